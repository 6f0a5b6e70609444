//! The delay loop over a netlink socket.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::msg::{self, Message};
use crate::{Error, QueueDelay};

const NETLINK_NETFILTER: libc::c_int = 12;
const SOL_NETLINK: libc::c_int = 270;
const NETLINK_NO_ENOBUFS: libc::c_int = 5;
/// Room for notifications while the loop is busy: ~100 bytes each, so about 600k packets.
const RECV_BUFFER: libc::c_int = 64 << 20;

/// What [`run`] did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    /// Packets held and accepted.
    pub packets: u64,
    /// The most packets held at one time.
    pub max_held: usize,
}

struct Held {
    delay: Duration,
    queue: u16,
    /// (due, packet id), in arrival order: one delay per queue keeps it sorted by due time.
    packets: VecDeque<(Instant, u32)>,
}

/// Binds `queues` in the calling process's network namespace and holds every packet that
/// arrives on one for its delay, for `ttl`; then accepts what it still holds and returns.
/// Each queue holds at most `max_len` packets (more are accepted at once).
///
/// # Errors
/// The socket cannot be made, or the kernel refuses a queue (no `nfnetlink_queue` support,
/// or another program is bound to it).
pub fn run(queues: &[QueueDelay], ttl: Duration, max_len: u32) -> Result<Stats, Error> {
    let deadline = Instant::now() + ttl;
    let sock = open()?;
    let mut held: Vec<Held> = Vec::with_capacity(queues.len());
    for (i, q) in queues.iter().enumerate() {
        if held.iter().any(|h| h.queue == q.queue) {
            return Err(Error::DuplicateQueue(q.queue));
        }
        let seq = 2 * i as u32 + 1;
        request(&sock, &msg::bind(q.queue, seq), seq).map_err(|source| Error::Refused {
            what: "bind",
            queue: q.queue,
            source,
        })?;
        let flags = msg::NFQA_CFG_F_FAIL_OPEN | msg::NFQA_CFG_F_GSO;
        request(&sock, &msg::configure(q.queue, seq + 1, max_len, flags), seq + 1)
            .map_err(|source| Error::Refused { what: "configure", queue: q.queue, source })?;
        held.push(Held { delay: q.delay, queue: q.queue, packets: VecDeque::new() });
    }

    let mut stats = Stats::default();
    let mut buf = vec![0u8; 1 << 18];
    let result = loop {
        let now = Instant::now();
        if let Err(e) = release(&sock, &mut held, now) {
            break Err(e);
        }
        if now >= deadline {
            break Ok(stats);
        }
        let next = held.iter().filter_map(|h| h.packets.front().map(|p| p.0)).min().unwrap_or(deadline).min(deadline);
        if let Err(e) = wait_readable(&sock, next.saturating_duration_since(now)) {
            break Err(Error::Os { context: "waiting on the netfilter queue socket".into(), source: e });
        }
        match receive(&sock, &mut buf, &mut held) {
            Ok(n) => {
                stats.packets += n;
                stats.max_held = stats.max_held.max(held.iter().map(|h| h.packets.len()).sum());
            }
            Err(e) => break Err(Error::Os { context: "reading the netfilter queue socket".into(), source: e }),
        }
    };
    // Fail open: whatever is still held goes through now.
    let _ = release(&sock, &mut held, Instant::now() + Duration::from_secs(3600));
    result
}

fn open() -> Result<OwnedFd, Error> {
    let os = |context: &str| {
        let source = io::Error::last_os_error();
        Error::Os { context: context.into(), source }
    };
    // SAFETY: plain socket calls on a descriptor this function owns from the start.
    unsafe {
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            NETLINK_NETFILTER,
        );
        if fd < 0 {
            return Err(os("opening a netfilter netlink socket"));
        }
        let sock = OwnedFd::from_raw_fd(fd);
        let mut kernel: libc::sockaddr_nl = std::mem::zeroed();
        kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        let len = std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t;
        let mut me = kernel;
        me.nl_pid = 0; // the kernel picks our port id
        if libc::bind(fd, std::ptr::addr_of!(me).cast(), len) != 0 {
            return Err(os("binding the netlink socket"));
        }
        if libc::connect(fd, std::ptr::addr_of!(kernel).cast(), len) != 0 {
            return Err(os("connecting the netlink socket to the kernel"));
        }
        let set = |level, name, value: libc::c_int| {
            let size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            libc::setsockopt(fd, level, name, std::ptr::addr_of!(value).cast(), size)
        };
        if set(libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, RECV_BUFFER) != 0 {
            set(libc::SOL_SOCKET, libc::SO_RCVBUF, RECV_BUFFER);
        }
        // A lost notification is accepted by the kernel (fail-open); no need to hear of it.
        set(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1);
        Ok(sock)
    }
}

fn send(sock: &OwnedFd, bytes: &[u8]) -> io::Result<()> {
    loop {
        // SAFETY: `bytes` is a live slice of the given length.
        let n = unsafe { libc::send(sock.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), 0) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Sends a request and waits (up to 2 s) for its acknowledgement.
fn request(sock: &OwnedFd, bytes: &[u8], seq: u32) -> io::Result<()> {
    send(sock, bytes)?;
    let until = Instant::now() + Duration::from_secs(2);
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let now = Instant::now();
        if now >= until {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no acknowledgement from the kernel"));
        }
        wait_readable(sock, until - now)?;
        let Some(n) = recv(sock, &mut buf)? else { continue };
        for m in msg::parse(&buf[..n]) {
            if let Message::Ack { seq: s, error } = m {
                if s == seq {
                    return if error == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(-error)) };
                }
            }
        }
    }
}

fn wait_readable(sock: &OwnedFd, timeout: Duration) -> io::Result<()> {
    let mut pfd = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: one valid pollfd; a null signal mask leaves the mask unchanged.
    let rc = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

/// One datagram, or `None` when nothing is waiting.
fn recv(sock: &OwnedFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: `buf` is a live, writable slice of the given length.
    let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n >= 0 {
        return Ok(Some(n as usize));
    }
    let e = io::Error::last_os_error();
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
        // Notifications were lost (the kernel accepted those packets): carry on.
        _ if e.raw_os_error() == Some(libc::ENOBUFS) => Ok(None),
        _ => Err(e),
    }
}

/// Reads every waiting notification; each packet is due its queue's delay from now.
fn receive(sock: &OwnedFd, buf: &mut [u8], held: &mut [Held]) -> io::Result<u64> {
    let mut count = 0;
    while let Some(n) = recv(sock, buf)? {
        let now = Instant::now();
        for m in msg::parse(&buf[..n]) {
            if let Message::Packet { queue, id } = m {
                if let Some(h) = held.iter_mut().find(|h| h.queue == queue) {
                    h.packets.push_back((now + h.delay, id));
                    count += 1;
                }
            }
        }
    }
    Ok(count)
}

/// Accepts every packet due by `now`: one batch verdict per queue.
fn release(sock: &OwnedFd, held: &mut [Held], now: Instant) -> Result<(), Error> {
    for h in held.iter_mut() {
        let mut last = None;
        while let Some(&(due, id)) = h.packets.front() {
            if due > now {
                break;
            }
            last = Some(id);
            h.packets.pop_front();
        }
        if let Some(id) = last {
            send(sock, &msg::accept_through(h.queue, id))
                .map_err(|source| Error::Os { context: format!("accepting packets of queue {}", h.queue), source })?;
        }
    }
    Ok(())
}
