//! The master's HTTP endpoints: `/metrics` (Prometheus text format, names prefixed `shoal_`),
//! `/status` (the run as JSON) and `/` (a status page that draws the ring and the link matrix
//! from `/status`). Every answer is built from one [`RunStatus`] the driver hands over, so the
//! numbers of one answer always belong together; the driver is never blocked by a slow client.
//!
//! The server is a single thread over `poll(2)` with non-blocking sockets, so a stranger's
//! connections cost a slot each, never a thread: at most [`HTTP_MAX_CONNECTIONS`] are held, at most
//! [`HTTP_MAX_PER_SOURCE`] from one address, and each gets [`HTTP_DEADLINE`] from its accept to
//! the last byte of its answer, however slowly it sends. (tiny_http, used before, spawned a thread
//! per connection and stopped serving for good at its first failed accept: 10,000 idle
//! connections took it down.) httparse reads the request; prometheus-client encodes the metrics.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use serde_json::{json, Value};
use shoal_proto::loglimit::LogLimit;
use shoal_proto::master::{PeerStatus, RunStatus, Status};
use shoal_wire::{LateReport, OpCounters, PeerId, PeerReport, DURATION_BOUNDS_US};
use std::fmt::Write as _;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What prometheus-client writes: OpenMetrics text, which Prometheus scrapes.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The status page: one self-contained file, no external resources.
const PAGE: &str = include_str!("status.html");

/// Connections the status endpoint holds at once; past it, a new one is closed unanswered.
pub const HTTP_MAX_CONNECTIONS: usize = 64;
/// Connections held at once from one address.
pub const HTTP_MAX_PER_SOURCE: usize = 8;
/// From a connection's accept to the last byte of its answer: trickling cannot extend it.
pub const HTTP_DEADLINE: Duration = Duration::from_secs(5);
/// A request line and headers longer than this are refused (431).
pub const HTTP_MAX_HEAD_BYTES: usize = 8 << 10;
/// What is read and dropped after the answer (a request's body), so that closing does not reset
/// the connection before the client reads the answer.
const DRAIN_BYTES: usize = 64 << 10;
/// How long accepting pauses after it fails (out of descriptors): the pending connection stays
/// queued and would wake every poll.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// Connections taken off the listener's queue per round: a flood of new ones cannot keep the
/// server from the exchanges it holds.
const ACCEPTS_PER_ROUND: usize = 256;
/// How often `stop` is looked at.
const STOP_POLL: Duration = Duration::from_millis(200);

/// The status endpoint's limits, [`HTTP_MAX_CONNECTIONS`] and the others by default.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub connections: usize,
    pub per_source: usize,
    pub deadline: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { connections: HTTP_MAX_CONNECTIONS, per_source: HTTP_MAX_PER_SOURCE, deadline: HTTP_DEADLINE }
    }
}

/// One client connection and where its exchange stands.
struct Conn {
    stream: TcpStream,
    from: IpAddr,
    deadline: Instant,
    state: Exchange,
}

enum Exchange {
    /// Reading the request's head.
    Reading(Vec<u8>),
    /// Writing the answer from `at`.
    Writing { answer: Vec<u8>, at: usize },
    /// Answered and shut for writing; dropping what the client still sends until it closes.
    Draining(usize),
}

/// Answers requests on `listener` until `stop`, asking `status` for the run's state.
pub(crate) fn serve(
    listener: TcpListener,
    limits: Limits,
    stop: Arc<AtomicBool>,
    status: impl Fn() -> Option<RunStatus>,
) {
    if let Err(e) = listener.set_nonblocking(true) {
        log::warn!("status server stopped: {e}");
        return;
    }
    let mut conns: Vec<Conn> = Vec::new();
    // Refused connections and failed accepts are logged apart: a flood of the one hides no other.
    let (mut refusals, mut failures) = (LogLimit::default(), LogLimit::default());
    let mut accept_after = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        conns.retain(|c| c.deadline > now);
        let accepting = now >= accept_after;
        let mut fds = Vec::with_capacity(conns.len() + 1);
        let mut l = shoal_transport::PollFd::new(&listener);
        l.want_read = accepting;
        fds.push(l);
        for c in &conns {
            let mut f = shoal_transport::PollFd::new(&c.stream);
            f.want_read = !matches!(c.state, Exchange::Writing { .. });
            f.want_write = !f.want_read;
            fds.push(f);
        }
        let wake = conns.iter().map(|c| c.deadline).chain((!accepting).then_some(accept_after)).min();
        let wait = wake.map_or(STOP_POLL, |w| w.saturating_duration_since(now).min(STOP_POLL));
        if let Err(e) = shoal_transport::poll(&mut fds, wait) {
            log::warn!("status server stopped: poll: {e}");
            return;
        }
        let mut kept = Vec::with_capacity(conns.len());
        for (mut c, f) in conns.drain(..).zip(&fds[1..]) {
            if !(f.readable || f.writable) || step(&mut c, &status) {
                kept.push(c);
            }
        }
        conns = kept;
        if fds[0].readable {
            if let Err(e) = accept_all(&listener, limits, &mut conns, &mut refusals) {
                if let Some(note) = failures.admit(Instant::now()) {
                    log::warn!("status server cannot accept a connection: {e}{note}");
                }
                accept_after = Instant::now() + ACCEPT_BACKOFF;
            }
        }
    }
}

/// Accepts the queued connections (up to [`ACCEPTS_PER_ROUND`]), keeping those within `limits`
/// and closing the others.
fn accept_all(
    listener: &TcpListener,
    limits: Limits,
    conns: &mut Vec<Conn>,
    refusals: &mut LogLimit,
) -> io::Result<()> {
    for _ in 0..ACCEPTS_PER_ROUND {
        let (stream, from) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == ErrorKind::Interrupted || e.kind() == ErrorKind::ConnectionAborted => continue,
            Err(e) => return Err(e),
        };
        let from_there = conns.iter().filter(|c| c.from == from.ip()).count();
        let refused = if conns.len() >= limits.connections {
            Some(format!("{} connections are open", conns.len()))
        } else if from_there >= limits.per_source {
            Some(format!("{from_there} connections from {} are open", from.ip()))
        } else {
            None
        };
        if let Some(why) = refused {
            if let Some(note) = refusals.admit(Instant::now()) {
                log::warn!("status server closed a connection from {from} unanswered: {why}{note}");
            }
            continue;
        }
        if stream.set_nonblocking(true).is_ok() {
            let deadline = Instant::now() + limits.deadline;
            conns.push(Conn { stream, from: from.ip(), deadline, state: Exchange::Reading(Vec::new()) });
        }
        debug_assert!(conns.len() <= limits.connections);
    }
    Ok(())
}

/// Moves `c`'s exchange on as far as it goes without blocking; false once it is over.
fn step(c: &mut Conn, status: &impl Fn() -> Option<RunStatus>) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match &mut c.state {
            Exchange::Reading(head) => match (&c.stream).read(&mut buf) {
                Ok(0) => return false,
                Ok(n) => {
                    head.extend_from_slice(&buf[..n]);
                    if let Some(answer) = answer(head, status) {
                        c.state = Exchange::Writing { answer, at: 0 };
                    }
                }
                Err(e) => return e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted,
            },
            Exchange::Writing { answer, at } => match (&c.stream).write(&answer[*at..]) {
                Ok(n) => {
                    *at += n;
                    if *at == answer.len() {
                        // Only the write side: the client sees the end of the answer, and what it
                        // still sends is read below rather than answered with a reset.
                        let _ = c.stream.shutdown(Shutdown::Write);
                        c.state = Exchange::Draining(0);
                    }
                }
                Err(e) => return e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted,
            },
            Exchange::Draining(dropped) => match (&c.stream).read(&mut buf) {
                Ok(0) => return false,
                Ok(n) => {
                    *dropped += n;
                    if *dropped > DRAIN_BYTES {
                        return false;
                    }
                }
                Err(e) => return e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted,
            },
        }
    }
}

/// The whole answer to the request whose head begins `head`, or `None` while the head is not
/// complete yet.
fn answer(head: &[u8], status: &impl Fn() -> Option<RunStatus>) -> Option<Vec<u8>> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut request = httparse::Request::new(&mut headers);
    // Only the first HTTP_MAX_HEAD_BYTES count: a head that does not end within them is refused.
    let parsed = request.parse(&head[..head.len().min(HTTP_MAX_HEAD_BYTES)]);
    let (code, content_type, body) = match parsed {
        Ok(httparse::Status::Partial) if head.len() < HTTP_MAX_HEAD_BYTES => return None,
        Ok(httparse::Status::Partial) | Err(httparse::Error::TooManyHeaders) => {
            (431, "text/plain", format!("a request's head is at most {HTTP_MAX_HEAD_BYTES} bytes and 32 headers\n"))
        }
        Err(e) => (400, "text/plain", format!("malformed request: {e}\n")),
        Ok(httparse::Status::Complete(_)) => {
            let path = request.path.unwrap_or("/").split('?').next().unwrap_or("/");
            let get = matches!(request.method, Some("GET" | "HEAD"));
            match (get, path) {
                (false, _) => (405, "text/plain", "only GET is served\n".to_string()),
                (true, "/metrics" | "/status") => match status() {
                    Some(s) if path == "/metrics" => (200, OPENMETRICS, metrics(s)),
                    Some(s) => (200, "application/json", status_json(&s).to_string()),
                    None => (503, "text/plain", "the master is stopping\n".to_string()),
                },
                (true, "/") => (200, "text/html; charset=utf-8", PAGE.to_string()),
                (true, _) => (404, "text/plain", format!("no such page: {path} (try /, /status or /metrics)\n")),
            }
        }
    };
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        _ => "Service Unavailable",
    };
    let mut out = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if request.method != Some("HEAD") {
        out.extend_from_slice(body.as_bytes());
    }
    Some(out)
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
                "dialable": p.dialable,
                "seen": p.seen.map(|ip| ip.to_string()),
                "silent_s": p.silent.as_secs_f64(),
                "silence_bound_s": p.silence_bound.as_secs_f64(),
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
                "ring_epoch": g.ring_epoch.0,
                "phase": g.phase,
                "ring": g.ring.iter().map(id).collect::<Vec<_>>(),
                "matrix": g.matrix.as_ref().map(|m| json!({
                    "peers": m.members.iter().map(id).collect::<Vec<_>>(),
                    "bytes_per_s": m.links.iter().map(|row| row.iter().map(|l| l.map(|l| l.bytes_per_s)).collect::<Vec<_>>()).collect::<Vec<_>>(),
                    "rtt_us": m.links.iter().map(|row| row.iter().map(|l| l.map(|l| l.rtt_us)).collect::<Vec<_>>()).collect::<Vec<_>>(),
                })),
                "revision": g.revision,
                "hashes": g.hashes.iter().map(|(name, h)| (name.clone(), json!(hex(h)))).collect::<serde_json::Map<_, _>>(),
                "syncing": g.syncing,
                "snapshot": g.snapshot.as_ref().map(|(round, revision, held)| json!({
                    "round": round, "revision": revision, "held_by": held.iter().map(id).collect::<Vec<_>>(),
                })),
            })
        })
        .collect();
    let running: Vec<Value> = s
        .peers
        .iter()
        .flat_map(|p| p.report.iter().flat_map(move |r| r.running.iter().map(move |o| (p.peer, o))))
        .map(|(p, o)| json!({"peer": p.0, "kind": o.kind, "bytes": o.bytes, "elapsed_s": o.elapsed_ms as f64 / 1e3}))
        .collect();
    // The peers that were last in any recent collective, those that hold their group up most
    // first.
    let mut stragglers: Vec<(&PeerStatus, &LateReport)> =
        s.peers.iter().filter_map(|p| Some((p, &p.report.as_ref()?.late))).filter(|(_, l)| l.recent_last > 0).collect();
    stragglers.sort_by_key(|(p, l)| (std::cmp::Reverse(l.recent_last), std::cmp::Reverse(l.recent_median_us), p.peer));
    let stragglers: Vec<Value> = stragglers
        .into_iter()
        .map(|(p, l)| {
            json!({
                "peer": p.peer.0, "group": p.group.0, "straggler": l.straggler(),
                "recent_last": l.recent_last, "recent_ops": l.recent_ops,
                "recent_median_late_s": l.recent_median_us as f64 / 1e6,
            })
        })
        .collect();
    let c = &s.counters;
    json!({
        "session": format!("{:016x}", s.session.0),
        "epoch": s.epoch.0,
        "ring": s.ring.iter().map(id).collect::<Vec<_>>(),
        "peers": peers,
        "groups": groups,
        "running": running,
        "stragglers": stragglers,
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
        "late": {
            "collectives": r.late.ops,
            "last": r.late.last,
            "seconds": r.late.late_us as f64 / 1e6,
            "recent_collectives": r.late.recent_ops,
            "recent_last": r.late.recent_last,
            "recent_median_s": r.late.recent_median_us as f64 / 1e6,
            "straggler": r.late.straggler(),
        },
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
        family(
            &mut e,
            "ring_epoch",
            "The topology in force, by group",
            None,
            s.groups.iter().map(|g| (vec![("group", g.group.0.to_string())], gauge(g.ring_epoch.0 as i64))),
        )?;
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
        let reports =
            || s.peers.iter().filter_map(|p| Some((vec![("peer", p.peer.0.to_string())], &p.report.as_ref()?.late)));
        family(
            &mut e,
            "collectives_measured",
            "Collectives in which a peer learned how late every member called, by peer",
            None,
            reports().map(|(l, r)| (l, counter(r.ops))),
        )?;
        family(
            &mut e,
            "collectives_last",
            "Collectives in which a peer was last and held the others up, by peer",
            None,
            reports().map(|(l, r)| (l, counter(r.last))),
        )?;
        family(
            &mut e,
            "lateness",
            "How much later than the earliest member a peer called its collectives, in all, by peer",
            Some(Unit::Seconds),
            reports().map(|(l, r)| (l, ConstCounter::new(r.late_us as f64 / 1e6))),
        )?;
        family(
            &mut e,
            "straggler",
            "1 while a peer was last in most of its recent collectives, by peer",
            None,
            reports().map(|(l, r)| (l, gauge(i64::from(r.straggler())))),
        )?;
        let matrices: Vec<_> = s.groups.iter().filter_map(|g| g.matrix.as_ref()).collect();
        if !matrices.is_empty() {
            let measured = |f: fn(&shoal_topology::Link) -> i64| {
                let mut samples = Vec::new();
                for (m, (i, row)) in matrices.iter().flat_map(|m| m.links.iter().enumerate().map(move |r| (m, r))) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use std::thread;

    /// A status server with `limits` on a fresh port, which has no run to show (503).
    fn server(limits: Limits) -> (SocketAddr, Arc<AtomicBool>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        thread::spawn(move || serve(listener, limits, s, || None));
        (addr, stop)
    }

    /// A connection to `addr` from source address `from` (any 127/8 address is local).
    fn dial_from(addr: SocketAddr, from: &str) -> TcpStream {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket.bind(&format!("{from}:0").parse::<SocketAddr>().unwrap().into()).unwrap();
        socket.connect(&addr.into()).unwrap();
        let stream: TcpStream = socket.into();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        stream
    }

    /// Sends `request` and reads the whole answer; its status code and the answer.
    fn exchange(mut s: TcpStream, request: &[u8]) -> (u16, String) {
        s.write_all(request).unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        let code = answer.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
        (code, answer)
    }

    fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        exchange(dial_from(addr, "127.0.0.1"), format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
    }

    /// How long until the server closes `s` (reads 0 or a reset); panics past `bound`.
    fn closed_within(s: &mut TcpStream, bound: Duration) -> Duration {
        let started = Instant::now();
        s.set_read_timeout(Some(bound)).unwrap();
        let mut b = [0u8; 1024];
        loop {
            match s.read(&mut b) {
                Ok(0) => return started.elapsed(),
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return started.elapsed(),
                Err(e) => panic!("still open after {:?}: {e}", started.elapsed()),
            }
        }
    }

    #[test]
    fn pages_methods_and_malformed_requests_get_their_codes() {
        let (addr, stop) = server(Limits::default());
        let (code, page) = get(addr, "/");
        assert_eq!(code, 200);
        assert!(page.contains("Content-Type: text/html") && page.ends_with(PAGE), "{}", &page[..200]);
        assert_eq!(get(addr, "/status").0, 503, "no run to show");
        assert_eq!(get(addr, "/nothing?x=1").0, 404);
        let head = exchange(dial_from(addr, "127.0.0.1"), b"HEAD / HTTP/1.1\r\n\r\n").1;
        assert!(head.ends_with("\r\n\r\n") && head.contains(&format!("Content-Length: {}", PAGE.len())), "{head}");
        assert_eq!(exchange(dial_from(addr, "127.0.0.1"), b"GET / HTTP/1.1\r\nno colon\r\n\r\n").0, 400);
        let long = format!("GET / HTTP/1.1\r\nX: {}\r\n\r\n", "y".repeat(HTTP_MAX_HEAD_BYTES));
        assert_eq!(exchange(dial_from(addr, "127.0.0.1"), long.as_bytes()).0, 431);
        // A body after the head is read and dropped: the client gets the answer, not a reset.
        let post = format!("POST /status HTTP/1.1\r\nContent-Length: 40000\r\n\r\n{}", "z".repeat(40_000));
        assert_eq!(exchange(dial_from(addr, "127.0.0.1"), post.as_bytes()).0, 405);
        stop.store(true, Ordering::Relaxed);
    }

    #[test]
    fn a_request_trickled_a_byte_at_a_time_is_closed_at_its_deadline() {
        let deadline = Duration::from_millis(400);
        let (addr, stop) = server(Limits { deadline, ..Limits::default() });
        let mut slow = dial_from(addr, "127.0.0.1");
        let trickle = {
            let mut s = slow.try_clone().unwrap();
            thread::spawn(move || {
                for b in b"GET / HTTP/1.1\r\nX-Slow: ".iter().chain(std::iter::repeat(&b'y')) {
                    if s.write_all(&[*b]).is_err() {
                        return;
                    }
                    thread::sleep(Duration::from_millis(20));
                }
            })
        };
        // Served beside it meanwhile.
        assert_eq!(get(addr, "/").0, 200);
        let closed = closed_within(&mut slow, Duration::from_secs(3));
        assert!(closed < deadline + Duration::from_millis(500), "closed after {closed:?}");
        trickle.join().unwrap();
        stop.store(true, Ordering::Relaxed);
    }

    #[test]
    fn connections_past_the_caps_are_closed_at_once_and_others_are_still_served() {
        let limits = Limits { connections: 12, per_source: 4, deadline: Duration::from_secs(30) };
        let (addr, stop) = server(limits);
        // Four idle connections from each of three addresses fill the server.
        let mut held: Vec<TcpStream> = (0..3)
            .flat_map(|i| (0..4).map(move |_| i))
            .map(|i| dial_from(addr, &format!("127.0.0.{}", i + 2)))
            .collect();
        // Past the cap from one address, and past the total from a fourth one: closed unanswered.
        for from in ["127.0.0.2", "127.0.0.9"] {
            let mut extra = dial_from(addr, from);
            assert!(closed_within(&mut extra, Duration::from_secs(2)) < Duration::from_secs(2));
        }
        // Once one is released, a client from anywhere is answered again.
        drop(held.pop());
        thread::sleep(Duration::from_millis(100));
        assert_eq!(get(addr, "/").0, 200);
        stop.store(true, Ordering::Relaxed);
    }
}
