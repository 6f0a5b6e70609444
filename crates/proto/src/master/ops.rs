//! The master's half of collective agreement (`docs/protocol.md`, "Agreement").
//!
//! Participants first try to agree among themselves: each that finishes its part sends a token
//! around the ring, and one that holds every other participant's token commits on its own; the
//! master never hears of a collective that went well. When that fails (a participant died or
//! froze, a stream broke) a participant that finished asks the master (`OpDone { decided: false }`)
//! and one that did not finish reports `OpFailed`. The master then queries every other
//! participant (`OpQuery`); one that committed on its own says so (`OpDone { decided: true }`),
//! one still running answers when it finishes. The master's rules keep both paths consistent:
//!
//! - **abort** only on an `OpFailed`: the reporter never finished, so it never sent a token, so no
//!   participant can have committed on its own;
//! - **commit** once any participant says it committed, or once every participant still in the
//!   run has reported `OpDone`: all of them hold the complete result. A removed participant
//!   counts for nothing either way.
//!
//! An abort goes to every participant, so those still waiting on data stop at once; a commit goes
//! to those that asked.

use super::{Master, Status};
use shoal_wire::{Epoch, FailureKind, GroupId, Message, OpFailure, PeerId};
use std::collections::BTreeSet;

/// Most undecided or aborted collectives the master tracks at once. A group runs its collectives
/// one after another, so only a peer that invents sequence numbers gets near this.
pub const MAX_TRACKED_OPS: usize = 4096;

/// Names a collective: its group, the topology it ran in, the derived group it ran in (0: the
/// topology's whole group), its number there. Numbers restart in every topology, so the epoch
/// must be part of the name: a late report about collective 12 of a replaced topology must never
/// be taken for collective 12 of the next one.
pub(super) type OpKey = (GroupId, Epoch, u64, u64);

/// A collective as a report names it: its topology, derived group and number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct OpName {
    pub epoch: Epoch,
    pub derived: u64,
    pub seq: u64,
}

/// A collective the master has heard of and not yet forgotten.
#[derive(Debug, Clone)]
pub(super) struct OpRecord {
    /// Its participants: the ring's members when the master first heard of it, or those of
    /// its derived group as the first report named them.
    members: BTreeSet<PeerId>,
    /// Members that reported `OpDone`.
    done: BTreeSet<PeerId>,
    /// Members that asked for the verdict and have not had it.
    waiting: BTreeSet<PeerId>,
    /// Members asked whether they committed on their own.
    queried: BTreeSet<PeerId>,
    /// The verdict, once there is one. An aborted record is kept (until the topology changes) to
    /// answer participants that report late.
    outcome: Option<Outcome>,
}

#[derive(Debug, Clone)]
enum Outcome {
    Committed,
    Aborted(OpFailure),
}

impl Master {
    pub(super) fn op_done(&mut self, peer: PeerId, name: OpName, members: Vec<PeerId>, decided: bool) {
        let Some(key) = self.op_key(peer, name, members) else {
            return;
        };
        let seq = name.seq;
        let record = self.ops.get_mut(&key).expect("op_key creates the record");
        record.done.insert(peer);
        if decided {
            if let Some(Outcome::Aborted(f)) = &record.outcome {
                log::error!("{peer} committed collective {seq}, which was aborted ({}): a bug", f.reason);
            }
            record.outcome.get_or_insert(Outcome::Committed);
        } else {
            record.waiting.insert(peer);
        }
        self.settle(key);
        debug_assert!(!decided || self.ops.get(&key).is_none_or(|r| r.outcome.is_some()), "a commit told is undecided");
        // Answered at once, or waiting for the others: never both.
        debug_assert!(
            self.ops.get(&key).is_none_or(|r| r.outcome.is_none() || r.waiting.is_empty()),
            "a verdict left someone waiting"
        );
    }

    pub(super) fn op_failed(&mut self, peer: PeerId, name: OpName, members: Vec<PeerId>, failure: OpFailure) {
        let Some(key) = self.op_key(peer, name, members) else {
            return;
        };
        let OpName { epoch, derived, seq } = name;
        let record = self.ops.get_mut(&key).expect("op_key creates the record");
        if let Some(m) = failure.reason.mismatch() {
            let of_it = |h: &shoal_wire::OpHeader| (h.epoch, h.derived, h.seq) == (epoch, derived, seq);
            if m.ours.0 != peer || !record.members.contains(&m.theirs.0) || !of_it(&m.ours.1) || !of_it(&m.theirs.1) {
                return self.violation(peer, super::PeerMisbehaved::MismatchNamesOthers { peer });
            }
        }
        // Calls that differ in a topology that lost a member follow from the loss, not from the
        // application: a member that heard of it failed its call and called again at once, in
        // the same topology, while another went on (the chaos run found it in optimize_topology,
        // whose probes fail only at the lost member's partners). The retry in the re-formed
        // topology runs them alike; a real difference shows there.
        let failure = match self.g.lost {
            Some(gone) if failure.reason.mismatch().is_some() => {
                let reason = format!("{gone} was lost, and the calls then differed ({})", failure.reason);
                OpFailure::new(FailureKind::PeerLost, gone, reason)
            }
            _ => failure,
        };
        match &record.outcome {
            None => {
                log::info!("collective {seq} of topology {} failed at {peer}: {}", epoch.0, failure.reason);
                self.counters.collectives_aborted += 1;
                // What ends a call goes out after the new topology, so that whoever calls again at
                // once finds it: the votes abandoned for misuse are held back until it is issued.
                let held = self.outputs.len();
                // A collective given up for a vote that never joins it: the vote ends too. (A
                // buffer that fits no group names no calls: the votes stand, for the members'
                // next calls to meet.)
                if let Some(misuse) = failure.reason.misuse() {
                    self.abandon_votes(key.0, misuse);
                }
                let abandoned: Vec<_> = self.outputs.drain(held..).collect();
                // Given up before it was decided: the members calling it later fail it too.
                if derived == 0 {
                    self.g.gathering.remove(&(epoch, seq));
                }
                let record = self.ops.get_mut(&key).expect("still tracked");
                record.outcome = Some(Outcome::Aborted(failure.clone()));
                record.waiting.clear();
                let members: Vec<PeerId> = record.members.iter().copied().collect();
                // The participants dropped the ring's streams: re-form it (unless a topology being
                // connected replaces the ring anyway), and announce the new topology before the
                // verdict.
                self.g.reform_due |= !matches!(self.g.phase, super::Phase::AwaitingConnections { .. });
                self.reform_if_due();
                self.outputs.extend(abandoned);
                for p in members {
                    self.send_to_peer(p, Message::OpAborted { epoch, derived, seq, failure: failure.clone() });
                }
                if derived == 0 {
                    self.gathered_fate(epoch, seq, Err(failure.clone()));
                }
            }
            Some(Outcome::Committed) => {
                log::error!("{peer} failed collective {seq}, which was committed ({}): a bug", failure.reason)
            }
            Some(Outcome::Aborted(_)) => {}
        }
        assert!(self.ops.get(&key).is_none_or(|r| r.outcome.is_some()), "a failure reported leaves a verdict");
        debug_assert!(self.ops.get(&key).is_none_or(|r| r.waiting.is_empty()), "a verdict left someone waiting");
    }

    /// A member left the run: collectives that waited only on it may now commit.
    pub(super) fn settle_ops_of(&mut self, peer: PeerId) {
        debug_assert!(!self.peers.contains_key(&peer), "the collectives of {peer}, still in the run, are settled");
        let keys: Vec<OpKey> = self.ops.iter().filter(|(_, r)| r.members.contains(&peer)).map(|(k, _)| *k).collect();
        for key in keys {
            self.settle(key);
        }
        // A removed member counts for nothing: once every live one finished, it committed.
        debug_assert!(
            self.ops
                .values()
                .all(|r| r.outcome.is_some()
                    || r.members.iter().any(|p| self.peers.contains_key(p) && !r.done.contains(p))),
            "a collective every live member finished is undecided"
        );
    }

    /// A new topology replaces the focused group's ring: collectives of the old one that cannot
    /// commit abort.
    pub(super) fn close_ops(&mut self, next: Epoch) {
        let group = self.focus;
        let ours = (group, Epoch(0), 0, 0)..=(group, Epoch(u64::MAX), u64::MAX, u64::MAX);
        let keys: Vec<OpKey> = self.ops.range(ours).map(|(key, _)| *key).collect();
        assert!(keys.iter().all(|(_, old, _, _)| *old < next), "a topology replaces only older ones");
        for key in keys {
            self.settle(key);
            let Some(record) = self.ops.get(&key) else {
                continue;
            };
            if record.outcome.is_none() {
                let (_, old, derived, seq) = key;
                let reason = format!("topology {} was replaced by topology {} during collective {seq}", old.0, next.0);
                let any_member = *record.members.iter().next().expect("records have members");
                let failure = OpFailure::new(FailureKind::Superseded, any_member, reason);
                let members: Vec<PeerId> = record.members.iter().copied().collect();
                for p in members {
                    self.send_to_peer(p, Message::OpAborted { epoch: old, derived, seq, failure: failure.clone() });
                }
                if derived == 0 {
                    self.gathered_fate(old, seq, Err(failure));
                }
            }
            self.ops.remove(&key);
        }
        debug_assert!(self.ops.keys().all(|(g, ..)| *g != group), "a replaced ring's collective is open");
    }

    /// Commits if the rules allow, answers whoever waits, and forgets what is settled; a
    /// collective with a deadline that committed tells the members left out of it.
    fn settle(&mut self, key: OpKey) {
        let existed = self.ops.contains_key(&key);
        self.settle_record(key);
        let committed = existed && self.ops.get(&key).is_none_or(|r| matches!(r.outcome, Some(Outcome::Committed)));
        let (group, epoch, derived, seq) = key;
        if committed && derived == 0 && group == self.focus {
            self.gathered_fate(epoch, seq, Ok(()));
        }
    }

    fn settle_record(&mut self, key: OpKey) {
        let peers = &self.peers;
        let Some(record) = self.ops.get_mut(&key) else {
            return;
        };
        let mut live = record.members.iter().filter(|p| peers.contains_key(p));
        let all_done = live.all(|p| record.done.contains(p));
        if record.outcome.is_none() && all_done {
            record.outcome = Some(Outcome::Committed);
        }
        let (_, epoch, derived, seq) = key;
        let answer = match &record.outcome {
            None if record.waiting.is_empty() => return,
            None => {
                // Someone waits: find out whether the others committed on their own.
                let ask: Vec<PeerId> = record
                    .members
                    .iter()
                    .filter(|p| peers.contains_key(p) && !record.done.contains(p) && !record.queried.contains(p))
                    .copied()
                    .collect();
                record.queried.extend(ask.iter().copied());
                for p in ask {
                    self.send_to_peer(p, Message::OpQuery { epoch, derived, seq });
                }
                return;
            }
            Some(Outcome::Committed) => Message::OpCommitted { epoch, derived, seq },
            Some(Outcome::Aborted(failure)) => Message::OpAborted { epoch, derived, seq, failure: failure.clone() },
        };
        let waiting = std::mem::take(&mut record.waiting);
        // Only members report (`op_key`), so only members hear a verdict.
        debug_assert!(waiting.iter().all(|p| record.members.contains(p)), "a verdict goes to a non-member");
        if matches!(record.outcome, Some(Outcome::Committed)) && all_done {
            self.ops.remove(&key);
        }
        for p in waiting {
            self.send_to_peer(p, answer.clone());
        }
        debug_assert!(self.ops.get(&key).is_none_or(|r| r.waiting.is_empty()), "answered, yet waiting");
    }

    /// The record of collective `name` in `peer`'s group, created on first report (of a derived
    /// group's, with the `members` the report names). `None` (and the reporter answered or
    /// expelled) when the report cannot concern the current ring.
    fn op_key(&mut self, peer: PeerId, name: OpName, members: Vec<PeerId>) -> Option<OpKey> {
        let OpName { epoch, derived, seq } = name;
        let entry = self.peers.get(&peer)?;
        if entry.status != Status::Accepted {
            self.violation(peer, super::PeerMisbehaved::ReportFromNonMember { peer });
            return None;
        }
        let group = entry.group;
        if epoch != self.g.ring_epoch {
            // A report for a replaced topology: that ring's collectives were settled with it.
            let reason = format!("topology {} was replaced by topology {}", epoch.0, self.g.ring_epoch.0);
            let failure = OpFailure::new(FailureKind::Superseded, peer, reason);
            self.send_to_peer(peer, Message::OpAborted { epoch, derived, seq, failure });
            return None;
        }
        let key = (group, epoch, derived, seq);
        let named: BTreeSet<PeerId> = members.iter().copied().collect();
        let known = self.ops.get(&key).map(|r| &r.members);
        // A derived group's members: within the ring (or removed from the run since: the
        // reporter may not have heard yet), the reporter among them, each once, and the same in
        // every report that names them (a member answering a query need not).
        let fits = named.len() == members.len()
            && named.contains(&peer)
            && named.iter().all(|p| self.g.ring.contains(p) || (!self.peers.contains_key(p) && p.0 < self.next_peer))
            && known.is_none_or(|k| *k == named);
        let named_well =
            if derived == 0 { members.is_empty() } else { fits || (members.is_empty() && known.is_some()) };
        if !named_well {
            self.violation(peer, super::PeerMisbehaved::DerivedMembers { peer, derived });
            return None;
        }
        if !self.ops.contains_key(&key) {
            if self.ops.len() >= MAX_TRACKED_OPS {
                self.violation(peer, super::PeerMisbehaved::TooManyOpenCollectives);
                return None;
            }
            let members = match self.gathered_members(epoch, seq) {
                // Called with a deadline: it runs among the members the master named.
                Some(included) if derived == 0 => included.iter().copied().collect(),
                _ if derived == 0 => self.g.ring.iter().copied().collect(),
                _ => named,
            };
            if !members.contains(&peer) {
                self.violation(peer, super::PeerMisbehaved::NotIncluded { peer, seq });
                return None;
            }
            let record = OpRecord {
                members,
                done: BTreeSet::new(),
                waiting: BTreeSet::new(),
                queried: BTreeSet::new(),
                outcome: None,
            };
            self.ops.insert(key, record);
        }
        debug_assert!(self.ops[&key].members.iter().all(|p| self.peers.get(p).is_none_or(|e| e.group == group)));
        debug_assert!(self.ops[&key].members.contains(&peer), "{peer} reports on a collective it is no member of");
        assert!(self.ops.len() <= MAX_TRACKED_OPS, "the master tracks at most MAX_TRACKED_OPS collectives");
        Some(key)
    }

    /// Collective `seq` of `epoch` of the focused group's whole group fails before it ran, with
    /// `failure`: every member hears the abort (one that calls it later fails it alike,
    /// `PeerView::fail_next`), and the record keeps it for late reports. `peer` asked: it hears
    /// again if it was aborted already.
    pub(super) fn abort_unstarted(&mut self, peer: PeerId, epoch: Epoch, seq: u64, failure: OpFailure) {
        let key = (self.focus, epoch, 0, seq);
        if let Some(failure) = self.aborted(epoch, seq) {
            return self.send_to_peer(peer, Message::OpAborted { epoch, derived: 0, seq, failure });
        }
        let members: BTreeSet<PeerId> = self.g.ring.iter().copied().collect();
        if self.ops.len() < MAX_TRACKED_OPS && !self.ops.contains_key(&key) {
            let outcome = Some(Outcome::Aborted(failure.clone()));
            let record = OpRecord {
                members: members.clone(),
                done: BTreeSet::new(),
                waiting: BTreeSet::new(),
                queried: BTreeSet::new(),
                outcome,
            };
            self.ops.insert(key, record);
        }
        for p in members {
            self.send_to_peer(p, Message::OpAborted { epoch, derived: 0, seq, failure: failure.clone() });
        }
    }

    /// Why collective `seq` of `epoch` (of the focused group's whole group) was aborted, if it was.
    pub(super) fn aborted(&self, epoch: Epoch, seq: u64) -> Option<OpFailure> {
        match self.ops.get(&(self.focus, epoch, 0, seq))?.outcome.as_ref()? {
            Outcome::Aborted(failure) => Some(failure.clone()),
            Outcome::Committed => None,
        }
    }

    pub(super) fn send_to_peer(&mut self, peer: PeerId, message: Message) {
        if let Some(conn) = self.peers.get(&peer).and_then(|e| e.conn) {
            self.send(conn, message);
        }
    }
}
