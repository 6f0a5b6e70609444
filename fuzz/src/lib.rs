//! What the fuzz targets build alike from a few fuzzed numbers.

use shoal_wire::{FailureKind, OpFailure, PeerId, StateDigest};

/// A collective's failure of one of the four kinds, concerning `peer`.
pub fn failure(kind: u8, peer: u8) -> OpFailure {
    let kinds = [FailureKind::PeerLost, FailureKind::Mismatch, FailureKind::Timeout, FailureKind::Misuse];
    OpFailure::new(kinds[usize::from(kind) % 4], PeerId(peer.into()), "fuzz")
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
