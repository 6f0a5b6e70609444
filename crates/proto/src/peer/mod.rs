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

mod view;

pub use view::{
    Interrupt, LapInterrupt, PeerEvent, PeerView, RingPosition, SyncAbort, TopologyStep, UnexpectedMessage, Verdict,
    VoteAbort, VoteOpen,
};

use crate::auth::{DataKey, RunKey};
use crate::master::heartbeat_interval;
use shoal_wire::{Epoch, FailureKind, GroupId, Message, OpFailure, PeerId, PlanEntry, SessionId, StateDigest, Vote};
use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant};

/// A collective's number within its topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Seq(pub u64);

/// A shared state's revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Revision(pub u64);

/// A collective's name on every participant: its topology and its number there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpId {
    /// The topology it runs in.
    pub epoch: Epoch,
    /// Its number there.
    pub seq: Seq,
}

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "collective {} of topology {}", self.seq.0, self.epoch.0)
    }
}

/// The timing a peer keeps, and its credentials.
#[derive(Debug, Clone)]
pub struct PeerConfig {
    /// A master silent this long is lost; a participant's report or verdict is awaited this long.
    pub heartbeat_timeout: Duration,
    /// The key of the run's secret, proved in `Join` (`crate::auth`); `None` proves nothing.
    pub key: Option<RunKey>,
}

/// A call of the application, after the peer joined ([`Peer::call`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallKind {
    /// `update_topology`: the admission vote.
    UpdateTopology,
    /// `peers_pending`: whether newcomers wait.
    PeersPending,
    /// `sync_shared_state` with this peer's ballot.
    SyncSharedState(SyncBallot),
    /// A collective (all-reduce): its data moves in [`Action::RunCollective`].
    Collective,
}

impl CallKind {
    /// The call's name, as users know it.
    pub fn name(&self) -> &'static str {
        match self {
            CallKind::UpdateTopology => "update_topology",
            CallKind::PeersPending => "peers_pending",
            CallKind::SyncSharedState(_) => "sync_shared_state",
            CallKind::Collective => "all_reduce",
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
    /// then report with [`Peer::handle_collective`].
    RunCollective {
        /// The collective.
        op: OpId,
        /// Our place in its ring.
        position: RingPosition,
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
    /// The call ended.
    Done(Result<Value, CallError>),
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
    /// The peers made calls that cannot complete together.
    Misuse(String),
    /// The sync ended without effect.
    SyncFailed {
        /// Calling again can succeed.
        retryable: bool,
        /// Why.
        reason: String,
    },
    /// We left the run, or lost the master.
    Gone(Gone),
    /// A call was made while another was in progress, or before joining.
    Busy(&'static str),
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
    /// stops the collective short of the master's decision (a removed member, a vote it can never
    /// complete against) stops it now.
    Stalled,
}

/// Where a collective stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum OpStage {
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

/// Why a call waits for a topology.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Purpose {
    /// `connect`: a newcomer waits to be admitted.
    Connect,
    /// Our `update_topology` vote.
    Vote,
    /// Another call joins a topology issued without a vote (a re-formed ring), then runs.
    Follow(CallKind),
}

/// The call in progress, with what it waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Idle,
    /// `connect`: waiting for the master's challenge to send `Join` (what it carries, until
    /// sent), then to be registered.
    Registering {
        deadline: Instant,
        join: Option<(GroupId, String)>,
    },
    Topology {
        deadline: Instant,
        purpose: Purpose,
        /// The last topology established (or found unreachable) by this call.
        handled: Option<Epoch>,
        /// The topology the data plane is establishing now.
        establishing: Option<Epoch>,
    },
    Pending {
        deadline: Instant,
    },
    Sync {
        deadline: Instant,
        stage: SyncStage,
    },
    Collective {
        deadline: Instant,
        op: OpId,
        members: Vec<PeerId>,
        stage: OpStage,
    },
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
#[derive(Debug)]
pub struct Peer {
    config: PeerConfig,
    view: PeerView,
    call: Call,
    /// Our place in the committed topology our calls run in ([`Action::TakeUp`]).
    taken_up: Option<RingPosition>,
    outbox: VecDeque<Message>,
    actions: VecDeque<Action>,
    lost: Option<String>,
    closed: bool,
    last_heard: Instant,
    next_heartbeat: Instant,
}

impl Peer {
    /// A peer that has not joined yet.
    pub fn new(config: PeerConfig, now: Instant) -> Self {
        Peer {
            view: PeerView::default(),
            call: Call::Idle,
            taken_up: None,
            outbox: VecDeque::new(),
            actions: VecDeque::new(),
            lost: None,
            closed: false,
            last_heard: now,
            next_heartbeat: now + heartbeat_interval(config.heartbeat_timeout),
            config,
        }
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
        if self.closed {
            return Some(Gone::Closed);
        }
        self.lost.clone().map(Gone::MasterLost)
    }

    /// Whether a call is in progress.
    pub fn busy(&self) -> bool {
        self.call != Call::Idle
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

    /// Whether collective `op` still wants its data (or, in its lap, its tokens) moved. Once it
    /// does not, the data plane stops and waits for [`Action::Done`]. A data plane about to sleep
    /// reports [`OpProgress::Stalled`] first.
    pub fn running(&self, op: OpId) -> bool {
        matches!(&self.call, Call::Collective { op: o, stage: OpStage::Running | OpStage::Lap, .. } if *o == op)
    }

    /// Joins the run: answers the master's challenge with `Join`; the call is done once the
    /// accepted peers admit us.
    pub fn connect(&mut self, group: GroupId, data_addr: String, bound: Duration, now: Instant) {
        if self.busy() || self.view.registered.is_some() {
            return self.actions.push_back(Action::Done(Err(CallError::Busy("connect"))));
        }
        self.call = Call::Registering { deadline: now + bound, join: Some((group, data_addr)) };
        self.progress(now);
    }

    /// Starts call `kind`, which must end within `bound`. First, as every call does, it joins a
    /// topology the master issued since the last call (`docs/protocol.md`, "Retry").
    pub fn call(&mut self, kind: CallKind, bound: Duration, now: Instant) {
        if let Some(gone) = self.gone() {
            return self.actions.push_back(Action::Done(Err(CallError::Gone(gone))));
        }
        if self.busy() || self.view.committed.is_none() {
            return self.actions.push_back(Action::Done(Err(CallError::Busy(kind.name()))));
        }
        self.begin(kind, now + bound);
        self.progress(now);
    }

    /// Applies one message from the master.
    ///
    /// # Errors
    /// [`UnexpectedMessage`] for one a master never sends; the master is then lost to us.
    pub fn handle_message(&mut self, message: Message, now: Instant) -> Result<PeerEvent, UnexpectedMessage> {
        self.last_heard = now;
        let event = self.view.handle_message(message);
        // The master may ask for heartbeats more often than we would send them (`Registered`).
        self.next_heartbeat = self.next_heartbeat.min(now + self.heartbeat_every());
        while let Some(m) = self.view.poll_output() {
            self.outbox.push_back(m);
        }
        match &event {
            Ok(_) => self.progress(now),
            Err(e) => self.handle_disconnect(e.to_string(), now),
        }
        event
    }

    /// The connection to the master failed.
    pub fn handle_disconnect(&mut self, reason: String, now: Instant) {
        // Once expelled, refused or closed, the master closing the connection is no news.
        if self.gone().is_none() {
            log::warn!("master lost: {reason}");
            self.lost = Some(reason);
        }
        self.progress(now);
    }

    /// Time passed: heartbeats fall due, a silent master is lost, bounds end.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.gone().is_none() {
            let silent = now.saturating_duration_since(self.last_heard);
            if silent > self.config.heartbeat_timeout {
                return self.handle_disconnect(format!("no message for {:.1} s", silent.as_secs_f64()), now);
            }
            if now >= self.next_heartbeat {
                self.outbox.push_back(Message::Heartbeat);
                self.next_heartbeat = now + self.heartbeat_every();
            }
        }
        self.progress(now);
    }

    /// When [`Peer::handle_timeout`] is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.gone().is_some() {
            return None;
        }
        let deadline = match &self.call {
            Call::Idle => None,
            Call::Registering { deadline, .. }
            | Call::Topology { deadline, .. }
            | Call::Pending { deadline }
            | Call::Sync { deadline, .. } => Some(*deadline),
            Call::Collective { deadline, stage, .. } => Some(match stage {
                OpStage::Running | OpStage::Lap => *deadline,
                OpStage::Asking(until) | OpStage::Reporting(until, _) => *until,
            }),
        };
        let silent = self.last_heard + self.config.heartbeat_timeout + Duration::from_millis(1);
        Some(deadline.into_iter().fold(self.next_heartbeat.min(silent), Instant::min))
    }

    /// The next message for the master, in order.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<Message> {
        self.outbox.pop_front()
    }

    /// The next thing the calling thread must do.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The data plane handled an [`Action::Establish`].
    pub fn handle_established(&mut self, epoch: Epoch, outcome: Established, now: Instant) {
        let Call::Topology { establishing, handled, .. } = &mut self.call else { return };
        if *establishing != Some(epoch) {
            return;
        }
        *establishing = None;
        *handled = Some(epoch);
        match outcome {
            Established::Ready => {
                // Before the report: its commit may come before the driver returns.
                self.view.ready_in = Some(epoch);
                self.outbox.push_back(Message::TopologyReady { epoch });
            }
            Established::Unreachable(peer) => self.outbox.push_back(Message::PeerUnreachable { epoch, peer }),
            Established::Superseded => {}
        }
        self.progress(now);
    }

    /// The data plane's news of collective `op`.
    pub fn handle_collective(&mut self, op: OpId, progress: OpProgress, now: Instant) {
        let Call::Collective { op: current, stage, .. } = &mut self.call else { return };
        if *current != op {
            return;
        }
        match (progress, stage.clone()) {
            (OpProgress::DataDone, OpStage::Running) => *stage = OpStage::Lap,
            (OpProgress::Confirmed, OpStage::Lap) => {
                // Every participant holds the result: committed without the master, which hears
                // of it only if it asks (to answer a participant that could not tell).
                self.view.commit_on_our_own(op.epoch, op.seq.0);
                while let Some(m) = self.view.poll_output() {
                    self.outbox.push_back(m);
                }
                self.finish(Ok(Value::Collective(op)));
            }
            (OpProgress::LapBroken(reason), OpStage::Lap) => self.ask(&reason, now),
            (OpProgress::Failed(failure), OpStage::Running) => self.report(failure, now),
            (OpProgress::Stalled, stage @ (OpStage::Running | OpStage::Lap)) => {
                let Call::Collective { deadline, members, .. } = self.call.clone() else { unreachable!() };
                self.step_collective(deadline, op, &members, stage, now, true);
            }
            // The peer stopped it already (a verdict, a lost member, the bound): its decision stands.
            _ => {}
        }
        self.progress(now);
    }

    /// The data plane fetched (or failed to fetch) what sync `round` asked of it.
    pub fn handle_fetched(&mut self, round: u64, fetched: Result<(), String>, now: Instant) {
        let Call::Sync { stage, .. } = &mut self.call else { return };
        let SyncStage::Fetching { round: r, revision } = *stage else { return };
        if r != round {
            return;
        }
        *stage = SyncStage::Reported { round, revision };
        self.outbox.push_back(match fetched {
            Ok(()) => Message::SyncDone { round },
            Err(reason) => {
                Message::SyncFailed { round, reason: shoal_wire::truncate(reason, shoal_wire::MAX_STRING_BYTES) }
            }
        });
        self.progress(now);
    }

    /// Leaves the run: tells the master, and every call in progress ends.
    pub fn close(&mut self, now: Instant) {
        if !self.closed {
            self.closed = true;
            self.outbox.push_back(Message::Leave);
        }
        self.progress(now);
    }

    fn heartbeat_every(&self) -> Duration {
        // As often as we need to watch the master, or as the master asks, whichever is more.
        let ours = heartbeat_interval(self.config.heartbeat_timeout);
        self.view.heartbeat_interval.map_or(ours, |theirs| theirs.min(ours))
    }

    /// Starts `kind`, joining an issued topology first, or taking up one committed between calls
    /// (we reported ready in a call that then failed: its pools are ours already).
    fn begin(&mut self, kind: CallKind, deadline: Instant) {
        if self.topology_issued() {
            let handled = self.view.ready_in;
            self.call = Call::Topology { deadline, purpose: Purpose::Follow(kind), handled, establishing: None };
            return;
        }
        self.take_up();
        self.run(kind, deadline);
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
            let position = self.view.position(*epoch, members);
            self.taken_up = Some(position.clone());
            self.actions.push_back(Action::TakeUp(position));
        }
    }

    /// The call itself, once this peer runs in the latest topology.
    fn run(&mut self, kind: CallKind, deadline: Instant) {
        match kind {
            CallKind::UpdateTopology => {
                let collectives = self.view.cast_vote(Vote::UpdateTopology);
                if !self.view.vote_needed() {
                    log::debug!("update_topology after a failure: the ring re-formed already");
                    return self.finish(Ok(Value::TopologyInForce));
                }
                self.outbox.push_back(Message::VoteUpdateTopology { collectives });
                let handled = self.view.ready_in;
                self.call = Call::Topology { deadline, purpose: Purpose::Vote, handled, establishing: None };
            }
            CallKind::PeersPending => {
                let collectives = self.view.cast_vote(Vote::PeersPending);
                self.outbox.push_back(Message::VotePeersPending { collectives });
                self.call = Call::Pending { deadline };
            }
            CallKind::SyncSharedState(ballot) => {
                let collectives = self.view.cast_vote(Vote::SyncSharedState);
                let SyncBallot { revision, strategy, override_resume, entries } = ballot.clone();
                let vote = Message::SyncVote { revision: revision.0, strategy, override_resume, entries, collectives };
                self.outbox.push_back(vote);
                self.call = Call::Sync { deadline, stage: SyncStage::Voted(ballot) };
            }
            CallKind::Collective => match self.view.start_collective() {
                // The others failed it before we started it: it fails here too, untouched.
                Err((epoch, seq, failure)) => {
                    self.finish(Err(CallError::Aborted { op: OpId { epoch, seq: Seq(seq) }, failure }))
                }
                Ok((epoch, seq)) => {
                    let op = OpId { epoch, seq: Seq(seq) };
                    let position = self.position().expect("a collective runs in the topology taken up");
                    if position.group_size() == 1 {
                        return self.finish(Ok(Value::Collective(op)));
                    }
                    let members = position.ring.iter().map(|m| m.peer).collect();
                    self.actions.push_back(Action::RunCollective { op, position, deadline });
                    self.call = Call::Collective { deadline, op, members, stage: OpStage::Running };
                }
            },
        }
    }

    /// Ends the call: the driver hears of it, and the retry rule of how it ended
    /// ([`PeerView::vote_needed`]).
    fn finish(&mut self, result: Result<Value, CallError>) {
        match &result {
            Ok(_) => self.view.call_ended(true),
            Err(CallError::Gone(_) | CallError::Busy(_)) => {}
            Err(_) => self.view.call_ended(false),
        }
        self.call = Call::Idle;
        self.actions.push_back(Action::Done(result));
    }

    /// This participant did not finish collective: report, and wait for the verdict naming the
    /// first failure (another participant's, say a mismatch, rather than the closed stream that
    /// followed it). An abort already decided is the answer.
    fn report(&mut self, failure: OpFailure, now: Instant) {
        let Call::Collective { op, stage, .. } = &mut self.call else { return };
        let op = *op;
        if let Some(Verdict::Aborted(f)) = self.view.verdicts.remove(&(op.epoch, op.seq.0)) {
            return self.finish(Err(CallError::Aborted { op, failure: f }));
        }
        *stage = OpStage::Reporting(now + self.config.heartbeat_timeout, failure.clone());
        self.outbox.push_back(Message::OpFailed { epoch: op.epoch, seq: op.seq.0, failure });
    }

    /// The lap cannot finish: say we hold the result, and wait for the master, which asks the
    /// others. Every participant still in the run answers within its own bound, so the verdict
    /// comes within ours and a heartbeat timeout, or the master is as good as lost.
    fn ask(&mut self, reason: &str, now: Instant) {
        let timeout = self.config.heartbeat_timeout;
        let Call::Collective { op, stage, deadline, .. } = &mut self.call else { return };
        log::info!("{op} finished here, asking the master ({reason})");
        *stage = OpStage::Asking((*deadline).max(now) + timeout);
        self.outbox.push_back(Message::OpDone { epoch: op.epoch, seq: op.seq.0, decided: false });
    }

    /// Makes every move the call can make now.
    fn progress(&mut self, now: Instant) {
        while self.step(now) {}
    }

    /// One move of the call in progress; false when it waits for something.
    fn step(&mut self, now: Instant) -> bool {
        if self.call == Call::Idle {
            return false;
        }
        if let Some(gone) = self.gone() {
            self.finish(Err(CallError::Gone(gone)));
            return false;
        }
        match self.call.clone() {
            Call::Idle => false,
            Call::Registering { deadline, join: Some((group, data_addr)) } => match self.view.challenge {
                Some(nonce) => {
                    let proof = self.config.key.as_ref().map_or([0; 32], |key| key.prove(&nonce));
                    self.outbox.push_back(Message::Join { group, data_addr, proof });
                    self.call = Call::Registering { deadline, join: None };
                    true
                }
                None => self.timed_out(deadline, now),
            },
            Call::Registering { deadline, join: None } => match self.view.registered {
                Some((me, session)) => {
                    let data_key = self.view.data_key.clone().expect("registered with the run's data key");
                    self.actions.push_back(Action::Registered { me, session, data_key });
                    let purpose = Purpose::Connect;
                    self.call = Call::Topology { deadline, purpose, handled: None, establishing: None };
                    true
                }
                None => self.timed_out(deadline, now),
            },
            Call::Topology { deadline, purpose, handled, establishing } => {
                if establishing.is_some() {
                    return self.timed_out(deadline, now);
                }
                match self.view.topology_step(handled, purpose == Purpose::Vote) {
                    // Not counted while a topology connected: join it, then vote again.
                    Some(TopologyStep::VoteRefused) => self.begin(CallKind::UpdateTopology, deadline),
                    Some(TopologyStep::VoteAbandoned(reason)) => self.finish(Err(CallError::Misuse(reason))),
                    Some(TopologyStep::Establish(epoch, members)) => {
                        let position = self.view.position(epoch, &members);
                        self.actions.push_back(Action::Establish { position, deadline });
                        if let Call::Topology { establishing, .. } = &mut self.call {
                            *establishing = Some(epoch);
                        }
                    }
                    Some(TopologyStep::InForce(..)) => {
                        self.take_up();
                        match purpose {
                            Purpose::Connect => self.finish(Ok(Value::Joined)),
                            Purpose::Vote => self.finish(Ok(Value::TopologyInForce)),
                            Purpose::Follow(kind) => self.run(kind, deadline),
                        }
                    }
                    None => return self.timed_out(deadline, now),
                }
                true
            }
            Call::Pending { deadline } => {
                match self.view.pending_aborted.take() {
                    // Not counted: a topology was issued. Join it, then vote again.
                    Some(VoteAbort { retry: true, .. }) => self.begin(CallKind::PeersPending, deadline),
                    Some(VoteAbort { retry: false, reason }) => self.finish(Err(CallError::Misuse(reason))),
                    None => match self.view.pending_result.take() {
                        Some(pending) => self.finish(Ok(Value::Pending(pending))),
                        None => return self.timed_out(deadline, now),
                    },
                }
                true
            }
            Call::Sync { deadline, stage } => self.step_sync(deadline, stage, now),
            Call::Collective { deadline, op, members, stage } => {
                self.step_collective(deadline, op, &members, stage, now, false)
            }
        }
    }

    fn step_sync(&mut self, deadline: Instant, stage: SyncStage, now: Instant) -> bool {
        match stage {
            SyncStage::Voted(ballot) => {
                if let Some((round, Err(SyncAbort { retryable, reason }))) = self.view.sync_end.take() {
                    if round == 0 && retryable && self.topology_issued() {
                        // Refused, not counted: the vote crossed a topology issued meanwhile (a
                        // member was lost). Join it, then vote again, as the other votes do.
                        log::debug!("sync_shared_state crossed a topology: {reason}; voting again");
                        self.begin(CallKind::SyncSharedState(ballot), deadline);
                    } else {
                        self.finish(Err(CallError::SyncFailed { retryable, reason }));
                    }
                    return true;
                }
                let Some((round, revision, entries)) = self.view.sync_plan.take() else {
                    return self.timed_out(deadline, now);
                };
                let revision = Revision(revision);
                self.actions.push_back(Action::Fetch { round, revision, entries });
                self.call = Call::Sync { deadline, stage: SyncStage::Fetching { round, revision } };
                true
            }
            // What the master says meanwhile waits until the fetch reports.
            SyncStage::Fetching { .. } => self.timed_out(deadline, now),
            SyncStage::Reported { round, revision } => match self.view.sync_end.take() {
                Some((r, end)) if r == round => {
                    self.finish(match end {
                        Ok(()) => Ok(Value::Synced(revision)),
                        Err(SyncAbort { retryable, reason }) => Err(CallError::SyncFailed { retryable, reason }),
                    });
                    true
                }
                _ => self.timed_out(deadline, now),
            },
        }
    }

    /// One move of collective `op`. The master's decision and the bound stop it at once; a
    /// removed member or a vote it can never complete against only once the data plane is
    /// `stalled` (has nothing to move until the network delivers): while bytes still flow the
    /// collective may complete without the member, whose part may all be in flight.
    #[allow(clippy::too_many_arguments)]
    fn step_collective(
        &mut self,
        deadline: Instant,
        op: OpId,
        members: &[PeerId],
        stage: OpStage,
        now: Instant,
        stalled: bool,
    ) -> bool {
        let (epoch, seq) = (op.epoch, op.seq.0);
        match stage {
            OpStage::Running => {
                let me = self.view.registered.expect("a collective runs once registered").0;
                let failure = match self.view.interrupt(epoch, seq, members) {
                    Some(Interrupt::Aborted(failure)) => {
                        self.finish(Err(CallError::Aborted { op, failure }));
                        return true;
                    }
                    Some(Interrupt::Blocked(why)) if stalled => OpFailure::new(FailureKind::Misuse, me, why),
                    Some(Interrupt::MemberLost(peer)) if stalled => {
                        OpFailure::new(FailureKind::PeerLost, peer, "the master removed it from the run")
                    }
                    _ if now >= deadline => {
                        OpFailure::new(FailureKind::Timeout, me, format!("{me}: {op} did not end in time"))
                    }
                    _ => return false,
                };
                self.report(failure, now);
                true
            }
            OpStage::Lap => {
                match self.view.lap_interrupt(epoch, seq, members) {
                    Some(LapInterrupt::Verdict(v)) => self.verdict(op, v, None),
                    Some(LapInterrupt::MemberLost(peer)) if stalled => {
                        self.ask(&format!("the master removed {peer}"), now)
                    }
                    _ if now >= deadline => self.ask("its bound passed", now),
                    _ => return false,
                }
                true
            }
            OpStage::Asking(until) => {
                match self.view.verdicts.remove(&(epoch, seq)) {
                    Some(v) => self.verdict(op, v, None),
                    None if now >= until => self.finish(Err(CallError::Timeout)),
                    None => return false,
                }
                true
            }
            OpStage::Reporting(until, failure) => {
                match self.view.verdicts.remove(&(epoch, seq)) {
                    Some(v) => self.verdict(op, v, Some(failure)),
                    None if now >= until => self.finish(Err(CallError::Unconfirmed { op, failure })),
                    None => return false,
                }
                true
            }
        }
    }

    /// The master's verdict on collective `op`, which failed here with `failed_here`, if it did.
    fn verdict(&mut self, op: OpId, verdict: Verdict, failed_here: Option<OpFailure>) {
        self.finish(match (verdict, failed_here) {
            // The master never commits a collective a participant failed; the local error stands.
            (Verdict::Committed, Some(failure)) => Err(CallError::Unconfirmed { op, failure }),
            (Verdict::Committed, None) => Ok(Value::Collective(op)),
            (Verdict::Aborted(failure), _) => Err(CallError::Aborted { op, failure }),
        });
    }

    /// Ends the call with a timeout once `deadline` passed; false (it waits) otherwise.
    fn timed_out(&mut self, deadline: Instant, now: Instant) -> bool {
        if now >= deadline {
            self.finish(Err(CallError::Timeout));
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests;
