//! One thread greets every connection a listener accepts (TCP, or Unix from this host): its TLS
//! handshake if the run has TLS, then its first frame, each moved on as its socket allows
//! (`poll(2)`), all by an absolute deadline from the accept. A stranger who opens connections by the hundred, trickles bytes or
//! holds them silent costs a descriptor and a few hundred bytes each, never a thread; a [`Gate`]
//! caps how many greet at once, in all and from one address. What a first frame means is the
//! listener's ([`Greet`]): this module knows frames, not messages.

use crate::gate::{Full, Gate, Pass};
use crate::tls::{Opening, Step};
use crate::{poll, Conn, PollFd, TlsConfig, TransportError};
use shoal_wire::{FrameHeader, Message, SessionId, WireError, HEADER_BYTES};
use std::io::{self, Read};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the greeter looks at its stop flag, at least.
const STOP_POLL: Duration = Duration::from_millis(100);
/// How often a first frame its listener could not take yet is offered again.
const AGAIN_EVERY: Duration = Duration::from_millis(2);
/// How long accepting pauses when the process is out of descriptors (the greetings under way
/// go on, and free theirs as they end).
const EMFILE_PAUSE: Duration = Duration::from_millis(100);
/// Connections taken from the listener's queue at once, before the greetings under way move on.
const ACCEPT_BATCH: usize = 64;

/// Threads that may greet one TLS listener's connections at once ([`greeters`]).
pub const MAX_GREETERS: usize = 4;

/// How many threads should greet a listener's connections, each with [`greet_until`] on its own
/// handle to it: a TLS handshake costs the server about a millisecond of CPU, so with TLS up to
/// [`MAX_GREETERS`] cores share them (64 streams of a pool at once); without, one keeps up.
pub fn greeters(tls: bool) -> usize {
    match tls {
        true => std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, MAX_GREETERS),
        false => 1,
    }
}

/// How a greeter greets.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// From the accept to the first frame's last byte, handshake included.
    pub deadline: Duration,
    /// The largest body the first frame may announce.
    pub max_body: u32,
}

/// A listening socket a greeter accepts on.
pub trait Listening: AsRawFd {
    /// An accepted connection while it opens.
    type Handshake: Handshake;

    /// Makes `accept` return at once when no connection waits.
    ///
    /// # Errors
    /// `fcntl` errors.
    fn listen_nonblocking(&self) -> io::Result<()>;

    /// Accepts one connection, non-blocking: how it opens (or why it cannot), and the address
    /// the gate counts it under.
    ///
    /// # Errors
    /// Those of `accept(2)`: `WouldBlock` when none waits.
    fn accept_one(&self, tls: Option<&TlsConfig>) -> io::Result<(io::Result<Self::Handshake>, SocketAddr)>;
}

/// An accepted connection's opening, stepped without blocking.
pub trait Handshake: AsRawFd + Sized {
    /// The connection once open.
    type Conn: Read + AsRawFd;

    /// Moves the opening on as far as the socket allows.
    ///
    /// # Errors
    /// The other end hung up, or sent what is no handshake.
    fn step(&mut self) -> io::Result<Step>;

    /// The open connection, non-blocking, and another handle to it for its listener to write on.
    ///
    /// # Errors
    /// `dup(2)` failed.
    fn open(self) -> io::Result<(Self::Conn, Self::Conn)>;

    /// Makes an open connection blocking again, as its listener takes it.
    ///
    /// # Errors
    /// `fcntl` errors.
    fn block(conn: &mut Self::Conn) -> io::Result<()>;
}

impl Listening for TcpListener {
    type Handshake = Opening;

    fn listen_nonblocking(&self) -> io::Result<()> {
        self.set_nonblocking(true)
    }

    fn accept_one(&self, tls: Option<&TlsConfig>) -> io::Result<(io::Result<Opening>, SocketAddr)> {
        let (tcp, from) = self.accept()?;
        Ok((tcp.set_nodelay(true).and_then(|()| Opening::accept(tcp, tls)), from))
    }
}

impl Handshake for Opening {
    type Conn = Conn;

    fn step(&mut self) -> io::Result<Step> {
        Opening::step(self)
    }

    fn open(self) -> io::Result<(Conn, Conn)> {
        let conn = Opening::open(self);
        let writer = conn.try_clone_blocking()?;
        Ok((conn, writer))
    }

    fn block(conn: &mut Conn) -> io::Result<()> {
        conn.set_nonblocking(false)
    }
}

/// Connections from this host, all counted under one address (`0.0.0.0`).
impl Listening for UnixListener {
    type Handshake = UnixStream;

    fn listen_nonblocking(&self) -> io::Result<()> {
        self.set_nonblocking(true)
    }

    fn accept_one(&self, _: Option<&TlsConfig>) -> io::Result<(io::Result<UnixStream>, SocketAddr)> {
        let (stream, _) = self.accept()?;
        let this_host = SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0));
        Ok((stream.set_nonblocking(true).map(|()| stream), this_host))
    }
}

/// Open as accepted: a Unix socket has no TLS.
impl Handshake for UnixStream {
    type Conn = UnixStream;

    fn step(&mut self) -> io::Result<Step> {
        Ok(Step::Done)
    }

    fn open(self) -> io::Result<(UnixStream, UnixStream)> {
        let writer = self.try_clone()?;
        Ok((self, writer))
    }

    fn block(conn: &mut UnixStream) -> io::Result<()> {
        conn.set_nonblocking(false)
    }
}

/// A connection that sent its first frame, handed to its listener blocking again.
pub struct Greeted<T, C = Conn> {
    /// The connection, after the first frame (with TLS, what followed it stays in the session).
    pub conn: C,
    /// Who dialed.
    pub from: SocketAddr,
    /// What the listener kept of it when it opened ([`Greet::opened`]).
    pub token: T,
    /// The first frame.
    pub session: SessionId,
    /// The first frame's message.
    pub message: Message,
    /// When its greeting must end.
    pub deadline: Instant,
}

/// What a listener does with the connections (`C`) its greeter greets. Every call is on the
/// greeter's thread: none may block.
pub trait Greet<C = Conn> {
    /// What the listener keeps of a connection from its opening on.
    type Token;

    /// The connection from `from` is open (its TLS handshake done) and will be read for its
    /// first frame: what to keep of it, or `None` to close it. `writer` is another handle to it,
    /// for a listener that speaks first (a master's challenge): until the first frame is read,
    /// its socket does not block, so it may write a few bytes only.
    fn opened(&mut self, writer: C, from: SocketAddr) -> Option<Self::Token>;

    /// Its first frame arrived. `Some` gives it back, to be offered again a moment later (what
    /// it needs is not there yet), until its deadline.
    fn greeted(&mut self, greeted: Greeted<Self::Token, C>) -> Option<Greeted<Self::Token, C>>;

    /// Its greeting failed: the handshake, the frame, or the deadline (`token`: if it opened).
    fn failed(&mut self, from: SocketAddr, token: Option<Self::Token>, error: TransportError);

    /// The gate refused a connection from `from`; it is closed.
    fn refused(&mut self, from: SocketAddr, full: Full);
}

/// The connection a listener's handshake opens.
type ConnOf<L> = <<L as Listening>::Handshake as Handshake>::Conn;

/// Greets every connection `listener` accepts with `greet` until `stop` is set.
///
/// # Errors
/// If the listener cannot be made non-blocking.
pub fn greet_until<L: Listening, G: Greet<ConnOf<L>>>(
    listener: &L,
    stop: &AtomicBool,
    tls: Option<&TlsConfig>,
    gate: &Arc<Gate>,
    limits: Limits,
    greet: &mut G,
) -> io::Result<()> {
    listener.listen_nonblocking()?;
    let mut greetings: Vec<Greeting<G::Token, L::Handshake>> = Vec::new();
    let mut paused_until: Option<Instant> = None;
    let mut starved = Starved::default();
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        // A full gate leaves connections queued, not closed: an honest burst (64 members'
        // pools dialed at once) waits its turn. Other greeters sharing the gate free places
        // unseen by this one's poll: it looks again soon.
        let full = gate.full();
        let accepting = paused_until.is_none_or(|t| now >= t) && !full;
        let mut fds = Vec::with_capacity(greetings.len() + 1);
        let mut wake = now + STOP_POLL;
        for g in &greetings {
            let mut fd = PollFd::from_raw(g.fd());
            match &g.stage {
                Stage::Opening(_, want) => (fd.want_read, fd.want_write) = (*want == Step::Read, *want == Step::Write),
                Stage::Reading(..) => fd.want_read = true,
                Stage::Again(_) => wake = wake.min(now + AGAIN_EVERY),
            }
            wake = wake.min(g.deadline);
            fds.push(fd);
        }
        let mut listening = PollFd::new(listener);
        listening.want_read = accepting;
        fds.push(listening);
        if !accepting {
            wake = wake.min(resume_at(now, paused_until, full));
        }
        if let Err(e) = poll(&mut fds, wake.saturating_duration_since(now)) {
            log::warn!("greeting connections: poll: {e}");
            std::thread::sleep(AGAIN_EVERY);
            continue;
        }
        let mut fresh = Vec::new();
        if fds.last().is_some_and(|l| l.readable) {
            paused_until = accept(listener, tls, gate, limits, greet, &mut fresh);
            match starved.note(paused_until.is_some(), Instant::now()) {
                Some(Starving::Began) => {
                    log::warn!(
                        "out of file descriptors: not accepting, {EMFILE_PAUSE:?} at a time, until some are free"
                    )
                }
                Some(Starving::Ended { pauses, lasted }) => log::info!(
                    "accepting again after {pauses} pauses for want of file descriptors ({:.1} s)",
                    lasted.as_secs_f64()
                ),
                None => {}
            }
        }
        // A new connection's handshake starts at once: without TLS, it opens (a master then
        // speaks first).
        let mut ready: Vec<bool> = fds[..greetings.len()].iter().map(|f| f.readable || f.writable).collect();
        ready.resize(greetings.len() + fresh.len(), true);
        let now = Instant::now();
        let mut kept = Vec::with_capacity(ready.len());
        for (g, ready) in greetings.into_iter().chain(fresh).zip(ready) {
            if let Some(g) = g.advance(ready, now, limits.max_body, greet) {
                kept.push(g);
            }
        }
        greetings = kept;
    }
    Ok(())
}

/// When a greeter that is not accepting looks at its listener again: a place may free in a full
/// gate at any moment (on another greeter sharing it, unseen), a pause for descriptors ends when
/// it ends. Never before `now`: a pause that ended while the gate was full would spin the loop.
fn resume_at(now: Instant, paused_until: Option<Instant>, full: bool) -> Instant {
    match (full, paused_until) {
        (true, _) | (false, None) => now + AGAIN_EVERY,
        (false, Some(t)) => t.max(now),
    }
}

/// A run of accepts paused for want of descriptors: its start and its end are logged, not every
/// pause (ten a second while it lasts).
#[derive(Debug, Default)]
struct Starved {
    pauses: u64,
    since: Option<Instant>,
}

/// What to log of a run of pauses.
#[derive(Debug, PartialEq)]
enum Starving {
    Began,
    Ended { pauses: u64, lasted: Duration },
}

impl Starved {
    /// The last accept at `now` paused for want of descriptors (`paused`), or did not.
    fn note(&mut self, paused: bool, now: Instant) -> Option<Starving> {
        match (paused, self.since) {
            (true, None) => {
                (self.since, self.pauses) = (Some(now), 1);
                Some(Starving::Began)
            }
            (true, Some(_)) => {
                self.pauses += 1;
                None
            }
            (false, Some(since)) => {
                let pauses = std::mem::take(&mut self.pauses);
                self.since = None;
                Some(Starving::Ended { pauses, lasted: now.saturating_duration_since(since) })
            }
            (false, None) => None,
        }
    }
}

/// Takes what waits in the listener's queue; when out of descriptors, until when to pause.
fn accept<L: Listening, G: Greet<ConnOf<L>>>(
    listener: &L,
    tls: Option<&TlsConfig>,
    gate: &Arc<Gate>,
    limits: Limits,
    greet: &mut G,
    greetings: &mut Vec<Greeting<G::Token, L::Handshake>>,
) -> Option<Instant> {
    for _ in 0..ACCEPT_BATCH {
        if gate.full() {
            return None;
        }
        let (opening, from) = match listener.accept_one(tls) {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) || e.raw_os_error() == Some(libc::ENFILE) => {
                return Some(Instant::now() + EMFILE_PAUSE);
            }
            // Reset before we took it, say: the next one.
            Err(_) => continue,
        };
        let pass = match gate.enter(from.ip()) {
            Ok(pass) => pass,
            Err(full) => {
                greet.refused(from, full);
                continue;
            }
        };
        let deadline = Instant::now() + limits.deadline;
        match opening {
            Ok(opening) => greetings.push(Greeting {
                from,
                deadline,
                _pass: pass,
                stage: Stage::Opening(Box::new(opening), Step::Read),
            }),
            Err(e) => greet.failed(from, None, e.into()),
        }
    }
    None
}

/// One connection being greeted.
struct Greeting<T, H: Handshake> {
    from: SocketAddr,
    deadline: Instant,
    /// Its place in the gate, given back when the greeting ends.
    _pass: Pass,
    stage: Stage<T, H>,
}

enum Stage<T, H: Handshake> {
    /// The handshake, and what its socket waits for (a TLS session is large: boxed).
    Opening(Box<H>, Step),
    /// The first frame, as far as it came.
    Reading(H::Conn, T, Vec<u8>),
    /// The first frame came; its listener takes it a moment later.
    Again(Greeted<T, H::Conn>),
}

impl<T, H: Handshake> Greeting<T, H> {
    fn fd(&self) -> RawFd {
        match &self.stage {
            Stage::Opening(o, _) => o.as_raw_fd(),
            Stage::Reading(c, ..) => c.as_raw_fd(),
            Stage::Again(g) => g.conn.as_raw_fd(),
        }
    }

    /// Moves the greeting on as far as it goes without blocking (`ready`: its socket is);
    /// `None` once it ended, handed on or failed.
    fn advance<G: Greet<H::Conn, Token = T>>(
        self,
        ready: bool,
        now: Instant,
        max_body: u32,
        greet: &mut G,
    ) -> Option<Self> {
        let Greeting { from, deadline, _pass, mut stage } = self;
        let mut moved = ready;
        loop {
            stage = match stage {
                Stage::Opening(mut opening, _) if moved => match opening.step() {
                    Ok(Step::Done) => match (*opening).open() {
                        Ok((conn, writer)) => {
                            let token = greet.opened(writer, from)?;
                            Stage::Reading(conn, token, Vec::new())
                        }
                        Err(e) => {
                            greet.failed(from, None, e.into());
                            return None;
                        }
                    },
                    Ok(want) => {
                        stage = Stage::Opening(opening, want);
                        break;
                    }
                    Err(e) => {
                        greet.failed(from, None, e.into());
                        return None;
                    }
                },
                Stage::Reading(mut conn, token, mut bytes) if moved => {
                    match read_frame(&mut conn, &mut bytes, max_body) {
                        Ok(None) => {
                            stage = Stage::Reading(conn, token, bytes);
                            break;
                        }
                        Ok(Some((session, message))) => match H::block(&mut conn) {
                            Ok(()) => Stage::Again(Greeted { conn, from, token, session, message, deadline }),
                            Err(e) => {
                                greet.failed(from, Some(token), e.into());
                                return None;
                            }
                        },
                        Err(e) => {
                            greet.failed(from, Some(token), e);
                            return None;
                        }
                    }
                }
                Stage::Again(greeted) => {
                    stage = Stage::Again(greet.greeted(greeted)?);
                    break;
                }
                waiting => {
                    stage = waiting;
                    break;
                }
            };
            moved = true;
        }
        if now < deadline {
            return Some(Greeting { from, deadline, _pass, stage });
        }
        let token = match stage {
            Stage::Opening(..) => None,
            Stage::Reading(_, token, _) => Some(token),
            Stage::Again(greeted) => Some(greeted.token),
        };
        greet.failed(from, token, TransportError::TimedOut);
        None
    }
}

/// Reads on toward a whole first frame in `bytes`, never past it (what follows is the
/// listener's); `None` while the socket has no more yet.
fn read_frame(
    conn: &mut impl Read,
    bytes: &mut Vec<u8>,
    max_body: u32,
) -> Result<Option<(SessionId, Message)>, TransportError> {
    loop {
        let whole = if bytes.len() < HEADER_BYTES {
            HEADER_BYTES
        } else {
            let header = FrameHeader::decode(bytes[..HEADER_BYTES].try_into().expect("a header's bytes"))?;
            if header.body_len > max_body {
                return Err(WireError::BodyTooLarge { len: header.body_len, max: max_body }.into());
            }
            let whole = HEADER_BYTES + header.body_len as usize;
            if bytes.len() == whole {
                return Ok(Some((header.session, shoal_wire::decode_body(&header, &bytes[HEADER_BYTES..])?)));
            }
            whole
        };
        let had = bytes.len();
        bytes.resize(whole, 0);
        let read = conn.read(&mut bytes[had..]);
        bytes.truncate(had + *read.as_ref().unwrap_or(&0));
        match read {
            Ok(0) => return Err(TransportError::Closed),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{connect, write_message};
    use std::io::Write;
    use std::sync::mpsc::{self, Receiver, Sender};
    use std::thread;

    /// Out of descriptors, accepting pauses ten times a second: the log says when that began and
    /// when it ended, not every pause.
    #[test]
    fn a_run_of_pauses_for_descriptors_is_logged_at_its_start_and_end() {
        let (mut starved, t0) = (Starved::default(), Instant::now());
        assert_eq!(starved.note(false, t0), None);
        assert_eq!(starved.note(true, t0), Some(Starving::Began));
        for k in 1..50 {
            assert_eq!(starved.note(true, t0 + EMFILE_PAUSE * k), None, "pause {k} logged");
        }
        let lasted = EMFILE_PAUSE * 50;
        assert_eq!(starved.note(false, t0 + lasted), Some(Starving::Ended { pauses: 50, lasted }));
        assert_eq!(starved.note(false, t0 + lasted), None);
        assert_eq!(starved.note(true, t0 + lasted), Some(Starving::Began), "a new run is logged again");
    }

    /// A pause for descriptors that ended while the gate is full does not make the greeter spin:
    /// it looks again a moment later, as for any full gate.
    #[test]
    fn a_greeter_that_cannot_accept_waits_a_moment_before_it_looks_again() {
        let now = Instant::now();
        let ended = now - Duration::from_millis(50);
        assert_eq!(resume_at(now, Some(ended), true), now + AGAIN_EVERY);
        assert_eq!(resume_at(now, None, true), now + AGAIN_EVERY);
        assert_eq!(resume_at(now, Some(now + EMFILE_PAUSE), false), now + EMFILE_PAUSE);
    }

    enum Event {
        Opened,
        Greeted(Message, Conn),
        Failed(String),
        Refused,
    }

    /// Reports every step; gives each first frame back once (`again`) before taking it.
    struct Report {
        events: Sender<Event>,
        again: bool,
    }

    impl Greet for Report {
        type Token = ();

        fn opened(&mut self, _: Conn, _: SocketAddr) -> Option<()> {
            self.events.send(Event::Opened).unwrap();
            Some(())
        }

        fn greeted(&mut self, greeted: Greeted<()>) -> Option<Greeted<()>> {
            if std::mem::take(&mut self.again) {
                return Some(greeted);
            }
            self.events.send(Event::Greeted(greeted.message, greeted.conn)).unwrap();
            None
        }

        fn failed(&mut self, _: SocketAddr, _: Option<()>, error: TransportError) {
            self.events.send(Event::Failed(error.to_string())).unwrap();
        }

        fn refused(&mut self, _: SocketAddr, _: Full) {
            self.events.send(Event::Refused).unwrap();
        }
    }

    struct Served {
        addr: String,
        events: Receiver<Event>,
        stop: Arc<AtomicBool>,
        greeter: thread::JoinHandle<()>,
    }

    impl Served {
        fn next(&self) -> Event {
            self.events.recv_timeout(Duration::from_secs(5)).expect("an event within 5 s")
        }

        fn failure(&self) -> String {
            loop {
                match self.next() {
                    Event::Failed(e) => return e,
                    Event::Opened => {}
                    _ => panic!("expected a failure"),
                }
            }
        }

        fn end(self) {
            self.stop.store(true, Ordering::Relaxed);
            self.greeter.join().unwrap();
        }
    }

    fn serve(tls: Option<TlsConfig>, gate: Arc<Gate>, deadline: Duration, again: bool) -> Served {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, events) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let halt = Arc::clone(&stop);
        let greeter = thread::spawn(move || {
            let limits = Limits { deadline, max_body: 64 };
            greet_until(&listener, &halt, tls.as_ref(), &gate, limits, &mut Report { events: tx, again }).unwrap();
        });
        Served { addr, events, stop, greeter }
    }

    fn frame(message: &Message) -> Vec<u8> {
        shoal_wire::encode_frame(SessionId(4), message).unwrap()
    }

    /// A hundred silent connections and one trickling its frame a byte at a time cannot hold up
    /// a dialer that says its frame at once, nor outlive the deadline; what follows a first frame
    /// stays for the listener.
    #[test]
    fn silent_and_trickling_connections_hold_up_no_one_and_end_at_their_deadline() {
        let served = serve(None, Gate::new(200, 200), Duration::from_millis(400), false);
        let silent: Vec<_> = (0..100).map(|_| connect(&served.addr, Duration::from_secs(1)).unwrap()).collect();
        let mut drip = connect(&served.addr, Duration::from_secs(1)).unwrap();
        let dripping = thread::spawn(move || {
            for b in frame(&Message::Heartbeat) {
                if drip.write_all(&[b]).is_err() {
                    return;
                }
                thread::sleep(Duration::from_millis(30));
            }
        });
        let started = Instant::now();
        let mut honest = connect(&served.addr, Duration::from_secs(1)).unwrap();
        honest.write_all(&[frame(&Message::Heartbeat), frame(&Message::Leave)].concat()).unwrap();
        let mut conn = loop {
            match served.next() {
                Event::Opened => {}
                Event::Greeted(message, conn) => break (assert_eq!(message, Message::Heartbeat), conn).1,
                _ => panic!("only the honest dialer is through"),
            }
        };
        assert!(started.elapsed() < Duration::from_millis(300), "greeted in {:?}", started.elapsed());
        assert_eq!(crate::read_message(&mut conn).unwrap(), (SessionId(4), Message::Leave), "the next frame is kept");
        for _ in 0..101 {
            assert_eq!(served.failure(), "timed out");
        }
        assert!(started.elapsed() < Duration::from_millis(1500), "{:?} for a 400 ms deadline", started.elapsed());
        drop(silent);
        dripping.join().unwrap();
        served.end();
    }

    /// A frame announcing more than the limit ends its greeting at its header; a connection
    /// past the gate's share of its address is refused; a frame the listener cannot take yet is
    /// offered again.
    #[test]
    fn large_frames_and_crowds_are_refused_and_a_frame_waits_for_its_listener() {
        let served = serve(None, Gate::new(3, 2), Duration::from_secs(2), true);
        let mut big = connect(&served.addr, Duration::from_secs(1)).unwrap();
        big.write_all(&frame(&Message::Kicked { reason: "x".repeat(100) })).unwrap();
        assert!(served.failure().contains("exceeds the limit of 64"));
        let held: Vec<_> = (0..2).map(|_| connect(&served.addr, Duration::from_secs(1)).unwrap()).collect();
        assert!(matches!(served.next(), Event::Opened) && matches!(served.next(), Event::Opened));
        let _third = connect(&served.addr, Duration::from_secs(1)).unwrap();
        assert!(matches!(served.next(), Event::Refused));
        (&held[0]).write_all(&frame(&Message::Heartbeat)).unwrap();
        match served.next() {
            Event::Greeted(message, _) => assert_eq!(message, Message::Heartbeat, "taken the second time"),
            Event::Failed(e) => panic!("failed: {e}"),
            _ => panic!("another event"),
        }
        served.end();
    }

    /// Past the gate's cap in all, connections wait in the accept queue, not closed: each is
    /// greeted once a place frees.
    #[test]
    fn a_full_gate_leaves_connections_queued_until_a_place_frees() {
        let served = serve(None, Gate::new(2, 2), Duration::from_secs(5), false);
        let held: Vec<_> = (0..2).map(|_| connect(&served.addr, Duration::from_secs(1)).unwrap()).collect();
        assert!(matches!(served.next(), Event::Opened) && matches!(served.next(), Event::Opened));
        let mut queued: Vec<_> = (0..3).map(|_| connect(&served.addr, Duration::from_secs(1)).unwrap()).collect();
        for q in &mut queued {
            q.write_all(&frame(&Message::Heartbeat)).unwrap();
        }
        assert!(served.events.recv_timeout(Duration::from_millis(300)).is_err(), "taken past a full gate");
        drop(held);
        let mut greeted = 0;
        while greeted < 3 {
            match served.next() {
                Event::Greeted(message, _) => (greeted, _) = (greeted + 1, assert_eq!(message, Message::Heartbeat)),
                Event::Failed(e) => assert_eq!(e, "connection closed by the other side", "a held one hung up"),
                Event::Opened => {}
                Event::Refused => panic!("a queued connection was refused"),
            }
        }
        served.end();
    }

    /// With TLS, a handshake trickled a byte at a time ends at the deadline, a plaintext dialer
    /// is refused, a dialer that hangs up unheard (the master's probe) just closed, and a
    /// member's frame arrives over its session.
    #[test]
    fn tls_handshakes_are_greeted_on_the_same_thread_by_their_deadline() {
        let dir = std::env::temp_dir().join(format!("shoal-greet-tls-{}", std::process::id()));
        let made = crate::tls::make_certs(&dir, &["127.0.0.1".into()]).unwrap();
        let (_, cert, key) = made.hosts[0].clone();
        let config = TlsConfig::load(&crate::TlsFiles { cert, key, ca: made.ca }).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let served = serve(Some(config.clone()), Gate::new(10, 10), Duration::from_millis(500), false);
        let mut trickle = connect(&served.addr, Duration::from_secs(1)).unwrap();
        let started = Instant::now();
        let trickling = thread::spawn(move || {
            // The start of a ClientHello, a byte every 50 ms.
            for b in [0x16u8, 0x03, 0x01, 0x00, 0xff].iter().cycle().take(40) {
                if trickle.write_all(&[*b]).is_err() {
                    return;
                }
                thread::sleep(Duration::from_millis(50));
            }
        });
        let mut plain = connect(&served.addr, Duration::from_secs(1)).unwrap();
        plain.write_all(&frame(&Message::Heartbeat)).unwrap();
        assert!(served.failure().contains("TLS"), "plaintext is no handshake");
        drop(connect(&served.addr, Duration::from_secs(1)).unwrap());
        assert_eq!(served.failure(), "connection closed by the other side", "hung up unheard: no TLS failure");
        let mut member = Conn::dial(&served.addr, Duration::from_secs(2), Some(&config)).unwrap();
        write_message(&mut member, SessionId(4), &Message::Heartbeat).unwrap();
        loop {
            match served.next() {
                Event::Opened => {}
                Event::Greeted(message, _) => break assert_eq!(message, Message::Heartbeat),
                _ => panic!("the member is greeted first"),
            }
        }
        assert!(served.failure().contains("timed out"));
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(450) && took < Duration::from_millis(1500), "{took:?}");
        trickling.join().unwrap();
        served.end();
    }
}
