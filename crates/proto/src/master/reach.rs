//! Whether a newcomer can be dialed (`docs/nat.md`). When a peer joins, the master opens a
//! connection to the data address it advertises ([`super::Output::Probe`]; the driver dials,
//! bounded by [`MasterConfig::probe_timeout`](super::MasterConfig)) and keeps the answer with
//! the address it saw the peer's control connection come from. Every topology carries both
//! ([`shoal_wire::Member`]'s `dialable` and `seen`): a member that cannot be dialed dials out
//! to those that can. A peer is not pending (no vote admits it) until its probe ends.

use super::{Master, Timer};
use shoal_wire::PeerId;
use std::time::{Duration, Instant};

/// How long the master waits for a newcomer's data port to answer: a SYN lost once is sent again
/// after a second, and a peer behind a NAT that drops it never answers.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// What the master found of a peer's advertised data address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// The probe is under way, until then.
    Probing(Instant),
    /// A connection to it opened.
    Dialable,
    /// None did, for this reason.
    Closed(String),
}

impl Reach {
    /// Whether the probe ended with a connection.
    pub fn dialable(&self) -> bool {
        *self == Reach::Dialable
    }

    /// Whether it can be dialed, once the probe ended.
    pub fn known(&self) -> Option<bool> {
        (!matches!(self, Reach::Probing(_))).then(|| self.dialable())
    }
}

impl Master {
    /// The probe of `peer`'s data address ended: `Ok` if a connection opened, else why not. A
    /// late answer (the probe's time was up) or one for a peer gone changes nothing.
    pub fn handle_probe(&mut self, now: Instant, peer: PeerId, result: Result<(), String>) {
        self.advance(now);
        let Some(e) = self.peers.get_mut(&peer) else { return };
        if !matches!(e.reach, Reach::Probing(_)) {
            return;
        }
        e.reach = match result {
            Ok(()) => Reach::Dialable,
            Err(why) => Reach::Closed(why),
        };
        self.probed(peer);
        self.check();
    }

    /// Ends the probes whose time is up, as closed.
    pub(super) fn end_late_probes(&mut self, now: Instant) {
        let late: Vec<PeerId> = self
            .peers
            .iter()
            .filter(|(_, e)| matches!(e.reach, Reach::Probing(by) if by <= now))
            .map(|(p, _)| *p)
            .collect();
        let waited = self.config.probe_timeout.as_secs_f64();
        for peer in late {
            self.peers.get_mut(&peer).expect("listed above").reach =
                Reach::Closed(format!("its data port did not answer within {waited:.1} s"));
            self.probed(peer);
        }
        self.arm_probes();
    }

    /// `peer`'s reach is known: it may be admitted.
    fn probed(&mut self, peer: PeerId) {
        let e = &self.peers[&peer];
        match &e.reach {
            Reach::Dialable => log::info!("{peer} can be dialed at {}", e.addr),
            Reach::Closed(why) => log::info!(
                "{peer} cannot be dialed at {} ({why}); seen at {}: it dials out to the members that can be",
                e.addr,
                e.seen.map_or_else(|| "an unknown address".to_string(), |ip| ip.to_string())
            ),
            Reach::Probing(_) => unreachable!("{peer} probed"),
        }
        self.touch();
        self.focus_on(peer);
        self.admit_without_vote_if_alone();
    }

    /// Those of `donors` that `fetcher` can dial (`docs/nat.md`): dialable, or seen at its own
    /// address; all of them where none is (its fetch then fails as a lost donor's does).
    pub(super) fn dialable_donors(&self, fetcher: PeerId, donors: &[PeerId]) -> Vec<PeerId> {
        let seen = self.peers.get(&fetcher).and_then(|e| e.seen);
        let reached =
            |d: &&PeerId| self.peers.get(d).is_some_and(|e| e.reach.dialable() || (e.seen.is_some() && e.seen == seen));
        let some: Vec<PeerId> = donors.iter().filter(reached).copied().collect();
        if some.is_empty() {
            donors.to_vec()
        } else {
            some
        }
    }

    /// Wakes at the earliest probe's end.
    pub(super) fn arm_probes(&mut self) {
        let next =
            self.peers.values().filter_map(|e| if let Reach::Probing(by) = e.reach { Some(by) } else { None }).min();
        match next {
            Some(at) => self.timers.set(Timer::Probes, at),
            None => self.timers.clear(Timer::Probes),
        }
    }
}
