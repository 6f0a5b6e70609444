//! Shared-memory lanes between processes on one host.
//!
//! A shared-memory lane carries bytes one way, like every data stream shoal dials: the dialer
//! writes, the acceptor reads. Its bytes go through a ring in a `memfd` segment both processes
//! map; a Unix stream socket between them carries the segment's descriptor once (`SCM_RIGHTS`)
//! and then only *doorbells*, single bytes that wake a sleeping end. The socket is what makes the
//! lane safe to block on:
//!
//! - **Wake-ups.** An end that finds nothing to do sets its `sleeping` flag, looks once more, and
//!   polls the socket; the other end, after moving the ring's cursor, swaps the flag off and
//!   rings if it was on (both sides order the flag against the cursor with `SeqCst` fences, so
//!   one of them always sees the other).
//! - **A dead partner.** The kernel closes a killed process's socket: the reader then sees end
//!   of stream once it has read every byte the writer put in the ring, and the writer gets
//!   `BrokenPipe` at its next wait for room. Nobody spins on a dead peer's memory: every wait is
//!   a `poll(2)` on the socket.
//! - **Clean-up.** The segment has no name: it lives while a process maps it or holds its
//!   descriptor, so a crashed run leaves nothing behind in `/dev/shm`.
//!
//! Layout of a segment: one page of header (the writer's cursor, the reader's cursor and each
//! end's `sleeping` flag, each on its own cache line, then a magic and the ring's capacity),
//! then the ring. Cursors count bytes since the lane opened; the ring position is the cursor
//! modulo the capacity.

use crate::lane::Lane;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// Bytes of a lane's ring: small enough that the rings of 4 peers on one host stay in a
/// last-level cache of 8 MiB, where a reader finds what the writer left (4 MiB rings made a
/// 64 MiB all-reduce of 4 peers 17% slower).
pub const RING_BYTES: usize = 1 << 20;
const HEADER_BYTES: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"SHOALSHM");

#[repr(C, align(64))]
struct Line<T>(T);

/// The header at the start of a segment.
#[repr(C)]
struct Header {
    /// Bytes the writer put in the ring, in all.
    head: Line<AtomicU64>,
    /// Bytes the reader took out, in all.
    tail: Line<AtomicU64>,
    reader_sleeping: Line<AtomicU32>,
    writer_sleeping: Line<AtomicU32>,
    magic: Line<AtomicU64>,
    capacity: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);

/// A mapped segment: the header and the ring, then the ring again right after it, so that any
/// range of up to the ring's capacity is contiguous from any position (a copy never wraps, and
/// a chunk can be lent in place).
struct Segment {
    base: *mut u8,
    /// Bytes of address space reserved: the header and two views of the ring.
    reserved: usize,
    capacity: usize,
}

// SAFETY: the mapping is shared memory accessed only through atomics (header) or by the one
// writer and the one reader of disjoint ring ranges, which the cursors hand over.
unsafe impl Send for Segment {}

impl Segment {
    fn map(fd: &OwnedFd, len: usize) -> io::Result<Segment> {
        let capacity = len - HEADER_BYTES;
        let reserved = HEADER_BYTES + 2 * capacity;
        let failed = |p: *mut libc::c_void| p == libc::MAP_FAILED;
        // Populated at once: otherwise every page the ring's first lap reaches costs a fault (and
        // the first peer to touch it, the page's zeroing) in the middle of a collective. Small
        // all-reduces paid that for their first thousand calls: 4 peers, 4 KiB, 0.16 ms per
        // peer after the lap against 0.20 ms during it.
        let (rw, shared) =
            (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE);
        // SAFETY: reserves fresh address space, then maps the descriptor twice into exactly
        // that space (MAP_FIXED over our own reservation); every result is checked, and a
        // failure unmaps the whole reservation.
        unsafe {
            let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
            let base = libc::mmap(std::ptr::null_mut(), reserved, libc::PROT_NONE, flags, -1, 0);
            if failed(base) {
                return Err(io::Error::last_os_error());
            }
            let seg = Segment { base: base.cast(), reserved, capacity };
            let fd = fd.as_raw_fd();
            if failed(libc::mmap(base, len, rw, shared, fd, 0))
                || failed(libc::mmap(seg.ring().add(capacity).cast(), capacity, rw, shared, fd, HEADER_BYTES as i64))
            {
                return Err(io::Error::last_os_error());
            }
            Ok(seg)
        }
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a page for the header, aligned to the page.
        unsafe { &*self.base.cast::<Header>() }
    }

    fn ring(&self) -> *mut u8 {
        // SAFETY: within the mapping.
        unsafe { self.base.add(HEADER_BYTES) }
    }

    /// The ring's bytes from `cursor` on, `n` of them (at most the capacity).
    fn at(&self, cursor: u64, n: usize) -> *mut u8 {
        debug_assert!(n <= self.capacity);
        // SAFETY: position + n < 2 * capacity: inside the two views.
        unsafe { self.ring().add(cursor as usize % self.capacity) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` reserved.
        unsafe { libc::munmap(self.base.cast(), self.reserved) };
    }
}

/// The process at the other end of a Unix socket, as the kernel saw it connect (`SO_PEERCRED`).
///
/// # Errors
/// Errors of `getsockopt(2)`.
pub fn peer_cred(socket: &impl AsRawFd) -> io::Result<libc::ucred> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a `ucred` of `len` bytes on a socket we hold open.
    let rc = unsafe {
        libc::getsockopt(socket.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &raw mut len)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred)
}

/// This process's effective user id.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// One end of a shared-memory lane: the writer (the dialer) or the reader (the acceptor).
pub struct ShmLane {
    seg: Segment,
    bell: UnixStream,
    writer: bool,
    /// Our cursor (head for the writer, tail for the reader), which only we move.
    cursor: u64,
    /// The other end closed its socket.
    closed: bool,
    /// Bytes the reader waits for before it can move: more than one while a chunk it wants
    /// whole has partly arrived.
    want: u64,
}

impl ShmLane {
    /// Makes a segment with a ring of `capacity` bytes and sends its descriptor over `bell`
    /// (blocking, with one byte of data): the writer's end.
    ///
    /// # Errors
    /// Creating, sizing, mapping or sending the segment.
    pub fn offer(bell: UnixStream, capacity: usize) -> io::Result<ShmLane> {
        // SAFETY: a C string literal; the call has no other inputs.
        let raw = unsafe { libc::memfd_create(c"shoal-lane".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just created and owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let len = HEADER_BYTES + capacity;
        // SAFETY: a valid descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let seg = Segment::map(&fd, len)?;
        seg.header().capacity.store(capacity as u64, Ordering::Relaxed);
        seg.header().magic.0.store(MAGIC, Ordering::Release);
        send_fd(&bell, &fd)?;
        Ok(ShmLane { seg, bell, writer: true, cursor: 0, closed: false, want: 1 })
    }

    /// Receives the segment the other end offered over `bell` and maps it: the reader's end.
    /// `bell` should have a read timeout set: this blocks until the descriptor arrives.
    ///
    /// # Errors
    /// No descriptor, or one that is not a lane's segment.
    pub fn accept(bell: UnixStream) -> io::Result<ShmLane> {
        let fd = recv_fd(&bell)?;
        let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
        let page = HEADER_BYTES;
        // SAFETY: fstat into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let len = st.st_size as usize;
        if len <= HEADER_BYTES || len > HEADER_BYTES + (1 << 30) || !len.is_multiple_of(page) {
            return Err(invalid(format!("a shared-memory segment of {len} bytes")));
        }
        let seg = Segment::map(&fd, len)?;
        let h = seg.header();
        let capacity = h.capacity.load(Ordering::Relaxed);
        if h.magic.0.load(Ordering::Acquire) != MAGIC || capacity != seg.capacity as u64 {
            return Err(invalid(format!("a segment that is no lane's ring (capacity {capacity}, {len} bytes)")));
        }
        if h.head.0.load(Ordering::Relaxed) != 0 || h.tail.0.load(Ordering::Relaxed) != 0 {
            return Err(invalid("a lane's ring that was used before".into()));
        }
        Ok(ShmLane { seg, bell, writer: false, cursor: 0, closed: false, want: 1 })
    }

    /// Switches the doorbell socket to non-blocking, for the engine.
    ///
    /// # Errors
    /// `fcntl` errors.
    pub fn set_nonblocking(&self) -> io::Result<()> {
        self.bell.set_nonblocking(true)
    }

    /// Reads every doorbell rung so far; notes whether the other end closed.
    fn drain(&mut self) -> io::Result<()> {
        let mut sink = [0u8; 64];
        while !self.closed {
            match (&self.bell).read(&mut sink) {
                Ok(0) => self.closed = true,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => self.closed = true,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Wakes the other end if it sleeps.
    fn ring_if_sleeping(&mut self, flag: &AtomicU32) -> io::Result<()> {
        fence(Ordering::SeqCst);
        if flag.load(Ordering::SeqCst) == 1 && flag.swap(0, Ordering::SeqCst) == 1 {
            match (&self.bell).write(&[1]) {
                // A full socket already holds a doorbell the other end has not read.
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset) => {
                    self.closed = true;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Room in the ring for the writer; `WouldBlock` if there is none (no system call: the
    /// driver may spin on it), `BrokenPipe` once the reader is known to be gone.
    fn room(&self, order: Ordering) -> io::Result<usize> {
        let cap = self.seg.capacity as u64;
        let free = cap - (self.cursor - self.seg.header().tail.0.load(order));
        match free {
            0 if self.closed => Err(io::ErrorKind::BrokenPipe.into()),
            0 => Err(io::ErrorKind::WouldBlock.into()),
            n => Ok(n as usize),
        }
    }

    /// Bytes the writer put in the ring that we have not taken; `Ok(0)` once there are none
    /// and the writer is known to be gone, `WouldBlock` before (no system call).
    fn available(&self, order: Ordering) -> io::Result<usize> {
        assert!(!self.writer, "a shared-memory lane's writer end cannot read");
        match self.seg.header().head.0.load(order) - self.cursor {
            // Everything the writer sent is read: a closed socket is the end of the lane.
            0 if self.closed => Ok(0),
            0 => Err(io::ErrorKind::WouldBlock.into()),
            n => Ok(n as usize),
        }
    }

    /// Copies `bufs` into the ring as far as there is room; the bytes written.
    fn put(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        assert!(self.writer, "a shared-memory lane's reader end cannot write");
        if bufs.iter().all(|b| b.is_empty()) {
            return Ok(0);
        }
        let mut free = self.room(Ordering::Acquire)?;
        let mut written = 0;
        for b in bufs {
            let n = b.len().min(free);
            // SAFETY: `n` bytes of room from our cursor on are ours until we publish them.
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.seg.at(self.cursor + written as u64, n), n) };
            written += n;
            free -= n;
            if free == 0 {
                break;
            }
        }
        self.cursor += written as u64;
        self.seg.header().head.0.store(self.cursor, Ordering::Release);
        let h = self.seg.header() as *const Header;
        // SAFETY: as in `take`.
        self.ring_if_sleeping(unsafe { &(*h).reader_sleeping.0 })?;
        Ok(written)
    }
}

impl ShmLane {
    /// Gives `n` bytes back to the writer.
    fn take(&mut self, n: usize) -> io::Result<()> {
        self.cursor += n as u64;
        self.seg.header().tail.0.store(self.cursor, Ordering::Release);
        let h = self.seg.header() as *const Header;
        // SAFETY: the header outlives this call; split from `self` for the borrow checker.
        self.ring_if_sleeping(unsafe { &(*h).writer_sleeping.0 })
    }
}

impl Read for ShmLane {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let n = buf.len().min(self.available(Ordering::Acquire)?);
        // SAFETY: `n` bytes the writer published and we have not given back.
        unsafe { std::ptr::copy_nonoverlapping(self.seg.at(self.cursor, n), buf.as_mut_ptr(), n) };
        self.take(n)?;
        Ok(n)
    }
}

impl Write for ShmLane {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.put(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.put(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Reads `into.len()` bytes (or fewer: the count returned) from address `addr` of process `pid`
/// with one `process_vm_readv(2)`: a single copy from another process's memory, the sender's
/// buffer straight into the receiver's.
///
/// # Errors
/// `PermissionDenied` where the kernel forbids it (another user, or Yama's `ptrace_scope`),
/// `NotFound` (`ESRCH`) once the process is gone, an invalid address as `EFAULT`.
pub fn read_process(pid: u32, addr: u64, into: &mut [u8]) -> io::Result<usize> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let local = libc::iovec { iov_base: into.as_mut_ptr().cast(), iov_len: into.len() };
    let remote = libc::iovec { iov_base: addr as usize as *mut libc::c_void, iov_len: into.len() };
    // SAFETY: `local` is our own writable buffer of that length; the kernel checks `remote`
    // against the other process's mappings (EFAULT) and never writes there.
    let n = unsafe { libc::process_vm_readv(pid, &raw const local, 1, &raw const remote, 1, 0) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

impl Lane for ShmLane {
    fn pollable(&self) -> Option<RawFd> {
        Some(self.bell.as_raw_fd())
    }

    fn poll_events(&self, read: bool, write: bool) -> (bool, bool) {
        // Both ends wait for a doorbell, which arrives as bytes to read.
        (read || write, false)
    }

    fn describe(&self) -> String {
        format!("shared memory ({}, {} KiB ring)", if self.writer { "out" } else { "in" }, self.seg.capacity >> 10)
    }

    fn kind(&self) -> &'static str {
        "shm"
    }

    fn partner_pid(&self) -> Option<u32> {
        // A pid of 0: the process lives in a pid namespace we cannot see.
        peer_cred(&self.bell).ok().filter(|c| c.pid > 0).map(|c| c.pid.unsigned_abs())
    }

    fn peek(&mut self, len: usize) -> io::Result<Option<&[u8]>> {
        if len > self.seg.capacity {
            return Err(io::ErrorKind::Unsupported.into());
        }
        match self.available(Ordering::Acquire) {
            Ok(0) => Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) if n >= len => {
                self.want = 1;
                // SAFETY: `len` bytes the writer published, which it may not touch until we
                // give them back; contiguous in the ring's second view.
                Ok(Some(unsafe { std::slice::from_raw_parts(self.seg.at(self.cursor, len), len) }))
            }
            Ok(_) if self.closed => Err(io::ErrorKind::UnexpectedEof.into()),
            // Part of it came: a sleep waits for all of it (the writer rings at each write).
            Ok(_) => {
                self.want = len as u64;
                Ok(None)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.want = len as u64;
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn arm(&mut self) -> io::Result<bool> {
        self.drain()?;
        let h = self.seg.header() as *const Header;
        // SAFETY: the header outlives this call; split from `self` for the borrow checker.
        let h = unsafe { &*h };
        let flag = if self.writer { &h.writer_sleeping.0 } else { &h.reader_sleeping.0 };
        flag.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let blocked = if self.writer {
            matches!(self.room(Ordering::SeqCst), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
        } else {
            !self.closed && h.head.0.load(Ordering::SeqCst) - self.cursor < self.want
        };
        if !blocked {
            flag.store(0, Ordering::Relaxed);
        }
        Ok(blocked)
    }

    fn consume(&mut self, len: usize) -> io::Result<()> {
        self.take(len)
    }
}

/// Runs `f` over a message of one byte with room for one descriptor (`SCM_RIGHTS`).
fn one_byte_and_a_descriptor<R>(f: impl FnOnce(&mut libc::msghdr) -> io::Result<R>) -> io::Result<R> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    // SAFETY: CMSG_SPACE of an int is a constant computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: a zeroed msghdr is valid; it points at buffers that outlive `f`.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    f(&mut msg)
}

/// Sends `fd` over `s` with one byte of data.
fn send_fd(s: &UnixStream, fd: &OwnedFd) -> io::Result<()> {
    one_byte_and_a_descriptor(|msg| {
        // SAFETY: the message has room for one descriptor's control message, filled with the
        // CMSG macros.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd.as_raw_fd());
            if libc::sendmsg(s.as_raw_fd(), msg, libc::MSG_NOSIGNAL) != 1 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    })
}

/// Receives one byte and the descriptor sent with it over `s`.
fn recv_fd(s: &UnixStream) -> io::Result<OwnedFd> {
    one_byte_and_a_descriptor(|msg| {
        // SAFETY: the descriptor is read only from a control message of the kernel's making.
        unsafe {
            let n = libc::recvmsg(s.as_raw_fd(), msg, libc::MSG_CMSG_CLOEXEC);
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let cmsg = libc::CMSG_FIRSTHDR(msg);
            if n == 0
                || cmsg.is_null()
                || (*cmsg).cmsg_level != libc::SOL_SOCKET
                || (*cmsg).cmsg_type != libc::SCM_RIGHTS
            {
                let what = if n == 0 { "the connection closed" } else { "no descriptor came" };
                let why = format!("expected a shared-memory segment: {what}");
                return Err(io::Error::new(io::ErrorKind::InvalidData, why));
            }
            Ok(OwnedFd::from_raw_fd(std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>())))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn pair(capacity: usize) -> (ShmLane, ShmLane) {
        let (a, b) = UnixStream::pair().unwrap();
        let w = ShmLane::offer(a, capacity).unwrap();
        b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let r = ShmLane::accept(b).unwrap();
        w.set_nonblocking().unwrap();
        r.set_nonblocking().unwrap();
        (w, r)
    }

    #[test]
    fn each_end_knows_the_process_at_the_other_and_can_read_its_memory() {
        let (w, r) = pair(4096);
        let me = std::process::id();
        assert_eq!((w.partner_pid(), r.partner_pid()), (Some(me), Some(me)));
        let source: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut into = vec![0u8; source.len()];
        assert_eq!(read_process(me, source.as_ptr() as u64, &mut into).unwrap(), source.len());
        assert_eq!(into, source);
        let e = read_process(me, 8, &mut into).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EFAULT), "{e}");
    }

    fn readable(fd: RawFd, ms: i32) -> bool {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, ms) == 1 }
    }

    #[test]
    fn bytes_cross_the_ring_in_order_through_every_wrap() {
        let (mut w, mut r) = pair(4096);
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let (mut sent, mut got) = (0, Vec::new());
        let mut buf = [0u8; 3000];
        while got.len() < data.len() {
            let end = (sent + 1234).min(data.len());
            // The header of a frame and its body in one call, as the engine writes them.
            let (a, b) = data[sent..end].split_at((end - sent) / 3);
            match w.write_vectored(&[IoSlice::new(a), IoSlice::new(b)]) {
                Ok(n) => sent += n,
                Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
            }
            match r.read(&mut buf) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
            }
        }
        assert!(got == data);
    }

    #[test]
    fn an_armed_end_is_rung_and_one_that_is_not_armed_is_not() {
        let (mut w, mut r) = pair(4096);
        // Spinning costs no system call and sets nothing: the writer does not ring.
        assert_eq!(r.read(&mut [0u8; 16]).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        w.write_all(&[5u8; 10]).unwrap();
        assert!(!readable(r.pollable().unwrap(), 0), "not armed: no doorbell");
        assert!(!r.arm().unwrap(), "bytes are there: no sleep");
        assert_eq!(r.read(&mut [0u8; 100]).unwrap(), 10);
        assert!(r.arm().unwrap());
        assert!(!readable(r.pollable().unwrap(), 0));
        w.write_all(&[5u8; 10]).unwrap();
        assert!(readable(r.pollable().unwrap(), 1000), "the reader slept: the write rings");
        assert_eq!(r.read(&mut [0u8; 4]).unwrap(), 4);
        // A full ring: the writer sleeps, and a read that makes room rings it.
        let mut filled = 0;
        loop {
            match w.write(&[1u8; 1000]) {
                Ok(n) => filled += n,
                Err(e) => {
                    assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
                    break;
                }
            }
        }
        assert_eq!(filled, 4096 - 6);
        assert!(w.arm().unwrap());
        assert!(!readable(w.pollable().unwrap(), 0));
        assert_eq!(r.read(&mut [0u8; 100]).unwrap(), 100);
        assert!(readable(w.pollable().unwrap(), 1000), "the writer slept: the read rings");
        assert!(!w.arm().unwrap(), "room came: no sleep");
        assert_eq!(w.write(&[1u8; 1000]).unwrap(), 100);
    }

    #[test]
    fn a_chunk_is_lent_in_place_once_whole_even_across_the_ring_end() {
        let (mut w, mut r) = pair(4096);
        w.write_all(&[0u8; 3000]).unwrap();
        r.read_exact(&mut [0u8; 3000]).unwrap();
        // The next 3000 bytes run from position 3000 past the end of the ring.
        let data: Vec<u8> = (0..3000u32).map(|i| (i % 253) as u8).collect();
        w.write_all(&data[..1000]).unwrap();
        assert!(r.peek(3000).unwrap().is_none(), "a third of it came");
        assert!(r.arm().unwrap(), "a sleep waits for the rest");
        assert!(readable_after(&mut w, &data[1000..], &r));
        assert_eq!(r.peek(3000).unwrap().expect("all of it came"), &data[..]);
        r.consume(3000).unwrap();
        assert_eq!(r.read(&mut [0u8; 1]).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        assert_eq!(r.peek(5000).unwrap_err().kind(), io::ErrorKind::Unsupported);
        w.write_all(&[1u8; 5]).unwrap();
        drop(w);
        assert!(r.peek(10).unwrap().is_none());
        assert!(!r.arm().unwrap());
        assert_eq!(r.peek(10).unwrap_err().kind(), io::ErrorKind::UnexpectedEof, "5 of 10 bytes, then the end");
    }

    /// Writes `bytes` and says whether the sleeping reader `r` was rung.
    fn readable_after(w: &mut ShmLane, bytes: &[u8], r: &ShmLane) -> bool {
        w.write_all(bytes).unwrap();
        readable(r.pollable().unwrap(), 1000)
    }

    #[test]
    fn a_closed_writer_ends_the_lane_after_its_last_byte_and_a_closed_reader_breaks_writes() {
        let (mut w, mut r) = pair(4096);
        w.write_all(&[9u8; 300]).unwrap();
        drop(w);
        assert!(readable(r.pollable().unwrap(), 1000));
        let mut buf = [0u8; 1000];
        assert_eq!(r.read(&mut buf).unwrap(), 300);
        assert_eq!(r.read(&mut buf).unwrap_err().kind(), io::ErrorKind::WouldBlock, "not known yet");
        assert!(!r.arm().unwrap(), "arming finds the closed socket: no sleep");
        assert_eq!(r.read(&mut buf).unwrap(), 0);

        let (mut w, r) = pair(4096);
        drop(r);
        while w.write(&[1u8; 1000]).is_ok() {}
        assert!(!w.arm().unwrap(), "arming finds the closed socket: no sleep");
        assert_eq!(w.write(&[1u8; 1000]).unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn a_descriptor_that_is_no_lane_is_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        send_fd(&a, &OwnedFd::from(file)).unwrap();
        let err = ShmLane::accept(b).err().expect("refused");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(&[0]).unwrap();
        let err = ShmLane::accept(b).err().expect("refused");
        assert!(err.to_string().contains("no descriptor"), "{err}");
    }
}
