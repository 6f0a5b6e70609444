//! Votes as values.
//!
//! A [`Ballot`] holds the set of peers eligible to vote and the votes cast. A vote passes when
//! every eligible peer has voted. When a peer is lost it leaves `eligible` and the tally runs
//! again, so a crash never stalls a vote. Only [`Ballot::tally`] creates a [`Quorum`], and the
//! transitions that need consensus take one.

use shoal_wire::{GroupId, PeerId};
use std::collections::{BTreeMap, BTreeSet};

/// An open vote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ballot {
    eligible: BTreeSet<PeerId>,
    cast: BTreeSet<PeerId>,
    /// Per group, the fewest collectives a voter had started, as announced to the group's
    /// members (`VoteOpened`): a later voter with as many needs no announcement.
    announced: BTreeMap<GroupId, u64>,
}

/// Proof that a ballot passed: every eligible peer voted. Only [`Ballot::tally`] makes one.
#[derive(Debug, PartialEq, Eq)]
pub struct Quorum {
    voters: BTreeSet<PeerId>,
}

impl Quorum {
    /// The peers whose votes made the quorum.
    pub fn voters(&self) -> &BTreeSet<PeerId> {
        &self.voters
    }
}

impl Ballot {
    /// A ballot among `eligible`.
    pub fn new(eligible: BTreeSet<PeerId>) -> Self {
        Ballot { eligible, cast: BTreeSet::new(), announced: BTreeMap::new() }
    }

    /// Records `peer`'s vote. A peer outside `eligible` (accepted after the ballot opened) joins
    /// it: it is a member now and its vote must count.
    pub fn cast(&mut self, peer: PeerId) {
        self.eligible.insert(peer);
        self.cast.insert(peer);
        debug_assert!(!self.awaits(peer), "{peer} voted, yet the ballot waits for it");
    }

    /// Removes a lost peer from the electorate (and its vote, if cast).
    pub fn remove(&mut self, peer: PeerId) {
        self.eligible.remove(&peer);
        self.cast.remove(&peer);
        assert!(!self.awaits(peer) && !self.cast.contains(&peer), "a removed peer still counts");
    }

    /// Whether `peer` may vote in this ballot.
    pub fn is_eligible(&self, peer: PeerId) -> bool {
        self.eligible.contains(&peer)
    }

    /// Takes back `peer`'s vote; it stays eligible.
    pub fn uncast(&mut self, peer: PeerId) {
        self.cast.remove(&peer);
        debug_assert!(self.cast.is_subset(&self.eligible) && !self.cast.contains(&peer));
    }

    /// Whether the ballot has votes and still waits for `peer`'s: then `peer` is in another call.
    pub fn awaits(&self, peer: PeerId) -> bool {
        !self.cast.is_empty() && self.eligible.contains(&peer) && !self.cast.contains(&peer)
    }

    /// The peers that voted so far.
    pub fn voters(&self) -> &BTreeSet<PeerId> {
        &self.cast
    }

    /// Records that a voter of `group` had started `collectives`; true if that is fewer than
    /// announced to the group so far, and so must be announced.
    pub fn announce(&mut self, group: GroupId, collectives: u64) -> bool {
        let least = self.announced.entry(group).or_insert(u64::MAX);
        let fewer = collectives < *least;
        *least = (*least).min(collectives);
        debug_assert!(self.announced[&group] <= collectives, "the least announced is kept");
        fewer
    }

    /// Whether nobody is left to vote.
    pub fn is_empty(&self) -> bool {
        self.eligible.is_empty()
    }

    /// A [`Quorum`] once every eligible peer has voted; `None` while votes are missing or
    /// nobody is eligible.
    pub fn tally(&self) -> Option<Quorum> {
        debug_assert!(self.cast.is_subset(&self.eligible), "a vote from outside the electorate");
        if self.eligible.is_empty() || self.cast != self.eligible {
            return None;
        }
        let quorum = Quorum { voters: self.cast.clone() };
        assert_eq!(quorum.voters, self.eligible, "a quorum is the whole electorate");
        Some(quorum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ids: &[u32]) -> BTreeSet<PeerId> {
        ids.iter().map(|&i| PeerId(i)).collect()
    }

    #[test]
    fn a_lost_voter_never_stalls_the_tally() {
        let mut b = Ballot::new(set(&[1, 2, 3]));
        b.cast(PeerId(1));
        b.cast(PeerId(2));
        assert_eq!(b.tally(), None);
        b.remove(PeerId(3));
        assert_eq!(b.tally().unwrap().voters(), &set(&[1, 2]));
    }

    #[test]
    fn a_tally_never_accepts_a_partial_vote() {
        // Exhaustive over electorates of up to 5 and every subset of votes.
        for n in 0..=5u32 {
            for mask in 0..(1u32 << n) {
                let mut b = Ballot::new((0..n).map(PeerId).collect());
                (0..n).filter(|i| mask & (1 << i) != 0).for_each(|i| b.cast(PeerId(i)));
                let all = n > 0 && mask == (1 << n) - 1;
                assert_eq!(b.tally().is_some(), all, "n={n} mask={mask:b}");
            }
        }
    }
}
