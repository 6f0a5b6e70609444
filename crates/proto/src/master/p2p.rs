//! Tagged transfers that wait on a member in another call (`docs/protocol.md`, "No call waits
//! for a call that will never come").
//!
//! The master sees no transfer: two members match a send and a receive between themselves. But a
//! member whose call waits on a transfer the other end never serves, because that end is in a
//! vote or a collective that in turn waits for the first, would wait for its whole bound. So a
//! transfer still unmatched a moment into its wait is announced here (`P2pWaits`) and relayed to
//! the other end, which alone can tell whether its own call lets the transfer complete: it
//! answers `P2pApart` if not, and the master ends the waiter's call with that reason, and any vote
//! of the other end's group with it.
//!
//! A receive from any member waits on all of them: each is asked, each answers for its own call,
//! and the waiter's call ends once every one has answered `P2pApart`. Their calls go on: another
//! member's send could still have served the receive until the last answer, so no verdict of one
//! member ends its call, and the waiter, its receive ended, may still make the calls they wait for.
//!
//! A transfer whose links failed while its outcome rested on the other end's word (`Received`,
//! `Confirmed`) asks here what became of it there (`P2pOutcome`); the other end, which decided it,
//! answers (`P2pDecided`) and the asker's transfer ends as that end's did. An end that left, or
//! leaves before it answers, decided nothing that holds: the asker's fails.

use super::{Master, Status};
use shoal_wire::{Call, Called, Epoch, Message, Misuse, PeerId};
use std::collections::BTreeSet;

/// Most questions about a transfer's outcome one member may have waiting for their answer: past
/// it, the next is answered "failed" at once (a member's transfers in flight when its links fail
/// are its calls not yet ended, far fewer).
pub const MAX_OUTCOMES_ASKED: usize = 4096;

/// A question about a transfer's outcome waiting for its answer: (asker, the end asked, topology,
/// number, the asker sent).
pub(super) type Asked = (PeerId, PeerId, Epoch, u64, bool);

/// A member's announced wait on a tagged transfer (`Master::p2p_waits`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Wait {
    /// With this member.
    One(PeerId),
    /// A receive from any member, with `tag`: the members asked that have not answered yet, and
    /// the answers of those that have.
    Any { tag: u64, asked: BTreeSet<PeerId>, apart: Vec<Misuse> },
}

impl Wait {
    /// The members asked about it, and not answered yet.
    pub(super) fn asked(&self) -> impl Iterator<Item = PeerId> + '_ {
        let (one, any) = match self {
            Wait::One(other) => (Some(*other), None),
            Wait::Any { asked, .. } => (None, Some(asked)),
        };
        one.into_iter().chain(any.into_iter().flatten().copied())
    }
}

impl Master {
    /// `waiter` waits on a transfer with `other` (the fields of `P2pWaits`), or, as a receive from
    /// any member, with every other member of its group: they hear of it. Only between accepted
    /// members of one group: anything else is dropped.
    pub(super) fn p2p_waits(&mut self, waiter: PeerId, other: PeerId, message: Message) {
        let Message::P2pWaits { any, send, tag, seen, epoch, collectives, .. } = message else {
            unreachable!("called with P2pWaits")
        };
        let group = |p: &PeerId| self.peers.get(p).filter(|e| e.status == Status::Accepted).map(|e| e.group);
        let Some(ours) = group(&waiter) else { return };
        let asked: BTreeSet<PeerId> = if any && other == PeerId::ANY && !send {
            self.peers.keys().filter(|p| **p != waiter && group(p) == Some(ours)).copied().collect()
        } else if !any && other != waiter && group(&other) == Some(ours) {
            BTreeSet::from([other])
        } else {
            BTreeSet::new()
        };
        if asked.is_empty() {
            log::debug!("{waiter} waits on a transfer with {other}, not a member of its group: not relayed");
            return;
        }
        for p in &asked {
            self.send_to_peer(*p, Message::P2pWaits { peer: waiter, any, send, tag, seen, epoch, collectives });
        }
        let wait = if any { Wait::Any { tag, asked, apart: Vec::new() } } else { Wait::One(other) };
        let old = self.p2p_waits.insert(waiter, wait);
        debug_assert!(old.is_none(), "{waiter} waits on one transfer at a time");
        assert!(self.p2p_waits.iter().all(|(w, o)| o.asked().all(|o| o != *w)), "a member waits on itself");
    }

    /// `waiter`'s wait announced earlier is over.
    pub(super) fn p2p_resumed(&mut self, waiter: PeerId) {
        if let Some(wait) = self.p2p_waits.remove(&waiter) {
            for other in wait.asked() {
                self.send_to_peer(other, Message::P2pResumed { peer: waiter });
            }
        }
        assert!(!self.p2p_waits.contains_key(&waiter), "a wait outlives its end");
    }

    /// `member`'s call can never let `waiter`'s transfer complete: every vote of the member's
    /// group ends with `misuse` (the member's own among them), and then the waiter's call. For a
    /// receive from any member, only the waiter's call ends, once every member asked said so.
    pub(super) fn p2p_apart(&mut self, member: PeerId, waiter: PeerId, misuse: Misuse) {
        if !self.p2p_waits.get(&waiter).is_some_and(|w| w.asked().any(|o| o == member)) {
            return; // The wait ended meanwhile, or was never with this member.
        }
        debug_assert!(self.accepted(member), "{member} is no member");
        if misuse.ours.peers != [waiter] || misuse.theirs.peers != [member] {
            return self.violation(member, super::PeerMisbehaved::ApartNamesOthers { waiter });
        }
        if let Some(Wait::Any { asked, apart, .. }) = self.p2p_waits.get_mut(&waiter) {
            asked.remove(&member);
            apart.push(misuse);
            if !asked.is_empty() {
                return;
            }
            let Some(Wait::Any { tag, apart, .. }) = self.p2p_waits.remove(&waiter) else { unreachable!("found") };
            let misuse = apart_from_all(waiter, tag, &apart);
            log::warn!("{misuse}");
            self.send_to_peer(waiter, Message::P2pApart { peer: PeerId::ANY, misuse });
            return;
        }
        self.p2p_waits.remove(&waiter);
        log::warn!("{misuse}");
        // The votes first: the waiter, told of them as every member, must not find one still
        // open when its next call starts, which it may as soon as its transfer ends.
        let group = self.peers[&member].group;
        self.abandon_votes(group, &misuse);
        self.send_to_peer(waiter, Message::P2pApart { peer: member, misuse });
        assert!(!self.p2p_waits.contains_key(&waiter), "a wait outlives its end");
    }

    /// `asker`'s transfer with `other` (the fields of `P2pOutcome`) lost its links while its
    /// outcome rested on `other`'s word: `other` is asked what became of it there. Answered "failed"
    /// at once where `other` is no member of the asker's group (it left: what it decided holds
    /// nowhere), or the asker has [`MAX_OUTCOMES_ASKED`] questions waiting.
    pub(super) fn p2p_outcome(&mut self, asker: PeerId, message: Message) {
        let Message::P2pOutcome { peer: other, epoch, number, send } = message else {
            unreachable!("called with P2pOutcome")
        };
        let group = |p: &PeerId| self.peers.get(p).filter(|e| e.status == Status::Accepted).map(|e| e.group);
        let waiting = self.p2p_asked.range((asker, PeerId(0), Epoch(0), 0, false)..).take_while(|a| a.0 == asker);
        if other == asker || group(&other) != group(&asker) || waiting.count() >= MAX_OUTCOMES_ASKED {
            log::debug!("{asker} asks what became of transfer #{number} of topology {} at {other}: failed", epoch.0);
            return self.send_to_peer(asker, Message::P2pDecided { peer: other, epoch, number, send, done: false });
        }
        self.p2p_asked.insert((asker, other, epoch, number, send));
        self.send_to_peer(other, Message::P2pOutcome { peer: asker, epoch, number, send });
    }

    /// `member` says what became at its end of `asker`'s transfer (the fields of `P2pDecided`):
    /// relayed to the asker, if it still asks.
    pub(super) fn p2p_decided(&mut self, member: PeerId, message: Message) {
        let Message::P2pDecided { peer: asker, epoch, number, send, done } = message else {
            unreachable!("called with P2pDecided")
        };
        if self.p2p_asked.remove(&(asker, member, epoch, number, send)) {
            log::debug!("transfer #{number} of topology {} between {asker} and {member}: done {done}", epoch.0);
            self.send_to_peer(asker, Message::P2pDecided { peer: member, epoch, number, send, done });
        }
    }

    /// `peer` left the run: its waits are over, and nobody waits on it any more (the transfers
    /// with it fail on the `PeerRemoved` every member hears; a receive from any member, on the
    /// topology that follows).
    pub(super) fn p2p_member_removed(&mut self, peer: PeerId) {
        self.p2p_waits.retain(|waiter, wait| {
            if let Wait::Any { asked, .. } = wait {
                asked.remove(&peer);
            }
            *waiter != peer && wait.asked().any(|o| o != peer)
        });
        debug_assert!(!self.p2p_waits.iter().any(|(w, o)| *w == peer || o.asked().any(|o| o == peer)));
        // What it decided holds nowhere now: those asking it hear "failed".
        let asked: Vec<Asked> = self.p2p_asked.iter().filter(|a| a.0 == peer || a.1 == peer).copied().collect();
        for (asker, other, epoch, number, send) in asked {
            self.p2p_asked.remove(&(asker, other, epoch, number, send));
            if asker != peer {
                self.send_to_peer(asker, Message::P2pDecided { peer: other, epoch, number, send, done: false });
            }
        }
    }
}

/// `waiter`'s receive from any member with `tag` can never complete: every other member said so
/// (`apart`). The usage error names the receive and the call most of them are in.
fn apart_from_all(waiter: PeerId, tag: u64, apart: &[Misuse]) -> Misuse {
    let most = apart.iter().max_by_key(|m| apart.iter().filter(|o| o.theirs.call == m.theirs.call).count());
    let call = most.expect("every member asked answered").theirs.call;
    let peers = apart.iter().filter(|m| m.theirs.call == call).flat_map(|m| m.theirs.peers.iter().copied());
    let ours = Called::new([waiter], Call::Transfer { send: false, peer: PeerId::ANY, tag });
    Misuse::new(ours, Called::new(peers, call))
}
