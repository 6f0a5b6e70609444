//! A peer's view of the protocol: what the master has told it, and where it stands in its ring.

use super::{OpId, Seq};
use crate::auth::DataKey;
use shoal_wire::{
    AlgorithmLimits, Api, Call, Called, Epoch, FailureKind, Member, Message, Misuse, OpFailure, PeerId, PlanEntry,
    Point, Reason, SessionId, Vote,
};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

/// Commits a peer remembers to answer the master's queries: far more than may be in flight.
pub const REMEMBERED_COMMITS: usize = 4096;

/// Decisions on collectives with a deadline a peer keeps for the calls it has not made yet:
/// it runs only a few collectives at a time, so the oldest of this many was long made.
const MAX_GATHERED_HEARD: usize = 1024;

/// How a collective this peer had not started by the time its topology was left ended for the
/// others ([`PeerView::missed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Missed {
    /// It failed.
    Failed(OpFailure),
    /// Called with a deadline, it ran among these members, without us.
    LeftOut(Vec<PeerId>),
}

/// What the peer has learned from the master.
#[derive(Debug, Clone, Default)]
pub struct PeerView {
    /// Our id and the run's session, once registered.
    pub registered: Option<(PeerId, SessionId)>,
    /// The latest topology issued to us, not yet committed.
    pub issued: Option<(Epoch, Vec<Member>)>,
    /// The topology in force for us.
    pub committed: Option<(Epoch, Vec<Member>)>,
    /// What the master said of the topologies issued since the one in force, besides their
    /// members: the run's size, and its small-message limits.
    pub issued_with: BTreeMap<Epoch, (u32, Option<AlgorithmLimits>)>,
    /// The issued topology this peer established and reported ready in, until it commits: a
    /// later call does not establish it again.
    pub ready_in: Option<Epoch>,
    /// Collectives this peer started in the committed topology: the next one's number there.
    pub started: u64,
    /// Collectives this peer started in each derived group in the committed topology (none:
    /// 0), as [`PeerView::started`] counts the whole group's.
    pub derived_started: BTreeMap<u64, u64>,
    /// Members whose call waits on a tagged transfer with us that found nothing to match it, as
    /// the master relayed them ([`WaitNote`]); one wait per member at a time.
    pub waiters: BTreeMap<PeerId, WaitNote>,
    /// The collectives this peer would have run next in the topology it left, which the others
    /// failed before it started them (it joined the re-formed ring first), or, called with a
    /// deadline, ran among the others without it: (topology, number, how), in order; of each
    /// derived group likewise. Its next collective calls there end the same way, so that every
    /// member's k-th call has one outcome ([`PeerView::start_collective`]).
    pub missed: VecDeque<(OpId, Missed)>,
    /// The answer of the last `peers_pending` vote, until consumed.
    pub pending_result: Option<bool>,
    /// Why the master expelled us, if it did.
    pub kicked: Option<String>,
    /// The run's key for data connections, once registered.
    pub data_key: Option<DataKey>,
    /// The nonce the master challenged us with.
    pub challenge: Option<[u8; 32]>,
    /// Why the master refused our proof of the run's secret, if it did.
    pub refused: Option<String>,
    /// How often the master wants a heartbeat, once registered.
    pub heartbeat_interval: Option<Duration>,
    /// Peers the master reported gone. Ids are never reused, so this only grows.
    pub removed: BTreeSet<PeerId>,
    /// The master's verdicts on collectives, until consumed. An abort may arrive before this
    /// peer even starts the collective; verdicts of replaced topologies are dropped when a new
    /// one is committed.
    pub verdicts: BTreeMap<OpId, Verdict>,
    /// The members the master named for collectives called with a deadline (`Gathered`), until
    /// this peer starts each; those of replaced topologies are dropped when a new one is
    /// committed.
    pub gathered: BTreeMap<OpId, Vec<PeerId>>,
    /// Whether peers waited to join when the master decided each of those (`Gathered`), kept
    /// after this peer started it, and past a new topology, for the call's result to say so
    /// whenever it ends: the latest `MAX_GATHERED_HEARD`.
    pub pending_at: BTreeMap<OpId, bool>,
    /// The latest collectives this peer committed (on its own or by verdict), at most
    /// `REMEMBERED_COMMITS`: several may be in flight and commit in any order, and the master
    /// only ever asks about one a participant still waits on, which is among the latest.
    pub committed_ops: BTreeSet<OpId>,
    /// Collectives the master asked about that this peer had not committed when asked: it
    /// reports them if it commits them on its own.
    pub queried: BTreeSet<OpId>,
    /// A member of our group waits in a vote (the one that had started the fewest collectives).
    /// A collective numbered at least its count can never complete.
    pub vote_open: Option<VoteOpen>,
    /// The last vote announced to this peer since it last started a call: where the others
    /// stand if they end as calls that cannot complete together.
    pub announced: Option<VoteOpen>,
    /// The others' calls at the point of this peer's calls ended as calls that cannot complete
    /// together, before it made a call there (`docs/protocol.md`, "No call waits for a call
    /// that will never come"): its next call can never meet theirs either, and ends at once with
    /// this usage error.
    pub settled_here: Option<Misuse>,
    /// This peer's last call ended as one of calls that cannot complete together, and it made no
    /// call since: what the master says of that mismatch afterwards concerns no later call.
    pub told: bool,
    /// Why the last `peers_pending` vote was abandoned or refused, until consumed.
    pub pending_aborted: Option<VoteAbort>,
    /// Why the last `update_topology` vote was abandoned or refused, until consumed.
    pub vote_aborted: Option<VoteAbort>,
    /// The topology in force when this peer's last call failed, until a call succeeds: a ring
    /// re-formed since then makes an `update_topology` after the failure a no-op
    /// ([`PeerView::vote_needed`]).
    pub failed_in: Option<Epoch>,
    /// Messages to the master this view decided on, until the driver takes them
    /// ([`PeerView::poll_output`]).
    outbox: VecDeque<Message>,
    /// The plan of the current shared-state sync: (round, revision, entries).
    pub sync_plan: Option<(u64, u64, Vec<PlanEntry>)>,
    /// How a shared-state sync ended: (round, completed or why not).
    pub sync_end: Option<(u64, Result<(), SyncAbort>)>,
    /// The plan of our catch-up, until taken.
    pub catch_up_plan: Option<CatchUpPlan>,
    /// The sync whose state the master asked us to keep a copy of for newcomers, until taken.
    pub snapshot_order: Option<u64>,
}

/// What a catching-up peer fetches (`Message::CatchUpPlan`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatchUpPlan {
    /// The sync whose state the donors keep; 0 if there is nothing to fetch.
    pub round: u64,
    /// Its revision.
    pub revision: u64,
    /// Per tensor of our `CatchUpStart`: its hash and donors (none: not fetched).
    pub entries: Vec<PlanEntry>,
    /// The donors, with their addresses.
    pub donors: Vec<Member>,
    /// Why the master refused the catch-up; empty if it did not.
    pub reason: String,
}

/// A member of our group waits in a vote: a collective it never started can never complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VoteOpen {
    /// The call it waits in.
    pub vote: Vote,
    /// The topology its count is in.
    pub epoch: Epoch,
    /// Who.
    pub voter: PeerId,
    /// Collectives it started in `epoch`.
    pub collectives: u64,
}

/// The answer to the master's query about collective `op`: we committed it on our own. The
/// master asked, so it knows a derived group's members already.
fn done_on_our_own(op: OpId) -> Message {
    let (epoch, derived, seq) = (op.epoch, op.derived, op.seq.0);
    Message::OpDone { epoch, derived, seq, members: Vec::new(), decided: true }
}

impl VoteOpen {
    /// Whether our collective `seq` of `epoch` (of call `api`) can never complete; then why,
    /// naming both calls.
    pub fn blocks(&self, epoch: Epoch, seq: u64, api: Api, me: PeerId) -> Option<Misuse> {
        debug_assert!(self.voter != me, "our own vote was announced to us");
        (self.epoch == epoch && self.collectives <= seq).then(|| {
            let vote = Call::Api { api: self.vote.into(), at: Some(Point { epoch, collectives: self.collectives }) };
            let ours = Call::Api { api, at: Some(Point { epoch, collectives: seq }) };
            Misuse::new(Called::new([me], ours), Called::new([self.voter], vote))
        })
    }

    /// Whether our collective of a derived group in `epoch` (of call `api`), which still moves
    /// data with `waits_on`, can never complete; then why, naming both calls. A voter runs
    /// nothing beside its vote: if the collective still moves data with it, it never started it.
    pub fn blocks_derived(&self, epoch: Epoch, api: Api, me: PeerId, waits_on: &[PeerId]) -> Option<Misuse> {
        debug_assert!(self.voter != me, "our own vote was announced to us");
        (self.epoch == epoch && waits_on.contains(&self.voter)).then(|| {
            let vote = Call::Api { api: self.vote.into(), at: Some(Point { epoch, collectives: self.collectives }) };
            Misuse::new(Called::new([me], Call::Api { api, at: None }), Called::new([self.voter], vote))
        })
    }
}

/// Why a collective this peer is moving data for must stop ([`PeerView::interrupt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Interrupt {
    /// The master aborted it: every participant fails with this failure.
    Aborted(OpFailure),
    /// A member of the group waits in a vote and will never join it: misuse, naming both calls.
    Blocked(Misuse),
    /// The master removed a participant it still moves data with (a frozen or cut-off peer never
    /// closes its streams).
    MemberLost(PeerId),
    /// A derived group's collective waits for members while a newer topology was issued (a
    /// member of the whole group outside it left, say): those that did not start it join that
    /// topology first and never will, and nothing else stops it.
    Superseded(Epoch),
}

/// Why a confirmation lap stops before every token came round ([`PeerView::lap_interrupt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LapInterrupt {
    /// The master decided the collective.
    Verdict(Verdict),
    /// A participant was removed: the lap cannot finish, ask the master.
    MemberLost(PeerId),
}

/// What a call that waits for a topology does next ([`PeerView::topology_step`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopologyStep {
    /// Open the connections of this issued topology, then report ready (or who is unreachable).
    Establish(Epoch, Vec<Member>),
    /// The topology this call established is in force: the call's work runs in it.
    InForce(Epoch, Vec<Member>),
    /// Our `update_topology` vote was not counted (a topology was being connected): vote again.
    VoteRefused,
    /// Our `update_topology` vote was abandoned (the others made another call): a usage error.
    VoteAbandoned(Misuse),
}

/// Why an `update_topology` or `peers_pending` vote ended without a result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VoteAbort {
    /// Not counted while a topology was being connected: join it, then vote again.
    Retry,
    /// Abandoned because the peers made calls that cannot complete together: the call fails.
    Abandoned(Misuse),
}

impl VoteAbort {
    /// How a vote ended, as the master says: `retry`, or abandoned for the calls `reason` names
    /// (the wire refuses an abandoned vote that names none; `got` is the message).
    fn of(retry: bool, reason: Reason, got: &'static str) -> Result<Self, UnexpectedMessage> {
        match (retry, reason) {
            (true, _) => Ok(VoteAbort::Retry),
            (false, Reason::Misuse(m)) => Ok(VoteAbort::Abandoned(*m)),
            (false, Reason::Text(_) | Reason::Mismatch(_)) => {
                Err(UnexpectedMessage { got, why: "an abandoned vote that names no calls" })
            }
        }
    }
}

/// Why a shared-state sync ended without effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncAbort {
    /// Calling again can succeed.
    pub retryable: bool,
    /// Why: the calls that cannot complete together, or an account in words.
    pub reason: Reason,
}

/// How the master decided a collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every participant finished: the results stand.
    Committed,
    /// The collective failed somewhere: every participant restores its buffers.
    Aborted(OpFailure),
}

/// A tagged transfer named across the master, as [`Message::P2pOutcome`] and
/// [`Message::P2pDecided`] carry it: the member at its other end (relayed: the asker, or the
/// member asked), its topology, the sender's number of it, and whether the asker sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferName {
    /// The member at the other end.
    pub peer: PeerId,
    /// The topology it ran in.
    pub epoch: Epoch,
    /// The sender's number of it among its transfers to the receiver.
    pub number: u64,
    /// The asker sent it; otherwise it received it.
    pub send: bool,
}

/// A fact the peer learned from one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerEvent {
    /// Nothing new (a heartbeat).
    Nothing,
    /// We are registered.
    Registered,
    /// The master took us back after a broken connection (`Rejoin`).
    Rejoined,
    /// A topology was issued: open its connections.
    TopologyIssued(Epoch),
    /// A topology is in force.
    TopologyCommitted(Epoch),
    /// A `peers_pending` vote ended.
    PeersPendingResult(bool),
    /// We were expelled.
    Kicked,
    /// Another peer left the run.
    PeerRemoved(PeerId),
    /// The master decided a collective.
    Verdict(OpId),
    /// The master named the members a collective with a deadline runs among.
    Gathered(OpId),
    /// A member's call waits on a transfer with us ([`PeerView::waiters`]).
    MemberWaits(PeerId),
    /// The transfer we wait on with `peer` can never complete: `reason` names both calls.
    P2pApart {
        /// The other end.
        peer: PeerId,
        /// Both calls, named.
        misuse: Misuse,
    },
    /// A member whose transfer with us stopped at our word asks what became of it here
    /// ([`Message::P2pOutcome`], relayed: `peer` is the asker).
    P2pOutcome(TransferName),
    /// The answer to a [`Message::P2pOutcome`] of ours (`peer` is the member asked): the transfer
    /// succeeded there, or not.
    P2pDecided(TransferName, bool),
    /// Drop the copy of the shared state kept for newcomers: none catches up any more.
    DropSnapshot,
    /// The master asked whether we committed a collective: `committed` says we did and must
    /// tell it so now; otherwise we will when we do.
    Query {
        /// The collective.
        op: OpId,
        /// Whether we already committed it.
        committed: bool,
    },
}

/// What a member's call waits on from us: a tagged transfer it announced (`P2pWaits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitNote {
    /// It receives from any member, us among them: our verdict ends no call of ours.
    pub any: bool,
    /// It sends to us; otherwise it receives from us.
    pub send: bool,
    /// The transfer's tag.
    pub tag: u64,
    /// A waiting receive: how many of our sends to it it has seen offered.
    pub seen: u64,
    /// Its committed topology and its count of collectives started there when it announced.
    pub point: (Epoch, u64),
}

/// The master sent something a peer never expects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unexpected {got} from the master: {why}")]
pub struct UnexpectedMessage {
    /// The message's name.
    pub got: &'static str,
    /// Why it is unexpected.
    pub why: &'static str,
}

/// Our place in our group's ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingPosition {
    /// The topology.
    pub epoch: Epoch,
    /// Our index in the group's ring.
    pub rank: usize,
    /// The group's ring, in order (shared: every collective's action carries the position).
    pub ring: Arc<[Member]>,
    /// Members of the whole run.
    pub world_size: usize,
    /// Where the master says the small-message all-reduces stop in this topology, if it does.
    pub limits: Option<AlgorithmLimits>,
}

impl RingPosition {
    /// Number of peers in our group.
    pub fn group_size(&self) -> usize {
        self.ring.len()
    }
    /// The member we send to.
    pub fn next(&self) -> &Member {
        &self.ring[(self.rank + 1) % self.ring.len()]
    }
    /// The member we receive from.
    pub fn prev(&self) -> &Member {
        &self.ring[(self.rank + self.ring.len() - 1) % self.ring.len()]
    }
}

impl PeerView {
    /// Applies one message from the master.
    ///
    /// # Errors
    /// [`UnexpectedMessage`] for messages a master never sends, or sends out of order.
    pub fn handle_message(&mut self, message: Message) -> Result<PeerEvent, UnexpectedMessage> {
        let unexpected = |why| Err(UnexpectedMessage { got: message.name(), why });
        Ok(match message {
            Message::Heartbeat => PeerEvent::Nothing,
            Message::Registered { peer, session, heartbeat_ms, data_key } => {
                if self.registered == Some((peer, session)) && self.data_key == Some(DataKey(data_key)) {
                    // The answer to `Rejoin`.
                    self.heartbeat_interval = Some(Duration::from_millis(heartbeat_ms.max(1).into()));
                    return Ok(PeerEvent::Rejoined);
                }
                if self.registered.is_some() {
                    return unexpected("already registered as someone else");
                }
                self.registered = Some((peer, session));
                self.data_key = Some(DataKey(data_key));
                self.heartbeat_interval = Some(Duration::from_millis(heartbeat_ms.max(1).into()));
                debug_assert!(self.committed.is_none() && self.issued.is_none(), "a topology before registration");
                PeerEvent::Registered
            }
            Message::PeerRemoved { peer } => {
                self.removed.insert(peer);
                PeerEvent::PeerRemoved(peer)
            }
            Message::Topology { epoch, ref members, world, limits } => {
                let Some((me, _)) = self.registered else {
                    return unexpected("not registered");
                };
                let Some(ours) = members.iter().find(|m| m.peer == me) else {
                    return unexpected("topology without us");
                };
                if members.iter().any(|m| m.group != ours.group) {
                    return unexpected("topology with members of another group");
                }
                if (world as usize) < members.len() {
                    return unexpected("topology with more members than the run");
                }
                if self.committed.as_ref().is_some_and(|(e, _)| *e >= epoch) {
                    return unexpected("topology epoch went backwards");
                }
                self.issued = Some((epoch, members.to_vec()));
                self.issued_with.retain(|e, _| *e >= self.committed.as_ref().map_or(Epoch(0), |(c, _)| *c));
                self.issued_with.insert(epoch, (world, limits));
                self.vote_open = None;
                // Queries about collectives we will now never start: answered.
                let never: Vec<OpId> = self.queried.iter().copied().filter(|&op| self.never_starts(op)).collect();
                for op in never {
                    self.queried.remove(&op);
                    self.never_started(op);
                }
                debug_assert!(self.vote_open.is_none(), "a vote announced in the topology left still blocks");
                debug_assert!(
                    self.queried.iter().all(|&op| !self.never_starts(op)),
                    "a query about a collective that never starts waits for it"
                );
                PeerEvent::TopologyIssued(epoch)
            }
            Message::TopologyCommitted { epoch } => match self.issued.take() {
                Some((issued, members)) if issued == epoch => {
                    // Every abort reaches every member of the collective before the next commit
                    // (one connection, in order): an abort of the collective we would have run
                    // next means the others failed it without us. Not for misuse: then we were in
                    // the other call, which failed with the same usage error already.
                    // So do the collectives after it that the others had started too.
                    // Each derived group's likewise.
                    self.missed.clear();
                    if let Some((left, _)) = self.committed.as_ref() {
                        let derived = self.verdicts.keys().filter(|op| op.epoch == *left && op.derived != 0);
                        let mut groups: Vec<u64> = derived.map(|op| op.derived).collect();
                        groups.dedup();
                        for derived in std::iter::once(0).chain(groups) {
                            let from = self.started_in(derived);
                            for seq in from.. {
                                let op = OpId { epoch: *left, derived, seq: Seq(seq) };
                                let me = self.registered.map(|(p, _)| p);
                                match (self.verdicts.get(&op), self.gathered.get(&op)) {
                                    (Some(Verdict::Aborted(f)), _) if f.kind != FailureKind::Misuse => {
                                        self.missed.push_back((op, Missed::Failed(f.clone())))
                                    }
                                    (Some(Verdict::Committed), Some(included))
                                        if me.is_some_and(|me| !included.contains(&me)) =>
                                    {
                                        self.missed.push_back((op, Missed::LeftOut(included.clone())))
                                    }
                                    _ => break,
                                }
                            }
                        }
                    }
                    // Epochs never go back: the issued one passed that check on arrival.
                    assert!(self.committed.as_ref().is_none_or(|(e, _)| *e < epoch), "a commit behind ours");
                    self.committed = Some((epoch, members));
                    self.ready_in = None;
                    self.started = 0;
                    self.derived_started.clear();
                    self.verdicts.retain(|op, _| op.epoch >= epoch);
                    self.gathered.retain(|op, _| op.epoch >= epoch);
                    self.queried.retain(|op| op.epoch >= epoch);
                    self.committed_ops.retain(|op| op.epoch >= epoch);
                    debug_assert!(self.issued.is_none() && self.ready_in.is_none(), "a commit leaves {epoch:?} issued");
                    debug_assert!(
                        self.missed.iter().all(|(op, m)| op.epoch < epoch
                            && !matches!(m, Missed::Failed(f) if f.kind == FailureKind::Misuse)),
                        "a collective missed in the topology in force"
                    );
                    PeerEvent::TopologyCommitted(epoch)
                }
                other => {
                    self.issued = other;
                    return unexpected("commit of a topology not issued to us");
                }
            },
            Message::PeersPendingResult { pending } => {
                self.vote_open = None;
                self.pending_result = Some(pending);
                PeerEvent::PeersPendingResult(pending)
            }
            Message::OpCommitted { epoch, derived, seq } => {
                let op = OpId { epoch, derived, seq: Seq(seq) };
                // Verdicts never change: a member that failed the collective never finished it.
                if matches!(self.verdicts.get(&op), Some(Verdict::Aborted(_))) {
                    return unexpected("a commit of a collective it aborted");
                }
                self.verdicts.insert(op, Verdict::Committed);
                PeerEvent::Verdict(op)
            }
            Message::OpAborted { epoch, derived, seq, failure } => {
                let op = OpId { epoch, derived, seq: Seq(seq) };
                // Our lap came round (every member finished), or the master said so: the
                // collective committed, and the master aborts none that did.
                let committed = self.verdicts.get(&op) == Some(&Verdict::Committed);
                if committed || self.committed_ops.contains(&op) {
                    return Err(UnexpectedMessage { got: "OpAborted", why: "an abort of a collective that committed" });
                }
                // (Calls at the whole group's point: a derived group's collective is at none.)
                let next =
                    derived == 0 && self.committed.as_ref().is_some_and(|(e, _)| *e == epoch) && self.started == seq;
                if let Some(misuse) = failure.reason.misuse().filter(|_| next && !self.told) {
                    // The others ended the collective we would run next as calls that cannot
                    // complete together: whatever we call there is one of them.
                    self.settled_here = Some(misuse.clone());
                }
                self.verdicts.insert(op, Verdict::Aborted(failure));
                PeerEvent::Verdict(op)
            }
            Message::Gathered { epoch, seq, included, pending } => {
                let op = OpId { epoch, derived: 0, seq: Seq(seq) };
                let in_force = self.committed.as_ref().map(|(e, _)| *e);
                // The master names the members of a whole group's collective of the topology in
                // force, once (to a member that calls it late, again: the same).
                if in_force.is_some_and(|e| e == epoch) {
                    if self.gathered.len() >= MAX_GATHERED_HEARD {
                        self.gathered.pop_first();
                    }
                    self.gathered.insert(op, included);
                    if self.pending_at.len() >= MAX_GATHERED_HEARD {
                        self.pending_at.pop_first();
                    }
                    self.pending_at.insert(op, pending);
                }
                PeerEvent::Gathered(op)
            }
            Message::VoteOpened { vote, epoch, voter, collectives } => {
                if self.registered.is_some_and(|(me, _)| me == voter) {
                    return unexpected("our own vote announced to us");
                }
                let open = VoteOpen { vote, epoch, voter, collectives };
                if self.vote_open.as_ref().is_none_or(|o| o.epoch != epoch || collectives < o.collectives) {
                    self.vote_open = Some(open.clone());
                }
                if self.announced.as_ref().is_none_or(|o| o.epoch != epoch || collectives < o.collectives) {
                    self.announced = Some(open);
                }
                // The vote that blocks is the earliest voter's: a later count blocks nothing more.
                debug_assert!(self
                    .vote_open
                    .as_ref()
                    .is_some_and(|o| o.epoch == epoch && o.collectives <= collectives));
                debug_assert!(self
                    .announced
                    .as_ref()
                    .is_some_and(|o| o.epoch == epoch && o.collectives <= collectives));
                PeerEvent::Nothing
            }
            Message::PeersPendingAborted { retry, reason } => {
                self.vote_open = None;
                self.vote_ended(retry, &reason);
                self.pending_aborted = Some(VoteAbort::of(retry, reason, "PeersPendingAborted")?);
                PeerEvent::Nothing
            }
            Message::TopologyVoteAborted { retry, reason } => {
                self.vote_open = None;
                self.vote_ended(retry, &reason);
                self.vote_aborted = Some(VoteAbort::of(retry, reason, "TopologyVoteAborted")?);
                PeerEvent::Nothing
            }
            Message::SyncPlan { round, revision, entries } => {
                self.vote_open = None;
                self.sync_plan = Some((round, revision, entries));
                PeerEvent::Nothing
            }
            Message::SyncComplete { round } => {
                self.sync_end = Some((round, Ok(())));
                PeerEvent::Nothing
            }
            Message::P2pWaits { peer, any, send, tag, seen, epoch, collectives } => {
                if self.registered.is_none_or(|(me, _)| me == peer) {
                    return unexpected("a wait on a transfer with ourselves");
                }
                if peer == PeerId::ANY {
                    return unexpected("a wait relayed without its waiter");
                }
                self.waiters.insert(peer, WaitNote { any, send, tag, seen, point: (epoch, collectives) });
                PeerEvent::MemberWaits(peer)
            }
            Message::P2pResumed { peer } => {
                self.waiters.remove(&peer);
                PeerEvent::Nothing
            }
            Message::P2pApart { peer, misuse } => {
                // Relayed to the waiter, us: it names our transfer and the other end's call.
                // From a receive of ours from any member: the call most of the others are in.
                let theirs = peer == PeerId::ANY || misuse.theirs.peers == [peer];
                if self.registered.is_none_or(|(me, _)| misuse.ours.peers != [me]) || !theirs {
                    return Err(UnexpectedMessage { got: "P2pApart", why: "it names other calls than our wait's" });
                }
                PeerEvent::P2pApart { peer, misuse }
            }
            Message::P2pOutcome { peer, epoch, number, send } => {
                PeerEvent::P2pOutcome(TransferName { peer, epoch, number, send })
            }
            Message::P2pDecided { peer, epoch, number, send, done } => {
                PeerEvent::P2pDecided(TransferName { peer, epoch, number, send }, done)
            }
            Message::Snapshot { round: 0 } => {
                self.snapshot_order = None;
                PeerEvent::DropSnapshot
            }
            Message::Snapshot { round } => {
                self.snapshot_order = Some(round);
                PeerEvent::Nothing
            }
            Message::CatchUpPlan { round, revision, entries, donors, reason } => {
                self.catch_up_plan = Some(CatchUpPlan { round, revision, entries, donors, reason });
                PeerEvent::Nothing
            }
            Message::SyncAborted { round, retryable, reason } => {
                self.vote_open = None;
                self.vote_ended(retryable, &reason);
                self.sync_end = Some((round, Err(SyncAbort { retryable, reason })));
                PeerEvent::Nothing
            }
            Message::OpQuery { epoch, derived, seq } => {
                let op = OpId { epoch, derived, seq: Seq(seq) };
                // The master needs the answer to decide for a participant that could not tell.
                let committed = self.committed_ops.contains(&op);
                if committed {
                    self.outbox.push_back(done_on_our_own(op));
                } else if self.never_starts(op) {
                    self.never_started(op);
                } else {
                    self.queried.insert(op);
                }
                debug_assert!(
                    !self.queried.contains(&op) || !(committed || self.never_starts(op)),
                    "a query answered now is kept to answer later"
                );
                PeerEvent::Query { op, committed }
            }
            Message::Kicked { reason } => {
                self.kicked = Some(reason);
                PeerEvent::Kicked
            }
            Message::Challenge { nonce } => {
                if self.challenge.is_some() || self.registered.is_some() {
                    return unexpected("a second challenge");
                }
                self.challenge = Some(nonce);
                PeerEvent::Nothing
            }
            Message::AuthFailed { reason } => {
                self.refused = Some(reason);
                PeerEvent::Kicked
            }
            _ => return unexpected("not a master-to-peer message"),
        })
    }

    /// Collectives this peer started in derived group `derived` (0: the whole group) in the
    /// committed topology.
    pub fn started_in(&self, derived: u64) -> u64 {
        if derived == 0 {
            self.started
        } else {
            self.derived_started.get(&derived).copied().unwrap_or(0)
        }
    }

    /// Counts a collective started in derived group `derived` (0: the whole group): the next
    /// one's number there. A collective of the whole group is a call at the group's point.
    fn count_started(&mut self, derived: u64) -> u64 {
        let seq = self.started_in(derived);
        if derived == 0 {
            self.started += 1;
            self.called();
        } else {
            self.derived_started.insert(derived, seq + 1);
        }
        assert_eq!(self.started_in(derived), seq + 1, "collective {seq} started twice");
        seq
    }

    /// How many collectives after `op` in its topology and group we heard the master decide
    /// (called with a deadline) without us, `me`. (One that names us we called already, with
    /// several in flight.)
    pub fn decided_past(&self, op: OpId, me: PeerId) -> u64 {
        let last = OpId { seq: Seq(u64::MAX), ..op };
        let past = self.gathered.range((std::ops::Bound::Excluded(op), std::ops::Bound::Included(last)));
        past.filter(|(_, included)| !included.contains(&me)).count() as u64
    }

    /// Numbers this peer's next collective in derived group `derived` (0: the topology's whole
    /// group): the committed topology, the group, its number there; the same on every member
    /// since each starts the same collectives of a group in the same order.
    ///
    /// # Errors
    /// The collective it would have run in the topology it left, with the failure the others
    /// saw, when they failed it before this peer started it: the call fails without running,
    /// like theirs, and the next one runs in the new topology. Likewise one that ran among the
    /// others without it (called with a deadline): the call ends left out of it.
    ///
    /// # Panics
    /// If no topology is in force: the caller checks that it is connected first.
    pub fn start_collective(&mut self, derived: u64) -> Result<OpId, (OpId, Missed)> {
        if let Some(i) = self.missed.iter().position(|(op, _)| op.derived == derived) {
            let missed = self.missed.remove(i).expect("found");
            debug_assert!(
                self.committed.as_ref().is_some_and(|(c, _)| missed.0.epoch < *c),
                "a collective missed in the topology in force"
            );
            // It ended in the topology we left, as the others' calls of it did.
            self.collective_ended(missed.0, matches!(missed.1, Missed::LeftOut(_)));
            return Err(missed);
        }
        let epoch = self.committed.as_ref().expect("a collective needs a topology in force").0;
        let seq = self.count_started(derived);
        assert!(derived != 0 || self.settled_here.is_none(), "a collective begun at a point settled apart");
        Ok(OpId { epoch, derived, seq: Seq(seq) })
    }

    /// The collective this peer would run next in derived group `derived` (0: the whole group),
    /// if the others failed it already: it fails here too, untouched, before this peer joins a
    /// re-formed ring (the others may be in no call). Not for misuse this peer was told of: it
    /// was in the other call, which failed already (as [`PeerView::missed`] leaves misuse out).
    pub fn fail_next(&mut self, derived: u64) -> Option<(OpId, OpFailure)> {
        let epoch = self.committed.as_ref()?.0;
        let op = OpId { epoch, derived, seq: Seq(self.started_in(derived)) };
        let Some(Verdict::Aborted(failure)) = self.verdicts.get(&op) else { return None };
        if failure.kind == FailureKind::Misuse && self.told && derived == 0 {
            return None;
        }
        let failed = (op, failure.clone());
        self.count_started(derived);
        self.collective_ended(op, false);
        debug_assert!(
            derived != 0 || (self.settled_here.is_none() && self.announced.is_none()),
            "a call made keeps older news"
        );
        assert!(derived != 0 || self.failed_in >= Some(epoch), "a failure this peer took on is forgotten");
        Some(failed)
    }

    /// This peer made a call at its point: what was announced or settled before concerns it no
    /// more.
    fn called(&mut self) {
        (self.announced, self.settled_here, self.told) = (None, None, false);
    }

    /// Starts this peer's call `vote` (after it joined any issued topology): forgets what an
    /// earlier call of that kind left behind, and the collective it missed (a vote is another
    /// call); returns the count of collectives the vote carries (`VoteOpened`).
    pub fn cast_vote(&mut self, vote: Vote) -> u64 {
        debug_assert!(self.committed.is_some(), "a vote cast outside any topology");
        self.missed.clear();
        self.called();
        match vote {
            Vote::UpdateTopology => self.vote_aborted = None,
            Vote::PeersPending => self.pending_aborted = None,
            Vote::SyncSharedState => {
                self.sync_plan = None;
                self.sync_end = None;
            }
        }
        assert!(self.missed.is_empty() && self.announced.is_none(), "a vote carries what an earlier call left");
        self.started
    }

    /// The next step of a call that waits for a topology, having handled (established, or reported
    /// unreachable) topology `handled` so far; `voting` when the call is our `update_topology`
    /// vote. `None`: wait for the master.
    pub fn topology_step(&mut self, handled: Option<Epoch>, voting: bool) -> Option<TopologyStep> {
        debug_assert!(self.registered.is_some(), "a call waits for a topology before registration");
        if voting {
            match self.vote_aborted.take() {
                Some(VoteAbort::Retry) => return Some(TopologyStep::VoteRefused),
                Some(VoteAbort::Abandoned(misuse)) => return Some(TopologyStep::VoteAbandoned(misuse)),
                None => {}
            }
        }
        if let Some((e, m)) = self.issued.as_ref().filter(|(e, _)| Some(*e) != handled) {
            debug_assert!(self.committed.as_ref().is_none_or(|(c, _)| c <= e), "{e:?} issued behind the commit");
            return Some(TopologyStep::Establish(*e, m.clone()));
        }
        match &self.committed {
            Some((e, m)) if Some(*e) == handled => Some(TopologyStep::InForce(*e, m.clone())),
            _ => None,
        }
    }

    /// Whether collective `op`, still moving data here with `waits_on`, must stop. The driver
    /// asks before it sleeps: what the master said since may end it.
    pub fn interrupt(&self, op: OpId, api: Api, waits_on: &[PeerId]) -> Option<Interrupt> {
        let (epoch, seq) = (op.epoch, op.seq.0);
        // A collective running here was started here, in a topology committed.
        let in_force = self.committed.as_ref().map(|(e, _)| *e);
        debug_assert!(
            in_force.is_some_and(|c| epoch < c || (epoch == c && seq < self.started_in(op.derived))),
            "{op} never started"
        );
        if let Some(Verdict::Aborted(f)) = self.verdicts.get(&op) {
            return Some(Interrupt::Aborted(f.clone()));
        }
        let (me, _) = self.registered.expect("a collective runs once registered");
        let blocked = self.vote_open.as_ref().and_then(|o| match op.derived {
            0 => o.blocks(epoch, seq, api, me),
            // A voter runs nothing else: one this collective still moves data with never
            // started it.
            _ => o.blocks_derived(epoch, api, me, waits_on),
        });
        if let Some(why) = blocked {
            return Some(Interrupt::Blocked(why));
        }
        if let Some(p) = waits_on.iter().find(|p| self.removed.contains(p)) {
            return Some(Interrupt::MemberLost(*p));
        }
        // (The whole group's collectives: a topology is issued after one of their members was
        // lost, which stops them above, at its neighbours first.)
        let newer = self.issued.as_ref().map(|(e, _)| *e).filter(|e| *e > epoch);
        newer.filter(|_| op.derived != 0 && !waits_on.is_empty()).map(Interrupt::Superseded)
    }

    /// Whether the confirmation lap of collective `op` (among `members`) must stop; takes the
    /// verdict if there is one.
    pub fn lap_interrupt(&mut self, op: OpId, members: &[PeerId]) -> Option<LapInterrupt> {
        debug_assert!(members.len() >= 2, "a lap of {} member", members.len());
        debug_assert!(
            self.committed.as_ref().is_some_and(|(c, _)| op.epoch <= *c),
            "a lap in a topology never committed"
        );
        if let Some(v) = self.verdicts.remove(&op) {
            return Some(LapInterrupt::Verdict(v));
        }
        members.iter().find(|p| self.removed.contains(p)).map(|p| LapInterrupt::MemberLost(*p))
    }

    /// A vote of our group ended (`retry`: to be cast again) with `reason`, the master told every
    /// member: if it ended as calls that cannot complete together where this peer's next call
    /// is, that call is one of them ([`PeerView::settled_here`]).
    fn vote_ended(&mut self, retry: bool, reason: &Reason) {
        let Some(open) = self.announced.take() else { return };
        let here = self.committed.as_ref().is_some_and(|(e, _)| *e == open.epoch) && self.started == open.collectives;
        if let Some(misuse) = reason.misuse().filter(|_| !retry && here && !self.told) {
            self.settled_here = Some(misuse.clone());
        }
        assert!(self.announced.is_none(), "an ended vote is still announced");
    }

    /// Records how this peer's last call other than a collective ended: a failure remembers the
    /// topology it failed in (the first since the last success: the ring re-forms after it).
    pub fn call_ended(&mut self, ok: bool) {
        if ok {
            self.failed_in = None;
        } else if let Some((e, _)) = &self.committed {
            self.failed_in.get_or_insert(*e);
        }
        assert!(ok || self.committed.is_none() || self.failed_in.is_some(), "a failed call is forgotten");
    }

    /// Records how collective `op` ended. Several run at once and end in any order, so only a
    /// success in a later topology than the latest failure forgets it: every member then comes to
    /// the same answer in [`PeerView::vote_needed`], whatever order its collectives ended in (a
    /// failure in topology 5, then one in 6 and a success in 6 leave the failure in 6 standing:
    /// the ring re-forms after it). A derived group's collective counts for nothing here: its
    /// outcome is agreed among its members alone, and the whole group's members must agree.
    pub fn collective_ended(&mut self, op: OpId, ok: bool) {
        if op.derived != 0 {
            return;
        }
        let epoch = op.epoch;
        let before = self.failed_in;
        if !ok {
            self.failed_in = self.failed_in.max(Some(epoch));
        } else if self.failed_in.is_some_and(|failed| failed < epoch) {
            self.failed_in = None;
        }
        // Order-free: a failure is forgotten only for a success in a later topology.
        assert!(ok || self.failed_in >= Some(epoch), "a failure in {epoch:?} is not kept");
        assert!(
            !ok || self.failed_in.is_none_or(|f| f >= epoch && before == Some(f)),
            "a success keeps an older failure"
        );
    }

    /// Whether an `update_topology` called now must vote. Not after a failed call once the master
    /// has re-formed the ring (`docs/protocol.md`, "Retry"): the survivors that saw no error
    /// already run in the new topology, and would never join the vote. The vote is for admission,
    /// and newcomers are admitted at the next vote every peer makes. Consumes the failure.
    pub fn vote_needed(&mut self) -> bool {
        let committed = self.committed.as_ref().map(|(e, _)| *e);
        debug_assert!(self.failed_in <= committed, "a failure in a topology never committed");
        if self.failed_in.is_some_and(|failed| committed > Some(failed)) {
            self.failed_in = None;
            return false;
        }
        true
    }

    /// Whether collective `op` will never start here: it is beyond those we started in its
    /// group in the topology in force, and a newer one was issued (our next call joins it first).
    fn never_starts(&self, op: OpId) -> bool {
        let in_force = self.committed.as_ref().is_some_and(|(e, _)| *e == op.epoch);
        let newer = self.issued.as_ref().is_some_and(|(e, _)| *e > op.epoch);
        in_force && newer && op.seq.0 >= self.started_in(op.derived)
    }

    /// Tells the master that we never started collective `op` and never will: we sent no token
    /// of it, so nobody committed it, and the master may abort it for the members that wait for
    /// its verdict (they would otherwise wait out their bound). The master asked about it, so
    /// it knows a derived group's members already.
    fn never_started(&mut self, op: OpId) {
        debug_assert!(self.never_starts(op), "{op} may yet start here");
        let me = self.registered.map_or(PeerId(0), |(me, _)| me);
        let reason = format!("{me} never started it: a newer topology was issued first");
        let failure = OpFailure::new(FailureKind::Superseded, me, reason);
        let (epoch, derived, seq) = (op.epoch, op.derived, op.seq.0);
        self.outbox.push_back(Message::OpFailed { epoch, derived, seq, members: Vec::new(), failure });
    }

    /// Records that we committed collective `op` on our own; if the master asked about it
    /// meanwhile, the answer waits in [`PeerView::poll_output`].
    pub fn commit_on_our_own(&mut self, op: OpId) {
        self.remember_commit(op);
        if self.queried.remove(&op) {
            self.outbox.push_back(done_on_our_own(op));
        }
        debug_assert!(self.committed_ops.contains(&op) && !self.queried.contains(&op));
    }

    /// Records that collective `op` committed here, to answer a query about it.
    pub fn remember_commit(&mut self, op: OpId) {
        self.committed_ops.insert(op);
        if self.committed_ops.len() > REMEMBERED_COMMITS {
            self.committed_ops.pop_first();
        }
        assert!(self.committed_ops.len() <= REMEMBERED_COMMITS, "commits are remembered without a cap");
    }

    /// The next message to the master this view decided on (the answer to a query): the driver
    /// drains these after every input and sends them in order.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<Message> {
        self.outbox.pop_front()
    }

    /// Our position in the ring of `members` (an issued or committed topology).
    ///
    /// # Panics
    /// If we are not registered or not a member: [`PeerView::handle_message`] rejects such
    /// topologies.
    pub fn position(&self, epoch: Epoch, members: &[Member]) -> RingPosition {
        let (me, _) = self.registered.expect("a topology is only accepted once registered");
        let ring: Arc<[Member]> = members.into();
        let rank = ring.iter().position(|m| m.peer == me).expect("we are a member");
        let (world, limits) = self.issued_with.get(&epoch).copied().unwrap_or((0, None));
        let world_size = (world as usize).max(ring.len());
        assert!(ring[rank].peer == me && world_size >= ring.len(), "our rank names another member");
        RingPosition { epoch, rank, ring, world_size, limits }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Collective `seq` of the whole group of topology `epoch`.
    fn op(epoch: Epoch, seq: u64) -> OpId {
        OpId { epoch, derived: 0, seq: Seq(seq) }
    }

    #[test]
    fn a_query_is_answered_now_if_we_committed_and_remembered_otherwise() {
        let mut v = PeerView::default();
        let (e, later) = (Epoch(3), Epoch(4));
        v.commit_on_our_own(op(e, 0));
        assert_eq!(v.poll_output(), None, "nobody asked");
        let query = |seq| Message::OpQuery { derived: 0, epoch: e, seq };
        let done = |seq| Some(Message::OpDone { derived: 0, members: Vec::new(), epoch: e, seq, decided: true });
        assert_eq!(v.handle_message(query(0)), Ok(PeerEvent::Query { op: op(e, 0), committed: true }));
        assert_eq!(v.poll_output(), done(0), "committed already: answered at once");
        assert_eq!(v.handle_message(query(1)), Ok(PeerEvent::Query { op: op(e, 1), committed: false }));
        assert_eq!(v.poll_output(), None);
        v.commit_on_our_own(op(e, 1));
        assert_eq!(v.poll_output(), done(1), "asked before we committed: told when we do");
        let other = Message::OpQuery { derived: 0, epoch: later, seq: 0 };
        assert_eq!(v.handle_message(other), Ok(PeerEvent::Query { op: op(later, 0), committed: false }));
        assert_eq!(v.poll_output(), None);
    }

    /// A failed call is followed by a vote only while the ring has not re-formed since; any
    /// successful call ends that.
    #[test]
    fn a_vote_after_a_failure_is_needed_only_until_the_ring_re_forms() {
        let mut v = registered_alone();
        commit(&mut v, 1);
        assert!(v.vote_needed(), "no failure: a real vote");
        v.call_ended(false);
        assert!(v.vote_needed(), "failed, not yet re-formed: vote");
        commit(&mut v, 2);
        assert!(!v.vote_needed(), "re-formed since the failure: nothing to vote on");
        assert!(v.vote_needed(), "consumed");
        v.call_ended(false);
        v.call_ended(true);
        commit(&mut v, 3);
        assert!(v.vote_needed(), "a success since the failure: a real vote");
    }

    /// Collectives end in any order: a failure in topology 1, then one in 2 and a success in 2
    /// (the batch of a failed iteration ran on in the re-formed ring, half of it failed again)
    /// leave the failure in 2 standing, so that an `update_topology` once the ring re-formed
    /// after it is a no-op here as on the members whose collectives ended in another order
    /// (simulated seed 944 found a member voting in the ring the others had already left).
    #[test]
    fn a_success_forgets_only_failures_of_earlier_topologies() {
        let mut v = registered_alone();
        commit(&mut v, 1);
        v.collective_ended(op(Epoch(1), 0), false);
        commit(&mut v, 2);
        v.collective_ended(op(Epoch(2), 0), false);
        v.collective_ended(op(Epoch(2), 0), true);
        commit(&mut v, 3);
        assert!(!v.vote_needed(), "re-formed after the failure in 2: nothing to vote on");
        // In the other order the answer is the same.
        let mut w = registered_alone();
        commit(&mut w, 1);
        w.collective_ended(op(Epoch(1), 0), false);
        commit(&mut w, 2);
        w.collective_ended(op(Epoch(2), 0), true);
        w.collective_ended(op(Epoch(2), 0), false);
        commit(&mut w, 3);
        assert!(!w.vote_needed());
    }

    /// Members that finished a collective ask the master, which queries the others; one that
    /// never started it (a newer topology came first, so its next call joins that) says so, and
    /// the master aborts it rather than leave the askers waiting out their bound (sim seed 866).
    #[test]
    fn a_query_about_a_collective_we_will_never_start_is_answered_with_a_failure() {
        let mut v = registered_alone();
        commit(&mut v, 1);
        assert_eq!(v.start_collective(0), Ok(op(Epoch(1), 0)));
        let query = |seq| Message::OpQuery { derived: 0, epoch: Epoch(1), seq };
        v.handle_message(query(1)).unwrap();
        assert_eq!(v.poll_output(), None, "we may yet start it");
        v.handle_message(query(0)).unwrap();
        v.handle_message(Message::Topology {
            epoch: Epoch(2),
            members: vec![member(0, 0)].into(),
            world: 1,
            limits: None,
        })
        .unwrap();
        assert!(
            matches!(v.poll_output(), Some(Message::OpFailed { derived: 0, epoch: Epoch(1), seq: 1, failure, .. })
                if failure.kind == FailureKind::Superseded),
            "a newer topology was issued: we never will"
        );
        assert_eq!(v.poll_output(), None, "collective 0 is ours: it reports on its own");
        v.handle_message(query(2)).unwrap();
        assert!(
            matches!(v.poll_output(), Some(Message::OpFailed { derived: 0, epoch: Epoch(1), seq: 2, .. })),
            "asked later"
        );
    }

    /// A member that had not started the collective the others failed (it joined the re-formed
    /// ring first) fails its own call of it, so that programs stay in step.
    #[test]
    fn a_collective_the_others_failed_before_we_started_it_fails_here_too() {
        let mut v = registered_alone();
        commit(&mut v, 1);
        assert_eq!(v.start_collective(0), Ok(op(Epoch(1), 0)));
        assert_eq!(v.start_collective(0), Ok(op(Epoch(1), 1)));
        let failure = OpFailure::new(FailureKind::PeerLost, PeerId(3), "gone");
        v.handle_message(Message::OpAborted { derived: 0, epoch: Epoch(1), seq: 2, failure: failure.clone() }).unwrap();
        commit(&mut v, 2);
        assert_eq!(v.start_collective(0), Err((op(Epoch(1), 2), Missed::Failed(failure))));
        assert_eq!(v.start_collective(0), Ok(op(Epoch(2), 0)), "the retry runs in the new topology");
        // An abort of a collective we started (and failed ourselves) voids nothing.
        let failure = OpFailure::new(FailureKind::PeerLost, PeerId(3), "gone");
        v.handle_message(Message::OpAborted { derived: 0, epoch: Epoch(2), seq: 0, failure }).unwrap();
        commit(&mut v, 3);
        assert_eq!(v.start_collective(0), Ok(op(Epoch(3), 0)));
    }

    /// A derived group numbers its collectives apart from the whole group's and every other's;
    /// after a re-form, its next call fails like the one the others failed before this member
    /// started it, and the whole group's calls are not touched by it (nor is whether the whole
    /// group's `update_topology` after a failure must vote: a member of another derived group
    /// never learns how this one's collectives ended).
    #[test]
    fn a_derived_group_numbers_its_collectives_apart_and_misses_what_the_others_failed() {
        let mut v = registered_alone();
        commit(&mut v, 1);
        let of = |derived, seq| OpId { epoch: Epoch(1), derived, seq: Seq(seq) };
        assert_eq!(v.start_collective(0), Ok(op(Epoch(1), 0)));
        assert_eq!(v.start_collective(5), Ok(of(5, 0)));
        assert_eq!(v.start_collective(5), Ok(of(5, 1)));
        assert_eq!(v.start_collective(9), Ok(of(9, 0)));
        assert_eq!(v.start_collective(0), Ok(op(Epoch(1), 1)));
        let failure = OpFailure::new(FailureKind::PeerLost, PeerId(3), "gone");
        v.handle_message(Message::OpAborted { derived: 5, epoch: Epoch(1), seq: 2, failure: failure.clone() }).unwrap();
        commit(&mut v, 2);
        assert_eq!(v.start_collective(0), Ok(op(Epoch(2), 0)), "the whole group missed nothing");
        assert_eq!(v.start_collective(5), Err((of(5, 2), Missed::Failed(failure))));
        let next = v.start_collective(5).unwrap();
        assert_eq!(next, OpId { epoch: Epoch(2), derived: 5, seq: Seq(0) });
        // Only the group's members agree on its outcomes: the whole group's answers ignore them.
        v.collective_ended(next, false);
        assert_eq!(v.failed_in, None, "a derived group's failure decides nothing of the whole group's calls");
    }

    /// A vote in the whole group blocks a derived group's collective only while that still moves
    /// data with the voter, which runs nothing beside its vote.
    #[test]
    fn a_vote_blocks_a_derived_collective_that_moves_data_with_the_voter() {
        let mut v = registered_alone();
        commit(&mut v, 1);
        let ours = v.start_collective(5).unwrap();
        let open =
            Message::VoteOpened { vote: Vote::UpdateTopology, epoch: Epoch(1), voter: PeerId(1), collectives: 0 };
        v.handle_message(open).unwrap();
        assert_eq!(v.interrupt(ours, Api::AllReduce, &[PeerId(2)]), None, "data only with peer#2 left");
        assert!(
            matches!(v.interrupt(ours, Api::AllReduce, &[PeerId(1)]), Some(Interrupt::Blocked(why)) if why.names(Api::UpdateTopology))
        );
    }

    /// What stops a running collective, in the order the peer and the simulator both apply: the
    /// master's abort, a vote the collective can never complete against, a removed participant.
    #[test]
    fn a_running_collective_is_interrupted_by_an_abort_a_blocking_vote_or_a_lost_member() {
        let mut v = registered_alone();
        commit(&mut v, 1);
        for _ in 0..3 {
            v.start_collective(0).unwrap();
        }
        let members = [PeerId(0), PeerId(1)];
        assert_eq!(v.interrupt(op(Epoch(1), 2), Api::AllReduce, &members), None);
        v.handle_message(Message::PeerRemoved { peer: PeerId(1) }).unwrap();
        assert_eq!(v.interrupt(op(Epoch(1), 2), Api::AllReduce, &members), Some(Interrupt::MemberLost(PeerId(1))));
        assert_eq!(v.lap_interrupt(op(Epoch(1), 2), &members), Some(LapInterrupt::MemberLost(PeerId(1))));
        let open = Message::VoteOpened { vote: Vote::PeersPending, epoch: Epoch(1), voter: PeerId(1), collectives: 2 };
        v.handle_message(open).unwrap();
        assert!(
            matches!(v.interrupt(op(Epoch(1), 2), Api::AllReduce, &members), Some(Interrupt::Blocked(why)) if why.names(Api::PeersPending))
        );
        assert_eq!(
            v.interrupt(op(Epoch(1), 1), Api::AllReduce, &members),
            Some(Interrupt::MemberLost(PeerId(1))),
            "started before the vote"
        );
        let failure = crate::mismatched(1, 2, 0, 1);
        v.handle_message(Message::OpAborted { derived: 0, epoch: Epoch(1), seq: 2, failure: failure.clone() }).unwrap();
        assert_eq!(v.interrupt(op(Epoch(1), 2), Api::AllReduce, &members), Some(Interrupt::Aborted(failure.clone())));
        assert_eq!(v.lap_interrupt(op(Epoch(1), 2), &members), Some(LapInterrupt::Verdict(Verdict::Aborted(failure))));
    }

    /// A call waiting for a topology establishes each issued one once, is done when the one it
    /// established commits, and (when it is our vote) ends on a refusal or an abandonment.
    #[test]
    fn a_call_waiting_for_a_topology_establishes_each_once_and_ends_when_it_commits() {
        let mut v = registered_alone();
        assert_eq!(v.topology_step(None, false), None);
        let members = vec![member(0, 0)];
        v.handle_message(Message::Topology {
            epoch: Epoch(1),
            members: members.clone().into(),
            world: 3,
            limits: None,
        })
        .unwrap();
        assert_eq!(v.topology_step(None, false), Some(TopologyStep::Establish(Epoch(1), members.clone())));
        assert_eq!(v.topology_step(Some(Epoch(1)), false), None, "established: wait for the commit");
        v.handle_message(Message::TopologyCommitted { epoch: Epoch(1) }).unwrap();
        assert_eq!(v.topology_step(Some(Epoch(1)), false), Some(TopologyStep::InForce(Epoch(1), members)));
        v.handle_message(Message::TopologyVoteAborted { retry: true, reason: Reason::text("connecting") }).unwrap();
        assert_eq!(v.topology_step(Some(Epoch(1)), false), Some(TopologyStep::InForce(Epoch(1), vec![member(0, 0)])));
        assert_eq!(v.topology_step(Some(Epoch(1)), true), Some(TopologyStep::VoteRefused), "only a vote hears it");
        let ran = Misuse::new(
            Called::new([PeerId(0)], Call::api(Vote::UpdateTopology)),
            Called::new([PeerId(1)], Call::api(Api::AllReduce)),
        );
        v.handle_message(Message::TopologyVoteAborted { retry: false, reason: ran.clone().into() }).unwrap();
        assert_eq!(v.topology_step(None, true), Some(TopologyStep::VoteAbandoned(ran)));
    }

    /// What the master relays must concern us as it says: an announced vote is another member's,
    /// a wait is on a transfer with another member, an answer to our wait names our transfer and
    /// the other end's call. Otherwise the master is broken.
    #[test]
    fn relayed_news_that_does_not_concern_us_is_refused() {
        let mut v = registered_alone();
        commit(&mut v, 1);
        let ours = Message::VoteOpened { vote: Vote::PeersPending, epoch: Epoch(1), voter: PeerId(0), collectives: 0 };
        assert_eq!(v.handle_message(ours).map_err(|e| e.why), Err("our own vote announced to us"));
        let waits = Message::P2pWaits {
            peer: PeerId(0),
            any: false,
            send: true,
            tag: 3,
            seen: 0,
            epoch: Epoch(1),
            collectives: 0,
        };
        assert_eq!(v.handle_message(waits).map_err(|e| e.why), Err("a wait on a transfer with ourselves"));
        let send = |from: u32| Called::new([PeerId(from)], Call::Transfer { send: true, peer: PeerId(1), tag: 3 });
        let vote = Called::new([PeerId(1)], Call::api(Vote::PeersPending));
        let others = Misuse::new(send(2), vote.clone());
        assert!(v.handle_message(Message::P2pApart { peer: PeerId(1), misuse: others }).is_err());
        let ours = Misuse::new(send(0), vote);
        assert!(matches!(
            v.handle_message(Message::P2pApart { peer: PeerId(1), misuse: ours }),
            Ok(PeerEvent::P2pApart { .. })
        ));
        // A vote abandoned, not refused for now, names the calls (the wire checks it too).
        let words = Message::PeersPendingAborted { retry: false, reason: Reason::text("no calls named") };
        assert_eq!(v.handle_message(words).map_err(|e| e.why), Err("an abandoned vote that names no calls"));
    }

    /// Peer 0, registered, in no topology yet.
    /// Verdicts never change, and no collective that committed is aborted: a master that says
    /// otherwise is broken, and refused.
    #[test]
    fn a_verdict_against_a_commit_or_an_earlier_verdict_is_refused() {
        let mut v = registered_alone();
        let abort =
            |seq| Message::OpAborted { derived: 0, epoch: Epoch(1), seq, failure: crate::mismatched(1, seq, 1, 0) };
        v.commit_on_our_own(op(Epoch(1), 3));
        assert!(v.handle_message(abort(3)).is_err(), "our lap came round");
        v.handle_message(Message::OpCommitted { derived: 0, epoch: Epoch(1), seq: 4 }).unwrap();
        assert!(v.handle_message(abort(4)).is_err(), "the master committed it");
        v.handle_message(abort(5)).unwrap();
        v.handle_message(abort(5)).unwrap();
        assert!(
            v.handle_message(Message::OpCommitted { derived: 0, epoch: Epoch(1), seq: 5 }).is_err(),
            "it aborted it"
        );
    }

    fn registered_alone() -> PeerView {
        registered(0)
    }

    /// Peer `p`, registered, in no topology yet.
    fn registered(p: u32) -> PeerView {
        let mut v = PeerView::default();
        let message =
            Message::Registered { peer: PeerId(p), session: SessionId(1), heartbeat_ms: 100, data_key: [0; 32] };
        v.handle_message(message).unwrap();
        v
    }

    /// Topology `e` with peer 0 alone is issued and comes into force.
    fn commit(v: &mut PeerView, e: u64) {
        let members = vec![member(0, 0)];
        v.handle_message(Message::Topology { epoch: Epoch(e), members: members.into(), world: 1, limits: None })
            .unwrap();
        v.handle_message(Message::TopologyCommitted { epoch: Epoch(e) }).unwrap();
    }

    fn member(p: u32, g: u32) -> Member {
        Member {
            peer: PeerId(p),
            group: shoal_wire::GroupId(g),
            addr: format!("h:{p}"),
            site: None,
            dialable: true,
            seen: None,
        }
    }

    /// A topology lists our group's members; the run's other groups count only in its size.
    #[test]
    fn ring_position_is_taken_in_our_group_and_the_world_counts_every_group() {
        let mut v = registered(3);
        let mixed = vec![member(1, 0), member(2, 1), member(3, 0)];
        let topology = |members: Vec<Member>, world| Message::Topology {
            epoch: Epoch(2),
            members: members.into(),
            world,
            limits: None,
        };
        assert!(v.handle_message(topology(mixed, 4)).is_err(), "a topology of two groups");
        let members = vec![member(1, 0), member(3, 0), member(4, 0)];
        assert!(v.handle_message(topology(members.clone(), 2)).is_err(), "a run smaller than its group");
        let ev = v.handle_message(topology(members.clone(), 4));
        assert_eq!(ev, Ok(PeerEvent::TopologyIssued(Epoch(2))));
        let pos = v.position(Epoch(2), &members);
        assert_eq!((pos.rank, pos.group_size(), pos.world_size), (1, 3, 4));
        assert_eq!((pos.prev().peer, pos.next().peer), (PeerId(1), PeerId(4)));
        assert!(v.handle_message(Message::TopologyCommitted { epoch: Epoch(1) }).is_err());
        assert_eq!(
            v.handle_message(Message::TopologyCommitted { epoch: Epoch(2) }),
            Ok(PeerEvent::TopologyCommitted(Epoch(2)))
        );
        assert!(v.handle_message(topology(members, 4)).is_err(), "an epoch issued twice");
        assert!(v.handle_message(Message::VotePeersPending { collectives: 0 }).is_err());
    }
}
