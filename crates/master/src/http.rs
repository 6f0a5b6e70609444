//! The master's HTTP endpoints: `/metrics` (Prometheus text format, names prefixed `shoal_`),
//! `/status` (the run as JSON) and `/` (a status page that draws the ring and the link matrix
//! from `/status`). Every answer is built from one [`RunStatus`] the driver hands over, so the
//! numbers of one answer always belong together; the driver is never blocked by a slow client.
//!
//! tiny_http serves: a small synchronous server fits the master's threads-and-channels design
//! and needs no async runtime. prometheus-client encodes the metrics.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use serde_json::{json, Value};
use shoal_proto::master::{RunStatus, Status};
use shoal_wire::{OpCounters, PeerId, PeerReport, DURATION_BOUNDS_US};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What prometheus-client writes: OpenMetrics text, which Prometheus scrapes.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The status page: one self-contained file, no external resources.
const PAGE: &str = include_str!("status.html");

/// Answers requests on `server` until `stop`, asking `status` for the run's state.
pub(crate) fn serve(server: tiny_http::Server, stop: Arc<AtomicBool>, status: impl Fn() -> Option<RunStatus>) {
    while !stop.load(Ordering::Relaxed) {
        let request = match server.recv_timeout(Duration::from_millis(200)) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(e) => {
                log::warn!("status server: {e}");
                continue;
            }
        };
        let path = request.url().split('?').next().unwrap_or("/").to_string();
        let get = matches!(request.method(), tiny_http::Method::Get | tiny_http::Method::Head);
        let (code, content_type, body) = match (get, path.as_str()) {
            (false, _) => (405, "text/plain", "only GET is served\n".to_string()),
            (true, "/metrics" | "/status") => match status() {
                Some(s) if path == "/metrics" => (200, OPENMETRICS, metrics(s)),
                Some(s) => (200, "application/json", status_json(&s).to_string()),
                None => (503, "text/plain", "the master is stopping\n".to_string()),
            },
            (true, "/") => (200, "text/html; charset=utf-8", PAGE.to_string()),
            (true, _) => (404, "text/plain", format!("no such page: {path} (try /, /status or /metrics)\n")),
        };
        let header =
            tiny_http::Header::from_bytes(&b"Content-Type"[..], content_type.as_bytes()).expect("valid header");
        let response = tiny_http::Response::from_string(body).with_status_code(code).with_header(header);
        if let Err(e) = request.respond(response) {
            log::debug!("status server: cannot answer {path}: {e}");
        }
    }
}

/// The run as JSON: what `/status` serves and `shoal status` prints.
pub fn status_json(s: &RunStatus) -> Value {
    let id = |p: &PeerId| p.0;
    let peers: Vec<Value> = s
        .peers
        .iter()
        .map(|p| {
            let mut peer = json!({
                "id": p.peer.0,
                "group": p.group.0,
                "addr": p.addr,
                "state": match p.status {
                    Status::Registered => "registered",
                    Status::CatchingUp => "catching_up",
                    Status::Accepted => "accepted",
                },
                "rank": p.rank,
                "site": p.site,
                "silent_s": p.silent.as_secs_f64(),
            });
            if let (Some(r), Value::Object(fields)) = (&p.report, &mut peer) {
                let Value::Object(report) = report_json(r) else { unreachable!("an object") };
                fields.extend(report);
            }
            if let (Some((done, total, eta_ms)), Value::Object(fields)) = (p.catch_up, &mut peer) {
                fields.insert(
                    "catch_up".into(),
                    json!({"done_bytes": done, "total_bytes": total, "eta_s": eta_ms as f64 / 1e3}),
                );
            }
            peer
        })
        .collect();
    let groups: Vec<Value> = s
        .groups
        .iter()
        .map(|g| {
            json!({
                "group": g.group.0,
                "ring": g.ring.iter().map(id).collect::<Vec<_>>(),
                "revision": g.revision,
                "hashes": g.hashes.iter().map(|(name, h)| (name.clone(), json!(hex(h)))).collect::<serde_json::Map<_, _>>(),
                "syncing": g.syncing,
                "snapshot": g.snapshot.as_ref().map(|(round, revision, held)| json!({
                    "round": round, "revision": revision, "held_by": held.iter().map(id).collect::<Vec<_>>(),
                })),
            })
        })
        .collect();
    let matrix = s.matrix.as_ref().map(|m| {
        json!({
            "peers": m.members.iter().map(id).collect::<Vec<_>>(),
            "bytes_per_s": m.links.iter().map(|row| row.iter().map(|l| l.map(|l| l.bytes_per_s)).collect::<Vec<_>>()).collect::<Vec<_>>(),
            "rtt_us": m.links.iter().map(|row| row.iter().map(|l| l.map(|l| l.rtt_us)).collect::<Vec<_>>()).collect::<Vec<_>>(),
        })
    });
    let running: Vec<Value> = s
        .peers
        .iter()
        .flat_map(|p| p.report.iter().flat_map(move |r| r.running.iter().map(move |o| (p.peer, o))))
        .map(|(p, o)| json!({"peer": p.0, "kind": o.kind, "bytes": o.bytes, "elapsed_s": o.elapsed_ms as f64 / 1e3}))
        .collect();
    let c = &s.counters;
    json!({
        "session": format!("{:016x}", s.session.0),
        "epoch": s.epoch.0,
        "ring_epoch": s.ring_epoch.0,
        "phase": s.phase,
        "ring": s.ring.iter().map(id).collect::<Vec<_>>(),
        "peers": peers,
        "groups": groups,
        "matrix": matrix,
        "running": running,
        "open_collectives": s.open_collectives,
        "counters": {
            "joins": c.joins, "auth_failures": c.auth_failures, "refused_full": c.refused_full,
            "tls_failures": c.tls_failures,
            "left": c.left, "lost": c.lost, "expelled": c.expelled, "topologies": c.topologies,
            "topology_votes": c.topology_votes, "pending_votes": c.pending_votes,
            "syncs_completed": c.syncs_completed, "syncs_aborted": c.syncs_aborted,
            "collectives_aborted": c.collectives_aborted,
        },
        "operations": operations_json(s.totals.ops.values()),
        "failures": s.totals.failures.iter().map(|(c, n)| (c.clone(), json!(n))).collect::<serde_json::Map<_, _>>(),
    })
}

/// One peer's counters as JSON: what `Communicator.stats()` returns, and each peer's entry of
/// `/status` holds.
pub fn report_json(r: &PeerReport) -> Value {
    json!({
        "operations": operations_json(r.ops.iter()),
        "failures": r.failures.iter().map(|(c, n)| (c.clone(), json!(n))).collect::<serde_json::Map<_, _>>(),
        "running": r.running.iter().map(|o| json!({
            "kind": o.kind, "bytes": o.bytes, "elapsed_s": o.elapsed_ms as f64 / 1e3,
        })).collect::<Vec<_>>(),
        "links": r.links.iter().map(|l| json!({
            "peer": l.peer.0,
            "tx_bytes": l.tx_bytes,
            "rx_bytes": l.rx_bytes,
            "tx_bytes_per_s": l.tx_rate,
            "saturated_s": l.saturated_us as f64 / 1e6,
            // What the link carries when it holds the operations back (0: it never did).
            "saturated_bytes_per_s": if l.saturated_us == 0 { 0 } else {
                (u128::from(l.saturated_bytes) * 1_000_000 / u128::from(l.saturated_us)) as u64
            },
            "transport": l.transport,
        })).collect::<Vec<_>>(),
    })
}

/// Counters by kind of operation.
fn operations_json<'a>(ops: impl Iterator<Item = &'a OpCounters>) -> Value {
    let entry = |o: &OpCounters| {
        json!({
            "started": o.started,
            "succeeded": o.succeeded,
            "failed": o.failed,
            "tx_bytes": o.tx_bytes,
            "rx_bytes": o.rx_bytes,
            "seconds": o.duration_sum_us as f64 / 1e6,
        })
    };
    Value::Object(ops.map(|o| (o.kind.clone(), entry(o))).collect())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::with_capacity(2 * bytes.len()), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// The Prometheus text of `status`.
fn metrics(status: RunStatus) -> String {
    let mut registry = Registry::with_prefix("shoal");
    registry.register_collector(Box::new(Run(status)));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("writing to a String cannot fail");
    text
}

#[derive(Debug)]
struct Run(RunStatus);

type Labels = Vec<(&'static str, String)>;

/// Writes one family: `name` with `help`, one sample per label set.
fn family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    samples: impl IntoIterator<Item = (Labels, M)>,
) -> std::fmt::Result {
    let samples: Vec<(Labels, M)> = samples.into_iter().collect();
    let Some(first) = samples.first() else { return Ok(()) };
    let mut family = encoder.encode_descriptor(name, help, unit.as_ref(), first.1.metric_type())?;
    if let [(labels, metric)] = &samples[..] {
        if labels.is_empty() {
            return metric.encode(family);
        }
    }
    for (labels, metric) in &samples {
        metric.encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

fn gauge(v: i64) -> ConstGauge<i64> {
    ConstGauge::new(v)
}

/// Counters, one per value of `label`.
fn by<const N: usize>(label: &'static str, counts: [(&str, u64); N]) -> [(Labels, ConstCounter<u64>); N] {
    counts.map(|(value, n)| (vec![(label, value.to_string())], counter(n)))
}

impl Collector for Run {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        let c = &s.counters;
        let none = Labels::new;
        let count = |state: Status| s.peers.iter().filter(|p| p.status == state).count() as i64;
        family(
            &mut e,
            "peers",
            "Peers in the run, by state",
            None,
            [
                (vec![("state", "registered".to_string())], gauge(count(Status::Registered))),
                (vec![("state", "catching_up".to_string())], gauge(count(Status::CatchingUp))),
                (vec![("state", "accepted".to_string())], gauge(count(Status::Accepted))),
            ],
        )?;
        family(&mut e, "groups", "Peer groups with a member", None, [(none(), gauge(s.groups.len() as i64))])?;
        family(&mut e, "topology_epoch", "The last topology issued", None, [(none(), gauge(s.epoch.0 as i64))])?;
        family(&mut e, "ring_epoch", "The topology in force", None, [(none(), gauge(s.ring_epoch.0 as i64))])?;
        family(&mut e, "peers_joined", "Peers registered", None, [(none(), counter(c.joins))])?;
        family(
            &mut e,
            "peers_removed",
            "Peers that left the run, by how",
            None,
            by("how", [("left", c.left), ("lost", c.lost), ("expelled", c.expelled)]),
        )?;
        family(
            &mut e,
            "joins_refused",
            "Joins refused, by reason",
            None,
            by("reason", [("authentication", c.auth_failures), ("tls", c.tls_failures), ("full", c.refused_full)]),
        )?;
        family(&mut e, "topologies", "Topologies issued", None, [(none(), counter(c.topologies))])?;
        family(
            &mut e,
            "votes",
            "Votes that passed, by kind",
            None,
            by("vote", [("update_topology", c.topology_votes), ("peers_pending", c.pending_votes)]),
        )?;
        family(
            &mut e,
            "syncs",
            "Shared-state syncs, by outcome",
            None,
            by("outcome", [("completed", c.syncs_completed), ("aborted", c.syncs_aborted)]),
        )?;
        family(
            &mut e,
            "collectives_aborted",
            "Collectives the master aborted after a participant failed",
            None,
            [(none(), counter(c.collectives_aborted))],
        )?;
        let ops = &s.totals.ops;
        let by_kind = |f: fn(&OpCounters) -> u64| {
            ops.values().map(move |o| (vec![("kind", o.kind.clone())], counter(f(o)))).collect::<Vec<_>>()
        };
        family(&mut e, "operations_started", "Operations peers started, by kind", None, by_kind(|o| o.started))?;
        family(&mut e, "operations_succeeded", "Operations that succeeded, by kind", None, by_kind(|o| o.succeeded))?;
        family(&mut e, "operations_failed", "Operations that failed, by kind", None, by_kind(|o| o.failed))?;
        family(
            &mut e,
            "operation_failures",
            "Failed operations, by cause",
            None,
            s.totals.failures.iter().map(|(cause, n)| (vec![("cause", cause.clone())], counter(*n))),
        )?;
        family(
            &mut e,
            "operation",
            "Bytes moved by operations that succeeded, by kind and direction",
            Some(Unit::Bytes),
            ops.values().flat_map(|o| {
                [("tx", o.tx_bytes), ("rx", o.rx_bytes)]
                    .map(|(d, n)| (vec![("kind", o.kind.clone()), ("direction", d.to_string())], counter(n)))
            }),
        )?;
        let running = s.peers.iter().filter_map(|p| p.report.as_ref()).map(|r| r.running.len()).sum::<usize>();
        family(&mut e, "operations_running", "Operations in flight", None, [(none(), gauge(running as i64))])?;
        family(
            &mut e,
            "operation_duration",
            "How long operations took, by kind",
            Some(Unit::Seconds),
            ops.values().map(|o| (vec![("kind", o.kind.clone())], Histogram(o.clone()))),
        )?;
        family(
            &mut e,
            "link_tx_bytes_per_second",
            "Bytes per second a peer sent to another while operations ran, in the topology in force",
            None,
            s.peers.iter().filter_map(|p| p.report.as_ref().map(|r| (p.peer, r))).flat_map(|(from, r)| {
                r.links.iter().map(move |l| {
                    (vec![("from", from.0.to_string()), ("to", l.peer.0.to_string())], gauge(l.tx_rate as i64))
                })
            }),
        )?;
        if let Some(m) = &s.matrix {
            let measured = |f: fn(&shoal_topology::Link) -> i64| {
                let mut samples = Vec::new();
                for (i, row) in m.links.iter().enumerate() {
                    for (j, l) in row.iter().enumerate() {
                        if let Some(l) = l {
                            let labels = vec![("from", m.members[i].0.to_string()), ("to", m.members[j].0.to_string())];
                            samples.push((labels, gauge(f(l))));
                        }
                    }
                }
                samples
            };
            family(
                &mut e,
                "link_measured_bytes_per_second",
                "Bytes per second measured by optimize_topology",
                None,
                measured(|l| l.bytes_per_s as i64),
            )?;
            family(
                &mut e,
                "link_measured_rtt_microseconds",
                "Round trips measured by optimize_topology",
                None,
                measured(|l| i64::from(l.rtt_us)),
            )?;
        }
        family(
            &mut e,
            "shared_state_revision",
            "Revision of each group's last completed shared-state sync",
            None,
            s.groups
                .iter()
                .filter_map(|g| g.revision.map(|r| (vec![("group", g.group.0.to_string())], gauge(r as i64)))),
        )?;
        Ok(())
    }
}

/// A histogram of counts the peers made: encoded as it is, never observed here.
#[derive(Debug)]
struct Histogram(OpCounters);

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: prometheus_client::encoding::MetricEncoder) -> std::fmt::Result {
        let o = &self.0;
        // Counts per bucket: the encoder makes them cumulative.
        let bounds = DURATION_BOUNDS_US.iter().map(|b| *b as f64 / 1e6).chain([f64::INFINITY]);
        let buckets: Vec<(f64, u64)> = bounds.zip(o.durations).collect();
        let count = o.durations.iter().sum();
        encoder.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            o.duration_sum_us as f64 / 1e6,
            count,
            &buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}
