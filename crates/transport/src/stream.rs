//! The data stream a peer holds to one member: TCP, TCP under TLS, or shared memory to a process
//! on the same host, each a [`Lane`].

use crate::lane::Lane;
use crate::shm::ShmLane;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::RawFd;

/// A data stream as the peer holds it: TCP, or shared memory to a process on the same host.
pub enum Stream {
    /// A TCP connection.
    Tcp(TcpStream),
    /// One end of a shared-memory lane.
    Shm(ShmLane),
    /// A TCP connection carrying TLS.
    Tls(crate::Conn),
}

impl Stream {
    /// Makes it non-blocking, for the engine.
    ///
    /// # Errors
    /// `fcntl` errors.
    pub fn set_nonblocking(&mut self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nonblocking(true),
            Stream::Shm(s) => s.set_nonblocking(),
            Stream::Tls(s) => s.set_nonblocking(true),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Shm(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Shm(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Shm(s) => s.write_vectored(bufs),
            Stream::Tls(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Lane for Stream {
    fn pollable(&self) -> Option<RawFd> {
        match self {
            Stream::Tcp(s) => s.pollable(),
            Stream::Shm(s) => s.pollable(),
            Stream::Tls(s) => s.pollable(),
        }
    }

    fn poll_events(&self, read: bool, write: bool) -> (bool, bool) {
        match self {
            Stream::Tcp(s) => s.poll_events(read, write),
            Stream::Shm(s) => s.poll_events(read, write),
            Stream::Tls(s) => s.poll_events(read, write),
        }
    }

    fn describe(&self) -> String {
        match self {
            Stream::Tcp(s) => s.describe(),
            Stream::Shm(s) => s.describe(),
            Stream::Tls(s) => s.describe(),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Stream::Tcp(s) => s.kind(),
            Stream::Shm(s) => s.kind(),
            Stream::Tls(s) => s.kind(),
        }
    }

    fn partner_pid(&self) -> Option<u32> {
        match self {
            Stream::Shm(s) => s.partner_pid(),
            Stream::Tcp(_) | Stream::Tls(_) => None,
        }
    }

    fn peek(&mut self, len: usize) -> io::Result<Option<&[u8]>> {
        match self {
            Stream::Tcp(s) => Lane::peek(s, len),
            Stream::Shm(s) => s.peek(len),
            Stream::Tls(s) => Lane::peek(s, len),
        }
    }

    fn arm(&mut self) -> io::Result<bool> {
        match self {
            Stream::Tcp(s) => Lane::arm(s),
            Stream::Shm(s) => s.arm(),
            Stream::Tls(s) => Lane::arm(s),
        }
    }

    fn consume(&mut self, len: usize) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => Lane::consume(s, len),
            Stream::Shm(s) => s.consume(len),
            Stream::Tls(s) => Lane::consume(s, len),
        }
    }
}
