//! `optimize_topology`: every member measures its links to the others, and the master orders
//! the ring by them (`docs/topology.md`).
//!
//! The measurement runs over the data plane's own links, as tagged transfers in a tag range
//! applications cannot use ([`PROBE_TAGS`]). Members pair off in rounds (a round-robin
//! tournament: `world - 1` rounds, one partner each, so no member's uplink is shared by two
//! measurements), and in each round the two partners:
//!
//! 1. time a ping and a pong; a transfer takes one and a half round trips (offer, accept,
//!    part: `engine/p2p.rs`), so the round trip is a third of the exchange. The lower rank
//!    measures and tells the other.
//! 2. send each other [`CommunicatorConfig::probe_bytes`] at once, each acknowledging with one
//!    byte once all arrived. The sender's rate is `bytes / (T - 3 rtt)`, `T` from posting its
//!    send to the partner's acknowledgement: each direction is timed at its sender, so the two
//!    clocks never meet.
//!
//! The rows are then gathered on every member ([`Communicator::bandwidth_matrix`]) and each
//! member votes `update_topology` with its own row ([`CallKind::OptimizeTopology`]).

use crate::communicator::check_buffer;
use crate::engine::{Direction, RawBuf};
use crate::error::{Error, Result};
use crate::failpoint::failpoint;
use crate::{Communicator, DType, PeerId};
use shoal_proto::peer::{CallKind, RingPosition};
use shoal_topology::Link;
use shoal_wire::Measured;
use std::time::Duration;

/// Tags from here up are the library's own; applications' transfers use those below.
pub const PROBE_TAGS: u64 = 1 << 63;
/// The tags of the collectives around the measurement: the barrier that starts it and the gather
/// that shares every member's row.
const BARRIER_TAG: u64 = u64::MAX - 1;
const GATHER_TAG: u64 = u64::MAX;
/// Bytes of one row entry: round trip (`u32`, µs) and rate (`u64`, bytes per second).
const ENTRY_BYTES: usize = 12;

/// What the members of one ring measured of their links to each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Measurements {
    /// The members, in the order of the ring they were measured in.
    members: Vec<PeerId>,
    /// `links[i][j]`: what `members[i]` measured towards `members[j]`.
    links: Vec<Vec<Option<Link>>>,
}

impl Communicator {
    /// Measures the links between the members of the group, and re-orders the ring by them: the
    /// master solves the asymmetric travelling-salesman problem over their costs and issues the
    /// ring that crosses the slowest links least, and places the members in sites (members with
    /// short mutual round trips), which the hierarchical all-reduce follows. A major operation:
    /// every accepted peer of the run must call it; pending peers stay pending. Returns once the
    /// ordered topology is in force.
    ///
    /// # Errors
    /// [`Error::PeerLost`] (retryable) if a member dies, freezes or leaves meanwhile; as
    /// [`Communicator::update_topology`] otherwise.
    pub fn optimize_topology(&self) -> Result<()> {
        // A collective first: it joins a topology issued since the last call, and every member
        // starts measuring at about the same moment.
        self.barrier(BARRIER_TAG)?;
        let position = self.position().ok_or(Error::NotConnected)?;
        let row = self.measure(&position)?;
        let measurements = self.gather_rows(&position, &row)?;
        *self.measured.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(measurements);
        let measured = row
            .iter()
            .enumerate()
            .filter_map(|(rank, link)| {
                let l = (*link)?;
                Some(Measured { peer: position.ring[rank].peer, rtt_us: l.rtt_us, bytes_per_s: l.bytes_per_s })
            })
            .collect();
        failpoint("optimize_topology.before_vote");
        self.vote(CallKind::OptimizeTopology(measured), self.config.timeout).map(drop)
    }

    /// What the last [`Communicator::optimize_topology`] measured, by rank in the topology in
    /// force: `[from][to]`, `None` on the diagonal and between members not measured together
    /// (a member admitted since, say).
    pub fn bandwidth_matrix(&self) -> Vec<Vec<Option<Link>>> {
        let Some(position) = self.position() else { return Vec::new() };
        let measured = self.measured.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = |p: PeerId| measured.as_ref()?.members.iter().position(|m| *m == p);
        let ring = &position.ring;
        ring.iter()
            .map(|from| {
                ring.iter().map(|to| Some(measured.as_ref()?.links[at(from.peer)?][at(to.peer)?]).flatten()).collect()
            })
            .collect()
    }

    /// This member's row: its link to every other member of the group, by rank.
    fn measure(&self, position: &RingPosition) -> Result<Vec<Option<Link>>> {
        let (me, world) = (position.rank, position.group_size());
        let mut row = vec![None; world];
        for round in 0..rounds(world) {
            if let Some(partner) = partner(me, world, round) {
                row[partner] = Some(self.probe(partner, me < partner, round as u64)?);
            }
        }
        Ok(row)
    }

    /// One round against `partner`; the `lead` times the round trip.
    fn probe(&self, partner: usize, lead: bool, round: u64) -> Result<Link> {
        let tag = |k: u64| PROBE_TAGS + round * 8 + k;
        let mut word = [0u8; 8];
        let rtt = if lead {
            let started = std::time::Instant::now();
            self.internal(&mut word[..1], Direction::Send, partner, tag(0))?;
            self.internal(&mut word[..1], Direction::Recv, partner, tag(1))?;
            let rtt = started.elapsed() / 3;
            word = (rtt.as_micros() as u64).to_le_bytes();
            self.internal(&mut word, Direction::Send, partner, tag(2))?;
            rtt
        } else {
            self.internal(&mut word[..1], Direction::Recv, partner, tag(0))?;
            self.internal(&mut word[..1], Direction::Send, partner, tag(1))?;
            self.internal(&mut word, Direction::Recv, partner, tag(2))?;
            Duration::from_micros(u64::from_le_bytes(word))
        };
        failpoint("optimize_topology.probe");
        let bytes = self.config.probe_bytes;
        let mut incoming = self.start_internal(vec![0u8; bytes], Direction::Recv, partner, tag(3))?;
        let mut ack = self.start_internal(vec![0u8; 1], Direction::Recv, partner, tag(4))?;
        let mut outgoing = self.start_internal(vec![0u8; bytes], Direction::Send, partner, tag(3))?;
        self.wait(&mut incoming, None)?;
        self.internal(&mut [1], Direction::Send, partner, tag(4))?;
        // From just before our send was posted to the partner's acknowledgement, as the engine
        // saw it complete (whatever we were blocked in meanwhile).
        let elapsed = self.wait(&mut ack, None)?.elapsed;
        self.wait(&mut outgoing, None)?;
        let moving = elapsed.saturating_sub(rtt * 3).max(elapsed / 4);
        let bytes_per_s = (bytes as f64 / moving.as_secs_f64().max(1e-9)) as u64;
        let rtt_us = rtt.as_micros().clamp(1, u32::MAX.into()) as u32;
        Ok(Link { rtt_us, bytes_per_s })
    }

    /// A blocking transfer of ours, in the probe's tag range.
    fn internal(&self, buf: &mut [u8], direction: Direction, peer: usize, tag: u64) -> Result<crate::Info> {
        self.transfer(RawBuf::new(buf), None, direction, DType::U8, peer, tag)
    }

    /// A transfer of ours in the probe's tag range, started.
    fn start_internal(
        &self,
        mut buf: Vec<u8>,
        direction: Direction,
        peer: usize,
        tag: u64,
    ) -> Result<crate::Work<Vec<u8>>> {
        let raw = RawBuf::new(&mut buf);
        self.start_transfer(raw, Box::new(buf), direction, DType::U8, peer, tag)
    }

    /// Every member's row, gathered on every member.
    fn gather_rows(&self, position: &RingPosition, row: &[Option<Link>]) -> Result<Measurements> {
        let world = position.group_size();
        let mut inp = Vec::with_capacity(world * ENTRY_BYTES);
        for link in row {
            let l = link.unwrap_or_default();
            inp.extend_from_slice(&l.rtt_us.to_le_bytes());
            inp.extend_from_slice(&l.bytes_per_s.to_le_bytes());
        }
        let mut out = vec![0u8; world * inp.len()];
        check_buffer(&out, DType::U8)?;
        self.all_gather(&mut out, &inp, DType::U8, GATHER_TAG)?;
        let links = out
            .chunks_exact(inp.len())
            .map(|row| {
                row.chunks_exact(ENTRY_BYTES)
                    .map(|e| {
                        let rtt_us = u32::from_le_bytes(e[..4].try_into().expect("4 bytes"));
                        let bytes_per_s = u64::from_le_bytes(e[4..].try_into().expect("8 bytes"));
                        (bytes_per_s > 0).then_some(Link { rtt_us, bytes_per_s })
                    })
                    .collect()
            })
            .collect();
        Ok(Measurements { members: position.ring.iter().map(|m| m.peer).collect(), links })
    }
}

/// Rounds of the tournament among `world` members: every pair meets once.
fn rounds(world: usize) -> usize {
    if world < 2 {
        0
    } else {
        world + world % 2 - 1
    }
}

/// Whom `me` meets in `round` (the circle method: one member stays, the others rotate), if
/// anyone: with an odd number of members, one sits each round out.
fn partner(me: usize, world: usize, round: usize) -> Option<usize> {
    let n = world + world % 2;
    let fixed = n - 1;
    let other = if me == fixed {
        round % fixed
    } else if me == round % fixed {
        fixed
    } else {
        (2 * round + fixed - me) % fixed
    };
    (other < world).then_some(other)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pair_meets_once_and_nobody_twice_in_a_round() {
        for world in 1..12 {
            let mut met = vec![vec![0; world]; world];
            for round in 0..rounds(world) {
                for (me, row) in met.iter_mut().enumerate() {
                    if let Some(p) = partner(me, world, round) {
                        assert_ne!(p, me);
                        assert_eq!(partner(p, world, round), Some(me), "world {world}, round {round}");
                        row[p] += 1;
                    }
                }
            }
            for (a, row) in met.iter().enumerate() {
                for (b, &times) in row.iter().enumerate() {
                    assert_eq!(times, usize::from(a != b), "world {world}: {a} met {b} {times} times");
                }
            }
        }
    }
}
