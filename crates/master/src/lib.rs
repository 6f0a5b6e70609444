//! shoal's master: accepts control connections and drives [`shoal_proto::master::Master`] over
//! them. It coordinates membership and votes; it never carries tensor data.
//!
//! Threads: one accepts connections and greets them all (a TLS handshake, the first frame, by a
//! deadline: `shoal_transport::greet`; with TLS, up to four share the handshakes), one per
//! greeted connection reads and decodes frames, and one — the driver — owns the state machine: it
//! feeds it every input in arrival order, writes what it outputs, and fires its timers. All
//! protocol decisions are the state machine's.
#![warn(missing_docs)]
#![deny(unsafe_code)]

mod http;
mod state;

pub use http::{
    report_json, status_json, HTTP_DEADLINE, HTTP_MAX_CONNECTIONS, HTTP_MAX_HEAD_BYTES, HTTP_MAX_PER_SOURCE,
};

use shoal_proto::auth::{DataKey, RunKey};
use shoal_proto::loglimit::LogLimit;
use shoal_proto::master::{ConnId, Master, MasterConfig, MasterEvent, Output, RunStatus, PROBE_TIMEOUT};
use shoal_transport::gate::{Full, Gate};
use shoal_transport::greet::{greet_until, greeters, Greet, Greeted, Limits};
use shoal_transport::{read_message, write_message, Conn, TlsConfig, TransportError};
use shoal_wire::{Message, PeerId, SessionId};
use state::StateDir;
use std::collections::{BTreeMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Default time a silent peer is tolerated before it is declared dead.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(15);
/// Longest a write to one peer may block the driver: a frozen peer must not freeze the run.
const WRITE_TIMEOUT_MAX: Duration = Duration::from_secs(1);
/// Inputs already queued that the driver takes before it judges a deadline that is due: a
/// heartbeat timeout counts what reached the master, not how soon it was read.
const BACKLOG_BEFORE_DEADLINES: usize = 4096;
/// Connections accepted that have not yet said `Join` (greeted on the accept threads): more are
/// closed at once, so strangers holding connections open cannot exhaust descriptors.
pub const MAX_PENDING_CONNECTIONS: usize = 256;
/// Of those, at most this many from one address: one stranger cannot fill them all.
pub const MAX_PENDING_PER_SOURCE: usize = 64;
/// Places past [`MAX_PENDING_CONNECTIONS`] that only the addresses of members a restarted master
/// kept may take: strangers holding every slot cannot crowd them out.
pub const MAX_PENDING_RESERVED: usize = 64;
/// Longest a status request waits for the driver.
const STATUS_WAIT: Duration = Duration::from_secs(2);
/// The largest first frame a connection may announce: a `Join` is far smaller.
pub const MAX_GREETING_BODY: u32 = 4 << 10;
/// Newcomers' probes under way at once, a thread each (`Prober`).
pub const PROBES_AT_ONCE: usize = 32;
/// Probes waiting their turn at most; past it a newcomer is judged closed at once (a run joins
/// [`shoal_proto::master::MAX_PEERS`] peers at most, so this is a flood of strangers' joins).
pub const PROBES_WAITING_MAX: usize = 4096;

/// How to run a master.
#[derive(Debug, Clone)]
pub struct MasterOptions {
    /// `host:port` to listen on (port 0: ephemeral).
    pub listen: String,
    /// How long a silent peer is tolerated (`SHOAL_HEARTBEAT_TIMEOUT`). `None`: as long as its
    /// heartbeats so far say it may be silent (`shoal_proto::bounds`), from half of
    /// [`DEFAULT_HEARTBEAT_TIMEOUT`] to four times it.
    pub heartbeat_timeout: Option<Duration>,
    /// The run's secret (`SHOAL_SECRET`): every peer must prove it to join. `None`: anyone who
    /// reaches the master may join.
    pub secret: Option<Vec<u8>>,
    /// `host:port` to serve `/metrics`, `/status` and the status page on (`SHOAL_HTTP_ADDR`);
    /// `None`: no HTTP.
    pub http: Option<String>,
    /// Where to keep what a restarted master needs (`--state-dir`): a master started on a
    /// directory that holds a run carries it on. `None`: a run ends with its master.
    pub state_dir: Option<std::path::PathBuf>,
    /// TLS for every connection (`SHOAL_TLS_CERT`, `SHOAL_TLS_KEY`, `SHOAL_TLS_CA`): peers must
    /// present a certificate of the run's CA. `None`: plaintext.
    pub tls: Option<shoal_transport::TlsFiles>,
}

impl MasterOptions {
    /// Options for `listen`, with the heartbeat timeout from the environment or the default.
    ///
    /// # Errors
    /// If `SHOAL_HEARTBEAT_TIMEOUT` is malformed.
    pub fn from_env(listen: &str) -> Result<Self, shoal_config::ConfigError> {
        Ok(MasterOptions {
            listen: listen.to_string(),
            heartbeat_timeout: shoal_config::env_seconds("SHOAL_HEARTBEAT_TIMEOUT")?,
            secret: shoal_config::env_value("SHOAL_SECRET").map(String::into_bytes),
            http: shoal_config::env_value("SHOAL_HTTP_ADDR"),
            state_dir: None,
            tls: shoal_transport::TlsFiles::from_env()?,
        })
    }
}

/// A running master. Stops when [`MasterServer::stop`] is called or it is dropped.
pub struct MasterServer {
    addr: SocketAddr,
    http_addr: Option<SocketAddr>,
    session: SessionId,
    inputs: Sender<Input>,
    stop: Arc<AtomicBool>,
    driver: Option<JoinHandle<()>>,
}

enum Input {
    Connected(ConnId, Conn, SocketAddr),
    /// A newcomer's probe ended: whether a connection to its data address opened.
    Probed(PeerId, Result<(), String>),
    /// A connection's TLS handshake failed (logged where it happened).
    TlsRefused,
    Message(ConnId, SessionId, Message),
    Closed(ConnId, String),
    /// Wants the run's status.
    Status(Sender<RunStatus>),
    Stop,
    /// Holds the driver this long, as a starved or busy thread would (tests).
    #[cfg(test)]
    Stall(Duration),
}

impl MasterServer {
    /// Binds `options.listen` and starts serving.
    ///
    /// # Errors
    /// If the address cannot be bound or a thread cannot be spawned.
    pub fn start(options: MasterOptions) -> io::Result<MasterServer> {
        shoal_config::init_logging();
        if options.heartbeat_timeout.is_some_and(|t| t.is_zero()) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "heartbeat timeout must be positive"));
        }
        if options.secret.as_ref().is_some_and(Vec::is_empty) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "the run's secret is empty"));
        }
        let tls = options.tls.as_ref().map(TlsConfig::load).transpose().map_err(io::Error::other)?;
        let listener = shoal_transport::listen(&options.listen)?;
        let addr = listener.local_addr()?;
        let http = match &options.http {
            Some(a) => {
                Some(shoal_transport::listen(a).map_err(|e| io::Error::new(e.kind(), format!("HTTP on {a}: {e}")))?)
            }
            None => None,
        };
        let http_addr = http.as_ref().map(TcpListener::local_addr).transpose()?;
        let session = SessionId(RandomState::new().hash_one((std::process::id(), Instant::now())));
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let key = options.secret.as_deref().map(RunKey::from_secret);
        let state = options.state_dir.as_deref().map(StateDir::open).transpose()?;
        let kept = state.as_ref().map(StateDir::load).transpose()?.flatten();
        // Members coming back to a restarted master get in past strangers holding the slots.
        let members = kept.iter().flat_map(|run| &run.peers).filter_map(|p| p.addr.parse::<SocketAddr>().ok());
        let pending = Gate::trusting(
            MAX_PENDING_CONNECTIONS,
            MAX_PENDING_PER_SOURCE,
            members.map(|a| a.ip()).collect(),
            MAX_PENDING_RESERVED,
        );
        // A connection must say Join within the time a silent peer is tolerated.
        let heartbeat_timeout = options.heartbeat_timeout.unwrap_or(DEFAULT_HEARTBEAT_TIMEOUT);
        let limits = Limits { deadline: heartbeat_timeout, max_body: MAX_GREETING_BODY };
        let greeter = Greeter { inputs: tx.clone(), next_conn: Arc::default(), refusals: Arc::default() };
        for _ in 0..greeters(tls.is_some()) {
            let (listener, tls, stop, pending, mut greeter) =
                (listener.try_clone()?, tls.clone(), stop.clone(), pending.clone(), greeter.clone());
            thread::Builder::new().name("shoal-master-accept".into()).spawn(move || {
                if let Err(e) = greet_until(&listener, &stop, tls.as_ref(), &pending, limits, &mut greeter) {
                    log::error!("master stopped accepting: {e}");
                }
            })?;
        }
        let (session, data_key) = match &kept {
            Some(run) => (run.session, DataKey(run.data_key)),
            // The run's key for data connections: random, handed to every peer the master
            // registers.
            None => {
                let mut data_key = [0u8; 32];
                getrandom::fill(&mut data_key)
                    .map_err(|e| io::Error::other(format!("no randomness for the run's key: {e}")))?;
                (session, DataKey(data_key))
            }
        };
        let adaptive = options.heartbeat_timeout.is_none();
        let search_clock = Some(Instant::now as fn() -> Instant);
        let config = MasterConfig {
            session,
            heartbeat_timeout,
            adaptive,
            key,
            data_key,
            search_effort: 1.0,
            search_clock,
            probe_timeout: PROBE_TIMEOUT,
        };
        let master = match kept {
            Some(run) => Master::restore(config, run, Instant::now())
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("the kept run: {e}")))?,
            None => Master::new(config, Instant::now()),
        };
        let write_timeout = (heartbeat_timeout / 4).min(WRITE_TIMEOUT_MAX);
        let prober = Prober { inputs: tx.clone(), waiting: VecDeque::new(), running: Arc::new(AtomicUsize::new(0)) };
        let driver = thread::Builder::new()
            .name("shoal-master".into())
            .spawn(move || drive(master, rx, write_timeout, state, prober))?;
        if let Some(listener) = http {
            let (inputs, stop) = (tx.clone(), stop.clone());
            thread::Builder::new()
                .name("shoal-master-http".into())
                .spawn(move || http::serve(listener, http::Limits::default(), stop, || ask_status(&inputs)))?;
        }
        log::info!("master listening on {addr} (session {:016x})", session.0);
        if let Some(a) = http_addr {
            log::info!("status page on http://{a}/ (metrics on /metrics, JSON on /status)");
        }
        Ok(MasterServer { addr, http_addr, session, inputs: tx, stop, driver: Some(driver) })
    }

    /// The address of the HTTP endpoints, if they are served.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// The run as it stands (`None` once the master stopped).
    pub fn status(&self) -> Option<RunStatus> {
        ask_status(&self.inputs)
    }

    /// The run as JSON, as `/status` serves it.
    pub fn status_json(&self) -> Option<String> {
        self.status().map(|s| http::status_json(&s).to_string())
    }

    /// The address the master listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The run's session id.
    pub fn session(&self) -> SessionId {
        self.session
    }

    /// Stops serving and closes every connection. Idempotent.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.inputs.send(Input::Stop);
        if let Some(d) = self.driver.take() {
            let _ = d.join();
        }
    }
}

impl Drop for MasterServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Asks the driver for the run's status.
fn ask_status(inputs: &Sender<Input>) -> Option<RunStatus> {
    let (tx, rx) = mpsc::channel();
    inputs.send(Input::Status(tx)).ok()?;
    rx.recv_timeout(STATUS_WAIT).ok()
}

/// Greets the master's connections on its accept threads (`shoal_transport::greet`): the
/// driver hears of each once open, to send its challenge; one that then says its first frame in
/// time gets a reader thread.
#[derive(Clone)]
struct Greeter {
    inputs: Sender<Input>,
    next_conn: Arc<AtomicU64>,
    /// What strangers' connections log (`shoal_proto::loglimit`), shared by the accept threads.
    refusals: Arc<Mutex<LogLimit>>,
}

impl Greeter {
    /// Whether a stranger's refusal may be logged now, and what to append ([`LogLimit::admit`]).
    fn admit(&self) -> Option<String> {
        self.refusals.lock().unwrap_or_else(std::sync::PoisonError::into_inner).admit(Instant::now())
    }
}

impl Greet for Greeter {
    type Token = ConnId;

    fn opened(&mut self, writer: Conn, from: SocketAddr) -> Option<ConnId> {
        let conn = ConnId(self.next_conn.fetch_add(1, Ordering::Relaxed));
        log::debug!("connection {} from {from}", conn.0);
        self.inputs.send(Input::Connected(conn, writer, from)).ok()?;
        Some(conn)
    }

    fn greeted(&mut self, greeted: Greeted<ConnId>) -> Option<Greeted<ConnId>> {
        let Greeted { conn: stream, from, token: conn, session, message, .. } = greeted;
        let inputs = self.inputs.clone();
        let first = Input::Message(conn, session, message);
        let spawned = thread::Builder::new()
            .name("shoal-master-read".into())
            .spawn(move || read_loop(conn, from, stream, first, inputs));
        if let Err(e) = spawned {
            log::warn!("dropping connection {} from {from}: cannot spawn its reader: {e}", conn.0);
            let _ = self.inputs.send(Input::Closed(conn, format!("cannot spawn its reader: {e}")));
        }
        None
    }

    fn failed(&mut self, from: SocketAddr, conn: Option<ConnId>, error: TransportError) {
        let what =
            conn.map_or_else(|| format!("a connection from {from}"), |c| format!("connection {} from {from}", c.0));
        let note = self.admit();
        match (&error, note) {
            (TransportError::Closed, _) => log::debug!("{what} closed before its Join"),
            (TransportError::TimedOut, Some(note)) => log::warn!("{what}: no Join in time; closing{note}"),
            (_, Some(note)) => log::warn!("{what}: {error}; closing{note}"),
            (_, None) => {}
        }
        if matches!(&error, TransportError::Io(e) if shoal_transport::tls::is_tls_error(e)) {
            let _ = self.inputs.send(Input::TlsRefused);
        }
        if let Some(conn) = conn {
            let _ = self.inputs.send(Input::Closed(conn, error.to_string()));
        }
    }

    fn refused(&mut self, from: SocketAddr, full: Full) {
        if let Some(note) = self.admit() {
            log::warn!("refused a connection from {from} before its Join: {full}{note}");
        }
    }
}

/// Reads connection `conn` from `from`, greeted with `first`: every frame as it comes. What
/// cannot be read is logged with its reason, then the connection is closed.
fn read_loop(conn: ConnId, from: SocketAddr, mut stream: Conn, first: Input, inputs: Sender<Input>) {
    let mut input = first;
    loop {
        if inputs.send(input).is_err() {
            break;
        }
        input = match read_message(&mut stream) {
            Ok((session, message)) => Input::Message(conn, session, message),
            Err(e) => {
                match &e {
                    TransportError::Closed => log::debug!("connection {} from {from} closed", conn.0),
                    _ => log::warn!("connection {} from {from}: {e}; closing", conn.0),
                }
                let _ = inputs.send(Input::Closed(conn, e.to_string()));
                break;
            }
        };
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Newcomers' probes (`shoal_proto::master::Reach`): each dials a data address on a thread of
/// its own, at most [`PROBES_AT_ONCE`] at a time, the rest waiting their turn. Each thread ends
/// at its timeout; the master judges a probe that outlives its own clock's bound closed.
struct Prober {
    inputs: Sender<Input>,
    waiting: VecDeque<(PeerId, String, Duration)>,
    running: Arc<AtomicUsize>,
}

impl Prober {
    fn probe(&mut self, peer: PeerId, addr: String, timeout: Duration) {
        if self.waiting.len() < PROBES_WAITING_MAX {
            self.waiting.push_back((peer, addr, timeout));
        } else {
            let _ = self.inputs.send(Input::Probed(peer, Err("too many probes wait already".into())));
        }
        self.start();
    }

    /// Starts what waits, as far as the cap allows.
    fn start(&mut self) {
        while self.running.load(Ordering::Acquire) < PROBES_AT_ONCE {
            let Some((peer, addr, timeout)) = self.waiting.pop_front() else { return };
            self.running.fetch_add(1, Ordering::AcqRel);
            let (inputs, running) = (self.inputs.clone(), Arc::clone(&self.running));
            let spawned = thread::Builder::new().name("shoal-master-probe".into()).spawn(move || {
                let result = dial_once(&addr, timeout);
                running.fetch_sub(1, Ordering::AcqRel);
                let _ = inputs.send(Input::Probed(peer, result));
            });
            if let Err(e) = spawned {
                self.running.fetch_sub(1, Ordering::AcqRel);
                let _ = self.inputs.send(Input::Probed(peer, Err(format!("cannot spawn its probe: {e}"))));
            }
        }
    }
}

/// Opens one TCP connection to `addr` (`host:port`) within `timeout`, and closes it.
fn dial_once(addr: &str, timeout: Duration) -> Result<(), String> {
    let targets: Vec<SocketAddr> = addr.to_socket_addrs().map_err(|e| format!("{addr}: {e}"))?.collect();
    let mut last = format!("{addr} resolves to no address");
    for target in targets {
        match TcpStream::connect_timeout(&target, timeout) {
            Ok(stream) => {
                let _ = stream.shutdown(Shutdown::Both);
                return Ok(());
            }
            Err(e) => last = format!("{target}: {e}"),
        }
    }
    Err(last)
}

fn drive(
    mut master: Master,
    inputs: Receiver<Input>,
    write_timeout: Duration,
    state: Option<StateDir>,
    mut prober: Prober,
) {
    let mut streams: BTreeMap<ConnId, Conn> = BTreeMap::new();
    // A new run is kept at once (the first pass below), so that a restart finds its session.
    let mut saved = None;
    'run: loop {
        let wait =
            master.poll_timeout().map_or(Duration::from_secs(1), |t| t.saturating_duration_since(Instant::now()));
        let mut input = match inputs.recv_timeout(wait) {
            Ok(input) => Some(input),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => break,
        };
        // Before a deadline is judged, what already waits in the queue is taken (up to
        // `BACKLOG_BEFORE_DEADLINES`): a master that fell behind (its thread starved of CPU, or
        // busy re-planning a large ring) must not expel peers whose heartbeats wait in its own
        // queue. Once, 64 lab peers on 2 cores were expelled so after a 4 s re-plan.
        let mut taken = 0;
        while let Some(next) = input.take() {
            if !take(&mut master, &mut streams, next, write_timeout, &mut prober) {
                break 'run;
            }
            if taken < BACKLOG_BEFORE_DEADLINES && master.poll_timeout().is_some_and(|t| t <= Instant::now()) {
                input = inputs.try_recv().ok();
                taken += 1;
            }
        }
        let now = Instant::now();
        if master.poll_timeout().is_some_and(|t| t <= now) {
            master.handle_timeout(now);
        }
        if let (Some(state), false) = (&state, saved == Some(master.generation())) {
            // Before what changed it is told to anyone: a peer told it was admitted must find
            // itself in the state a restarted master reads.
            match state.save(&master.durable()) {
                Ok(()) => saved = Some(master.generation()),
                Err(e) => log::error!("cannot keep the run's state: {e}; a restarted master would lose the run"),
            }
        }
        while let Some(output) = master.poll_output() {
            match output {
                Output::Send { conn, message } => {
                    let Some(stream) = streams.get_mut(&conn) else {
                        continue;
                    };
                    if let Err(e) = write_message(stream, master.session(), &message) {
                        // The reader sees the shutdown and reports the connection closed. Peers
                        // that just left cause this routinely: not worth a warning.
                        log::info!("connection {}: cannot send {}: {e}", conn.0, message.name());
                        let _ = stream.shutdown(Shutdown::Both);
                    }
                }
                Output::Close { conn, reason } => {
                    if let Some(stream) = streams.remove(&conn) {
                        log::debug!("closing connection {}: {reason}", conn.0);
                        let _ = stream.shutdown(Shutdown::Both);
                    }
                }
                Output::Probe { peer, addr, timeout } => prober.probe(peer, addr, timeout),
                Output::Event(event) => log_event(&event),
            }
        }
    }
    for stream in streams.values() {
        let _ = stream.shutdown(Shutdown::Both);
    }
    log::info!("master stopped");
}

/// Feeds `master` one input; false on `Stop`.
fn take(
    master: &mut Master,
    streams: &mut BTreeMap<ConnId, Conn>,
    input: Input,
    write_timeout: Duration,
    prober: &mut Prober,
) -> bool {
    match input {
        Input::Connected(conn, stream, from) => {
            if let Err(e) = stream.set_write_timeout(Some(write_timeout)) {
                log::warn!("connection {}: {e}", conn.0);
            }
            let mut nonce = [0u8; 32];
            match getrandom::fill(&mut nonce) {
                Ok(()) => {
                    streams.insert(conn, stream);
                    master.handle_connect(Instant::now(), conn, nonce, Some(from.ip()));
                }
                Err(e) => {
                    log::error!("connection {}: no randomness for its challenge: {e}; closing", conn.0);
                    let _ = stream.shutdown(Shutdown::Both);
                }
            }
        }
        Input::TlsRefused => master.count_tls_failure(),
        Input::Probed(peer, result) => {
            master.handle_probe(Instant::now(), peer, result);
            prober.start();
        }
        Input::Message(conn, session, message) => {
            log::trace!("connection {}: {message:?}", conn.0);
            master.handle_message(Instant::now(), conn, session, message);
        }
        Input::Closed(conn, reason) => {
            master.handle_disconnect(Instant::now(), conn, &reason);
            streams.remove(&conn);
        }
        Input::Status(reply) => {
            let _ = reply.send(master.status(Instant::now()));
        }
        Input::Stop => return false,
        #[cfg(test)]
        Input::Stall(d) => thread::sleep(d),
    }
    true
}

fn log_event(event: &MasterEvent) {
    match event {
        MasterEvent::PeerRegistered { peer, group, addr } => {
            log::info!("{peer} registered in group {} at {addr}", group.0)
        }
        MasterEvent::PeerRemoved { peer, reason } => log::info!("{peer} removed: {reason}"),
        MasterEvent::TopologyIssued { group, epoch, members } => {
            log::debug!("group {}: topology {} issued: {members:?}", group.0, epoch.0)
        }
        MasterEvent::RingPlanned { group, members, cost_us, before_us } => {
            let ids: Vec<String> = members.iter().map(ToString::to_string).collect();
            log::info!(
                "group {}: ring ordered by measured links: [{}], {cost_us} µs per round of steps ({before_us} µs before)",
                group.0,
                ids.join(" -> ")
            )
        }
        MasterEvent::TopologyCommitted { group, epoch, members } => {
            let ids: Vec<String> = members.iter().map(ToString::to_string).collect();
            log::info!("group {}: topology {} committed: ring [{}]", group.0, epoch.0, ids.join(" -> "))
        }
        MasterEvent::Straggler { peer, group, now: true, late } => log::warn!(
            "group {}: {peer} holds the others up: last in {} of its {} most recent collectives, {:.1} ms late \
             at the median",
            group.0,
            late.recent_last,
            late.recent_ops,
            late.recent_median_us as f64 / 1e3
        ),
        MasterEvent::Straggler { peer, group, now: false, late } => log::info!(
            "group {}: {peer} no longer holds the others up (last in {} of its {} most recent collectives)",
            group.0,
            late.recent_last,
            late.recent_ops
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_wire::{GroupId, PeerId};
    use std::net::TcpStream;

    const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(300);

    /// A peer registered with `m` over a raw connection, with its session.
    fn joined(m: &MasterServer) -> (TcpStream, SessionId, PeerId) {
        let mut s = shoal_transport::connect(&m.local_addr().to_string(), Duration::from_secs(2)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        assert!(matches!(read_message(&mut s), Ok((_, Message::Challenge { .. }))));
        let join =
            Message::Join { group: GroupId(0), data_addr: "127.0.0.1:1".into(), proof: [0; 32], catch_up: false };
        write_message(&mut s, SessionId(0), &join).unwrap();
        match read_message(&mut s) {
            Ok((_, Message::Registered { peer, session, .. })) => (s, session, peer),
            other => panic!("not registered: {other:?}"),
        }
    }

    #[test]
    fn a_master_that_fell_behind_reads_its_queue_before_it_expels_anyone() {
        let options = MasterOptions {
            listen: "127.0.0.1:0".into(),
            heartbeat_timeout: Some(HEARTBEAT_TIMEOUT),
            secret: None,
            http: None,
            state_dir: None,
            tls: None,
        };
        let m = MasterServer::start(options).unwrap();
        let mut peers = [joined(&m), joined(&m)];
        // The driver is held past every peer's deadline while both keep sending signs of life:
        // they wait in its queue, the first peer's ahead of the second's.
        m.inputs.send(Input::Stall(3 * HEARTBEAT_TIMEOUT)).unwrap();
        let until = Instant::now() + 3 * HEARTBEAT_TIMEOUT;
        while Instant::now() < until {
            for (s, session, _) in &mut peers {
                write_message(s, *session, &Message::Heartbeat).unwrap();
            }
            thread::sleep(HEARTBEAT_TIMEOUT / 6);
        }
        let kept: Vec<PeerId> = m.status().unwrap().peers.iter().map(|p| p.peer).collect();
        assert_eq!(kept, peers.iter().map(|(.., id)| *id).collect::<Vec<_>>(), "a peer heard in time was expelled");
    }
}
