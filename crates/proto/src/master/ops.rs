//! The master's half of collective agreement: every participant reports its end of a collective
//! (`OpDone` or `OpFailed`), and the master decides one outcome for all of them.
//!
//! A collective commits when every member its group had when the master first heard of it has
//! reported `OpDone`. It aborts as soon as one member reports `OpFailed`, or a member is removed
//! before reporting `OpDone`, or a new topology is issued. The decision is final and goes to every
//! member of the group, so participants still moving data stop at once. `docs/protocol.md`
//! argues why every surviving participant returns the same outcome.

use super::{Master, Status};
use shoal_wire::{Epoch, FailureKind, GroupId, Message, OpFailure, PeerId};
use std::collections::BTreeSet;

/// Most undecided or aborted collectives the master tracks at once. A group runs its collectives
/// one after another, so only a peer that invents sequence numbers gets near this.
pub const MAX_TRACKED_OPS: usize = 4096;

/// A collective the master has heard of and not yet forgotten.
#[derive(Debug, Clone)]
pub(super) struct OpRecord {
    /// The group's members when the master first heard of it.
    members: BTreeSet<PeerId>,
    /// Members that reported `OpDone`.
    done: BTreeSet<PeerId>,
    /// Set once the collective is aborted; kept to answer late `OpDone`s.
    aborted: Option<OpFailure>,
}

impl Master {
    pub(super) fn op_done(&mut self, peer: PeerId, epoch: Epoch, seq: u64) {
        let Some(key) = self.op_key(peer, epoch, seq) else { return };
        let record = &mut self.ops.get_mut(&key).expect("op_key creates the record");
        if let Some(failure) = record.aborted.clone() {
            // We finished our part after someone else failed: the collective still aborts.
            return self.send_to_peer(peer, Message::OpAborted { epoch, seq, failure });
        }
        record.done.insert(peer);
        if record.done.is_superset(&record.members) {
            let record = self.ops.remove(&key).expect("present");
            for p in record.members {
                self.send_to_peer(p, Message::OpCommitted { epoch, seq });
            }
        }
    }

    pub(super) fn op_failed(&mut self, peer: PeerId, epoch: Epoch, seq: u64, failure: OpFailure) {
        let Some(key) = self.op_key(peer, epoch, seq) else { return };
        log::info!("collective {seq} of topology {} failed at {peer}: {}", epoch.0, failure.reason);
        self.abort_op(key, failure);
    }

    /// A member left the run: every collective of its group it had not finished aborts.
    pub(super) fn abort_ops_of(&mut self, peer: PeerId, reason: &str) {
        let keys: Vec<(GroupId, u64)> = self
            .ops
            .iter()
            .filter(|(_, r)| r.aborted.is_none() && r.members.contains(&peer) && !r.done.contains(&peer))
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            self.abort_op(key, OpFailure::new(FailureKind::PeerLost, peer, reason));
        }
    }

    /// A new topology replaces the ring: collectives of the old one can never finish.
    pub(super) fn abort_all_ops(&mut self, next: Epoch) {
        let keys: Vec<(GroupId, u64)> =
            self.ops.iter().filter(|(_, r)| r.aborted.is_none()).map(|(k, _)| *k).collect();
        for key in keys {
            let (_, seq) = key;
            let reason = format!("topology {} was replaced by topology {} during collective {seq}", self.ring_epoch.0, next.0);
            let any_member = *self.ops[&key].members.iter().next().expect("records have members");
            self.abort_op(key, OpFailure::new(FailureKind::Superseded, any_member, reason));
        }
        self.ops.clear();
    }

    fn abort_op(&mut self, key: (GroupId, u64), failure: OpFailure) {
        let epoch = self.ring_epoch;
        let record = self.ops.get_mut(&key).expect("aborting a tracked op");
        if record.aborted.is_some() {
            return;
        }
        record.aborted = Some(failure.clone());
        let members: Vec<PeerId> = record.members.iter().copied().collect();
        for p in members {
            self.send_to_peer(p, Message::OpAborted { epoch, seq: key.1, failure: failure.clone() });
        }
    }

    /// The record of collective `seq` in `peer`'s group, created on first report. `None` (and
    /// the reporter answered or expelled) when the report cannot concern the current ring.
    fn op_key(&mut self, peer: PeerId, epoch: Epoch, seq: u64) -> Option<(GroupId, u64)> {
        let entry = self.peers.get(&peer)?;
        if entry.status != Status::Accepted {
            self.violation(peer, format!("collective report from {peer}, which is not accepted"));
            return None;
        }
        let group = entry.group;
        if epoch != self.ring_epoch {
            // Reports for a replaced topology: that ring's collectives were aborted with it.
            let reason = format!("topology {} was replaced by topology {}", epoch.0, self.ring_epoch.0);
            self.send_to_peer(peer, Message::OpAborted { epoch, seq, failure: OpFailure::new(FailureKind::Superseded, peer, reason) });
            return None;
        }
        let key = (group, seq);
        if !self.ops.contains_key(&key) {
            if self.ops.len() >= MAX_TRACKED_OPS {
                self.violation(peer, format!("more than {MAX_TRACKED_OPS} collectives open at once"));
                return None;
            }
            let members: BTreeSet<PeerId> =
                self.ring.iter().copied().filter(|p| self.peers[p].group == group).collect();
            self.ops.insert(key, OpRecord { members, done: BTreeSet::new(), aborted: None });
        }
        Some(key)
    }

    fn send_to_peer(&mut self, peer: PeerId, message: Message) {
        if let Some(conn) = self.peers.get(&peer).map(|e| e.conn) {
            self.send(conn, message);
        }
    }
}
