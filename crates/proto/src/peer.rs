//! A peer's view of the protocol: what the master has told it, and where it stands in its ring.

use shoal_wire::{Epoch, GroupId, Member, Message, OpFailure, PeerId, PlanEntry, SessionId};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// What the peer has learned from the master.
#[derive(Debug, Clone, Default)]
pub struct PeerView {
    /// Our id and the run's session, once registered.
    pub registered: Option<(PeerId, SessionId)>,
    /// The latest topology issued to us, not yet committed.
    pub issued: Option<(Epoch, Vec<Member>)>,
    /// The topology in force for us.
    pub committed: Option<(Epoch, Vec<Member>)>,
    /// The answer of the last `peers_pending` vote, until consumed.
    pub pending_result: Option<bool>,
    /// Why the master expelled us, if it did.
    pub kicked: Option<String>,
    /// How often the master wants a heartbeat, once registered.
    pub heartbeat_interval: Option<Duration>,
    /// Peers the master reported gone. Ids are never reused, so this only grows.
    pub removed: BTreeSet<PeerId>,
    /// The master's verdicts on collectives, by (epoch, seq), until consumed. An abort may
    /// arrive before this peer even starts the collective; verdicts of replaced topologies are
    /// dropped when a new one is committed.
    pub verdicts: BTreeMap<(Epoch, u64), Verdict>,
    /// The last collective this peer committed on its own, which implies every earlier one of
    /// that epoch it took part in committed too (a failed one ends the epoch's collectives for it).
    pub committed_through: Option<(Epoch, u64)>,
    /// Collectives the master asked about that this peer had not committed when asked: it
    /// reports them if it commits them on its own.
    pub queried: BTreeSet<(Epoch, u64)>,
    /// An `update_topology` vote is open: (topology, a voter, the fewest collectives a voter had
    /// started). A collective numbered at least that can never complete.
    pub vote_open: Option<(Epoch, PeerId, u64)>,
    /// Why the last `update_topology` vote was abandoned or refused, until consumed.
    pub vote_aborted: Option<VoteAbort>,
    /// The plan of the current shared-state sync: (round, revision, entries).
    pub sync_plan: Option<(u64, u64, Vec<PlanEntry>)>,
    /// How a shared-state sync ended: (round, completed or why not).
    pub sync_end: Option<(u64, Result<(), SyncAbort>)>,
}

/// Why an `update_topology` vote ended without a topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VoteAbort {
    /// Not counted while a topology was being connected: join it, then vote again. Otherwise the
    /// vote was abandoned because the peers made different calls, and the call fails.
    pub retry: bool,
    /// Why.
    pub reason: String,
}

/// Why a shared-state sync ended without effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncAbort {
    /// Calling again can succeed.
    pub retryable: bool,
    /// Why.
    pub reason: String,
}

/// How the master decided a collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every participant finished: the results stand.
    Committed,
    /// The collective failed somewhere: every participant restores its buffers.
    Aborted(OpFailure),
}

/// A fact the peer learned from one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerEvent {
    /// Nothing new (a heartbeat).
    Nothing,
    /// We are registered.
    Registered,
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
    Verdict(Epoch, u64),
    /// The master asked whether we committed a collective: `committed` says we did and must
    /// tell it so now; otherwise we will when we do.
    Query {
        /// The topology.
        epoch: Epoch,
        /// The collective.
        seq: u64,
        /// Whether we already committed it.
        committed: bool,
    },
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
    /// The group's ring, in order.
    pub ring: Vec<Member>,
    /// Members of the whole run.
    pub world_size: usize,
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
            Message::Registered { peer, session, heartbeat_ms } => {
                if self.registered.is_some() {
                    return unexpected("already registered");
                }
                self.registered = Some((peer, session));
                self.heartbeat_interval = Some(Duration::from_millis(heartbeat_ms.max(1).into()));
                PeerEvent::Registered
            }
            Message::PeerRemoved { peer } => {
                self.removed.insert(peer);
                PeerEvent::PeerRemoved(peer)
            }
            Message::Topology { epoch, ref members } => {
                let Some((me, _)) = self.registered else {
                    return unexpected("not registered");
                };
                if !members.iter().any(|m| m.peer == me) {
                    return unexpected("topology without us");
                }
                if self.committed.as_ref().is_some_and(|(e, _)| *e >= epoch) {
                    return unexpected("topology epoch went backwards");
                }
                self.issued = Some((epoch, members.clone()));
                self.vote_open = None;
                PeerEvent::TopologyIssued(epoch)
            }
            Message::TopologyCommitted { epoch } => match self.issued.take() {
                Some((issued, members)) if issued == epoch => {
                    self.committed = Some((epoch, members));
                    self.verdicts.retain(|(e, _), _| *e >= epoch);
                    self.queried.retain(|(e, _)| *e >= epoch);
                    PeerEvent::TopologyCommitted(epoch)
                }
                other => {
                    self.issued = other;
                    return unexpected("commit of a topology not issued to us");
                }
            },
            Message::PeersPendingResult { pending } => {
                self.pending_result = Some(pending);
                PeerEvent::PeersPendingResult(pending)
            }
            Message::OpCommitted { epoch, seq } => {
                self.verdicts.insert((epoch, seq), Verdict::Committed);
                PeerEvent::Verdict(epoch, seq)
            }
            Message::OpAborted { epoch, seq, failure } => {
                self.verdicts.insert((epoch, seq), Verdict::Aborted(failure));
                PeerEvent::Verdict(epoch, seq)
            }
            Message::TopologyVoteOpened { epoch, voter, collectives } => {
                if self.vote_open.is_none_or(|(e, _, c)| e != epoch || collectives < c) {
                    self.vote_open = Some((epoch, voter, collectives));
                }
                PeerEvent::Nothing
            }
            Message::TopologyVoteAborted { retry, reason } => {
                self.vote_open = None;
                self.vote_aborted = Some(VoteAbort { retry, reason });
                PeerEvent::Nothing
            }
            Message::SyncPlan { round, revision, entries } => {
                self.sync_plan = Some((round, revision, entries));
                PeerEvent::Nothing
            }
            Message::SyncComplete { round } => {
                self.sync_end = Some((round, Ok(())));
                PeerEvent::Nothing
            }
            Message::SyncAborted { round, retryable, reason } => {
                self.sync_end = Some((round, Err(SyncAbort { retryable, reason })));
                PeerEvent::Nothing
            }
            Message::OpQuery { epoch, seq } => {
                let committed = self.committed_through.is_some_and(|(e, s)| e == epoch && s >= seq);
                if !committed {
                    self.queried.insert((epoch, seq));
                }
                PeerEvent::Query { epoch, seq, committed }
            }
            Message::Kicked { reason } => {
                self.kicked = Some(reason);
                PeerEvent::Kicked
            }
            _ => return unexpected("not a master-to-peer message"),
        })
    }

    /// Records that we committed collective `seq` of `epoch` on our own; true if the master
    /// asked about it meanwhile and must be told.
    pub fn commit_on_our_own(&mut self, epoch: Epoch, seq: u64) -> bool {
        self.committed_through = Some((epoch, seq));
        self.queried.remove(&(epoch, seq))
    }

    /// Our position in the ring of `members` (an issued or committed topology).
    ///
    /// # Panics
    /// If we are not registered or not a member: [`PeerView::handle_message`] rejects such
    /// topologies.
    pub fn position(&self, epoch: Epoch, members: &[Member]) -> RingPosition {
        let (me, _) = self.registered.expect("a topology is only accepted once registered");
        let group: GroupId = members.iter().find(|m| m.peer == me).expect("we are a member").group;
        let ring: Vec<Member> = members.iter().filter(|m| m.group == group).cloned().collect();
        let rank = ring.iter().position(|m| m.peer == me).expect("we are in our group's ring");
        RingPosition { epoch, rank, ring, world_size: members.len() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_is_answered_now_if_we_committed_and_remembered_otherwise() {
        let mut v = PeerView::default();
        let (e, later) = (Epoch(3), Epoch(4));
        assert!(!v.commit_on_our_own(e, 0), "nobody asked");
        let query = |seq| Message::OpQuery { epoch: e, seq };
        assert_eq!(v.handle_message(query(0)), Ok(PeerEvent::Query { epoch: e, seq: 0, committed: true }));
        assert_eq!(v.handle_message(query(1)), Ok(PeerEvent::Query { epoch: e, seq: 1, committed: false }));
        assert!(v.commit_on_our_own(e, 1), "asked before we committed: tell the master");
        let other = Message::OpQuery { epoch: later, seq: 0 };
        assert_eq!(v.handle_message(other), Ok(PeerEvent::Query { epoch: later, seq: 0, committed: false }));
    }

    fn member(p: u32, g: u32) -> Member {
        Member { peer: PeerId(p), group: GroupId(g), addr: format!("h:{p}") }
    }

    #[test]
    fn ring_position_is_taken_within_our_group() {
        let mut v = PeerView::default();
        v.handle_message(Message::Registered { peer: PeerId(3), session: SessionId(1), heartbeat_ms: 100 }).unwrap();
        let members = vec![member(1, 0), member(2, 1), member(3, 0), member(4, 0)];
        let ev = v.handle_message(Message::Topology { epoch: Epoch(2), members: members.clone() });
        assert_eq!(ev, Ok(PeerEvent::TopologyIssued(Epoch(2))));
        let pos = v.position(Epoch(2), &members);
        assert_eq!((pos.rank, pos.group_size(), pos.world_size), (1, 3, 4));
        assert_eq!((pos.prev().peer, pos.next().peer), (PeerId(1), PeerId(4)));
        assert!(v.handle_message(Message::TopologyCommitted { epoch: Epoch(1) }).is_err());
        assert_eq!(
            v.handle_message(Message::TopologyCommitted { epoch: Epoch(2) }),
            Ok(PeerEvent::TopologyCommitted(Epoch(2)))
        );
        assert!(v.handle_message(Message::Topology { epoch: Epoch(2), members }).is_err());
        assert!(v.handle_message(Message::VotePeersPending).is_err());
    }
}
