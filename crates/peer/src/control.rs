//! The driver of [`Peer`], the peer's protocol state machine: the control connection to the
//! master, a reader thread that feeds it the master's messages, a timer thread that feeds it the
//! passing of time, and the calling thread that carries out its [`Action`]s. Every decision is
//! the state machine's; this module moves bytes and wakes threads.

use crate::error::{Error, Result};
use crate::stats::Stats;
use shoal_proto::peer::{Action, Gone, Peer, PeerConfig, PeerEvent};
use shoal_transport::{read_message, write_message, Conn, TlsConfig, TransportError};
use shoal_wire::{Message, SessionId};
use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

/// How long a failed send waits for the reader to deliver what the master sent before closing.
const READER_DRAIN: Duration = Duration::from_millis(500);
/// How often a broken control connection is dialed again.
const REDIAL_EVERY: Duration = Duration::from_millis(50);

/// Readies a control connection: a frozen master must not block a write (and so a call) for
/// longer than it takes to declare the master lost. Returns its reading half.
fn split(stream: &Conn, heartbeat_timeout: Duration) -> std::io::Result<Conn> {
    stream.set_write_timeout(Some(heartbeat_timeout))?;
    stream.set_read_timeout(None)?;
    stream.try_clone()
}

/// Why a TLS session with the master failed, and what to check.
pub(crate) fn tls_refusal(e: &dyn std::fmt::Display) -> String {
    format!(
        "{e} (the master and every peer need TLS, with certificates of the same run's CA: SHOAL_TLS_CERT, \
         SHOAL_TLS_KEY, SHOAL_TLS_CA)"
    )
}

/// Wakes a collective sleeping in `poll(2)` on its data streams when the state machine may have
/// stopped it (a verdict, a removed peer, an opened vote, expulsion, loss, its bound). Without it
/// the collective would notice only at the end of its poll slice.
pub(crate) struct Waker {
    rx: UnixStream,
    tx: UnixStream,
}

impl Waker {
    pub fn new() -> std::io::Result<Self> {
        let (rx, tx) = UnixStream::pair()?;
        rx.set_nonblocking(true)?;
        tx.set_nonblocking(true)?;
        Ok(Waker { rx, tx })
    }

    pub fn wake(&self) {
        // A full pipe already holds a wake-up.
        let _ = (&self.tx).write(&[1]);
    }

    /// The end to poll for reading.
    pub fn fd(&self) -> &UnixStream {
        &self.rx
    }

    /// Consumes pending wake-ups.
    pub fn drain(&self) {
        let mut buf = [0u8; 64];
        while matches!((&self.rx).read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// Shared between the calling thread and the control threads.
pub(crate) struct Control {
    master_addr: String,
    pub waker: Waker,
    /// The control connection's writing half, and how many times it was dialed again: a failed
    /// write of an old connection is no news about the new one.
    writer: Mutex<(Conn, u64)>,
    /// TLS for the connection, when dialed again.
    tls: Option<TlsConfig>,
    peer: Mutex<Peer>,
    changed: Condvar,
    /// The counters sent in place of heartbeats.
    stats: Arc<Stats>,
    /// The copy of the shared state kept for newcomers, dropped when the master says so.
    snapshots: Arc<crate::fetch::Snapshots>,
}

impl Control {
    /// Starts the reader and timer threads over `stream`.
    pub fn start(
        master_addr: &str,
        stream: Conn,
        tls: Option<TlsConfig>,
        config: PeerConfig,
        stats: Arc<Stats>,
        snapshots: Arc<crate::fetch::Snapshots>,
    ) -> Result<Arc<Self>> {
        let io_err = |source| Error::Io { context: "configuring the master connection".into(), source };
        let reader = split(&stream, config.heartbeat_timeout).map_err(io_err)?;
        let waker = Waker::new().map_err(|source| Error::Io { context: "creating a wake-up pipe".into(), source })?;
        let control = Arc::new(Control {
            master_addr: master_addr.to_string(),
            waker,
            writer: Mutex::new((stream, 0)),
            tls,
            peer: Mutex::new(Peer::new(config, Instant::now())),
            changed: Condvar::new(),
            stats,
            snapshots,
        });
        let c = Arc::clone(&control);
        thread::Builder::new()
            .name("shoal-control".into())
            .spawn(move || c.read_loop(reader))
            .map_err(|source| Error::Io { context: "spawning the control thread".into(), source })?;
        let c = Arc::clone(&control);
        thread::Builder::new()
            .name("shoal-timer".into())
            .spawn(move || c.timer_loop())
            .map_err(|source| Error::Io { context: "spawning the timer thread".into(), source })?;
        Ok(control)
    }

    /// The state machine, for reading.
    pub fn lock(&self) -> MutexGuard<'_, Peer> {
        self.peer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Feeds the state machine one input from a thread other than the calling one (a message, a
    /// lost connection, `close`), then sends what it decided to tell the master and wakes every
    /// thread that waits on it: the calling thread, and a collective sleeping in `poll(2)`.
    pub fn input<R>(&self, f: impl FnOnce(&mut Peer, Instant) -> R) -> R {
        self.feed(f, true)
    }

    /// Feeds the state machine an input from the calling thread itself (its call, what its data
    /// plane did). Nobody else waits for those: only the timer thread is woken, and only if the
    /// state machine's next timeout came earlier. A collective's fast path wakes no thread.
    pub fn own_input<R>(&self, f: impl FnOnce(&mut Peer, Instant) -> R) -> R {
        self.feed(f, false)
    }

    fn feed<R>(&self, f: impl FnOnce(&mut Peer, Instant) -> R, wake: bool) -> R {
        let mut peer = self.lock();
        let before = peer.poll_timeout();
        let r = f(&mut peer, Instant::now());
        let earlier = peer.poll_timeout().is_some_and(|t| before.is_none_or(|b| t < b));
        self.flush(peer, wake || earlier);
        r
    }

    /// Sends, in order, what the state machine decided to tell the master; then, if `wake`, wakes
    /// whoever waits on it. The writer is taken before the state is released, so messages leave
    /// in the order they were decided.
    fn flush(&self, mut peer: MutexGuard<'_, Peer>, wake: bool) {
        let messages: Vec<Message> = std::iter::from_fn(|| peer.poll_output()).collect();
        if messages.is_empty() {
            drop(peer);
            if wake {
                self.wake();
            }
            return;
        }
        let session = peer.registered().map_or(SessionId(0), |(_, s)| s);
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        drop(peer);
        let mut failed = None;
        for message in &messages {
            match write_message(&mut writer.0, session, message) {
                Ok(()) => {}
                // The state machine's messages hold only what was checked before it took them.
                Err(TransportError::Wire(e)) => log::error!("{} cannot be sent: {e}", message.name()),
                Err(e) => {
                    failed = Some(format!("sending {}: {e}", message.name()));
                    break;
                }
            }
        }
        if failed.is_some() {
            // The reader sees it closed, and dials again if the state machine wants.
            let _ = writer.0.shutdown(Shutdown::Both);
        }
        let dialed = writer.1;
        drop(writer);
        if let Some(reason) = failed {
            return self.lose(reason, dialed);
        }
        if wake {
            self.wake();
        }
    }

    fn wake(&self) {
        self.changed.notify_all();
        self.waker.wake();
    }

    /// The connection to the master failed. It may have said why before it closed (an expelled
    /// peer that was frozen finds Kicked waiting when it wakes): the reader gets a moment to
    /// deliver what is buffered, so that the caller learns that rather than "connection closed".
    fn lose(&self, reason: String, dialed: u64) {
        let peer = self.lock();
        let peer = self
            .changed
            .wait_timeout_while(peer, READER_DRAIN, |p| p.gone().is_none() && p.reconnecting().is_none())
            .unwrap_or_else(PoisonError::into_inner)
            .0;
        drop(peer);
        if self.writer.lock().unwrap_or_else(PoisonError::into_inner).1 == dialed {
            self.input(|p, now| p.handle_disconnect(reason, now));
        }
    }

    /// Waits for the state machine's next action for the calling thread. Every call ends (its
    /// bound is the state machine's), so this returns.
    pub fn next_action(&self) -> Action {
        let mut peer = self.lock();
        loop {
            if let Some(action) = peer.poll_action() {
                return action;
            }
            let wait =
                peer.poll_timeout().map_or(Duration::from_secs(1), |t| t.saturating_duration_since(Instant::now()));
            if wait.is_zero() {
                self.tick(&mut peer);
                self.flush(peer, true);
                peer = self.lock();
                continue;
            }
            peer = self.changed.wait_timeout(peer, wait).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// The state machine's next action, if it has one.
    pub fn poll_action(&self) -> Option<Action> {
        self.lock().poll_action()
    }

    /// The state machine's next action, waiting for one until `deadline` at most, or until
    /// [`Control::interrupt`] is called; at once if `interrupted()` (checked under the lock that
    /// `interrupt` takes, so that an interrupt between the check and the wait is not lost).
    pub fn wait_action(&self, deadline: Instant, interrupted: impl Fn() -> bool) -> Option<Action> {
        let mut peer = self.lock();
        if let Some(action) = peer.poll_action() {
            return Some(action);
        }
        let wait = deadline.saturating_duration_since(Instant::now());
        if !wait.is_zero() && !interrupted() {
            peer = self.changed.wait_timeout(peer, wait).unwrap_or_else(PoisonError::into_inner).0;
        }
        peer.poll_action()
    }

    /// Waits until `f` finds what it looks for in the state machine, until `deadline` at most
    /// (then `Ok(None)`); fails at once if we are out of the run.
    pub fn wait_for<T>(&self, deadline: Instant, mut f: impl FnMut(&mut Peer) -> Option<T>) -> Result<Option<T>> {
        let mut peer = self.lock();
        loop {
            if let Some(found) = f(&mut peer) {
                return Ok(Some(found));
            }
            if let Some(gone) = peer.gone() {
                return Err(self.gone_error(gone));
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                return Ok(None);
            }
            peer = self.changed.wait_timeout(peer, wait).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// Wakes whoever waits on the state machine or sleeps on the data streams, to look around.
    pub fn interrupt(&self) {
        // Under the state machine's lock: a waiter checks why it would be woken, then waits,
        // with the lock held in between (see `wait_action`).
        let _peer = self.lock();
        self.wake();
    }

    /// Fails if the master is lost or has expelled us, or we left.
    pub fn check_connected(&self) -> Result<()> {
        match self.lock().gone() {
            Some(gone) => Err(self.gone_error(gone)),
            None => Ok(()),
        }
    }

    /// The error a call returns once this peer is out of the run.
    pub fn gone_error(&self, gone: Gone) -> Error {
        match gone {
            Gone::Kicked(reason) => Error::Kicked { reason },
            Gone::AuthFailed(reason) => Error::Authentication { reason },
            Gone::MasterLost(reason) => Error::MasterUnreachable { addr: self.master_addr.clone(), reason },
            Gone::Closed => Error::Closed,
        }
    }

    /// Leaves the run: tells the master, then closes the connection.
    pub fn close(&self) {
        if matches!(self.lock().gone(), Some(Gone::Closed)) {
            return;
        }
        let report = self.stats.report();
        self.input(|p, now| {
            p.attach_report(report);
            p.close(now)
        });
        let _ = self.writer.lock().unwrap_or_else(PoisonError::into_inner).0.shutdown(Shutdown::Both);
    }

    fn read_loop(&self, mut stream: Conn) {
        loop {
            let message = match read_message(&mut stream) {
                Ok((_, m)) => m,
                // In TLS 1.3 the master checks our certificate after our handshake ended: its
                // refusal arrives as the first thing we read. Before we are registered that is
                // a refusal of our credentials, not a lost master.
                Err(TransportError::Io(e))
                    if shoal_transport::tls::is_tls_error(&e) && self.lock().registered().is_none() =>
                {
                    let reason = tls_refusal(&e);
                    self.input(|p, now| p.handle_message(Message::AuthFailed { reason }, now)).ok();
                    return;
                }
                Err(e) => {
                    self.input(|p, now| p.handle_disconnect(format!("control connection: {e}"), now));
                    match self.redial() {
                        Some(next) => {
                            stream = next;
                            continue;
                        }
                        None => return,
                    }
                }
            };
            let event = self.input(|p, now| p.handle_message(message, now));
            match event {
                Ok(PeerEvent::DropSnapshot) => self.snapshots.drop_kept(),
                Ok(event) => log::trace!("from master: {event:?}"),
                Err(e) => return log::warn!("master {}: {e}", self.master_addr),
            }
        }
    }

    /// Dials the master again for as long as the state machine wants ([`Peer::reconnecting`]):
    /// once a new connection is challenged, it replaces the old one and `Rejoin` goes out on it.
    /// Returns its reading half; `None` once the state machine gave up (the master is lost).
    fn redial(&self) -> Option<Conn> {
        let mut tries = 0u32;
        loop {
            let until = self.lock().reconnecting()?;
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // The timer thread declares the master lost.
                thread::sleep(REDIAL_EVERY);
                continue;
            }
            tries += 1;
            match self.dial(left) {
                Ok((reader, nonce)) => {
                    log::debug!("master {} answered dial {tries}", self.master_addr);
                    self.input(|p, now| p.handle_reconnected(nonce, now));
                    return Some(reader);
                }
                Err(e) => {
                    log::debug!("dialing master {} again (try {tries}): {e}", self.master_addr);
                    thread::sleep(REDIAL_EVERY.min(left));
                }
            }
        }
    }

    /// One dial of the master: a connection whose challenge arrived within `left`, in place of
    /// the old one; its reading half and the challenge's nonce.
    fn dial(&self, left: Duration) -> std::result::Result<(Conn, [u8; 32]), String> {
        let mut stream = Conn::dial(&self.master_addr, left, self.tls.as_ref()).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + left;
        let nonce = match shoal_transport::read_message_until(&mut stream, deadline, shoal_wire::MAX_BODY_BYTES) {
            Ok((_, Message::Challenge { nonce })) => nonce,
            Ok((_, other)) => return Err(format!("it opened with {} instead of a challenge", other.name())),
            Err(e) => return Err(e.to_string()),
        };
        let heartbeat_timeout = self.lock().heartbeat_timeout();
        let reader = split(&stream, heartbeat_timeout).map_err(|e| e.to_string())?;
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let dialed = writer.1 + 1;
        *writer = (stream, dialed);
        Ok((reader, nonce))
    }

    /// Feeds the state machine the time that passed; a heartbeat due carries our counters.
    fn tick(&self, peer: &mut Peer) {
        let now = Instant::now();
        if peer.heartbeat_due(now) {
            peer.attach_report(self.stats.report());
        }
        peer.handle_timeout(now);
    }

    /// Feeds the state machine the passing of time: heartbeats, a silent master, bounds.
    fn timer_loop(&self) {
        let mut peer = self.lock();
        loop {
            let Some(due) = peer.poll_timeout() else {
                // Out of the run: a lost master's connection is shut, so nothing blocks on it.
                if matches!(peer.gone(), Some(Gone::MasterLost(_))) {
                    drop(peer);
                    let _ = self.writer.lock().unwrap_or_else(PoisonError::into_inner).0.shutdown(Shutdown::Both);
                }
                return;
            };
            let wait = due.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                self.tick(&mut peer);
                self.flush(peer, true);
                peer = self.lock();
            } else {
                peer = self.changed.wait_timeout(peer, wait).unwrap_or_else(PoisonError::into_inner).0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_proto::peer::CallError;
    use shoal_wire::{GroupId, PeerId};

    /// A control connection over `stream` to the master at `addr`, with no shared-state copy.
    fn start(addr: &str, stream: Conn, heartbeat_timeout: Duration) -> Arc<Control> {
        let config = PeerConfig { heartbeat_timeout, key: None, max_in_flight: 1, reconnect: false };
        let snapshots = crate::fetch::Snapshots::new(None, Duration::from_secs(5));
        Control::start(addr, stream, None, config, Arc::default(), snapshots).unwrap()
    }

    /// A driver about to wait for the state machine checks whether a caller wants it back, then
    /// waits: a caller's interrupt in between must wake it, not leave it asleep for the whole
    /// wait (a 50 ms stall of every `isend`/`recv` pair that hit it).
    #[test]
    fn an_interrupt_between_the_check_and_the_wait_is_not_lost() {
        let listener = shoal_transport::listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let master = std::thread::spawn(move || {
            let (mut s, _) = shoal_transport::accept(&listener).unwrap();
            write_message(&mut s, SessionId(0), &Message::Challenge { nonce: [1; 32] }).unwrap();
            s
        });
        let stream = Conn::dial(&addr, Duration::from_secs(1), None).unwrap();
        let control = start(&addr, stream, Duration::from_secs(60));
        let _master = master.join().unwrap();
        let started = Instant::now();
        let action = control.wait_action(started + Duration::from_secs(20), || {
            // The interrupt comes now, between the check and the wait (unless it waits for the
            // wait to begin, as it must).
            let (done, interrupted) = std::sync::mpsc::channel();
            let control = Arc::clone(&control);
            std::thread::spawn(move || {
                control.interrupt();
                let _ = done.send(());
            });
            let _ = interrupted.recv_timeout(Duration::from_millis(200));
            false
        });
        assert!(action.is_none());
        assert!(started.elapsed() < Duration::from_secs(10), "slept through the interrupt");
        // A waiter that is wanted already does not wait at all.
        let started = Instant::now();
        assert!(control.wait_action(started + Duration::from_secs(20), || true).is_none());
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    /// A peer expelled while frozen finds Kicked in its socket when it wakes, and the master has
    /// closed the connection. Whatever the calling thread does first, it must learn that it was
    /// expelled and why, not merely that the connection is closed.
    #[test]
    fn a_failed_send_reports_the_expulsion_the_master_sent_first() {
        let listener = shoal_transport::listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let master = std::thread::spawn(move || {
            let (mut s, _) = shoal_transport::accept(&listener).unwrap();
            write_message(&mut s, SessionId(0), &Message::Challenge { nonce: [1; 32] }).unwrap();
            // Unread bytes would make the close a reset, which may discard what we send.
            assert!(matches!(read_message(&mut s).unwrap().1, Message::Join { .. }));
            let registered =
                Message::Registered { peer: PeerId(4), session: SessionId(9), heartbeat_ms: 1000, data_key: [1; 32] };
            write_message(&mut s, SessionId(9), &registered).unwrap();
            let kicked = Message::Kicked { reason: "no message for 2.0 s".into() };
            write_message(&mut s, SessionId(9), &kicked).unwrap();
            // Closing with unread data resets the connection: the peer's writes fail.
            s.shutdown(Shutdown::Both).unwrap();
        });
        let stream = Conn::dial(&addr, Duration::from_secs(1), None).unwrap();
        let control = start(&addr, stream, Duration::from_secs(10));
        control.input(|p, now| p.connect(GroupId(0), "127.0.0.1:1".into(), false, Duration::from_secs(5), now));
        master.join().unwrap();
        let outcome = loop {
            match control.next_action() {
                Action::Done { result, .. } => break result,
                _ => continue,
            }
        };
        match outcome {
            Err(CallError::Gone(gone)) => match control.gone_error(gone) {
                Error::Kicked { reason } => assert!(reason.contains("no message"), "{reason}"),
                other => panic!("expected Kicked, got {other:?}"),
            },
            other => panic!("expected Kicked, got {other:?}"),
        }
    }
}
