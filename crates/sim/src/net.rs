//! The simulated data connections: the shipped engine's lanes, whose bytes the simulator carries.
//!
//! A [`Conn`] is one connection between two peers, each end a [`SimLane`] that the peer's
//! engine reads and writes like a non-blocking socket. What an end writes stays with it until the
//! simulator takes it ([`Conn::take_written`]) and delivers it to the other end after the
//! network's delay ([`Conn::deliver`]); so the seed decides when every byte arrives, and a fault
//! can land between any two of them. An end that is dropped (its peer crashed, or left the
//! topology) closes: the other end reads what was sent before, then the end of the stream.

use shoal_transport::Lane;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Bytes an end may have written and not yet had read at the other end: past it, a write
/// would block (the socket buffers of both ends, together).
pub const CAPACITY: usize = 64 << 10;

/// One connection's state, shared by its two ends and the simulator.
#[derive(Debug, Default)]
pub struct ConnState {
    /// Bytes each end wrote that the simulator has not carried yet.
    written: [Vec<u8>; 2],
    /// Bytes carried from each end and not delivered yet.
    in_flight: [usize; 2],
    /// Bytes delivered to each end and not read yet.
    readable: [VecDeque<u8>; 2],
    /// Each end was dropped; and whether the simulator carried its close.
    dropped: [bool; 2],
    close_carried: [bool; 2],
    /// Each end learned that the other closed: it reads the end of the stream, writes fail.
    ended: [bool; 2],
    /// The connection was reset: both ends fail.
    reset: bool,
}

/// A connection, as the simulator holds it.
#[derive(Debug, Clone)]
pub struct Conn(Arc<Mutex<ConnState>>);

impl Conn {
    /// A new connection, and its two ends (`name` names it in logs); each end raises its
    /// owner's flag ([`Dirty`]) when it writes or closes.
    pub fn open(name: &str, owners: [&Dirty; 2]) -> (Conn, SimLane, SimLane) {
        let conn = Conn(Arc::new(Mutex::new(ConnState::default())));
        let end = |end: usize| SimLane {
            conn: conn.clone(),
            end,
            name: format!("{name}[{end}]"),
            dirty: owners[end].clone(),
        };
        (conn.clone(), end(0), end(1))
    }

    fn state(&self) -> MutexGuard<'_, ConnState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What end `end` wrote since the last call, now in the network; and whether its close is to
    /// be carried after it (once).
    pub fn take_written(&self, end: usize) -> (Vec<u8>, bool) {
        let mut s = self.state();
        if s.written[end].is_empty() && (!s.dropped[end] || s.close_carried[end]) {
            return (Vec::new(), false);
        }
        let bytes = std::mem::take(&mut s.written[end]);
        s.in_flight[end] += bytes.len();
        let close = s.dropped[end] && !s.close_carried[end];
        s.close_carried[end] |= close;
        (bytes, close)
    }

    /// Bytes from end `from` arrive at the other end. Their buffer is kept for what end `from`
    /// writes next, if it has none: one allocation per piece carried less.
    pub fn deliver(&self, from: usize, mut bytes: Vec<u8>) {
        let mut s = self.state();
        s.in_flight[from] -= bytes.len();
        if !s.reset && !s.dropped[1 - from] {
            s.readable[1 - from].extend(&bytes);
        }
        if s.written[from].capacity() == 0 {
            bytes.clear();
            s.written[from] = bytes;
        }
    }

    /// End `from`'s close arrives at the other end.
    pub fn deliver_close(&self, from: usize) {
        self.state().ended[1 - from] = true;
    }

    /// Resets the connection: both ends fail from now on, and what was in flight is lost.
    pub fn reset(&self) {
        let mut s = self.state();
        s.reset = true;
        s.readable = Default::default();
    }

    /// Whether both ends are gone and nothing of it is in the network: it can be forgotten.
    pub fn finished(&self) -> bool {
        let s = self.state();
        s.dropped == [true, true] && s.close_carried == [true, true] && s.in_flight == [0, 0]
    }
}

/// Raised when a peer's lanes wrote or closed: only then is there anything to carry.
#[derive(Debug, Clone, Default)]
pub struct Dirty(Arc<AtomicBool>);

impl Dirty {
    /// Whether it was raised since the last call; lowers it.
    pub fn take(&self) -> bool {
        self.0.swap(false, Ordering::Relaxed)
    }

    fn raise(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// One end of a [`Conn`]: a lane of the shipped engine.
#[derive(Debug)]
pub struct SimLane {
    conn: Conn,
    end: usize,
    name: String,
    dirty: Dirty,
}

impl Read for SimLane {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut s = self.conn.state();
        let queue = &mut s.readable[self.end];
        if !queue.is_empty() {
            let n = buf.len().min(queue.len());
            let (front, back) = queue.as_slices();
            let from_front = n.min(front.len());
            buf[..from_front].copy_from_slice(&front[..from_front]);
            buf[from_front..n].copy_from_slice(&back[..n - from_front]);
            queue.drain(..n);
            return Ok(n);
        }
        if s.reset {
            Err(io::ErrorKind::ConnectionReset.into())
        } else if s.ended[self.end] {
            Ok(0)
        } else {
            Err(io::ErrorKind::WouldBlock.into())
        }
    }
}

impl Write for SimLane {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut s = self.conn.state();
        if s.reset {
            return Err(io::ErrorKind::ConnectionReset.into());
        }
        if s.ended[self.end] {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let (me, other) = (self.end, 1 - self.end);
        let held = s.written[me].len() + s.in_flight[me] + s.readable[other].len();
        let n = buf.len().min(CAPACITY.saturating_sub(held));
        if n == 0 && !buf.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        s.written[me].extend_from_slice(&buf[..n]);
        self.dirty.raise();
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Lane for SimLane {
    fn pollable(&self) -> Option<RawFd> {
        None
    }

    fn describe(&self) -> String {
        self.name.clone()
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

impl Drop for SimLane {
    fn drop(&mut self) {
        self.conn.state().dropped[self.end] = true;
        self.dirty.raise();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_arrive_only_when_carried_and_a_close_after_them() {
        let (conn, mut a, mut b) = Conn::open("a-b", [&Dirty::default(), &Dirty::default()]);
        assert_eq!(a.write(b"hello").unwrap(), 5);
        let mut buf = [0u8; 8];
        assert_eq!(b.read(&mut buf).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        drop(a);
        let (bytes, close) = conn.take_written(0);
        assert_eq!((bytes.as_slice(), close), (&b"hello"[..], true));
        conn.deliver(0, bytes);
        assert_eq!(b.read(&mut buf).unwrap(), 5);
        assert_eq!(b.read(&mut buf).unwrap_err().kind(), io::ErrorKind::WouldBlock, "the close is still in flight");
        conn.deliver_close(0);
        assert_eq!(b.read(&mut buf).unwrap(), 0);
        assert_eq!(b.write(b"x").unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn a_full_connection_blocks_the_writer_until_the_reader_takes_its_bytes() {
        let (conn, mut a, mut b) = Conn::open("a-b", [&Dirty::default(), &Dirty::default()]);
        let big = vec![7u8; CAPACITY + 10];
        assert_eq!(a.write(&big).unwrap(), CAPACITY);
        assert_eq!(a.write(&big).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        let (bytes, _) = conn.take_written(0);
        conn.deliver(0, bytes);
        let mut buf = vec![0u8; 100];
        assert_eq!(b.read(&mut buf).unwrap(), 100);
        assert_eq!(a.write(&big).unwrap(), 100);
        conn.reset();
        assert_eq!(b.read(&mut buf).unwrap_err().kind(), io::ErrorKind::ConnectionReset);
    }
}
