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

use super::{Master, Status};
use shoal_wire::{Message, Misuse, PeerId};

impl Master {
    /// `waiter` waits on a transfer with `other` (the fields of `P2pWaits`): the other end hears
    /// of it. Only between accepted members of one group: anything else is dropped.
    pub(super) fn p2p_waits(&mut self, waiter: PeerId, other: PeerId, message: Message) {
        let Message::P2pWaits { send, tag, seen, epoch, collectives, .. } = message else {
            unreachable!("called with P2pWaits")
        };
        let group = |p: &PeerId| self.peers.get(p).filter(|e| e.status == Status::Accepted).map(|e| e.group);
        if other == waiter || group(&waiter).is_none() || group(&waiter) != group(&other) {
            log::debug!("{waiter} waits on a transfer with {other}, not a member of its group: not relayed");
            return;
        }
        self.p2p_waits.insert(waiter, other);
        self.send_to_peer(other, Message::P2pWaits { peer: waiter, send, tag, seen, epoch, collectives });
        assert!(self.p2p_waits.iter().all(|(w, o)| w != o), "a member waits on itself");
        debug_assert_eq!(self.p2p_waits.get(&waiter), Some(&other), "{waiter} waits on one transfer at a time");
    }

    /// `waiter`'s wait announced earlier is over.
    pub(super) fn p2p_resumed(&mut self, waiter: PeerId) {
        if let Some(other) = self.p2p_waits.remove(&waiter) {
            self.send_to_peer(other, Message::P2pResumed { peer: waiter });
        }
        assert!(!self.p2p_waits.contains_key(&waiter), "a wait outlives its end");
    }

    /// `member`'s call can never let `waiter`'s transfer complete: every vote of the member's
    /// group ends with `misuse` (the member's own among them), and then the waiter's call.
    pub(super) fn p2p_apart(&mut self, member: PeerId, waiter: PeerId, misuse: Misuse) {
        if self.p2p_waits.get(&waiter) != Some(&member) {
            return; // The wait ended meanwhile, or was never with this member.
        }
        debug_assert!(self.accepted(member), "{member} is no member");
        if misuse.ours.peers != [waiter] || misuse.theirs.peers != [member] {
            return self.violation(member, super::PeerMisbehaved::ApartNamesOthers { waiter });
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

    /// `peer` left the run: its waits are over, and nobody waits on it any more (the transfers
    /// with it fail on the `PeerRemoved` every member hears).
    pub(super) fn p2p_member_removed(&mut self, peer: PeerId) {
        self.p2p_waits.retain(|waiter, other| *waiter != peer && *other != peer);
        debug_assert!(!self.p2p_waits.iter().any(|(w, o)| *w == peer || *o == peer));
    }
}
