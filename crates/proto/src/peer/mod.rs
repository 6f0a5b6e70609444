//! A peer's side of the protocol as a sans-IO state machine: [`Peer`].
//!
//! [`Peer`] takes every decision a peer makes: it numbers collectives, follows the topologies the
//! master issues, casts and retries votes, decides when a collective must stop, reports failures
//! and asks for verdicts, runs the steps of a shared-state sync, sends heartbeats and declares a
//! silent master lost. Its driver moves bytes: it feeds in what the master sent
//! ([`Peer::handle_message`]), the passing of time ([`Peer::handle_timeout`]), the application's
//! calls ([`Peer::connect`], [`Peer::call`]) and what its data plane did
//! ([`Peer::handle_established`], [`Peer::handle_collective`], [`Peer::handle_fetched`]); it
//! sends what [`Peer::poll_output`] returns to the master in order, and carries out what
//! [`Peer::poll_action`] asks of the calling thread (open connections, move a collective's data,
//! fetch state) until the call is [`Action::Done`].
//!
//! `crates/peer` drives it with sockets and threads, `crates/sim` with a simulated network: the
//! simulated seeds test the code that ships.

mod transfers;
mod view;

pub use transfers::{
    verb as transfer_verb, Ended, EngineEnd, Stop, Transfer, Transfers, APART_GRACE, ASK_AGAIN, MAX_DECIDED,
    P2P_PATIENCE,
};
pub use view::{
    CatchUpPlan, Interrupt, LapInterrupt, Missed, PeerEvent, PeerView, RingPosition, SyncAbort, TopologyStep,
    TransferName, UnexpectedMessage, Verdict, VoteAbort, VoteOpen, WaitNote,
};

use crate::auth::{DataKey, RunKey};
use crate::master::heartbeat_interval;
use shoal_wire::{
    Api, Call as Made, Called, Epoch, FailureKind, GroupId, Measured, Message, Misuse, OpFailure, PeerId, PeerReport,
    PlanEntry, Reason, SessionId, StateDigest, Vote,
};
use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant};

/// A collective's number within its topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Seq(pub u64);

/// A shared state's revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Revision(pub u64);

/// A collective's name on every participant: its topology, the derived group it runs in, and
/// its number there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpId {
    /// The topology it runs in.
    pub epoch: Epoch,
    /// The derived group it runs in ([`Derived::id`]); 0 for the topology's whole group.
    pub derived: u64,
    /// Its number there.
    pub seq: Seq,
}

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "collective {} of topology {}", self.seq.0, self.epoch.0)?;
        if self.derived != 0 {
            write!(f, " in derived group {:#x}", self.derived)?;
        }
        Ok(())
    }
}

/// The timing a peer keeps, and its credentials.
#[derive(Debug, Clone)]
pub struct PeerConfig {
    /// A master silent this long is lost; a participant's report or verdict is awaited this long.
    pub heartbeat_timeout: Duration,
    /// The key of the run's secret, proved in `Join` (`crate::auth`); `None` proves nothing.
    pub key: Option<RunKey>,
    /// Most collectives in flight at once; later ones wait in [`Peer::call`]'s queue.
    pub max_in_flight: usize,
    /// A broken control connection is not the end: the driver dials the master again for up to
    /// a heartbeat timeout ([`Peer::reconnecting`]), as a master restarted from its state
    /// directory expects. Otherwise the master is lost at once.
    pub reconnect: bool,
}

/// A call of the application: [`Peer::connect`] and [`Peer::call`] name each, and
/// [`Action::Done`] ends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CallId(pub u64);

/// A call of the application, after the peer joined ([`Peer::call`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallKind {
    /// `update_topology`: the admission vote.
    UpdateTopology,
    /// `optimize_topology`, once this peer measured its links to the ring's other members: a
    /// vote like `update_topology`'s that re-orders the ring and admits nobody.
    OptimizeTopology(Vec<Measured>),
    /// `peers_pending`: whether newcomers wait.
    PeersPending,
    /// `sync_shared_state` with this peer's ballot.
    SyncSharedState(SyncBallot),
    /// A collective, by the call users know it as (`all_reduce`, `barrier`, the barrier
    /// `optimize_topology` starts with, ...), in the topology's whole group or a group derived
    /// from it: its data moves in [`Action::RunCollective`].
    Collective(Api, Option<Derived>),
    /// A collective of the topology's whole group with a deadline: the master names the members
    /// it runs among, leaving out those that did not call it in time, never the member of the
    /// rank given (a broadcast's root) (`docs/protocol.md`, "Collectives with a deadline").
    Gathered(Api, Cutoff, Option<usize>),
}

/// When a collective with a deadline leaves out the members that have not called it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cutoff {
    /// How long after the first member's call.
    pub deadline: Duration,
    /// The fewest members it runs with (0: more than half the group's).
    pub min: u32,
}

/// A group derived from the whole group without admission (`split`, `new_group`): its name, the
/// same on each of its members and unlike any other group's they derived, and its members as it
/// was derived, by their rank there. In each topology it is those of them still members, in that
/// order; its collectives are numbered on their own (`docs/protocol.md`, "Derived groups").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Derived {
    /// Its name (never 0, the whole group's).
    pub id: u64,
    /// Its members as derived, by rank.
    pub members: std::sync::Arc<[PeerId]>,
}

impl Derived {
    /// Its members in the topology whose ring is `ring`: the topology's rank of each, by their
    /// rank in the group.
    pub fn ranks_in(&self, ring: &[shoal_wire::Member]) -> Vec<usize> {
        self.members.iter().filter_map(|p| ring.iter().position(|m| m.peer == *p)).collect()
    }
}

impl CallKind {
    /// The call, as users know it.
    pub fn api(&self) -> Api {
        match self {
            CallKind::UpdateTopology => Api::UpdateTopology,
            CallKind::OptimizeTopology(_) => Api::OptimizeTopology,
            CallKind::PeersPending => Api::PeersPending,
            CallKind::SyncSharedState(_) => Api::SyncSharedState,
            CallKind::Collective(api, _) | CallKind::Gathered(api, ..) => *api,
        }
    }
}

/// What this peer brings to a shared-state sync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncBallot {
    /// Its revision.
    pub revision: Revision,
    /// The strategy's code.
    pub strategy: u8,
    /// Whether this peer's revision wins over a higher one.
    pub override_resume: bool,
    /// Its tensors' digests, in name order.
    pub entries: Vec<StateDigest>,
}

/// What the calling thread must do next ([`Peer::poll_action`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The master registered us: data connections for us may arrive from now on.
    Registered {
        /// Our id.
        me: PeerId,
        /// The run.
        session: SessionId,
        /// The run's key for data connections: what we dial opens with a frame tagged under
        /// it, and what we accept must be.
        data_key: DataKey,
    },
    /// Open the connections of this issued topology, then [`Peer::handle_established`]. Give up
    /// (with [`Established::Superseded`]) once [`Peer::superseded`] says so.
    Establish {
        /// Our place in it.
        position: RingPosition,
        /// When the call's bound ends.
        deadline: Instant,
    },
    /// This topology, whose connections were established, is in force: calls run in it now.
    TakeUp(RingPosition),
    /// Move collective `op`'s data with the ring of `position` while [`Peer::running`] says so,
    /// then report with [`Peer::handle_collective`]. Several may be in flight at once.
    RunCollective {
        /// The call it belongs to.
        call: CallId,
        /// The collective.
        op: OpId,
        /// Our place in its topology's ring.
        position: RingPosition,
        /// For a derived group's collective, the ring's rank of each of its members, by their
        /// rank in the group (empty: the whole ring).
        group: Vec<usize>,
        /// When the call's bound ends.
        deadline: Instant,
    },
    /// Fetch what the plan of sync `round` says we lack, then [`Peer::handle_fetched`].
    Fetch {
        /// The sync's round.
        round: u64,
        /// The elected revision.
        revision: Revision,
        /// Per tensor, in name order: its elected hash and the donors to fetch it from (none: we
        /// hold it).
        entries: Vec<PlanEntry>,
    },
    /// A member's call waits on a transfer with us: if ours can never let it complete, say so
    /// ([`Peer::waiters`], [`Peer::p2p_apart`]).
    MemberWaits(PeerId),
    /// The transfer our call waits on with `peer` can never complete: the call ends with
    /// this usage error.
    P2pApart {
        /// The other end.
        peer: PeerId,
        /// Both calls, named with their peers.
        misuse: Misuse,
    },
    /// A member asks what became here of its transfer with us ([`PeerEvent::P2pOutcome`]):
    /// [`Transfers::handle_outcome_asked`].
    P2pOutcome(TransferName),
    /// Whether our transfer asking the member at its other end succeeded there
    /// ([`PeerEvent::P2pDecided`]): [`Transfers::handle_decided`].
    P2pDecided(TransferName, bool),
    /// The call ended.
    Done {
        /// Which.
        call: CallId,
        /// How.
        result: Result<Value, CallError>,
    },
}

/// What a call that succeeded returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `connect`: we are accepted.
    Joined,
    /// `update_topology`: the topology is in force (a new one, or none needed after a failure).
    TopologyInForce,
    /// `peers_pending`'s answer.
    Pending(bool),
    /// The sync completed: every participant holds the elected state at this revision.
    Synced(Revision),
    /// The collective committed: every participant holds its result.
    Collective(OpId),
}

/// Why a call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// Its bound passed.
    Timeout,
    /// The master aborted the collective: every participant fails it with this failure.
    Aborted {
        /// The collective.
        op: OpId,
        /// The first failure reported.
        failure: OpFailure,
    },
    /// The collective failed here and no verdict came within a heartbeat timeout: the driver's
    /// own error for it stands, or, where the state machine stopped it, the failure it reported.
    Unconfirmed {
        /// The collective.
        op: OpId,
        /// The failure this peer reported.
        failure: OpFailure,
    },
    /// The collective, called with a deadline, ran without us: we had not called it in time.
    /// Nothing was done here; we are a member still.
    Excluded {
        /// The collective.
        op: OpId,
        /// The members it ran among, in ring order.
        included: Vec<PeerId>,
        /// How many later collectives of the topology we heard the master decide without us
        /// already: the others are that far ahead, and our next calls of that many end the same
        /// way at once.
        ahead: u64,
    },
    /// The peers made calls that cannot complete together.
    Misuse(Misuse),
    /// The sync ended without effect.
    SyncFailed {
        /// Calling again can succeed.
        retryable: bool,
        /// Why.
        reason: String,
    },
    /// We left the run, or lost the master.
    Gone(Gone),
    /// The connection to the master broke during this call, which needs the master (a vote, a
    /// sync): whatever the master counted of it is lost with the master. Calling again can
    /// succeed once the connection is back.
    Interrupted(String),
    /// A call was made while another was in progress, or before joining.
    Busy(Api),
}

/// Why this peer is no longer in the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gone {
    /// The master expelled us, saying why.
    Kicked(String),
    /// The master refused our proof of the run's secret.
    AuthFailed(String),
    /// The master is lost: silent for a heartbeat timeout, or its connection failed.
    MasterLost(String),
    /// We left ([`Peer::close`]).
    Closed,
}

/// What the data plane made of an [`Action::Establish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Established {
    /// Our connections are open.
    Ready,
    /// This peer could not be reached.
    Unreachable(PeerId),
    /// The master issued a newer topology meanwhile.
    Superseded,
}

/// What the data plane did with a collective's data ([`Peer::handle_collective`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpProgress {
    /// Every byte moved: the confirmation lap runs.
    DataDone,
    /// The lap came round: every participant holds the result.
    Confirmed,
    /// The lap cannot finish (a stream broke): ask the master.
    LapBroken(String),
    /// It failed here: report to the master.
    Failed(OpFailure),
    /// Nothing moves until the network delivers (the data plane is about to sleep): whatever
    /// stops the collective short of the master's decision stops it now.
    Stalled {
        /// The members it still has data to move with: a vote it can never complete against, or
        /// the removal of one of these, stops it. A removed member it is done with stops it only
        /// [`Peer::removal_grace`] later: what it still waits for comes from members alive,
        /// which may be slow.
        waits_on: Vec<PeerId>,
    },
}

/// Where a collective stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum OpStage {
    /// Called with a deadline: waiting for the master to name its members.
    Gathering,
    /// Left out of it (it runs among these members): waiting for the master to say how it
    /// ended, which ends our call alike.
    LeftOut(Vec<PeerId>),
    /// Its data moves.
    Running,
    /// The confirmation lap runs.
    Lap,
    /// Finished here; waiting until then for the master's verdict.
    Asking(Instant),
    /// Failed here (this failure) and reported; waiting until then for the verdict naming the
    /// first failure.
    Reporting(Instant, OpFailure),
}

/// A collective in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
struct InFlight {
    call: CallId,
    /// Called with a deadline: once committed here, the master hears of it, for the members left
    /// out.
    gathered: bool,
    /// Its call, as users know it.
    api: Api,
    deadline: Instant,
    /// Its participants, by rank: the ring's members, or its derived group's.
    members: Vec<PeerId>,
    stage: OpStage,
}

impl InFlight {
    /// The members a report about derived collective `op` names for the master (none for the
    /// whole group's: the master knows the ring).
    fn named(&self, op: OpId) -> Vec<PeerId> {
        if op.derived == 0 {
            Vec::new()
        } else {
            self.members.clone()
        }
    }
}

/// Why a call waits for a topology.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Purpose {
    /// `connect`: a newcomer waits to be admitted.
    Connect,
    /// Our `update_topology` vote (or `optimize_topology`'s), cast again if it is not counted.
    Vote(CallKind),
    /// Another call joins a topology issued without a vote (a re-formed ring), then runs.
    Follow(CallKind),
}

/// What `Join` carries: the group, the data address, whether we will catch up.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Joining {
    group: GroupId,
    data_addr: String,
    catch_up: bool,
}

/// The one call in progress that is not a collective in flight, with what it waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    /// `connect`: waiting for the master's challenge to send `Join` (what it carries, until
    /// sent), then to be registered.
    Registering {
        join: Option<Joining>,
    },
    Topology {
        purpose: Purpose,
        /// The last topology established (or found unreachable) by this call.
        handled: Option<Epoch>,
        /// The topology the data plane is establishing now.
        establishing: Option<Epoch>,
    },
    Pending,
    Sync(SyncStage),
}

/// A call not begun yet: it waits for the calls before it ([`Peer::call`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Queued {
    id: CallId,
    kind: CallKind,
    deadline: Instant,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum SyncStage {
    /// This ballot was cast: waiting for the plan. Kept to vote again if the vote crossed a
    /// topology issued meanwhile.
    Voted(SyncBallot),
    Fetching {
        round: u64,
        revision: Revision,
    },
    Reported {
        round: u64,
        revision: Revision,
    },
}

/// The peer's side of the protocol (see the module docs).
///
/// Calls begin in the order they were made. Collectives run several at once, up to
/// [`PeerConfig::max_in_flight`]; any other call begins once every collective before it has
/// ended and runs alone, and so does a collective that must first join a topology issued since
/// the last call: every member then counts the same collectives in its votes, and a topology
/// changes only between collectives.
#[derive(Debug)]
pub struct Peer {
    config: PeerConfig,
    view: PeerView,
    /// The call that runs alone, with its bound.
    call: Option<(CallId, Instant, Call)>,
    /// Collectives in flight, by name.
    ops: std::collections::BTreeMap<OpId, InFlight>,
    /// Calls not begun yet, in order.
    queue: VecDeque<Queued>,
    next_call: u64,
    /// Our place in the committed topology our calls run in ([`Action::TakeUp`]).
    taken_up: Option<RingPosition>,
    outbox: VecDeque<Message>,
    actions: VecDeque<Action>,
    /// Where we stand with the master; changed only by [`Peer::set_link`].
    link: Link,
    last_heard: Instant,
    next_heartbeat: Instant,
    /// Counters the driver attached, sent at the next heartbeat in its place.
    report: Option<PeerReport>,
    /// When the master told us of each removed peer ([`Peer::removal_grace`]).
    removed_at: std::collections::BTreeMap<PeerId, Instant>,
    /// The point (topology, collectives started) and call of this peer's last vote, collective or
    /// transfer, while it runs and after.
    last_call: Option<(Epoch, u64, Made)>,
    /// Whether `last_call` ended as one of calls that cannot complete together.
    last_apart: bool,
    /// Where our catch-up stands until we are admitted: what a master that restarted meanwhile
    /// lost is told again once it took us back ([`Peer::rejoined`]).
    catching_up: Option<CatchingUp>,
}

/// A newcomer's catch-up, as the master must know it (`docs/state.md`, "Catching up").
#[derive(Debug, Clone, PartialEq, Eq)]
enum CatchingUp {
    /// `CatchUpStart` went out with these entries; no plan came yet.
    Asked(Vec<shoal_wire::StateDigest>),
    /// The plan came: the fetch is under way.
    Planned,
    /// `CatchUpEnd` went out: we await admission.
    Ended { fetched: bool, revision: u64 },
}

/// Where a peer stands with the master. Expulsion and refusal are the master's news and live in
/// the view; this is what the connection did.
#[derive(Debug, Clone)]
enum Link {
    /// Connected, or joining: messages go out as they come.
    Up,
    /// The connection broke for `reason`: the driver dials again until `until`; `rejoined` once
    /// the new connection was challenged and `Rejoin` went out (nothing else goes out before).
    Reconnecting { until: Instant, reason: String, rejoined: bool },
    /// The master is lost for good: broke the protocol, fell silent, or was not back in time.
    Lost(String),
    /// We left ([`Peer::close`]).
    Closed,
}

impl Peer {
    /// A peer that has not joined yet.
    pub fn new(config: PeerConfig, now: Instant) -> Self {
        let interval = heartbeat_interval(config.heartbeat_timeout);
        assert!(interval <= config.heartbeat_timeout, "heartbeats go out before the master misses them");
        let peer = Peer {
            view: PeerView::default(),
            call: None,
            ops: std::collections::BTreeMap::new(),
            queue: VecDeque::new(),
            next_call: 0,
            taken_up: None,
            outbox: VecDeque::new(),
            actions: VecDeque::new(),
            link: Link::Up,
            last_heard: now,
            next_heartbeat: now + interval,
            report: None,
            removed_at: std::collections::BTreeMap::new(),
            last_call: None,
            last_apart: false,
            catching_up: None,
            config,
        };
        debug_assert!(!peer.busy() && peer.gone().is_none() && peer.outbox.is_empty(), "a new peer is in a call");
        debug_assert!(peer.poll_timeout().is_some(), "a new peer sends no heartbeat");
        peer
    }

    /// How long a stalled collective waits for the live members' bytes once a member it has
    /// no data left to move with was removed: that member may have sent all its part before it
    /// died (the collective can still complete), and a live member on the path of its data
    /// may be slow. Past it the collective stops, as it would at once for a member it still
    /// moves data with: whatever it waits for may be stuck behind the lost member, and nothing
    /// waits for the whole bound.
    pub fn removal_grace(&self) -> Duration {
        heartbeat_interval(self.config.heartbeat_timeout)
    }

    /// A member of `members` removed at least [`Peer::removal_grace`] before `now`.
    fn removed_long_ago(&self, members: &[PeerId], now: Instant) -> Option<PeerId> {
        let grace = self.removal_grace();
        members.iter().copied().find(|p| self.removed_at.get(p).is_some_and(|at| now >= *at + grace))
    }

    /// How long a silent master is tolerated.
    pub fn heartbeat_timeout(&self) -> Duration {
        self.config.heartbeat_timeout
    }

    /// Whether the driver must dial the master again: until when it may try, if it must.
    pub fn reconnecting(&self) -> Option<Instant> {
        match self.link {
            Link::Reconnecting { until, rejoined: false, .. } if self.gone().is_none() => Some(until),
            _ => None,
        }
    }

    /// A new control connection was challenged with `nonce`: `Rejoin` goes out on it first, then
    /// whatever waited for the connection.
    pub fn handle_reconnected(&mut self, nonce: [u8; 32], now: Instant) {
        let (Link::Reconnecting { until, reason, rejoined: false }, Some((peer, session))) =
            (&self.link, self.view.registered)
        else {
            return;
        };
        log::info!("control connection back ({reason}); rejoining as {peer}");
        self.set_link(Link::Reconnecting { until: *until, reason: reason.clone(), rejoined: true });
        let proof = self.config.key.as_ref().map_or([0; 32], |key| key.prove(&nonce));
        self.outbox.push_front(Message::Rejoin { peer, session, proof });
        self.last_heard = now;
        self.progress(now);
        assert!(self.reconnecting().is_none(), "a rejoin in flight dials again");
        debug_assert!(matches!(self.outbox.front(), Some(Message::Rejoin { .. })), "Rejoin goes out first");
    }

    /// Whether [`Peer::handle_timeout`] at `now` sends a heartbeat: the moment for the driver
    /// to [`Peer::attach_report`].
    pub fn heartbeat_due(&self, now: Instant) -> bool {
        self.gone().is_none() && self.view.registered.is_some() && now >= self.next_heartbeat
    }

    /// Sends `report` to the master at the next heartbeat, in its place (`Message::Report`), or
    /// before `Leave` if [`Peer::close`] comes first.
    pub fn attach_report(&mut self, report: PeerReport) {
        self.report = Some(report);
    }

    /// Our id and the run's session, once registered.
    pub fn registered(&self) -> Option<(PeerId, SessionId)> {
        self.view.registered
    }

    /// Why we are out of the run, if we are. Expulsion is the news over a lost connection (the
    /// master closes it after saying why).
    pub fn gone(&self) -> Option<Gone> {
        if let Some(reason) = &self.view.kicked {
            return Some(Gone::Kicked(reason.clone()));
        }
        if let Some(reason) = &self.view.refused {
            return Some(Gone::AuthFailed(reason.clone()));
        }
        match &self.link {
            Link::Closed => Some(Gone::Closed),
            Link::Lost(reason) => Some(Gone::MasterLost(reason.clone())),
            Link::Up | Link::Reconnecting { .. } => None,
        }
    }

    /// Whether a call is in progress (running, in flight or waiting to begin).
    pub fn busy(&self) -> bool {
        self.call.is_some() || !self.ops.is_empty() || !self.queue.is_empty()
    }

    /// Collectives in flight.
    pub fn in_flight(&self) -> usize {
        self.ops.len()
    }

    /// How many collectives of the whole group after `op` we heard the master decide without us
    /// (called with a deadline) and have not called yet: how far ahead the others are now.
    pub fn decided_ahead(&self, op: OpId) -> u64 {
        self.view.registered.map_or(0, |(me, _)| self.view.decided_past(op, me))
    }

    /// Whether peers waited to join when the master decided collective `op` (called with a
    /// deadline): what `peers_pending` would have answered then, the same on every member. None
    /// for one the master did not decide, or decided long ago.
    pub fn pending_at(&self, op: OpId) -> Option<bool> {
        self.view.pending_at.get(&op).copied()
    }

    /// Our place in the topology our calls run in, once accepted.
    pub fn position(&self) -> Option<RingPosition> {
        self.taken_up.clone()
    }

    /// Whether the data plane must give up establishing topology `epoch`: a newer one was issued,
    /// or we are out of the run.
    pub fn superseded(&self, epoch: Epoch) -> bool {
        self.gone().is_some() || self.view.issued.as_ref().is_some_and(|(e, _)| *e != epoch)
    }

    /// Whether a call still waits for topology `epoch` to be established here: one that ended
    /// meanwhile (its vote was abandoned, say) leaves the driver nothing to wait for.
    pub fn establishing(&self, epoch: Epoch) -> bool {
        matches!(&self.call, Some((_, _, Call::Topology { establishing: Some(e), .. })) if *e == epoch)
    }

    /// Whether collective `op` still wants its data (or, in its lap, its tokens) moved. Once it
    /// does not, the data plane stops it and waits for its [`Action::Done`]. A data plane about
    /// to sleep reports [`OpProgress::Stalled`] first.
    pub fn running(&self, op: OpId) -> bool {
        self.ops.get(&op).is_some_and(|o| matches!(o.stage, OpStage::Running | OpStage::Lap))
    }

    /// Whether collective `op` holds the result and waits for the master's verdict, which waits
    /// for the other participants' reports: they must learn of the failure, so the data plane
    /// closes the failed streams now rather than at the verdict.
    pub fn asking(&self, op: OpId) -> bool {
        self.ops.get(&op).is_some_and(|o| matches!(o.stage, OpStage::Asking(_)))
    }

    /// A call id for a call the data plane runs on its own, outside the state machine: a tagged
    /// point-to-point transfer, which concerns two members and no agreement. Unique among every
    /// call's.
    pub fn reserve_call(&mut self) -> CallId {
        self.next_id()
    }

    /// Announces that our call waits on a tagged transfer with member `other` that found nothing
    /// to match it (`send`: ours is the send; `seen`: a receive's count of `other`'s sends to us
    /// offered so far): `other` tells, through the master, whether its own call lets it complete.
    /// A receive from any member names [`PeerId::ANY`]: every other member tells.
    pub fn p2p_waits(&mut self, other: PeerId, send: bool, tag: u64, seen: u64) {
        let Some((epoch, _)) = &self.view.committed else { return };
        let (epoch, collectives) = (*epoch, self.view.started);
        assert!(self.view.registered.is_some_and(|(me, _)| me != other), "a transfer with ourselves waits");
        let any = other == PeerId::ANY;
        assert!(!(any && send), "a send goes to a member");
        self.outbox.push_back(Message::P2pWaits { peer: other, any, send, tag, seen, epoch, collectives });
    }

    /// Our transfer `t` (`t.peer`: the other end) stopped while its outcome rested on the other
    /// end's word: the master asks that end what became of it there ([`Action::P2pDecided`]
    /// answers).
    pub fn p2p_outcome(&mut self, t: TransferName) {
        let TransferName { peer, epoch, number, send } = t;
        self.outbox.push_back(Message::P2pOutcome { peer, epoch, number, send });
    }

    /// Answers [`Action::P2pOutcome`] about `t` (`t.peer`: the asker): the transfer succeeded
    /// here (`done`) or not.
    pub fn p2p_decided(&mut self, t: TransferName, done: bool) {
        let TransferName { peer, epoch, number, send } = t;
        self.outbox.push_back(Message::P2pDecided { peer, epoch, number, send, done });
    }

    /// The wait announced with [`Peer::p2p_waits`] is over.
    pub fn p2p_resumed(&mut self, other: PeerId) {
        debug_assert!(self.view.registered.is_some_and(|(me, _)| me != other), "a transfer with ourselves waited");
        self.outbox.push_back(Message::P2pResumed { peer: other });
    }

    /// The others' calls at our point ended as calls that cannot complete together before we
    /// made a call there ([`PeerView::settled_here`]): a tagged transfer of ours there is one of
    /// them, and ends with this usage error (we are told, as by a vote ended so): `transfer`
    /// against the others' calls.
    pub fn p2p_settled(&mut self, transfer: Made) -> Option<Misuse> {
        assert!(matches!(transfer, Made::Transfer { .. }), "{transfer} is no transfer");
        let theirs = self.view.settled_here.take()?;
        self.view.told = true;
        self.calling(self.view.started, transfer);
        self.last_apart = true;
        self.settle_waiters();
        let me = self.view.registered.expect("a transfer runs in a registered peer").0;
        debug_assert!(self.last_call.is_some() && self.view.settled_here.is_none(), "our call is told, once");
        Some(settled_against(me, transfer, &theirs))
    }

    /// The members whose calls wait on a transfer with us, as announced.
    pub fn waiters(&self) -> impl Iterator<Item = (PeerId, WaitNote)> + '_ {
        self.view.waiters.iter().map(|(p, n)| (*p, *n))
    }

    /// Our call can never let the transfer `waiter` waits on complete: its call ends with
    /// `misuse`, and the master abandons our group's votes with it (ours among them); for a
    /// receive from any member, once every other member said so, and only the waiter's call.
    pub fn p2p_apart(&mut self, waiter: PeerId, misuse: Misuse) {
        let removed = self.view.waiters.remove(&waiter);
        assert!(removed.is_some(), "{waiter} does not wait on us");
        assert!(misuse.ours.peers == [waiter], "the waiter's call ends: {misuse}");
        self.outbox.push_back(Message::P2pApart { peer: waiter, misuse });
    }

    /// As [`Peer::p2p_apart`], while the waiter waits on our collective `op`, which it has not
    /// started: `op` fails first, with the same reason (`OpFailed { Misuse }`), so that the master
    /// re-forms the ring before it ends the waiter's call, and the waiter's next call finds the
    /// new topology rather than run `op`'s number again in the old one.
    pub fn p2p_apart_in(&mut self, op: OpId, waiter: PeerId, misuse: Misuse, now: Instant) {
        let (me, _) = self.view.registered.expect("a collective runs in a registered peer");
        assert!(misuse.theirs.peers == [me], "our collective is named: {misuse}");
        let failure = OpFailure::misuse(me, misuse.clone());
        self.handle_collective(op, OpProgress::Failed(failure), now);
        self.p2p_apart(waiter, misuse);
    }

    /// Ends the waits on us that our call `call` can never let complete, asked by
    /// [`Action::MemberWaits`] as a wait arrives and as a vote or collective starts: those on a
    /// call of ours not made yet, while `call` is a vote, or a collective they have not started
    /// (`collective`: the one `call` runs, by the name its caller knows it). `stuck` says whether
    /// our engine holds nothing that lets a waiter's transfer complete (`docs/protocol.md`, "No call
    /// waits for a call that will never come"). Their calls end, and ours with them.
    pub fn judge_waiters(
        &mut self,
        call: CallId,
        collective: Option<(OpId, Api)>,
        stuck: impl Fn(PeerId, &WaitNote) -> bool,
        now: Instant,
    ) {
        let Some((me, _)) = self.view.registered else { return };
        debug_assert!(
            collective.is_none_or(|(op, _)| self.view.committed.as_ref().is_some_and(|(e, _)| op.epoch <= *e)),
            "a collective of a topology never committed waits"
        );
        let ours = collective.map(|(op, api)| (api, Some(op))).or_else(|| self.voting(call).map(|api| (api, None)));
        let Some((api, op)) = ours else { return };
        let at = op.map(|op| shoal_wire::Point { epoch: op.epoch, collectives: op.seq.0 });
        let apart: Vec<(PeerId, bool, Misuse)> = self
            .waiters()
            .filter(|(waiter, note)| {
                // A collective the waiter started already moves without its call.
                let needs = op.is_none_or(|op| note.point.0 == op.epoch && note.point.1 <= op.seq.0);
                needs && stuck(*waiter, note)
            })
            .map(|(waiter, note)| (waiter, note.any, p2p_misuse(waiter, &note, me, Made::Api { api, at }, false)))
            .collect();
        for (waiter, any, misuse) in apart {
            log::warn!("{misuse}");
            // A receive from any member may yet be served by another: our call goes on.
            match op.filter(|_| !any) {
                Some(op) => self.p2p_apart_in(op, waiter, misuse, now),
                None => self.p2p_apart(waiter, misuse),
            }
            assert!(self.waiters().all(|(w, _)| w != waiter), "{waiter} still waits after it was told");
        }
    }

    /// The vote `call` is cast in, by the call users know, while it waits in it.
    pub fn voting(&self, call: CallId) -> Option<Api> {
        let (_, _, c) = self.call.as_ref().filter(|(id, ..)| *id == call && self.in_vote())?;
        let api = match c {
            Call::Topology { purpose: Purpose::Vote(kind), .. } => kind.api(),
            Call::Pending => Api::PeersPending,
            _ => Api::SyncSharedState,
        };
        // optimize_topology starts with a collective, and ends in this vote.
        debug_assert!(!api.is_collective() || api == Api::OptimizeTopology, "{api} is a vote");
        Some(api)
    }

    /// This peer's last vote or collective, if it ended as one of calls that cannot complete
    /// together and no call was made since: its point and call.
    pub fn apart(&self) -> Option<(Epoch, u64, Made)> {
        self.last_call.filter(|_| self.last_apart)
    }

    /// Whether the master removed `peer` from the run (it died, froze or was cut off): a
    /// transfer with it cannot complete.
    pub fn removed(&self, peer: PeerId) -> bool {
        self.view.removed.contains(&peer)
    }

    /// Joins the run: answers the master's challenge with `Join`; the call is done once the
    /// accepted peers admit us. `catch_up`: we will catch up with the group's state once
    /// registered ([`Peer::catch_up_start`]), and the master holds our admission until then.
    pub fn connect(
        &mut self,
        group: GroupId,
        data_addr: String,
        catch_up: bool,
        bound: Duration,
        now: Instant,
    ) -> CallId {
        let id = self.next_id();
        if self.busy() || self.view.registered.is_some() {
            self.actions.push_back(Action::Done { call: id, result: Err(CallError::Busy(Api::Connect)) });
            return id;
        }
        debug_assert!(self.view.committed.is_none() && self.taken_up.is_none(), "a newcomer runs in a topology");
        let join = Joining { group, data_addr, catch_up };
        self.call = Some((id, now + bound, Call::Registering { join: Some(join) }));
        self.progress(now);
        assert!(self.busy() || self.gone().is_some() || self.has_action(), "connect neither runs nor ended");
        id
    }

    /// Makes call `kind`, which must end within `bound`. It begins once the calls before it allow
    /// (see [`Peer`]) and first, as every call does, joins a topology the master issued since
    /// the last call (`docs/protocol.md`, "Retry").
    pub fn call(&mut self, kind: CallKind, bound: Duration, now: Instant) -> CallId {
        let id = self.next_id();
        if let Some(gone) = self.gone() {
            self.actions.push_back(Action::Done { call: id, result: Err(CallError::Gone(gone)) });
            return id;
        }
        if self.view.committed.is_none() {
            self.actions.push_back(Action::Done { call: id, result: Err(CallError::Busy(kind.api())) });
            return id;
        }
        (self.last_call, self.last_apart) = (None, false);
        debug_assert!(self.queue.iter().all(|q| q.id < id), "call ids go forward");
        self.queue.push_back(Queued { id, kind, deadline: now + bound });
        self.progress(now);
        debug_assert!(self.busy() || self.has_action(), "{id:?} neither runs nor ended");
        id
    }

    /// Applies one message from the master.
    ///
    /// # Errors
    /// [`UnexpectedMessage`] for one a master never sends; the master is then lost to us.
    pub fn handle_message(&mut self, message: Message, now: Instant) -> Result<PeerEvent, UnexpectedMessage> {
        self.last_heard = now;
        let event = self.view.handle_message(message);
        match &event {
            Ok(PeerEvent::PeerRemoved(peer)) => {
                self.removed_at.entry(*peer).or_insert(now);
                self.view.waiters.remove(peer);
                debug_assert!(self.removed(*peer), "{peer} removed, yet a member");
            }
            Ok(PeerEvent::MemberWaits(peer)) => self.member_waits(*peer),
            Ok(PeerEvent::P2pApart { peer, misuse }) => {
                // Our call is one of those told: what the master said of the others' calls at
                // this point, before or after, concerns no later call of ours (as for a vote
                // ended with a usage error). A receive from any member ends no other call.
                if *peer != PeerId::ANY {
                    self.view.told = true;
                    self.view.settled_here = None;
                }
                self.actions.push_back(Action::P2pApart { peer: *peer, misuse: misuse.clone() });
            }
            Ok(PeerEvent::P2pOutcome(t)) => self.actions.push_back(Action::P2pOutcome(*t)),
            Ok(PeerEvent::P2pDecided(t, done)) => self.actions.push_back(Action::P2pDecided(*t, *done)),
            _ => {}
        }
        if self.in_vote() {
            // What ends a vote of ours ends our call, not the next one.
            self.view.settled_here = None;
        }
        // The master may ask for heartbeats more often than we would send them (`Registered`).
        self.next_heartbeat = self.next_heartbeat.min(now + self.heartbeat_every());
        while let Some(m) = self.view.poll_output() {
            self.outbox.push_back(m);
        }
        match &event {
            Ok(PeerEvent::Rejoined) => {
                self.rejoined(now);
                self.progress(now)
            }
            Ok(_) => self.progress(now),
            Err(e) => {
                // The master broke the protocol: no new connection mends that.
                log::warn!("master lost: {e}");
                if self.gone().is_none() {
                    self.set_link(Link::Lost(e.to_string()));
                }
                self.progress(now)
            }
        }
        assert!(event.is_ok() || self.gone().is_some(), "a master that broke the protocol is kept");
        event
    }

    /// The connection to the master failed. Where [`PeerConfig::reconnect`] allows and we are
    /// registered, the driver dials again ([`Peer::reconnecting`]); otherwise the master is lost.
    pub fn handle_disconnect(&mut self, reason: String, now: Instant) {
        // Once expelled, refused or closed, the master closing the connection is no news.
        if self.gone().is_some() {
            return self.progress(now);
        }
        debug_assert!(matches!(self.link, Link::Up | Link::Reconnecting { .. }), "a lost master's link fails again");
        let until = match self.link {
            // The new connection broke too: the first break's time still counts.
            Link::Reconnecting { until, .. } => until,
            _ => now + self.config.heartbeat_timeout,
        };
        if !self.config.reconnect || self.view.registered.is_none() || now >= until {
            log::warn!("master lost: {reason}");
            self.set_link(Link::Lost(reason));
            self.progress(now);
            debug_assert!(!self.busy(), "a call outlives the master");
            return;
        }
        log::warn!(
            "control connection lost ({reason}); dialing the master again for {:.1} s",
            until.saturating_duration_since(now).as_secs_f64()
        );
        self.set_link(Link::Reconnecting { until, reason: reason.clone(), rejoined: false });
        self.interrupt_master_calls(&reason);
        self.progress(now);
        assert!(self.reconnecting() == Some(until), "a broken connection is dialed again until {until:?}");
    }

    /// The call in progress that counts on what the master holds (a vote, a sync) ends: that is
    /// lost with the connection. Collectives run on; those that await a verdict ask again once
    /// rejoined.
    fn interrupt_master_calls(&mut self, reason: &str) {
        let Some((id, _, call)) = &self.call else { return };
        let interrupted = match call {
            Call::Topology { purpose: Purpose::Vote(kind), .. } => Some(kind.api()),
            Call::Pending => Some(Api::PeersPending),
            Call::Sync(_) => Some(Api::SyncSharedState),
            Call::Registering { .. } | Call::Topology { .. } => None,
        };
        if let Some(name) = interrupted {
            let id = *id;
            // Not sent yet: it goes nowhere now.
            self.outbox.retain(|m| {
                !matches!(
                    m,
                    Message::VoteUpdateTopology { .. } | Message::VotePeersPending { .. } | Message::SyncVote { .. }
                )
            });
            let why = format!("the connection to the master broke during {name} ({reason}); call it again");
            self.finish(id, Err(CallError::Interrupted(why)));
        }
        assert!(!self.in_vote(), "a vote outlives the connection it was cast on");
        debug_assert!(!self.outbox.iter().any(|m| matches!(m, Message::SyncVote { .. })), "a vote waits to go out");
    }

    /// The master took us back after a broken connection: what awaited its answer asks again.
    fn rejoined(&mut self, now: Instant) {
        debug_assert!(self.view.registered.is_some(), "rejoined before we were registered");
        if matches!(self.link, Link::Reconnecting { .. }) {
            self.set_link(Link::Up);
        }
        let asking: Vec<(OpId, OpStage)> = self
            .ops
            .iter()
            .filter(|(_, o)| matches!(o.stage, OpStage::Asking(_) | OpStage::Reporting(..)))
            .map(|(id, o)| (*id, o.stage.clone()))
            .collect();
        for (op, stage) in asking {
            match stage {
                OpStage::Reporting(_, failure) => self.report(op, failure, now),
                _ => self.ask(op, "the master restarted", now),
            }
        }
        // The master that took us back may be a new one, which knows nothing of our catch-up:
        // it keeps us out of votes until we ask for a plan again, or say again that we ended.
        match self.catching_up.clone() {
            Some(CatchingUp::Asked(entries)) if self.view.catch_up_plan.is_none() => {
                log::info!("asking again for our catch-up's plan: the master may have restarted");
                self.outbox.push_back(Message::CatchUpStart { entries });
            }
            Some(CatchingUp::Ended { fetched, revision }) => {
                self.outbox.push_back(Message::CatchUpEnd { fetched, revision });
            }
            _ => {}
        }
        assert!(self.reconnecting().is_none(), "rejoined, yet dialing the master again");
    }

    /// Time passed: heartbeats fall due, a silent master is lost, bounds end.
    pub fn handle_timeout(&mut self, now: Instant) {
        // Only a registered peer dials the master again; a newcomer's master is lost at once.
        debug_assert!(
            self.view.registered.is_some() || !matches!(self.link, Link::Reconnecting { .. }),
            "an unregistered peer dials the master again"
        );
        if self.gone().is_none() {
            let silent = now.saturating_duration_since(self.last_heard);
            let reconnecting = match &self.link {
                Link::Reconnecting { until, reason, .. } => Some((*until, reason.clone())),
                _ => None,
            };
            if silent > self.config.heartbeat_timeout && reconnecting.is_none() {
                // A silent master may be frozen: dialing it again would not help.
                log::warn!("master lost: no message for {:.1} s", silent.as_secs_f64());
                self.set_link(Link::Lost(format!("no message for {:.1} s", silent.as_secs_f64())));
                return self.progress(now);
            }
            if let Some((until, reason)) = reconnecting {
                // Nothing goes out until the master took us back; a connection not back in time
                // is the master lost.
                if now >= until {
                    let bound = self.config.heartbeat_timeout.as_secs_f64();
                    log::warn!("master lost: {reason}; not back within {bound:.1} s");
                    self.set_link(Link::Lost(format!("{reason}; the master was not back within {bound:.1} s")));
                    return self.progress(now);
                }
            } else if now >= self.next_heartbeat {
                let report = self.report.take().filter(|_| self.view.registered.is_some());
                self.outbox.push_back(report.map_or(Message::Heartbeat, |report| Message::Report { report }));
                self.next_heartbeat = now + self.heartbeat_every();
            }
        }
        self.progress(now);
        assert!(
            self.gone().is_some()
                || matches!(self.link, Link::Reconnecting { .. })
                || now.saturating_duration_since(self.last_heard) <= self.config.heartbeat_timeout,
            "a master silent past the heartbeat timeout is kept"
        );
    }

    /// When [`Peer::handle_timeout`] is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.gone().is_some() {
            return None;
        }
        debug_assert!(self.call.is_none() || self.ops.is_empty(), "a call that runs alone runs beside collectives");
        let call = self.call.as_ref().map(|(_, deadline, _)| *deadline);
        let queued = self.queue.iter().map(|q| q.deadline);
        let ops = self.ops.values().map(|o| match &o.stage {
            OpStage::Gathering | OpStage::LeftOut(_) | OpStage::Running | OpStage::Lap => o.deadline,
            OpStage::Asking(until) | OpStage::Reporting(until, _) => *until,
        });
        let master = match self.link {
            Link::Reconnecting { until, .. } => until,
            _ => self.next_heartbeat.min(self.last_heard + self.config.heartbeat_timeout + Duration::from_millis(1)),
        };
        Some(call.into_iter().chain(queued).chain(ops).fold(master, Instant::min))
    }

    /// The next message for the master, in order. Nothing while the control connection is
    /// being dialed again: what waits goes out after `Rejoin`.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<Message> {
        if matches!(self.link, Link::Reconnecting { rejoined: false, .. }) {
            return None;
        }
        self.outbox.pop_front()
    }

    /// The next thing the driver must do.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Whether [`Peer::poll_action`] has something.
    pub fn has_action(&self) -> bool {
        !self.actions.is_empty()
    }

    /// The data plane handled an [`Action::Establish`].
    pub fn handle_established(&mut self, epoch: Epoch, outcome: Established, now: Instant) {
        let Some((_, _, Call::Topology { establishing, handled, .. })) = &mut self.call else { return };
        if *establishing != Some(epoch) {
            return;
        }
        *establishing = None;
        *handled = Some(epoch);
        debug_assert!(self.ops.is_empty(), "a topology is established beside collectives");
        match outcome {
            Established::Ready => {
                // Before the report: its commit may come before the driver returns.
                self.view.ready_in = Some(epoch);
                self.outbox.push_back(Message::TopologyReady { epoch });
            }
            Established::Unreachable(peer) => self.outbox.push_back(Message::PeerUnreachable { epoch, peer }),
            Established::Superseded => {}
        }
        debug_assert!(!self.establishing(epoch), "{epoch:?} is established twice by one call");
        self.progress(now);
    }

    /// The data plane's news of collective `op`.
    pub fn handle_collective(&mut self, op: OpId, progress: OpProgress, now: Instant) {
        let Some(stage) = self.ops.get(&op).map(|o| o.stage.clone()) else { return };
        debug_assert!(
            self.taken_up.as_ref().is_some_and(|p| p.epoch == op.epoch),
            "{op} runs outside the topology taken up"
        );
        let failed_running = matches!((&progress, &stage), (OpProgress::Failed(_), OpStage::Running));
        match (progress, stage) {
            (OpProgress::DataDone, OpStage::Running) => self.set_stage(op, OpStage::Lap),
            (OpProgress::Confirmed, OpStage::Lap) => {
                // Every participant holds the result: committed without the master, which hears
                // of it only if it asks (to answer a participant that could not tell), or if the
                // collective has a deadline: the members left out of it wait to hear so.
                if self.ops.get(&op).is_some_and(|o| o.gathered) && !self.view.queried.contains(&op) {
                    let (epoch, seq) = (op.epoch, op.seq.0);
                    self.outbox.push_back(Message::OpDone {
                        epoch,
                        derived: 0,
                        seq,
                        members: Vec::new(),
                        decided: true,
                    });
                }
                self.view.commit_on_our_own(op);
                while let Some(m) = self.view.poll_output() {
                    self.outbox.push_back(m);
                }
                self.end_op(op, Ok(Value::Collective(op)));
                debug_assert!(!self.ops.contains_key(&op), "{op} confirmed, yet in flight");
            }
            (OpProgress::LapBroken(reason), OpStage::Lap) => self.ask(op, &reason, now),
            (OpProgress::Failed(failure), OpStage::Running) => self.report(op, failure, now),
            // A member that called another collective can be noticed only once our data moved
            // (it sent what we never expect: a broadcast from another root, say). Nobody counts
            // the tokens of a member whose collective differs, so nobody committed: it fails.
            (OpProgress::Failed(failure), OpStage::Lap) if failure.kind == FailureKind::Mismatch => {
                self.report(op, failure, now)
            }
            (OpProgress::Stalled { waits_on }, OpStage::Running | OpStage::Lap) => {
                self.step_op(op, now, Some(&waits_on));
            }
            // The peer stopped it already (a verdict, a lost member, the bound): its decision stands.
            _ => {}
        }
        debug_assert!(
            !failed_running || self.ops.get(&op).is_none_or(|o| o.stage != OpStage::Running),
            "{op} failed here and runs on"
        );
        self.progress(now);
    }

    /// We begin to catch up with our group's state, described by `entries` (sorted by name; hashes
    /// unused): the master answers with a [`CatchUpPlan`] ([`Peer::take_catch_up_plan`]).
    pub fn catch_up_start(&mut self, entries: Vec<shoal_wire::StateDigest>) {
        self.view.catch_up_plan = None;
        self.catching_up = Some(CatchingUp::Asked(entries.clone()));
        self.outbox.push_back(Message::CatchUpStart { entries });
    }

    /// The plan of our catch-up, once the master sent it.
    pub fn take_catch_up_plan(&mut self) -> Option<CatchUpPlan> {
        let plan = self.view.catch_up_plan.take();
        if plan.is_some() {
            self.catching_up = Some(CatchingUp::Planned);
        }
        plan
    }

    /// Tells the master how far our catch-up is.
    pub fn catch_up_progress(&mut self, done: u64, total: u64, eta_ms: u64) {
        self.outbox.push_back(Message::CatchUpProgress { done, total, eta_ms });
    }

    /// Our catch-up ended: with `fetched`, we hold the state of `revision`.
    pub fn catch_up_end(&mut self, fetched: bool, revision: u64) {
        self.catching_up = Some(CatchingUp::Ended { fetched, revision });
        self.outbox.push_back(Message::CatchUpEnd { fetched, revision });
    }

    /// The sync whose state the master asked us to keep a copy of, if it did (taken once).
    pub fn take_snapshot_order(&mut self) -> Option<u64> {
        self.view.snapshot_order.take()
    }

    /// We keep (or could not keep) the copy of sync `round` the master asked for.
    pub fn snapshot_held(&mut self, round: u64, held: bool) {
        self.outbox.push_back(Message::SnapshotHeld { round, held });
    }

    /// The data plane fetched (or failed to fetch) what sync `round` asked of it.
    pub fn handle_fetched(&mut self, round: u64, fetched: Result<(), impl std::fmt::Display>, now: Instant) {
        let Some((_, _, Call::Sync(stage))) = &mut self.call else { return };
        let SyncStage::Fetching { round: r, revision } = *stage else { return };
        if r != round {
            return;
        }
        *stage = SyncStage::Reported { round, revision };
        debug_assert!(self.ops.is_empty(), "a sync runs beside collectives");
        debug_assert!(!self.outbox.iter().any(|m| matches!(m, Message::SyncDone { round: r } if *r == round)));
        self.outbox.push_back(match fetched {
            Ok(()) => Message::SyncDone { round },
            Err(reason) => Message::SyncFailed {
                round,
                reason: shoal_wire::truncate(reason.to_string(), shoal_wire::MAX_STRING_BYTES),
            },
        });
        self.progress(now);
    }

    /// Leaves the run: tells the master, and every call in progress ends.
    pub fn close(&mut self, now: Instant) {
        if !matches!(self.link, Link::Closed) {
            self.set_link(Link::Closed);
            // The last counts go first: the master keeps them in its totals.
            if let Some(report) = self.report.take().filter(|_| self.view.registered.is_some()) {
                self.outbox.push_back(Message::Report { report });
            }
            self.outbox.push_back(Message::Leave);
        }
        self.progress(now);
        assert!(matches!(self.link, Link::Closed) && !self.busy(), "a closed peer keeps a call");
    }

    /// Moves to `next`, which must follow from where we stand: a lost master and a closed peer
    /// are for good (only closing follows the one, nothing the other), and only a broken
    /// connection is dialed again.
    fn set_link(&mut self, next: Link) {
        let legal = matches!(
            (&self.link, &next),
            (Link::Up, Link::Reconnecting { rejoined: false, .. })
                | (Link::Reconnecting { .. }, Link::Reconnecting { .. } | Link::Up)
                | (Link::Up | Link::Reconnecting { .. }, Link::Lost(_))
                | (Link::Up | Link::Reconnecting { .. } | Link::Lost(_), Link::Closed)
        );
        assert!(legal, "illegal link transition {:?} -> {:?}", self.link, next);
        if let (Link::Reconnecting { until, .. }, Link::Reconnecting { until: next_until, .. }) = (&self.link, &next) {
            assert_eq!(until, next_until, "a connection broken again keeps the first break's bound");
        }
        self.link = next;
    }

    fn next_id(&mut self) -> CallId {
        self.next_call += 1;
        CallId(self.next_call)
    }

    fn heartbeat_every(&self) -> Duration {
        // As often as we need to watch the master, or as the master asks, whichever is more.
        let ours = heartbeat_interval(self.config.heartbeat_timeout);
        self.view.heartbeat_interval.map_or(ours, |theirs| theirs.min(ours))
    }

    /// Begins call `id`, joining an issued topology first, or taking up one committed between
    /// calls (we reported ready in a call that then failed: its pools are ours already).
    fn begin(&mut self, id: CallId, kind: CallKind, deadline: Instant) {
        // One call at a time: only a vote refused while a topology connected begins again.
        assert!(self.call.as_ref().is_none_or(|(c, ..)| *c == id), "{id:?} begins while another call runs");
        if self.ended_apart(id, &kind) {
            return;
        }
        if self.topology_issued() {
            debug_assert!(self.ops.is_empty(), "a topology is joined between collectives");
            let handled = self.view.ready_in;
            let call = Call::Topology { purpose: Purpose::Follow(kind), handled, establishing: None };
            self.call = Some((id, deadline, call));
            return;
        }
        self.take_up();
        self.run(id, kind, deadline);
    }

    /// Ends call `id` (of `kind`) at once if the others' calls at this point of ours ended before
    /// we made it, so that it never waits for them to join a re-formed ring, which they may never
    /// do while they are in no call: a vote where theirs ended as calls that cannot complete
    /// together ([`PeerView::settled_here`]), a collective that they failed
    /// ([`PeerView::fail_next`]).
    fn ended_apart(&mut self, id: CallId, kind: &CallKind) -> bool {
        debug_assert!(self.view.committed.is_some(), "{id:?} ends apart outside any topology");
        let collective = match kind {
            CallKind::Collective(api, derived) => Some((*api, derived.as_ref().map_or(0, |d| d.id))),
            CallKind::Gathered(api, ..) => Some((*api, 0)),
            _ => None,
        };
        if let Some((api, derived)) = collective {
            let Some((op, failure)) = self.view.fail_next(derived) else { return false };
            self.calling(self.point_of(op), Made::api(api));
            self.finish(id, Err(CallError::Aborted { op, failure }));
            return true;
        }
        let Some(theirs) = self.view.settled_here.take() else { return false };
        let me = self.view.registered.expect("a vote runs in a registered peer").0;
        let misuse = settled_against(me, Made::api(kind.api()), &theirs);
        log::warn!("{misuse}");
        self.calling(self.view.started, Made::api(kind.api()));
        self.finish(id, Err(CallError::Misuse(misuse)));
        assert!(self.call.as_ref().is_none_or(|(c, ..)| *c != id), "{id:?} ended apart, yet runs");
        true
    }

    /// Whether this peer cast a vote and waits in it.
    fn in_vote(&self) -> bool {
        matches!(
            self.call,
            Some((_, _, Call::Topology { purpose: Purpose::Vote(_), .. } | Call::Pending | Call::Sync(_)))
        )
    }

    /// Whether the master issued a topology that is not in force yet.
    fn topology_issued(&self) -> bool {
        let committed = self.view.committed.as_ref().map(|(e, _)| *e);
        self.view.issued.as_ref().is_some_and(|(e, _)| committed.is_none_or(|c| c < *e))
    }

    /// Makes the committed topology the one our calls run in, if it is not already.
    fn take_up(&mut self) {
        let Some((epoch, members)) = self.view.committed.as_ref() else { return };
        if self.taken_up.as_ref().is_none_or(|p| p.epoch != *epoch) {
            debug_assert!(self.ops.is_empty(), "a topology is taken up between collectives");
            let position = self.view.position(*epoch, members);
            assert!(self.taken_up.as_ref().is_none_or(|p| p.epoch < position.epoch), "a topology taken up goes back");
            self.taken_up = Some(position.clone());
            self.actions.push_back(Action::TakeUp(position));
        }
        assert_eq!(self.taken_up.as_ref().map(|p| p.epoch), self.view.committed.as_ref().map(|(e, _)| *e));
    }

    /// The call itself, once this peer runs in the latest topology.
    fn run(&mut self, id: CallId, kind: CallKind, deadline: Instant) {
        let call = match kind {
            CallKind::UpdateTopology => {
                let collectives = self.view.cast_vote(Vote::UpdateTopology);
                self.calling(collectives, Made::api(Api::UpdateTopology));
                if !self.view.vote_needed() {
                    log::debug!("update_topology after a failure: the ring re-formed already");
                    return self.finish(id, Ok(Value::TopologyInForce));
                }
                self.outbox.push_back(Message::VoteUpdateTopology { collectives, measured: None });
                let purpose = Purpose::Vote(CallKind::UpdateTopology);
                Call::Topology { purpose, handled: self.view.ready_in, establishing: None }
            }
            CallKind::OptimizeTopology(measured) => {
                // Always a vote: a ring re-formed after a failure is not the ordered one.
                let collectives = self.view.cast_vote(Vote::UpdateTopology);
                self.calling(collectives, Made::api(Api::OptimizeTopology));
                let vote = Message::VoteUpdateTopology { collectives, measured: Some(measured.clone()) };
                self.outbox.push_back(vote);
                let purpose = Purpose::Vote(CallKind::OptimizeTopology(measured));
                Call::Topology { purpose, handled: self.view.ready_in, establishing: None }
            }
            CallKind::PeersPending => {
                let collectives = self.view.cast_vote(Vote::PeersPending);
                self.calling(collectives, Made::api(Api::PeersPending));
                self.outbox.push_back(Message::VotePeersPending { collectives });
                Call::Pending
            }
            CallKind::SyncSharedState(ballot) => {
                let collectives = self.view.cast_vote(Vote::SyncSharedState);
                self.calling(collectives, Made::api(Api::SyncSharedState));
                let SyncBallot { revision, strategy, override_resume, entries } = ballot.clone();
                let vote = Message::SyncVote { revision: revision.0, strategy, override_resume, entries, collectives };
                self.outbox.push_back(vote);
                Call::Sync(SyncStage::Voted(ballot))
            }
            CallKind::Collective(api, derived) => return self.start_collective(id, api, derived, None, deadline),
            CallKind::Gathered(api, cutoff, needs) => {
                return self.start_collective(id, api, None, Some((cutoff, needs)), deadline)
            }
        };
        assert!(self.call.as_ref().is_none_or(|(c, ..)| *c == id), "{id:?} votes while another call runs");
        self.call = Some((id, deadline, call));
        self.ask_judgement();
        assert!(self.in_vote(), "{id:?} waits outside its vote");
    }

    /// Asks the driver to judge the members waiting on us against the call we are now in
    /// ([`Action::MemberWaits`]), if any wait.
    fn ask_judgement(&mut self) {
        if let Some(&waiter) = self.view.waiters.keys().next() {
            self.actions.push_back(Action::MemberWaits(waiter));
        }
    }

    /// The whole group's point (collectives started there) a call of collective `op` is made at:
    /// a derived group's collective is a call between two of the whole group's.
    fn point_of(&self, op: OpId) -> u64 {
        if op.derived == 0 {
            op.seq.0
        } else {
            self.view.started
        }
    }

    fn start_collective(
        &mut self,
        id: CallId,
        api: Api,
        derived: Option<Derived>,
        cutoff: Option<(Cutoff, Option<usize>)>,
        deadline: Instant,
    ) {
        self.call = None;
        match self.view.start_collective(derived.as_ref().map_or(0, |d| d.id)) {
            // The others failed it before we started it: it fails here too, untouched.
            Err((op, Missed::Failed(failure))) => self.finish(id, Err(CallError::Aborted { op, failure })),
            // It ran among the others: left out.
            Err((op, Missed::LeftOut(included))) => {
                // Missed in a replaced topology: the next call is in the new one, nothing ahead.
                self.finish(id, Err(CallError::Excluded { op, included, ahead: 0 }))
            }
            Ok(op) => {
                self.calling(self.point_of(op), Made::api(api));
                let position = self.position().expect("a collective runs in the topology taken up");
                let group = derived.as_ref().map_or_else(Vec::new, |d| d.ranks_in(&position.ring));
                let members: Vec<PeerId> = match derived {
                    None => position.ring.iter().map(|m| m.peer).collect(),
                    Some(_) => group.iter().map(|&r| position.ring[r].peer).collect(),
                };
                let me = self.view.registered.map(|(p, _)| p);
                assert!(me.is_some_and(|me| members.contains(&me)), "a collective of a group we are not in");
                if members.len() == 1 {
                    self.view.collective_ended(op, true);
                    return self.actions.push_back(Action::Done { call: id, result: Ok(Value::Collective(op)) });
                }
                let stage = match cutoff {
                    // The master names its members first; a decision already heard is taken at
                    // the next step.
                    Some((Cutoff { deadline: after, min }, needs)) => {
                        if !self.view.gathered.contains_key(&op) {
                            let deadline_ms = after.as_millis().min(u64::MAX.into()) as u64;
                            let seq = op.seq.0;
                            // A rank past the ring's names nobody: the buffers fit no group then.
                            let needs = needs.and_then(|r| position.ring.get(r)).map(|m| m.peer).into_iter().collect();
                            let gather = Message::Gather { epoch: op.epoch, seq, deadline_ms, min, needs };
                            self.outbox.push_back(gather);
                        }
                        OpStage::Gathering
                    }
                    None => {
                        self.actions.push_back(Action::RunCollective { call: id, op, position, group, deadline });
                        OpStage::Running
                    }
                };
                self.ask_judgement();
                let gathered = cutoff.is_some();
                let previous = self.ops.insert(op, InFlight { call: id, gathered, api, deadline, members, stage });
                assert!(previous.is_none(), "{op} started twice");
            }
        }
    }

    /// Member `waiter`'s call waits on a transfer with us. While we are in a call, the driver
    /// judges it against that call. Out of calls, our last one ended as one of calls that cannot
    /// complete together at the very point the waiter is at: like a vote made there after the
    /// others' calls ended apart (`calls.rs`), the waiter's call can never meet ours, and ends.
    fn member_waits(&mut self, waiter: PeerId) {
        debug_assert!(self.view.registered.is_some_and(|(me, _)| me != waiter), "the view refuses a wait on us");
        log::debug!("{waiter} waits on a transfer with us: {:?}", self.view.waiters.get(&waiter));
        self.settle_waiters();
        if self.view.waiters.contains_key(&waiter) {
            self.actions.push_back(Action::MemberWaits(waiter));
        }
    }

    /// Out of calls, with our last one ended apart: the members waiting on us at its point end
    /// ([`Peer::member_waits`]).
    fn settle_waiters(&mut self) {
        debug_assert!(self.view.registered.is_some() || self.view.waiters.is_empty(), "a wait on a newcomer");
        let idle = self.call.is_none() && self.ops.is_empty() && self.queue.is_empty();
        let (Some((epoch, collectives, ours)), Some((me, _)), true) = (self.apart(), self.view.registered, idle) else {
            return;
        };
        let here: Vec<(PeerId, WaitNote)> =
            self.waiters().filter(|(_, note)| note.point == (epoch, collectives)).collect();
        for (waiter, note) in here {
            let misuse = p2p_misuse(waiter, &note, me, ours, true);
            log::warn!("{misuse}");
            self.p2p_apart(waiter, misuse);
        }
        debug_assert!(self.waiters().all(|(_, n)| n.point != (epoch, collectives)), "a waiter at our point is left");
    }

    /// Our vote or collective is made at the point of `collectives` started in the committed
    /// topology ([`Peer::apart`]).
    fn calling(&mut self, collectives: u64, call: Made) {
        let epoch = self.view.committed.as_ref().expect("calls run in a topology in force").0;
        (self.last_call, self.last_apart) = (Some((epoch, collectives, call)), false);
    }

    /// Ends the call that runs alone (or a queued one): the driver hears of it, and the retry
    /// rule of how it ended ([`PeerView::vote_needed`]).
    fn finish(&mut self, id: CallId, result: Result<Value, CallError>) {
        let told = matches!(result, Err(CallError::Misuse(_) | CallError::SyncFailed { retryable: false, .. }));
        self.view.told |= told;
        let misuse = matches!(&result, Err(CallError::Aborted { failure, .. }) if failure.kind == FailureKind::Misuse);
        // Ended apart, unless a call was made since (queued behind this one, by another thread):
        // then that one is our last, and it has not met anyone yet.
        if (told || misuse) && self.last_call.is_some() {
            self.last_apart = true;
        }
        match &result {
            Ok(_) => self.view.call_ended(true),
            // Left out of a collective that ran among the others, counted as it ended there
            // (`PeerView::start_collective`), as the others count theirs.
            Err(CallError::Gone(_) | CallError::Busy(_) | CallError::Excluded { .. }) => {}
            Err(_) => self.view.call_ended(false),
        }
        if self.call.as_ref().is_some_and(|(current, ..)| *current == id) {
            self.call = None;
        }
        if self.last_apart {
            self.settle_waiters();
        }
        debug_assert!(self.ops.values().all(|o| o.call != id), "{id:?} ends while its collective runs");
        debug_assert!(self.call.as_ref().is_none_or(|(c, ..)| *c != id), "{id:?} ends and runs on");
        self.actions.push_back(Action::Done { call: id, result });
    }

    /// Ends collective `op`.
    fn end_op(&mut self, op: OpId, result: Result<Value, CallError>) {
        let Some(o) = self.ops.remove(&op) else { return };
        debug_assert!(self.call.is_none(), "{op} ended beside a call that runs alone");
        if matches!(&result, Err(CallError::Aborted { failure, .. }) if failure.kind == FailureKind::Misuse) {
            self.last_apart = self.last_call.is_some_and(|(e, seq, _)| (e, seq) == (op.epoch, op.seq.0));
            self.settle_waiters();
        }
        debug_assert!(
            match &result {
                Ok(Value::Collective(v)) => *v == op,
                Ok(_) => false,
                Err(_) => true,
            },
            "{op} ends with another value"
        );
        match &result {
            // Left out, it ran among the others: the ring is whole.
            Ok(_) | Err(CallError::Excluded { .. }) => self.view.collective_ended(op, true),
            Err(CallError::Gone(_)) => {}
            Err(_) => self.view.collective_ended(op, false),
        }
        self.actions.push_back(Action::Done { call: o.call, result });
    }

    fn set_stage(&mut self, op: OpId, stage: OpStage) {
        debug_assert!(self.ops.contains_key(&op), "{op} changes stage out of flight");
        if let Some(o) = self.ops.get_mut(&op) {
            // Forward only: running, then the lap, then a question to the master (asked again of
            // a restarted master); a failure reported only while running or in the lap.
            let legal = matches!(
                (&o.stage, &stage),
                (OpStage::Gathering, OpStage::Running | OpStage::Reporting(..) | OpStage::LeftOut(_))
                    | (OpStage::Running, OpStage::Lap | OpStage::Reporting(..) | OpStage::Asking(_))
                    | (OpStage::Lap, OpStage::Reporting(..) | OpStage::Asking(_))
                    | (OpStage::Reporting(..), OpStage::Reporting(..))
                    | (OpStage::Asking(_), OpStage::Asking(_))
            );
            assert!(legal, "{op}: {:?} -> {stage:?}", o.stage);
            o.stage = stage;
        }
    }

    /// Collective `op` did not finish here: report, and wait for the verdict naming the first
    /// failure (another participant's, say a mismatch, rather than the closed stream that
    /// followed it). An abort already decided is the answer.
    fn report(&mut self, op: OpId, failure: OpFailure, now: Instant) {
        debug_assert!(self.ops.contains_key(&op), "{op} reports a failure out of flight");
        if let Some(Verdict::Aborted(f)) = self.view.verdicts.remove(&op) {
            return self.end_op(op, Err(CallError::Aborted { op, failure: f }));
        }
        self.set_stage(op, OpStage::Reporting(now + self.config.heartbeat_timeout, failure.clone()));
        let (epoch, derived, seq, members) = (op.epoch, op.derived, op.seq.0, self.ops[&op].named(op));
        self.outbox.push_back(Message::OpFailed { epoch, derived, seq, members, failure });
        debug_assert!(self.ops.get(&op).is_none_or(|o| matches!(o.stage, OpStage::Reporting(..))));
    }

    /// The lap of `op` cannot finish: say we hold the result, and wait for the master, which asks
    /// the others. Every participant still in the run answers within its own bound, so the
    /// verdict comes within ours and a heartbeat timeout, or the master is as good as lost.
    fn ask(&mut self, op: OpId, reason: &str, now: Instant) {
        let Some(deadline) = self.ops.get(&op).map(|o| o.deadline) else { return };
        debug_assert!(!matches!(self.ops[&op].stage, OpStage::Reporting(..)), "{op} failed here, yet asks");
        log::info!("{op} finished here, asking the master ({reason})");
        self.set_stage(op, OpStage::Asking(deadline.max(now) + self.config.heartbeat_timeout));
        let (epoch, derived, seq, members) = (op.epoch, op.derived, op.seq.0, self.ops[&op].named(op));
        self.outbox.push_back(Message::OpDone { epoch, derived, seq, members, decided: false });
        debug_assert!(matches!(self.ops[&op].stage, OpStage::Asking(until) if until > now));
    }

    /// Makes every move the calls can make now.
    fn progress(&mut self, now: Instant) {
        debug_assert!(self.queue.iter().zip(self.queue.iter().skip(1)).all(|(a, b)| a.id < b.id), "calls out of order");
        if let Some(gone) = self.gone() {
            self.end_all(gone);
            return self.check();
        }
        loop {
            let mut moved = false;
            while self.step(now) {
                moved = true;
            }
            let ops: Vec<OpId> = self.ops.keys().copied().collect();
            for op in ops {
                moved |= self.step_op(op, now, None);
            }
            moved |= self.admit(now);
            if !moved {
                debug_assert!(self.queue.iter().all(|q| now < q.deadline), "a queued call past its bound waits");
                return self.check();
            }
        }
    }

    /// What holds whenever an input was handled (every input ends in [`Peer::progress`]). Each
    /// check costs O(1): this runs after every input, in every build.
    fn check(&self) {
        let cap = self.config.max_in_flight.max(1);
        debug_assert!(self.ops.len() <= cap, "{} collectives in flight, at most {cap}", self.ops.len());
        debug_assert!(self.call.is_none() || self.ops.is_empty(), "a call that runs alone runs beside collectives");
        debug_assert!(
            !matches!(self.link, Link::Lost(_) | Link::Closed) || (self.call.is_none() && self.ops.is_empty()),
            "a call outlives the master"
        );
        debug_assert!(
            self.taken_up.as_ref().is_none_or(|t| self.view.committed.as_ref().is_some_and(|(e, _)| t.epoch <= *e)),
            "a topology taken up before it was committed"
        );
        debug_assert!(!self.last_apart || self.last_call.is_some(), "a call ended apart that was never made");
    }

    /// We are out of the run: every call ends.
    fn end_all(&mut self, gone: Gone) {
        debug_assert!(self.gone().as_ref() == Some(&gone), "calls end for another reason than ours: {gone:?}");
        let mut ended: Vec<CallId> = self.call.take().map(|(id, ..)| id).into_iter().collect();
        ended.extend(std::mem::take(&mut self.ops).into_values().map(|o| o.call));
        ended.extend(self.queue.drain(..).map(|q| q.id));
        ended.sort();
        for id in ended {
            self.actions.push_back(Action::Done { call: id, result: Err(CallError::Gone(gone.clone())) });
        }
        assert!(
            self.call.is_none() && self.ops.is_empty() && self.queue.is_empty(),
            "a peer out of the run has no calls"
        );
    }

    /// Begins the next queued call if the calls before it allow; ends queued calls whose bound
    /// passed. False if nothing changed.
    fn admit(&mut self, now: Instant) -> bool {
        if let Some(i) = self.queue.iter().position(|q| now >= q.deadline) {
            let q = self.queue.remove(i).expect("found");
            self.finish(q.id, Err(CallError::Timeout));
            return true;
        }
        let Some(next) = self.queue.front() else { return false };
        let ready = self.call.is_none()
            && match next.kind {
                CallKind::Collective(..) | CallKind::Gathered(..) => {
                    self.ops.len() < self.config.max_in_flight.max(1)
                        && (self.ops.is_empty() || !self.topology_issued())
                }
                _ => self.ops.is_empty(),
            };
        if ready {
            let Queued { id, kind, deadline } = self.queue.pop_front().expect("a call waits");
            debug_assert!(self.ops.values().all(|o| o.call < id), "{id:?} begins before a call made earlier");
            self.begin(id, kind, deadline);
        }
        assert!(self.ops.len() <= self.config.max_in_flight.max(1), "more collectives in flight than allowed");
        ready
    }

    /// One move of the call that runs alone; false when it waits for something.
    fn step(&mut self, now: Instant) -> bool {
        let Some((id, deadline, call)) = self.call.clone() else { return false };
        debug_assert!(self.ops.is_empty() && self.gone().is_none(), "{id:?} runs alone, in the run");
        match call {
            Call::Registering { join: Some(Joining { group, data_addr, catch_up }) } => match self.view.challenge {
                Some(nonce) => {
                    debug_assert!(self.view.registered.is_none(), "Join goes out once registered");
                    let proof = self.config.key.as_ref().map_or([0; 32], |key| key.prove(&nonce));
                    self.outbox.push_back(Message::Join { group, data_addr, proof, catch_up });
                    self.call = Some((id, deadline, Call::Registering { join: None }));
                    true
                }
                None => self.timed_out(id, deadline, now),
            },
            Call::Registering { join: None } => match self.view.registered {
                Some((me, session)) => {
                    debug_assert!(self.taken_up.is_none(), "a newcomer runs in a topology before it joined");
                    let data_key = self.view.data_key.clone().expect("registered with the run's data key");
                    self.actions.push_back(Action::Registered { me, session, data_key });
                    let call = Call::Topology { purpose: Purpose::Connect, handled: None, establishing: None };
                    self.call = Some((id, deadline, call));
                    true
                }
                None => self.timed_out(id, deadline, now),
            },
            Call::Topology { purpose, handled, establishing } => {
                // A call that waits for the others to join a re-formed ring, which they may never
                // do: they are in no call, as their calls at this point ended apart.
                let voting = matches!(purpose, Purpose::Vote(_));
                if voting && matches!(self.view.vote_aborted, Some(VoteAbort::Abandoned(_))) {
                    let Some(VoteAbort::Abandoned(misuse)) = self.view.vote_aborted.take() else { unreachable!() };
                    self.finish(id, Err(CallError::Misuse(misuse)));
                    return true;
                }
                if let Purpose::Follow(kind) = &purpose {
                    if self.ended_apart(id, kind) {
                        return true;
                    }
                }
                if establishing.is_some() {
                    return self.timed_out(id, deadline, now);
                }
                match self.view.topology_step(handled, voting) {
                    // Not counted while a topology connected: join it, then vote again.
                    Some(TopologyStep::VoteRefused) => {
                        let Purpose::Vote(kind) = purpose else { unreachable!("only a vote is refused") };
                        self.begin(id, kind, deadline)
                    }
                    Some(TopologyStep::VoteAbandoned(misuse)) => self.finish(id, Err(CallError::Misuse(misuse))),
                    Some(TopologyStep::Establish(epoch, members)) => {
                        let position = self.view.position(epoch, &members);
                        self.actions.push_back(Action::Establish { position, deadline });
                        if let Some((_, _, Call::Topology { establishing, .. })) = &mut self.call {
                            *establishing = Some(epoch);
                        }
                        debug_assert!(self.establishing(epoch), "{id:?} ended as it began to establish");
                    }
                    Some(TopologyStep::InForce(..)) => {
                        self.take_up();
                        match purpose {
                            Purpose::Connect => {
                                self.catching_up = None;
                                self.finish(id, Ok(Value::Joined))
                            }
                            Purpose::Vote(_) => self.finish(id, Ok(Value::TopologyInForce)),
                            Purpose::Follow(kind) => self.run(id, kind, deadline),
                        }
                    }
                    None => return self.timed_out(id, deadline, now),
                }
                true
            }
            Call::Pending => {
                match self.view.pending_aborted.take() {
                    // Not counted: a topology was issued. Join it, then vote again.
                    Some(VoteAbort::Retry) => self.begin(id, CallKind::PeersPending, deadline),
                    Some(VoteAbort::Abandoned(misuse)) => self.finish(id, Err(CallError::Misuse(misuse))),
                    None => match self.view.pending_result.take() {
                        Some(pending) => self.finish(id, Ok(Value::Pending(pending))),
                        None => return self.timed_out(id, deadline, now),
                    },
                }
                true
            }
            Call::Sync(stage) => self.step_sync(id, deadline, stage, now),
        }
    }

    fn step_sync(&mut self, id: CallId, deadline: Instant, stage: SyncStage, now: Instant) -> bool {
        debug_assert!(matches!(&self.call, Some((c, _, Call::Sync(_))) if *c == id), "{id:?} is no sync");
        match stage {
            SyncStage::Voted(ballot) => {
                if let Some((round, Err(SyncAbort { retryable, reason }))) = self.view.sync_end.take() {
                    if round == 0 && retryable && self.topology_issued() {
                        // Refused, not counted: the vote crossed a topology issued meanwhile (a
                        // member was lost). Join it, then vote again, as the other votes do.
                        log::debug!("sync_shared_state crossed a topology: {reason}; voting again");
                        self.begin(id, CallKind::SyncSharedState(ballot), deadline);
                    } else {
                        self.finish(id, Err(sync_failed(retryable, reason)));
                    }
                    return true;
                }
                let Some((round, revision, entries)) = self.view.sync_plan.take() else {
                    return self.timed_out(id, deadline, now);
                };
                let revision = Revision(revision);
                self.actions.push_back(Action::Fetch { round, revision, entries });
                self.call = Some((id, deadline, Call::Sync(SyncStage::Fetching { round, revision })));
                true
            }
            // What the master says meanwhile waits until the fetch reports.
            SyncStage::Fetching { .. } => self.timed_out(id, deadline, now),
            SyncStage::Reported { round, revision } => match self.view.sync_end.take() {
                Some((r, end)) if r == round => {
                    self.finish(
                        id,
                        match end {
                            Ok(()) => Ok(Value::Synced(revision)),
                            Err(SyncAbort { retryable, reason }) => Err(sync_failed(retryable, reason)),
                        },
                    );
                    debug_assert!(self.call.is_none(), "{id:?} ended and runs on");
                    true
                }
                _ => self.timed_out(id, deadline, now),
            },
        }
    }

    /// One move of collective `op`; false when it waits. The master's decision and the bound stop
    /// it at once; a vote it can never complete against, or a removed member, only once the data
    /// plane is `stalled` (has nothing to move until the network delivers; with the members it
    /// still moves data with): while bytes still flow the collective may complete without the
    /// member, whose part may all be in flight. A removed member it is done with stops it only
    /// [`Peer::removal_grace`] after the news.
    fn step_op(&mut self, op: OpId, now: Instant, stalled: Option<&[PeerId]>) -> bool {
        let Some(InFlight { deadline, members, stage, api, .. }) = self.ops.get(&op).cloned() else { return false };
        let before = std::mem::discriminant(&stage);
        let moved = match stage {
            OpStage::Gathering => return self.step_gathering(op, api, deadline, now),
            OpStage::LeftOut(included) => {
                match self.view.verdicts.remove(&op) {
                    Some(Verdict::Committed) => {
                        let me = self.view.registered.expect("a collective runs once registered").0;
                        let ahead = self.view.decided_past(op, me);
                        self.end_op(op, Err(CallError::Excluded { op, included, ahead }))
                    }
                    Some(Verdict::Aborted(failure)) => self.end_op(op, Err(CallError::Aborted { op, failure })),
                    None if now >= deadline => self.end_op(op, Err(CallError::Timeout)),
                    None => return false,
                }
                true
            }
            OpStage::Running => {
                let me = self.view.registered.expect("a collective runs once registered").0;
                let interrupt = self.view.interrupt(op, api, stalled.unwrap_or_default());
                let late = stalled.and_then(|_| self.removed_long_ago(&members, now));
                let failure = match interrupt.or(late.map(Interrupt::MemberLost)) {
                    Some(Interrupt::Aborted(failure)) => {
                        self.view.verdicts.remove(&op);
                        self.end_op(op, Err(CallError::Aborted { op, failure }));
                        return true;
                    }
                    Some(Interrupt::Blocked(misuse)) if stalled.is_some() => OpFailure::misuse(me, misuse),
                    Some(Interrupt::Superseded(issued)) if stalled.is_some() => {
                        let why = format!("topology {} was issued while {op} waited for its members", issued.0);
                        OpFailure::new(FailureKind::Superseded, me, why)
                    }
                    Some(Interrupt::MemberLost(peer)) => {
                        OpFailure::new(FailureKind::PeerLost, peer, "the master removed it from the run")
                    }
                    _ if now >= deadline => {
                        OpFailure::new(FailureKind::Timeout, me, format!("{me}: {op} did not end in time"))
                    }
                    _ => return false,
                };
                self.report(op, failure, now);
                assert!(!self.running(op), "{op} reported a failure and runs on");
                true
            }
            OpStage::Lap => {
                match self.view.lap_interrupt(op, &members) {
                    Some(LapInterrupt::Verdict(v)) => self.verdict(op, v, None),
                    Some(LapInterrupt::MemberLost(peer)) if stalled.is_some() => {
                        self.ask(op, &format!("the master removed {peer}"), now)
                    }
                    _ if now >= deadline => self.ask(op, "its bound passed", now),
                    _ => return false,
                }
                true
            }
            OpStage::Asking(until) => {
                match self.view.verdicts.remove(&op) {
                    Some(v) => self.verdict(op, v, None),
                    None if now >= until => self.end_op(op, Err(CallError::Timeout)),
                    None => return false,
                }
                true
            }
            OpStage::Reporting(until, failure) => {
                match self.view.verdicts.remove(&op) {
                    Some(v) => self.verdict(op, v, Some(failure)),
                    None if now >= until => self.end_op(op, Err(CallError::Unconfirmed { op, failure })),
                    None => return false,
                }
                true
            }
        };
        debug_assert!(
            !moved || self.ops.get(&op).is_none_or(|o| std::mem::discriminant(&o.stage) != before),
            "a step of {op} that moved left it where it was"
        );
        moved
    }

    /// Collective `op`, called with a deadline, waits for the master to name its members: runs
    /// among them once it has, or ends left out. Whatever stops a collective that moves no data
    /// stops it meanwhile (an abort, a vote that blocks it, its bound).
    fn step_gathering(&mut self, op: OpId, api: Api, deadline: Instant, now: Instant) -> bool {
        let me = self.view.registered.expect("a collective runs once registered").0;
        if let Some(Verdict::Aborted(failure)) = self.view.verdicts.get(&op) {
            // Failed before we called (or before we heard whom it ran among): so here.
            let failure = failure.clone();
            self.view.verdicts.remove(&op);
            self.end_op(op, Err(CallError::Aborted { op, failure }));
            return true;
        }
        if let Some(included) = self.view.gathered.remove(&op) {
            if !included.contains(&me) {
                self.set_stage(op, OpStage::LeftOut(included));
                return true;
            }
            if included.len() == 1 {
                // Alone: nothing moves, as in a group of one.
                self.end_op(op, Ok(Value::Collective(op)));
                return true;
            }
            let position = self.position().expect("a collective runs in the topology taken up");
            let group: Vec<usize> =
                included.iter().filter_map(|p| position.ring.iter().position(|m| m.peer == *p)).collect();
            let o = self.ops.get_mut(&op).expect("in flight");
            o.members = included;
            let (call, deadline) = (o.call, o.deadline);
            self.set_stage(op, OpStage::Running);
            self.actions.push_back(Action::RunCollective { call, op, position, group, deadline });
            return true;
        }
        let failure = match self.view.interrupt(op, api, &[]) {
            Some(Interrupt::Aborted(failure)) => {
                self.view.verdicts.remove(&op);
                self.end_op(op, Err(CallError::Aborted { op, failure }));
                return true;
            }
            Some(Interrupt::Blocked(misuse)) => OpFailure::misuse(me, misuse),
            _ if now >= deadline => OpFailure::new(FailureKind::Timeout, me, format!("{me}: {op} was never decided")),
            _ => return false,
        };
        self.report(op, failure, now);
        true
    }

    /// The master's verdict on collective `op`, which failed here with `failed_here`, if it did.
    fn verdict(&mut self, op: OpId, verdict: Verdict, failed_here: Option<OpFailure>) {
        assert!(self.ops.contains_key(&op), "a verdict on {op}, which is not in flight");
        let result = match (verdict, failed_here) {
            // The master never commits a collective a participant failed; the local error stands.
            (Verdict::Committed, Some(failure)) => Err(CallError::Unconfirmed { op, failure }),
            (Verdict::Committed, None) => {
                self.view.remember_commit(op);
                Ok(Value::Collective(op))
            }
            (Verdict::Aborted(failure), _) => Err(CallError::Aborted { op, failure }),
        };
        self.end_op(op, result);
        assert!(!self.ops.contains_key(&op), "{op} outlives its verdict");
    }

    /// Ends the call that runs alone with a timeout once `deadline` passed; false (it waits)
    /// otherwise.
    fn timed_out(&mut self, id: CallId, deadline: Instant, now: Instant) -> bool {
        debug_assert!(self.call.as_ref().is_some_and(|(c, ..)| *c == id), "{id:?} times out, yet never ran");
        if now >= deadline {
            self.finish(id, Err(CallError::Timeout));
            assert!(self.call.as_ref().is_none_or(|(c, ..)| *c != id), "{id:?} timed out, yet runs");
            return true;
        }
        false
    }
}

/// Member `waiter`'s transfer with us (`note`) and our call `ours` can never complete together
/// (`ended`: ours ended already, as one of calls that cannot complete together).
fn p2p_misuse(waiter: PeerId, note: &WaitNote, me: PeerId, ours: Made, ended: bool) -> Misuse {
    debug_assert!(waiter != me, "we wait on ourselves");
    let misuse = Misuse::new(
        Called::new([waiter], Made::Transfer { send: note.send, peer: me, tag: note.tag }),
        Called::new([me], ours),
    );
    Misuse { settled: ended, ..misuse }
}

/// Our call `ours`, made where the others' calls ended as `settled`: the usage error that names
/// it and the one of theirs unlike it (the first to end, if both are).
fn settled_against(me: PeerId, ours: Made, settled: &Misuse) -> Misuse {
    let theirs = settled.calls().into_iter().find(|c| c.call.of_api() != ours.of_api()).unwrap_or(&settled.ours);
    Misuse::settled(Called::new([me], ours), theirs.clone())
}

/// How a sync the master aborted fails: with a usage error where it names the calls that cannot
/// complete together, else as a failed sync.
fn sync_failed(retryable: bool, reason: Reason) -> CallError {
    match reason {
        Reason::Misuse(misuse) => CallError::Misuse(*misuse),
        Reason::Text(reason) => CallError::SyncFailed { retryable, reason },
        // The wire refuses it: a sync has no collective to mismatch.
        Reason::Mismatch(m) => CallError::SyncFailed { retryable, reason: m.to_string() },
    }
}

#[cfg(test)]
mod tests;
