//! What a peer tells the master about its own work ([`crate::Message::Report`]): the counters
//! behind the master's metrics and status page. The master never sees a collective that went
//! well (`docs/protocol.md`, "Agreement"), so its view of the data plane is what peers report.

use crate::codec::{Reader, Writer};
use crate::{PeerId, WireError, MAX_MEMBERS};

/// Upper bounds of the buckets of [`OpCounters::durations`], microseconds; a last bucket holds
/// the longer ones.
pub const DURATION_BOUNDS_US: [u64; 12] =
    [100, 300, 1_000, 3_000, 10_000, 30_000, 100_000, 300_000, 1_000_000, 3_000_000, 10_000_000, 30_000_000];
/// Buckets of a duration histogram: one per bound, and one above the last.
pub const DURATION_BUCKETS: usize = DURATION_BOUNDS_US.len() + 1;
/// Most kinds of operation, and most causes of failure, one report lists.
pub const MAX_REPORT_KINDS: usize = 32;
/// The recent collectives a [`LateReport`] counts.
pub const RECENT_OPS: usize = 32;
/// The fewest recent collectives measured that can make a peer a straggler
/// ([`LateReport::straggler`]).
pub const STRAGGLER_MIN_OPS: u32 = 5;
/// Most operations in flight one report lists.
pub const MAX_REPORT_RUNNING: usize = 256;

/// A peer's counters since it joined, and what it does now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PeerReport {
    /// Counters per kind of operation.
    pub ops: Vec<OpCounters>,
    /// Failed operations by cause (`"peer_lost"`, `"timeout"`, ...).
    pub failures: Vec<(String, u64)>,
    /// Operations in flight, longest running first.
    pub running: Vec<RunningOp>,
    /// Its links in the topology in force.
    pub links: Vec<LinkReport>,
    /// How long, in that topology, it had an operation in flight, microseconds: what the links'
    /// rates and saturated shares are of.
    pub busy_us: u64,
    /// How late it was to its collectives (`docs/protocol.md`, "Stragglers").
    pub late: LateReport,
}

/// How late a peer called its collectives, against the earliest member of each: counted over
/// the collectives whose lap told it every member's figure (`Info::lateness` in the peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LateReport {
    /// Collectives measured.
    pub ops: u64,
    /// Those in which it was last and held the others up (by at least a millisecond and a
    /// tenth of the call of the earliest).
    pub last: u64,
    /// How late it was in all, microseconds.
    pub late_us: u64,
    /// Its most recent collectives measured ([`RECENT_OPS`] at most).
    pub recent_ops: u32,
    /// In how many of those it was last.
    pub recent_last: u32,
    /// Its median lateness over those, microseconds.
    pub recent_median_us: u64,
}

/// The counters of one kind of operation.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OpCounters {
    /// `"all_reduce"`, `"all_gather"`, `"reduce_scatter"`, `"broadcast"`, `"barrier"`, `"send"`,
    /// `"recv"`, or `"probe"` (what `optimize_topology` runs to measure links).
    pub kind: String,
    /// Calls started.
    pub started: u64,
    /// Calls that returned success.
    pub succeeded: u64,
    /// Calls that returned an error.
    pub failed: u64,
    /// Bytes sent by calls that succeeded.
    pub tx_bytes: u64,
    /// Bytes received by calls that succeeded.
    pub rx_bytes: u64,
    /// How long the calls that ended took, counted per bucket of [`DURATION_BOUNDS_US`]
    /// (not cumulative).
    pub durations: [u64; DURATION_BUCKETS],
    /// Their total duration, microseconds.
    pub duration_sum_us: u64,
}

impl OpCounters {
    /// Counts one call that ended after `micros`.
    pub fn observe(&mut self, micros: u64) {
        let bucket = DURATION_BOUNDS_US.iter().position(|b| micros <= *b).unwrap_or(DURATION_BUCKETS - 1);
        self.durations[bucket] += 1;
        self.duration_sum_us = self.duration_sum_us.saturating_add(micros);
    }

    /// Adds `other`'s counts to these. They are a peer's word, so they saturate rather than
    /// overflow, however large.
    pub fn add(&mut self, other: &OpCounters) {
        let sum = |a: &mut u64, b: u64| *a = a.saturating_add(b);
        sum(&mut self.started, other.started);
        sum(&mut self.succeeded, other.succeeded);
        sum(&mut self.failed, other.failed);
        sum(&mut self.tx_bytes, other.tx_bytes);
        sum(&mut self.rx_bytes, other.rx_bytes);
        for (a, b) in self.durations.iter_mut().zip(other.durations) {
            sum(a, b);
        }
        sum(&mut self.duration_sum_us, other.duration_sum_us);
    }
}

/// An operation in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningOp {
    /// Its kind, as in [`OpCounters::kind`].
    pub kind: String,
    /// Its buffer's bytes.
    pub bytes: u64,
    /// How long it has run, milliseconds.
    pub elapsed_ms: u64,
}

/// A link to another member of the group, and what moved over it in the topology in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkReport {
    /// The member.
    pub peer: PeerId,
    /// Bytes sent to it.
    pub tx_bytes: u64,
    /// Bytes received from it.
    pub rx_bytes: u64,
    /// Bytes per second sent to it while operations ran (0: nothing sent yet).
    pub tx_rate: u64,
    /// Bytes written to it (frame headers included) while the link was saturated: some frame
    /// to it waited for room in its stream.
    pub saturated_bytes: u64,
    /// How long it was saturated, microseconds. `saturated_bytes` over this is what the link
    /// carries; the master compares it with what `optimize_topology` measured (drift).
    pub saturated_us: u64,
    /// `"tcp"`, `"tls"`, `"shm"` or `"mixed"`.
    pub transport: String,
}

impl LateReport {
    /// Whether it held its group up in most of its recent collectives (of at least
    /// [`STRAGGLER_MIN_OPS`] measured): the peer the others wait for.
    pub fn straggler(&self) -> bool {
        self.recent_ops >= STRAGGLER_MIN_OPS && 2 * u64::from(self.recent_last) > u64::from(self.recent_ops)
    }
}

impl PeerReport {
    pub(crate) fn encode(&self, w: &mut Writer) {
        assert!(self.ops.len() <= MAX_REPORT_KINDS, "report lists too many kinds: a bug");
        assert!(self.failures.len() <= MAX_REPORT_KINDS, "report lists too many causes: a bug");
        assert!(self.running.len() <= MAX_REPORT_RUNNING, "report lists too many operations: a bug");
        assert!(self.links.len() <= MAX_MEMBERS, "report lists too many links: a bug");
        w.u32(self.ops.len() as u32);
        for o in &self.ops {
            w.str(&o.kind);
            for v in [o.started, o.succeeded, o.failed, o.tx_bytes, o.rx_bytes] {
                w.u64(v);
            }
            for v in o.durations {
                w.u64(v);
            }
            w.u64(o.duration_sum_us);
        }
        w.u32(self.failures.len() as u32);
        for (cause, n) in &self.failures {
            w.str(cause);
            w.u64(*n);
        }
        w.u32(self.running.len() as u32);
        for r in &self.running {
            w.str(&r.kind);
            w.u64(r.bytes);
            w.u64(r.elapsed_ms);
        }
        w.u32(self.links.len() as u32);
        for l in &self.links {
            w.u32(l.peer.0);
            w.u64(l.tx_bytes);
            w.u64(l.rx_bytes);
            w.u64(l.tx_rate);
            w.u64(l.saturated_bytes);
            w.u64(l.saturated_us);
            w.str(&l.transport);
        }
        w.u64(self.busy_us);
        let l = &self.late;
        for v in [l.ops, l.last, l.late_us] {
            w.u64(v);
        }
        w.u32(l.recent_ops);
        w.u32(l.recent_last);
        w.u64(l.recent_median_us);
    }

    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let count = r.count(MAX_REPORT_KINDS, 2 + 8 * (6 + DURATION_BUCKETS))?;
        let mut ops = Vec::with_capacity(count);
        for _ in 0..count {
            let kind = r.str()?;
            let (started, succeeded, failed, tx_bytes, rx_bytes) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?, r.u64()?);
            let mut durations = [0; DURATION_BUCKETS];
            for d in &mut durations {
                *d = r.u64()?;
            }
            let duration_sum_us = r.u64()?;
            ops.push(OpCounters { kind, started, succeeded, failed, tx_bytes, rx_bytes, durations, duration_sum_us });
        }
        let count = r.count(MAX_REPORT_KINDS, 2 + 8)?;
        let failures = (0..count).map(|_| Ok((r.str()?, r.u64()?))).collect::<Result<Vec<_>, WireError>>()?;
        let count = r.count(MAX_REPORT_RUNNING, 2 + 8 + 8)?;
        let running = (0..count)
            .map(|_| Ok(RunningOp { kind: r.str()?, bytes: r.u64()?, elapsed_ms: r.u64()? }))
            .collect::<Result<Vec<_>, WireError>>()?;
        let count = r.count(MAX_MEMBERS, 4 + 8 * 5 + 2)?;
        let links = (0..count)
            .map(|_| {
                Ok(LinkReport {
                    peer: PeerId(r.u32()?),
                    tx_bytes: r.u64()?,
                    rx_bytes: r.u64()?,
                    tx_rate: r.u64()?,
                    saturated_bytes: r.u64()?,
                    saturated_us: r.u64()?,
                    transport: r.str()?,
                })
            })
            .collect::<Result<Vec<_>, WireError>>()?;
        let busy_us = r.u64()?;
        let late = LateReport {
            ops: r.u64()?,
            last: r.u64()?,
            late_us: r.u64()?,
            recent_ops: r.u32()?,
            recent_last: r.u32()?,
            recent_median_us: r.u64()?,
        };
        Ok(PeerReport { ops, failures, running, links, busy_us, late })
    }
}

#[cfg(test)]
pub(crate) mod strategy {
    use super::*;
    use proptest::prelude::*;

    pub fn report() -> impl Strategy<Value = PeerReport> {
        let ops = prop::collection::vec(
            ("[a-z_]{0,14}", any::<[u64; 5]>(), any::<[u64; DURATION_BUCKETS]>(), any::<u64>()).prop_map(
                |(kind, c, durations, duration_sum_us)| OpCounters {
                    kind,
                    started: c[0],
                    succeeded: c[1],
                    failed: c[2],
                    tx_bytes: c[3],
                    rx_bytes: c[4],
                    durations,
                    duration_sum_us,
                },
            ),
            0..4,
        );
        let failures = prop::collection::vec(("[a-z_]{0,20}", any::<u64>()), 0..4);
        let running = prop::collection::vec(
            (".{0,10}", any::<u64>(), any::<u64>()).prop_map(|(kind, bytes, elapsed_ms)| RunningOp {
                kind,
                bytes,
                elapsed_ms,
            }),
            0..4,
        );
        let links = prop::collection::vec(
            (any::<u32>(), any::<[u64; 5]>(), "tcp|shm|mixed").prop_map(|(p, c, transport)| LinkReport {
                peer: PeerId(p),
                tx_bytes: c[0],
                rx_bytes: c[1],
                tx_rate: c[2],
                saturated_bytes: c[3],
                saturated_us: c[4],
                transport,
            }),
            0..4,
        );
        let late = (any::<[u64; 4]>(), any::<[u32; 2]>()).prop_map(|(c, n)| LateReport {
            ops: c[0],
            last: c[1],
            late_us: c[2],
            recent_ops: n[0],
            recent_last: n[1],
            recent_median_us: c[3],
        });
        (ops, failures, running, links, any::<u64>(), late).prop_map(
            |(ops, failures, running, links, busy_us, late)| PeerReport {
                ops,
                failures,
                running,
                links,
                busy_us,
                late,
            },
        )
    }
}
