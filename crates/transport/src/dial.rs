//! Many connections dialed at once on the calling thread: each one's TCP handshake, its TLS
//! handshake if the run has TLS, and a first frame, moved on as its socket allows (`poll(2)`),
//! all by one absolute deadline. A peer that links to 63 members over 16 streams each opens
//! 1,008 connections in about one round trip with no thread per connection: on a thread each,
//! 64 such peers on two cores once starved their own dial threads between the connect and the
//! hello for longer than the other end waits for a hello.

use crate::tls::{Opening, Step};
use crate::{poll, Conn, PollFd, TlsConfig};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Instant;

/// One connection to open: where, and the bytes it says first (a framed hello), sent whole
/// before it counts as open.
#[derive(Debug, Clone, Copy)]
pub struct Dial<'a> {
    /// `host:port`; every address it resolves to is tried in turn.
    pub addr: &'a str,
    /// Sent once the connection (and its TLS session) is open.
    pub first: &'a [u8],
}

/// Opens every connection of `dials`, at most `at_once` under way at a time (a SYN burst and the
/// other ends' accept queues stay bounded), each by `deadline`: its TCP handshake, its TLS
/// handshake with `tls`, and its first bytes. Returns them in order, non-blocking, each with
/// `TCP_NODELAY`, or why each failed; one failing does not hold up the others.
pub fn dial_all(
    dials: &[Dial<'_>],
    tls: Option<&TlsConfig>,
    deadline: Instant,
    at_once: usize,
) -> Vec<io::Result<Conn>> {
    let mut states: Vec<State> = dials.iter().map(|_| State::Waiting).collect();
    let mut next = 0;
    loop {
        let under_way = states.iter().filter(|s| s.under_way()).count();
        for _ in under_way..at_once.max(1) {
            let Some(dial) = dials.get(next) else { break };
            states[next] = start(dial, resolve(dial.addr), tls);
            next += 1;
        }
        let waiting: Vec<usize> = (0..states.len()).filter(|&i| states[i].under_way()).collect();
        if waiting.is_empty() && next == dials.len() {
            break;
        }
        let now = Instant::now();
        if now >= deadline {
            for i in waiting {
                states[i] = State::Failed(timed_out(dials[i].addr));
            }
            for state in &mut states[next..] {
                *state = State::Failed(io::Error::new(io::ErrorKind::TimedOut, "no time left to dial"));
            }
            break;
        }
        let mut fds: Vec<PollFd> = waiting.iter().map(|&i| states[i].poll_fd()).collect();
        if let Err(e) = poll(&mut fds, deadline - now) {
            for &i in &waiting {
                states[i] = State::Failed(io::Error::new(e.kind(), format!("poll: {e}")));
            }
            continue;
        }
        for (&i, fd) in waiting.iter().zip(&fds) {
            if fd.readable || fd.writable {
                let state = std::mem::replace(&mut states[i], State::Waiting);
                states[i] = state.advance(&dials[i], tls);
            }
        }
    }
    states
        .into_iter()
        .map(|s| match s {
            State::Open(conn) => Ok(conn),
            State::Failed(e) => Err(e),
            _ => unreachable!("every dial ends open or failed"),
        })
        .collect()
}

/// Where a connection stands.
enum State {
    /// Not started: `at_once` are under way.
    Waiting,
    /// Its TCP handshake, to the address at the front of the rest.
    Connecting(Socket, Vec<SocketAddr>),
    /// Its TLS handshake, waiting for its socket to be readable (`Step::Read`) or writable.
    Opening(Box<Opening>, Step),
    /// Its first bytes, this many of them sent.
    Saying(Conn, usize),
    Open(Conn),
    Failed(io::Error),
}

impl State {
    fn under_way(&self) -> bool {
        matches!(self, State::Connecting(..) | State::Opening(..) | State::Saying(..))
    }

    fn poll_fd(&self) -> PollFd {
        use std::os::fd::AsRawFd;
        let (fd, read) = match self {
            State::Connecting(socket, _) => (socket.as_raw_fd(), false),
            State::Opening(opening, want) => (opening.as_raw_fd(), *want == Step::Read),
            State::Saying(conn, _) => (conn.as_raw_fd(), false),
            _ => unreachable!("only connections under way are polled"),
        };
        let mut fd = PollFd::from_raw(fd);
        (fd.want_read, fd.want_write) = (read, !read);
        fd
    }

    /// Moves on as far as the socket allows, now that it is ready.
    fn advance(self, dial: &Dial<'_>, tls: Option<&TlsConfig>) -> State {
        let mut state = self;
        loop {
            state = match state {
                State::Connecting(socket, rest) => match socket.take_error() {
                    Ok(None) => opening(TcpStream::from(socket), dial, tls),
                    // Refused there: the next address, if it resolves to another.
                    Ok(Some(e)) | Err(e) => next_address(e, rest, dial, tls),
                },
                State::Opening(mut opening, _) => match opening.step() {
                    Ok(Step::Done) => State::Saying(opening.open(), 0),
                    Ok(want) => return State::Opening(opening, want),
                    Err(e) => return State::Failed(e),
                },
                State::Saying(mut conn, sent) if sent == dial.first.len() => match conn.flush() {
                    Ok(()) => return State::Open(conn),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return State::Saying(conn, sent),
                    Err(e) => return State::Failed(e),
                },
                // A non-blocking TLS writer offers the same bytes again until they are sent.
                State::Saying(mut conn, sent) => match conn.write(&dial.first[sent..]) {
                    Ok(0) => return State::Failed(io::ErrorKind::WriteZero.into()),
                    Ok(n) => State::Saying(conn, sent + n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return State::Saying(conn, sent),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => State::Saying(conn, sent),
                    Err(e) => return State::Failed(e),
                },
                done => return done,
            };
            if matches!(state, State::Connecting(..)) {
                return state;
            }
        }
    }
}

/// The addresses `addr` resolves to, in the order to try them.
fn resolve(addr: &str) -> io::Result<Vec<SocketAddr>> {
    let mut all: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    if all.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{addr} resolves to no address")));
    }
    all.reverse();
    Ok(all)
}

/// A connection's TCP handshake begun to the last of `to` (the addresses left, last first).
fn start(dial: &Dial<'_>, to: io::Result<Vec<SocketAddr>>, tls: Option<&TlsConfig>) -> State {
    let mut to = match to {
        Ok(to) => to,
        Err(e) => return State::Failed(e),
    };
    let Some(at) = to.pop() else { return State::Failed(io::ErrorKind::InvalidInput.into()) };
    let socket = match connecting(at) {
        Ok(socket) => socket,
        Err(e) => return next_address(e, to, dial, tls),
    };
    match socket.connect(&SockAddr::from(at)) {
        Ok(()) => opening(TcpStream::from(socket), dial, tls),
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => State::Connecting(socket, to),
        Err(e) => next_address(e, to, dial, tls),
    }
}

/// A non-blocking TCP socket for `at`, with `TCP_NODELAY` as every shoal socket has.
fn connecting(at: SocketAddr) -> io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(at), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_nonblocking(true)?;
    socket.set_tcp_nodelay(true)?;
    Ok(socket)
}

/// After `e` at one address: the next one, or `e` if none is left.
fn next_address(e: io::Error, rest: Vec<SocketAddr>, dial: &Dial<'_>, tls: Option<&TlsConfig>) -> State {
    if rest.is_empty() {
        State::Failed(io::Error::new(e.kind(), format!("connecting to {}: {e}", dial.addr)))
    } else {
        start(dial, Ok(rest), tls)
    }
}

fn opening(tcp: TcpStream, dial: &Dial<'_>, tls: Option<&TlsConfig>) -> State {
    match Opening::dial(tcp, dial.addr, tls) {
        Ok(opening) => State::Opening(Box::new(opening), Step::Write),
        Err(e) => State::Failed(e),
    }
}

fn timed_out(addr: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("dialing {addr} timed out"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;
    use std::time::Duration;

    /// A listener that reads `first.len()` bytes from each of `n` connections and sends them
    /// back, once all are in, from a thread: every dial must be open at once for any to finish.
    fn echo_all(n: usize, len: usize) -> (String, std::thread::JoinHandle<Vec<Vec<u8>>>) {
        let listener = crate::listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let mut conns: Vec<TcpStream> = (0..n).map(|_| listener.accept().unwrap().0).collect();
            conns
                .iter_mut()
                .map(|c| {
                    let mut got = vec![0; len];
                    c.read_exact(&mut got).unwrap();
                    got
                })
                .collect()
        });
        (addr, server)
    }

    #[test]
    fn hundreds_of_connections_open_on_one_thread_each_with_its_first_bytes() {
        let (addr, server) = echo_all(300, 3);
        let firsts: Vec<[u8; 3]> = (0..300u16).map(|i| [b'h', (i >> 8) as u8, i as u8]).collect();
        let dials: Vec<Dial> = firsts.iter().map(|f| Dial { addr: &addr, first: f }).collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        let conns = dial_all(&dials, None, deadline, 64);
        let failed: Vec<String> = conns.iter().filter_map(|c| c.as_ref().err()).map(|e| e.to_string()).collect();
        assert!(failed.is_empty(), "{failed:?}");
        let mut got = server.join().unwrap();
        got.sort();
        let mut want: Vec<Vec<u8>> = firsts.iter().map(|f| f.to_vec()).collect();
        want.sort();
        assert_eq!(got, want);
    }

    #[test]
    fn an_address_that_refuses_fails_its_own_dials_alone() {
        let (addr, server) = echo_all(2, 1);
        // A port no one listens on: bound, then closed.
        let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        let dials = [
            Dial { addr: &addr, first: b"a" },
            Dial { addr: &closed, first: b"b" },
            Dial { addr: "nowhere.invalid:1", first: b"c" },
            Dial { addr: &addr, first: b"d" },
        ];
        let conns = dial_all(&dials, None, Instant::now() + Duration::from_secs(10), 2);
        assert!(conns[0].is_ok() && conns[3].is_ok());
        let Err(refused) = &conns[1] else { panic!("dialed a closed port") };
        assert_eq!(refused.kind(), io::ErrorKind::ConnectionRefused, "{refused}");
        assert!(refused.to_string().contains(&closed), "{refused}");
        assert!(conns[2].is_err());
        server.join().unwrap();
    }

    /// The run's TLS settings for 127.0.0.1, made in a fresh directory.
    fn tls_config(name: &str) -> TlsConfig {
        let dir = std::env::temp_dir().join(format!("shoal-dial-{name}-{}", std::process::id()));
        let made = crate::tls::make_certs(&dir, &["127.0.0.1".into()]).unwrap();
        let (_, cert, key) = made.hosts[0].clone();
        let config = TlsConfig::load(&crate::TlsFiles { cert, key, ca: made.ca }).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        config
    }

    #[test]
    fn tls_connections_open_together_and_carry_their_first_bytes_encrypted() {
        let tls = tls_config("tls");
        let listener = crate::listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server_tls = tls.clone();
        let server = std::thread::spawn(move || {
            (0..8)
                .map(|_| {
                    let tcp = listener.accept().unwrap().0;
                    let deadline = Instant::now() + Duration::from_secs(10);
                    let mut conn = Conn::accept(tcp, Some(&server_tls), deadline).unwrap();
                    let mut got = [0; 5];
                    conn.read_exact(&mut got).unwrap();
                    got
                })
                .collect::<Vec<_>>()
        });
        let dials = [Dial { addr: &addr, first: b"hello" }; 8];
        let conns = dial_all(&dials, Some(&tls), Instant::now() + Duration::from_secs(10), 8);
        assert!(conns.iter().all(|c| c.as_ref().is_ok_and(Conn::is_tls)));
        assert_eq!(server.join().unwrap(), vec![*b"hello"; 8]);
    }

    #[test]
    fn a_tls_listener_that_never_answers_ends_every_dial_at_the_deadline() {
        // Accepted by the kernel, never read: the TLS handshake cannot finish.
        let listener = crate::listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let tls = tls_config("silent");
        let dials = [Dial { addr: &addr, first: b"x" }; 5];
        let started = Instant::now();
        let conns = dial_all(&dials, Some(&tls), started + Duration::from_millis(300), 8);
        let took = started.elapsed();
        assert!(conns.iter().all(|c| c.as_ref().is_err_and(|e| e.kind() == io::ErrorKind::TimedOut)));
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(3), "{took:?}");
        drop(listener);
    }
}
