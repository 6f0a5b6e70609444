//! The master's timers, by name.

use shoal_wire::GroupId;
use std::collections::BTreeMap;
use std::time::Instant;

/// Every timer the master arms; a group's are its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Timer {
    /// Send a heartbeat to every peer, so peers can tell a live master from a lost one.
    SendHeartbeats,
    /// The oldest peer's silence reaches the heartbeat timeout: check who is overdue.
    CheckHeartbeats,
    /// Newcomers of an issued topology are overdue with their `TopologyReady`: every accepted
    /// member is ready, and a newcomer that can be reached is ready within moments.
    NewcomersReady(GroupId),
    /// A newcomer's first `peers_pending`, cast tentatively, is due its answer (`calls.rs`).
    TentativeVotes(GroupId),
    /// A slice of the background search for a better ring is due (`plan.rs`).
    ImprovePlan(GroupId),
    /// A collective with a deadline is due its decision (`gather.rs`).
    Gather(GroupId),
    /// A newcomer's probe is out of time (`reach.rs`).
    Probes,
}

/// Deadlines indexed by [`Timer`]; at most one per timer.
#[derive(Debug, Default, Clone)]
pub struct TimerTable {
    deadlines: BTreeMap<Timer, Instant>,
}

impl TimerTable {
    /// Arms (or re-arms) `timer` for `at`.
    pub fn set(&mut self, timer: Timer, at: Instant) {
        self.deadlines.insert(timer, at);
    }

    /// Disarms `timer`.
    pub fn clear(&mut self, timer: Timer) {
        self.deadlines.remove(&timer);
    }

    /// The earliest deadline.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.values().min().copied()
    }

    /// Removes and returns a timer due at `now`, earliest first.
    pub fn pop_due(&mut self, now: Instant) -> Option<Timer> {
        let (&timer, _) = self.deadlines.iter().filter(|(_, &at)| at <= now).min_by_key(|(_, &at)| at)?;
        self.deadlines.remove(&timer);
        Some(timer)
    }
}
