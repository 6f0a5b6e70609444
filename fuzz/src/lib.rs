//! What the fuzz targets build alike from a few fuzzed numbers.

use shoal_wire::{
    Api, Call, Called, Epoch, FailureKind, Mismatch, Misuse, OpFailure, OpHeader, PeerId, Reason, StateDigest,
};

/// A collective's failure of one of the four kinds, concerning `peer` (a usage error names the
/// calls, or not, as the wire allows both; a mismatch names the next peer's call of collective
/// `kind` of topology 1 against `peer`'s).
pub fn failure(kind: u8, peer: u8) -> OpFailure {
    let kinds = [FailureKind::PeerLost, FailureKind::Mismatch, FailureKind::Timeout, FailureKind::Misuse];
    match kinds[usize::from(kind) % 4] {
        FailureKind::Misuse if kind % 8 >= 4 => OpFailure::misuse(PeerId(peer.into()), misuse(peer, kind)),
        FailureKind::Mismatch => {
            let call = OpHeader {
                collective: 1,
                algorithm: 1,
                epoch: Epoch(1),
                derived: 0,
                seq: kind.into(),
                tag: 0,
                dtype: 9,
                op: 1,
                count: 10,
                root: 0,
                quantization: 0,
                block: 0,
            };
            let (ours, theirs) =
                ((PeerId(u32::from(peer) + 1), call), (PeerId(peer.into()), OpHeader { count: 11, ..call }));
            OpFailure::mismatch(Mismatch::new(ours, theirs))
        }
        kind => OpFailure::new(kind, PeerId(peer.into()), "fuzz"),
    }
}

/// Peer `ours`'s transfer with peer `theirs`, against `theirs`'s call `call` (a code; the same
/// peer twice names a vote against a collective).
pub fn misuse(ours: u8, theirs: u8) -> Misuse {
    apart(PeerId(ours.into()), PeerId(theirs.into()))
}

/// `waiter`'s transfer with `member`, against a call of `member`'s its id picks.
pub fn apart(waiter: PeerId, member: PeerId) -> Misuse {
    let apis = [Api::UpdateTopology, Api::PeersPending, Api::SyncSharedState, Api::AllReduce];
    let transfer = Call::Transfer { send: member.0 % 2 == 0, peer: member, tag: 3 };
    let call = Call::api(apis[member.0 as usize % 4]);
    Misuse::new(Called::new([waiter], transfer), Called::new([member], call))
}

/// Why a vote or sync ended: words, or the calls a misuse names (a vote abandoned with words
/// only is refused by the wire, and by the peer alike).
pub fn vote_abort(code: u8) -> Reason {
    match code % 3 {
        0 => Reason::text("fuzz"),
        _ => misuse(code, code.wrapping_add(1)).into(),
    }
}

/// Up to three tensors' digests for a sync vote: names, shapes and hashes that often agree
/// between voters (small numbers), sometimes not.
pub fn digests(tensors: u8, hash: u8) -> Vec<StateDigest> {
    (0..tensors % 4)
        .map(|i| StateDigest {
            name: format!("t{i}"),
            dtype: 1,
            shape: vec![u64::from(i)],
            hash: [hash.wrapping_add(i); 32],
            may_differ: hash % 3 == i,
        })
        .collect()
}
