//! TLS for control and data connections (rustls), and the run's certificates.
//!
//! A run with TLS gives every process the same three files: the run's CA certificate, and its
//! own certificate and key, signed by that CA (`shoal certs` makes them, [`make_certs`]). TLS is
//! always mutual: every peer also accepts data connections, so every peer has a certificate, and
//! each end checks the other's against the CA; the dialer also checks that the certificate names
//! the host it dialed (an IP address or a DNS name in its subject alternative names).
//!
//! A [`Conn`] is a TCP connection that may carry TLS. Like a [`TcpStream`] it can be cloned
//! ([`Conn::try_clone`]) into a half that reads on one thread and a half that writes on another:
//! both share one TLS session, and a blocked read does not hold up a write. Set non-blocking, it
//! is a [`Lane`](crate::Lane) the engine drives.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Plaintext one `write` takes at most: what a non-blocking lane holds encrypted but unsent, on
/// top of the socket's own limit.
const WRITE_CHUNK: usize = 64 << 10;
/// Ciphertext one `read` takes from the socket at most.
const READ_CHUNK: usize = 64 << 10;

/// Why TLS settings cannot be loaded or certificates made; each names the file or host at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsSetupError {
    /// Some but not all of the three files were given: those missing.
    #[error(
        "TLS needs a certificate, its key and the run's CA (SHOAL_TLS_CERT, SHOAL_TLS_KEY, SHOAL_TLS_CA); \
         missing: {}",
        .0.join(", ")
    )]
    Incomplete(Vec<&'static str>),
    /// A file that cannot be read or written, or holds nothing usable.
    #[error("TLS {what} {}: {reason}", path.display())]
    File {
        /// What the file is (certificate, key, CA, ...).
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The certificate and key do not go together.
    #[error("TLS certificate {} and key {}: {reason}", cert.display(), key.display())]
    Pair {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls said.
        reason: String,
    },
    /// A host that cannot be a certificate's name.
    #[error("{host} as a certificate's name: {reason}")]
    HostName {
        /// The host.
        host: String,
        /// Why not.
        reason: String,
    },
    /// The crypto library refused, with no file at fault.
    #[error("TLS: {0}")]
    Crypto(String),
}

/// Where a process's TLS files lie: its certificate (chain), its key, and the run's CA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// This process's certificate, PEM (a chain to the CA may follow it).
    pub cert: PathBuf,
    /// Its private key, PEM.
    pub key: PathBuf,
    /// The run's CA certificate(s), PEM: the other end's certificate must chain to one.
    pub ca: PathBuf,
}

impl TlsFiles {
    /// The files the environment names (`SHOAL_TLS_CERT`, `SHOAL_TLS_KEY`, `SHOAL_TLS_CA`).
    ///
    /// # Errors
    /// Some but not all of the three are set.
    pub fn from_env() -> Result<Option<TlsFiles>, shoal_config::ConfigError> {
        let get = |name| shoal_config::env_value(name).map(PathBuf::from);
        let (cert, key, ca) = (get("SHOAL_TLS_CERT"), get("SHOAL_TLS_KEY"), get("SHOAL_TLS_CA"));
        let set = [&cert, &key, &ca].iter().filter(|v| v.is_some()).count();
        TlsFiles::from_parts(cert, key, ca).map_err(|_| shoal_config::ConfigError {
            name: "SHOAL_TLS_CERT",
            value: format!("{set} of SHOAL_TLS_CERT, SHOAL_TLS_KEY and SHOAL_TLS_CA set"),
            expected: "all three set, or none",
        })
    }

    /// All three files, or none of them.
    ///
    /// # Errors
    /// Some but not all of the three are given: the message names the missing ones.
    pub fn from_parts(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        ca: Option<PathBuf>,
    ) -> Result<Option<TlsFiles>, TlsSetupError> {
        match (cert, key, ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Ok(Some(TlsFiles { cert, key, ca })),
            (cert, key, ca) => {
                let missing: Vec<&str> =
                    [(cert.is_none(), "certificate"), (key.is_none(), "key"), (ca.is_none(), "CA")]
                        .into_iter()
                        .filter_map(|(m, name)| m.then_some(name))
                        .collect();
                Err(TlsSetupError::Incomplete(missing))
            }
        }
    }
}

/// A process's TLS settings, loaded: what dialing and accepting with TLS need.
#[derive(Clone)]
pub struct TlsConfig {
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsConfig { .. }")
    }
}

impl TlsConfig {
    /// Loads `files`: TLS 1.3 only, mutual, both ends checked against the CA.
    ///
    /// # Errors
    /// A file that cannot be read or holds no usable certificate or key; the message names it.
    pub fn load(files: &TlsFiles) -> Result<TlsConfig, TlsSetupError> {
        let read_err = |what: &'static str, path: &Path, e: &dyn std::fmt::Display| TlsSetupError::File {
            what,
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
            .and_then(|certs| certs.collect::<Result<_, _>>())
            .map_err(|e| read_err("certificate", &files.cert, &e))?;
        if certs.is_empty() {
            return Err(read_err("certificate", &files.cert, &"no certificate in it"));
        }
        let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| read_err("key", &files.key, &e))?;
        let mut roots = RootCertStore::empty();
        let cas = CertificateDer::pem_file_iter(&files.ca)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| read_err("CA", &files.ca, &e))?;
        for ca in cas {
            roots.add(ca).map_err(|e| read_err("CA", &files.ca, &e))?;
        }
        if roots.is_empty() {
            return Err(read_err("CA", &files.ca, &"no certificate in it"));
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let bad_pair = |e: rustls::Error| TlsSetupError::Pair {
            cert: files.cert.clone(),
            key: files.key.clone(),
            reason: e.to_string(),
        };
        let client = ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(crypto)?
            .with_root_certificates(roots.clone())
            .with_client_auth_cert(certs.clone(), key.clone_key())
            .map_err(bad_pair)?;
        let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
            .build()
            .map_err(|e| read_err("CA", &files.ca, &e))?;
        let mut server = ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(crypto)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map_err(bad_pair)?;
        // Connections are long-lived and each dialed once: tickets would only be bytes that a
        // one-way data stream never reads.
        server.send_tls13_tickets = 0;
        Ok(TlsConfig { client: Arc::new(client), server: Arc::new(server) })
    }
}

/// A crypto library's refusal that names no file.
fn crypto(e: impl std::fmt::Display) -> TlsSetupError {
    TlsSetupError::Crypto(e.to_string())
}

/// The TLS half of a [`Conn`], shared by its clones. Nothing blocks on the socket while holding
/// `session`: a reader blocked in `read` or a writer blocked in `write` on one thread leaves the
/// session to the other (two ends that both write while both read would otherwise wait for each
/// other for ever).
struct Shared {
    session: Mutex<Session>,
    /// Ciphertext taken from the session and not yet sent; its lock orders writes to the socket.
    out: Mutex<Vec<u8>>,
}

struct Session {
    conn: Connection,
    /// Ciphertext read from the socket and not yet taken by rustls (it takes more only once its
    /// plaintext was read).
    unread: Vec<u8>,
}

/// A TCP connection, with TLS when the run is configured for it (see the module docs).
pub struct Conn {
    tcp: TcpStream,
    tls: Option<Arc<Shared>>,
    /// Where this handle reads ciphertext from the socket (TLS only).
    scratch: Vec<u8>,
    /// Whether this handle was made non-blocking (see `owed`).
    nonblocking: bool,
    /// Plaintext bytes a non-blocking write took and encrypted but could not send whole: it said
    /// `WouldBlock`, and the writer's next write (of the same bytes again, as a non-blocking
    /// writer does) reports them written once they are sent. A write counts bytes only once
    /// they are in the socket, as with TCP: nothing lies encrypted in this process that no one
    /// would flush.
    owed: usize,
}

impl Conn {
    /// A plaintext connection.
    pub fn plain(tcp: TcpStream) -> Conn {
        Conn { tcp, tls: None, scratch: Vec::new(), nonblocking: false, owed: 0 }
    }

    /// Dials `addr` (`host:port`) within `timeout`, with TLS if `tls` is given: the handshake
    /// also ends within `timeout`, and the other end's certificate must name `host`.
    ///
    /// # Errors
    /// The connection or the handshake failed (a refused certificate, a plaintext listener).
    pub fn dial(addr: &str, timeout: Duration, tls: Option<&TlsConfig>) -> io::Result<Conn> {
        let deadline = Instant::now() + timeout;
        let tcp = crate::connect(addr, timeout)?;
        if tls.is_none() {
            return Ok(Conn::plain(tcp));
        }
        Conn::handshake(Opening::dial(tcp, addr, tls)?, deadline)
    }

    /// Takes an accepted connection: with TLS if `tls` is given, its handshake done by
    /// `deadline` (a client that trickles bytes cannot hold it longer).
    ///
    /// # Errors
    /// The handshake failed or ran late.
    pub fn accept(tcp: TcpStream, tls: Option<&TlsConfig>, deadline: Instant) -> io::Result<Conn> {
        Conn::handshake(Opening::accept(tcp, tls)?, deadline)
    }

    /// Steps `opening` through its handshake, waiting for its socket in `poll(2)` with what is
    /// left until `deadline`: the other end trickling bytes cannot stretch it. Blocking again
    /// once open.
    fn handshake(mut opening: Opening, deadline: Instant) -> io::Result<Conn> {
        loop {
            let want = match opening.step()? {
                Step::Done => break,
                want => want,
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"));
            }
            let mut fds = [crate::PollFd::new(&opening.tcp)];
            (fds[0].want_read, fds[0].want_write) = (want == Step::Read, want == Step::Write);
            crate::poll(&mut fds, left)?;
        }
        let mut conn = opening.open();
        conn.set_nonblocking(false)?;
        Ok(conn)
    }

    /// Whether it carries TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The TCP socket underneath, for its options.
    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Another handle to the same connection (and TLS session): one thread may read on it while
    /// another writes on this one.
    ///
    /// # Errors
    /// `dup(2)` failed.
    pub fn try_clone(&self) -> io::Result<Conn> {
        Ok(Conn {
            tcp: self.tcp.try_clone()?,
            tls: self.tls.clone(),
            scratch: Vec::new(),
            nonblocking: self.nonblocking,
            owed: 0,
        })
    }

    /// As [`Conn::try_clone`], for a handle that writes as on a blocking socket, whatever this one
    /// does ([`crate::greet`]: the greeter reads without blocking while the listener answers).
    pub(crate) fn try_clone_blocking(&self) -> io::Result<Conn> {
        Ok(Conn { nonblocking: false, ..self.try_clone()? })
    }

    /// As [`TcpStream::set_read_timeout`].
    ///
    /// # Errors
    /// `setsockopt` errors.
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.tcp.set_read_timeout(timeout)
    }

    /// As [`TcpStream::set_write_timeout`].
    ///
    /// # Errors
    /// `setsockopt` errors.
    pub fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.tcp.set_write_timeout(timeout)
    }

    /// As [`TcpStream::set_nonblocking`].
    ///
    /// # Errors
    /// `fcntl` errors.
    pub fn set_nonblocking(&mut self, nonblocking: bool) -> io::Result<()> {
        self.nonblocking = nonblocking;
        self.tcp.set_nonblocking(nonblocking)
    }

    /// Shuts the TCP connection down (every handle's reads and writes end).
    ///
    /// # Errors
    /// As [`TcpStream::shutdown`].
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.tcp.shutdown(how)
    }

    /// As [`TcpStream::peer_addr`].
    ///
    /// # Errors
    /// The socket is not connected.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.peer_addr()
    }

    /// As [`TcpStream::local_addr`].
    ///
    /// # Errors
    /// As `getsockname(2)`.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Whether bytes already received wait to be read: a reader must not sleep on the socket
    /// then, for it may never become readable again.
    pub fn has_buffered_input(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| {
            let mut s = lock(&t.session);
            !s.unread.is_empty() || s.conn.process_new_packets().is_ok_and(|st| st.plaintext_bytes_to_read() > 0)
        })
    }

    /// Whether encrypted bytes wait to be sent: the lane wants to write until they are.
    fn has_buffered_output(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| !lock(&t.out).is_empty() || lock(&t.session).conn.wants_write())
    }

    /// Sends what the session holds encrypted, and what `out` held before, as far as the socket
    /// takes it; `out` keeps the rest. The session's lock is not held while the socket blocks.
    fn send(&self, t: &Shared, out: &mut Vec<u8>) -> io::Result<()> {
        {
            let mut s = lock(&t.session);
            if self.nonblocking && out.is_empty() {
                // A non-blocking socket never blocks: straight from the session, one copy fewer.
                while s.conn.wants_write() {
                    s.conn.write_tls(&mut &self.tcp)?;
                }
                return Ok(());
            }
            while s.conn.wants_write() {
                s.conn.write_tls(out)?;
            }
        }
        let mut sent = 0;
        let result = loop {
            if sent == out.len() {
                break Ok(());
            }
            match (&self.tcp).write(&out[sent..]) {
                Ok(0) => break Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        out.drain(..sent);
        result
    }

    /// Sends what is encrypted if no writer is at it, without waiting for the socket (a reader's
    /// answers: alerts, key updates).
    fn send_if_idle(&self, t: &Shared) -> io::Result<()> {
        let Ok(mut out) = t.out.try_lock() else { return Ok(()) };
        match self.send(t, &mut out) {
            Err(e) if e.kind() != io::ErrorKind::WouldBlock => Err(e),
            _ => Ok(()),
        }
    }

    fn read_tls(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let shared = self.tls.clone().expect("a TLS connection");
        loop {
            {
                let mut s = lock(&shared.session);
                match s.conn.reader().read(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    done => return done,
                }
                if !s.unread.is_empty() {
                    let unread = std::mem::take(&mut s.unread);
                    Conn::feed(&mut s, &unread)?;
                    drop(s);
                    self.send_if_idle(&shared)?;
                    continue;
                }
            }
            if self.nonblocking {
                // A non-blocking socket never blocks: straight into the session, one copy fewer.
                // At the end of the stream rustls says whether it was a clean close.
                let mut s = lock(&shared.session);
                let n = s.conn.read_tls(&mut &self.tcp)?;
                s.conn.process_new_packets().map_err(tls_error)?;
                drop(s);
                if n > 0 {
                    self.send_if_idle(&shared)?;
                }
                continue;
            }
            // The socket is read without the session's lock: a writer on another thread goes on.
            if self.scratch.is_empty() {
                self.scratch = vec![0; READ_CHUNK];
            }
            let n = (&self.tcp).read(&mut self.scratch)?;
            let mut s = lock(&shared.session);
            if n == 0 {
                // The end of the stream: rustls says whether it was a clean close.
                s.conn.read_tls(&mut io::empty())?;
                s.conn.process_new_packets().map_err(tls_error)?;
                continue;
            }
            Conn::feed(&mut s, &self.scratch[..n])?;
            drop(s);
            self.send_if_idle(&shared)?;
        }
    }

    /// Hands `bytes` of ciphertext to the session until it holds plaintext to read; keeps the
    /// rest for later (rustls buffers a bounded amount of plaintext).
    fn feed(s: &mut Session, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            if s.conn.read_tls(&mut bytes)? == 0 {
                return Err(tls_error("bytes after the end of the session"));
            }
            let state = s.conn.process_new_packets().map_err(tls_error)?;
            if state.plaintext_bytes_to_read() > 0 || state.peer_has_closed() {
                break;
            }
        }
        s.unread.extend_from_slice(bytes);
        Ok(())
    }

    fn write_tls(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let shared = self.tls.clone().expect("a TLS connection");
        let mut out = lock(&shared.out);
        // Until the last chunk is sent, take no more: the socket's limit stays the lane's.
        self.send(&shared, &mut out)?;
        if self.owed > 0 {
            debug_assert!(bufs.iter().map(|b| b.len()).sum::<usize>() >= self.owed, "not the same bytes again");
            return Ok(std::mem::take(&mut self.owed));
        }
        let mut taken = 0;
        {
            let mut s = lock(&shared.session);
            let mut writer = s.conn.writer();
            for buf in bufs {
                let n = buf.len().min(WRITE_CHUNK - taken);
                taken += writer.write(&buf[..n])?;
                if taken == WRITE_CHUNK {
                    break;
                }
            }
        }
        match self.send(&shared, &mut out) {
            Ok(()) => Ok(taken),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && self.nonblocking => {
                self.owed = taken;
                Err(e)
            }
            // Blocking, the socket's write timeout ran out: the connection is stuck.
            Err(e) => Err(e),
        }
    }
}

/// A connection whose TLS handshake (if it has TLS) is under way on a non-blocking socket,
/// stepped as the socket allows ([`Opening::step`]): one thread can open many at once, however
/// their bytes trickle in.
pub struct Opening {
    tcp: TcpStream,
    tls: Option<Connection>,
    /// Whether a byte of the other end's handshake arrived: an accepted connection closed before
    /// any did is one that hung up unheard, as over plain TCP (the master's probe of a
    /// newcomer's data port, `docs/nat.md`), not a failed handshake.
    heard: bool,
}

/// What an [`Opening`] waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The socket to be readable.
    Read,
    /// The socket to be writable.
    Write,
    /// Nothing: the connection is open.
    Done,
}

impl Opening {
    /// Takes an accepted connection, set non-blocking: its server handshake if `tls` is given.
    ///
    /// # Errors
    /// `fcntl` errors, or a TLS session that cannot be made.
    pub fn accept(tcp: TcpStream, tls: Option<&TlsConfig>) -> io::Result<Opening> {
        tcp.set_nonblocking(true)?;
        let tls = tls.map(|t| ServerConnection::new(t.server.clone()).map(Connection::from)).transpose();
        Ok(Opening { tcp, tls: tls.map_err(tls_error)?, heard: false })
    }

    /// Takes a connection we dialed to `addr` (`host:port`), set non-blocking: its client
    /// handshake if `tls` is given, which checks that the other end's certificate names `host`.
    ///
    /// # Errors
    /// `fcntl` errors, a host that cannot be a server's name, or a TLS session that cannot be made.
    pub fn dial(tcp: TcpStream, addr: &str, tls: Option<&TlsConfig>) -> io::Result<Opening> {
        tcp.set_nonblocking(true)?;
        let Some(tls) = tls else { return Ok(Opening { tcp, tls: None, heard: false }) };
        let host = host_of(addr);
        let name =
            ServerName::try_from(host.to_string()).map_err(|e| tls_error(format!("{host} as a server name: {e}")))?;
        let conn = ClientConnection::new(tls.client.clone(), name).map_err(tls_error)?;
        Ok(Opening { tcp, tls: Some(conn.into()), heard: false })
    }

    /// Moves the handshake on as far as the socket allows without blocking.
    ///
    /// # Errors
    /// The other end hung up, or sent what is not a handshake (with TLS: a [`TlsError`]).
    pub fn step(&mut self) -> io::Result<Step> {
        let Some(conn) = &mut self.tls else { return Ok(Step::Done) };
        // What a listener without TLS does with a handshake: it reads it as garbage and hangs up.
        let hung_up = || tls_error("the other end hung up during the handshake (has it TLS?)");
        loop {
            if conn.wants_write() {
                match conn.write_tls(&mut self.tcp) {
                    Ok(_) => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Step::Write),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) if matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset) => {
                        return Err(hung_up())
                    }
                    Err(e) => return Err(e),
                }
            }
            // The client's last flight went out above.
            if !conn.is_handshaking() {
                return Ok(Step::Done);
            }
            match conn.read_tls(&mut self.tcp) {
                // Hung up unheard: a server was dialed and left, nothing was refused.
                Ok(0) if !self.heard && matches!(conn, Connection::Server(_)) => {
                    return Err(io::ErrorKind::UnexpectedEof.into())
                }
                Ok(0) => return Err(hung_up()),
                Ok(_) => self.heard = true,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Step::Read),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.kind(), io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset) => {
                    return Err(hung_up())
                }
                Err(e) => return Err(e),
            }
            if let Err(e) = conn.process_new_packets() {
                // The alert that says why, if it can go.
                let _ = conn.write_tls(&mut self.tcp);
                return Err(tls_error(format!("handshake: {e}")));
            }
        }
    }

    /// The open connection, non-blocking, once [`Opening::step`] said [`Step::Done`].
    pub fn open(self) -> Conn {
        debug_assert!(self.tls.as_ref().is_none_or(|c| !c.is_handshaking()), "opened mid-handshake");
        let tls = self.tls.map(|conn| {
            Arc::new(Shared { session: Mutex::new(Session { conn, unread: Vec::new() }), out: Mutex::default() })
        });
        Conn { tcp: self.tcp, tls, scratch: Vec::new(), nonblocking: true, owed: 0 }
    }
}

impl AsRawFd for Opening {
    fn as_raw_fd(&self) -> RawFd {
        self.tcp.as_raw_fd()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A TLS session failed or was refused: a certificate of another CA, a name that does not match,
/// an alert from the other end, bytes that are not TLS.
#[derive(Debug)]
pub struct TlsError(String);

impl std::fmt::Display for TlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TLS: {}", self.0)
    }
}

impl std::error::Error for TlsError {}

/// Whether `e` is a [`TlsError`]: a matter of credentials or configuration, which no retry
/// mends, rather than of the network.
pub fn is_tls_error(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<TlsError>())
}

fn tls_error(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, TlsError(e.to_string()))
}

/// The host of `host:port` (or `[v6]:port`).
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host)
}

impl From<Conn> for crate::Stream {
    fn from(conn: Conn) -> crate::Stream {
        match conn.tls {
            Some(_) => crate::Stream::Tls(conn),
            None => crate::Stream::Tcp(conn.tcp),
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.tls.is_some() {
            self.read_tls(buf)
        } else {
            self.tcp.read(buf)
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[io::IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        if self.tls.is_some() {
            self.write_tls(bufs)
        } else {
            self.tcp.write_vectored(bufs)
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match &self.tls {
            Some(t) => self.send(t, &mut lock(&t.out)),
            None => Ok(()),
        }
    }
}

impl AsRawFd for Conn {
    fn as_raw_fd(&self) -> RawFd {
        self.tcp.as_raw_fd()
    }
}

impl crate::TimedStream for Conn {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.tcp.set_read_timeout(timeout)
    }

    fn read_timed(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read(buf)
    }
}

impl crate::Lane for Conn {
    fn pollable(&self) -> Option<RawFd> {
        Some(self.tcp.as_raw_fd())
    }

    fn poll_events(&self, read: bool, write: bool) -> (bool, bool) {
        (read, write || self.has_buffered_output())
    }

    fn describe(&self) -> String {
        crate::Lane::describe(&self.tcp)
    }

    fn kind(&self) -> &'static str {
        if self.tls.is_some() {
            "tls"
        } else {
            "tcp"
        }
    }

    fn arm(&mut self) -> io::Result<bool> {
        if let Some(t) = &self.tls {
            self.send_if_idle(t)?;
        }
        Ok(!self.has_buffered_input())
    }
}

/// What [`make_certs`] wrote.
#[derive(Debug, Clone)]
pub struct MadeCerts {
    /// The run's CA certificate (give it to every process).
    pub ca: PathBuf,
    /// Whether the CA was made now (else an existing one in the directory signed the hosts').
    pub new_ca: bool,
    /// Per host: its certificate and key.
    pub hosts: Vec<(String, PathBuf, PathBuf)>,
}

/// Makes a run's certificates in `dir`: the CA (`ca.pem`, and `ca.key`, which signs more hosts
/// later: a CA already there is reused), and for each of `hosts` (an IP address or a DNS name,
/// as peers and the master are dialed) `HOST.pem` and `HOST.key`, valid for both ends of a
/// connection. Keys are ECDSA P-256, written mode 0600.
///
/// # Errors
/// A file cannot be written, a host is neither an IP address nor a DNS name, or an existing
/// `ca.key` cannot be read.
pub fn make_certs(dir: &Path, hosts: &[String]) -> Result<MadeCerts, TlsSetupError> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose};
    let io = |path: &Path, e: io::Error| TlsSetupError::File {
        what: "file",
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let (ca_cert, ca_key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
    let now = time::OffsetDateTime::now_utc();
    let validity = |params: &mut CertificateParams| {
        params.not_before = now - time::Duration::days(1);
        params.not_after = now + time::Duration::days(3650);
    };
    let new_ca = !ca_key_path.exists();
    let ca_key = if new_ca {
        KeyPair::generate().map_err(crypto)?
    } else {
        let pem = std::fs::read_to_string(&ca_key_path).map_err(|e| io(&ca_key_path, e))?;
        KeyPair::from_pem(&pem).map_err(|e| TlsSetupError::File {
            what: "CA key",
            path: ca_key_path.clone(),
            reason: e.to_string(),
        })?
    };
    // The CA is its subject and key: signed again here it signs as the one on disk did. Its
    // name comes from its key, so that another run's CA is another issuer, not an impostor.
    let mut ca_params = CertificateParams::default();
    let id: String = ca_key.public_key_raw().iter().skip(1).take(8).map(|b| format!("{b:02x}")).collect();
    ca_params.distinguished_name = rcgen::DistinguishedName::new();
    ca_params.distinguished_name.push(DnType::CommonName, format!("shoal run CA {id}"));
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut ca_params);
    let ca = ca_params.self_signed(&ca_key).map_err(crypto)?;
    if new_ca {
        write_private(&ca_key_path, &ca_key.serialize_pem()).map_err(|e| io(&ca_key_path, e))?;
        std::fs::write(&ca_cert, ca.pem()).map_err(|e| io(&ca_cert, e))?;
    }
    let mut made = Vec::new();
    for host in hosts {
        let mut params = CertificateParams::new(vec![host.clone()])
            .map_err(|e| TlsSetupError::HostName { host: host.clone(), reason: e.to_string() })?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, host.as_str());
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        validity(&mut params);
        let key = KeyPair::generate().map_err(crypto)?;
        let cert = params.signed_by(&key, &ca, &ca_key).map_err(crypto)?;
        let file = host.replace(':', "_");
        let (cert_path, key_path) = (dir.join(format!("{file}.pem")), dir.join(format!("{file}.key")));
        std::fs::write(&cert_path, cert.pem()).map_err(|e| io(&cert_path, e))?;
        write_private(&key_path, &key.serialize_pem()).map_err(|e| io(&key_path, e))?;
        made.push((host.clone(), cert_path, key_path));
    }
    Ok(MadeCerts { ca: ca_cert, new_ca, hosts: made })
}

/// Writes a file only its owner can read.
fn write_private(path: &Path, contents: &str) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    f.write_all(contents.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::thread;

    /// A fresh directory with a run's certificates for 127.0.0.1 and `localhost`.
    fn certs(name: &str) -> (PathBuf, TlsConfig) {
        let dir = std::env::temp_dir().join(format!("shoal-tls-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let made = make_certs(&dir, &["127.0.0.1".into(), "localhost".into()]).unwrap();
        assert!(made.new_ca);
        let (_, cert, key) = made.hosts[0].clone();
        let config = TlsConfig::load(&TlsFiles { cert, key, ca: made.ca }).unwrap();
        (dir, config)
    }

    /// Accepts one connection on a new listener with `server`, and hands it to `then`.
    fn serve<T: Send + 'static>(
        server: Option<TlsConfig>,
        then: impl FnOnce(io::Result<Conn>) -> T + Send + 'static,
    ) -> (String, thread::JoinHandle<T>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let handle = thread::spawn(move || {
            let (tcp, _) = listener.accept().unwrap();
            then(Conn::accept(tcp, server.as_ref(), Instant::now() + Duration::from_secs(5)))
        });
        (addr, handle)
    }

    /// Both ends of a TLS connection read on one thread and write on another at once, with
    /// megabytes in flight both ways (a reader blocked in the socket must not hold up a writer).
    #[test]
    fn a_tls_connection_reads_and_writes_at_once_from_two_threads() {
        let (_dir, config) = certs("duplex");
        const BYTES: usize = 8 << 20;
        let pattern = |i: usize| (i * 31 % 251) as u8;
        let echo = move |conn: Conn| {
            let mut reader = conn.try_clone().unwrap();
            let mut writer = conn;
            let sending = thread::spawn(move || {
                let data: Vec<u8> = (0..BYTES).map(pattern).collect();
                writer.write_all(&data).unwrap();
                writer
            });
            let mut got = vec![0u8; BYTES];
            reader.read_exact(&mut got).unwrap();
            assert!(got.iter().enumerate().all(|(i, &b)| b == pattern(i)), "the bytes arrived changed");
            sending.join().unwrap();
        };
        let (addr, server) = serve(Some(config.clone()), move |c| echo(c.unwrap()));
        let client = Conn::dial(&addr, Duration::from_secs(5), Some(&config)).unwrap();
        assert!(client.is_tls());
        // Both ends writing while both read once waited on each other for ever: a deadlock
        // fails here instead of hanging the suite.
        let (done, finished) = std::sync::mpsc::channel();
        thread::spawn(move || {
            echo(client);
            let _ = done.send(());
        });
        finished.recv_timeout(Duration::from_secs(60)).expect("the two ends wait on each other");
        server.join().unwrap();
    }

    /// Non-blocking, as the engine drives a lane: a write counts bytes once they are in the
    /// socket (a full socket says `WouldBlock`, and the same bytes are offered again), and every
    /// byte arrives in order.
    #[test]
    fn a_nonblocking_tls_lane_moves_every_byte() {
        use crate::Lane;
        let (_dir, config) = certs("lane");
        const BYTES: usize = 4 << 20;
        let (addr, server) = serve(Some(config.clone()), |c| {
            let mut c = c.unwrap();
            c.set_nonblocking(true).unwrap();
            let mut got = Vec::with_capacity(BYTES);
            let mut buf = vec![0u8; 10_000];
            while got.len() < BYTES {
                match c.read(&mut buf) {
                    Ok(0) => panic!("closed early"),
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if c.arm().unwrap() {
                            let mut fd = crate::PollFd::from_raw(c.pollable().unwrap());
                            (fd.want_read, fd.want_write) = c.poll_events(true, false);
                            crate::poll(&mut [fd], Duration::from_millis(100)).unwrap();
                        }
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            got
        });
        let mut c = Conn::dial(&addr, Duration::from_secs(5), Some(&config)).unwrap();
        c.set_nonblocking(true).unwrap();
        let data: Vec<u8> = (0..BYTES).map(|i| (i % 253) as u8).collect();
        let mut sent = 0;
        while sent < BYTES {
            match c.write(&data[sent..(sent + 100_000).min(BYTES)]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
            if c.arm().unwrap() {
                let mut fd = crate::PollFd::from_raw(c.pollable().unwrap());
                (fd.want_read, fd.want_write) = c.poll_events(false, sent < BYTES);
                crate::poll(&mut [fd], Duration::from_millis(100)).unwrap();
            }
        }
        // Written means sent: nothing lies encrypted here once the last write said so.
        assert!(!c.has_buffered_output());
        assert_eq!(server.join().unwrap(), data);
    }

    /// A certificate from another run's CA, a certificate that does not name the host dialed,
    /// and a dialer that speaks no TLS are all refused, with an error that says TLS.
    #[test]
    fn strangers_without_the_runs_certificates_are_refused() {
        let (_dir, config) = certs("refuse");
        let (_other_dir, other) = certs("refuse-other");
        let (addr, server) = serve(Some(config.clone()), |c| c.map(|_| ()));
        let e = Conn::dial(&addr, Duration::from_secs(5), Some(&other)).err().expect("another CA's certificate");
        assert!(e.to_string().contains("TLS"), "{e}");
        assert!(server.join().unwrap().is_err());
        // The certificate names 127.0.0.1 and localhost, not 127.0.0.2.
        let listener = TcpListener::bind("127.0.0.2:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server_config = config.clone();
        let server = thread::spawn(move || {
            let (tcp, _) = listener.accept().unwrap();
            Conn::accept(tcp, Some(&server_config), Instant::now() + Duration::from_secs(5)).map(|_| ())
        });
        let e = Conn::dial(&format!("127.0.0.2:{port}"), Duration::from_secs(5), Some(&config)).err().expect("name");
        assert!(e.to_string().contains("TLS"), "{e}");
        assert!(server.join().unwrap().is_err());
        // A plaintext dialer's bytes are not a TLS handshake.
        let (addr, server) = serve(Some(config), |c| c.map(|_| ()));
        let mut plain = Conn::dial(&addr, Duration::from_secs(5), None).unwrap();
        plain.write_all(b"\0\0\0\0 not a handshake").unwrap();
        assert!(server.join().unwrap().is_err());
    }

    /// An eavesdropper on the path sees no plaintext: a relay between the two ends records what
    /// crosses it, and the pattern sent is nowhere in it (while a plaintext connection shows it).
    #[test]
    fn bytes_on_the_wire_are_encrypted() {
        let (_dir, config) = certs("wire");
        let secret_pattern: Vec<u8> = b"shoal tensor bytes ".repeat(4096);
        let relayed = |tls: Option<TlsConfig>| -> Vec<u8> {
            let expected = secret_pattern.clone();
            let (server_addr, server) = serve(tls.clone(), move |c| {
                let mut c = c.unwrap();
                let mut got = vec![0u8; expected.len()];
                c.read_exact(&mut got).unwrap();
                assert_eq!(got, expected);
            });
            // The relay: accepts the dialer, dials the server, copies both ways, records one.
            let relay = TcpListener::bind("127.0.0.1:0").unwrap();
            let relay_addr = relay.local_addr().unwrap().to_string();
            let recorder = thread::spawn(move || {
                let (mut from_client, _) = relay.accept().unwrap();
                let mut to_server = TcpStream::connect(&server_addr).unwrap();
                let (mut back_from, mut back_to) = (to_server.try_clone().unwrap(), from_client.try_clone().unwrap());
                thread::spawn(move || io::copy(&mut back_from, &mut back_to));
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    match from_client.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            seen.extend_from_slice(&buf[..n]);
                            if to_server.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                seen
            });
            let mut c = Conn::dial(&relay_addr, Duration::from_secs(5), tls.as_ref()).unwrap();
            c.write_all(&secret_pattern).unwrap();
            server.join().unwrap();
            c.shutdown(Shutdown::Both).unwrap();
            recorder.join().unwrap()
        };
        let needle = b"shoal tensor bytes";
        let contains = |hay: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
        assert!(contains(&relayed(None)), "the relay records what crosses it");
        let seen = relayed(Some(config));
        assert!(seen.len() > secret_pattern.len(), "the relay saw the whole transfer");
        assert!(!contains(&seen), "plaintext crossed the wire under TLS");
    }

    /// A dialer that sends nothing cannot hold an acceptor's handshake past its deadline.
    #[test]
    fn a_silent_dialer_runs_out_the_handshake_deadline() {
        let (_dir, config) = certs("silent");
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let _silent = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (tcp, _) = listener.accept().unwrap();
        let started = Instant::now();
        let e = Conn::accept(tcp, Some(&config), started + Duration::from_millis(200)).err().expect("timed out");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() < Duration::from_secs(3));
    }

    /// A dialer that sends its ClientHello a byte at a time cannot hold the acceptor past its
    /// deadline either: each byte arrived within the read timeout, so 300 trickling handshakes
    /// once held the master's slots for 40 s against a 5 s deadline.
    #[test]
    fn a_trickling_dialer_runs_out_the_handshake_deadline() {
        let (_dir, config) = certs("trickle");
        let name = ServerName::try_from("127.0.0.1".to_string()).unwrap();
        let mut hello = Vec::new();
        ClientConnection::new(config.client.clone(), name).unwrap().write_tls(&mut hello).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut trickler = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (tcp, _) = listener.accept().unwrap();
        let dripping = std::thread::spawn(move || {
            for b in hello {
                if trickler.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let started = Instant::now();
        let e = Conn::accept(tcp, Some(&config), started + Duration::from_millis(300)).err().expect("timed out");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(started.elapsed() < Duration::from_millis(800), "held for {:?}", started.elapsed());
        dripping.join().unwrap();
    }

    #[test]
    fn tls_needs_all_three_files_or_none() {
        assert_eq!(TlsFiles::from_parts(None, None, None), Ok(None));
        let e = TlsFiles::from_parts(Some("a".into()), None, Some("c".into())).unwrap_err();
        assert_eq!(e, TlsSetupError::Incomplete(vec!["key"]));
        assert!(e.to_string().contains("missing: key"), "{e}");
        let e = TlsConfig::load(&TlsFiles { cert: "/nonexistent.pem".into(), key: "k".into(), ca: "c".into() });
        assert!(
            matches!(e, Err(TlsSetupError::File { what: "certificate", path, .. }) if path.ends_with("nonexistent.pem"))
        );
    }

    /// A CA already in the directory signs the next hosts' certificates: a host added later
    /// joins the same run.
    #[test]
    fn hosts_added_later_are_signed_by_the_same_ca() {
        let (dir, first) = certs("later");
        let made = make_certs(&dir, &["127.0.0.1".into()]).unwrap();
        assert!(!made.new_ca);
        let (_, cert, key) = made.hosts[0].clone();
        let later = TlsConfig::load(&TlsFiles { cert, key, ca: made.ca }).unwrap();
        let (addr, server) = serve(Some(first), |c| c.map(|_| ()));
        Conn::dial(&addr, Duration::from_secs(5), Some(&later)).unwrap();
        server.join().unwrap().unwrap();
    }
}
