//! Lanes: the seam every data path runs over.
//!
//! A [`Lane`] is an ordered, reliable byte stream to one peer, driven without blocking: `read` and
//! `write` return [`io::ErrorKind::WouldBlock`] when they cannot go on, `read` returns 0 once the
//! other end closed and everything it sent was read. Executors move bytes over lanes and never
//! know what carries them: TCP ([`TcpStream`] is a lane), or the in-memory lanes of [`mem`], which
//! let tests step several peers' executors in one thread, deterministically, with backpressure,
//! fragmented IO, stalls and resets injected where they choose.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};

/// An ordered, reliable, non-blocking byte stream to one peer (see the module docs).
pub trait Lane: Read + Write + Send {
    /// The descriptor to `poll(2)` for this lane's readiness, or `None` where progress comes
    /// only from someone stepping the other end (in-memory lanes): the driver then retries.
    fn pollable(&self) -> Option<RawFd>;
    /// The `poll(2)` events (readable, writable) that say the lane may move, when the driver
    /// wants to `read` and to `write` it: the same by default; a lane woken by doorbells maps
    /// both to readable.
    fn poll_events(&self, read: bool, write: bool) -> (bool, bool) {
        (read, write)
    }
    /// Both ends, for logs.
    fn describe(&self) -> String;
    /// What carries it, for stats: `"tcp"`, `"shm"` or `"memory"`.
    fn kind(&self) -> &'static str;
    /// Lends the next `len` bytes where they lie, without copying them out, once all of them
    /// arrived: `Ok(Some(bytes))`, after which [`Lane::consume`] takes them; `Ok(None)` while
    /// some have not (a wake-up comes as for `read`). `Unsupported` where the lane cannot lend
    /// (read it with `read`), `UnexpectedEof` if it ended first.
    ///
    /// # Errors
    /// As above, or the lane failed.
    fn peek(&mut self, len: usize) -> io::Result<Option<&[u8]>> {
        let _ = len;
        Err(io::ErrorKind::Unsupported.into())
    }
    /// Called before the driver sleeps on [`Lane::pollable`] because the lane would block: makes
    /// sure the other end's next move wakes it. `Ok(false)` if the lane can move already (do
    /// not sleep). Lanes whose descriptor wakes by itself (TCP) have nothing to do.
    ///
    /// # Errors
    /// The lane failed.
    fn arm(&mut self) -> io::Result<bool> {
        Ok(true)
    }
    /// The process at the other end, where it runs on this host and the kernel vouches for it
    /// (shared-memory lanes: the doorbell socket's peer credentials): a receiver may then read a
    /// large transfer straight out of that process's memory ([`crate::shm::read_process`]).
    fn partner_pid(&self) -> Option<u32> {
        None
    }
    /// Takes the `len` bytes [`Lane::peek`] lent.
    ///
    /// # Errors
    /// The lane failed.
    fn consume(&mut self, len: usize) -> io::Result<()> {
        let _ = len;
        Err(io::ErrorKind::Unsupported.into())
    }
}

impl Lane for TcpStream {
    fn pollable(&self) -> Option<RawFd> {
        Some(self.as_raw_fd())
    }

    fn describe(&self) -> String {
        let addr = |a: io::Result<std::net::SocketAddr>| a.map_or_else(|_| "?".to_string(), |a| a.to_string());
        format!("{}->{}", addr(self.local_addr()), addr(self.peer_addr()))
    }

    fn kind(&self) -> &'static str {
        "tcp"
    }
}

pub mod mem {
    //! In-memory lanes for deterministic tests.
    //!
    //! [`pair`] makes the two ends of one connection; both carry bytes both ways, like a socket.
    //! A [`Faults`] shapes the connection: how many bytes it buffers before a write would block
    //! (backpressure), how many bytes one `read` or `write` moves at most (fragmentation), after
    //! how many bytes it resets (a peer killed mid-transfer). [`Control`] stalls and resumes it
    //! (a slow or frozen link) or resets it at a moment the test picks. Nothing here sleeps or
    //! spawns: whoever steps the executors decides what happens when.

    use super::Lane;
    use std::collections::VecDeque;
    use std::io::{self, Read, Write};
    use std::os::fd::RawFd;
    use std::sync::{Arc, Mutex, PoisonError};

    /// How an in-memory connection behaves.
    #[derive(Debug, Clone, Copy)]
    pub struct Faults {
        /// Bytes buffered in each direction before a write would block.
        pub capacity: usize,
        /// At most this many bytes per `read` or `write` call.
        pub max_io: usize,
        /// The connection resets once this many bytes crossed it (both directions together).
        pub reset_after: Option<u64>,
    }

    impl Default for Faults {
        fn default() -> Self {
            Faults { capacity: 64 << 10, max_io: usize::MAX, reset_after: None }
        }
    }

    #[derive(Debug, Default)]
    struct Link {
        /// Bytes in flight, per direction: `queues[0]` from end 0 to end 1.
        queues: [VecDeque<u8>; 2],
        /// End `i` closed: its peer reads the rest, then end of stream; writes to it fail.
        closed: [bool; 2],
        reset: bool,
        stalled: bool,
        carried: u64,
    }

    /// One end of an in-memory connection.
    #[derive(Debug)]
    pub struct MemLane {
        link: Arc<Mutex<Link>>,
        end: usize,
        faults: Faults,
        name: String,
        partner_pid: Option<u32>,
    }

    /// What a test does to a connection from outside.
    #[derive(Debug, Clone)]
    pub struct Control(Arc<Mutex<Link>>);

    /// The two ends of one connection named `name`, and its control.
    pub fn pair(name: &str, faults: Faults) -> (MemLane, MemLane, Control) {
        let link = Arc::new(Mutex::new(Link::default()));
        let end =
            |end| MemLane { link: Arc::clone(&link), end, faults, name: format!("{name}[{end}]"), partner_pid: None };
        (end(0), end(1), Control(Arc::clone(&link)))
    }

    impl Control {
        /// Stalls the connection (nothing moves: both ends see `WouldBlock`) or resumes it.
        pub fn stall(&self, stalled: bool) {
            self.0.lock().unwrap_or_else(PoisonError::into_inner).stalled = stalled;
        }

        /// Resets the connection: both ends fail from now on.
        pub fn reset(&self) {
            self.0.lock().unwrap_or_else(PoisonError::into_inner).reset = true;
        }

        /// Bytes that crossed it so far.
        pub fn carried(&self) -> u64 {
            self.0.lock().unwrap_or_else(PoisonError::into_inner).carried
        }
    }

    impl MemLane {
        /// Says that the other end runs in process `pid` ([`Lane::partner_pid`]): both ends of an
        /// in-memory pair run in this process, so a test passes its own pid to read a transfer
        /// straight out of the sender's buffer, as peers on one host do.
        #[must_use]
        pub fn with_partner_pid(mut self, pid: u32) -> Self {
            self.partner_pid = Some(pid);
            self
        }

        fn link(&self) -> std::sync::MutexGuard<'_, Link> {
            self.link.lock().unwrap_or_else(PoisonError::into_inner)
        }

        /// Counts up to `n` bytes crossing; `None` once the connection's budget is spent, which
        /// resets it.
        fn carry(&self, link: &mut Link, n: usize) -> Option<usize> {
            let left = self.faults.reset_after.map_or(u64::MAX, |b| b.saturating_sub(link.carried));
            if left == 0 {
                link.reset = true;
                return None;
            }
            let n = n.min(usize::try_from(left).unwrap_or(usize::MAX));
            link.carried += n as u64;
            Some(n)
        }
    }

    fn would_block() -> io::Error {
        io::Error::from(io::ErrorKind::WouldBlock)
    }

    fn reset() -> io::Error {
        io::Error::from(io::ErrorKind::ConnectionReset)
    }

    impl Read for MemLane {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let mut link = self.link();
            if link.reset {
                return Err(reset());
            }
            if buf.is_empty() {
                return Ok(0);
            }
            let from = 1 - self.end;
            if link.queues[from].is_empty() {
                return if link.closed[from] { Ok(0) } else { Err(would_block()) };
            }
            if link.stalled {
                return Err(would_block());
            }
            let n = buf.len().min(self.faults.max_io).min(link.queues[from].len());
            let Some(n) = self.carry(&mut link, n) else { return Err(reset()) };
            for (dst, src) in buf.iter_mut().zip(link.queues[from].drain(..n)) {
                *dst = src;
            }
            Ok(n)
        }
    }

    impl Write for MemLane {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let mut link = self.link();
            if link.reset {
                return Err(reset());
            }
            if link.closed[1 - self.end] {
                return Err(io::Error::from(io::ErrorKind::BrokenPipe));
            }
            if buf.is_empty() {
                return Ok(0);
            }
            let room = self.faults.capacity.saturating_sub(link.queues[self.end].len());
            if link.stalled || room == 0 {
                return Err(would_block());
            }
            let n = buf.len().min(self.faults.max_io).min(room);
            let Some(n) = self.carry(&mut link, n) else { return Err(reset()) };
            link.queues[self.end].extend(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Drop for MemLane {
        fn drop(&mut self) {
            let end = self.end;
            self.link().closed[end] = true;
        }
    }

    impl Lane for MemLane {
        fn pollable(&self) -> Option<RawFd> {
            None
        }

        fn describe(&self) -> String {
            self.name.clone()
        }

        fn kind(&self) -> &'static str {
            "memory"
        }

        fn partner_pid(&self) -> Option<u32> {
            self.partner_pid
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn bytes_cross_in_order_with_backpressure_and_fragments() {
            let (mut a, mut b, _) = pair("t", Faults { capacity: 5, max_io: 3, reset_after: None });
            assert_eq!(a.write(b"hello world").unwrap(), 3, "at most max_io per call");
            assert_eq!(a.write(b"lo world").unwrap(), 2, "then what the capacity leaves");
            assert_eq!(a.write(b" world").unwrap_err().kind(), io::ErrorKind::WouldBlock, "full");
            let mut got = [0u8; 16];
            assert_eq!(b.read(&mut got).unwrap(), 3);
            assert_eq!(&got[..3], b"hel");
            assert_eq!(b.read(&mut got).unwrap(), 2);
            assert_eq!(&got[..2], b"lo");
            assert_eq!(b.read(&mut got).unwrap_err().kind(), io::ErrorKind::WouldBlock, "empty");
            b.write_all(b"back").unwrap_or_else(|e| panic!("{e}"));
            drop(b);
            let mut back = Vec::new();
            loop {
                match a.read(&mut got) {
                    Ok(0) => break,
                    Ok(n) => back.extend_from_slice(&got[..n]),
                    Err(e) => panic!("{e}"),
                }
            }
            assert_eq!(back, b"back", "the rest, then end of stream");
            assert_eq!(a.write(b"x").unwrap_err().kind(), io::ErrorKind::BrokenPipe);
        }

        #[test]
        fn a_connection_resets_after_its_budget_or_on_command_and_stalls_on_command() {
            let (mut a, mut b, control) = pair("t", Faults { reset_after: Some(4), ..Faults::default() });
            assert_eq!(a.write(b"abcdef").unwrap(), 4);
            assert_eq!(a.write(b"ef").unwrap_err().kind(), io::ErrorKind::ConnectionReset);
            assert_eq!(b.read(&mut [0u8; 8]).unwrap_err().kind(), io::ErrorKind::ConnectionReset);
            assert_eq!(control.carried(), 4);

            let (mut a, mut b, control) = pair("t", Faults::default());
            a.write_all(b"ab").unwrap();
            control.stall(true);
            assert_eq!(b.read(&mut [0u8; 8]).unwrap_err().kind(), io::ErrorKind::WouldBlock);
            assert_eq!(a.write(b"c").unwrap_err().kind(), io::ErrorKind::WouldBlock);
            control.stall(false);
            assert_eq!(b.read(&mut [0u8; 8]).unwrap(), 2);
            control.reset();
            assert_eq!(a.write(b"c").unwrap_err().kind(), io::ErrorKind::ConnectionReset);
        }
    }
}
