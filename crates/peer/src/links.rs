//! Data connections between peers.
//!
//! Each peer listens on one port. A *link* to another member of the group is a pool of streams
//! we dialed (we send on them) and a pool it dialed (we receive on them): a dialed stream carries
//! data one way only, from dialer to acceptor, so each side opens its half when it first has
//! something to send, and neither waits for the other to decide. Before a topology is in force
//! a peer links to its ring successor and predecessor, and in a small group to every member on
//! another host, its dials all at once ([`Listener::establish`]); a schedule that exchanges data
//! with other members links to them when first posted ([`Listener::open`],
//! [`Listener::take_pool`]), and every later collective of the topology reuses the link. Links
//! are for one topology alone: a collective that failed leaves half-sent chunks in its streams,
//! and a member that never ran it (it joined the re-formed ring first) cannot tell, so no pool
//! outlives its topology.
//!
//! A stream opens with `PeerHello`, which names the run's session, both peers and the topology,
//! so a stranger, a process of an earlier run or a pool of a replaced topology cannot feed bytes
//! into a collective.

use crate::config::CommunicatorConfig;
use crate::control::{Control, Waker};
use crate::error::{Error, Result};
use crate::fetch::{Asker, FetchConn, Held};
use crate::Deadline;
use shoal_proto::auth::DataKey;
use shoal_proto::peer::{Established, RingPosition};
use shoal_transport::dial::{dial_all, Dial};
use shoal_transport::gate::{Full, Gate};
use shoal_transport::greet::{greet_until, greeters, Greet, Greeted, Handshake, Limits, Listening};
use shoal_transport::shm::{ShmLane, RING_BYTES};
use shoal_transport::{limit_unsent, write_message, Conn, Stream, TlsConfig, TransportError};
use shoal_wire::{Epoch, Member, Message, PeerId, SessionId};
use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

/// How long an accepted stream may take to say hello, however its bytes trickle in.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections a data port greets at once (TLS handshake, hello), on its accept threads
/// (`shoal_transport::greet`). Past it, new ones are closed at once: 20,000 trickling handshakes
/// once gave a peer 19,990 threads, one per greeting, and ran it out of descriptors.
const MAX_GREETINGS: usize = 1024;
/// Of those, from one address: a pool is at most `MAX_CONNECTIONS` (256) streams, and a host may
/// run several peers that dial at once.
const MAX_GREETINGS_PER_SOURCE: usize = 512;
/// The largest hello (`PeerHello` or `FetchRequest`) an accepted stream may announce.
const MAX_HELLO_BODY: u32 = 1 << 10;
/// Fetch connections held at once (served on a thread each, or waiting for the sync in
/// progress): a newcomer dials a few per donor; past it, another is refused.
pub(crate) const MAX_FETCHES: usize = 256;
/// How long one dial may take before the successor is reported unreachable.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// Data streams one call dials at once, on its own thread: 63 pools of 16 streams (a 64-peer
/// one-shot) go out in one round trip, while a run of larger pools waits its turn rather than
/// flood the members' accept queues (`ACCEPT_BACKLOG`) with SYNs.
const DIALS_AT_ONCE: usize = 1024;
/// Shared-memory lanes one call opens at once, a thread each: each waits for the member on this
/// host to map its ring.
const LOCAL_DIALS_AT_ONCE: usize = 8;
/// The most a dialed stream holds written but unsent: the engine gives a pool's streams data
/// as each drains, so no window-bound stream queues what the others could have carried (in the
/// lab's long-fat pipe, 8 concurrent 8 MiB all-reduces over 8 streams took 807 ms without it,
/// 717 ms with it), and a frame waits behind at most this much of its stream.
const UNSENT_LIMIT: u32 = 256 << 10;
/// Largest group whose members each link to every member on another host when its topology is
/// established, rather than when a collective first needs the link (a full mesh: past this,
/// what a ring-only run would hold open costs more than the round trip it saves).
const EAGER_LINKS_MAX: usize = 16;
/// How often a wait for the predecessor's streams looks at the control state.
const ESTABLISH_POLL: Duration = Duration::from_millis(20);

/// Who we are in the run, once registered: what greetings must be addressed to and tagged with.
#[derive(Debug)]
struct Identity {
    me: PeerId,
    session: SessionId,
    key: DataKey,
}

/// The listening side, shared with its accept threads.
pub(crate) struct Listener {
    pub port: u16,
    identity: Arc<OnceLock<Identity>>,
    advertised_ip: OnceLock<Option<IpAddr>>,
    arrivals: Arc<Arrivals>,
    stop: Arc<AtomicBool>,
    /// Streams to dial per member where `optimize_topology` sized the pool.
    sized: Mutex<BTreeMap<PeerId, usize>>,
    /// TLS for every data connection, dialed or accepted.
    pub tls: Option<TlsConfig>,
}

/// Streams accepted and greeted, not yet taken into a [`crate::plane::DataPlane`] (or, for
/// shared-state fetches, by the sync that serves them).
struct Arrivals {
    streams: Mutex<BTreeMap<PeerId, Pool>>,
    /// Pools a member that cannot be dialed opened to us for our data to it (a reverse dial),
    /// by that member: our sending half of the link.
    reverse: Mutex<BTreeMap<PeerId, Pool>>,
    fetches: Mutex<std::collections::VecDeque<crate::fetch::FetchConn>>,
    /// Fetch connections held, served or waiting: at most [`MAX_FETCHES`].
    fetching: Arc<AtomicUsize>,
    /// The copy of the shared state kept for newcomers, served to each on a thread of its own.
    snapshots: Arc<crate::fetch::Snapshots>,
    /// Connections refused at their greeting (strangers, forgeries, stale pools), and what of
    /// them may be logged ([`shoal_proto::loglimit`]).
    refused: AtomicU64,
    refusals: Mutex<shoal_proto::loglimit::LogLimit>,
    /// Connections greeting at once: at most [`MAX_GREETINGS`], at most
    /// [`MAX_GREETINGS_PER_SOURCE`] from one address (those on this host count as one).
    greeting: Arc<Gate>,
    changed: Condvar,
    /// Woken when a pool is complete: a driver waiting for a link polls it.
    arrived: Waker,
}

/// A pool being filled: `size` streams announced for topology `epoch`, those arrived by index.
struct Pool {
    epoch: Epoch,
    size: usize,
    streams: BTreeMap<u16, Stream>,
}

/// The pools dialed for a topology being established, until it is taken up.
#[derive(Default)]
pub(crate) struct Staged {
    /// Streams we dialed, by the peer they reach: we send on them.
    pub outgoing: BTreeMap<PeerId, Vec<Stream>>,
    /// Streams we receive on, by the peer that sends: it dialed them, or we did for it (a reverse
    /// dial, it cannot be dialed).
    pub incoming: BTreeMap<PeerId, Vec<Stream>>,
    /// The topology they are for: a call that ended while it established that topology leaves
    /// them to the next call, which goes on where it stopped (redialing would close the streams
    /// a member already took).
    pub epoch: Option<Epoch>,
}

impl Listener {
    /// Binds `addr` and starts accepting, with TLS if `tls` is given.
    pub fn start(addr: &str, tls: Option<TlsConfig>, snapshots: Arc<crate::fetch::Snapshots>) -> Result<Self> {
        Self::start_gated(addr, tls, snapshots, Gate::new(MAX_GREETINGS, MAX_GREETINGS_PER_SOURCE))
    }

    /// As [`Listener::start`], greeting at most what `greeting` lets in at once.
    fn start_gated(
        addr: &str,
        tls: Option<TlsConfig>,
        snapshots: Arc<crate::fetch::Snapshots>,
        greeting: Arc<Gate>,
    ) -> Result<Self> {
        let io = |context: &str| {
            let context = format!("{context} {addr}");
            move |source| Error::Io { context, source }
        };
        let listener = shoal_transport::listen(addr).map_err(io("binding the data listener on"))?;
        let arrived = Waker::new().map_err(io("creating a wake-up pipe for"))?;
        let arrivals = Arrivals {
            streams: Mutex::default(),
            reverse: Mutex::default(),
            fetches: Mutex::default(),
            fetching: Arc::default(),
            snapshots,
            refused: AtomicU64::new(0),
            refusals: Mutex::default(),
            greeting,
            changed: Condvar::new(),
            arrived,
        };
        let port = listener.local_addr().map_err(io("reading the address of"))?.port();
        let me = Listener {
            port,
            identity: Arc::new(OnceLock::new()),
            advertised_ip: OnceLock::new(),
            arrivals: Arc::new(arrivals),
            stop: Arc::new(AtomicBool::new(false)),
            sized: Mutex::new(BTreeMap::new()),
            tls,
        };
        for _ in 0..greeters(me.tls.is_some()) {
            let listener = listener.try_clone().map_err(io("sharing"))?;
            let (identity, arrivals, stop, tls) =
                (me.identity.clone(), me.arrivals.clone(), me.stop.clone(), me.tls.clone());
            thread::Builder::new()
                .name("shoal-accept".into())
                .spawn(move || accept_loop(listener, tls, identity, arrivals, stop))
                .map_err(io("spawning an accept thread for"))?;
        }
        // Members in this network namespace reach us here for shared-memory lanes. Without it
        // (the name is taken: another process bound our port on another address) they dial TCP.
        let name = std::os::unix::net::SocketAddr::from_abstract_name(local_name(port));
        match name.and_then(|n| UnixListener::bind_addr(&n)) {
            Ok(local) => {
                let (identity, arrivals, stop) = (me.identity.clone(), me.arrivals.clone(), me.stop.clone());
                thread::Builder::new()
                    .name("shoal-accept-local".into())
                    .spawn(move || accept_loop(local, None, identity, arrivals, stop))
                    .map_err(io("spawning the local accept thread for"))?;
            }
            // Taken by another process: maybe one of another user's, squatting it to intercept
            // lanes (dialers check who listens before they send anything).
            Err(e) => {
                log::warn!("no shared-memory lanes to the listener on {addr}: local socket @{}: {e}", local_name(port))
            }
        }
        Ok(me)
    }

    /// Tells the accept threads who we are, once registered, the run's data key, and the address
    /// we advertise.
    pub fn set_identity(&self, me: PeerId, session: SessionId, key: DataKey, advertised: &str) {
        let _ = self.identity.set(Identity { me, session, key });
        let _ = self.advertised_ip.set(advertised.parse::<SocketAddr>().ok().map(|a| a.ip()));
    }

    /// The copy of the shared state this peer keeps for newcomers.
    pub fn snapshots(&self) -> &crate::fetch::Snapshots {
        &self.arrivals.snapshots
    }

    /// The next connection a peer opened to fetch shared state from us, with its first request;
    /// waits up to `wait`.
    pub fn take_fetch(&self, wait: Duration) -> Option<crate::fetch::FetchConn> {
        let fetches = self.arrivals.fetches.lock().unwrap_or_else(PoisonError::into_inner);
        let mut fetches = self
            .arrivals
            .changed
            .wait_timeout_while(fetches, wait, |f| f.is_empty())
            .unwrap_or_else(PoisonError::into_inner)
            .0;
        fetches.pop_front()
    }

    fn local_ip(&self) -> Option<IpAddr> {
        self.advertised_ip.get().copied().flatten()
    }

    /// Streams to dial to `member`: as sized by `optimize_topology`, else as configured.
    fn connections(&self, config: &CommunicatorConfig, member: &Member) -> usize {
        let sized = self.sized.lock().unwrap_or_else(PoisonError::into_inner).get(&member.peer).copied();
        sized
            .filter(|_| config.connections.is_none())
            .unwrap_or_else(|| config.pool_size(self.local_ip(), &member.addr))
    }

    /// From the next topology on, pools we dial to `peer` hold `streams` streams.
    pub fn size_pool(&self, peer: PeerId, streams: usize) {
        self.sized.lock().unwrap_or_else(PoisonError::into_inner).insert(peer, streams);
    }

    /// Polled for reading, it wakes when a pool arrived.
    pub fn arrived(&self) -> &Waker {
        &self.arrivals.arrived
    }

    /// Dials a pool to each of `members` for topology `epoch`, made non-blocking: our half of the
    /// links a schedule needs, all at once; with `reverse`, each member's half of its link to us
    /// (it cannot be dialed, [`Dialer::Receiver`]).
    pub fn open(
        &self,
        members: &[&Member],
        reverse: bool,
        epoch: Epoch,
        config: &CommunicatorConfig,
        deadline: Deadline,
    ) -> Vec<std::result::Result<Vec<Stream>, DialFailed>> {
        let id = self.identity.get().expect("identity is set at registration");
        let pools: Vec<PoolTo> = members.iter().map(|m| self.pool_to(config, m, reverse)).collect();
        dial_pools(id, &pools, epoch, config.shared_memory, self.tls.as_ref(), deadline, "all_reduce")
    }

    fn pool_to<'a>(&self, config: &CommunicatorConfig, member: &'a Member, reverse: bool) -> PoolTo<'a> {
        PoolTo { to: member.peer, addr: &member.addr, streams: self.connections(config, member), reverse }
    }

    /// The pool `from` dialed to us for topology `epoch`, if it is complete, made non-blocking:
    /// its half of a link.
    pub fn take_pool(&self, from: PeerId, epoch: Epoch) -> Option<Vec<Stream>> {
        take_complete(&mut self.arrivals.streams.lock().unwrap_or_else(PoisonError::into_inner), from, epoch)
    }

    /// The pool `to` dialed to us for our data to it in topology `epoch` (a reverse dial), if it
    /// is complete, made non-blocking: our half of the link.
    pub fn take_reverse(&self, to: PeerId, epoch: Epoch) -> Option<Vec<Stream>> {
        take_complete(&mut self.arrivals.reverse.lock().unwrap_or_else(PoisonError::into_inner), to, epoch)
    }

    /// Makes `staged` hold a pool to our successor and one from our predecessor for the topology
    /// of `pos` (and, in a small group, to the members on other hosts), going on from what an
    /// earlier try at the same topology staged. Each pool is dialed by its sender, or by its
    /// receiver where only the sender can be dialed ([`Dialer`]). Gives up once the state machine
    /// says the topology is superseded (or we are out of the run) or no call waits for it any
    /// more, or at `deadline`: the state machine ends the call.
    pub fn establish(
        &self,
        staged: &mut Staged,
        control: &Control,
        pos: &RingPosition,
        config: &CommunicatorConfig,
        deadline: Deadline,
        operation: &'static str,
    ) -> Established {
        let members: BTreeSet<PeerId> = pos.ring.iter().map(|m| m.peer).collect();
        if staged.epoch != Some(pos.epoch) {
            staged.outgoing.clear();
            staged.incoming.clear();
            staged.epoch = Some(pos.epoch);
        }
        for arrivals in [&self.arrivals.streams, &self.arrivals.reverse] {
            let mut arrivals = arrivals.lock().unwrap_or_else(PoisonError::into_inner);
            arrivals.retain(|p, pool| members.contains(p) && pool.epoch >= pos.epoch);
        }
        if pos.group_size() == 1 {
            return Established::Ready;
        }
        let id = self.identity.get().expect("identity is set at registration");
        let (me, mine) = (id.me, &pos.ring[pos.rank]);
        let (next, prev) = (pos.next(), pos.prev());
        for (from, to, them) in [(mine, next, next), (prev, mine, prev)] {
            if Dialer::of(from, to) == Dialer::Nobody {
                log::warn!("{me}: no path to {}: neither {} nor {} can be dialed", them.peer, from.peer, to.peer);
                return Established::Unreachable(them.peer);
            }
        }
        // The members on other hosts too, while the group is small, in the same round trip: the
        // one-shot and two-shot schedules of small collectives link to every member, and would
        // otherwise dial them when first posted, a round trip of the first collective.
        let mut others: Vec<&Member> = Vec::new();
        if pos.group_size() <= EAGER_LINKS_MAX {
            let elsewhere = |m: &&Member| !crate::config::on_this_host(self.local_ip(), &m.addr);
            others.extend(pos.ring.iter().filter(|m| m.peer != me).filter(elsewhere));
        }
        // What we send on, to those we can dial; what we receive on, from those that cannot dial us.
        let mut sends: Vec<&Member> = vec![next];
        sends.extend(others.iter().copied().filter(|m| m.peer != next.peer));
        sends.retain(|m| Dialer::of(mine, m) == Dialer::Sender && !staged.outgoing.contains_key(&m.peer));
        let mut receives: Vec<&Member> = vec![prev];
        receives.extend(others.iter().copied().filter(|m| m.peer != prev.peer));
        receives.retain(|m| Dialer::of(m, mine) == Dialer::Receiver && !staged.incoming.contains_key(&m.peer));
        for (reverse, targets, neighbour) in [(false, &sends, next), (true, &receives, prev)] {
            let pools: Vec<PoolTo> = targets.iter().map(|m| self.pool_to(config, m, reverse)).collect();
            let tls = self.tls.as_ref();
            let dialed = dial_pools(id, &pools, pos.epoch, config.shared_memory, tls, deadline, operation);
            for (m, dialed) in targets.iter().zip(dialed) {
                match dialed {
                    Ok(pool) if reverse => drop(staged.incoming.insert(m.peer, pool)),
                    Ok(pool) => drop(staged.outgoing.insert(m.peer, pool)),
                    Err(reason) if m.peer == neighbour.peer => {
                        log::warn!("{me}: cannot reach {}: {reason}", m.peer);
                        return Established::Unreachable(m.peer);
                    }
                    // The first collective that needs it dials again, and fails if it cannot.
                    Err(reason) => log::info!("{me}: no link to {} yet: {reason}", m.peer),
                }
            }
        }
        loop {
            {
                let mut arrivals = self.arrivals.streams.lock().unwrap_or_else(PoisonError::into_inner);
                if let Entry::Vacant(slot) = staged.incoming.entry(prev.peer) {
                    if let Some(pool) = take_complete(&mut arrivals, prev.peer, pos.epoch) {
                        slot.insert(pool);
                    }
                }
                // A successor that cannot be dialed opens our pool to it itself.
                if let Entry::Vacant(slot) = staged.outgoing.entry(next.peer) {
                    let mut reversed = self.arrivals.reverse.lock().unwrap_or_else(PoisonError::into_inner);
                    if let Some(pool) = take_complete(&mut reversed, next.peer, pos.epoch) {
                        slot.insert(pool);
                    }
                }
                if staged.incoming.contains_key(&prev.peer) && staged.outgoing.contains_key(&next.peer) {
                    return Established::Ready;
                }
                let Ok(wait) = deadline.left(operation) else { return Established::Superseded };
                drop(self.arrivals.changed.wait_timeout(arrivals, wait.min(ESTABLISH_POLL)));
            }
            let peer = control.lock();
            if peer.superseded(pos.epoch) || !peer.establishing(pos.epoch) {
                return Established::Superseded;
            }
        }
    }
}

/// Who opens the pool that carries one member's data to another (`docs/nat.md`), as the master
/// found each member at admission (`Member::dialable`, `Member::seen`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialer {
    /// The sender dials the receiver: it can be dialed, or both sit on one network.
    Sender,
    /// The receiver dials the sender (a reverse dial): only the sender can be dialed.
    Receiver,
    /// Neither can dial the other.
    Nobody,
}

impl Dialer {
    /// Who dials the pool of `from`'s data to `to`.
    pub(crate) fn of(from: &Member, to: &Member) -> Dialer {
        let one_network = from.seen.is_some() && from.seen == to.seen;
        if to.dialable || one_network {
            Dialer::Sender
        } else if from.dialable {
            Dialer::Receiver
        } else {
            Dialer::Nobody
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Why a pool to a member could not be dialed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DialFailed {
    /// The call's bound passed first.
    #[error(transparent)]
    OutOfTime(crate::Error),
    /// The member's port did not take the connection, its TLS handshake failed, or the hello
    /// did not go out.
    #[error("dialing {to} at {addr}: {source}")]
    Dialing { to: PeerId, addr: String, source: std::io::Error },
    /// The stream could not be set up for the engine.
    #[error("configuring a stream to {to}: {source}")]
    Configuring { to: PeerId, source: std::io::Error },
}

/// A pool to dial: to whom, where, and how many streams.
pub(crate) struct PoolTo<'a> {
    pub to: PeerId,
    pub addr: &'a str,
    pub streams: usize,
    /// It carries `to`'s data to us: `to` cannot dial us.
    pub reverse: bool,
}

/// Dials every pool of `pools` for topology `epoch` at once, their streams made non-blocking:
/// shared-memory lanes to members on this host where `shared_memory` allows, TCP (with `tls`)
/// otherwise, all of those on this thread ([`shoal_transport::dial`]), at most [`DIALS_AT_ONCE`]
/// under way. A pool fails whole when one of its streams does.
#[allow(clippy::too_many_arguments)]
fn dial_pools(
    id: &Identity,
    pools: &[PoolTo<'_>],
    epoch: Epoch,
    shared_memory: bool,
    tls: Option<&TlsConfig>,
    deadline: Deadline,
    operation: &'static str,
) -> Vec<Result<Vec<Stream>, DialFailed>> {
    let left = match deadline.left(operation) {
        Ok(left) => left.min(DIAL_TIMEOUT),
        Err(_) => {
            let late = || crate::Error::Timeout { operation, after: deadline.bound() };
            return pools.iter().map(|_| Err(DialFailed::OutOfTime(late()))).collect();
        }
    };
    let by = Instant::now() + left;
    // Every stream of every pool: (pool, its hello).
    let streams: Vec<(usize, Message)> = (pools.iter().enumerate())
        .flat_map(|(k, pool)| {
            let (count, reverse) = (pool.streams as u16, pool.reverse);
            (0..count).map(move |stream| {
                let mac = id.key.hello(id.session, id.me, pool.to, epoch, stream, count, reverse);
                (k, Message::PeerHello { from: id.me, to: pool.to, epoch, stream, streams: count, reverse, mac })
            })
        })
        .collect();
    // The same machine and network namespace: the member's local socket answers there.
    let lanes = match shared_memory {
        true => at_most(streams.len(), LOCAL_DIALS_AT_ONCE, |i| {
            let (k, hello) = &streams[i];
            dial_local(id, pools[*k].addr, hello, by.saturating_duration_since(Instant::now()).min(HELLO_TIMEOUT))
        }),
        false => streams.iter().map(|_| None).collect(),
    };
    let remote: Vec<usize> = (0..streams.len()).filter(|&i| lanes[i].is_none()).collect();
    let frames: Vec<Vec<u8>> = remote
        .iter()
        .map(|&i| shoal_wire::encode_frame(id.session, &streams[i].1).expect("a hello fits a frame"))
        .collect();
    let dials: Vec<Dial> =
        remote.iter().zip(&frames).map(|(&i, f)| Dial { addr: pools[streams[i].0].addr, first: f }).collect();
    let mut dialed = dial_all(&dials, tls, by, DIALS_AT_ONCE).into_iter();
    let mut out: Vec<Result<Vec<Stream>, DialFailed>> =
        pools.iter().map(|p| Ok(Vec::with_capacity(p.streams))).collect();
    for ((k, _), lane) in streams.iter().zip(lanes) {
        let pool = &pools[*k];
        let stream = match lane {
            Some(lane) => Ok(Stream::Shm(lane)),
            None => dialed
                .next()
                .expect("a dial per stream without a lane")
                .map_err(|source| DialFailed::Dialing { to: pool.to, addr: pool.addr.to_string(), source })
                .and_then(|conn| {
                    let configured = limit_unsent(conn.tcp(), UNSENT_LIMIT).map(|()| Stream::from(conn));
                    configured.map_err(|source| DialFailed::Configuring { to: pool.to, source })
                }),
        };
        // From here the engine drives it, without blocking.
        let stream = stream.and_then(|mut s| match s.set_nonblocking() {
            Ok(()) => Ok(s),
            Err(source) => Err(DialFailed::Configuring { to: pool.to, source }),
        });
        match (&mut out[*k], stream) {
            (Ok(held), Ok(s)) => held.push(s),
            (Err(_), _) => {}
            (slot, Err(e)) => *slot = Err(e),
        }
    }
    for (pool, dialed) in pools.iter().zip(&out) {
        if let Ok(streams) = dialed {
            let kind = match streams.first() {
                Some(Stream::Shm(_)) => "shared-memory",
                Some(Stream::Tls(_)) => "TLS",
                _ => "TCP",
            };
            let reverse = if pool.reverse { " for its data to us" } else { "" };
            log::debug!("{} dialed {} {kind} streams to {} at {}{reverse}", id.me, pool.streams, pool.to, pool.addr);
        }
    }
    out
}

/// `f(0)`, ..., `f(n - 1)`, on up to `threads` threads when there are several: waits that
/// would otherwise come one after another.
fn at_most<T: Send>(n: usize, threads: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    if n <= 1 || threads <= 1 {
        return (0..n).map(f).collect();
    }
    let (f, next) = (&f, &AtomicUsize::new(0));
    let done = Mutex::new((0..n).map(|_| None).collect::<Vec<Option<T>>>());
    thread::scope(|scope| {
        for _ in 0..threads.min(n) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return;
                }
                let value = f(i);
                done.lock().unwrap_or_else(PoisonError::into_inner)[i] = Some(value);
            });
        }
    });
    done.into_inner().unwrap_or_else(PoisonError::into_inner).into_iter().map(|v| v.expect("every index ran")).collect()
}

/// The name of the local socket of the member listening on `port` in this network namespace.
fn local_name(port: u16) -> String {
    format!("shoal-data-{port}")
}

/// A shared-memory lane to the member at `addr`, if its local socket answers here and it takes
/// our `hello` within `wait`; `None` sends the stream over TCP (another host or namespace, or
/// another process that holds the name).
fn dial_local(id: &Identity, addr: &str, hello: &Message, wait: Duration) -> Option<ShmLane> {
    let port: u16 = addr.rsplit_once(':')?.1.parse().ok()?;
    let name = std::os::unix::net::SocketAddr::from_abstract_name(local_name(port)).ok()?;
    let mut s = UnixStream::connect_addr(&name).ok()?;
    // Nothing goes to a listener of another user: one that bound the name first would take the
    // hello (to replay over TCP) and the ring (to read and rewrite every chunk).
    let ours = shoal_transport::shm::effective_uid();
    match shoal_transport::shm::peer_cred(&s) {
        Ok(cred) if cred.uid == ours => {}
        Ok(cred) => {
            log::warn!(
                "{}: the local socket @{} of {addr} is held by uid {} (pid {}), not by us (uid {ours}): \
                 another user may be squatting it; dialing TCP",
                id.me,
                local_name(port),
                cred.uid,
                cred.pid
            );
            return None;
        }
        Err(e) => {
            log::warn!(
                "{}: cannot tell who holds the local socket @{} of {addr} ({e}): dialing TCP",
                id.me,
                local_name(port)
            );
            return None;
        }
    }
    let mut attempt = || -> std::io::Result<ShmLane> {
        s.set_read_timeout(Some(wait.max(Duration::from_millis(1))))?;
        write_message(&mut s, id.session, hello).map_err(std::io::Error::other)?;
        let lane = ShmLane::offer(s.try_clone()?, RING_BYTES)?;
        // The acceptor's one byte: it took the hello and mapped the ring.
        let mut ack = [0u8; 1];
        std::io::Read::read_exact(&mut s, &mut ack)?;
        Ok(lane)
    };
    match attempt() {
        Ok(lane) => Some(lane),
        Err(e) => {
            log::debug!("{}: no shared-memory lane to {addr} ({e}): dialing TCP", id.me);
            None
        }
    }
}

/// The pool `from` dialed to us for topology `epoch`, out of `arrivals` if it is complete, made
/// non-blocking for the engine (a stream that cannot be drops its pool).
fn take_complete(arrivals: &mut BTreeMap<PeerId, Pool>, from: PeerId, epoch: Epoch) -> Option<Vec<Stream>> {
    let complete = arrivals.get(&from).is_some_and(|p| p.epoch == epoch && p.streams.len() == p.size);
    let mut pool: Vec<Stream> = complete.then(|| arrivals.remove(&from)).flatten()?.streams.into_values().collect();
    match pool.iter_mut().try_for_each(Stream::set_nonblocking) {
        Ok(()) => Some(pool),
        Err(e) => {
            log::warn!("dropping the streams of {from}: configuring a data stream: {e}");
            None
        }
    }
}

/// Greets what `listener` accepts until `stop` (`shoal_transport::greet`): TCP dialers, or
/// (`L` = [`UnixListener`]) members on this host asking for a shared-memory lane.
fn accept_loop<L: Listening>(
    listener: L,
    tls: Option<TlsConfig>,
    identity: Arc<OnceLock<Identity>>,
    arrivals: Arc<Arrivals>,
    stop: Arc<AtomicBool>,
) where
    Greeter: Greet<<L::Handshake as Handshake>::Conn>,
{
    let limits = Limits { deadline: HELLO_TIMEOUT, max_body: MAX_HELLO_BODY };
    let gate = Arc::clone(&arrivals.greeting);
    let mut greeter = Greeter { identity, arrivals };
    if let Err(e) = greet_until(&listener, &stop, tls.as_ref(), &gate, limits, &mut greeter) {
        log::error!("data listener stopped: {e}");
    }
}

/// Greets the data port's connections, all on its accept threads: a dialer's hello puts its
/// stream in a pool; a fetch is served, and a shared-memory lane mapped, on a thread of its own
/// once the first frame proved the run's data key.
struct Greeter {
    identity: Arc<OnceLock<Identity>>,
    arrivals: Arc<Arrivals>,
}

impl Greeter {
    /// Who we are, once the API thread recorded it: a peer may dial us as soon as the master
    /// issues a topology with us in it, which can be before that thread has woken up. `None`
    /// gives `greeted` back, to be offered again a moment later.
    fn take<C>(
        &self,
        greeted: Greeted<(), C>,
        take: impl FnOnce(&Identity, Greeted<(), C>) -> Result<(), String>,
    ) -> Option<Greeted<(), C>> {
        let Some(id) = self.identity.get() else { return Some(greeted) };
        let from = source(greeted.from);
        if let Err(reason) = take(id, greeted) {
            refuse(&self.arrivals, &from, &reason);
        }
        None
    }

    fn failed(&self, from: SocketAddr, error: TransportError) {
        match error {
            // A fetcher that dialed every donor at once and found its pieces taken by nearer
            // ones hangs up unheard; nothing was offered, so nothing is refused.
            TransportError::Closed => {}
            TransportError::TimedOut if self.identity.get().is_none() => {
                refuse(&self.arrivals, &source(from), "not registered yet")
            }
            e => refuse(&self.arrivals, &source(from), &e.to_string()),
        }
    }

    fn refused(&self, from: SocketAddr, full: Full) {
        let admitted = self.arrivals.refusals.lock().unwrap_or_else(PoisonError::into_inner).admit(Instant::now());
        if let Some(note) = admitted {
            log::warn!("closed a data connection from {} before its greeting: {full}{note}", source(from));
        }
    }
}

impl Greet for Greeter {
    type Token = ();

    fn opened(&mut self, _: Conn, _: SocketAddr) -> Option<()> {
        Some(())
    }

    fn greeted(&mut self, greeted: Greeted<()>) -> Option<Greeted<()>> {
        let arrivals = Arc::clone(&self.arrivals);
        self.take(greeted, |id, greeted| take_greeting(id, &arrivals, greeted))
    }

    fn failed(&mut self, from: SocketAddr, _: Option<()>, error: TransportError) {
        Greeter::failed(self, from, error);
    }

    fn refused(&mut self, from: SocketAddr, full: Full) {
        Greeter::refused(self, from, full);
    }
}

/// Members on this host: a checked hello, then their ring's descriptor, mapped on a thread of
/// its own and acknowledged with one byte.
impl Greet<UnixStream> for Greeter {
    type Token = ();

    fn opened(&mut self, _: UnixStream, _: SocketAddr) -> Option<()> {
        Some(())
    }

    fn greeted(&mut self, greeted: Greeted<(), UnixStream>) -> Option<Greeted<(), UnixStream>> {
        let arrivals = Arc::clone(&self.arrivals);
        self.take(greeted, |id, Greeted { conn, session, message, deadline, .. }| {
            let place = check_hello(id, session, message)?;
            let spawned = thread::Builder::new().name("shoal-lane-accept".into()).spawn(move || {
                if let Err(reason) = take_lane(conn, deadline).and_then(|lane| add_stream(&arrivals, place, lane)) {
                    refuse(&arrivals, "this host", &reason);
                }
            });
            spawned.map(drop).map_err(|e| format!("cannot spawn a thread to map its lane: {e}"))
        })
    }

    fn failed(&mut self, from: SocketAddr, _: Option<()>, error: TransportError) {
        Greeter::failed(self, from, error);
    }

    fn refused(&mut self, from: SocketAddr, full: Full) {
        Greeter::refused(self, from, full);
    }
}

/// Where a data connection came from, for the log: a Unix one from this host.
fn source(from: SocketAddr) -> String {
    if from.ip().is_unspecified() {
        "this host".into()
    } else {
        from.to_string()
    }
}

/// Maps the ring a member on this host sent after its hello, and says so with one byte.
fn take_lane(mut stream: UnixStream, deadline: Instant) -> Result<Stream, String> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let lane = stream
        .set_read_timeout(Some(left))
        .and_then(|()| ShmLane::accept(stream.try_clone()?))
        .and_then(|lane| std::io::Write::write_all(&mut stream, &[1]).map(|()| lane))
        .map_err(|e| format!("opening a shared-memory lane: {e}"))?;
    Ok(Stream::Shm(lane))
}

/// Counts and logs (rate-limited) a data connection refused at its greeting.
fn refuse(arrivals: &Arrivals, from: &str, reason: &str) {
    let refused = arrivals.refused.fetch_add(1, Ordering::Relaxed) + 1;
    let admitted = arrivals.refusals.lock().unwrap_or_else(PoisonError::into_inner).admit(Instant::now());
    if let Some(note) = admitted {
        log::warn!("refused data connection from {from}: {reason} ({refused} refused so far){note}");
    }
}

/// Takes a dialer's first frame: a hello puts its stream in its pool; a fetch request, checked
/// under the run's key, is served on a thread of its own (a newcomer catching up: this peer's
/// calls go on meanwhile) or kept for the sync in progress.
fn take_greeting(id: &Identity, arrivals: &Arc<Arrivals>, greeted: Greeted<()>) -> Result<(), String> {
    let Greeted { conn: stream, session, message, .. } = greeted;
    if let Message::FetchRequest { .. } = message {
        let (asker, first) = Asker::first(id.me, id.session, &id.key, session, &message).map_err(|e| e.to_string())?;
        let held = Held::take(&arrivals.fetching, MAX_FETCHES)
            .ok_or_else(|| format!("a fetch from {}: {MAX_FETCHES} fetch connections are held already", first.from))?;
        let arrivals = Arc::clone(arrivals);
        let spawned = thread::Builder::new().name("shoal-fetch-serve".into()).spawn(move || {
            let Some(fetch) = arrivals.snapshots.serve(FetchConn { stream, asker, first, held }) else { return };
            arrivals.fetches.lock().unwrap_or_else(PoisonError::into_inner).push_back(fetch);
            arrivals.changed.notify_all();
        });
        return spawned.map(drop).map_err(|e| format!("cannot spawn a thread to serve its fetch: {e}"));
    }
    let place = check_hello(id, session, message)?;
    add_stream(arrivals, place, Stream::from(stream))
}

/// The place a greeted stream takes: (dialer, topology, index, pool size, whether it carries our
/// data to the dialer).
type Place = (PeerId, Epoch, u16, u16, bool);

/// Checks a dialer's first message: a `PeerHello` to us in our session, under the run's key.
fn check_hello(id: &Identity, session: SessionId, message: Message) -> Result<Place, String> {
    let (me, our_session) = (id.me, id.session);
    let Message::PeerHello { from, to, epoch, stream: index, streams, reverse, mac } = message else {
        return Err(format!("expected PeerHello or FetchRequest, got {}", message.name()));
    };
    if session != our_session || to != me {
        return Err(format!("hello for {to} in {session:?}, we are {me} in {our_session:?}"));
    }
    if !DataKey::matches(id.key.hello(session, from, to, epoch, index, streams, reverse), &mac) {
        return Err(format!("a PeerHello posing as {from} without the run's data key"));
    }
    if streams == 0 || usize::from(streams) > crate::config::MAX_CONNECTIONS || index >= streams {
        return Err(format!("stream {index} of a pool of {streams}"));
    }
    Ok((from, epoch, index, streams, reverse))
}

/// Puts a greeted stream in its pool, and says when the pool is complete.
fn add_stream(
    arrivals: &Arrivals,
    (from, epoch, index, streams, reverse): Place,
    stream: Stream,
) -> Result<(), String> {
    let pools = if reverse { &arrivals.reverse } else { &arrivals.streams };
    let mut all = pools.lock().unwrap_or_else(PoisonError::into_inner);
    let fresh = || Pool { epoch, size: streams.into(), streams: BTreeMap::new() };
    let pool = all.entry(from).or_insert_with(fresh);
    if epoch < pool.epoch {
        return Err(format!("{from} greeted for topology {} after topology {}", epoch.0, pool.epoch.0));
    }
    if epoch > pool.epoch || pool.size != usize::from(streams) || pool.streams.contains_key(&index) {
        // The dialer started a new pool: forget the old one.
        *pool = fresh();
    }
    pool.streams.insert(index, stream);
    let complete = pool.streams.len() == pool.size;
    drop(all);
    arrivals.changed.notify_all();
    if complete {
        arrivals.arrived.wake();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: DataKey = DataKey([6; 32]);

    /// A hello from `from` to `to`, tagged under `key`.
    fn hello(key: &DataKey, session: SessionId, from: PeerId, to: PeerId) -> Message {
        let mac = key.hello(session, from, to, Epoch(1), 0, 1, false);
        Message::PeerHello { from, to, epoch: Epoch(1), stream: 0, streams: 1, reverse: false, mac }
    }

    #[test]
    fn a_pool_is_dialed_by_its_sender_unless_only_the_sender_can_be_dialed() {
        let member = |dialable, seen: [u8; 4]| Member {
            peer: PeerId(seen[3].into()),
            group: shoal_wire::GroupId(0),
            addr: "h:1".into(),
            site: None,
            dialable,
            seen: Some(seen.into()),
        };
        let public = member(true, [1, 1, 1, 1]);
        let (home, campus, campus2) =
            (member(false, [2, 2, 2, 2]), member(false, [3, 3, 3, 3]), member(false, [3, 3, 3, 4]));
        let same_nat = Member { peer: PeerId(9), ..campus.clone() };
        assert_eq!(Dialer::of(&home, &public), Dialer::Sender);
        assert_eq!(Dialer::of(&public, &home), Dialer::Receiver, "a reverse dial");
        assert_eq!(Dialer::of(&campus, &same_nat), Dialer::Sender, "one network: its own addresses");
        assert_eq!(Dialer::of(&home, &campus), Dialer::Nobody);
        assert_eq!(Dialer::of(&campus, &campus2), Dialer::Nobody, "two NATs");
        let unknown = Member { seen: None, ..home.clone() };
        assert_eq!(Dialer::of(&unknown, &Member { peer: PeerId(8), ..unknown.clone() }), Dialer::Nobody);
    }

    /// A listener without TLS on a free loopback port.
    fn plain_listener() -> Listener {
        Listener::start("127.0.0.1:0", None, crate::fetch::Snapshots::new(None, Duration::from_secs(5))).unwrap()
    }

    /// Waits up to 3 s for `listener` to have counted `n` refusals, failing with `what`.
    fn await_refused(listener: &Listener, n: u64, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(3);
        while listener.arrivals.refused.load(Ordering::Relaxed) < n {
            assert!(Instant::now() < deadline, "{what}");
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Sends `message` on a new connection to `listener`; true if the listener closed it.
    fn refused(listener: &Listener, session: SessionId, message: &Message) -> bool {
        let mut s = Conn::dial(&format!("127.0.0.1:{}", listener.port), Duration::from_secs(1), None).unwrap();
        write_message(&mut s, session, message).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        matches!(std::io::Read::read(&mut s, &mut [0u8; 1]), Ok(0))
    }

    /// A peer may dial a newcomer before the newcomer's API thread has recorded its identity
    /// (the master issues the topology right after registering it). The stream must be kept,
    /// not refused: a refused stream leaves the dialer holding a pool nobody reads, and the
    /// newcomer waiting for one that never comes.
    #[test]
    fn hello_before_identity_is_known_is_kept() {
        let listener = plain_listener();
        let addr = format!("127.0.0.1:{}", listener.port);
        let (me, session) = (PeerId(7), SessionId(42));
        let mut s = Conn::dial(&addr, Duration::from_secs(1), None).unwrap();
        write_message(&mut s, session, &hello(&KEY, session, PeerId(3), me)).unwrap();
        thread::sleep(Duration::from_millis(100));
        listener.set_identity(me, session, KEY, "");
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let arrivals = listener.arrivals.streams.lock().unwrap();
            if arrivals.get(&PeerId(3)).is_some_and(|p| p.streams.len() == 1) {
                break;
            }
            drop(arrivals);
            assert!(Instant::now() < deadline, "the early stream was refused");
            thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn hello_for_another_session_or_peer_is_refused() {
        let listener = plain_listener();
        listener.set_identity(PeerId(1), SessionId(5), KEY, "127.0.0.1:1");
        for (to, session) in [(PeerId(2), SessionId(5)), (PeerId(1), SessionId(6))] {
            assert!(refused(&listener, session, &hello(&KEY, session, PeerId(9), to)));
        }
        assert!(listener.arrivals.streams.lock().unwrap().is_empty());
    }

    /// With TLS, a dialer without a certificate of the run's CA (no TLS, or another CA's) is
    /// refused at its handshake, logged and counted, and never reaches the pools; a member's
    /// TLS stream lands.
    #[test]
    fn without_the_runs_certificate_a_data_connection_is_refused() {
        let dir = std::env::temp_dir().join(format!("shoal-links-tls-{}", std::process::id()));
        let load = |dir: &std::path::Path| {
            let made = shoal_transport::tls::make_certs(dir, &["127.0.0.1".into()]).unwrap();
            let (_, cert, key) = made.hosts[0].clone();
            TlsConfig::load(&shoal_transport::TlsFiles { cert, key, ca: made.ca }).unwrap()
        };
        let _ = std::fs::remove_dir_all(&dir);
        let (ours, theirs) = (load(&dir.join("run")), load(&dir.join("other")));
        let listener = Listener::start(
            "127.0.0.1:0",
            Some(ours.clone()),
            crate::fetch::Snapshots::new(None, Duration::from_secs(5)),
        )
        .unwrap();
        let (me, session) = (PeerId(1), SessionId(5));
        listener.set_identity(me, session, KEY, "127.0.0.1:1");
        let addr = format!("127.0.0.1:{}", listener.port);
        // The acceptor hangs up (after a TLS alert, perhaps) rather than keep the stream.
        let hung_up = |mut s: Conn| {
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            loop {
                match std::io::Read::read(&mut s, &mut [0u8; 64]) {
                    Ok(0) => return true,
                    Ok(_) => continue,
                    Err(e) => return e.kind() != std::io::ErrorKind::WouldBlock,
                }
            }
        };
        let hello = hello(&KEY, session, PeerId(2), me);
        // In plaintext, even with the run's data key.
        let mut s = Conn::dial(&addr, Duration::from_secs(2), None).unwrap();
        write_message(&mut s, session, &hello).unwrap();
        assert!(hung_up(s), "a plaintext stream was kept");
        // Another run's CA: the dialer refuses the acceptor's certificate, or its handshake ends
        // and the acceptor's refusal arrives.
        match Conn::dial(&addr, Duration::from_secs(2), Some(&theirs)) {
            Ok(mut s) => {
                let _ = write_message(&mut s, session, &hello);
                assert!(hung_up(s), "another CA's stream was kept");
            }
            Err(e) => assert!(shoal_transport::tls::is_tls_error(&e), "{e}"),
        }
        await_refused(&listener, 2, "refusals are counted");
        assert!(listener.arrivals.streams.lock().unwrap().is_empty());
        let mut s = Conn::dial(&addr, Duration::from_secs(2), Some(&ours)).unwrap();
        write_message(&mut s, session, &hello).unwrap();
        let deadline = Instant::now() + Duration::from_secs(3);
        while listener.arrivals.streams.lock().unwrap().get(&PeerId(2)).is_none() {
            assert!(Instant::now() < deadline, "the member's TLS stream did not land");
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// A fetcher dials every donor at once and hangs up on those whose pieces nearer ones took:
    /// such a connection offered nothing and is not a refusal (not logged, not counted).
    #[test]
    fn a_dialer_that_hangs_up_before_its_greeting_is_not_refused() {
        let listener = plain_listener();
        let (me, session) = (PeerId(1), SessionId(5));
        listener.set_identity(me, session, KEY, "127.0.0.1:1");
        for _ in 0..3 {
            drop(Conn::dial(&format!("127.0.0.1:{}", listener.port), Duration::from_secs(1), None).unwrap());
        }
        assert!(refused(&listener, session, &hello(&DataKey([0; 32]), session, PeerId(2), me)));
        await_refused(&listener, 1, "the forged hello is counted");
        thread::sleep(Duration::from_millis(100));
        assert_eq!(listener.arrivals.refused.load(Ordering::Relaxed), 1, "a hang-up was counted as a refusal");
    }

    /// A stranger who knows the session, every member's id and our address (a `Topology` tells
    /// all of it) but not the run's data key can neither replace a pool's stream nor fetch our
    /// shared state: each attempt is refused, logged and counted, and an honest hello still
    /// lands.
    #[test]
    fn a_forged_hello_or_fetch_without_the_data_key_is_refused_and_counted() {
        let listener = plain_listener();
        let (me, session) = (PeerId(1), SessionId(5));
        listener.set_identity(me, session, KEY, "127.0.0.1:1");
        let guessed = DataKey([0; 32]);
        assert!(refused(&listener, session, &hello(&guessed, session, PeerId(2), me)));
        let forged_fetch = Message::FetchRequest {
            from: PeerId(2),
            to: me,
            round: 1,
            index: 0,
            offset: 0,
            len: 8,
            mac: guessed.fetch(session, PeerId(2), me, 1, 0, 0, 8),
        };
        assert!(refused(&listener, session, &forged_fetch));
        assert!(listener.arrivals.streams.lock().unwrap().is_empty());
        assert!(listener.take_fetch(Duration::from_millis(50)).is_none(), "a forged fetch reached the sync");
        assert!(!refused(&listener, session, &hello(&KEY, session, PeerId(2), me)), "the honest hello");
        await_refused(&listener, 2, "refusals are counted");
        assert_eq!(listener.arrivals.streams.lock().unwrap().get(&PeerId(2)).map(|p| p.streams.len()), Some(1));
    }

    /// A member holds at most [`MAX_FETCHES`] fetch connections (each served on a thread, or
    /// waiting for the sync): one more, even from a member with the run's key, is refused,
    /// logged and counted, and one taken and done with frees its place.
    #[test]
    fn fetch_connections_held_at_once_are_capped() {
        let listener = plain_listener();
        let (me, session) = (PeerId(1), SessionId(5));
        listener.set_identity(me, session, KEY, "127.0.0.1:1");
        let fetch = |from: PeerId| Message::FetchRequest {
            from,
            to: me,
            round: 1,
            index: 0,
            offset: 0,
            len: 8,
            mac: KEY.fetch(session, from, me, 1, 0, 0, 8),
        };
        let addr = format!("127.0.0.1:{}", listener.port);
        let held: Vec<Conn> = (0..MAX_FETCHES)
            .map(|_| {
                let mut s = Conn::dial(&addr, Duration::from_secs(1), None).unwrap();
                write_message(&mut s, session, &fetch(PeerId(2))).unwrap();
                s
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        while listener.arrivals.fetching.load(Ordering::Acquire) < MAX_FETCHES {
            assert!(Instant::now() < deadline, "the fetches within the cap were not all taken");
            thread::sleep(Duration::from_millis(5));
        }
        assert!(refused(&listener, session, &fetch(PeerId(3))), "a fetch past the cap was kept");
        await_refused(&listener, 1, "the refusal is counted");
        drop(listener.take_fetch(Duration::from_millis(50)).expect("a fetch waits for the sync"));
        assert!(!refused(&listener, session, &fetch(PeerId(3))), "a fetch once one was done with");
        assert_eq!(listener.arrivals.fetching.load(Ordering::Acquire), MAX_FETCHES);
        drop(held);
    }

    /// Every request on a fetch connection is checked, not only its first (later ones were served
    /// whatever their tag, session or sender: 64 KiB never asked for were read), and a fetcher
    /// that stays silent is hung up on rather than kept while the copy is.
    #[test]
    fn every_fetch_request_on_a_connection_is_checked_and_an_idle_one_is_closed() {
        let idle = Duration::from_millis(300);
        let snapshots = crate::fetch::Snapshots::new(None, idle);
        snapshots.keep(crate::fetch::Snapshot::new(1, vec![vec![7u8; 64], vec![9u8; 64]]));
        let listener = Listener::start("127.0.0.1:0", None, snapshots).unwrap();
        let (me, session) = (PeerId(1), SessionId(5));
        listener.set_identity(me, session, KEY, "127.0.0.1:1");
        let request = |key: &DataKey, tagged: SessionId, from: PeerId, index: u32| Message::FetchRequest {
            from,
            to: me,
            round: 1,
            index,
            offset: 0,
            len: 8,
            mac: key.fetch(tagged, from, me, 1, index, 0, 8),
        };
        let dial = || {
            let s = Conn::dial(&format!("127.0.0.1:{}", listener.port), Duration::from_secs(1), None).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            s
        };
        // The answer to `m` sent in `sent`, or None if the server hung up instead.
        let ask = |s: &mut Conn, sent: SessionId, m: Message| -> Option<Vec<u8>> {
            write_message(s, sent, &m).ok()?;
            let mut answer = vec![0u8; 8];
            std::io::Read::read_exact(s, &mut answer).ok().map(|()| answer)
        };
        let honest = |index| request(&KEY, session, PeerId(2), index);
        let mut s = dial();
        assert_eq!(ask(&mut s, session, honest(0)), Some(vec![7; 8]));
        assert_eq!(ask(&mut s, session, honest(1)), Some(vec![9; 8]), "a second honest request");
        let forged = [
            (session, request(&DataKey([0; 32]), session, PeerId(2), 1)),
            (session, request(&KEY, session, PeerId(3), 1)),
            (SessionId(0), request(&KEY, SessionId(0), PeerId(2), 1)),
            (session, hello(&KEY, session, PeerId(2), me)),
        ];
        for (sent, m) in forged {
            let mut s = dial();
            assert_eq!(ask(&mut s, session, honest(0)), Some(vec![7; 8]));
            assert_eq!(ask(&mut s, sent, m.clone()), None, "served {m:?}");
        }
        let mut s = dial();
        assert_eq!(ask(&mut s, session, honest(0)), Some(vec![7; 8]));
        let started = Instant::now();
        assert_eq!(std::io::Read::read(&mut s, &mut [0u8; 1]).ok(), Some(0), "an idle fetcher is hung up on");
        assert!(started.elapsed() < idle + Duration::from_millis(700), "after {:?}", started.elapsed());
    }

    /// A data port whose greeting places are all taken leaves a pool's streams in its accept
    /// queue and takes them whole once places free: closed, they would leave the dialer a pool
    /// that breaks under its first collective (64 peers dialing 63 pools of 32 streams did).
    #[test]
    fn a_pool_dialed_while_every_greeting_place_is_taken_arrives_whole() {
        let snapshots = crate::fetch::Snapshots::new(None, Duration::from_secs(5));
        let listener = Listener::start_gated("127.0.0.1:0", None, snapshots, Gate::new(8, 8)).unwrap();
        let (me, session) = (PeerId(1), SessionId(5));
        listener.set_identity(me, session, KEY, "127.0.0.1:1");
        let addr = format!("127.0.0.1:{}", listener.port);
        let silent: Vec<_> = (0..8).map(|_| Conn::dial(&addr, Duration::from_secs(1), None).unwrap()).collect();
        let deadline = Instant::now() + Duration::from_secs(3);
        while listener.arrivals.greeting.held() < 8 {
            assert!(Instant::now() < deadline, "the silent connections were not taken");
            thread::sleep(Duration::from_millis(5));
        }
        let them = Identity { me: PeerId(2), session, key: KEY };
        let pools = [PoolTo { to: me, addr: &addr, streams: 16, reverse: false }];
        let dialed = dial_pools(&them, &pools, Epoch(1), false, None, Deadline::after(Duration::from_secs(5)), "test");
        assert!(dialed[0].as_ref().is_ok_and(|p| p.len() == 16), "the dials into the accept queue");
        thread::sleep(Duration::from_millis(200));
        assert!(listener.take_pool(PeerId(2), Epoch(1)).is_none(), "greeted past a full gate");
        drop(silent);
        let deadline = Instant::now() + Duration::from_secs(3);
        let pool = loop {
            if let Some(pool) = listener.take_pool(PeerId(2), Epoch(1)) {
                break pool;
            }
            assert!(Instant::now() < deadline, "the queued pool never arrived");
            thread::sleep(Duration::from_millis(5));
        };
        assert_eq!(pool.len(), 16);
        assert_eq!(listener.arrivals.refused.load(Ordering::Relaxed), 0, "the silent ones hung up unheard");
    }

    /// Connections that never greet hold at most their address's share of the greeting slots;
    /// past it they are closed at once, and a member from elsewhere still lands its stream.
    #[test]
    fn one_address_holding_connections_open_cannot_keep_members_out() {
        let snapshots = crate::fetch::Snapshots::new(None, Duration::from_secs(5));
        let listener = Listener::start_gated("127.0.0.1:0", None, snapshots, Gate::new(8, 4)).unwrap();
        let (me, session) = (PeerId(1), SessionId(5));
        listener.set_identity(me, session, KEY, "127.0.0.1:1");
        let from = |source: &str| {
            let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
            socket.bind(&format!("{source}:0").parse::<SocketAddr>().unwrap().into()).unwrap();
            socket.connect(&SocketAddr::from(([127, 0, 0, 1], listener.port)).into()).unwrap();
            let s = std::net::TcpStream::from(socket);
            s.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
            s
        };
        let held: Vec<_> = (0..4).map(|_| from("127.0.0.2")).collect();
        let deadline = Instant::now() + Duration::from_secs(3);
        while listener.arrivals.greeting.held() < 4 {
            assert!(Instant::now() < deadline, "the idle connections were not taken");
            thread::sleep(Duration::from_millis(5));
        }
        let mut past = from("127.0.0.2");
        assert!(matches!(std::io::Read::read(&mut past, &mut [0u8; 1]), Ok(0)), "a fifth was kept");
        assert!(!refused(&listener, session, &hello(&KEY, session, PeerId(2), me)), "the member's hello");
        assert_eq!(listener.arrivals.streams.lock().unwrap().get(&PeerId(2)).map(|p| p.streams.len()), Some(1));
        drop(held);
    }
}
