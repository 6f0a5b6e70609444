//! A communicator's counters ([`crate::Communicator::stats`]): operations by kind, failures by
//! cause, what runs now, and its links. The timer thread sends them to the master with every
//! heartbeat (`Message::Report`), where they become the run's metrics; it never takes the data
//! plane's lock to do so, so the counters keep their own.

use crate::error::Error;
use crate::info::{Info, LinkInfo};
use shoal_proto::peer::CallId;
use shoal_wire::{
    LateReport, LinkReport, OpCounters, PeerReport, RunningOp, MAX_REPORT_KINDS, MAX_REPORT_RUNNING, RECENT_OPS,
};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The counters, updated as calls start and end.
#[derive(Default)]
pub(crate) struct Stats {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    ops: BTreeMap<&'static str, OpCounters>,
    failures: BTreeMap<&'static str, u64>,
    /// Calls in flight: their kind, bytes and start.
    running: HashMap<CallId, (&'static str, u64, Instant)>,
    /// The topology the links are of.
    epoch: u64,
    links: Vec<LinkInfo>,
    /// Time with a call in flight in that topology: what the links' rates are measured over.
    busy: Duration,
    busy_since: Option<Instant>,
    /// How late we were to our collectives, and to the most recent ones (whether last, how late).
    late: LateReport,
    recent: VecDeque<(bool, Duration)>,
}

impl Stats {
    /// Call `call`, a `kind` with `tag` over `bytes`, started. What `optimize_topology` runs to
    /// measure the links (tags of [`crate::PROBE_TAGS`]) counts as `"probe"`, not as the
    /// application's.
    pub fn started(&self, call: CallId, kind: &'static str, tag: u64, bytes: u64) {
        let kind = if tag >= crate::PROBE_TAGS { "probe" } else { kind };
        let mut s = self.lock();
        let now = Instant::now();
        s.busy_since.get_or_insert(now);
        s.running.insert(call, (kind, bytes, now));
        counters(&mut s.ops, kind).started += 1;
    }

    /// Call `call` ended with `outcome`; `links` are ours in topology `epoch` after it.
    pub fn ended(&self, call: CallId, outcome: &Result<Info, Error>, epoch: u64, links: Vec<LinkInfo>) {
        let mut s = self.lock();
        let Some((kind, _, started)) = s.running.remove(&call) else { return };
        let now = Instant::now();
        if s.running.is_empty() {
            if let Some(since) = s.busy_since.take() {
                s.busy += now.saturating_duration_since(since);
            }
        }
        if epoch != s.epoch {
            // The links are new: their rates start again.
            (s.epoch, s.busy) = (epoch, Duration::ZERO);
        }
        s.links = links;
        let c = counters(&mut s.ops, kind);
        c.observe(micros(now.saturating_duration_since(started)));
        match outcome {
            Ok(info) => {
                c.succeeded += 1;
                c.tx_bytes += info.tx_bytes;
                c.rx_bytes += info.rx_bytes;
                if let Some(&late) = info.lateness.get(info.rank) {
                    let last = info.last() == Some(info.rank);
                    let l = &mut s.late;
                    l.ops += 1;
                    l.last += u64::from(last);
                    l.late_us = l.late_us.saturating_add(micros(late));
                    if s.recent.len() == RECENT_OPS {
                        s.recent.pop_front();
                    }
                    s.recent.push_back((last, late));
                }
            }
            Err(e) => {
                c.failed += 1;
                if s.failures.len() < MAX_REPORT_KINDS || s.failures.contains_key(e.cause()) {
                    *s.failures.entry(e.cause()).or_default() += 1;
                }
            }
        }
    }

    /// The counters as they stand.
    pub fn report(&self) -> PeerReport {
        let s = self.lock();
        let now = Instant::now();
        let busy = s.busy + s.busy_since.map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        let mut running: Vec<RunningOp> = s
            .running
            .values()
            .map(|(kind, bytes, started)| RunningOp {
                kind: (*kind).to_string(),
                bytes: *bytes,
                elapsed_ms: now.saturating_duration_since(*started).as_millis().min(u64::MAX.into()) as u64,
            })
            .collect();
        running.sort_by_key(|r| std::cmp::Reverse(r.elapsed_ms));
        running.truncate(MAX_REPORT_RUNNING);
        let rate = |bytes: u64| if busy.is_zero() { 0 } else { (bytes as f64 / busy.as_secs_f64()) as u64 };
        PeerReport {
            ops: s.ops.values().cloned().collect(),
            failures: s.failures.iter().map(|(cause, n)| ((*cause).to_string(), *n)).collect(),
            running,
            links: s
                .links
                .iter()
                .map(|l| LinkReport {
                    peer: l.peer,
                    tx_bytes: l.tx_bytes,
                    rx_bytes: l.rx_bytes,
                    tx_rate: rate(l.tx_bytes),
                    saturated_bytes: l.saturated_bytes,
                    saturated_us: micros(l.saturated),
                    transport: l.transport.to_string(),
                })
                .collect(),
            busy_us: micros(busy),
            late: LateReport {
                recent_ops: s.recent.len() as u32,
                recent_last: s.recent.iter().filter(|(last, _)| *last).count() as u32,
                recent_median_us: median(s.recent.iter().map(|(_, late)| *late)).map_or(0, micros),
                ..s.late
            },
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `d` in microseconds, saturated.
fn micros(d: Duration) -> u64 {
    d.as_micros().min(u64::MAX.into()) as u64
}

/// The median of `values` (the upper one of an even count), if any.
fn median(values: impl Iterator<Item = Duration>) -> Option<Duration> {
    let mut v: Vec<Duration> = values.collect();
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

fn counters<'a>(ops: &'a mut BTreeMap<&'static str, OpCounters>, kind: &'static str) -> &'a mut OpCounters {
    ops.entry(kind).or_insert_with(|| OpCounters { kind: kind.to_string(), ..Default::default() })
}
