//! The master's state machine: membership, topology phases and votes.
//!
//! A peer's life at the master (see `docs/protocol.md`):
//!
//! ```text
//!  Join ──▶ Registered ──(its group's update_topology vote passes, or the group has no accepted
//!  member)──▶ in a Topology being connected ──(every member TopologyReady)──▶ Accepted
//!  Registered ──(CatchUpStart)──▶ CatchingUp ──(CatchUpEnd)──▶ Registered   (`catchup.rs`;
//!  a `Join` that says it will catch up registers it CatchingUp at once)
//!  any state ──(connection closed, missed heartbeats, Leave, protocol violation)──▶ removed
//! ```
//!
//! Each peer group has one [`Phase`] at a time, its own ring and its own votes (`Group`): groups
//! never wait for each other. `peers_pending` votes are independent of the phase.

mod calls;
mod catchup;
mod durable;
mod gather;
mod ops;
mod p2p;
mod plan;
mod reach;
mod status;
mod sync;
mod timers;

use crate::auth::{DataKey, RunKey};
use crate::ballot::Ballot;
use crate::bounds::Observed;
pub use durable::{Durable, DurableGroup, DurablePeer, DurableRing, Incoherent};
pub use ops::MAX_TRACKED_OPS;
pub use plan::Plan;
pub use reach::{Reach, PROBE_TIMEOUT};
use shoal_wire::{Epoch, GroupId, LateReport, Member, Message, PeerId, PeerReport, Reason, SessionId, Vote};
pub use status::{Counters, GroupStatus, Matrix, PeerStatus, RunStatus, Totals};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
pub use sync::Strategy;
pub use timers::{Timer, TimerTable};

/// Peers a run holds at most, registered or accepted: a topology lists every member of its group,
/// which may be every peer, and a peer's decoder refuses a longer list. A `Join` beyond it is
/// refused with `Kicked`.
pub const MAX_PEERS: usize = shoal_wire::MAX_MEMBERS;

/// A control connection, as numbered by the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnId(pub u64);

/// Settings of the master state machine.
#[derive(Debug, Clone)]
pub struct MasterConfig {
    /// The run's session id, written in every frame.
    pub session: SessionId,
    /// How long a peer may stay silent before it is declared dead; with `adaptive`, until its
    /// heartbeats say otherwise. A quarter of it is how often heartbeats go out.
    pub heartbeat_timeout: Duration,
    /// Whether each peer's bound follows the gaps between its heartbeats
    /// ([`crate::bounds`]: from two heartbeat intervals to four times `heartbeat_timeout`), or
    /// stays `heartbeat_timeout` (`SHOAL_HEARTBEAT_TIMEOUT` pins it).
    pub adaptive: bool,
    /// The key of the run's secret: a `Join` must prove it (`crate::auth`). `None`: anyone who
    /// reaches the master may join.
    pub key: Option<RunKey>,
    /// The run's key for data connections, handed to every peer it registers: random, drawn by
    /// the driver for the run.
    pub data_key: DataKey,
    /// How much of the ring search's budgets (`plan::FIRST_ANSWER` and the others) to spend,
    /// as a fraction: 1.0 for a run; the simulator, which checks agreement rather than plans,
    /// spends a hundredth.
    pub search_effort: f64,
    /// Where the ring search reads the time. With one, each search also stops once its budget
    /// passed in this clock's time: a master that gets a sliver of a core shared with many busy
    /// peers would otherwise spend dozens of times its budget in kicks calibrated on an idle one,
    /// and hear nothing meanwhile. Without one (the simulator, which replays by seed) budgets are
    /// kicks alone.
    pub search_clock: Option<fn() -> Instant>,
    /// How long a newcomer's data port has to answer the master's probe ([`PROBE_TIMEOUT`]).
    pub probe_timeout: Duration,
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Output {
    /// Send `message` on `conn`.
    Send {
        /// The connection.
        conn: ConnId,
        /// The message.
        message: Message,
    },
    /// Close `conn`; `reason` is for the log.
    Close {
        /// The connection.
        conn: ConnId,
        /// Why.
        reason: String,
    },
    /// Open a connection to `peer`'s data address `addr`, within `timeout`, and close it; answer
    /// [`Master::handle_probe`] (`reach.rs`). A late answer is ignored.
    Probe {
        /// The newcomer.
        peer: PeerId,
        /// The address it advertises for data connections.
        addr: String,
        /// How long the master waits for the answer.
        timeout: Duration,
    },
    /// Something worth logging or counting happened.
    Event(MasterEvent),
}

/// Facts about the run, reported for logs, status and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MasterEvent {
    /// A peer registered.
    PeerRegistered {
        /// The new peer.
        peer: PeerId,
        /// Its group.
        group: GroupId,
        /// The address it advertises.
        addr: String,
    },
    /// A peer left the run.
    PeerRemoved {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
    /// A topology was issued for peers to connect.
    TopologyIssued {
        /// The group.
        group: GroupId,
        /// Its number.
        epoch: Epoch,
        /// Its members in ring order.
        members: Vec<PeerId>,
    },
    /// `optimize_topology` passed: the ring is ordered by what its members measured.
    RingPlanned {
        /// The group.
        group: GroupId,
        /// The measured members in the planned order.
        members: Vec<PeerId>,
        /// The planned ring's cost (`shoal_topology::Costs`), microseconds per round of steps.
        cost_us: u64,
        /// The cost of the order before.
        before_us: u64,
    },
    /// A topology came into force.
    TopologyCommitted {
        /// The group.
        group: GroupId,
        /// Its number.
        epoch: Epoch,
        /// Its members in ring order.
        members: Vec<PeerId>,
    },
    /// A peer became a straggler, or stopped being one (`LateReport::straggler`), by its report.
    Straggler {
        /// The peer.
        peer: PeerId,
        /// Its group.
        group: GroupId,
        /// Whether it is one now.
        now: bool,
        /// What it reported.
        late: LateReport,
    },
}

/// How a peer leaves the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Removal {
    /// It said `Leave`.
    Left,
    /// Its control connection closed.
    Lost,
    /// The master expels it: silent, unreachable, late or misbehaving.
    Expelled,
}

/// What a group is doing.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Phase {
    /// No major operation.
    #[default]
    Idle,
    /// Accepted peers are voting to update the topology.
    AwaitingTopologyVotes {
        /// The vote.
        ballot: Ballot,
    },
    /// A topology was issued; its members are opening their data connections.
    AwaitingConnections {
        /// The issued topology.
        epoch: Epoch,
        /// Its members in ring order.
        members: Vec<PeerId>,
        /// Members that reported `TopologyReady`.
        ready: BTreeSet<PeerId>,
        /// Once every member accepted before is ready: when newcomers not ready by then are
        /// dropped (a process that accepts connections but never reports must not stall the run).
        newcomers_by: Option<Instant>,
    },
}

/// Where a peer stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Joined; awaits admission.
    Registered,
    /// Joined; fetches its group's shared state before it awaits admission (`catchup.rs`).
    CatchingUp,
    /// Member of the committed topology.
    Accepted,
}

/// How a peer broke the protocol. It is expelled with this reason; the others go on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerMisbehaved {
    /// A frame stamped with another run's session.
    #[error("frame of session {got:?} in another run")]
    WrongSession {
        /// The session it named.
        got: SessionId,
    },
    /// A message a peer never sends the master, or not once registered.
    #[error("unexpected {message} from {peer}")]
    UnexpectedMessage {
        /// Who sent it.
        peer: PeerId,
        /// Its name.
        message: &'static str,
    },
    /// `optimize_topology`'s measurements named a member twice, or the voter itself.
    #[error("{voter} measured its link to {to} twice, or to itself")]
    MeasuredTwice {
        /// Who measured.
        voter: PeerId,
        /// The member named again.
        to: PeerId,
    },
    /// `TopologyReady` from a peer that is not a member of that topology.
    #[error("TopologyReady for {epoch:?} from a non-member")]
    ReadyFromNonMember {
        /// The topology it named.
        epoch: Epoch,
    },
    /// A report about a collective from a peer that is not accepted.
    #[error("collective report from {peer}, which is not accepted")]
    ReportFromNonMember {
        /// Who reported.
        peer: PeerId,
    },
    /// A report about a collective of a derived group whose members are not members of the
    /// reporter's ring (or do not include it, or name one twice), or differ from those another
    /// member reported.
    #[error("{peer} reported a collective of derived group {derived:#x} with members outside its ring or others'")]
    DerivedMembers {
        /// Who reported.
        peer: PeerId,
        /// The derived group.
        derived: u64,
    },
    /// `P2pApart` that names other calls than the waiter's transfer and the sender's own call.
    #[error("P2pApart for {waiter} names other peers' calls")]
    ApartNamesOthers {
        /// The waiter it named.
        waiter: PeerId,
    },
    /// A mismatch whose first call is not the reporter's call of that collective, or whose other
    /// is not a member's call of it.
    #[error("{peer} reported a mismatch of other calls than its own collective's and a member's")]
    MismatchNamesOthers {
        /// Who reported it.
        peer: PeerId,
    },
    /// A report about a collective with a deadline that the master left the reporter out of.
    #[error("{peer} reported collective {seq}, which runs without it")]
    NotIncluded {
        /// Who reported.
        peer: PeerId,
        /// The collective's number.
        seq: u64,
    },
    /// More collectives open than the master tracks.
    #[error("more than {MAX_TRACKED_OPS} collectives open at once")]
    TooManyOpenCollectives,
    /// A sync vote with a strategy code the master does not know.
    #[error("unknown sync strategy {code}")]
    UnknownStrategy {
        /// The code.
        code: u8,
    },
    /// A sync vote while no sync of its group is voting, or a second vote in one.
    #[error("sync vote outside of a sync's voting")]
    SyncVoteOutsideVoting,
}

#[derive(Debug, Clone)]
struct PeerEntry {
    /// Its control connection; `None` for a peer restored from the state directory that has not
    /// rejoined yet (`durable.rs`).
    conn: Option<ConnId>,
    group: GroupId,
    addr: String,
    status: Status,
    last_heard: Instant,
    /// Its last heartbeat, and the gaps between its heartbeats: how long it may be silent.
    last_beat: Option<Instant>,
    beats: Observed,
    /// Admitted by the accepted peers' vote and has made no call since (`calls.rs`).
    fresh: bool,
    /// Its last vote, and whether that ended as one of calls that can never complete together
    /// (`calls.rs`).
    last_vote: Option<calls::LastVote>,
    /// Whether its data address can be dialed (`reach.rs`).
    reach: Reach,
    /// Where its control connection came from, if known.
    seen: Option<IpAddr>,
}

/// One peer group's membership: its committed ring, the major operation it runs and its votes.
/// Groups are independent: each is admitted, voted, re-formed and planned on its own, and no
/// group's call waits for another's (`docs/protocol.md`, "Groups"). Only the run's peer ids,
/// epochs, connections and heartbeats are shared.
#[derive(Debug, Default)]
struct Group {
    /// Peers of the group in the run, registered or accepted: a group without any is dropped.
    peers: usize,
    /// Accepted peers in ring order: the committed topology.
    ring: Vec<PeerId>,
    /// The epoch of `ring`.
    ring_epoch: Epoch,
    /// The last epoch issued to the group: later than `ring_epoch` while one is being connected.
    issued: Epoch,
    phase: Phase,
    pending_vote: Option<Ballot>,
    /// Newcomers' first `peers_pending` votes, cast tentatively, and when each is answered `false`
    /// unless its ballot passed (`calls.rs`).
    tentative: BTreeMap<PeerId, Instant>,
    /// Newcomers the tentative rule answered `false`, until they report a collective or a vote
    /// of theirs passes (they met the others): their first conflicting vote is retried
    /// (`calls.rs`).
    sent_on: BTreeSet<PeerId>,
    /// The ring lost a member, or a collective of it was aborted (its streams are gone): the
    /// survivors' next calls need a new topology of the same ring. Issued as soon as no major
    /// operation is open ([`Master::reform_if_due`]), so an application simply retries.
    reform_due: bool,
    /// A member the committed ring lost since it came into force: calls of the ring that differ
    /// after it follow from the loss (`ops.rs`).
    lost: Option<PeerId>,
    /// What each voter of the open `update_topology` ballot measured, if it called
    /// `optimize_topology` (`plan.rs`).
    measured: BTreeMap<PeerId, Option<Vec<shoal_wire::Measured>>>,
    /// The ring's order from the last `optimize_topology`.
    plan: Option<Plan>,
    /// Collectives with a deadline some members called, not decided yet, by topology and
    /// number; and the members those decided run among (`gather.rs`).
    gathering: BTreeMap<(Epoch, u64), gather::Gathering>,
    gathered: BTreeMap<(Epoch, u64), gather::Decided>,
}

/// The master's protocol state machine.
///
/// Every input concerns one group at a time (a peer's message, its loss, a group's timer): the
/// machine *focuses* on that group first (`Master::focus`), so that `g` is its state and the
/// code of a transition reads one group's ring and votes as `self.g`, and can reach no other.
#[derive(Debug)]
pub struct Master {
    config: MasterConfig,
    peers: BTreeMap<PeerId, PeerEntry>,
    conns: BTreeMap<ConnId, PeerId>,
    next_peer: u32,
    /// The last epoch issued, to any group: epochs name topologies across the run.
    epoch: Epoch,
    /// The group in focus, and its state.
    focus: GroupId,
    g: Group,
    /// Every other group with a peer in the run.
    groups: BTreeMap<GroupId, Group>,
    /// Collectives reported by some member and not yet settled, of every group's committed ring.
    ops: BTreeMap<ops::OpKey, ops::OpRecord>,
    /// Shared-state syncs in progress, by group.
    syncs: BTreeMap<GroupId, sync::SyncRound>,
    /// Members whose call waits on a tagged transfer with another member, announced and not
    /// over: (waiter, the other end, or the members asked about a receive from any) (`p2p.rs`).
    p2p_waits: BTreeMap<PeerId, p2p::Wait>,
    /// Questions about transfers' outcomes waiting for their answers (`p2p.rs`).
    p2p_asked: BTreeSet<p2p::Asked>,
    next_sync: u64,
    /// Each group's last completed sync.
    group_states: BTreeMap<GroupId, sync::GroupState>,
    /// Registered peers fetching their group's state (`catchup.rs`).
    catching_up: BTreeMap<PeerId, catchup::Newcomer>,
    /// The copy of each group's state its members keep while newcomers catch up.
    snapshots: BTreeMap<GroupId, catchup::Snapshot>,
    /// The nonce each connection was challenged with, until its `Join`.
    challenges: BTreeMap<ConnId, [u8; 32]>,
    /// Where each connection not yet registered came from, as the driver saw it.
    origins: BTreeMap<ConnId, IpAddr>,
    /// What each peer last reported of its work (`Message::Report`).
    reports: BTreeMap<PeerId, PeerReport>,
    /// What peers that left had reported: the run's totals never go down.
    retired: Totals,
    counters: Counters,
    /// What a stranger's refused connections may log ([`crate::loglimit`]).
    refusals: crate::loglimit::LogLimit,
    /// Counts changes of what a restarted master needs (`durable.rs`).
    generation: u64,
    timers: TimerTable,
    outputs: VecDeque<Output>,
    /// The time of the latest input: the machine's clock, which only its inputs move.
    now: Instant,
}

impl Master {
    /// A master with no peers.
    pub fn new(config: MasterConfig, now: Instant) -> Self {
        assert!(!config.heartbeat_timeout.is_zero(), "heartbeat timeout of zero");
        let mut timers = TimerTable::default();
        timers.set(Timer::SendHeartbeats, now + heartbeat_interval(config.heartbeat_timeout));
        let master = Master {
            config,
            peers: BTreeMap::new(),
            conns: BTreeMap::new(),
            next_peer: 0,
            epoch: Epoch(0),
            focus: GroupId(0),
            g: Group::default(),
            groups: BTreeMap::new(),
            ops: BTreeMap::new(),
            syncs: BTreeMap::new(),
            p2p_waits: BTreeMap::new(),
            p2p_asked: BTreeSet::new(),
            next_sync: 0,
            group_states: BTreeMap::new(),
            catching_up: BTreeMap::new(),
            snapshots: BTreeMap::new(),
            challenges: BTreeMap::new(),
            origins: BTreeMap::new(),
            reports: BTreeMap::new(),
            retired: Totals::default(),
            counters: Counters::default(),
            refusals: crate::loglimit::LogLimit::default(),
            generation: 0,
            timers,
            outputs: VecDeque::new(),
            now,
        };
        debug_assert!(master.poll_timeout().is_some_and(|t| t > now), "a new master sends no heartbeat");
        master
    }

    /// Makes `group` the group in focus: its state is `self.g` until the next focus. The group
    /// left is kept while it has a peer, and forgotten with its last.
    fn focus(&mut self, group: GroupId) {
        if group == self.focus {
            return;
        }
        let next = self.groups.remove(&group).unwrap_or_default();
        let left = std::mem::replace(&mut self.g, next);
        let left_id = std::mem::replace(&mut self.focus, group);
        if left.peers > 0 {
            self.groups.insert(left_id, left);
        } else {
            debug_assert!(left.ring.is_empty() && left.phase == Phase::Idle, "{left_id:?} is left busy, and empty");
            debug_assert!(!self.peers.values().any(|e| e.group == left_id), "{left_id:?} is forgotten with a peer");
        }
        assert!(self.focus == group && !self.groups.contains_key(&group), "{group:?} is kept twice");
    }

    /// Focuses on `peer`'s group, if `peer` is in the run.
    fn focus_on(&mut self, peer: PeerId) {
        if let Some(group) = self.peers.get(&peer).map(|e| e.group) {
            self.focus(group);
        }
    }

    /// Every group with a peer in the run, by id.
    fn each_group(&self) -> impl Iterator<Item = (GroupId, &Group)> + '_ {
        let focused = (self.g.peers > 0).then_some((self.focus, &self.g));
        let mut all: Vec<(GroupId, &Group)> = self.groups.iter().map(|(id, g)| (*id, g)).chain(focused).collect();
        all.sort_unstable_by_key(|(id, _)| *id);
        all.into_iter()
    }

    // ----- getters -----

    /// The run's session id.
    pub fn session(&self) -> SessionId {
        self.config.session
    }

    /// `Join`s refused for a wrong or missing proof of the run's secret.
    pub fn auth_failures(&self) -> u64 {
        self.counters.auth_failures
    }

    /// Counts a connection whose TLS handshake failed: it never reached the state machine, but
    /// the run's counters tell of it.
    pub fn count_tls_failure(&mut self) {
        self.counters.tls_failures += 1;
    }

    /// What `group` is doing.
    pub fn phase(&self, group: GroupId) -> &Phase {
        self.group(group).map_or(&Phase::Idle, |g| &g.phase)
    }

    /// `group`'s committed ring: its accepted peers in ring order.
    pub fn ring(&self, group: GroupId) -> &[PeerId] {
        self.group(group).map_or(&[], |g| &g.ring)
    }

    /// Every group's committed ring, by group: the run's accepted peers.
    pub fn rings(&self) -> impl Iterator<Item = (GroupId, &[PeerId])> + '_ {
        self.each_group().map(|(id, g)| (id, g.ring.as_slice()))
    }

    fn group(&self, group: GroupId) -> Option<&Group> {
        if group == self.focus {
            Some(&self.g)
        } else {
            self.groups.get(&group)
        }
    }

    /// Every known peer and its status.
    pub fn peers(&self) -> impl Iterator<Item = (PeerId, Status)> + '_ {
        self.peers.iter().map(|(id, e)| (*id, e.status))
    }

    /// The last epoch issued.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    // ----- inputs -----

    /// Connection `conn` opened, from `from` if the driver knows: it is challenged with `nonce`,
    /// which must be random and never reused (the driver draws it), and must answer with `Join`.
    pub fn handle_connect(&mut self, now: Instant, conn: ConnId, nonce: [u8; 32], from: Option<IpAddr>) {
        self.advance(now);
        let reused = self.challenges.insert(conn, nonce).is_some() || self.conns.contains_key(&conn);
        assert!(!reused, "connection {} was opened twice", conn.0);
        if let Some(ip) = from {
            self.origins.insert(conn, ip);
        }
        self.send(conn, Message::Challenge { nonce });
    }

    /// A message arrived on `conn` in a frame stamped with `session`.
    pub fn handle_message(&mut self, now: Instant, conn: ConnId, session: SessionId, message: Message) {
        self.advance(now);
        let Some(&peer) = self.conns.get(&conn) else {
            return self.handle_first_message(now, conn, message);
        };
        debug_assert!(self.peers.get(&peer).is_some_and(|e| e.conn == Some(conn)), "{conn:?} names a peer gone");
        self.focus_on(peer);
        if session != self.config.session {
            return self.violation(peer, PeerMisbehaved::WrongSession { got: session });
        }
        // Every message counts as a sign of life; heartbeats, which come at a steady pace
        // whatever else the peer sends, say how long it may be silent.
        if let Some(e) = self.peers.get_mut(&peer) {
            e.last_heard = now;
            if matches!(message, Message::Heartbeat | Message::Report { .. }) {
                if let Some(last) = e.last_beat.replace(now) {
                    e.beats.observe(now.saturating_duration_since(last));
                }
            }
        }
        let accepted = self.accepted(peer);
        match message {
            Message::Heartbeat => {}
            Message::Report { report } => {
                self.watch_drift(now, peer, &report);
                let was = self.reports.get(&peer).is_some_and(|r| r.late.straggler());
                if report.late.straggler() != was {
                    let (group, late) = (self.focus, report.late);
                    let now = !was;
                    self.outputs.push_back(Output::Event(MasterEvent::Straggler { peer, group, now, late }));
                }
                self.reports.insert(peer, report);
            }
            Message::VoteUpdateTopology { collectives, measured } if accepted => {
                self.vote_update_topology(now, peer, collectives, measured)
            }
            Message::VotePeersPending { collectives } if accepted => self.vote_peers_pending(now, peer, collectives),
            Message::TopologyReady { epoch } => self.topology_ready(now, peer, epoch),
            Message::PeerUnreachable { epoch, peer: target } => self.peer_unreachable(peer, epoch, target),
            Message::OpDone { epoch, derived, seq, members, decided } => {
                self.made_a_call(peer);
                self.op_done(peer, ops::OpName { epoch, derived, seq }, members, decided)
            }
            Message::OpFailed { epoch, derived, seq, members, failure } => {
                self.made_a_call(peer);
                self.op_failed(peer, ops::OpName { epoch, derived, seq }, members, failure)
            }
            Message::SyncVote { revision, strategy, override_resume, entries, collectives } if accepted => {
                self.sync_vote(now, peer, revision, strategy, override_resume, entries, collectives)
            }
            Message::Gather { epoch, seq, deadline_ms, min, needs } if accepted => {
                self.made_a_call(peer);
                self.gather(now, peer, epoch, seq, deadline_ms, min, needs)
            }
            Message::SyncDone { round } if accepted => self.sync_done(peer, round),
            Message::SyncFailed { round, reason } if accepted => self.sync_failed(peer, round, reason),
            Message::SnapshotHeld { round, held } if accepted => self.snapshot_held(peer, round, held),
            Message::P2pWaits { peer: other, .. } if accepted => self.p2p_waits(peer, other, message),
            Message::P2pResumed { .. } if accepted => self.p2p_resumed(peer),
            Message::P2pApart { peer: waiter, misuse } if accepted => self.p2p_apart(peer, waiter, misuse),
            Message::P2pOutcome { .. } if accepted => self.p2p_outcome(peer, message),
            Message::P2pDecided { .. } if accepted => self.p2p_decided(peer, message),
            Message::CatchUpStart { entries } => self.catch_up_start(peer, entries),
            Message::CatchUpProgress { done, total, eta_ms } => self.catch_up_progress(peer, done, total, eta_ms),
            Message::CatchUpEnd { fetched, revision } => self.catch_up_end(peer, fetched, revision),
            Message::Leave => {
                self.remove_peer(peer, "left the run".into(), Removal::Left);
            }
            other => self.violation(peer, PeerMisbehaved::UnexpectedMessage { peer, message: other.name() }),
        }
        self.reform_if_due();
        assert!(self.conns.get(&conn).is_none_or(|p| self.peers.contains_key(p)), "{conn:?} names a peer gone");
        self.check();
    }

    /// `conn` closed (or its reader failed with `reason`).
    pub fn handle_disconnect(&mut self, now: Instant, conn: ConnId, reason: &str) {
        self.advance(now);
        debug_assert!(
            !self.conns.contains_key(&conn) || !self.challenges.contains_key(&conn),
            "a peer's conn challenged"
        );
        self.challenges.remove(&conn);
        self.origins.remove(&conn);
        if let Some(peer) = self.conns.get(&conn).copied() {
            self.remove_peer(peer, format!("control connection lost: {reason}"), Removal::Lost);
        }
        self.reform_if_due();
        assert!(!self.conns.contains_key(&conn) && !self.challenges.contains_key(&conn), "{conn:?} outlives its close");
        self.check();
    }

    /// What holds whenever an input was handled: the committed topology is never ahead of the
    /// issued one; a tentative vote is cast; waits name peers of the run. Each check costs what
    /// the few entries it reads cost: this runs after every input, in every build. (The ring's
    /// own invariants are checked where it changes, as a topology commits.)
    fn check(&self) {
        debug_assert!(
            self.g.ring_epoch <= self.epoch,
            "{:?} committed ahead of {:?} issued",
            self.g.ring_epoch,
            self.epoch
        );
        debug_assert!(
            self.g.tentative.keys().all(|p| self.g.pending_vote.as_ref().is_some_and(|b| b.voters().contains(p))),
            "a tentative vote not cast"
        );
        debug_assert!(
            self.p2p_waits
                .iter()
                .all(|(w, o)| self.peers.contains_key(w) && o.asked().all(|o| self.peers.contains_key(&o))),
            "a wait on a peer gone"
        );
    }

    /// Moves the machine's clock to `now`, the time of an input. A driver reads a monotonic clock,
    /// so time never goes back; one that did is a bug of the driver's, and the clock stays put.
    fn advance(&mut self, now: Instant) {
        debug_assert!(now >= self.now, "time went back by {:?}", self.now - now);
        self.now = self.now.max(now);
    }

    /// Time passed; fire whatever timers are due.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.advance(now);
        while let Some(timer) = self.timers.pop_due(now) {
            match timer {
                Timer::SendHeartbeats => {
                    let conns: Vec<ConnId> = self.peers.values().filter_map(|e| e.conn).collect();
                    for conn in conns {
                        self.send(conn, Message::Heartbeat);
                    }
                    let interval = heartbeat_interval(self.config.heartbeat_timeout);
                    self.timers.set(Timer::SendHeartbeats, now + interval);
                }
                // Only a wake-up: the scan for silent peers below runs on every timeout.
                Timer::CheckHeartbeats => {}
                Timer::NewcomersReady(group) => {
                    self.focus(group);
                    self.drop_late_newcomers(now)
                }
                Timer::TentativeVotes(group) => {
                    self.focus(group);
                    self.answer_tentative_votes(now)
                }
                Timer::ImprovePlan(group) => {
                    self.focus(group);
                    self.improve_plan(now)
                }
                Timer::Gather(group) => {
                    self.focus(group);
                    self.decide_gathers(now)
                }
                Timer::Probes => self.end_late_probes(now),
            }
        }
        let silent: Vec<(PeerId, Duration)> = self
            .peers
            .iter()
            .filter_map(|(id, e)| {
                let bound = self.silence_bound(e);
                (now.saturating_duration_since(e.last_heard) > bound).then_some((*id, bound))
            })
            .collect();
        for (peer, bound) in silent {
            self.remove_peer(peer, format!("no message for {:.1} s", bound.as_secs_f64()), Removal::Expelled);
        }
        self.arm_heartbeat_check();
        self.reform_if_due();
        debug_assert!(self
            .peers
            .values()
            .all(|e| now.saturating_duration_since(e.last_heard) <= self.silence_bound(e)));
        assert!(self.timers.next_deadline().is_none_or(|t| t > now), "a timer due now is left unfired");
        self.check();
    }

    // ----- outputs -----

    /// The next thing the driver must do.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// When [`Master::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.next_deadline()
    }

    // ----- transitions -----

    fn handle_first_message(&mut self, now: Instant, conn: ConnId, message: Message) {
        let seen = self.origins.remove(&conn);
        if let Message::Rejoin { peer, session, proof } = message {
            return self.rejoin(now, conn, peer, session, proof);
        }
        let Message::Join { group, data_addr, proof, catch_up } = message else {
            let reason = format!("expected Join as first message, got {}", message.name());
            if let Some(note) = self.refusals.admit(now) {
                log::warn!("connection {}: {reason}{note}", conn.0);
            }
            return self.outputs.push_back(Output::Close { conn, reason });
        };
        if !self.proven(now, conn, "Join", &data_addr, &proof) {
            return;
        }
        if self.peers.len() >= MAX_PEERS {
            // A topology lists every member of a group: one more could not be sent to anyone.
            self.counters.refused_full += 1;
            let reason = format!("the run is full: {MAX_PEERS} peers, the most a topology can list");
            if let Some(note) = self.refusals.admit(now) {
                log::warn!("connection {}: refused: {reason}{note}", conn.0);
            }
            self.send(conn, Message::Kicked { reason: reason.clone() });
            return self.outputs.push_back(Output::Close { conn, reason });
        }
        let peer = PeerId(self.next_peer);
        assert!(peer != PeerId::ANY, "peer ids exhausted");
        assert!(!self.peers.contains_key(&peer), "{peer} is issued twice");
        debug_assert!(self.peers.last_key_value().is_none_or(|(p, _)| *p < peer), "peer ids go back");
        self.next_peer = self.next_peer.checked_add(1).expect("peer ids exhausted");
        let entry = PeerEntry {
            conn: Some(conn),
            group,
            addr: data_addr.clone(),
            // One that will catch up is not pending meanwhile: its `CatchUpStart` is a round
            // trip behind, and a vote in between would admit it before it fetched anything.
            status: if catch_up { Status::CatchingUp } else { Status::Registered },
            last_heard: now,
            last_beat: None,
            beats: self.beats(),
            fresh: false,
            last_vote: None,
            reach: Reach::Probing(now + self.config.probe_timeout),
            seen,
        };
        self.peers.insert(peer, entry);
        self.conns.insert(conn, peer);
        self.focus(group);
        self.g.peers += 1;
        self.counters.joins += 1;
        self.touch();
        self.outputs.push_back(Output::Probe { peer, addr: data_addr.clone(), timeout: self.config.probe_timeout });
        self.outputs.push_back(Output::Event(MasterEvent::PeerRegistered { peer, group, addr: data_addr }));
        self.send(conn, self.registered_message(peer));
        self.arm_heartbeat_check();
        self.arm_probes();
        assert_eq!(self.conns.get(&conn), Some(&peer), "a registered peer is reached on its connection");
    }

    /// Whether connection `conn`, whose first message (`first`, from `who`) carries `proof`, was
    /// challenged and proves the run's secret. If not, it is answered, closed, logged and
    /// counted.
    fn proven(&mut self, now: Instant, conn: ConnId, first: &str, who: &str, proof: &[u8; 32]) -> bool {
        debug_assert!(!self.conns.contains_key(&conn), "a peer's connection proves itself again");
        let Some(nonce) = self.challenges.remove(&conn) else {
            let reason = format!("{first} on a connection that was not challenged");
            if let Some(note) = self.refusals.admit(now) {
                log::warn!("connection {}: {reason}{note}", conn.0);
            }
            self.outputs.push_back(Output::Close { conn, reason });
            return false;
        };
        if self.config.key.as_ref().is_some_and(|key| !key.verify(&nonce, proof)) {
            self.counters.auth_failures += 1;
            let reason = "authentication failed: the proof of the run's secret is wrong or missing".to_string();
            if let Some(note) = self.refusals.admit(now) {
                log::warn!("connection {} ({who}): {reason} ({} so far){note}", conn.0, self.counters.auth_failures);
            }
            self.send(conn, Message::AuthFailed { reason: reason.clone() });
            self.outputs.push_back(Output::Close { conn, reason });
            return false;
        }
        assert!(!self.challenges.contains_key(&conn), "a challenge answers twice");
        true
    }

    /// What tells `peer` it is registered (or taken back): its id, the run, how often to send
    /// heartbeats, the run's data key.
    fn registered_message(&self, peer: PeerId) -> Message {
        let heartbeat_ms =
            heartbeat_interval(self.config.heartbeat_timeout).as_millis().clamp(1, u32::MAX.into()) as u32;
        Message::Registered { peer, session: self.config.session, heartbeat_ms, data_key: self.config.data_key.0 }
    }

    /// The first peers of a group (or the first after every accepted member left) have nobody to
    /// vote them in: they are admitted at once.
    fn admit_without_vote_if_alone(&mut self) {
        if self.g.phase == Phase::Idle && self.g.ring.is_empty() {
            self.catch_ups_without_members();
            let newcomers = self.registered();
            if !newcomers.is_empty() {
                self.issue_topology(newcomers);
                debug_assert!(
                    matches!(self.g.phase, Phase::AwaitingConnections { .. }),
                    "the first peers connect theirs"
                );
            }
        }
        debug_assert!(
            !(self.g.phase == Phase::Idle && self.g.ring.is_empty()) || self.registered().is_empty(),
            "the first peers wait for a vote nobody can cast"
        );
    }

    /// Issues a topology of the surviving ring when one is due and no major operation is open:
    /// the survivors' next calls run in it, whatever they are (`docs/protocol.md`, "Retry").
    /// Newcomers wait for the admission vote.
    pub(super) fn reform_if_due(&mut self) {
        let (g, syncing) = (&self.g, self.syncs.contains_key(&self.focus));
        if g.reform_due && g.phase == Phase::Idle && !syncing && !g.ring.is_empty() && self.group_back() {
            log::info!("re-forming the ring of {} peers after a failure", self.g.ring.len());
            self.issue_topology(self.g.ring.clone());
            debug_assert!(!self.g.reform_due && matches!(self.g.phase, Phase::AwaitingConnections { .. }));
        }
    }

    fn vote_update_topology(
        &mut self,
        now: Instant,
        peer: PeerId,
        collectives: u64,
        measured: Option<Vec<shoal_wire::Measured>>,
    ) {
        if let Phase::AwaitingConnections { epoch, .. } = self.g.phase {
            // A retry that crossed a topology issued meanwhile (a member was lost): not counted;
            // the voter joins that topology and votes again.
            let reason =
                format!("{peer} called update_topology while topology {} was being connected; call it again", epoch.0);
            return self.send_to_peer(peer, Message::TopologyVoteAborted { retry: true, reason: Reason::text(reason) });
        }
        if !self.admit_vote(now, peer, Vote::UpdateTopology, collectives) {
            return;
        }
        if let Err(reason) = self.record_measured(peer, measured) {
            return self.violation(peer, reason);
        }
        let group = self.peers[&peer].group;
        let fewer = match &mut self.g.phase {
            Phase::Idle => {
                let mut ballot = Ballot::new(self.g.ring.iter().copied().collect());
                let fewer = ballot.announce(group, collectives);
                ballot.cast(peer);
                self.set_phase(Phase::AwaitingTopologyVotes { ballot });
                fewer
            }
            Phase::AwaitingTopologyVotes { ballot } => {
                ballot.cast(peer);
                ballot.announce(group, collectives)
            }
            Phase::AwaitingConnections { .. } => unreachable!("refused above"),
        };
        debug_assert!(
            matches!(&self.g.phase, Phase::AwaitingTopologyVotes { ballot } if ballot.voters().contains(&peer)),
            "{peer}'s vote is cast"
        );
        if fewer {
            self.announce_vote(peer, Vote::UpdateTopology, collectives);
        }
        self.tally_topology_votes();
        debug_assert!(
            !matches!(&self.g.phase, Phase::AwaitingTopologyVotes { ballot } if ballot.tally().is_some()),
            "a complete topology ballot is tallied at once"
        );
    }

    /// Newcomers that did not report ready a heartbeat timeout after every accepted member did are
    /// expelled; the topology is issued again without them.
    fn drop_late_newcomers(&mut self, now: Instant) {
        let Phase::AwaitingConnections { epoch, members, ready, newcomers_by: Some(by) } = &self.g.phase else {
            return;
        };
        if now < *by {
            return self.timers.set(Timer::NewcomersReady(self.focus), *by);
        }
        let (epoch, bound) = (*epoch, self.config.heartbeat_timeout.as_secs_f64());
        let late: Vec<PeerId> = members.iter().copied().filter(|p| !ready.contains(p)).collect();
        for p in late {
            debug_assert!(self.peers.get(&p).is_none_or(|e| e.status != Status::Accepted), "{p} is an accepted member");
            let reason = format!("not ready in topology {} {bound:.1} s after the accepted peers", epoch.0);
            self.remove_peer(p, reason, Removal::Expelled);
        }
        // Each removal re-issued the topology without the late member (or ended it: none left).
        debug_assert!(
            !matches!(&self.g.phase, Phase::AwaitingConnections { epoch: e, .. } if *e == epoch),
            "{epoch:?} still waits for newcomers that were late"
        );
    }

    /// `peer` reported on a collective: it is no newcomer at the top of its loop any more.
    fn made_a_call(&mut self, peer: PeerId) {
        if let Some(e) = self.peers.get_mut(&peer) {
            e.fresh = false;
        }
        self.g.sent_on.remove(&peer);
        debug_assert!(self.peers.get(&peer).is_none_or(|e| !e.fresh), "{peer} called, yet is fresh");
    }

    fn tally_topology_votes(&mut self) {
        let Phase::AwaitingTopologyVotes { ballot } = &self.g.phase else {
            return;
        };
        if ballot.is_empty() {
            self.set_phase(Phase::Idle);
            return self.admit_without_vote_if_alone();
        }
        let Some(quorum) = ballot.tally() else { return };
        self.counters.topology_votes += 1;
        self.g.sent_on.retain(|p| !quorum.voters().contains(p));
        let mut members: Vec<PeerId> = self.g.ring.iter().copied().filter(|p| quorum.voters().contains(p)).collect();
        assert_eq!(members.len(), quorum.voters().len(), "a topology quorum is the ring's members");
        if self.every_voter_measured(&members) {
            // optimize_topology: the ring re-ordered; newcomers wait for update_topology.
            self.make_plan(&members);
        } else {
            members.extend(self.registered());
        }
        self.issue_topology(members);
        debug_assert!(matches!(self.g.phase, Phase::AwaitingConnections { .. }), "a passed vote issues a topology");
    }

    fn issue_topology(&mut self, members: Vec<PeerId>) {
        assert!(!members.is_empty(), "issuing an empty topology");
        let members = self.planned(members);
        self.arm_plan_slice(self.now);
        debug_assert!(members.iter().all(|p| self.peers.contains_key(p)), "unknown member");
        self.epoch = Epoch(self.epoch.0 + 1);
        self.g.issued = self.epoch;
        assert!(self.epoch > self.g.ring_epoch, "a topology issued behind the committed one");
        self.counters.topologies += 1;
        self.touch();
        let epoch = self.epoch;
        // The ring's collectives stay open until this topology commits: members still running
        // one (the ring re-forms without waiting for anyone's call) may yet report on it.
        self.g.reform_due = false;
        self.abort_sync(self.focus, true, Reason::text("the topology changed during the sync"));
        // Its members join it at their next call: a peers_pending vote cast before cannot pass.
        if let Some(ballot) = self.g.pending_vote.take() {
            // A newcomer's first peers_pending, cast tentatively, did not count: the vote it
            // casts again once in this topology is still its first (`calls.rs`).
            for p in std::mem::take(&mut self.g.tentative).into_keys() {
                if let Some(e) = self.peers.get_mut(&p) {
                    e.fresh = true;
                }
            }
            let reason = format!("topology {} was issued during the vote", epoch.0);
            for p in ballot.voters().clone() {
                self.send_to_peer(p, Message::PeersPendingAborted { retry: true, reason: Reason::text(&reason) });
            }
        }
        let sites = self.g.plan.as_ref().map(Plan::sites).unwrap_or_default();
        let limits = self.limits(&members);
        // A member nobody measured (a newcomer) sits in a site of its own, so that the others
        // keep theirs until the next `optimize_topology` measures it.
        let mut spare = sites.values().max().map_or(0, |s| s + 1);
        let wire_members: Arc<[Member]> = members
            .iter()
            .map(|p| {
                let e = &self.peers[p];
                debug_assert_eq!(e.group, self.focus, "{p} is issued another group's topology");
                let site = sites.get(p).copied().or_else(|| {
                    (!sites.is_empty()).then(|| {
                        spare += 1;
                        spare - 1
                    })
                });
                Member {
                    peer: *p,
                    group: e.group,
                    addr: e.addr.clone(),
                    site,
                    dialable: e.reach.dialable(),
                    seen: e.seen,
                }
            })
            .collect();
        // The run's size: the other groups' rings, and this topology.
        let others: usize = self.groups.values().map(|g| g.ring.len()).sum();
        let world = u32::try_from(others + members.len()).expect("a run holds at most MAX_PEERS");
        for p in &members {
            self.send_to_peer(*p, Message::Topology { epoch, members: wire_members.clone(), world, limits });
        }
        self.outputs.push_back(Output::Event(MasterEvent::TopologyIssued {
            group: self.focus,
            epoch,
            members: members.clone(),
        }));
        self.set_phase(Phase::AwaitingConnections { epoch, members, ready: BTreeSet::new(), newcomers_by: None });
        // After the topology, as what ends a call goes: its callers retry in it.
        self.supersede_gathers(epoch);
        assert!(
            !self.syncs.contains_key(&self.focus) && self.g.pending_vote.is_none(),
            "a new topology ends the votes of the old one"
        );
    }

    fn topology_ready(&mut self, now: Instant, peer: PeerId, epoch: Epoch) {
        let Phase::AwaitingConnections { epoch: current, members, ready, newcomers_by } = &mut self.g.phase else {
            return; // A late report for a topology that was replaced.
        };
        if epoch != *current {
            return;
        }
        if !members.contains(&peer) {
            return self.violation(peer, PeerMisbehaved::ReadyFromNonMember { epoch });
        }
        ready.insert(peer);
        if ready.len() < members.len() {
            let peers = &self.peers;
            let accepted_ready = members
                .iter()
                .filter(|p| peers.get(p).is_some_and(|e| e.status == Status::Accepted))
                .all(|p| ready.contains(p));
            if accepted_ready && newcomers_by.is_none() {
                let at = now + self.config.heartbeat_timeout;
                *newcomers_by = Some(at);
                self.timers.set(Timer::NewcomersReady(self.focus), at);
            }
            return;
        }
        self.timers.clear(Timer::NewcomersReady(self.focus));
        let members = members.clone();
        // Newcomers admitted by the accepted peers' vote (not the first peers of a run).
        let by_vote = !self.g.ring.is_empty();
        for p in &members {
            let e = self.peers.get_mut(p).expect("members are known peers");
            if e.status == Status::Registered {
                e.fresh = by_vote;
            }
            e.status = Status::Accepted;
            self.send_to_peer(*p, Message::TopologyCommitted { epoch });
        }
        self.g.ring = members.clone();
        self.touch();
        // Reports about the old ring that arrived while this one connected are settled now.
        self.close_ops(epoch);
        self.close_gathers(epoch);
        assert!(epoch > self.g.ring_epoch && epoch <= self.epoch, "commit of {epoch:?} after {:?}", self.g.ring_epoch);
        self.g.ring_epoch = epoch;
        self.g.lost = None;
        assert!(self.g.ring.iter().all(|p| self.peers[p].status == Status::Accepted), "the ring is accepted members");
        debug_assert_eq!(self.g.ring.iter().collect::<BTreeSet<_>>().len(), self.g.ring.len(), "a ring member twice");
        self.outputs.push_back(Output::Event(MasterEvent::TopologyCommitted { group: self.focus, epoch, members }));
        self.set_phase(Phase::Idle);
    }

    fn peer_unreachable(&mut self, reporter: PeerId, epoch: Epoch, target: PeerId) {
        let Phase::AwaitingConnections { epoch: current, members, .. } = &self.g.phase else {
            return;
        };
        if epoch != *current || !members.contains(&target) {
            return;
        }
        debug_assert!(self.peers.contains_key(&reporter), "a report from {reporter}, which is gone");
        // A newcomer that an accepted peer cannot reach is rejected; between two accepted
        // peers we cannot tell who is at fault, and drop the one that was reported.
        log::warn!("{reporter} cannot reach {target}; removing {target} from the run");
        self.remove_peer(target, format!("{reporter} could not connect to it"), Removal::Expelled);
        assert!(!self.peers.contains_key(&target) && !self.g.ring.contains(&target), "{target} stays after removal");
    }

    fn vote_peers_pending(&mut self, now: Instant, peer: PeerId, collectives: u64) {
        debug_assert!(self.accepted(peer), "{peer} votes unaccepted");
        if let Phase::AwaitingConnections { epoch, .. } = self.g.phase {
            // Sent before the voter saw the topology: the members that did wait for the voter to
            // join it, and the vote for them. Not counted: the voter joins and votes again.
            let reason = format!("{peer} called peers_pending while topology {} was being connected", epoch.0);
            return self.send_to_peer(peer, Message::PeersPendingAborted { retry: true, reason: Reason::text(reason) });
        }
        if !self.admit_vote(now, peer, Vote::PeersPending, collectives) {
            return;
        }
        // A tentative vote is not announced (`calls.rs`); an ordinary one makes the ballot's
        // tentative votes ordinary too: the others are asking as well.
        let (group, tentative) = (self.peers[&peer].group, self.g.tentative.contains_key(&peer));
        if !tentative {
            self.g.tentative.clear();
            self.timers.clear(Timer::TentativeVotes(self.focus));
        }
        let ring = &self.g.ring;
        let ballot = self.g.pending_vote.get_or_insert_with(|| Ballot::new(ring.iter().copied().collect()));
        let fewer = !tentative && ballot.announce(group, collectives);
        assert!(self.g.ring.contains(&peer), "{peer} votes peers_pending outside the ring");
        ballot.cast(peer);
        if fewer {
            self.announce_vote(peer, Vote::PeersPending, collectives);
        }
        self.tally_pending_votes();
        debug_assert!(self.g.pending_vote.as_ref().is_none_or(|b| b.voters().contains(&peer)), "{peer}'s vote is lost");
    }

    /// What `peers_pending` answers now: peers wait to join, or the ring was re-planned for
    /// drifted links (`plan.rs`); either waits for `update_topology`.
    pub(super) fn admission_due(&self) -> bool {
        !self.registered().is_empty() || self.g.plan.as_ref().is_some_and(Plan::replanned)
    }

    fn tally_pending_votes(&mut self) {
        let Some(quorum) = self.g.pending_vote.as_ref().and_then(Ballot::tally) else {
            if self.g.pending_vote.as_ref().is_some_and(Ballot::is_empty) {
                self.g.pending_vote = None;
            }
            return;
        };
        self.g.pending_vote = None;
        self.counters.pending_votes += 1;
        self.g.tentative.clear();
        let pending = self.admission_due();
        self.g.sent_on.retain(|p| !quorum.voters().contains(p));
        debug_assert!(quorum.voters().iter().all(|p| self.peers.contains_key(p)), "a quorum of known peers");
        for p in quorum.voters() {
            self.send_to_peer(*p, Message::PeersPendingResult { pending });
        }
        debug_assert!(self.g.pending_vote.is_none() && self.g.tentative.is_empty(), "a passed vote is still open");
    }

    /// Removes `peer` from the run, focusing on its group. An expelled peer is told why first (it
    /// may be alive: frozen, misbehaving, unreachable); one that left or hung up by itself is not.
    fn remove_peer(&mut self, peer: PeerId, reason: String, how: Removal) {
        let Some(entry) = self.peers.remove(&peer) else {
            return;
        };
        self.focus(entry.group);
        assert!(self.g.peers > 0, "{peer} leaves a group that counts none");
        self.g.peers -= 1;
        if let Some(conn) = entry.conn {
            self.conns.remove(&conn);
        }
        self.touch();
        if let Some(report) = self.reports.remove(&peer) {
            self.retired.add(&report);
        }
        match how {
            Removal::Left => self.counters.left += 1,
            Removal::Lost => self.counters.lost += 1,
            Removal::Expelled => self.counters.expelled += 1,
        }
        if let Some(conn) = entry.conn {
            if how == Removal::Expelled {
                // A frozen peer finds this when it wakes up.
                self.send(conn, Message::Kicked { reason: reason.clone() });
            }
            self.outputs.push_back(Output::Close { conn, reason: reason.clone() });
        }
        self.outputs.push_back(Output::Event(MasterEvent::PeerRemoved { peer, reason: reason.clone() }));
        // Its group must hear of it: an expelled peer may still hold its data streams open
        // (frozen, cut off), and participants of a collective that wait on tokens routed
        // through a dead peer ask the master once they know it is gone. Nobody can still need
        // a peer that left on purpose: it left after its collectives were committed. Other
        // groups never connect to it.
        let group = entry.group;
        let conns: Vec<ConnId> = self.peers.values().filter(|e| e.group == group).filter_map(|e| e.conn).collect();
        for conn in conns {
            self.send(conn, Message::PeerRemoved { peer });
        }
        if self.g.ring.contains(&peer) {
            self.g.ring.retain(|p| *p != peer);
            self.g.lost.get_or_insert(peer);
            // A topology being connected is re-issued without the peer below instead.
            self.g.reform_due |= !matches!(self.g.phase, Phase::AwaitingConnections { .. });
        }
        // What ends a call because of this loss (an abort, a sync aborted, a vote answered without
        // the peer) goes out after the topology the loss brings, so that whoever calls again at
        // once finds it (`docs/protocol.md`, "Retry"): held back until the re-form below.
        let held = self.outputs.len();
        self.settle_ops_of(peer);
        let now = self.now;
        self.decide_gathers(now);
        self.abandon_gathered();
        self.sync_member_removed(peer);
        self.catch_up_member_removed(peer);
        self.p2p_member_removed(peer);
        self.g.tentative.remove(&peer);
        self.g.sent_on.remove(&peer);
        if let Some(b) = &mut self.g.pending_vote {
            b.remove(peer);
            self.tally_pending_votes();
        }
        match &mut self.g.phase {
            Phase::Idle => self.admit_without_vote_if_alone(),
            Phase::AwaitingTopologyVotes { ballot } => {
                ballot.remove(peer);
                self.tally_topology_votes();
            }
            Phase::AwaitingConnections { members, .. } => {
                if members.contains(&peer) {
                    // The issued topology can never be complete: issue it again without the
                    // lost member. Everyone re-establishes against the new epoch.
                    let remaining: Vec<PeerId> = members.iter().copied().filter(|p| *p != peer).collect();
                    if remaining.is_empty() {
                        self.set_phase(Phase::Idle);
                        self.admit_without_vote_if_alone();
                    } else {
                        self.issue_topology(remaining);
                    }
                }
            }
        }
        let ended: Vec<Output> = self.outputs.drain(held..).collect();
        self.reform_if_due();
        self.outputs.extend(ended);
        self.arm_heartbeat_check();
        assert!(!self.g.ring.contains(&peer) && !self.g.tentative.contains_key(&peer), "a removed peer still counts");
        assert!(
            !matches!(&self.g.phase, Phase::AwaitingConnections { members, .. } if members.contains(&peer)),
            "a topology issued with a removed peer"
        );
    }

    fn violation(&mut self, peer: PeerId, reason: PeerMisbehaved) {
        log::warn!("protocol violation by {peer}: {reason}");
        self.remove_peer(peer, format!("protocol violation: {reason}"), Removal::Expelled);
    }

    fn set_phase(&mut self, next: Phase) {
        let legal = matches!(
            (&self.g.phase, &next),
            (Phase::Idle, Phase::AwaitingTopologyVotes { .. })
                | (Phase::Idle, Phase::AwaitingConnections { .. })
                | (Phase::AwaitingTopologyVotes { .. }, Phase::AwaitingConnections { .. })
                | (Phase::AwaitingTopologyVotes { .. }, Phase::Idle)
                | (Phase::AwaitingConnections { .. }, Phase::AwaitingConnections { .. })
                | (Phase::AwaitingConnections { .. }, Phase::Idle)
        );
        assert!(legal, "illegal phase transition {:?} -> {:?}", self.g.phase, next);
        log::debug!("phase {} -> {}", phase_name(&self.g.phase), phase_name(&next));
        if !matches!(next, Phase::AwaitingTopologyVotes { .. }) {
            self.g.measured.clear();
        }
        self.g.phase = next;
        debug_assert!(
            !matches!(&self.g.phase, Phase::AwaitingConnections { epoch, .. } if *epoch != self.epoch),
            "the topology being connected is the last one issued"
        );
    }

    /// Whether `peer` is in the run and accepted (a member of its group's ring).
    pub(super) fn accepted(&self, peer: PeerId) -> bool {
        self.peers.get(&peer).is_some_and(|e| e.status == Status::Accepted)
    }

    /// The focused group's peers that await admission.
    fn registered(&self) -> Vec<PeerId> {
        let group = self.focus;
        // One whose probe is under way waits for it: a topology must say how to reach it.
        let waits = |e: &PeerEntry| e.group == group && e.status == Status::Registered && e.reach.known().is_some();
        self.peers.iter().filter(|(_, e)| waits(e)).map(|(id, _)| *id).collect()
    }

    /// Whether every peer of the focused group is attached: a restored master waits for them
    /// to rejoin before it issues their group a topology (`durable.rs`).
    fn group_back(&self) -> bool {
        let group = self.focus;
        self.peers.values().all(|e| e.group != group || e.conn.is_some())
    }

    fn send(&mut self, conn: ConnId, message: Message) {
        self.outputs.push_back(Output::Send { conn, message });
    }

    /// How long peer `e` may stay silent.
    fn silence_bound(&self, e: &PeerEntry) -> Duration {
        if self.config.adaptive {
            e.beats.bound()
        } else {
            self.config.heartbeat_timeout
        }
    }

    /// A peer's heartbeat gaps, before it sent any: the bound starts at the configured one.
    fn beats(&self) -> Observed {
        let t = self.config.heartbeat_timeout;
        Observed::new(2 * heartbeat_interval(t), 4 * t, t)
    }

    fn arm_heartbeat_check(&mut self) {
        match self.peers.values().map(|e| e.last_heard + self.silence_bound(e)).min() {
            // A millisecond past the deadline, so the check sees the peer as overdue.
            Some(first) => self.timers.set(Timer::CheckHeartbeats, first + Duration::from_millis(1)),
            None => self.timers.clear(Timer::CheckHeartbeats),
        }
        // Every silent peer is looked for in time: the check is due no later than the first
        // peer's deadline passes.
        debug_assert!(self.peers.is_empty() || self.timers.next_deadline().is_some(), "nobody watches the peers");
    }
}

fn phase_name(p: &Phase) -> &'static str {
    match p {
        Phase::Idle => "Idle",
        Phase::AwaitingTopologyVotes { .. } => "AwaitingTopologyVotes",
        Phase::AwaitingConnections { .. } => "AwaitingConnections",
    }
}

/// Heartbeats go out four times per timeout, so one or two lost or late ones never expel a peer.
pub fn heartbeat_interval(timeout: Duration) -> Duration {
    timeout / 4
}

#[cfg(test)]
mod tests;
