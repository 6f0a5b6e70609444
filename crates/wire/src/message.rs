//! The messages of the protocol and their body encodings. `docs/wire.md` has the table.

use crate::codec::{Reader, Writer};
use crate::misuse::{Mismatch, Misuse, Reason};
use crate::report::PeerReport;
use crate::{SessionId, WireError, MAX_DIMS, MAX_MEMBERS, MAX_STATE_ENTRIES};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

/// A peer's identity within one run of the master, assigned at registration and never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerId(pub u32);

impl PeerId {
    /// Names no peer: the other end of a receive from any member ([`crate::Call::Transfer`],
    /// [`Message::P2pWaits`]). The master assigns every id below it.
    pub const ANY: PeerId = PeerId(u32::MAX);
}

/// A peer group: collectives run within one group; admission is run-wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GroupId(pub u32);

/// Numbers the topologies the master has issued. It only grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Epoch(pub u64);

impl std::fmt::Display for PeerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == PeerId::ANY {
            return f.write_str("any member");
        }
        write!(f, "peer#{}", self.0)
    }
}

/// One member of a topology: who it is, its group, and where peers dial it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The member.
    pub peer: PeerId,
    /// Its peer group.
    pub group: GroupId,
    /// The `host:port` other peers dial for data connections.
    pub addr: String,
    /// Its site, where `optimize_topology` measured it: members of a site have short round trips
    /// to each other (`docs/topology.md`). `None` for a member nobody measured.
    pub site: Option<u16>,
    /// Whether the master could open a connection to `addr` when the member joined: one that
    /// cannot be dialed (behind a NAT or a firewall) dials out instead (`docs/nat.md`).
    pub dialable: bool,
    /// The address the master saw the member's control connection come from (behind a NAT, the
    /// NAT's public one), if known: members that share one sit on one network and may reach
    /// each other there although nobody outside can.
    pub seen: Option<IpAddr>,
}

/// The largest all-reduces that run one-shot and two-shot in a topology, derived by the master
/// from measured links (`optimize_topology`); they replace the members' own settings there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AlgorithmLimits {
    /// One-shot up to this many bytes.
    pub oneshot_max: u64,
    /// Two-shot above `oneshot_max`, up to this.
    pub twoshot_max: u64,
    /// Whether a larger all-reduce runs hierarchically by the members' sites
    /// ([`Member::site`]): the cost model predicts it faster than the ring. Sites are sent
    /// wherever round trips cluster, for the small all-reduces' two-level schedule, whether or
    /// not grouping pays for bandwidth.
    pub hierarchical: bool,
}

/// The code of [`Member::site`]'s `None` on the wire.
const NO_SITE: u16 = u16::MAX;

/// What a peer measured of its link to another member (`optimize_topology`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measured {
    /// The member at the other end.
    pub peer: PeerId,
    /// The round trip, microseconds.
    pub rtt_us: u32,
    /// Bytes per second from the measuring peer to `peer`.
    pub bytes_per_s: u64,
}

/// Names one collective in every frame of its data: the receiver compares it with its own call,
/// so peers that called different collectives find out before any tensor byte is misread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpHeader {
    /// Which collective (a code of the collective crate).
    pub collective: u8,
    /// Which algorithm runs it (a code of the collective crate): peers that chose differently
    /// would read each other's chunks wrongly.
    pub algorithm: u8,
    /// The topology the sender runs it in.
    pub epoch: Epoch,
    /// The derived group it runs in (`docs/protocol.md`, "Derived groups"): 0 for the topology's
    /// whole group, else the name every member of a subset of it computed alike.
    pub derived: u64,
    /// The sender's count of collectives started in that group and topology.
    pub seq: u64,
    /// The application's tag.
    pub tag: u64,
    /// Element type code.
    pub dtype: u8,
    /// Reduction operator code.
    pub op: u8,
    /// Number of elements.
    pub count: u64,
    /// A broadcast's root rank (0 for other collectives).
    pub root: u32,
    /// The format its chunks travel in (a code of the collective crate; 0: as they are).
    pub quantization: u8,
    /// Elements per block of a block-wise quantization (else 0).
    pub block: u16,
}

impl OpHeader {
    pub(crate) fn encode(&self, w: &mut Writer) {
        w.u8(self.collective);
        w.u8(self.algorithm);
        w.u64(self.epoch.0);
        w.u64(self.derived);
        w.u64(self.seq);
        w.u64(self.tag);
        w.u8(self.dtype);
        w.u8(self.op);
        w.u64(self.count);
        w.u32(self.root);
        w.u8(self.quantization);
        w.u16(self.block);
    }

    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let (collective, algorithm) = (r.u8()?, r.u8()?);
        let (epoch, derived, seq, tag) = (Epoch(r.u64()?), r.u64()?, r.u64()?, r.u64()?);
        let (dtype, op, count, root) = (r.u8()?, r.u8()?, r.u64()?, r.u32()?);
        let (quantization, block) = (r.u8()?, r.u16()?);
        Ok(OpHeader { collective, algorithm, epoch, derived, seq, tag, dtype, op, count, root, quantization, block })
    }
}

/// In codes: the names are the collective crate's (the peer names them).
impl fmt::Display for OpHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "collective {}(count={}, dtype {}, op {}, root={}, quantization {}/{}, tag={}, algorithm {}, topology={}, \
             number={})",
            self.collective,
            self.count,
            self.dtype,
            self.op,
            self.root,
            self.quantization,
            self.block,
            self.tag,
            self.algorithm,
            self.epoch.0,
            self.seq
        )?;
        if self.derived != 0 {
            write!(f, " of derived group {:#x}", self.derived)?;
        }
        Ok(())
    }
}

/// Why a collective failed, as one peer saw it and as the master then tells every participant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpFailure {
    /// What kind of failure.
    pub kind: FailureKind,
    /// The peer it concerns: the one lost, or the one whose call differs.
    pub peer: PeerId,
    /// Why: the calls that cannot complete together (a [`FailureKind::Misuse`] may name them),
    /// or an account in words.
    pub reason: Reason,
}

/// The calls that are votes at the master, by wire code: a member of the voter's group running a
/// collective the voter never started must give it up ([`Message::VoteOpened`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Vote {
    /// `update_topology`.
    UpdateTopology = 1,
    /// `peers_pending`.
    PeersPending = 2,
    /// `sync_shared_state`.
    SyncSharedState = 3,
}

impl Vote {
    fn from_code(code: u8) -> Result<Self, WireError> {
        Ok(match code {
            1 => Vote::UpdateTopology,
            2 => Vote::PeersPending,
            3 => Vote::SyncSharedState,
            value => return Err(WireError::InvalidValue { field: "vote", value: value.into() }),
        })
    }

    /// The API call's name.
    pub fn call(self) -> &'static str {
        match self {
            Vote::UpdateTopology => "update_topology",
            Vote::PeersPending => "peers_pending",
            Vote::SyncSharedState => "sync_shared_state",
        }
    }
}

/// The kinds of [`OpFailure`], by wire code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// A participant died, froze, was cut off or left.
    PeerLost = 1,
    /// Participants called different collectives.
    Mismatch = 2,
    /// A participant's call ran out of time.
    Timeout = 3,
    /// A participant broke the data protocol (malformed bytes).
    Protocol = 4,
    /// The run changed under the collective (a new topology was issued).
    Superseded = 5,
    /// Members made different calls: one ran the collective while another voted to change the
    /// topology.
    Misuse = 6,
}

impl FailureKind {
    fn from_code(code: u8) -> Result<Self, WireError> {
        Ok(match code {
            1 => FailureKind::PeerLost,
            2 => FailureKind::Mismatch,
            3 => FailureKind::Timeout,
            4 => FailureKind::Protocol,
            5 => FailureKind::Superseded,
            6 => FailureKind::Misuse,
            value => return Err(WireError::InvalidValue { field: "failure kind", value: value.into() }),
        })
    }
}

impl OpFailure {
    /// A failure of `kind` concerning `peer`; `reason` is cut to fit a message. A misuse and a
    /// mismatch name their calls instead ([`OpFailure::misuse`], [`OpFailure::mismatch`]).
    pub fn new(kind: FailureKind, peer: PeerId, reason: impl Into<String>) -> Self {
        debug_assert!(kind != FailureKind::Mismatch, "a mismatch names both calls");
        OpFailure { kind, peer, reason: Reason::text(reason) }
    }

    /// The failure of a collective whose calls differ: it concerns the member whose frame did.
    pub fn mismatch(mismatch: Mismatch) -> Self {
        OpFailure { kind: FailureKind::Mismatch, peer: mismatch.theirs.0, reason: mismatch.into() }
    }

    /// The failure of `peer`'s collective, which can never complete with another call.
    pub fn misuse(peer: PeerId, misuse: Misuse) -> Self {
        OpFailure { kind: FailureKind::Misuse, peer, reason: misuse.into() }
    }

    fn encode(&self, w: &mut Writer) {
        w.u8(self.kind as u8);
        w.u32(self.peer.0);
        self.reason.encode(w);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let (kind, peer, reason) = (FailureKind::from_code(r.u8()?)?, PeerId(r.u32()?), Reason::decode(r)?);
        if reason.misuse().is_some() && kind != FailureKind::Misuse {
            return Err(WireError::InvalidValue { field: "failure kind of a misuse", value: kind as u64 });
        }
        if reason.mismatch().is_some_and(|m| m.theirs.0 != peer)
            || reason.mismatch().is_some() != (kind == FailureKind::Mismatch)
        {
            return Err(WireError::InvalidValue { field: "a mismatch's calls", value: kind as u64 });
        }
        Ok(OpFailure { kind, peer, reason })
    }
}

/// A vote's end: refused for now (`retry`), or abandoned, where the reason names the calls that
/// cannot complete together.
fn vote_abort(r: &mut Reader<'_>) -> Result<(bool, Reason), WireError> {
    let (retry, reason) = (r.bool("retry")?, Reason::decode(r)?);
    if !retry && reason.misuse().is_none() || reason.mismatch().is_some() {
        return Err(WireError::InvalidValue { field: "abandoned vote's calls", value: 0 });
    }
    Ok((retry, reason))
}

/// `s` cut to at most `max` bytes at a character boundary.
pub fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// One tensor of a peer's shared state, as it votes in a sync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateDigest {
    /// The tensor's name.
    pub name: String,
    /// Element type code.
    pub dtype: u8,
    /// Dimensions.
    pub shape: Vec<u64>,
    /// Content hash (`shoal_state::hash_tensor`).
    pub hash: [u8; 32],
    /// May differ between accepted peers (only newcomers receive it).
    pub may_differ: bool,
}

/// The master's instruction for one tensor of a sync, in the order of the peer's vote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanEntry {
    /// The hash the tensor must have afterwards.
    pub hash: [u8; 32],
    /// Peers to fetch it from; empty when the peer keeps its own.
    pub donors: Vec<PeerId>,
}

/// Every message of the protocol. The doc of each variant says who sends it to whom.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Message {
    /// Master → peer, first message on a control connection: a fresh nonce the peer's `Join`
    /// must prove it knows the run's secret with.
    Challenge {
        /// Random, never reused.
        nonce: [u8; 32],
    },
    /// Peer → master, the answer to `Challenge`: asks to join the run.
    Join {
        /// The group the peer will run collectives in.
        group: GroupId,
        /// Where other peers should dial this peer (`host:port`).
        data_addr: String,
        /// Keyed hash of the nonce under the run's key (zeros where the peer has no secret); the
        /// secret never crosses the wire, and the proof is worthless on another connection.
        proof: [u8; 32],
        /// Whether it will catch up with its group's state (`CatchUpStart` follows) before it
        /// awaits admission: until then it is not pending, and no vote admits it.
        catch_up: bool,
    },
    /// Peer → master, in place of `Join` on a new control connection: this peer, registered in
    /// `session`, lost its connection (the master restarted, say) and is back.
    Rejoin {
        /// Its id.
        peer: PeerId,
        /// The run it was registered in.
        session: SessionId,
        /// As `Join`'s: the keyed hash of this connection's nonce under the run's key.
        proof: [u8; 32],
    },
    /// Master → peer: the proof in `Join` is wrong, or missing where the run has a secret.
    AuthFailed {
        /// A human-readable reason.
        reason: String,
    },
    /// Either direction, on a control connection: I am alive.
    Heartbeat,
    /// Peer → master, in place of some heartbeats: its counters and what it runs now, for the
    /// master's metrics and status. Counts as a heartbeat.
    Report {
        /// The counters.
        report: PeerReport,
    },
    /// Peer → master: this accepted peer calls `update_topology`, or `optimize_topology` with
    /// what it measured.
    VoteUpdateTopology {
        /// How many collectives the peer started in the current topology: a member still running
        /// a collective with a number at least this knows the voter will never join it.
        collectives: u64,
        /// `optimize_topology`: the voter's link to every other member of the ring
        /// (`update_topology`: `None`). The master orders the next ring by them.
        measured: Option<Vec<Measured>>,
    },
    /// Peer → master: this peer holds every data connection `epoch` asks of it.
    TopologyReady {
        /// The topology the peer is ready in.
        epoch: Epoch,
    },
    /// Peer → master: this accepted peer calls `peers_pending`.
    VotePeersPending {
        /// Collectives the voter started in the committed topology (see [`Message::VoteOpened`]).
        collectives: u64,
    },
    /// Peer → master: this peer leaves the run.
    Leave,
    /// Peer → master: this peer could not open the data connections `epoch` asks to `peer`.
    PeerUnreachable {
        /// The topology being established.
        epoch: Epoch,
        /// The peer that could not be reached.
        peer: PeerId,
    },
    /// Peer → master: this peer finished its part of collective `seq` of `epoch`: it holds the
    /// complete result.
    OpDone {
        /// The topology the collective runs in.
        epoch: Epoch,
        /// The derived group it runs in ([`OpHeader::derived`]; 0: the topology's whole group).
        derived: u64,
        /// The collective's number within its group and epoch.
        seq: u64,
        /// A derived group's members, by their rank there (empty for the whole group, or once the
        /// master knows the collective): the participants whose reports decide it.
        members: Vec<PeerId>,
        /// The peer already learned from the other participants that all of them finished, and
        /// returned success (no answer wanted). Otherwise it awaits the master's verdict.
        decided: bool,
    },
    /// Peer → master: collective `seq` of `epoch` failed here; abort it everywhere.
    OpFailed {
        /// The topology the collective runs in.
        epoch: Epoch,
        /// The derived group it runs in ([`OpHeader::derived`]; 0: the topology's whole group).
        derived: u64,
        /// The collective's number within its group and epoch.
        seq: u64,
        /// A derived group's members, by their rank there (empty for the whole group, or once the
        /// master knows the collective): the participants whose reports decide it.
        members: Vec<PeerId>,
        /// What went wrong.
        failure: OpFailure,
    },
    /// Peer → master: this accepted peer calls `sync_shared_state`.
    SyncVote {
        /// The revision the peer's state is at.
        revision: u64,
        /// 1 enforce_popular, 2 send_only, 3 receive_only.
        strategy: u8,
        /// Accept a state that does not match the one the run last agreed on.
        override_resume: bool,
        /// The peer's tensors, sorted by name.
        entries: Vec<StateDigest>,
        /// Collectives the voter started in the committed topology (see [`Message::VoteOpened`]).
        collectives: u64,
    },
    /// Peer → master: this peer holds every tensor of sync `round` as planned, verified.
    SyncDone {
        /// The sync.
        round: u64,
    },
    /// Peer → master: this peer cannot complete sync `round` (every donor of a tensor failed,
    /// or what arrived does not hash as planned).
    SyncFailed {
        /// The sync.
        round: u64,
        /// Why.
        reason: String,
    },
    /// Peer → master: this registered peer fetches its group's shared state in the background
    /// before it is admitted (`docs/state.md`, "Catching up"); until it reports
    /// [`Message::CatchUpEnd`] the accepted peers' `peers_pending` does not count it.
    CatchUpStart {
        /// Its tensors, sorted by name (their hashes are not used).
        entries: Vec<StateDigest>,
    },
    /// Peer → master: how far its catch-up is, for the run's status.
    CatchUpProgress {
        /// Bytes fetched and verified.
        done: u64,
        /// Bytes to fetch.
        total: u64,
        /// Expected milliseconds left at the rate so far.
        eta_ms: u64,
    },
    /// Peer → master: its catch-up ended. With `fetched` it holds the state of `revision`,
    /// verified; without, it fetched nothing and the sync after its admission repairs it. Either
    /// way it awaits admission now.
    CatchUpEnd {
        /// Whether it holds the state it was sent to fetch.
        fetched: bool,
        /// That state's revision.
        revision: u64,
    },
    /// Peer → master: this accepted peer keeps a copy of the state sync `round` ended with, for
    /// newcomers to fetch (`held`), or could not (the copy would exceed its memory bound).
    SnapshotHeld {
        /// The sync.
        round: u64,
        /// Whether it holds the copy.
        held: bool,
    },
    /// Peer → master, then master → the other end: the sender's call waits on a tagged transfer
    /// with member `peer` that found nothing to match it (the master sees no transfer itself,
    /// and relays this with `peer` naming the waiter). The other end, if its own call can never
    /// let that transfer complete, answers [`Message::P2pApart`] (`docs/protocol.md`, "No call
    /// waits for a call that will never come").
    ///
    /// A receive from any member (`any`) names [`PeerId::ANY`]: the master asks every other
    /// member of the group, and answers the waiter once each has answered `P2pApart`; their calls
    /// go on (another member may still send).
    P2pWaits {
        /// The other end (relayed: the waiter); [`PeerId::ANY`] from a receive from any member.
        peer: PeerId,
        /// A receive from any member waits: the other end's call ends with no verdict of its own.
        any: bool,
        /// The waiter sends; otherwise it receives.
        send: bool,
        /// The transfer's tag.
        tag: u64,
        /// A waiting receive: how many of the other end's sends to it it has seen offered; a
        /// waiting send: its number among the waiter's sends to the other end.
        seen: u64,
        /// The waiter's committed topology.
        epoch: Epoch,
        /// The waiter's count of collectives started in `epoch`.
        collectives: u64,
    },
    /// Peer → master, then master → the other end: the wait announced with [`Message::P2pWaits`]
    /// is over.
    P2pResumed {
        /// The other end (relayed: the waiter).
        peer: PeerId,
    },
    /// Peer → master, then master → the waiter: the sender is in a call that can never let the
    /// transfer `peer` waits on complete; the waiter's call ends with `reason`, as does the
    /// sender's (a vote of its is abandoned).
    P2pApart {
        /// The waiter (relayed: the member whose call it met).
        peer: PeerId,
        /// Both calls, named with their peers.
        misuse: Misuse,
    },
    /// Peer → master, then master → the other end: the links of the sender's transfer with member
    /// `peer` failed while its outcome rested on that end's word (`Received`, `Confirmed`): what
    /// became of the transfer there? The other end answers [`Message::P2pDecided`]
    /// (`docs/protocol.md`, "A transfer's outcome when its links fail").
    P2pOutcome {
        /// The other end (relayed: the asker).
        peer: PeerId,
        /// The topology the transfer ran in.
        epoch: Epoch,
        /// The sender's number of the transfer among its transfers to the receiver.
        number: u64,
        /// The asker sent; otherwise it received.
        send: bool,
    },
    /// Peer → master, then master → the asker: the answer to [`Message::P2pOutcome`], whose fields
    /// it repeats. `done`: the transfer ended at the answering end and holds (the asker's ends as
    /// it); otherwise it failed there, or it never will end there (the asker's fails).
    P2pDecided {
        /// The asker (relayed: the member that answers).
        peer: PeerId,
        /// As asked.
        epoch: Epoch,
        /// As asked.
        number: u64,
        /// As asked: the asker sent.
        send: bool,
        /// Whether the transfer succeeded at the answering end.
        done: bool,
    },
    /// Peer → master: this member called collective `seq` of `epoch` (of the whole group) with a
    /// deadline: leave out the members not called `deadline_ms` after at least `min` had (0: more
    /// than half the group's members), never those of `needs`. The first member's figures stand
    /// (`docs/protocol.md`, "Collectives with a deadline").
    Gather {
        /// The committed topology.
        epoch: Epoch,
        /// The collective's number in it.
        seq: u64,
        /// Milliseconds after the minimum had called.
        deadline_ms: u64,
        /// The fewest members it runs with.
        min: u32,
        /// The members it cannot run without (a broadcast's root), waited for like any member
        /// of a collective without a deadline.
        needs: Vec<PeerId>,
    },
    /// Master → peer: collective `seq` of `epoch`, called with a deadline, runs among `included`
    /// alone (in ring order); a member left out ends its call of it with nothing done.
    Gathered {
        /// The topology.
        epoch: Epoch,
        /// The collective's number in it.
        seq: u64,
        /// Its participants, in ring order.
        included: Vec<PeerId>,
        /// Whether peers waited to join when the master decided: what `peers_pending` would
        /// have answered, the same for every member without a vote.
        pending: bool,
    },
    /// Master → peer: you are registered as `peer` in run `session`.
    Registered {
        /// The peer's id.
        peer: PeerId,
        /// The run's session id; every later frame carries it.
        session: SessionId,
        /// How often the master wants a sign of life, in milliseconds.
        heartbeat_ms: u32,
        /// The run's key for data connections: every `PeerHello` and `FetchRequest` carries a
        /// keyed hash under it, so a stranger who reaches a peer's data port cannot speak there.
        data_key: [u8; 32],
    },
    /// Master → peer: the members of the peer's group, in ring order; open your data connections.
    Topology {
        /// This topology's number.
        epoch: Epoch,
        /// Every member of the group, in ring order. Shared: the master sends one list to every
        /// member, and copying it for each cost a 1,000-member group a million copies.
        members: Arc<[Member]>,
        /// Peers of the whole run (every group) accepted or admitted by this topology, when it
        /// was issued: at least `members`' count.
        world: u32,
        /// Where the small-message all-reduces stop, if the master derived it from measured links.
        limits: Option<AlgorithmLimits>,
    },
    /// Master → peer: every member of `epoch` is connected; the topology is in force.
    TopologyCommitted {
        /// The committed topology.
        epoch: Epoch,
    },
    /// Master → peer: the outcome of a `peers_pending` vote, the same for every voter.
    PeersPendingResult {
        /// Whether registered peers await admission.
        pending: bool,
    },
    /// Master → peer: `peer` left the run (died, fell silent, left or was expelled). Operations
    /// that involve it must end.
    PeerRemoved {
        /// The peer that left.
        peer: PeerId,
    },
    /// Master → peer: you are no longer a member of the run, and why.
    Kicked {
        /// A human-readable reason.
        reason: String,
    },
    /// Master → peer: every participant finished collective `seq` of `epoch`; it succeeded.
    OpCommitted {
        /// The topology the collective ran in.
        epoch: Epoch,
        /// The derived group it runs in ([`OpHeader::derived`]; 0: the topology's whole group).
        derived: u64,
        /// The collective's number within its group and epoch.
        seq: u64,
    },
    /// Master → peer: collective `seq` of `epoch` failed; every participant restores its buffers.
    OpAborted {
        /// The topology the collective ran in.
        epoch: Epoch,
        /// The derived group it runs in ([`OpHeader::derived`]; 0: the topology's whole group).
        derived: u64,
        /// The collective's number within its group and epoch.
        seq: u64,
        /// Why.
        failure: OpFailure,
    },
    /// Master → peer: a participant asked for the verdict on collective `seq` of `epoch`; did
    /// you commit it on your own? A peer that did answers `OpDone { decided: true }` at once;
    /// one still running it answers when it has finished.
    OpQuery {
        /// The topology the collective runs in.
        epoch: Epoch,
        /// The derived group it runs in ([`OpHeader::derived`]; 0: the topology's whole group).
        derived: u64,
        /// The collective's number within its group and epoch.
        seq: u64,
    },
    /// Master → peer: `voter` made the call `vote` after starting `collectives` collectives of
    /// topology `epoch`. A member of its group running a later one must abort it: it cannot
    /// complete, since the voter waits in the vote.
    VoteOpened {
        /// The call the voter is in.
        vote: Vote,
        /// The committed topology.
        epoch: Epoch,
        /// Who voted.
        voter: PeerId,
        /// The voter's count of collectives started in `epoch`.
        collectives: u64,
    },
    /// Master → peer: the `peers_pending` vote was abandoned, because the members made calls that
    /// cannot complete together (voters' calls fail with `reason`, which names them), or not
    /// counted because a topology was issued (`retry`: the voter joins it and votes again).
    PeersPendingAborted {
        /// The vote was refused for now, not abandoned: vote again once the topology is in force.
        retry: bool,
        /// Why: without `retry`, always the calls that cannot complete together.
        reason: Reason,
    },
    /// Master → peer: the `update_topology` vote was abandoned, because a member ran a collective
    /// instead (voters' calls fail with `reason`, which names the calls), or this vote was not
    /// counted because a topology was being connected (`retry`: the voter joins that topology
    /// and votes again).
    TopologyVoteAborted {
        /// The vote was refused for now, not abandoned: vote again once the topology is in force.
        retry: bool,
        /// Why: without `retry`, always the calls that cannot complete together.
        reason: Reason,
    },
    /// Master → peer: the plan of sync `round`, one entry per tensor of the peer's vote.
    SyncPlan {
        /// The sync.
        round: u64,
        /// The revision every participant is at once it completes.
        revision: u64,
        /// Per tensor: the hash to hold and whom to fetch it from.
        entries: Vec<PlanEntry>,
    },
    /// Master → peer (accepted, before `SyncComplete`): keep a copy of the state sync `round` ends
    /// with, for newcomers to fetch while you go on; `round` 0: drop the copy you keep.
    Snapshot {
        /// The sync; 0 to drop the copy.
        round: u64,
    },
    /// Master → peer (catching up): fetch your group's state from the donors' copies of sync
    /// `round`, at `revision`, one entry per tensor of your `CatchUpStart` (no donors: not
    /// fetched, such as a tensor allowed to differ). A non-empty `reason` refuses the catch-up.
    CatchUpPlan {
        /// The sync whose state the donors keep (0 if there is nothing to fetch).
        round: u64,
        /// Its revision.
        revision: u64,
        /// Per tensor: the hash it must have and whom to fetch it from.
        entries: Vec<PlanEntry>,
        /// The donors, with the addresses to dial.
        donors: Vec<Member>,
        /// Why the catch-up is refused; empty if it is not.
        reason: String,
    },
    /// Master → peer: every participant of sync `round` holds the elected state.
    SyncComplete {
        /// The sync.
        round: u64,
    },
    /// Master → peer: the sync ended without effect.
    SyncAborted {
        /// The sync (0 if it never started).
        round: u64,
        /// Whether calling again can succeed (a participant was lost) or the calls are wrong.
        retryable: bool,
        /// Why: the calls that cannot complete together, or an account in words.
        reason: Reason,
    },
    /// Peer → peer, on a connection dialed to a donor: send `len` bytes of tensor `index` of
    /// sync `round` from `offset`. The donor answers with exactly those bytes.
    FetchRequest {
        /// The fetching peer.
        from: PeerId,
        /// The donor.
        to: PeerId,
        /// The sync.
        round: u64,
        /// The tensor, by position in the sorted vote.
        index: u32,
        /// First byte.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Keyed hash of the fields above and the session under the run's data key.
        mac: [u8; 32],
    },
    /// Peer → peer, first message on a data connection: who dials, whom, for which topology and
    /// stream.
    PeerHello {
        /// The dialing peer.
        from: PeerId,
        /// The peer it means to reach.
        to: PeerId,
        /// The topology the pool is for: every topology has pools of its own.
        epoch: Epoch,
        /// Index of this stream in the pair's pool.
        stream: u16,
        /// Size of the pool the dialer opens to this peer.
        streams: u16,
        /// The dialer opens the pool that carries `to`'s data to it, not its own to `to`: it
        /// cannot be dialed, and `to` can (a reverse dial, `docs/nat.md`).
        reverse: bool,
        /// Keyed hash of the fields above and the session under the run's data key.
        mac: [u8; 32],
    },
}

/// Kind codes. Never renumber; retire a code by commenting it out and leaving it reserved.
mod kind {
    pub const JOIN: u16 = 1;
    pub const HEARTBEAT: u16 = 2;
    pub const VOTE_UPDATE_TOPOLOGY: u16 = 3;
    pub const TOPOLOGY_READY: u16 = 4;
    pub const VOTE_PEERS_PENDING: u16 = 5;
    pub const LEAVE: u16 = 6;
    pub const PEER_UNREACHABLE: u16 = 7;
    pub const OP_DONE: u16 = 8;
    pub const OP_FAILED: u16 = 9;
    pub const SYNC_VOTE: u16 = 10;
    pub const SYNC_DONE: u16 = 11;
    pub const SYNC_FAILED: u16 = 12;
    pub const REPORT: u16 = 13;
    pub const REJOIN: u16 = 14;
    pub const CATCH_UP_START: u16 = 15;
    pub const CATCH_UP_PROGRESS: u16 = 16;
    pub const CATCH_UP_END: u16 = 17;
    pub const SNAPSHOT_HELD: u16 = 18;
    pub const P2P_WAITS: u16 = 19;
    pub const P2P_RESUMED: u16 = 20;
    pub const P2P_APART: u16 = 21;
    pub const GATHER: u16 = 22;
    pub const P2P_OUTCOME: u16 = 23;
    pub const P2P_DECIDED: u16 = 24;
    pub const REGISTERED: u16 = 64;
    pub const TOPOLOGY: u16 = 65;
    pub const TOPOLOGY_COMMITTED: u16 = 66;
    pub const PEERS_PENDING_RESULT: u16 = 67;
    pub const KICKED: u16 = 68;
    pub const PEER_REMOVED: u16 = 69;
    pub const OP_COMMITTED: u16 = 70;
    pub const OP_ABORTED: u16 = 71;
    pub const OP_QUERY: u16 = 72;
    pub const VOTE_OPENED: u16 = 73;
    pub const TOPOLOGY_VOTE_ABORTED: u16 = 74;
    pub const SYNC_PLAN: u16 = 75;
    pub const SYNC_COMPLETE: u16 = 76;
    pub const SYNC_ABORTED: u16 = 77;
    pub const PEERS_PENDING_ABORTED: u16 = 78;
    pub const CHALLENGE: u16 = 79;
    pub const AUTH_FAILED: u16 = 80;
    pub const SNAPSHOT: u16 = 81;
    pub const CATCH_UP_PLAN: u16 = 82;
    pub const GATHERED: u16 = 83;
    pub const PEER_HELLO: u16 = 128;
    // 129 was `Op`: a collective's header on a stream of its own, before data frames.
    pub const FETCH_REQUEST: u16 = 130;
}

impl Message {
    /// The kind code written in the frame header.
    pub fn kind(&self) -> u16 {
        match self {
            Message::Join { .. } => kind::JOIN,
            Message::Challenge { .. } => kind::CHALLENGE,
            Message::AuthFailed { .. } => kind::AUTH_FAILED,
            Message::Heartbeat => kind::HEARTBEAT,
            Message::Report { .. } => kind::REPORT,
            Message::Rejoin { .. } => kind::REJOIN,
            Message::VoteUpdateTopology { .. } => kind::VOTE_UPDATE_TOPOLOGY,
            Message::TopologyReady { .. } => kind::TOPOLOGY_READY,
            Message::VotePeersPending { .. } => kind::VOTE_PEERS_PENDING,
            Message::Leave => kind::LEAVE,
            Message::PeerUnreachable { .. } => kind::PEER_UNREACHABLE,
            Message::OpDone { .. } => kind::OP_DONE,
            Message::OpFailed { .. } => kind::OP_FAILED,
            Message::SyncVote { .. } => kind::SYNC_VOTE,
            Message::SyncDone { .. } => kind::SYNC_DONE,
            Message::SyncFailed { .. } => kind::SYNC_FAILED,
            Message::SyncPlan { .. } => kind::SYNC_PLAN,
            Message::SyncComplete { .. } => kind::SYNC_COMPLETE,
            Message::SyncAborted { .. } => kind::SYNC_ABORTED,
            Message::FetchRequest { .. } => kind::FETCH_REQUEST,
            Message::CatchUpStart { .. } => kind::CATCH_UP_START,
            Message::CatchUpProgress { .. } => kind::CATCH_UP_PROGRESS,
            Message::CatchUpEnd { .. } => kind::CATCH_UP_END,
            Message::SnapshotHeld { .. } => kind::SNAPSHOT_HELD,
            Message::P2pWaits { .. } => kind::P2P_WAITS,
            Message::P2pResumed { .. } => kind::P2P_RESUMED,
            Message::P2pApart { .. } => kind::P2P_APART,
            Message::P2pOutcome { .. } => kind::P2P_OUTCOME,
            Message::P2pDecided { .. } => kind::P2P_DECIDED,
            Message::Gather { .. } => kind::GATHER,
            Message::Gathered { .. } => kind::GATHERED,
            Message::Snapshot { .. } => kind::SNAPSHOT,
            Message::CatchUpPlan { .. } => kind::CATCH_UP_PLAN,
            Message::Registered { .. } => kind::REGISTERED,
            Message::Topology { .. } => kind::TOPOLOGY,
            Message::TopologyCommitted { .. } => kind::TOPOLOGY_COMMITTED,
            Message::PeersPendingResult { .. } => kind::PEERS_PENDING_RESULT,
            Message::Kicked { .. } => kind::KICKED,
            Message::PeerRemoved { .. } => kind::PEER_REMOVED,
            Message::OpCommitted { .. } => kind::OP_COMMITTED,
            Message::OpAborted { .. } => kind::OP_ABORTED,
            Message::OpQuery { .. } => kind::OP_QUERY,
            Message::VoteOpened { .. } => kind::VOTE_OPENED,
            Message::PeersPendingAborted { .. } => kind::PEERS_PENDING_ABORTED,
            Message::TopologyVoteAborted { .. } => kind::TOPOLOGY_VOTE_ABORTED,
            Message::PeerHello { .. } => kind::PEER_HELLO,
        }
    }

    /// A short name for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Join { .. } => "Join",
            Message::Challenge { .. } => "Challenge",
            Message::AuthFailed { .. } => "AuthFailed",
            Message::Heartbeat => "Heartbeat",
            Message::Report { .. } => "Report",
            Message::Rejoin { .. } => "Rejoin",
            Message::VoteUpdateTopology { .. } => "VoteUpdateTopology",
            Message::TopologyReady { .. } => "TopologyReady",
            Message::VotePeersPending { .. } => "VotePeersPending",
            Message::Leave => "Leave",
            Message::PeerUnreachable { .. } => "PeerUnreachable",
            Message::OpDone { .. } => "OpDone",
            Message::OpFailed { .. } => "OpFailed",
            Message::SyncVote { .. } => "SyncVote",
            Message::SyncDone { .. } => "SyncDone",
            Message::SyncFailed { .. } => "SyncFailed",
            Message::SyncPlan { .. } => "SyncPlan",
            Message::SyncComplete { .. } => "SyncComplete",
            Message::SyncAborted { .. } => "SyncAborted",
            Message::FetchRequest { .. } => "FetchRequest",
            Message::Registered { .. } => "Registered",
            Message::Topology { .. } => "Topology",
            Message::TopologyCommitted { .. } => "TopologyCommitted",
            Message::PeersPendingResult { .. } => "PeersPendingResult",
            Message::Kicked { .. } => "Kicked",
            Message::PeerRemoved { .. } => "PeerRemoved",
            Message::OpCommitted { .. } => "OpCommitted",
            Message::OpAborted { .. } => "OpAborted",
            Message::OpQuery { .. } => "OpQuery",
            Message::VoteOpened { .. } => "VoteOpened",
            Message::PeersPendingAborted { .. } => "PeersPendingAborted",
            Message::TopologyVoteAborted { .. } => "TopologyVoteAborted",
            Message::PeerHello { .. } => "PeerHello",
            Message::CatchUpStart { .. } => "CatchUpStart",
            Message::CatchUpProgress { .. } => "CatchUpProgress",
            Message::CatchUpEnd { .. } => "CatchUpEnd",
            Message::SnapshotHeld { .. } => "SnapshotHeld",
            Message::P2pWaits { .. } => "P2pWaits",
            Message::P2pResumed { .. } => "P2pResumed",
            Message::P2pApart { .. } => "P2pApart",
            Message::P2pOutcome { .. } => "P2pOutcome",
            Message::P2pDecided { .. } => "P2pDecided",
            Message::Gather { .. } => "Gather",
            Message::Gathered { .. } => "Gathered",
            Message::Snapshot { .. } => "Snapshot",
            Message::CatchUpPlan { .. } => "CatchUpPlan",
        }
    }

    /// Appends the body (everything after the frame header) to `w`.
    pub fn encode_body(&self, w: &mut Writer) {
        match self {
            Message::Join { group, data_addr, proof, catch_up } => {
                w.u32(group.0);
                w.str(data_addr);
                w.bytes(proof);
                w.bool(*catch_up);
            }
            Message::Challenge { nonce } => w.bytes(nonce),
            Message::AuthFailed { reason } => w.str(reason),
            Message::VoteUpdateTopology { collectives, measured } => {
                w.u64(*collectives);
                w.bool(measured.is_some());
                let measured = measured.as_deref().unwrap_or_default();
                assert!(measured.len() <= MAX_MEMBERS, "measurements exceed MAX_MEMBERS: a bug");
                w.u32(measured.len() as u32);
                for m in measured {
                    w.u32(m.peer.0);
                    w.u32(m.rtt_us);
                    w.u64(m.bytes_per_s);
                }
            }
            Message::VoteOpened { vote, epoch, voter, collectives } => {
                w.u8(*vote as u8);
                w.u64(epoch.0);
                w.u32(voter.0);
                w.u64(*collectives);
            }
            Message::TopologyVoteAborted { retry, reason } | Message::PeersPendingAborted { retry, reason } => {
                w.bool(*retry);
                reason.encode(w);
            }
            Message::SyncVote { revision, strategy, override_resume, entries, collectives } => {
                assert!(entries.len() <= MAX_STATE_ENTRIES, "state exceeds MAX_STATE_ENTRIES: a bug");
                w.u64(*collectives);
                w.u64(*revision);
                w.u8(*strategy);
                w.bool(*override_resume);
                encode_digests(w, entries);
            }
            Message::CatchUpStart { entries } => encode_digests(w, entries),
            Message::CatchUpProgress { done, total, eta_ms } => {
                w.u64(*done);
                w.u64(*total);
                w.u64(*eta_ms);
            }
            Message::CatchUpEnd { fetched, revision } => {
                w.bool(*fetched);
                w.u64(*revision);
            }
            Message::SnapshotHeld { round, held } => {
                w.u64(*round);
                w.bool(*held);
            }
            Message::P2pWaits { peer, any, send, tag, seen, epoch, collectives } => {
                w.u32(peer.0);
                w.bool(*any);
                w.bool(*send);
                w.u64(*tag);
                w.u64(*seen);
                w.u64(epoch.0);
                w.u64(*collectives);
            }
            Message::P2pResumed { peer } => w.u32(peer.0),
            Message::P2pApart { peer, misuse } => {
                w.u32(peer.0);
                misuse.encode(w);
            }
            Message::P2pOutcome { peer, epoch, number, send } => {
                w.u32(peer.0);
                w.u64(epoch.0);
                w.u64(*number);
                w.bool(*send);
            }
            Message::P2pDecided { peer, epoch, number, send, done } => {
                w.u32(peer.0);
                w.u64(epoch.0);
                w.u64(*number);
                w.bool(*send);
                w.bool(*done);
            }
            Message::Snapshot { round } => w.u64(*round),
            Message::CatchUpPlan { round, revision, entries, donors, reason } => {
                w.u64(*round);
                w.u64(*revision);
                encode_plan(w, entries);
                encode_members(w, donors);
                w.str(reason);
            }
            Message::SyncDone { round } | Message::SyncComplete { round } => w.u64(*round),
            Message::SyncFailed { round, reason } => {
                w.u64(*round);
                w.str(reason);
            }
            Message::SyncPlan { round, revision, entries } => {
                w.u64(*round);
                w.u64(*revision);
                encode_plan(w, entries);
            }
            Message::SyncAborted { round, retryable, reason } => {
                w.u64(*round);
                w.bool(*retryable);
                reason.encode(w);
            }
            Message::FetchRequest { from, to, round, index, offset, len, mac } => {
                w.u32(from.0);
                w.u32(to.0);
                w.u64(*round);
                w.u32(*index);
                w.u64(*offset);
                w.u64(*len);
                w.bytes(mac);
            }
            Message::Heartbeat | Message::Leave => {}
            Message::Report { report } => report.encode(w),
            Message::Rejoin { peer, session, proof } => {
                w.u32(peer.0);
                w.u64(session.0);
                w.bytes(proof);
            }
            Message::VotePeersPending { collectives } => w.u64(*collectives),
            Message::TopologyReady { epoch } | Message::TopologyCommitted { epoch } => w.u64(epoch.0),
            Message::PeerUnreachable { epoch, peer } => {
                w.u64(epoch.0);
                w.u32(peer.0);
            }
            Message::Registered { peer, session, heartbeat_ms, data_key } => {
                w.u32(peer.0);
                w.u64(session.0);
                w.u32(*heartbeat_ms);
                w.bytes(data_key);
            }
            Message::PeerRemoved { peer } => w.u32(peer.0),
            Message::OpDone { epoch, derived, seq, members, decided } => {
                encode_op(w, *epoch, *derived, *seq);
                encode_peers(w, members);
                w.bool(*decided);
            }
            Message::OpCommitted { epoch, derived, seq } | Message::OpQuery { epoch, derived, seq } => {
                encode_op(w, *epoch, *derived, *seq);
            }
            Message::Gather { epoch, seq, deadline_ms, min, needs } => {
                w.u64(epoch.0);
                w.u64(*seq);
                w.u64(*deadline_ms);
                w.u32(*min);
                encode_peers(w, needs);
            }
            Message::Gathered { epoch, seq, included, pending } => {
                w.u64(epoch.0);
                w.u64(*seq);
                encode_peers(w, included);
                w.bool(*pending);
            }
            Message::OpFailed { epoch, derived, seq, members, failure } => {
                encode_op(w, *epoch, *derived, *seq);
                encode_peers(w, members);
                failure.encode(w);
            }
            Message::OpAborted { epoch, derived, seq, failure } => {
                encode_op(w, *epoch, *derived, *seq);
                failure.encode(w);
            }
            Message::Topology { epoch, members, world, limits } => {
                w.u64(epoch.0);
                encode_members(w, members);
                w.u32(*world);
                w.bool(limits.is_some());
                let l = limits.unwrap_or(AlgorithmLimits { oneshot_max: 0, twoshot_max: 0, hierarchical: false });
                w.u64(l.oneshot_max);
                w.u64(l.twoshot_max);
                w.bool(l.hierarchical);
            }
            Message::PeersPendingResult { pending } => w.bool(*pending),
            Message::Kicked { reason } => w.str(reason),
            Message::PeerHello { from, to, epoch, stream, streams, reverse, mac } => {
                w.u32(from.0);
                w.u32(to.0);
                w.u64(epoch.0);
                w.u16(*stream);
                w.u16(*streams);
                w.bool(*reverse);
                w.bytes(mac);
            }
        }
    }

    /// Decodes a body of the given kind. Never panics; checks every length before allocating.
    ///
    /// # Errors
    /// [`WireError::UnknownKind`] for a kind this version does not know, or whatever is wrong
    /// with the body.
    pub fn decode_body(kind: u16, body: &[u8]) -> Result<Message, WireError> {
        let mut r = Reader::new(body);
        let message = match kind {
            kind::JOIN => Message::Join {
                group: GroupId(r.u32()?),
                data_addr: r.str()?,
                proof: r.hash()?,
                catch_up: r.bool("catch_up")?,
            },
            kind::CHALLENGE => Message::Challenge { nonce: r.hash()? },
            kind::AUTH_FAILED => Message::AuthFailed { reason: r.str()? },
            kind::HEARTBEAT => Message::Heartbeat,
            kind::REPORT => Message::Report { report: PeerReport::decode(&mut r)? },
            kind::REJOIN => Message::Rejoin { peer: PeerId(r.u32()?), session: SessionId(r.u64()?), proof: r.hash()? },
            kind::VOTE_UPDATE_TOPOLOGY => {
                let (collectives, optimize) = (r.u64()?, r.bool("optimize")?);
                let count = r.count(MAX_MEMBERS, 4 + 4 + 8)?;
                let mut measured = Vec::with_capacity(count);
                for _ in 0..count {
                    measured.push(Measured { peer: PeerId(r.u32()?), rtt_us: r.u32()?, bytes_per_s: r.u64()? });
                }
                if !optimize && count > 0 {
                    return Err(WireError::InvalidValue {
                        field: "measurements of update_topology",
                        value: count as u64,
                    });
                }
                Message::VoteUpdateTopology { collectives, measured: optimize.then_some(measured) }
            }
            kind::VOTE_OPENED => Message::VoteOpened {
                vote: Vote::from_code(r.u8()?)?,
                epoch: Epoch(r.u64()?),
                voter: PeerId(r.u32()?),
                collectives: r.u64()?,
            },
            kind::TOPOLOGY_VOTE_ABORTED => {
                let (retry, reason) = vote_abort(&mut r)?;
                Message::TopologyVoteAborted { retry, reason }
            }
            kind::SYNC_VOTE => {
                let collectives = r.u64()?;
                let (revision, strategy, override_resume) = (r.u64()?, r.u8()?, r.bool("override_resume")?);
                let entries = decode_digests(&mut r)?;
                Message::SyncVote { revision, strategy, override_resume, entries, collectives }
            }
            kind::CATCH_UP_START => Message::CatchUpStart { entries: decode_digests(&mut r)? },
            kind::CATCH_UP_PROGRESS => Message::CatchUpProgress { done: r.u64()?, total: r.u64()?, eta_ms: r.u64()? },
            kind::CATCH_UP_END => Message::CatchUpEnd { fetched: r.bool("fetched")?, revision: r.u64()? },
            kind::SNAPSHOT_HELD => Message::SnapshotHeld { round: r.u64()?, held: r.bool("held")? },
            kind::P2P_WAITS => Message::P2pWaits {
                peer: PeerId(r.u32()?),
                any: r.bool("any")?,
                send: r.bool("send")?,
                tag: r.u64()?,
                seen: r.u64()?,
                epoch: Epoch(r.u64()?),
                collectives: r.u64()?,
            },
            kind::P2P_RESUMED => Message::P2pResumed { peer: PeerId(r.u32()?) },
            kind::P2P_APART => Message::P2pApart { peer: PeerId(r.u32()?), misuse: Misuse::decode(&mut r)? },
            kind::P2P_OUTCOME => Message::P2pOutcome {
                peer: PeerId(r.u32()?),
                epoch: Epoch(r.u64()?),
                number: r.u64()?,
                send: r.bool("send")?,
            },
            kind::P2P_DECIDED => Message::P2pDecided {
                peer: PeerId(r.u32()?),
                epoch: Epoch(r.u64()?),
                number: r.u64()?,
                send: r.bool("send")?,
                done: r.bool("done")?,
            },
            kind::SNAPSHOT => Message::Snapshot { round: r.u64()? },
            kind::CATCH_UP_PLAN => Message::CatchUpPlan {
                round: r.u64()?,
                revision: r.u64()?,
                entries: decode_plan(&mut r)?,
                donors: decode_members(&mut r)?,
                reason: r.str()?,
            },
            kind::SYNC_DONE => Message::SyncDone { round: r.u64()? },
            kind::SYNC_COMPLETE => Message::SyncComplete { round: r.u64()? },
            kind::SYNC_FAILED => Message::SyncFailed { round: r.u64()?, reason: r.str()? },
            kind::SYNC_PLAN => {
                let (round, revision) = (r.u64()?, r.u64()?);
                Message::SyncPlan { round, revision, entries: decode_plan(&mut r)? }
            }
            kind::SYNC_ABORTED => {
                let (round, retryable, reason) = (r.u64()?, r.bool("retryable")?, Reason::decode(&mut r)?);
                if reason.mismatch().is_some() {
                    return Err(WireError::InvalidValue { field: "a sync's end", value: 2 });
                }
                Message::SyncAborted { round, retryable, reason }
            }
            kind::FETCH_REQUEST => Message::FetchRequest {
                from: PeerId(r.u32()?),
                to: PeerId(r.u32()?),
                round: r.u64()?,
                index: r.u32()?,
                offset: r.u64()?,
                len: r.u64()?,
                mac: r.hash()?,
            },
            kind::TOPOLOGY_READY => Message::TopologyReady { epoch: Epoch(r.u64()?) },
            kind::VOTE_PEERS_PENDING => Message::VotePeersPending { collectives: r.u64()? },
            kind::PEERS_PENDING_ABORTED => {
                let (retry, reason) = vote_abort(&mut r)?;
                Message::PeersPendingAborted { retry, reason }
            }
            kind::LEAVE => Message::Leave,
            kind::PEER_UNREACHABLE => Message::PeerUnreachable { epoch: Epoch(r.u64()?), peer: PeerId(r.u32()?) },
            kind::REGISTERED => Message::Registered {
                peer: PeerId(r.u32()?),
                session: SessionId(r.u64()?),
                heartbeat_ms: r.u32()?,
                data_key: r.hash()?,
            },
            kind::PEER_REMOVED => Message::PeerRemoved { peer: PeerId(r.u32()?) },
            kind::OP_DONE => {
                let (epoch, derived, seq, members) = (Epoch(r.u64()?), r.u64()?, r.u64()?, decode_peers(&mut r)?);
                Message::OpDone { epoch, derived, seq, members, decided: r.bool("decided")? }
            }
            kind::OP_COMMITTED => Message::OpCommitted { epoch: Epoch(r.u64()?), derived: r.u64()?, seq: r.u64()? },
            kind::OP_QUERY => Message::OpQuery { epoch: Epoch(r.u64()?), derived: r.u64()?, seq: r.u64()? },
            kind::GATHER => Message::Gather {
                epoch: Epoch(r.u64()?),
                seq: r.u64()?,
                deadline_ms: r.u64()?,
                min: r.u32()?,
                needs: decode_peers(&mut r)?,
            },
            kind::GATHERED => Message::Gathered {
                epoch: Epoch(r.u64()?),
                seq: r.u64()?,
                included: decode_peers(&mut r)?,
                pending: r.bool("pending")?,
            },
            kind::OP_FAILED => {
                let (epoch, derived, seq, members) = (Epoch(r.u64()?), r.u64()?, r.u64()?, decode_peers(&mut r)?);
                Message::OpFailed { epoch, derived, seq, members, failure: OpFailure::decode(&mut r)? }
            }
            kind::OP_ABORTED => {
                let (epoch, derived, seq) = (Epoch(r.u64()?), r.u64()?, r.u64()?);
                Message::OpAborted { epoch, derived, seq, failure: OpFailure::decode(&mut r)? }
            }
            kind::TOPOLOGY => {
                let (epoch, members, world) = (Epoch(r.u64()?), decode_members(&mut r)?, r.u32()?);
                let (known, oneshot_max, twoshot_max) = (r.bool("limits")?, r.u64()?, r.u64()?);
                let hierarchical = r.bool("hierarchical")?;
                let limits = known.then_some(AlgorithmLimits { oneshot_max, twoshot_max, hierarchical });
                Message::Topology { epoch, members: members.into(), world, limits }
            }
            kind::TOPOLOGY_COMMITTED => Message::TopologyCommitted { epoch: Epoch(r.u64()?) },
            kind::PEERS_PENDING_RESULT => Message::PeersPendingResult { pending: r.bool("pending")? },
            kind::KICKED => Message::Kicked { reason: r.str()? },
            kind::PEER_HELLO => Message::PeerHello {
                from: PeerId(r.u32()?),
                to: PeerId(r.u32()?),
                epoch: Epoch(r.u64()?),
                stream: r.u16()?,
                streams: r.u16()?,
                reverse: r.bool("reverse")?,
                mac: r.hash()?,
            },
            other => return Err(WireError::UnknownKind(other)),
        };
        r.finish()?;
        Ok(message)
    }
}

fn encode_digests(w: &mut Writer, entries: &[StateDigest]) {
    assert!(entries.len() <= MAX_STATE_ENTRIES, "state exceeds MAX_STATE_ENTRIES: a bug");
    w.u32(entries.len() as u32);
    for e in entries {
        assert!(e.shape.len() <= MAX_DIMS, "tensor exceeds MAX_DIMS: a bug");
        w.str(&e.name);
        w.u8(e.dtype);
        w.u32(e.shape.len() as u32);
        for d in &e.shape {
            w.u64(*d);
        }
        w.bytes(&e.hash);
        w.bool(e.may_differ);
    }
}

fn decode_digests(r: &mut Reader<'_>) -> Result<Vec<StateDigest>, WireError> {
    let count = r.count(MAX_STATE_ENTRIES, 2 + 1 + 4 + 32 + 1)?;
    let mut entries = Vec::with_capacity(count);
    for _ in 0..count {
        let (name, dtype) = (r.str()?, r.u8()?);
        let dims = r.count(MAX_DIMS, 8)?;
        let shape = (0..dims).map(|_| r.u64()).collect::<Result<Vec<u64>, _>>()?;
        entries.push(StateDigest { name, dtype, shape, hash: r.hash()?, may_differ: r.bool("may_differ")? });
    }
    Ok(entries)
}

fn encode_plan(w: &mut Writer, entries: &[PlanEntry]) {
    assert!(entries.len() <= MAX_STATE_ENTRIES, "plan exceeds MAX_STATE_ENTRIES: a bug");
    w.u32(entries.len() as u32);
    for e in entries {
        w.bytes(&e.hash);
        w.u32(e.donors.len() as u32);
        for d in &e.donors {
            w.u32(d.0);
        }
    }
}

fn decode_plan(r: &mut Reader<'_>) -> Result<Vec<PlanEntry>, WireError> {
    let count = r.count(MAX_STATE_ENTRIES, 32 + 4)?;
    let mut entries = Vec::with_capacity(count);
    for _ in 0..count {
        let hash = r.hash()?;
        let n = r.count(MAX_MEMBERS, 4)?;
        let donors = (0..n).map(|_| r.u32().map(PeerId)).collect::<Result<Vec<_>, _>>()?;
        entries.push(PlanEntry { hash, donors });
    }
    Ok(entries)
}

/// A collective's name in the messages about it: its topology, derived group and number.
fn encode_op(w: &mut Writer, epoch: Epoch, derived: u64, seq: u64) {
    w.u64(epoch.0);
    w.u64(derived);
    w.u64(seq);
}

fn encode_peers(w: &mut Writer, peers: &[PeerId]) {
    assert!(peers.len() <= MAX_MEMBERS, "peers exceed MAX_MEMBERS: a bug");
    w.u32(peers.len() as u32);
    for p in peers {
        w.u32(p.0);
    }
}

fn decode_peers(r: &mut Reader<'_>) -> Result<Vec<PeerId>, WireError> {
    let count = r.count(MAX_MEMBERS, 4)?;
    (0..count).map(|_| r.u32().map(PeerId)).collect()
}

fn encode_members(w: &mut Writer, members: &[Member]) {
    assert!(members.len() <= MAX_MEMBERS, "members exceed MAX_MEMBERS: a bug");
    w.u32(members.len() as u32);
    for m in members {
        w.u32(m.peer.0);
        w.u32(m.group.0);
        w.str(&m.addr);
        w.u16(m.site.map_or(NO_SITE, |s| {
            assert!(s != NO_SITE, "site {NO_SITE} is reserved: a bug");
            s
        }));
        w.bool(m.dialable);
        encode_ip(w, m.seen);
    }
}

fn decode_members(r: &mut Reader<'_>) -> Result<Vec<Member>, WireError> {
    let count = r.count(MAX_MEMBERS, 4 + 4 + 2 + 2 + 1 + 1)?;
    let mut members = Vec::with_capacity(count);
    for _ in 0..count {
        let (peer, group, addr) = (PeerId(r.u32()?), GroupId(r.u32()?), r.str()?);
        let site = Some(r.u16()?).filter(|s| *s != NO_SITE);
        let (dialable, seen) = (r.bool("member dialable")?, decode_ip(r)?);
        members.push(Member { peer, group, addr, site, dialable, seen });
    }
    Ok(members)
}

/// An optional IP address: a version byte (0 for none, 4 or 6), then its octets.
fn encode_ip(w: &mut Writer, ip: Option<IpAddr>) {
    match ip {
        None => w.u8(0),
        Some(IpAddr::V4(v4)) => {
            w.u8(4);
            v4.octets().iter().for_each(|b| w.u8(*b));
        }
        Some(IpAddr::V6(v6)) => {
            w.u8(6);
            v6.octets().iter().for_each(|b| w.u8(*b));
        }
    }
}

fn decode_ip(r: &mut Reader<'_>) -> Result<Option<IpAddr>, WireError> {
    match r.u8()? {
        0 => Ok(None),
        4 => Ok(Some(IpAddr::V4(Ipv4Addr::from(r.take::<4>()?)))),
        6 => Ok(Some(IpAddr::V6(Ipv6Addr::from(r.take::<16>()?)))),
        v => Err(WireError::InvalidValue { field: "IP address version", value: v.into() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::misuse::strategy::{mismatch, misuse, reason};
    use crate::{decode_frame, encode_frame, HEADER_BYTES, MAX_STRING_BYTES};
    use crate::{Api, Call, Called};
    use proptest::prelude::*;

    /// A collective's topology, derived group and number.
    fn op_name() -> impl Strategy<Value = (u64, u64, u64)> {
        (any::<u64>(), prop_oneof![Just(0u64), any::<u64>()], any::<u64>())
    }

    fn peers() -> impl Strategy<Value = Vec<PeerId>> {
        proptest::collection::vec(any::<u32>().prop_map(PeerId), 0..6)
    }

    fn member() -> impl Strategy<Value = Member> {
        let seen = proptest::option::of(prop_oneof![
            any::<[u8; 4]>().prop_map(IpAddr::from),
            any::<[u8; 16]>().prop_map(IpAddr::from),
        ]);
        (any::<u32>(), any::<u32>(), "[a-z0-9.:]{0,40}", proptest::option::of(0u16..u16::MAX), any::<bool>(), seen)
            .prop_map(|(p, g, addr, site, dialable, seen)| Member {
                peer: PeerId(p),
                group: GroupId(g),
                addr,
                site,
                dialable,
                seen,
            })
    }

    fn failure() -> impl Strategy<Value = OpFailure> {
        let kinds = [
            FailureKind::PeerLost,
            FailureKind::Timeout,
            FailureKind::Protocol,
            FailureKind::Superseded,
            FailureKind::Misuse,
        ];
        prop_oneof![
            (prop::sample::select(kinds.to_vec()), any::<u32>(), ".{0,300}")
                .prop_map(|(kind, p, reason)| OpFailure::new(kind, PeerId(p), reason)),
            (any::<u32>(), misuse()).prop_map(|(p, m)| OpFailure::misuse(PeerId(p), m)),
            mismatch().prop_map(OpFailure::mismatch),
        ]
    }

    /// A refused vote's (`retry`) reason, or an abandoned one's, which names the calls.
    fn vote_abort() -> impl Strategy<Value = (bool, Reason)> {
        prop_oneof![reason().prop_map(|r| (true, r)), misuse().prop_map(|m| (false, m.into()))]
    }

    fn digest() -> impl Strategy<Value = StateDigest> {
        ("[a-z.]{0,30}", any::<u8>(), prop::collection::vec(any::<u64>(), 0..5), any::<[u8; 32]>(), any::<bool>())
            .prop_map(|(name, dtype, shape, hash, may_differ)| StateDigest { name, dtype, shape, hash, may_differ })
    }

    fn sync_message() -> impl Strategy<Value = Message> {
        prop_oneof![
            (any::<u64>(), 1u8..4, any::<bool>(), prop::collection::vec(digest(), 0..6), any::<u64>()).prop_map(
                |(revision, strategy, override_resume, entries, collectives)| Message::SyncVote {
                    revision,
                    strategy,
                    override_resume,
                    entries,
                    collectives
                }
            ),
            any::<u64>().prop_map(|round| Message::SyncDone { round }),
            any::<u64>().prop_map(|round| Message::SyncComplete { round }),
            (any::<u64>(), ".{0,60}").prop_map(|(round, reason)| Message::SyncFailed { round, reason }),
            (
                any::<u64>(),
                any::<u64>(),
                prop::collection::vec((any::<[u8; 32]>(), prop::collection::vec(any::<u32>(), 0..4)), 0..5)
            )
                .prop_map(|(round, revision, e)| Message::SyncPlan {
                    round,
                    revision,
                    entries: e
                        .into_iter()
                        .map(|(hash, d)| PlanEntry { hash, donors: d.into_iter().map(PeerId).collect() })
                        .collect()
                }),
            (any::<u64>(), any::<bool>(), reason()).prop_map(|(round, retryable, reason)| Message::SyncAborted {
                round,
                retryable,
                reason
            }),
            prop::collection::vec(digest(), 0..6).prop_map(|entries| Message::CatchUpStart { entries }),
            any::<(u64, u64, u64)>().prop_map(|(done, total, eta_ms)| Message::CatchUpProgress { done, total, eta_ms }),
            any::<(bool, u64)>().prop_map(|(fetched, revision)| Message::CatchUpEnd { fetched, revision }),
            any::<(u64, bool)>().prop_map(|(round, held)| Message::SnapshotHeld { round, held }),
            (any::<(u32, bool, u64, u64)>(), any::<(u64, u64, bool)>()).prop_map(
                |((p, send, tag, seen), (e, collectives, any))| {
                    Message::P2pWaits { peer: PeerId(p), any, send, tag, seen, epoch: Epoch(e), collectives }
                }
            ),
            any::<u32>().prop_map(|p| Message::P2pResumed { peer: PeerId(p) }),
            (any::<u32>(), misuse()).prop_map(|(p, misuse)| Message::P2pApart { peer: PeerId(p), misuse }),
            any::<(u32, u64, u64, bool)>().prop_map(|(p, e, number, send)| Message::P2pOutcome {
                peer: PeerId(p),
                epoch: Epoch(e),
                number,
                send
            }),
            any::<(u32, u64, u64, bool, bool)>().prop_map(|(p, e, number, send, done)| Message::P2pDecided {
                peer: PeerId(p),
                epoch: Epoch(e),
                number,
                send,
                done
            }),
            any::<u64>().prop_map(|round| Message::Snapshot { round }),
            (
                any::<(u64, u64)>(),
                prop::collection::vec((any::<[u8; 32]>(), prop::collection::vec(any::<u32>(), 0..4)), 0..5),
                prop::collection::vec(member(), 0..4),
                ".{0,60}"
            )
                .prop_map(|((round, revision), e, donors, reason)| Message::CatchUpPlan {
                    round,
                    revision,
                    entries: e
                        .into_iter()
                        .map(|(hash, d)| PlanEntry { hash, donors: d.into_iter().map(PeerId).collect() })
                        .collect(),
                    donors,
                    reason
                }),
            (any::<(u32, u32, u64, u32, u64, u64)>(), any::<[u8; 32]>()).prop_map(|(t, mac)| Message::FetchRequest {
                from: PeerId(t.0),
                to: PeerId(t.1),
                round: t.2,
                index: t.3,
                offset: t.4,
                len: t.5,
                mac,
            }),
        ]
    }

    fn message() -> impl Strategy<Value = Message> {
        prop_oneof![
            sync_message(),
            (any::<u32>(), ".{0,64}", any::<[u8; 32]>(), any::<bool>()).prop_map(|(g, a, proof, catch_up)| {
                Message::Join { group: GroupId(g), data_addr: a, proof, catch_up }
            }),
            any::<[u8; 32]>().prop_map(|nonce| Message::Challenge { nonce }),
            ".{0,100}".prop_map(|reason| Message::AuthFailed { reason }),
            Just(Message::Heartbeat),
            crate::report::strategy::report().prop_map(|report| Message::Report { report }),
            (any::<u32>(), any::<u64>(), any::<[u8; 32]>()).prop_map(|(p, s, proof)| Message::Rejoin {
                peer: PeerId(p),
                session: SessionId(s),
                proof
            }),
            (
                any::<u64>(),
                proptest::option::of(proptest::collection::vec((any::<u32>(), any::<u32>(), any::<u64>()), 0..5))
            )
                .prop_map(|(collectives, m)| Message::VoteUpdateTopology {
                    collectives,
                    measured: m.map(|m| {
                        m.into_iter()
                            .map(|(p, rtt_us, bytes_per_s)| Measured { peer: PeerId(p), rtt_us, bytes_per_s })
                            .collect()
                    }),
                }),
            (1u8..4, any::<u64>(), any::<u32>(), any::<u64>()).prop_map(|(k, e, v, collectives)| {
                let vote = Vote::from_code(k).expect("a vote code");
                Message::VoteOpened { vote, epoch: Epoch(e), voter: PeerId(v), collectives }
            }),
            vote_abort().prop_map(|(retry, reason)| Message::TopologyVoteAborted { retry, reason }),
            any::<u64>().prop_map(|e| Message::TopologyReady { epoch: Epoch(e) }),
            any::<u64>().prop_map(|collectives| Message::VotePeersPending { collectives }),
            vote_abort().prop_map(|(retry, reason)| Message::PeersPendingAborted { retry, reason }),
            Just(Message::Leave),
            (any::<u64>(), any::<u32>())
                .prop_map(|(e, p)| Message::PeerUnreachable { epoch: Epoch(e), peer: PeerId(p) }),
            (any::<u32>(), any::<u64>(), any::<u32>(), any::<[u8; 32]>()).prop_map(|(p, s, h, k)| {
                Message::Registered { peer: PeerId(p), session: SessionId(s), heartbeat_ms: h, data_key: k }
            }),
            any::<u32>().prop_map(|p| Message::PeerRemoved { peer: PeerId(p) }),
            (op_name(), peers(), any::<bool>()).prop_map(|((e, derived, seq), members, decided)| {
                Message::OpDone { epoch: Epoch(e), derived, seq, members, decided }
            }),
            op_name().prop_map(|(e, derived, seq)| Message::OpCommitted { epoch: Epoch(e), derived, seq }),
            op_name().prop_map(|(e, derived, seq)| Message::OpQuery { epoch: Epoch(e), derived, seq }),
            (any::<u64>(), any::<u64>(), any::<u64>(), any::<u32>(), peers()).prop_map(
                |(e, seq, deadline_ms, min, needs)| Message::Gather { epoch: Epoch(e), seq, deadline_ms, min, needs }
            ),
            (any::<u64>(), any::<u64>(), peers(), any::<bool>()).prop_map(|(e, seq, included, pending)| {
                Message::Gathered { epoch: Epoch(e), seq, included, pending }
            }),
            (op_name(), peers(), failure()).prop_map(|((e, derived, seq), members, failure)| {
                Message::OpFailed { epoch: Epoch(e), derived, seq, members, failure }
            }),
            (op_name(), failure()).prop_map(|((e, derived, seq), failure)| {
                Message::OpAborted { epoch: Epoch(e), derived, seq, failure }
            }),
            (
                any::<u64>(),
                prop::collection::vec(member(), 0..20),
                any::<u32>(),
                proptest::option::of((any::<u64>(), any::<u64>(), any::<bool>()))
            )
                .prop_map(|(e, members, world, limits)| Message::Topology {
                    epoch: Epoch(e),
                    members: members.into(),
                    world,
                    limits: limits.map(|(oneshot_max, twoshot_max, hierarchical)| AlgorithmLimits {
                        oneshot_max,
                        twoshot_max,
                        hierarchical
                    }),
                }),
            any::<u64>().prop_map(|e| Message::TopologyCommitted { epoch: Epoch(e) }),
            any::<bool>().prop_map(|pending| Message::PeersPendingResult { pending }),
            ".{0,100}".prop_map(|reason| Message::Kicked { reason }),
            (any::<u32>(), any::<u32>(), any::<u64>(), any::<u16>(), any::<u16>(), any::<bool>(), any::<[u8; 32]>())
                .prop_map(|(f, t, e, s, n, reverse, mac)| Message::PeerHello {
                    from: PeerId(f),
                    to: PeerId(t),
                    epoch: Epoch(e),
                    stream: s,
                    streams: n,
                    reverse,
                    mac
                }),
        ]
    }

    proptest! {
        #[test]
        fn decode_of_encode_is_identity(m in message(), session in any::<u64>()) {
            let bytes = encode_frame(SessionId(session), &m).unwrap();
            prop_assert_eq!(decode_frame(&bytes), Ok((SessionId(session), m)));
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_frame(&bytes);
            for kind in [1u16, 2, 5, 7, 8, 9, 64, 65, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 10, 11, 12, 130, 128, 129, 999] {
                let _ = Message::decode_body(kind, &bytes);
            }
        }

        #[test]
        fn any_flipped_bit_is_detected(m in message(), bit in any::<prop::sample::Index>()) {
            let mut bytes = encode_frame(SessionId(1), &m).unwrap();
            let i = bit.index(bytes.len() * 8);
            bytes[i / 8] ^= 1 << (i % 8);
            prop_assert!(decode_frame(&bytes).is_err());
        }
    }

    #[test]
    fn oversized_lengths_are_rejected_before_allocation() {
        // A topology claiming four billion members in a tiny body must fail on the count.
        let mut w = Writer::with_capacity(16);
        w.u64(1);
        w.u32(u32::MAX);
        assert_eq!(
            Message::decode_body(kind::TOPOLOGY, w.as_bytes()),
            Err(WireError::TooManyEntries { len: u32::MAX as usize, max: MAX_MEMBERS })
        );
        // A count within the limit but larger than the bytes present is truncation.
        let mut w = Writer::with_capacity(16);
        w.u64(1);
        w.u32(100);
        assert_eq!(Message::decode_body(kind::TOPOLOGY, w.as_bytes()), Err(WireError::Truncated));
        let mut w = Writer::with_capacity(16);
        w.u16(u16::MAX);
        assert_eq!(
            Message::decode_body(kind::KICKED, w.as_bytes()),
            Err(WireError::StringTooLong { len: u16::MAX as usize, max: MAX_STRING_BYTES })
        );
    }

    #[test]
    fn long_reasons_are_cut_at_a_character_boundary() {
        let f = OpFailure::new(FailureKind::PeerLost, PeerId(1), "é".repeat(200));
        assert_eq!(f.reason.to_string().len(), MAX_STRING_BYTES);
        let f = OpFailure::new(FailureKind::PeerLost, PeerId(1), format!("x{}", "é".repeat(200)));
        assert_eq!(f.reason.to_string().len(), MAX_STRING_BYTES - 1);
        let mut w = Writer::with_capacity(32);
        encode_op(&mut w, Epoch(1), 0, 2);
        w.u8(9);
        assert_eq!(
            Message::decode_body(kind::OP_ABORTED, w.as_bytes()),
            Err(WireError::InvalidValue { field: "failure kind", value: 9 })
        );
        // Only a usage error names calls that cannot complete together.
        let ours = Called::new([PeerId(1)], Call::api(Vote::PeersPending));
        let misuse = Misuse::new(ours, Called::new([PeerId(2)], Call::api(Api::AllReduce)));
        let failure = OpFailure { kind: FailureKind::PeerLost, ..OpFailure::misuse(PeerId(1), misuse) };
        let bytes =
            encode_frame(SessionId(1), &Message::OpAborted { epoch: Epoch(1), derived: 0, seq: 2, failure }).unwrap();
        assert_eq!(
            decode_frame(&bytes),
            Err(WireError::InvalidValue { field: "failure kind of a misuse", value: FailureKind::PeerLost as u64 })
        );
        // A vote abandoned, not refused for now, names the calls.
        let abandoned = Message::TopologyVoteAborted { retry: false, reason: Reason::text("no calls named") };
        assert_eq!(
            decode_frame(&encode_frame(SessionId(1), &abandoned).unwrap()),
            Err(WireError::InvalidValue { field: "abandoned vote's calls", value: 0 })
        );
    }

    /// A user's string (a tensor name, an advertised address) longer than the limit must come back
    /// as an error naming it, never a panic: a panic under the communicator's locks once made
    /// every later call of that peer fail.
    #[test]
    fn an_over_long_string_is_an_encoding_error_not_a_panic() {
        let m = Message::Join {
            group: GroupId(0),
            data_addr: "é".repeat(MAX_STRING_BYTES),
            proof: [0; 32],
            catch_up: false,
        };
        let want = WireError::StringTooLong { len: 2 * MAX_STRING_BYTES, max: MAX_STRING_BYTES };
        assert_eq!(encode_frame(SessionId(1), &m), Err(want));
        let fits = Message::Join {
            group: GroupId(0),
            data_addr: "é".repeat(MAX_STRING_BYTES / 2),
            proof: [0; 32],
            catch_up: false,
        };
        assert!(encode_frame(SessionId(1), &fits).is_ok());
    }

    #[test]
    fn header_checks_name_the_problem() {
        let mut bytes = encode_frame(SessionId(3), &Message::Leave).unwrap();
        bytes[0] = b'X';
        assert!(matches!(decode_frame(&bytes), Err(WireError::BadMagic { .. })));
        assert_eq!(decode_frame(&bytes[..HEADER_BYTES - 1]), Err(WireError::Truncated));
        assert_eq!(Message::decode_body(kind::LEAVE, &[0]), Err(WireError::TrailingBytes(1)));
        assert_eq!(
            Message::decode_body(kind::PEERS_PENDING_RESULT, &[2]),
            Err(WireError::InvalidValue { field: "pending", value: 2 })
        );
    }
}
