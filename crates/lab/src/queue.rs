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

/// The queues of one namespace, on the socket made there.
struct Socket {
    fd: OwnedFd,
    namespace: String,
    held: Vec<Held>,
}

/// Binds `queues`, each in its namespace, and holds every packet that arrives on one for its
/// delay, for `ttl`; then accepts what it still holds and returns. Each queue holds at most
/// `max_len` packets (more are accepted at once).
///
/// # Errors
/// A namespace cannot be entered, a socket cannot be made, or the kernel refuses a queue (no
/// `nfnetlink_queue` support, or another program is bound to it).
pub fn run(queues: &[QueueDelay], ttl: Duration, max_len: u32) -> Result<Stats, Error> {
    let deadline = Instant::now() + ttl;
    let mut sockets: Vec<Socket> = Vec::new();
    for q in queues {
        let namespace = q.namespace.clone().unwrap_or_else(|| "this namespace".into());
        let at = match sockets.iter().position(|s| s.namespace == namespace) {
            Some(at) => at,
            None => {
                let fd = open_in(q.namespace.as_deref())?;
                sockets.push(Socket { fd, namespace: namespace.clone(), held: Vec::new() });
                sockets.len() - 1
            }
        };
        let socket = &mut sockets[at];
        if socket.held.iter().any(|h| h.queue == q.queue) {
            return Err(Error::DuplicateQueue { queue: q.queue, namespace });
        }
        let seq = 2 * socket.held.len() as u32 + 1;
        let refused = |what| move |source| Error::Refused { what, queue: q.queue, source };
        request(&socket.fd, &msg::bind(q.queue, seq), seq).map_err(refused("bind"))?;
        let flags = msg::NFQA_CFG_F_FAIL_OPEN | msg::NFQA_CFG_F_GSO;
        request(&socket.fd, &msg::configure(q.queue, seq + 1, max_len, flags), seq + 1)
            .map_err(refused("configure"))?;
        socket.held.push(Held { delay: q.delay, queue: q.queue, packets: VecDeque::new() });
    }

    let mut stats = Stats::default();
    let mut buf = vec![0u8; 1 << 18];
    let mut polled: Vec<libc::pollfd> =
        sockets.iter().map(|s| libc::pollfd { fd: s.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
    let result = 'run: loop {
        let now = Instant::now();
        for s in &mut sockets {
            if let Err(e) = release(&s.fd, &mut s.held, now) {
                break 'run Err(e);
            }
        }
        if now >= deadline {
            break Ok(stats);
        }
        let next = sockets
            .iter()
            .flat_map(|s| s.held.iter().filter_map(|h| h.packets.front().map(|p| p.0)))
            .min()
            .unwrap_or(deadline)
            .min(deadline);
        if let Err(e) = wait_readable(&mut polled, next.saturating_duration_since(now)) {
            break Err(Error::Os { context: "waiting on the netfilter queue sockets".into(), source: e });
        }
        for (s, p) in sockets.iter_mut().zip(&polled) {
            if p.revents == 0 {
                continue;
            }
            match receive(&s.fd, &mut buf, &mut s.held) {
                Ok(n) => stats.packets += n,
                Err(e) => {
                    let context = format!("reading the netfilter queue socket in {}", s.namespace);
                    break 'run Err(Error::Os { context, source: e });
                }
            }
        }
        let held: usize = sockets.iter().flat_map(|s| s.held.iter().map(|h| h.packets.len())).sum();
        stats.max_held = stats.max_held.max(held);
    };
    // Fail open: whatever is still held goes through now.
    for s in &mut sockets {
        let _ = release(&s.fd, &mut s.held, Instant::now() + Duration::from_secs(3600));
    }
    result
}

/// A netfilter socket made inside `namespace` (a name under `/run/netns`), or in ours. The
/// namespace is entered by a thread of its own, so the caller's stays as it was.
fn open_in(namespace: Option<&str>) -> Result<OwnedFd, Error> {
    let Some(name) = namespace else { return open() };
    let path = std::path::Path::new("/run/netns").join(name);
    let ns = std::fs::File::open(&path)
        .map_err(|source| Error::Os { context: format!("opening namespace {}", path.display()), source })?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // SAFETY: `ns` is an open namespace file; only this short-lived thread moves.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    let source = io::Error::last_os_error();
                    return Err(Error::Os { context: format!("entering namespace {name}"), source });
                }
                open()
            })
            .join()
            .expect("opening a socket does not panic")
    })
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
        let mut polled = [libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        wait_readable(&mut polled, until - now)?;
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

/// Waits until one of `fds` is readable or `timeout` passed; each one's `revents` says which.
fn wait_readable(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<()> {
    fds.iter_mut().for_each(|p| p.revents = 0);
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: valid pollfds; a null signal mask leaves the mask unchanged.
    let rc = unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
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
