//! The master's half of catching up (`docs/state.md`, "Catching up"): a registered peer fetches
//! its group's shared state from the accepted peers while they go on training, and only then
//! awaits admission.
//!
//! ```text
//!  CatchUpStart ──▶ CatchingUp ──(the group's next sync ends: its members keep a copy, Snapshot)
//!    ──(every member answered SnapshotHeld)──▶ CatchUpPlan ──▶ the newcomer fetches, striped
//!    over the members that hold the copy ──▶ CatchUpEnd ──▶ Registered (peers_pending: true)
//! ```
//!
//! A peer whose `Join` said it will catch up is registered `CatchingUp` at once, so that no
//! vote admits it in the round trip before its `CatchUpStart`. A catching-up peer is not
//! pending: the accepted peers' `peers_pending` answers `false` for it, so they do not stop for
//! it. The members keep their copy while a newcomer of the group catches up, and drop it
//! (`Snapshot { round: 0 }`) once none does. A newcomer that dies costs nothing but its copy's
//! memory until then; a donor that dies is routed around by the newcomer.

use super::{Master, Status};
use shoal_wire::{GroupId, Member, Message, PeerId, PlanEntry, StateDigest};
use std::collections::{BTreeMap, BTreeSet};

/// A registered peer fetching its group's state.
#[derive(Debug, Clone)]
pub(super) struct Newcomer {
    /// Its tensors, sorted by name.
    entries: Vec<StateDigest>,
    /// Whether it was sent its plan.
    planned: bool,
    /// What it last reported: (bytes done, bytes in all, milliseconds left).
    pub(super) progress: Option<(u64, u64, u64)>,
}

/// The copy of a group's state its members keep for newcomers: the state sync `round` ended
/// with.
#[derive(Debug, Clone)]
pub(super) struct Snapshot {
    pub(super) round: u64,
    pub(super) revision: u64,
    hashes: BTreeMap<String, [u8; 32]>,
    /// Members asked to keep it.
    asked: BTreeSet<PeerId>,
    /// Members that answered, and those of them that hold it.
    answered: BTreeSet<PeerId>,
    pub(super) held: BTreeSet<PeerId>,
}

impl Master {
    /// `peer` asks to catch up with its group's state, described by `entries`.
    pub(super) fn catch_up_start(&mut self, peer: PeerId, entries: Vec<StateDigest>) {
        let entry = &self.peers[&peer];
        debug_assert!(
            !self.catching_up.contains_key(&peer) || entry.status == Status::CatchingUp,
            "{peer} half caught up"
        );
        let group = entry.group;
        let admitting =
            matches!(&self.g.phase, super::Phase::AwaitingConnections { members, .. } if members.contains(&peer));
        if entry.status == Status::Accepted || self.catching_up.contains_key(&peer) || admitting {
            // Admitted meanwhile (it joined without saying it would catch up, or the master
            // restarted), or asked twice: the sync after its admission repairs it.
            return self.send_plan(peer, None, String::new());
        }
        let Some(state) = self.group_states.get(&group).filter(|_| !self.g.ring.is_empty()) else {
            // Nobody holds a state to fetch: its first sync elects one.
            return self.send_plan(peer, None, String::new());
        };
        let ours: BTreeSet<&str> = entries.iter().filter(|e| !e.may_differ).map(|e| e.name.as_str()).collect();
        let run: BTreeSet<&str> = state.hashes.keys().map(String::as_str).collect();
        if ours != run {
            let name = |s: Option<&&str>| s.map_or("nothing".to_string(), |n| format!("{n:?}"));
            let reason = format!(
                "the shared state differs from group {}'s: the run has {} where {peer} has {}",
                group.0,
                name(run.difference(&ours).next()),
                name(ours.difference(&run).next())
            );
            return self.send_plan(peer, None, reason);
        }
        log::info!("{peer} catches up with group {}'s state (revision {} or later)", group.0, state.revision);
        self.peers.get_mut(&peer).expect("known").status = Status::CatchingUp;
        self.catching_up.insert(peer, Newcomer { entries, planned: false, progress: None });
        // A copy held already is fetched from at once; otherwise the group's next sync makes one.
        self.send_plans(group);
        assert_eq!(self.peers[&peer].status, Status::CatchingUp, "a newcomer catching up is not admitted meanwhile");
    }

    /// Before sync `round` of `group` completes for `participants` at `revision`: if a newcomer
    /// of the group waits for a copy of the state, they are asked to keep this one.
    pub(super) fn snapshot_at_sync(
        &mut self,
        group: GroupId,
        round: u64,
        revision: u64,
        hashes: &BTreeMap<String, [u8; 32]>,
        participants: &BTreeSet<PeerId>,
    ) {
        if self.snapshots.contains_key(&group) || !self.catching_up.keys().any(|p| self.peers[p].group == group) {
            return;
        }
        log::info!("group {}: its members keep the state of sync {round} (revision {revision}) for newcomers", group.0);
        let snapshot = Snapshot {
            round,
            revision,
            hashes: hashes.clone(),
            asked: participants.clone(),
            answered: BTreeSet::new(),
            held: BTreeSet::new(),
        };
        debug_assert!(participants.iter().all(|p| !self.catching_up.contains_key(p)), "a newcomer donates");
        self.snapshots.insert(group, snapshot);
        for p in participants {
            self.send_to_peer(*p, Message::Snapshot { round });
        }
        debug_assert!(self.snapshots.get(&group).is_some_and(|s| s.round == round), "the copy is kept");
    }

    /// `peer` keeps (or could not keep) the copy of sync `round`.
    pub(super) fn snapshot_held(&mut self, peer: PeerId, round: u64, held: bool) {
        let group = self.peers[&peer].group;
        let Some(s) = self.snapshots.get_mut(&group).filter(|s| s.round == round && s.asked.contains(&peer)) else {
            return; // A copy dropped meanwhile: the peer drops it too, at our `Snapshot { round: 0 }`.
        };
        s.answered.insert(peer);
        assert!(s.held.is_subset(&s.answered), "a member keeps a copy only once it answered");
        if held {
            s.held.insert(peer);
        } else {
            log::warn!("{peer} could not keep a copy of group {}'s state for newcomers", group.0);
        }
        self.send_plans(group);
        debug_assert!(
            self.snapshots.get(&group).is_some_and(|s| s.answered.contains(&peer)),
            "{peer}'s answer is kept"
        );
    }

    /// `peer` reports how far it is.
    pub(super) fn catch_up_progress(&mut self, peer: PeerId, done: u64, total: u64, eta_ms: u64) {
        if let Some(n) = self.catching_up.get_mut(&peer) {
            // The peer's word: bytes fetched again (a donor lost mid-piece) never show as more
            // than the whole.
            n.progress = Some((done.min(total), total, eta_ms));
        }
        debug_assert!(self.catching_up.values().all(|n| n.progress.is_none_or(|(d, t, _)| d <= t)));
    }

    /// `peer`'s catch-up ended: it awaits admission now.
    pub(super) fn catch_up_end(&mut self, peer: PeerId, fetched: bool, revision: u64) {
        // CatchingUp since its `Join` perhaps, with no plan asked for yet (it was refused one).
        if self.peers[&peer].status != Status::CatchingUp {
            return;
        }
        self.catching_up.remove(&peer);
        if fetched {
            log::info!("{peer} caught up with revision {revision}: it awaits admission");
        } else {
            log::info!("{peer} ends its catch-up without the state: the sync after its admission repairs it");
        }
        self.peers.get_mut(&peer).expect("known").status = Status::Registered;
        self.drop_unneeded_snapshots();
        self.admit_without_vote_if_alone();
        assert!(!self.catching_up.contains_key(&peer), "a catch-up that ended is over");
    }

    /// `peer`, of the focused group, left the run: it no longer catches up, nor donates.
    pub(super) fn catch_up_member_removed(&mut self, peer: PeerId) {
        debug_assert!(!self.peers.contains_key(&peer), "{peer} is removed while in the run");
        self.catching_up.remove(&peer);
        if let Some(s) = self.snapshots.get_mut(&self.focus) {
            s.asked.remove(&peer);
            s.held.remove(&peer);
            self.send_plans(self.focus);
        }
        self.drop_unneeded_snapshots();
        assert!(self.snapshots.values().all(|s| !s.held.contains(&peer)), "a removed member donates nothing");
    }

    /// The focused group has no member left (the last one left or was lost): nobody will sync
    /// again to make a copy, so a newcomer waiting for one goes on with nothing to fetch (and,
    /// pending then, is admitted alone; its state becomes the group's) instead of waiting out
    /// its timeout. A copy kept already is planned by [`Master::send_plans`] as members answer.
    pub(super) fn catch_ups_without_members(&mut self) {
        let group = self.focus;
        if self.snapshots.contains_key(&group) {
            return;
        }
        let waiting = self.unplanned(group);
        for p in waiting {
            log::info!("group {}: no member is left to make a copy of the state for {p}", group.0);
            self.catching_up.get_mut(&p).expect("listed").planned = true;
            self.send_plan(p, None, String::new());
        }
    }

    /// The newcomers of `group` catching up that were sent no plan yet.
    fn unplanned(&self, group: GroupId) -> Vec<PeerId> {
        let of_group = |(p, n): (&PeerId, &Newcomer)| (!n.planned && self.peers[p].group == group).then_some(*p);
        self.catching_up.iter().filter_map(of_group).collect()
    }

    /// Sends every newcomer of `group` not planned yet its plan, once every member asked to keep
    /// the group's copy has answered.
    fn send_plans(&mut self, group: GroupId) {
        let Some(s) = self.snapshots.get(&group) else { return };
        if !s.asked.iter().all(|p| s.answered.contains(p)) {
            return;
        }
        let waiting = self.unplanned(group);
        let s = s.clone();
        debug_assert!(s.held.is_subset(&s.asked), "only members asked keep a copy");
        for p in waiting {
            self.catching_up.get_mut(&p).expect("listed").planned = true;
            if s.held.is_empty() {
                // Nothing to fetch: the sync after its admission repairs it, as without a catch-up.
                log::warn!("no member of group {} keeps a copy of the state for {p} (SHOAL_CATCHUP_MEMORY)", group.0);
                self.send_plan(p, None, String::new());
            } else {
                self.send_plan(p, Some(&s), String::new());
            }
        }
        debug_assert!(
            self.catching_up.iter().all(|(p, n)| n.planned || self.peers[p].group != group),
            "a newcomer of group {} waits for a plan its copy allows",
            group.0
        );
    }

    /// Sends `peer` the plan to fetch `snapshot` (none: nothing to fetch), or `reason` for refusing.
    fn send_plan(&mut self, peer: PeerId, snapshot: Option<&Snapshot>, reason: String) {
        let Some(s) = snapshot.filter(|_| reason.is_empty()) else {
            let plan = Message::CatchUpPlan { round: 0, revision: 0, entries: Vec::new(), donors: Vec::new(), reason };
            return self.send_to_peer(peer, plan);
        };
        debug_assert!(s.held.is_subset(&s.answered), "a donor that never said it keeps a copy");
        let ids = self.dialable_donors(peer, &s.held.iter().copied().collect::<Vec<_>>());
        let entries = self.catching_up[&peer]
            .entries
            .iter()
            .map(|e| match s.hashes.get(&e.name).filter(|_| !e.may_differ) {
                Some(hash) => PlanEntry { hash: *hash, donors: ids.clone() },
                // Allowed to differ: the sync after its admission hands it a member's copy.
                None => PlanEntry { hash: [0; 32], donors: Vec::new() },
            })
            .collect();
        let donors = ids
            .iter()
            .map(|p| {
                let e = &self.peers[p];
                Member {
                    peer: *p,
                    group: e.group,
                    addr: e.addr.clone(),
                    site: None,
                    dialable: e.reach.dialable(),
                    seen: e.seen,
                }
            })
            .collect();
        assert!(!ids.is_empty() && s.round > 0, "a plan to fetch names a copy and who holds it");
        let plan = Message::CatchUpPlan { round: s.round, revision: s.revision, entries, donors, reason };
        self.send_to_peer(peer, plan);
    }

    /// Copies no newcomer needs any more are dropped.
    fn drop_unneeded_snapshots(&mut self) {
        debug_assert!(self.catching_up.keys().all(|p| self.peers.contains_key(p)), "a newcomer gone catches up");
        let needed: BTreeSet<GroupId> = self.catching_up.keys().map(|p| self.peers[p].group).collect();
        let unneeded: Vec<GroupId> = self.snapshots.keys().copied().filter(|g| !needed.contains(g)).collect();
        for g in unneeded {
            let s = self.snapshots.remove(&g).expect("listed");
            log::info!("group {}: no newcomer catches up; its members drop the copy of sync {}", g.0, s.round);
            for p in s.asked {
                self.send_to_peer(p, Message::Snapshot { round: 0 });
            }
        }
        debug_assert!(self.snapshots.keys().all(|g| needed.contains(g)), "a copy is kept only while needed");
    }
}
