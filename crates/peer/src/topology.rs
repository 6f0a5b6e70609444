//! `optimize_topology`: every member measures its links to the others, and the master orders
//! the ring by them (`docs/topology.md`).
//!
//! The measurement runs over the data plane's own links, as tagged transfers in a tag range
//! applications cannot use ([`PROBE_TAGS`]). Members pair off in rounds (a round-robin
//! tournament: `world - 1` rounds, one partner each, so no member's uplink is shared by two
//! measurements), and in each round the two partners:
//!
//! 1. ping once untimed (it opens the link: dialing, greetings), then time three pings and
//!    pongs; a transfer takes one and a half round trips (offer, accept, part:
//!    `engine/p2p.rs`), so the round trip is a third of the fastest. The lower rank measures and
//!    tells the other.
//! 2. send each other the same number of bytes at once, each acknowledging with one byte once
//!    all arrived; the sender's rate is `bytes / (T - 3 rtt)`, `T` from posting its send to the
//!    partner's acknowledgement: each direction is timed at its sender, so the two clocks never
//!    meet. Exchanges grow from 256 KiB, four times each, until one lasts 30 round trips (and
//!    50 ms), by when a fresh connection left TCP's slow start behind, or reaches
//!    [`crate::CommunicatorConfig::probe_bytes`]; the rate is the best of the last and of those
//!    that lasted at least 15 round trips.
//!
//! The rows are then gathered on every member ([`Communicator::bandwidth_matrix`]) and each
//! member votes `update_topology` with its own row ([`CallKind::OptimizeTopology`]).

use crate::communicator::check_buffer;
use crate::error::{Error, Result, Usage};
use crate::info::Measurements;
use crate::tags::{BARRIER_TAG, GATHER_TAG, PROBE_TAGS};
use crate::{Communicator, DType, PeerId};
use shoal_config::failpoint;
use shoal_engine::{Direction, RawBuf};
use shoal_proto::peer::{CallKind, RingPosition};
use shoal_topology::Link;
use shoal_transport::SendTimes;
use shoal_wire::Measured;
use std::time::Duration;

/// Tags one round may use.
const TAGS_PER_ROUND: u64 = 64;
/// Timed ping-pongs per round: the round trip is the fastest.
const PINGS: usize = 3;
/// The first exchange's size; each next is four times larger, up to `probe_bytes`.
const PROBE_START_BYTES: usize = 256 << 10;
/// An exchange long enough to measure a rate lasts this many round trips (slow start takes a
/// handful), and at least [`PROBE_MIN_TIME`].
const PROBE_RTTS: u32 = 30;
const PROBE_MIN_TIME: Duration = Duration::from_millis(50);
/// Bytes of one row entry: round trip (`u32`, µs), rate (`u64`, bytes per second), and whether
/// the pool grows (`u8`).
const ENTRY_BYTES: usize = 13;
/// A pool whose streams a window held back this fraction of their sending time grows.
const WINDOW_LIMITED: f64 = 0.25;
/// Measurements one `optimize_topology` runs at most: each after pools grew.
const SIZING_ROUNDS: usize = 3;

/// What one round measured of the link to the partner.
#[derive(Debug, Clone, Copy)]
struct Probed {
    link: Link,
    /// The size our pool to it grows to, if it grows.
    grow_to: Option<usize>,
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
        self.whole_group("optimize_topology")?;
        for round in 1..=SIZING_ROUNDS {
            let grew = self.measure_and_vote()?;
            if !grew {
                break;
            }
            log::info!("pools grew in measuring round {round}: measuring again over the larger pools");
        }
        Ok(())
    }

    /// One measurement and its vote; whether some member grew a pool for the new topology (every
    /// member sees the same answer: it is in the gathered rows).
    fn measure_and_vote(&self) -> Result<bool> {
        // A collective first: it joins a topology issued since the last call, and every member
        // starts measuring at about the same moment.
        self.barrier(BARRIER_TAG)?;
        let position = self.position().ok_or(Error::NotConnected)?;
        let row = self.measure(&position)?;
        let measurements = self.gather_rows(&position, &row)?;
        let grew = measurements.grew;
        *self.measured.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(measurements);
        let measured = row
            .iter()
            .enumerate()
            .filter_map(|(rank, probe)| {
                let l = probe.as_ref()?.link;
                Some(Measured { peer: position.ring[rank].peer, rtt_us: l.rtt_us, bytes_per_s: l.bytes_per_s })
            })
            .collect();
        failpoint("optimize_topology.before_vote");
        self.vote(CallKind::OptimizeTopology(measured), self.config.timeout)?;
        Ok(grew)
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
    fn measure(&self, position: &RingPosition) -> Result<Vec<Option<Probed>>> {
        let (me, world) = (position.rank, position.group_size());
        let mut row: Vec<Option<Probed>> = vec![None; world];
        for round in 0..rounds(world) {
            if let Some(partner) = partner(me, world, round) {
                let probed = self.probe(partner, me < partner, round as u64)?;
                let peer = position.ring[partner].peer;
                if let Some(streams) = probed.grow_to {
                    self.connected()?.listener.size_pool(peer, streams);
                }
                row[partner] = Some(probed);
            }
        }
        Ok(row)
    }

    /// One round against `partner`; the `lead` times the round trip and decides how long the
    /// exchanges go on.
    fn probe(&self, partner: usize, lead: bool, round: u64) -> Result<Probed> {
        let mut taken = 0;
        let mut tag = || {
            taken += 1;
            debug_assert!(taken < TAGS_PER_ROUND);
            PROBE_TAGS + round * TAGS_PER_ROUND + taken
        };
        // The first ping opens the link both ways (dialing, greeting): it is not timed.
        self.ping(partner, lead, tag(), tag())?;
        let mut rtt = Duration::MAX;
        for _ in 0..PINGS {
            let started = std::time::Instant::now();
            self.ping(partner, lead, tag(), tag())?;
            rtt = rtt.min(started.elapsed() / 3);
        }
        let rtt = Duration::from_micros(self.tell(partner, lead, rtt.as_micros() as u64, tag())?);
        failpoint("optimize_topology.probe");
        // Exchanges grow until one lasts long enough to leave TCP's slow start behind. The rate
        // is the best of those long enough for the round-trip correction to matter little (the
        // last always counts): a stall of the partner's or of this machine in one exchange
        // does not pass for the link's rate.
        let (mut bytes, most) = (PROBE_START_BYTES.min(self.config.probe_bytes), self.config.probe_bytes);
        let mut best = 0u64;
        loop {
            let before = self.send_times(partner);
            let elapsed = self.exchange(partner, bytes, tag(), tag())?;
            let moving = elapsed.saturating_sub(rtt * 3).max(elapsed / 4);
            let rate = (bytes as f64 / moving.as_secs_f64().max(1e-9)) as u64;
            let enough = elapsed >= (rtt * PROBE_RTTS).max(PROBE_MIN_TIME) || bytes >= most;
            let last = self.tell(partner, lead, u64::from(enough), tag())? == 1;
            if last || elapsed >= rtt * PROBE_RTTS / 2 {
                best = best.max(rate);
            }
            if last {
                let rtt_us = rtt.as_micros().clamp(1, u32::MAX.into()) as u32;
                let link = Link { rtt_us, bytes_per_s: best };
                return Ok(Probed { link, grow_to: self.grow_to(partner, &before, &link) });
            }
            bytes = (bytes * 4).min(most);
        }
    }

    /// The send times of our TCP lanes to `partner`.
    fn send_times(&self, partner: usize) -> Vec<SendTimes> {
        let fds = self.lock_data().exec.as_ref().map(|e| e.tcp_lanes_to(partner)).unwrap_or_default();
        fds.into_iter().map(|fd| shoal_transport::send_times(fd).unwrap_or_default()).collect()
    }

    /// How many streams our pool to `partner` should hold from the next topology on, if more than
    /// now: twice as many (up to [`crate::CommunicatorConfig::connections_max`]) when a window
    /// held its streams back for most of the last exchange (since `before`), unless the pool's
    /// size is configured.
    fn grow_to(&self, partner: usize, before: &[SendTimes], link: &Link) -> Option<usize> {
        let after = self.send_times(partner);
        let streams = after.len();
        let limited =
            after.iter().zip(before).map(|(a, b)| a.window_limited_since(b)).sum::<f64>() / streams.max(1) as f64;
        log::info!(
            "link to rank {partner}: {streams} TCP streams, {:.1} Mbit/s, round trip {:.2} ms, held back by a window {:.0}% of the time",
            link.bytes_per_s as f64 * 8e-6,
            link.rtt_us as f64 / 1e3,
            limited * 100.0
        );
        let grow = self.config.connections.is_none()
            && streams > 0
            && streams < self.config.connections_max
            && after.len() == before.len()
            && limited >= WINDOW_LIMITED;
        grow.then(|| (streams * 2).min(self.config.connections_max))
    }

    /// A byte from the lead to the partner and back.
    fn ping(&self, partner: usize, lead: bool, there: u64, back: u64) -> Result<()> {
        let mut byte = [0u8; 1];
        let order = if lead {
            [(Direction::Send, there), (Direction::Recv, back)]
        } else {
            [(Direction::Recv, there), (Direction::Send, back)]
        };
        for (direction, tag) in order {
            self.internal(&mut byte, direction, partner, tag)?;
        }
        Ok(())
    }

    /// The lead's `value`, on both ends.
    fn tell(&self, partner: usize, lead: bool, value: u64, tag: u64) -> Result<u64> {
        let mut word = value.to_le_bytes();
        self.internal(&mut word, if lead { Direction::Send } else { Direction::Recv }, partner, tag)?;
        Ok(u64::from_le_bytes(word))
    }

    /// Sends `bytes` to the partner while it sends as many to us; returns how long after our send
    /// was posted the partner acknowledged receiving all of it.
    fn exchange(&self, partner: usize, bytes: usize, data: u64, ack: u64) -> Result<Duration> {
        let mut incoming = self.start_internal(vec![0u8; bytes], Direction::Recv, partner, data)?;
        let mut acked = self.start_internal(vec![0u8; 1], Direction::Recv, partner, ack)?;
        let mut outgoing = self.start_internal(vec![0u8; bytes], Direction::Send, partner, data)?;
        self.wait(&mut incoming, None)?;
        self.internal(&mut [1], Direction::Send, partner, ack)?;
        // As the engine saw the acknowledgement complete, whatever we were blocked in meanwhile.
        let elapsed = self.wait(&mut acked, None)?.elapsed;
        self.wait(&mut outgoing, None)?;
        Ok(elapsed)
    }

    /// A blocking transfer of ours, in the probe's tag range.
    fn internal(&self, buf: &mut [u8], direction: Direction, peer: usize, tag: u64) -> Result<crate::Info> {
        self.transfer(RawBuf::new(buf), None, direction, DType::U8, Some(peer), tag)
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
        self.start_transfer(raw, Box::new(buf), direction, DType::U8, Some(peer), tag)
    }

    /// Every member's row, gathered on every member.
    fn gather_rows(&self, position: &RingPosition, row: &[Option<Probed>]) -> Result<Measurements> {
        let world = position.group_size();
        let mut inp = Vec::with_capacity(world * ENTRY_BYTES);
        for probed in row {
            let l = probed.as_ref().map(|p| p.link).unwrap_or_default();
            inp.extend_from_slice(&l.rtt_us.to_le_bytes());
            inp.extend_from_slice(&l.bytes_per_s.to_le_bytes());
            inp.push(u8::from(probed.as_ref().is_some_and(|p| p.grow_to.is_some())));
        }
        let mut out = vec![0u8; world * inp.len()];
        check_buffer(&out, DType::U8)?;
        self.all_gather(&mut out, &inp, DType::U8, GATHER_TAG, None).map_err(changed_meanwhile)?;
        let links = out
            .chunks_exact(inp.len())
            .map(|row| {
                row.chunks_exact(ENTRY_BYTES)
                    .map(|e| {
                        let rtt_us = u32::from_le_bytes(e[..4].try_into().expect("4 bytes"));
                        let bytes_per_s = u64::from_le_bytes(e[4..12].try_into().expect("8 bytes"));
                        (bytes_per_s > 0).then_some(Link { rtt_us, bytes_per_s })
                    })
                    .collect()
            })
            .collect();
        let grew = out.chunks_exact(ENTRY_BYTES).any(|e| e[12] != 0);
        Ok(Measurements { members: position.ring.iter().map(|m| m.peer).collect(), links, grew })
    }
}

/// The rows were measured in a topology that a loss or an admission replaced before they were
/// gathered: they fit no longer (every member fails the gather alike, found by the chaos run). Not
/// the caller's misuse but the run's change, retryable as a loss is.
fn changed_meanwhile(e: Error) -> Error {
    match e {
        Error::Usage(Usage::Misfit(m)) => Error::PeerLost {
            peer: PeerId::ANY,
            operation: "optimize_topology",
            reason: format!("the group changed while its links were measured ({m})"),
        },
        Error::Usage(Usage::MemberMisfit { peer, reason }) => Error::PeerLost {
            peer,
            operation: "optimize_topology",
            reason: format!("the group changed while its links were measured ({peer}: {reason})"),
        },
        e => e,
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
    use crate::error::Misfit;

    #[test]
    fn rows_that_no_longer_fit_the_group_fail_as_a_loss_not_a_misuse() {
        let misfit = Misfit::Blocks { kind: "all_gather", what: "output", whole: 39, world: 2, block: 13 };
        for e in [
            Error::Usage(Usage::Misfit(misfit)),
            Error::Usage(Usage::MemberMisfit { peer: PeerId(3), reason: shoal_wire::Reason::Text("fits not".into()) }),
        ] {
            let e = changed_meanwhile(e);
            assert!(matches!(&e, Error::PeerLost { operation: "optimize_topology", .. }), "{e}");
            assert!(e.to_string().contains("the group changed while its links were measured"), "{e}");
        }
        let refused = changed_meanwhile(Error::Usage(Usage::CatchUpRefused("no".into())));
        assert!(matches!(refused, Error::Usage(_)), "another misuse stays one");
    }

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
