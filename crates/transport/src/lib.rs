//! shoal's IO seam: opening TCP connections the way every shoal socket must be opened
//! (`TCP_NODELAY` on both ends), reading and writing whole frames, waiting for readiness on
//! several sockets at once, and [`Lane`]s, the byte streams executors move data over (TCP, or
//! in memory for deterministic tests).
//!
//! This crate knows the frame format but not what any message means.
#![warn(missing_docs)]

pub mod dial;
pub mod gate;
pub mod greet;
pub mod lane;
pub mod shm;
mod stream;
pub mod tls;

pub use lane::Lane;
use shoal_wire::{FrameHeader, Message, SessionId, WireError, HEADER_BYTES, MAX_BODY_BYTES};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};
pub use stream::Stream;
pub use tls::{Conn, TlsConfig, TlsFiles, TlsSetupError};

/// What can go wrong reading or writing frames.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The other side closed the connection.
    #[error("connection closed by the other side")]
    Closed,
    /// The wait for data ran past its deadline.
    #[error("timed out")]
    TimedOut,
    /// The bytes received are not a valid frame.
    #[error("malformed frame: {0}")]
    Wire(#[from] WireError),
    /// A socket error.
    #[error("{0}")]
    Io(io::Error),
}

impl From<io::Error> for TransportError {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => TransportError::Closed,
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => TransportError::TimedOut,
            _ => TransportError::Io(e),
        }
    }
}

/// Opens a TCP connection to `addr` (`host:port`), trying every address it resolves to, with
/// `TCP_NODELAY` set.
///
/// # Errors
/// The last connection error, or `InvalidInput` if `addr` resolves to nothing.
pub fn connect(addr: &str, timeout: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::InvalidInput, format!("{addr} resolves to no address"));
    for sa in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&sa, timeout) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Caps the bytes a stream holds written but not yet sent (`TCP_NOTSENT_LOWAT`): past it, the
/// stream stops taking writes and stops polling writable. A pool of window-bound streams then
/// takes data only as fast as each drains, instead of one stream queueing megabytes that only
/// it can carry.
///
/// # Errors
/// `setsockopt` errors.
pub fn limit_unsent(s: &TcpStream, bytes: u32) -> io::Result<()> {
    let v = bytes as libc::c_int;
    // SAFETY: a valid socket and an option value of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_NOTSENT_LOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// How long a TCP socket has been sending, and how much of that its send was held back by a
/// window: the receiver's advertised one or its own send buffer (`TCP_INFO`'s
/// `tcpi_busy_time`, `tcpi_rwnd_limited` and `tcpi_sndbuf_limited`, microseconds since it
/// opened). A stream held back most of the time would have sent more beside other streams: a
/// long fat pipe wants more of them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SendTimes {
    /// Microseconds with data to send.
    pub busy_us: u64,
    /// Of those, microseconds held back by a window rather than by the network.
    pub window_limited_us: u64,
}

impl SendTimes {
    /// The fraction of the busy time between `before` and `self` that a window held back.
    pub fn window_limited_since(&self, before: &SendTimes) -> f64 {
        let busy = self.busy_us.saturating_sub(before.busy_us);
        let limited = self.window_limited_us.saturating_sub(before.window_limited_us);
        if busy == 0 {
            0.0
        } else {
            limited as f64 / busy as f64
        }
    }
}

/// The [`SendTimes`] of TCP socket `fd`.
///
/// # Errors
/// The `getsockopt` error, for a socket that is not TCP say.
pub fn send_times(fd: std::os::fd::RawFd) -> io::Result<SendTimes> {
    // SAFETY: `tcp_info` is plain old data; the kernel fills at most `len` bytes of it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: a buffer of `len` bytes for the option, and its length.
    let rc = unsafe {
        libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, (&mut info as *mut libc::tcp_info).cast(), &mut len)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(SendTimes { busy_us: info.tcpi_busy_time, window_limited_us: info.tcpi_rwnd_limited + info.tcpi_sndbuf_limited })
}

/// Raises this process's soft limit on open descriptors to its hard limit, once (later calls
/// return what the first found): pools of up to 256 streams to each of several members need
/// more than the 1,024 most systems start a process with. Returns the limit now in force.
///
/// # Errors
/// The limits could not be read or set.
pub fn raise_open_files_limit() -> io::Result<u64> {
    static RAISED: std::sync::OnceLock<Result<u64, i32>> = std::sync::OnceLock::new();
    let raised = RAISED.get_or_init(|| {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: plain calls on a struct this function owns.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                return Err(io::Error::last_os_error().raw_os_error().unwrap_or(0));
            }
            if limit.rlim_cur < limit.rlim_max {
                let wanted = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) != 0 {
                    return Err(io::Error::last_os_error().raw_os_error().unwrap_or(0));
                }
                limit.rlim_cur = limit.rlim_max;
            }
        }
        #[allow(clippy::unnecessary_cast)] // `rlim_t` is u64 here, narrower elsewhere
        Ok(limit.rlim_cur as u64)
    });
    raised.map_err(io::Error::from_raw_os_error)
}

/// Connections the kernel completes for a listener before it accepts them. Past it, a dialer's
/// SYN is dropped and sent again a second later: std's 128 was reached by 256 members' fetch
/// connections dialed at once, each then a second late.
pub const ACCEPT_BACKLOG: i32 = 1024;

/// Binds a listener on `addr` (`host:port`, port 0 for an ephemeral one), with a queue of
/// [`ACCEPT_BACKLOG`] (the kernel caps it at `net.core.somaxconn`).
///
/// # Errors
/// Resolution or bind errors.
pub fn listen(addr: &str) -> io::Result<TcpListener> {
    let listener = TcpListener::bind(addr)?;
    // Listening again only resizes the queue. SAFETY: the descriptor is the listener's own.
    if unsafe { libc::listen(listener.as_raw_fd(), ACCEPT_BACKLOG) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(listener)
}

/// Accepts one connection and sets `TCP_NODELAY` on it: Nagle's algorithm and delayed ACKs
/// would otherwise add tens of milliseconds to every small exchange.
///
/// # Errors
/// Accept errors.
pub fn accept(listener: &TcpListener) -> io::Result<(TcpStream, SocketAddr)> {
    let (s, a) = listener.accept()?;
    s.set_nodelay(true)?;
    Ok((s, a))
}

/// Writes one framed message.
///
/// # Errors
/// Socket errors.
pub fn write_message(stream: &mut impl Write, session: SessionId, message: &Message) -> Result<(), TransportError> {
    stream.write_all(&shoal_wire::encode_frame(session, message)?)?;
    Ok(())
}

/// Reads one framed message, blocking (subject to the stream's read timeout).
///
/// # Errors
/// [`TransportError::Closed`] at end of stream, [`TransportError::Wire`] for malformed bytes.
pub fn read_message(stream: &mut impl Read) -> Result<(SessionId, Message), TransportError> {
    read_message_within(stream, MAX_BODY_BYTES)
}

/// Reads one framed message whose body may be at most `max_body` bytes: a stranger's first frame
/// is small, and one announcing more is refused before anything is buffered. The body is read as
/// it arrives, so memory follows the bytes received, not the length announced.
///
/// # Errors
/// As [`read_message`]; [`WireError::BodyTooLarge`] over `max_body`.
pub fn read_message_within(stream: &mut impl Read, max_body: u32) -> Result<(SessionId, Message), TransportError> {
    let mut head = [0u8; HEADER_BYTES];
    stream.read_exact(&mut head)?;
    let header = FrameHeader::decode(&head)?;
    if header.body_len > max_body {
        return Err(WireError::BodyTooLarge { len: header.body_len, max: max_body }.into());
    }
    let len = header.body_len as usize;
    let mut body = Vec::with_capacity(len.min(BODY_READ_AHEAD));
    stream.take(len as u64).read_to_end(&mut body)?;
    if body.len() < len {
        return Err(TransportError::Closed);
    }
    Ok((header.session, shoal_wire::decode_body(&header, &body)?))
}

/// Reads one framed message of at most `max_body` body bytes from `stream`, by `deadline`: the
/// deadline holds however the bytes trickle in (a stranger sending one byte a second cannot hold
/// the connection open past it).
///
/// # Errors
/// As [`read_message_within`], plus [`TransportError::TimedOut`].
pub fn read_message_until<S: TimedStream>(
    stream: &mut S,
    deadline: Instant,
    max_body: u32,
) -> Result<(SessionId, Message), TransportError> {
    let result = read_message_within(&mut Until { stream: &mut *stream, deadline }, max_body);
    stream.set_read_timeout(None)?;
    result
}

/// A socket whose reads can be given a timeout (TCP, or Unix to a peer on the same host).
pub trait TimedStream {
    /// Sets the longest a read waits; `None` for no limit.
    ///
    /// # Errors
    /// `setsockopt` errors.
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// Reads, waiting at most the read timeout.
    ///
    /// # Errors
    /// As `read(2)`.
    fn read_timed(&mut self, buf: &mut [u8]) -> io::Result<usize>;
}

impl TimedStream for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }

    fn read_timed(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read(buf)
    }
}

impl TimedStream for std::os::unix::net::UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        std::os::unix::net::UnixStream::set_read_timeout(self, timeout)
    }

    fn read_timed(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read(buf)
    }
}

/// Bytes of a frame's body buffered before any arrived.
const BODY_READ_AHEAD: usize = 64 << 10;

/// A reader whose every read waits at most until `deadline`.
struct Until<'a, S> {
    stream: &'a mut S,
    deadline: Instant,
}

impl<S: TimedStream> Read for Until<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read_timed(buf)
    }
}

/// Readiness interest and result for one socket in [`poll`].
#[derive(Debug, Clone, Copy)]
pub struct PollFd {
    fd: i32,
    /// Wait until readable.
    pub want_read: bool,
    /// Wait until writable.
    pub want_write: bool,
    /// Readable (or closed, or in error) after the poll.
    pub readable: bool,
    /// Writable (or in error) after the poll.
    pub writable: bool,
}

impl PollFd {
    /// An entry for `socket` with no interest yet.
    pub fn new(socket: &impl AsRawFd) -> Self {
        Self::from_raw(socket.as_raw_fd())
    }

    /// An entry for descriptor `fd` with no interest yet.
    pub fn from_raw(fd: std::os::fd::RawFd) -> Self {
        PollFd { fd, want_read: false, want_write: false, readable: false, writable: false }
    }
}

/// Waits until at least one entry is ready or `timeout` passes; returns how many are ready.
///
/// # Errors
/// Errors of `poll(2)` other than `EINTR`, which counts as nothing ready.
pub fn poll(fds: &mut [PollFd], timeout: Duration) -> io::Result<usize> {
    let mut raw: Vec<libc::pollfd> = fds
        .iter()
        .map(|f| libc::pollfd {
            fd: if f.want_read || f.want_write { f.fd } else { -1 },
            events: (if f.want_read { libc::POLLIN } else { 0 }) | (if f.want_write { libc::POLLOUT } else { 0 }),
            revents: 0,
        })
        .collect();
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `raw` is a valid, exclusively borrowed array of `raw.len()` pollfd structs that
    // lives across the call; poll(2) only writes their `revents` fields.
    let n = unsafe { libc::poll(raw.as_mut_ptr(), raw.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted { Ok(0) } else { Err(e) };
    }
    let bad = libc::POLLERR | libc::POLLHUP | libc::POLLNVAL;
    for (f, r) in fds.iter_mut().zip(&raw) {
        f.readable = r.revents & (libc::POLLIN | bad) != 0;
        f.writable = r.revents & (libc::POLLOUT | bad) != 0;
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_open_files_limit_is_raised_to_the_hard_one() {
        let limit = raise_open_files_limit().unwrap();
        let mut now = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: a plain call on a struct the test owns.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut now) }, 0);
        assert_eq!((now.rlim_cur, now.rlim_cur), (limit as libc::rlim_t, now.rlim_max));
        assert_eq!(raise_open_files_limit().unwrap(), limit);
    }

    /// A burst of dials to a listener busy elsewhere completes, up to its backlog: with std's
    /// 128, the rest waited a second for their SYN to be sent again (their dials timed out here).
    #[test]
    fn a_listener_holds_a_burst_of_dials_before_it_accepts() {
        let l = listen("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        // The kernel caps every backlog at its own limit (4096 on current kernels).
        let cap = std::fs::read_to_string("/proc/sys/net/core/somaxconn").ok().and_then(|s| s.trim().parse().ok());
        let burst = 600.min(ACCEPT_BACKLOG as usize).min(cap.unwrap_or(usize::MAX));
        let dials: Vec<TcpStream> = (0..burst).map(|_| connect(&addr, Duration::from_millis(500)).unwrap()).collect();
        assert_eq!(dials.len(), burst);
    }

    /// Bytes a stream takes before a write would block, with its peer not reading.
    fn taken_until_full(limit: Option<u32>) -> usize {
        let l = listen("127.0.0.1:0").unwrap();
        let c = connect(&l.local_addr().unwrap().to_string(), Duration::from_secs(1)).unwrap();
        let (_s, _) = accept(&l).unwrap();
        if let Some(bytes) = limit {
            limit_unsent(&c, bytes).unwrap();
        }
        c.set_nonblocking(true).unwrap();
        let (chunk, mut taken) = (vec![0u8; 4096], 0);
        loop {
            match (&c).write(&chunk) {
                Ok(n) => taken += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return taken,
                Err(e) => panic!("{e}"),
            }
        }
    }

    #[test]
    fn a_stream_with_an_unsent_limit_stops_taking_writes_sooner() {
        // Loopback delivers into the peer's receive buffer first, so both take that much.
        let (limited, unlimited) = (taken_until_full(Some(16 << 10)), taken_until_full(None));
        assert!(limited < unlimited, "{limited} bytes with a 16 KiB limit, {unlimited} without");
        assert!(unlimited - limited >= 64 << 10, "{limited} bytes with a 16 KiB limit, {unlimited} without");
    }

    #[test]
    fn frames_cross_a_real_socket_and_garbage_is_named() {
        let l = listen("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let mut c = connect(&addr, Duration::from_secs(1)).unwrap();
        let (mut s, _) = accept(&l).unwrap();
        assert!(s.nodelay().unwrap() && c.nodelay().unwrap());
        write_message(&mut c, SessionId(9), &Message::Heartbeat).unwrap();
        assert_eq!(read_message(&mut s).unwrap(), (SessionId(9), Message::Heartbeat));
        c.write_all(&[0u8; HEADER_BYTES]).unwrap();
        assert!(matches!(read_message(&mut s), Err(TransportError::Wire(WireError::BadMagic { .. }))));
        let deadline = Instant::now() + Duration::from_millis(50);
        assert!(matches!(read_message_until(&mut s, deadline, MAX_BODY_BYTES), Err(TransportError::TimedOut)));
        drop(c);
        assert!(matches!(read_message(&mut s), Err(TransportError::Closed)));
    }

    /// A stranger dripping a byte at a time cannot hold a read past its deadline, and a frame
    /// announcing more than the reader accepts is refused at its header.
    #[test]
    fn a_deadline_holds_against_a_drip_and_a_limit_against_a_large_announcement() {
        let l = listen("127.0.0.1:0").unwrap();
        let mut c = connect(&l.local_addr().unwrap().to_string(), Duration::from_secs(1)).unwrap();
        let (mut s, _) = accept(&l).unwrap();
        let frame = shoal_wire::encode_frame(SessionId(1), &Message::Heartbeat).unwrap();
        let drip = std::thread::spawn(move || {
            for b in frame {
                if c.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(40));
            }
        });
        let started = Instant::now();
        let read = read_message_until(&mut s, started + Duration::from_millis(300), MAX_BODY_BYTES);
        assert!(matches!(read, Err(TransportError::TimedOut)), "{read:?}");
        assert!(started.elapsed() < Duration::from_millis(600), "the drip stretched the deadline");
        drop(s);
        drip.join().unwrap();

        let mut c = connect(&l.local_addr().unwrap().to_string(), Duration::from_secs(1)).unwrap();
        let (mut s, _) = accept(&l).unwrap();
        let big = Message::Kicked { reason: "x".repeat(200) };
        write_message(&mut c, SessionId(1), &big).unwrap();
        let read = read_message_within(&mut s, 64);
        assert!(matches!(read, Err(TransportError::Wire(WireError::BodyTooLarge { max: 64, .. }))), "{read:?}");
    }

    #[test]
    fn poll_reports_readable_sockets() {
        let l = listen("127.0.0.1:0").unwrap();
        let mut c = connect(&l.local_addr().unwrap().to_string(), Duration::from_secs(1)).unwrap();
        let (s, _) = accept(&l).unwrap();
        let mut fds = [PollFd::new(&s)];
        fds[0].want_read = true;
        assert_eq!(poll(&mut fds, Duration::from_millis(10)).unwrap(), 0);
        c.write_all(b"x").unwrap();
        assert_eq!(poll(&mut fds, Duration::from_secs(1)).unwrap(), 1);
        assert!(fds[0].readable);
    }
}
