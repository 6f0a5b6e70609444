//! What a restarted master needs to carry on the run (`docs/protocol.md`, "Master restart"): the
//! session and its data key, who is in the run and where, every group's committed ring, the last
//! epoch, and every group's last synced revision and elected hashes. The driver writes it to its
//! state directory whenever it changes ([`Master::generation`]) and starts from it again
//! ([`Master::restore`]).
//!
//! A restored master holds every peer detached until it rejoins (`Rejoin` on a new connection)
//! within a heartbeat timeout; one that does not is removed as a silent peer is. What was in
//! progress (votes, syncs, collectives awaiting a verdict) is not kept: peers end their votes and
//! syncs with a retryable error when the connection breaks, and ask again about collectives once
//! rejoined. A topology being connected when the master stopped is issued again once every peer
//! of its group is back.

use super::sync::GroupState;
use super::{ConnId, Group, Master, MasterConfig, Message, Output, PeerEntry, Reach, Status};
use shoal_wire::{Epoch, GroupId, PeerId, SessionId};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Instant;

/// A peer of the run, as kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurablePeer {
    /// Its id.
    pub peer: PeerId,
    /// Its group.
    pub group: GroupId,
    /// Where other peers dial it.
    pub addr: String,
    /// Whether it is a member of the committed ring (else it awaits admission).
    pub accepted: bool,
    /// Whether it catches up with its group's state before it awaits admission: a restored
    /// master keeps it out of votes until it asks again (`catchup.rs`).
    pub catching_up: bool,
    /// Whether its data address can be dialed; `None` while that was being probed (a restored
    /// master probes it again).
    pub dialable: Option<bool>,
    /// Where its control connection came from, if known.
    pub seen: Option<IpAddr>,
}

/// A group's committed ring, as kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurableRing {
    /// The group.
    pub group: GroupId,
    /// The committed topology.
    pub epoch: Epoch,
    /// The last topology issued to the group: later than `epoch` while one was being connected.
    pub issued: Epoch,
    /// Its members in ring order.
    pub members: Vec<PeerId>,
}

/// A group's last completed sync, as kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurableGroup {
    /// The group.
    pub group: GroupId,
    /// Its revision.
    pub revision: u64,
    /// The elected hash of every tensor.
    pub hashes: BTreeMap<String, [u8; 32]>,
    /// Peers that took part in a completed sync.
    pub synced: BTreeSet<PeerId>,
}

/// Everything a restarted master needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durable {
    /// The run's session.
    pub session: SessionId,
    /// The run's key for data connections: peers' streams keep using it.
    pub data_key: [u8; 32],
    /// The next peer id to hand out: ids are never reused.
    pub next_peer: u32,
    /// The last topology issued, to any group.
    pub epoch: Epoch,
    /// Every group's committed ring, by group.
    pub rings: Vec<DurableRing>,
    /// Every peer.
    pub peers: Vec<DurablePeer>,
    /// Every group's last completed sync.
    pub groups: Vec<DurableGroup>,
}

/// Why a kept run cannot be restored: it does not hold together, so no master wrote it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Incoherent {
    /// Its session or data key is not the configuration's.
    #[error("the state is of another session than the configuration")]
    OtherSession,
    /// A group's committed ring is not exactly its accepted peers, or a group is listed twice.
    #[error("the ring of {0:?} is not the set of its accepted peers")]
    RingNotAccepted(GroupId),
    /// A peer id at or past the next id to hand out.
    #[error("{peer} was never handed out (next id {next})")]
    NeverHandedOut {
        /// The peer.
        peer: PeerId,
        /// The next id the state says it hands out.
        next: u32,
    },
    /// A group's committed topology is newer than the last one issued.
    #[error("the committed topology of {0:?} is newer than the last issued")]
    CommittedAhead(GroupId),
    /// A peer listed twice.
    #[error("{0} is listed twice")]
    Twice(PeerId),
}

impl Master {
    /// Grows whenever what [`Master::durable`] returns changed: the driver saves it then.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// What a restarted master needs.
    pub fn durable(&self) -> Durable {
        // What a restart checks ([`Master::restore`]) holds of every state written.
        let rings: Vec<DurableRing> = self
            .each_group()
            .filter(|(_, g)| g.issued > Epoch(0))
            .map(|(group, g)| DurableRing { group, epoch: g.ring_epoch, issued: g.issued, members: g.ring.clone() })
            .collect();
        assert!(rings.iter().all(|r| r.epoch <= r.issued && r.issued <= self.epoch), "a ring committed ahead");
        debug_assert!(self.peers.keys().all(|p| p.0 < self.next_peer), "a peer id was handed out twice");
        Durable {
            session: self.config.session,
            data_key: self.config.data_key.0,
            next_peer: self.next_peer,
            epoch: self.epoch,
            rings,
            peers: self
                .peers
                .iter()
                .map(|(id, e)| DurablePeer {
                    peer: *id,
                    group: e.group,
                    addr: e.addr.clone(),
                    accepted: e.status == Status::Accepted,
                    catching_up: e.status == Status::CatchingUp,
                    dialable: e.reach.known(),
                    seen: e.seen,
                })
                .collect(),
            groups: self
                .group_states
                .iter()
                .map(|(g, s)| DurableGroup {
                    group: *g,
                    revision: s.revision,
                    hashes: s.hashes.clone(),
                    synced: s.synced.clone(),
                })
                .collect(),
        }
    }

    /// A master that carries on the run `durable` describes, under `config` (whose session and
    /// data key must be `durable`'s). Every peer must rejoin within a heartbeat timeout.
    ///
    /// # Errors
    /// If `durable` does not hold together (a ring member that is not an accepted peer, a peer id
    /// not below `next_peer`, another session): a state file written by no master.
    pub fn restore(config: MasterConfig, durable: Durable, now: Instant) -> Result<Master, Incoherent> {
        if durable.session != config.session || durable.data_key != config.data_key.0 {
            return Err(Incoherent::OtherSession);
        }
        let mut accepted: BTreeMap<GroupId, BTreeSet<PeerId>> = BTreeMap::new();
        for p in durable.peers.iter().filter(|p| p.accepted) {
            accepted.entry(p.group).or_default().insert(p.peer);
        }
        let mut groups: BTreeMap<GroupId, Group> = BTreeMap::new();
        for r in &durable.rings {
            let members: BTreeSet<PeerId> = r.members.iter().copied().collect();
            let theirs = accepted.remove(&r.group).unwrap_or_default();
            if members != theirs || members.len() != r.members.len() || groups.contains_key(&r.group) {
                return Err(Incoherent::RingNotAccepted(r.group));
            }
            if r.epoch > r.issued || r.issued > durable.epoch {
                return Err(Incoherent::CommittedAhead(r.group));
            }
            // A topology issued and not committed was lost with its phase: one is issued again
            // once every peer of the group is back.
            let reform_due = r.issued != r.epoch;
            let group = Group {
                ring_epoch: r.epoch,
                issued: r.issued,
                ring: r.members.clone(),
                reform_due,
                ..Group::default()
            };
            groups.insert(r.group, group);
        }
        if let Some((group, _)) = accepted.pop_first() {
            return Err(Incoherent::RingNotAccepted(group));
        }
        if let Some(p) = durable.peers.iter().find(|p| p.peer.0 >= durable.next_peer) {
            return Err(Incoherent::NeverHandedOut { peer: p.peer, next: durable.next_peer });
        }
        let mut master = Master::new(config, now);
        for p in durable.peers {
            let status = match (p.accepted, p.catching_up) {
                (true, _) => Status::Accepted,
                (false, true) => Status::CatchingUp,
                (false, false) => Status::Registered,
            };
            let reach = match p.dialable {
                Some(true) => Reach::Dialable,
                Some(false) => Reach::Closed("found so before the master restarted".into()),
                None => {
                    let timeout = master.config.probe_timeout;
                    master.outputs.push_back(Output::Probe { peer: p.peer, addr: p.addr.clone(), timeout });
                    Reach::Probing(now + timeout)
                }
            };
            let entry = PeerEntry {
                conn: None,
                group: p.group,
                addr: p.addr,
                status,
                last_heard: now,
                last_beat: None,
                beats: master.beats(),
                fresh: false,
                last_vote: None,
                reach,
                seen: p.seen,
            };
            if master.peers.insert(p.peer, entry).is_some() {
                return Err(Incoherent::Twice(p.peer));
            }
            groups.entry(p.group).or_default().peers += 1;
        }
        master.next_peer = durable.next_peer;
        master.epoch = durable.epoch;
        master.g = groups.remove(&master.focus).unwrap_or_default();
        master.groups = groups;
        for g in durable.groups {
            master
                .group_states
                .insert(g.group, GroupState { revision: g.revision, hashes: g.hashes, synced: g.synced });
        }
        master.arm_heartbeat_check();
        master.arm_probes();
        assert!(
            master.rings().all(|(_, ring)| ring.iter().all(|p| master.peers[p].status == Status::Accepted)),
            "the rings are accepted members"
        );
        debug_assert!(master.peers.keys().all(|p| p.0 < master.next_peer), "a restored id is handed out again");
        debug_assert!(master.peers.values().all(|e| e.conn.is_none()), "a restored peer is attached before it rejoins");
        log::info!(
            "restored the run: {} peers in {} groups ({} in rings); waiting for them to rejoin",
            master.peers.len(),
            master.each_group().count(),
            master.rings().map(|(_, ring)| ring.len()).sum::<usize>(),
        );
        Ok(master)
    }

    /// Connection `conn`'s first message is `Rejoin`: `peer`, registered in `session`, is back.
    pub(super) fn rejoin(&mut self, now: Instant, conn: ConnId, peer: PeerId, session: SessionId, proof: [u8; 32]) {
        if !self.proven(now, conn, "Rejoin", &peer.to_string(), &proof) {
            return;
        }
        if session != self.config.session {
            let reason = format!("{peer} was registered in another run (session {:016x})", session.0);
            return self.refuse_rejoin(conn, reason);
        }
        let Some(entry) = self.peers.get_mut(&peer) else {
            return self.refuse_rejoin(conn, format!("{peer} is not in the run any more"));
        };
        // Its old connection, if the master still holds one, is dead: the peer dialed anew.
        let old = entry.conn.replace(conn);
        entry.last_heard = now;
        if let Some(old) = old {
            self.conns.remove(&old);
            let reason = format!("{peer} rejoined on another connection");
            self.outputs.push_back(super::Output::Close { conn: old, reason });
        }
        self.conns.insert(conn, peer);
        log::info!("{peer} rejoined");
        self.send(conn, self.registered_message(peer));
        self.focus_on(peer);
        self.reform_if_due();
        if self.group_back() {
            // A group whose first topology was lost with the master's phase.
            self.admit_without_vote_if_alone();
        }
        assert_eq!(self.peers.get(&peer).and_then(|e| e.conn), Some(conn), "{peer} rejoined on another connection");
        debug_assert_eq!(
            self.conns.values().filter(|p| **p == peer).count(),
            1,
            "{peer} is reached on two connections"
        );
    }

    /// Refuses connection `conn`'s `Rejoin` for `reason`, telling the peer: it must not come
    /// back.
    fn refuse_rejoin(&mut self, conn: ConnId, reason: String) {
        log::warn!("connection {}: refused: {reason}", conn.0);
        self.send(conn, Message::Kicked { reason: reason.clone() });
        self.outputs.push_back(super::Output::Close { conn, reason });
    }

    /// Counts a change of what [`Master::durable`] returns.
    pub(super) fn touch(&mut self) {
        self.generation += 1;
    }
}
