//! The control connection to the master: a reader thread that feeds [`PeerView`], a heartbeat
//! thread, and blocking waits (always with a deadline) for what the API needs next.

use crate::error::{Error, Result};
use crate::Deadline;
use shoal_proto::master::heartbeat_interval;
use shoal_proto::peer::PeerView;
use shoal_transport::{read_message, write_message, TransportError};
use shoal_wire::{Epoch, Message, SessionId};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

/// How long a failed send waits for the reader to deliver what the master sent before closing.
const READER_DRAIN: Duration = Duration::from_millis(500);

/// Wakes a collective sleeping in `poll(2)` on its data streams when the master says something
/// that may end it (a verdict, a removed peer, an opened vote, expulsion, loss). Without it the
/// collective would notice only at the end of its poll slice.
pub(crate) struct Waker {
    rx: UnixStream,
    tx: UnixStream,
}

impl Waker {
    fn new() -> std::io::Result<Self> {
        let (rx, tx) = UnixStream::pair()?;
        rx.set_nonblocking(true)?;
        tx.set_nonblocking(true)?;
        Ok(Waker { rx, tx })
    }

    fn wake(&self) {
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

/// Shared between the API thread and the control threads.
pub(crate) struct Control {
    master_addr: String,
    pub waker: Waker,
    writer: Mutex<TcpStream>,
    state: Mutex<ControlState>,
    changed: Condvar,
}

pub(crate) struct ControlState {
    pub view: PeerView,
    master_addr: String,
    /// Why the master is considered lost, once it is.
    pub lost: Option<String>,
    last_heard: Instant,
    closing: bool,
}

impl Control {
    /// Starts the reader and heartbeat threads over `stream`.
    pub fn start(master_addr: &str, stream: TcpStream, heartbeat_timeout: Duration) -> Result<Arc<Self>> {
        let io_err = |source| Error::Io { context: "configuring the master connection".into(), source };
        // A frozen master must not block a write (and so a call) for longer than it takes to
        // declare the master lost.
        stream.set_write_timeout(Some(heartbeat_timeout)).map_err(io_err)?;
        let reader = stream.try_clone().map_err(io_err)?;
        let waker = Waker::new().map_err(|source| Error::Io { context: "creating a wake-up pipe".into(), source })?;
        let control = Arc::new(Control {
            master_addr: master_addr.to_string(),
            waker,
            writer: Mutex::new(stream),
            state: Mutex::new(ControlState {
                view: PeerView::default(),
                master_addr: master_addr.to_string(),
                lost: None,
                last_heard: Instant::now(),
                closing: false,
            }),
            changed: Condvar::new(),
        });
        let c = Arc::clone(&control);
        thread::Builder::new()
            .name("shoal-control".into())
            .spawn(move || c.read_loop(reader))
            .map_err(|source| Error::Io { context: "spawning the control thread".into(), source })?;
        let c = Arc::clone(&control);
        thread::Builder::new()
            .name("shoal-heartbeat".into())
            .spawn(move || c.heartbeat_loop(heartbeat_timeout))
            .map_err(|source| Error::Io { context: "spawning the heartbeat thread".into(), source })?;
        Ok(control)
    }

    /// Sends one message to the master.
    pub fn send(&self, message: &Message) -> Result<()> {
        let session = self.lock().view.registered.map_or(SessionId(0), |(_, s)| s);
        let mut w = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let e = match write_message(&mut *w, session, message) {
            Ok(()) => return Ok(()),
            // Nothing was sent: a string the user gave does not fit a message.
            Err(TransportError::Wire(e)) => {
                return Err(Error::InvalidArgument(format!("{} cannot be sent: {e}", message.name())))
            }
            Err(e) => e,
        };
        drop(w);
        // The master may have said why before it closed the connection (an expelled peer that
        // was frozen finds Kicked waiting when it wakes): let the reader deliver what is
        // buffered, so that the caller learns that rather than "connection closed".
        let state = self.lock();
        let drained = self
            .changed
            .wait_timeout_while(state, READER_DRAIN, |s| s.view.kicked.is_none() && s.lost.is_none())
            .unwrap_or_else(PoisonError::into_inner)
            .0;
        drop(drained);
        let reason = format!("sending {}: {e}", message.name());
        self.mark_lost(reason.clone());
        self.lock().check_connected()?;
        Err(Error::MasterUnreachable { addr: self.master_addr.clone(), reason })
    }

    /// Waits until `ready` returns `Some`, the master is lost, we are kicked, or `deadline`.
    pub fn wait_until<R>(
        &self,
        operation: &'static str,
        deadline: Deadline,
        mut ready: impl FnMut(&mut ControlState) -> Option<R>,
    ) -> Result<R> {
        let mut state = self.lock();
        loop {
            state.check_connected()?;
            if let Some(r) = ready(&mut state) {
                return Ok(r);
            }
            let left = deadline.left(operation)?;
            state = self.changed.wait_timeout(state, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// Records that we committed collective `seq` of `epoch` on our own, and tells the master if
    /// the view says it asked meanwhile. Best effort: a lost master is the next call's news.
    pub fn commit_on_our_own(&self, epoch: Epoch, seq: u64) {
        let answers: Vec<Message> = {
            let mut s = self.lock();
            s.view.commit_on_our_own(epoch, seq);
            std::iter::from_fn(|| s.view.poll_output()).collect()
        };
        for answer in answers {
            let _ = self.send(&answer);
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, ControlState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops the threads and closes the connection, telling the master we leave.
    pub fn close(&self) {
        {
            let mut s = self.lock();
            if s.closing {
                return;
            }
            s.closing = true;
        }
        // Best effort: the master also notices the closed connection.
        let _ = self.send(&Message::Leave);
        let _ = self.writer.lock().unwrap_or_else(PoisonError::into_inner).shutdown(Shutdown::Both);
        self.changed.notify_all();
    }

    fn mark_lost(&self, reason: String) {
        let mut s = self.lock();
        if s.lost.is_none() && !s.closing {
            log::warn!("master {} lost: {reason}", self.master_addr);
            s.lost = Some(reason);
        }
        drop(s);
        self.changed.notify_all();
        self.waker.wake();
    }

    fn read_loop(&self, mut stream: TcpStream) {
        loop {
            let message = match read_message(&mut stream) {
                Ok((_, m)) => m,
                Err(e) => return self.mark_lost(format!("control connection: {e}")),
            };
            let wake = !matches!(message, Message::Heartbeat | Message::PeersPendingResult { .. });
            let mut s = self.lock();
            s.last_heard = Instant::now();
            match s.view.handle_message(message) {
                Ok(event) => log::trace!("from master: {event:?}"),
                Err(e) => {
                    drop(s);
                    return self.mark_lost(e.to_string());
                }
            }
            let answers: Vec<Message> = std::iter::from_fn(|| s.view.poll_output()).collect();
            drop(s);
            for answer in answers {
                if self.send(&answer).is_err() {
                    return;
                }
            }
            self.changed.notify_all();
            if wake {
                self.waker.wake();
            }
        }
    }

    fn heartbeat_loop(&self, timeout: Duration) {
        let mut state = self.lock();
        loop {
            // As often as we need to watch the master, or as the master asks, whichever is more.
            let ours = heartbeat_interval(timeout);
            let interval = state.view.heartbeat_interval.map_or(ours, |theirs| theirs.min(ours));
            state = self.changed.wait_timeout(state, interval).unwrap_or_else(PoisonError::into_inner).0;
            if state.closing || state.lost.is_some() {
                return;
            }
            let silent = state.last_heard.elapsed();
            drop(state);
            if silent > timeout {
                self.mark_lost(format!("no message for {:.1} s", silent.as_secs_f64()));
                let _ = self.writer.lock().unwrap_or_else(PoisonError::into_inner).shutdown(Shutdown::Both);
                return;
            }
            if self.send(&Message::Heartbeat).is_err() {
                return;
            }
            state = self.lock();
        }
    }
}

impl ControlState {
    /// Fails if the master is lost or has expelled us.
    pub fn check_connected(&self) -> Result<()> {
        if let Some(reason) = &self.view.kicked {
            return Err(Error::Kicked { reason: reason.clone() });
        }
        if self.closing {
            return Err(Error::Closed);
        }
        if let Some(reason) = &self.lost {
            return Err(Error::MasterUnreachable { addr: self.master_addr.clone(), reason: reason.clone() });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_wire::PeerId;

    /// A peer expelled while frozen finds Kicked in its socket when it wakes, and the master has
    /// closed the connection. Whatever the API thread does first, it must learn that it was
    /// expelled and why, not merely that the connection is closed.
    #[test]
    fn a_failed_send_reports_the_expulsion_the_master_sent_first() {
        let listener = shoal_transport::listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let master = std::thread::spawn(move || {
            let (mut s, _) = shoal_transport::accept(&listener).unwrap();
            let registered = Message::Registered { peer: PeerId(4), session: SessionId(9), heartbeat_ms: 1000 };
            write_message(&mut s, SessionId(9), &registered).unwrap();
            let kicked = Message::Kicked { reason: "no message for 2.0 s".into() };
            write_message(&mut s, SessionId(9), &kicked).unwrap();
            // Closing with unread data resets the connection: the peer's writes fail.
            s.shutdown(Shutdown::Both).unwrap();
        });
        let stream = shoal_transport::connect(&addr, Duration::from_secs(1)).unwrap();
        let control = Control::start(&addr, stream, Duration::from_secs(10)).unwrap();
        master.join().unwrap();
        let mut outcome = Ok(());
        for _ in 0..50 {
            outcome = control.send(&Message::Heartbeat);
            if outcome.is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        match outcome {
            Err(Error::Kicked { reason }) => assert!(reason.contains("no message"), "{reason}"),
            other => panic!("expected Kicked, got {other:?}"),
        }
    }
}
