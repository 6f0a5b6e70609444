//! The master's half of `sync_shared_state` (`docs/state.md`): a vote per group, the election
//! of every tensor, the plan each peer fetches by, and the end of the sync for everyone.
//!
//! A sync is a major operation of its group: every accepted member of the group votes with its
//! revision, strategy and tensor hashes. Once all have, the master elects and sends each a plan;
//! peers fetch what they lack from donors, peer to peer, and report `SyncDone`; when every
//! participant still in the run has, the master sends `SyncComplete` and remembers the group's
//! revision and hashes. A lost participant that others still need to fetch from is routed around
//! by the fetchers; one that cannot be routed around makes its fetcher report `SyncFailed`, and
//! the sync aborts for everyone (retryable).

use super::Master;
use crate::ballot::Ballot;
use shoal_wire::{GroupId, Message, PeerId, PlanEntry, Reason, StateDigest};
use std::collections::{BTreeMap, BTreeSet};

/// How a peer takes part in a sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Votes with its state; the most popular state wins and it is repaired if outvoted.
    EnforcePopular = 1,
    /// Authoritative: its state wins; it never receives.
    SendOnly = 2,
    /// Never votes or sends; takes the elected state.
    ReceiveOnly = 3,
}

impl Strategy {
    /// The strategy of a wire code.
    pub fn from_code(code: u8) -> Option<Self> {
        [Strategy::EnforcePopular, Strategy::SendOnly, Strategy::ReceiveOnly].into_iter().find(|s| *s as u8 == code)
    }
}

#[derive(Debug, Clone)]
struct Vote {
    revision: u64,
    strategy: Strategy,
    override_resume: bool,
    entries: Vec<StateDigest>,
}

/// A sync in progress in one group.
#[derive(Debug)]
pub(super) struct SyncRound {
    round: u64,
    ballot: Ballot,
    votes: BTreeMap<PeerId, Vote>,
    /// Set once the plan went out: who takes part, and who has finished.
    transfer: Option<Transfer>,
}

impl SyncRound {
    /// The ballot, while the sync is still voting (no plan sent yet).
    pub(super) fn voting(&self) -> Option<&Ballot> {
        self.transfer.is_none().then_some(&self.ballot)
    }

    /// Its number.
    pub(super) fn round(&self) -> u64 {
        self.round
    }
}

#[derive(Debug)]
struct Transfer {
    revision: u64,
    hashes: BTreeMap<String, [u8; 32]>,
    participants: BTreeSet<PeerId>,
    done: BTreeSet<PeerId>,
}

/// What the master remembers of a group's last completed sync: the resume rule needs it.
#[derive(Debug, Clone)]
pub(super) struct GroupState {
    pub(super) revision: u64,
    pub(super) hashes: BTreeMap<String, [u8; 32]>,
    /// Peers that took part in a completed sync: they are not newcomers.
    pub(super) synced: BTreeSet<PeerId>,
}

impl GroupState {
    pub(super) fn revision(&self) -> u64 {
        self.revision
    }

    pub(super) fn hashes(&self) -> &BTreeMap<String, [u8; 32]> {
        &self.hashes
    }
}

impl Master {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sync_vote(
        &mut self,
        now: std::time::Instant,
        peer: PeerId,
        revision: u64,
        strategy: u8,
        override_resume: bool,
        entries: Vec<StateDigest>,
        collectives: u64,
    ) {
        debug_assert!(self.accepted(peer), "{peer} is a newcomer");
        let Some(strategy) = Strategy::from_code(strategy) else {
            return self.violation(peer, super::PeerMisbehaved::UnknownStrategy { code: strategy });
        };
        if let super::Phase::AwaitingConnections { epoch, .. } = self.g.phase {
            // A call that crossed a topology issued meanwhile (a member was lost): retryable, and
            // the retry joins that topology first.
            let reason = format!("topology {} was being connected when {peer} called sync_shared_state", epoch.0);
            let reason = Reason::text(reason);
            return self.send_to_peer(peer, Message::SyncAborted { round: 0, retryable: true, reason });
        }
        if !self.admit_vote(now, peer, shoal_wire::Vote::SyncSharedState, collectives) {
            return;
        }
        let group = self.peers[&peer].group;
        if !self.syncs.contains_key(&group) {
            self.next_sync += 1;
            let electorate = self.g.ring.iter().copied().collect();
            let round = SyncRound {
                round: self.next_sync,
                ballot: Ballot::new(electorate),
                votes: BTreeMap::new(),
                transfer: None,
            };
            self.syncs.insert(group, round);
        }
        let sync = self.syncs.get_mut(&group).expect("inserted above");
        if sync.transfer.is_some() || sync.votes.contains_key(&peer) || !sync.ballot.is_eligible(peer) {
            return self.violation(peer, super::PeerMisbehaved::SyncVoteOutsideVoting);
        }
        let fewer = sync.ballot.announce(group, collectives);
        sync.ballot.cast(peer);
        sync.votes.insert(peer, Vote { revision, strategy, override_resume, entries });
        assert!(sync.votes.keys().all(|v| sync.ballot.is_eligible(*v)), "a sync vote from outside its electorate");
        if fewer {
            self.announce_vote(peer, shoal_wire::Vote::SyncSharedState, collectives);
        }
        self.tally_sync(group);
        debug_assert!(
            self.syncs.get(&group).is_none_or(|s| s.votes.contains_key(&peer) || s.transfer.is_some()),
            "{peer}'s sync vote is lost"
        );
    }

    pub(super) fn sync_done(&mut self, peer: PeerId, round: u64) {
        let group = self.peers[&peer].group;
        let Some(sync) = self.syncs.get_mut(&group).filter(|s| s.round == round) else { return };
        if let Some(t) = &mut sync.transfer {
            t.done.insert(peer);
        }
        self.settle_sync(group);
        debug_assert!(self.syncs.get(&group).is_none_or(|s| s.round >= round), "a sync's round moves forward");
        debug_assert!(
            self.syncs.contains_key(&group) || self.group_states.contains_key(&group),
            "a completed sync left no state"
        );
    }

    pub(super) fn sync_failed(&mut self, peer: PeerId, round: u64, reason: String) {
        let group = self.peers[&peer].group;
        if self.syncs.get(&group).is_some_and(|s| s.round == round) {
            self.abort_sync(group, true, Reason::text(format!("{peer} could not complete the sync: {reason}")));
        }
        debug_assert!(self.syncs.get(&group).is_none_or(|s| s.round != round), "a failed round is over");
    }

    /// A member of the focused group left: it no longer votes, and nobody waits for it to finish.
    pub(super) fn sync_member_removed(&mut self, peer: PeerId) {
        debug_assert!(!self.peers.contains_key(&peer), "{peer} leaves the syncs while in the run");
        let group = self.focus;
        if let Some(sync) = self.syncs.get_mut(&group) {
            sync.ballot.remove(peer);
            sync.votes.remove(&peer);
            if let Some(t) = &mut sync.transfer {
                t.participants.remove(&peer);
            }
            if sync.transfer.is_some() {
                self.settle_sync(group);
            } else {
                self.tally_sync(group);
            }
        }
        assert!(
            self.syncs.values().all(|s| !s.votes.contains_key(&peer) && !s.ballot.is_eligible(peer)),
            "a removed member still counts in a sync"
        );
    }

    /// Ends the sync of `group` (the focused one), if one is open, with an error for its voters.
    pub(super) fn abort_sync(&mut self, group: GroupId, retryable: bool, reason: Reason) {
        debug_assert_eq!(group, self.focus, "a sync is aborted by an input of its group");
        let Some(sync) = self.syncs.remove(&group) else { return };
        debug_assert!(sync.ballot.voters().iter().eq(sync.votes.keys()), "a sync's ballot counts a vote it never got");
        self.counters.syncs_aborted += 1;
        log::warn!("sync {} aborted: {reason}", sync.round);
        // While voting, every member of the group hears of it: the vote was announced to them.
        let voters: Vec<PeerId> = match &sync.transfer {
            Some(t) => t.participants.iter().copied().collect(),
            None => self.g.ring.clone(),
        };
        for p in voters {
            self.send_to_peer(p, Message::SyncAborted { round: sync.round, retryable, reason: reason.clone() });
        }
        assert!(!self.syncs.contains_key(&group), "an aborted sync is over");
    }

    fn tally_sync(&mut self, group: GroupId) {
        let Some(sync) = self.syncs.get(&group) else { return };
        if sync.transfer.is_some() {
            return;
        }
        if sync.ballot.is_empty() {
            self.syncs.remove(&group);
            return;
        }
        if sync.ballot.tally().is_none() {
            return;
        }
        let votes = sync.votes.clone();
        let round = sync.round;
        assert_eq!(votes.len(), sync.ballot.voters().len(), "a tallied sync has a vote from every voter");
        match self.elect(group, &votes) {
            Ok((revision, hashes, plans)) => {
                let participants: BTreeSet<PeerId> = votes.keys().copied().collect();
                assert!(plans.iter().map(|(p, _)| p).eq(participants.iter()), "every voter gets a plan, once");
                self.g.sent_on.retain(|p| !participants.contains(p));
                let sync = self.syncs.get_mut(&group).expect("present");
                sync.transfer = Some(Transfer { revision, hashes, participants, done: BTreeSet::new() });
                log::info!("sync {round} of group {}: revision {revision}, {} peers", group.0, votes.len());
                for (p, entries) in plans {
                    self.send_to_peer(p, Message::SyncPlan { round, revision, entries });
                }
            }
            Err(reason) => self.abort_sync(group, false, Reason::text(reason)),
        }
    }

    fn settle_sync(&mut self, group: GroupId) {
        let Some(sync) = self.syncs.get(&group) else { return };
        let Some(t) = &sync.transfer else { return };
        if !t.participants.iter().all(|p| t.done.contains(p)) {
            return;
        }
        let sync = self.syncs.remove(&group).expect("present");
        self.counters.syncs_completed += 1;
        let t = sync.transfer.expect("checked");
        // The state only moves forward: a sync elects the newest revision its voters hold.
        let before = self.group_states.get(&group).map(GroupState::revision);
        let overridden = sync.votes.values().any(|v| v.override_resume);
        assert!(before.is_none_or(|r| t.revision >= r) || overridden, "sync {} went back", sync.round);
        let state = self.group_states.entry(group).or_insert_with(|| GroupState {
            revision: t.revision,
            hashes: BTreeMap::new(),
            synced: BTreeSet::new(),
        });
        state.revision = t.revision;
        state.hashes = t.hashes.clone();
        state.synced.extend(t.participants.iter().copied());
        self.touch();
        // Asked before SyncComplete, so that each member copies the state it completes with.
        self.snapshot_at_sync(group, sync.round, t.revision, &t.hashes, &t.participants);
        for p in t.participants {
            self.send_to_peer(p, Message::SyncComplete { round: sync.round });
        }
        assert!(!self.syncs.contains_key(&group), "a completed sync stays open");
    }

    /// The election: the revision, the elected hash of every tensor, and each voter's plan; or
    /// why the votes cannot be reconciled (a usage error: calling again will not help).
    #[allow(clippy::type_complexity)]
    fn elect(
        &self,
        group: GroupId,
        votes: &BTreeMap<PeerId, Vote>,
    ) -> Result<(u64, BTreeMap<String, [u8; 32]>, Vec<(PeerId, Vec<PlanEntry>)>), String> {
        let (first, first_vote) = votes.iter().next().expect("a tallied ballot has voters");
        // Every voter must describe the same tensors.
        let layout = |v: &Vote| -> Vec<(String, u8, Vec<u64>, bool)> {
            v.entries.iter().map(|e| (e.name.clone(), e.dtype, e.shape.clone(), e.may_differ)).collect()
        };
        for (p, v) in votes {
            if layout(v) != layout(first_vote) {
                return Err(describe_layout_difference(*first, first_vote, *p, v));
            }
        }
        let providers: Vec<(PeerId, &Vote)> =
            votes.iter().filter(|(_, v)| v.strategy != Strategy::ReceiveOnly).map(|(p, v)| (*p, v)).collect();
        if providers.is_empty() {
            return Err("every peer called sync_shared_state with receive_only: nobody provides the state".into());
        }
        let previous = self.group_states.get(&group);
        let override_resume = votes.values().any(|v| v.override_resume);
        let resuming = previous.is_some_and(|s| !override_resume && votes.keys().all(|p| !s.synced.contains(p)));
        let max_revision = providers.iter().map(|(_, v)| v.revision).max().expect("not empty");
        // A sync moves the run one revision on; when every provider claims the run's current
        // revision it re-checks that one instead (a step retried after a failure).
        let expected = match previous {
            Some(s) if resuming => s.revision,
            Some(s) if !override_resume => s.revision + u64::from(max_revision > s.revision),
            _ => max_revision,
        };
        if let Some((p, v)) = providers.iter().find(|(_, v)| v.revision > expected) {
            return Err(format!(
                "{p} claims revision {} but the run is at revision {}: a sync advances it by exactly one",
                v.revision,
                expected.saturating_sub(1)
            ));
        }
        if let Some((p, v)) = providers.iter().find(|(_, v)| v.strategy == Strategy::SendOnly && v.revision != expected)
        {
            return Err(format!(
                "{p} is send_only at revision {} but the sync is at revision {expected}: a send_only peer never receives",
                v.revision
            ));
        }
        let mut candidates: Vec<(PeerId, &Vote)> =
            providers.iter().filter(|(_, v)| v.revision == expected).copied().collect();
        if resuming {
            // Every peer left and peers came back: only the state the run last agreed on is
            // accepted, so a restart cannot silently roll training back or forward.
            let s = previous.expect("resuming implies a previous state");
            candidates
                .retain(|(_, v)| v.entries.iter().all(|e| e.may_differ || s.hashes.get(&e.name) == Some(&e.hash)));
            if candidates.is_empty() {
                return Err(format!(
                    "no peer holds the state the run last agreed on (revision {}): pass override_resume=True to \
                     start from another",
                    s.revision
                ));
            }
        }
        if candidates.is_empty() {
            return Err(format!("no peer that provides state is at revision {expected}"));
        }
        let synced = |p: &PeerId| previous.is_some_and(|s| s.synced.contains(p));
        let mut hashes = BTreeMap::new();
        let mut plans: BTreeMap<PeerId, Vec<PlanEntry>> = votes.keys().map(|p| (*p, Vec::new())).collect();
        for (i, entry) in first_vote.entries.iter().enumerate() {
            let (winner, donors, receivers): ([u8; 32], Vec<PeerId>, BTreeSet<PeerId>) = if entry.may_differ {
                // Never repaired among accepted peers; a newcomer takes a synced peer's copy.
                let donor = candidates.iter().find(|(p, _)| synced(p));
                match donor {
                    Some((d, v)) => {
                        let hash = v.entries[i].hash;
                        let receivers = votes
                            .iter()
                            .filter(|(p, w)| !synced(p) && w.entries[i].hash != hash)
                            .map(|(p, _)| *p)
                            .collect();
                        (hash, vec![*d], receivers)
                    }
                    None => ([0; 32], Vec::new(), BTreeSet::new()),
                }
            } else {
                let send_only: BTreeSet<[u8; 32]> = candidates
                    .iter()
                    .filter(|(_, v)| v.strategy == Strategy::SendOnly)
                    .map(|(_, v)| v.entries[i].hash)
                    .collect();
                let winner = match send_only.len() {
                    0 => popular(candidates.iter().map(|(_, v)| v.entries[i].hash)),
                    1 => *send_only.iter().next().expect("one"),
                    _ => return Err(format!("send_only peers disagree on tensor {:?}", entry.name)),
                };
                let donors = candidates.iter().filter(|(_, v)| v.entries[i].hash == winner).map(|(p, _)| *p).collect();
                let receivers = votes.iter().filter(|(_, v)| v.entries[i].hash != winner).map(|(p, _)| *p).collect();
                hashes.insert(entry.name.clone(), winner);
                (winner, donors, receivers)
            };
            for (p, plan) in &mut plans {
                let receives = receivers.contains(p);
                let hash = if receives { winner } else { votes[p].entries[i].hash };
                let donors = if receives { self.dialable_donors(*p, &donors) } else { Vec::new() };
                plan.push(PlanEntry { hash, donors });
            }
        }
        let entries = first_vote.entries.len();
        assert!(plans.values().all(|plan| plan.len() == entries), "a plan has an entry per tensor");
        assert!(hashes.len() <= entries, "an elected hash per tensor at most");
        Ok((expected, hashes, plans.into_iter().collect()))
    }
}

/// The most frequent hash; ties go to the smallest, so every master elects the same.
fn popular(hashes: impl Iterator<Item = [u8; 32]>) -> [u8; 32] {
    let mut counts: BTreeMap<[u8; 32], usize> = BTreeMap::new();
    for h in hashes {
        *counts.entry(h).or_default() += 1;
    }
    let best = counts.values().copied().max().expect("at least one candidate");
    let (winner, _) = counts.iter().find(|(_, c)| **c == best).expect("the maximum exists");
    debug_assert!(counts.iter().all(|(h, c)| c < &best || h >= winner), "ties go to the smallest hash");
    *winner
}

fn describe_layout_difference(a: PeerId, va: &Vote, b: PeerId, vb: &Vote) -> String {
    debug_assert!(a != b && va.entries != vb.entries, "{a}'s layout differs from itself");
    let show = |e: &StateDigest| {
        format!(
            "{:?} (dtype {}, shape {:?}{})",
            e.name,
            e.dtype,
            e.shape,
            if e.may_differ { ", may differ" } else { "" }
        )
    };
    for i in 0..va.entries.len().max(vb.entries.len()) {
        match (va.entries.get(i), vb.entries.get(i)) {
            (Some(x), Some(y)) if show(x) == show(y) => continue,
            (x, y) => {
                let x = x.map_or("nothing".into(), show);
                let y = y.map_or("nothing".into(), show);
                return format!("shared states differ: {a} has {x} where {b} has {y}");
            }
        }
    }
    "shared states differ".into()
}
