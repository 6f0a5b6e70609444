//! Calls that cannot complete together (`docs/protocol.md`, "No call waits for a call that will
//! never come").
//!
//! The master sees the votes: `update_topology`, `peers_pending` and `sync_shared_state`. A peer
//! is in one call at a time, so a vote that waits for a peer which is in another vote, whose
//! ballot in turn waits for this voter, can never pass: both end at once with a usage error that
//! names who called what. A collective is invisible to the master, so every vote is announced to
//! the voter's group with the number of collectives the voter had started (`VoteOpened`): a
//! member running a later one knows the voter will never join it, gives it up (`OpFailed` with
//! `Misuse`), and the master then abandons the votes of that group.
//!
//! One combination is not a mistake: a peer admitted by the last vote whose first call is
//! `peers_pending` may be at the top of a loop iteration the others already passed (PCCL's loop:
//! `peers_pending`, `update_topology`, then the sync and collectives), or the others may be about
//! to ask too (`connect(min_world_size=...)`'s loop). The master cannot tell which, so that vote
//! is cast *tentatively*: not announced, it passes if the others join it; it is answered `false`
//! (sending the newcomer on to the others' call) as soon as a member votes another call that the
//! ballot waits for, or after a heartbeat interval (the others may be in a collective, which the
//! master does not see). A newcomer sent on that way may find the others gone back to the top of
//! their loop (their iteration failed, which it never saw): when its next vote and theirs cannot
//! complete together, the newcomer's side is refused *retryably*, once, and its loop meets them.
//!
//! A member may reach the point of a mismatch only after it was settled: peer 0 calls
//! `update_topology`, peer 1 `sync_shared_state` (both end with a usage error), then peer 2 calls
//! `sync_shared_state` too. Its vote waits for peers that are in no call, and would wait for its
//! whole bound. So the master remembers each member's last vote and whether it ended as a
//! mismatch ([`LastVote`]); a member that has no such vote of its own and votes at the same point
//! (the same topology, as many collectives started) can never meet it, and ends at once too: in
//! another call, or in the same one where a third member's transfer or collective ended it. A
//! member whose own vote ended that way is not held to it: its next call is its own choice.

use super::{heartbeat_interval, Master, Phase, Timer};
use shoal_wire::{Call, Called, Epoch, GroupId, Message, Misuse, PeerId, Point, Vote};
use std::collections::BTreeSet;
use std::time::Instant;

/// A member's last vote: the call, and the point among its calls at which it was made (the
/// committed topology, and the collectives it had started in it). Members that make the same calls
/// in the same order vote the same call at the same point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LastVote {
    vote: Vote,
    epoch: Epoch,
    collectives: u64,
    /// It ended with a usage error, as one of calls that can never complete together.
    mismatched: bool,
}

impl Master {
    /// Checks the vote of `peer` in `vote`, having started `collectives` collectives of the
    /// committed topology, against the calls its group is in. False when the vote must not be
    /// cast: it was answered or abandoned here.
    pub(super) fn admit_vote(&mut self, now: Instant, peer: PeerId, vote: Vote, collectives: u64) -> bool {
        let at = LastVote { vote, epoch: self.g.ring_epoch, collectives, mismatched: false };
        let entry = self.peers.get_mut(&peer).expect("votes come from known peers");
        let (group, fresh) = (entry.group, std::mem::take(&mut entry.fresh));
        let settled = entry.last_vote.replace(at).is_some_and(|last| last.mismatched);
        if vote == Vote::PeersPending && fresh && collectives == 0 {
            if self.vote_awaiting(peer, vote).is_some() {
                log::debug!("{peer}'s first call since its admission is peers_pending, the others vote another");
                self.send_to_peer(peer, Message::PeersPendingResult { pending: false });
                self.g.sent_on.insert(peer);
                return false;
            }
            let at = now + heartbeat_interval(self.config.heartbeat_timeout);
            self.g.tentative.insert(peer, at);
            self.arm_tentative_votes();
            return true;
        }
        if vote != Vote::PeersPending {
            self.release_tentative_votes_awaiting(peer);
        }
        while let Some((other, voters)) = self.vote_awaiting(peer, vote) {
            let misuse =
                Misuse::new(Called::new([peer], Call::api(vote)), Called::new(voters.clone(), Call::api(other)));
            if self.g.sent_on.remove(&peer) {
                // A newcomer sent on to a call the others have left: it goes back to meet them.
                log::debug!("{misuse}: {peer} was sent on as a newcomer, and tries again");
                self.refuse(peer, vote, misuse, true);
                return false;
            }
            if voters.iter().all(|v| self.g.sent_on.contains(v)) {
                // The newcomers wait in a call the others have left: they try again, this vote counts.
                log::debug!("{misuse}: the newcomers sent on try again");
                self.g.sent_on.retain(|v| !voters.contains(v));
                self.withdraw(other, group, &misuse, true);
                continue;
            }
            log::warn!("{misuse}");
            self.abandon_votes(group, &misuse);
            self.refuse(peer, vote, misuse, false);
            return false;
        }
        debug_assert!(self.vote_awaiting(peer, vote).is_none(), "a vote cast while another waits for its voter");
        if settled {
            return true;
        }
        if let Some((other, voters)) = self.mismatch_at(peer, at) {
            let point = Some(Point { epoch: at.epoch, collectives });
            let misuse = Misuse::settled(
                Called::new([peer], Call::Api { api: vote.into(), at: point }),
                Called::new(voters, Call::Api { api: other.into(), at: point }),
            );
            log::warn!("{misuse}");
            self.refuse(peer, vote, misuse, false);
            return false;
        }
        debug_assert!(
            self.peers[&peer].last_vote.is_some_and(|l| l.vote == vote && l.collectives == collectives),
            "an admitted vote is {peer}'s last"
        );
        true
    }

    /// Tells the other members of `peer`'s group that it waits in `vote` having started
    /// `collectives` collectives: its ballot found that fewer than announced so far
    /// ([`crate::ballot::Ballot::announce`]).
    pub(super) fn announce_vote(&mut self, peer: PeerId, vote: Vote, collectives: u64) {
        let epoch = self.g.ring_epoch;
        debug_assert_eq!(self.peers[&peer].last_vote.map(|l| (l.vote, l.collectives)), Some((vote, collectives)));
        debug_assert!(self.g.ring.contains(&peer), "{peer} announces a vote outside the ring");
        let others: Vec<PeerId> = self.g.ring.iter().copied().filter(|p| *p != peer).collect();
        for p in others {
            self.send_to_peer(p, Message::VoteOpened { vote, epoch, voter: peer, collectives });
        }
    }

    /// Answers `false` to the tentative `peers_pending` votes whose time is up.
    pub(super) fn answer_tentative_votes(&mut self, now: Instant) {
        let due: Vec<PeerId> = self.g.tentative.iter().filter(|(_, at)| **at <= now).map(|(p, _)| *p).collect();
        self.release_tentative(&due);
        self.arm_tentative_votes();
        assert!(self.g.tentative.values().all(|at| *at > now), "a tentative vote past its time is answered");
    }

    /// `member` votes another call: a ballot of tentative newcomers' votes that waits for it
    /// can never pass, and its newcomers go on to the call the others are in.
    fn release_tentative_votes_awaiting(&mut self, member: PeerId) {
        let Some(ballot) = &self.g.pending_vote else { return };
        if ballot.awaits(member) && ballot.voters().iter().all(|p| self.g.tentative.contains_key(p)) {
            let voters: Vec<PeerId> = ballot.voters().iter().copied().collect();
            self.release_tentative(&voters);
        }
        // No tentative ballot is left waiting for a member that votes another call.
        debug_assert!(self
            .g
            .pending_vote
            .as_ref()
            .is_none_or(|b| !b.awaits(member) || !b.voters().iter().all(|p| self.g.tentative.contains_key(p))));
    }

    fn release_tentative(&mut self, peers: &[PeerId]) {
        for p in peers {
            self.g.tentative.remove(p);
            self.g.sent_on.insert(*p);
            if let Some(ballot) = &mut self.g.pending_vote {
                ballot.uncast(*p);
                log::debug!("{p}'s first peers_pending since its admission: false");
                self.send_to_peer(*p, Message::PeersPendingResult { pending: false });
            }
        }
        if self.g.pending_vote.as_ref().is_some_and(|b| b.voters().is_empty()) {
            self.g.pending_vote = None;
        }
        // They call the others' collective next: one with a deadline counts it from now.
        let now = self.now;
        self.restart_gathers(now);
        assert!(peers.iter().all(|p| !self.g.tentative.contains_key(p)), "a released vote is no longer tentative");
        assert!(
            self.g.pending_vote.as_ref().is_none_or(|b| peers.iter().all(|p| !b.voters().contains(p))),
            "a released tentative vote is taken back"
        );
    }

    fn arm_tentative_votes(&mut self) {
        match self.g.tentative.values().min() {
            Some(at) => self.timers.set(Timer::TentativeVotes(self.focus), *at),
            None => self.timers.clear(Timer::TentativeVotes(self.focus)),
        }
        debug_assert!(
            self.g.tentative.is_empty() || self.timers.next_deadline().is_some(),
            "a tentative vote waits on"
        );
    }

    /// A member of `group` gave up a collective because others wait in a vote, or two votes wait
    /// for each other: every open vote the group's members are in ends with `reason`. Every
    /// member hears of it, voter or not, so that none keeps the announcement of a dead vote.
    pub(super) fn abandon_votes(&mut self, group: GroupId, misuse: &Misuse) {
        for vote in [Vote::UpdateTopology, Vote::PeersPending, Vote::SyncSharedState] {
            self.withdraw(vote, group, misuse, false);
        }
        assert!(
            [Vote::UpdateTopology, Vote::PeersPending, Vote::SyncSharedState]
                .into_iter()
                .all(|v| self.open_ballot(v, group).is_none()),
            "an abandoned vote is closed"
        );
    }

    /// Ends the open ballot of `vote` (of `group`, for a sync), if any: its voters' calls fail,
    /// or (`retry`) vote again. Every member hears of a vote that failed, voter or not (one
    /// about to make that call learns that the calls at its point ended apart); only its voters
    /// hear that they vote again: a member whose own vote crossed the message would take it for
    /// its own, and vote twice in one call.
    fn withdraw(&mut self, vote: Vote, group: GroupId, misuse: &Misuse, retry: bool) {
        let voters = self.open_ballot(vote, group).map(|b| b.voters().clone()).unwrap_or_default();
        if !retry {
            for p in &voters {
                self.mark_mismatched(*p, vote);
            }
        }
        debug_assert!(
            retry
                || voters.iter().all(|p| self.peers.get(p).is_some_and(|e| e.last_vote.is_some_and(|l| l.mismatched))),
            "a voter of a vote that ended apart may wait at its point"
        );
        let told: Vec<PeerId> = if retry { voters.into_iter().collect() } else { self.g.ring.clone() };
        match vote {
            Vote::UpdateTopology if matches!(self.g.phase, Phase::AwaitingTopologyVotes { .. }) => {
                log::warn!("update_topology vote ended: {misuse}");
                for p in told {
                    self.send_to_peer(p, Message::TopologyVoteAborted { retry, reason: misuse.clone().into() });
                }
                self.set_phase(Phase::Idle);
            }
            Vote::PeersPending if self.g.pending_vote.is_some() => {
                self.g.pending_vote = None;
                self.g.tentative.clear();
                log::warn!("peers_pending vote ended: {misuse}");
                for p in told {
                    self.send_to_peer(p, Message::PeersPendingAborted { retry, reason: misuse.clone().into() });
                }
            }
            Vote::SyncSharedState if self.syncs.get(&group).is_some_and(|s| s.voting().is_some()) => {
                self.abort_sync(group, retry, misuse.clone().into());
            }
            _ => {}
        }
        debug_assert!(self.open_ballot(vote, group).is_none(), "a withdrawn {} vote is closed", vote.call());
    }

    /// An open vote of another kind than `vote` that has votes and waits for `peer`, which is
    /// in `vote`: (its kind, its voters).
    fn vote_awaiting(&self, peer: PeerId, vote: Vote) -> Option<(Vote, BTreeSet<PeerId>)> {
        debug_assert!(self.accepted(peer), "{peer} votes unaccepted");
        let group = self.peers[&peer].group;
        let awaiting = [Vote::UpdateTopology, Vote::PeersPending, Vote::SyncSharedState]
            .into_iter()
            .filter(|kind| *kind != vote)
            .filter_map(|kind| Some((kind, self.open_ballot(kind, group)?)))
            .find(|(_, ballot)| ballot.awaits(peer))
            .map(|(kind, ballot)| (kind, ballot.voters().clone()));
        debug_assert!(
            awaiting.as_ref().is_none_or(|(kind, voters)| *kind != vote && !voters.contains(&peer)),
            "a ballot that awaits {peer} holds no vote of its"
        );
        awaiting
    }

    /// The ballot of `vote` open for `group`'s members, if any.
    fn open_ballot(&self, vote: Vote, group: GroupId) -> Option<&crate::ballot::Ballot> {
        match vote {
            Vote::UpdateTopology => match &self.g.phase {
                Phase::AwaitingTopologyVotes { ballot } => Some(ballot),
                _ => None,
            },
            Vote::PeersPending => self.g.pending_vote.as_ref(),
            Vote::SyncSharedState => self.syncs.get(&group).and_then(|s| s.voting()),
        }
    }

    /// Other members of `peer`'s group whose vote at the point `at` (of `peer`'s vote) ended as a
    /// mismatch: (their call, the members that made it). Another call than `peer`'s names the
    /// mismatch best; failing one, the same call, whose ballot ended there (a transfer or a
    /// collective of a third member's could never meet it): its voters are in no call now.
    fn mismatch_at(&self, peer: PeerId, at: LastVote) -> Option<(Vote, BTreeSet<PeerId>)> {
        debug_assert!(at.epoch == self.g.ring_epoch, "a vote at {:?} judged in {:?}", at.epoch, self.g.ring_epoch);
        let group = self.peers[&peer].group;
        let apart = || {
            self.peers.iter().filter(|(p, _)| **p != peer).filter_map(move |(p, e)| {
                let l = e.last_vote?;
                let here = l.mismatched && e.group == group && (l.epoch, l.collectives) == (at.epoch, at.collectives);
                here.then_some((*p, l.vote))
            })
        };
        let other = apart().map(|(_, v)| v).find(|v| *v != at.vote).or_else(|| apart().next().map(|(_, v)| v))?;
        let voters: BTreeSet<PeerId> = apart().filter(|(_, v)| *v == other).map(|(p, _)| p).collect();
        assert!(!voters.is_empty() && !voters.contains(&peer), "a mismatch names others' calls");
        Some((other, voters))
    }

    /// `peer`'s vote in `vote` ended as one of calls that cannot complete together.
    fn mark_mismatched(&mut self, peer: PeerId, vote: Vote) {
        // A peer is in one vote at a time: the last it cast is the one that ended.
        let last = self.peers.get_mut(&peer).and_then(|e| e.last_vote.as_mut()).filter(|l| l.vote == vote);
        debug_assert!(last.is_some(), "{peer}'s last vote is not the {} that ended", vote.call());
        if let Some(last) = last {
            last.mismatched = true;
        }
    }

    /// Ends `peer`'s call `vote` without casting it: with a usage error, or (`retry`) for it to
    /// try again.
    fn refuse(&mut self, peer: PeerId, vote: Vote, misuse: Misuse, retry: bool) {
        assert!(misuse.ours.peers == [peer], "{peer} is refused for its own call: {misuse}");
        if !retry {
            self.mark_mismatched(peer, vote);
        }
        let message = match vote {
            Vote::UpdateTopology => Message::TopologyVoteAborted { retry, reason: misuse.into() },
            Vote::PeersPending => Message::PeersPendingAborted { retry, reason: misuse.into() },
            Vote::SyncSharedState => Message::SyncAborted { round: 0, retryable: retry, reason: misuse.into() },
        };
        self.send_to_peer(peer, message);
        // Refused, never cast: no ballot counts it.
        debug_assert!(self.open_ballot(vote, self.peers[&peer].group).is_none_or(|b| !b.voters().contains(&peer)));
    }
}
