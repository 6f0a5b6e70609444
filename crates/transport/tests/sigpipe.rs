//! In a process of its own (SIGPIPE back to its default, which kills): a shared-memory lane whose
//! other end is gone reports it and raises no signal (std sends on Unix sockets with
//! `MSG_NOSIGNAL`). Rust and Python ignore SIGPIPE, but a program embedding shoal need not.

use shoal_transport::shm::ShmLane;
use shoal_transport::Lane;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

#[test]
fn writing_to_a_gone_end_is_an_error_not_a_signal() {
    // SAFETY: restores the default disposition; nothing else in this process handles it.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let (a, b) = UnixStream::pair().unwrap();
    let mut w = ShmLane::offer(a, 4096).unwrap();
    b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut r = ShmLane::accept(b).unwrap();
    w.set_nonblocking().unwrap();
    r.set_nonblocking().unwrap();
    // The reader sleeps, then dies: the next write rings a closed socket.
    assert!(r.arm().unwrap());
    drop(r);
    assert_eq!(w.write(&[1u8; 10]).unwrap(), 10);
    // It learned that the reader is gone: the ring fills, then writing fails.
    while w.write(&[1u8; 1000]).is_ok() {}
    assert!(!w.arm().unwrap());
    assert_eq!(w.write(&[1u8; 10]).unwrap_err().kind(), std::io::ErrorKind::BrokenPipe);
}
