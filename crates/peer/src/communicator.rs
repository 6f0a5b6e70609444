//! The communicator: one peer's handle on a run.

use crate::config::CommunicatorConfig;
use crate::control::Control;
use crate::error::{Error, Result};
use crate::links::{DataPlane, EstablishError, Listener};
use crate::ring::{self, RingError, RingJob, Side};
use crate::Deadline;
use shoal_collective::{CollectiveKind, DType, ReduceOp};
use shoal_proto::peer::RingPosition;
use shoal_wire::{Epoch, GroupId, Member, Message, OpHeader, PeerId, SessionId};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a completed collective reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Info {
    /// Peers that took part.
    pub world_size: usize,
    /// Bytes this peer sent.
    pub tx_bytes: u64,
    /// Bytes this peer received.
    pub rx_bytes: u64,
    /// Wall time of the call.
    pub elapsed: Duration,
}

/// One peer's membership in a run: joins through the master, is admitted by the accepted
/// peers' vote, and runs collectives with the other peers of its group.
///
/// Every method takes `&self` and is safe to call from several threads; collectives and
/// topology changes are serialised internally. Every blocking call ends within its bound.
pub struct Communicator {
    config: CommunicatorConfig,
    connected: Mutex<Option<Arc<Connected>>>,
    /// The data pools. Held for the whole of a collective or a topology change.
    data: Mutex<DataPlane>,
    topology: Mutex<Option<RingPosition>>,
    seq: AtomicU64,
}

struct Connected {
    control: Arc<Control>,
    listener: Listener,
    me: PeerId,
    session: SessionId,
}

impl Communicator {
    /// A communicator that will join the run at `config.master_addr`. Does no IO.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if a setting is out of range.
    pub fn new(config: CommunicatorConfig) -> Result<Self> {
        config.validate()?;
        shoal_config::init_logging();
        Ok(Communicator {
            config,
            connected: Mutex::new(None),
            data: Mutex::new(DataPlane::default()),
            topology: Mutex::new(None),
            seq: AtomicU64::new(0),
        })
    }

    /// Registers with the master and returns once this peer is accepted: at once if it is the
    /// first peer of the run, otherwise when the accepted peers call
    /// [`Communicator::update_topology`].
    ///
    /// # Errors
    /// [`Error::MasterUnreachable`], [`Error::Timeout`] after `timeout` (default: the
    /// configured bound), [`Error::AlreadyConnected`], [`Error::Io`] if the listen address
    /// cannot be bound.
    pub fn connect(&self, timeout: Option<Duration>) -> Result<()> {
        let mut slot = self.connected.lock().expect("connect lock poisoned");
        if slot.is_some() {
            return Err(Error::AlreadyConnected);
        }
        let deadline = Deadline::after(timeout.unwrap_or(self.config.timeout));
        let listener = Listener::start(&self.config.listen_addr)?;
        let addr = self.config.master_addr.clone();
        let unreachable = |reason: String| Error::MasterUnreachable { addr: addr.clone(), reason };
        let stream = shoal_transport::connect(&addr, deadline.left("connect")?)
            .map_err(|e| unreachable(e.to_string()))?;
        let data_addr = self.advertised_addr(&stream, listener.port)?;
        let control = Control::start(&addr, stream, self.config.heartbeat_timeout)?;
        let group = GroupId(self.config.group);
        control.send(&Message::Join { group, data_addr: data_addr.clone() })?;
        let registered = control.wait_until("connect", deadline, |s| s.view.registered);
        let (me, session) = match registered {
            Ok(x) => x,
            Err(e) => {
                control.close();
                return Err(e);
            }
        };
        log::info!("registered as {me} in group {} advertising {data_addr}", group.0);
        listener.set_identity(me, session, &data_addr);
        let connected = Arc::new(Connected { control, listener, me, session });
        match self.await_topology(&connected, deadline, "connect") {
            Ok(()) => {
                *slot = Some(connected);
                Ok(())
            }
            Err(e) => {
                connected.control.close();
                Err(e)
            }
        }
    }

    /// Votes, with every other accepted peer, to admit all pending peers; returns once the new
    /// topology is in force. Must be called by every accepted peer.
    ///
    /// # Errors
    /// [`Error::NotConnected`], [`Error::MasterUnreachable`], [`Error::Timeout`].
    pub fn update_topology(&self) -> Result<()> {
        let connected = self.connected()?;
        connected.control.send(&Message::VoteUpdateTopology)?;
        self.await_topology(&connected, Deadline::after(self.config.timeout), "update_topology")
    }

    /// Whether peers wait to be admitted. A vote among the accepted peers: every one of them
    /// must call it, and all get the same answer.
    ///
    /// # Errors
    /// [`Error::NotConnected`], [`Error::MasterUnreachable`], [`Error::Timeout`].
    pub fn peers_pending(&self) -> Result<bool> {
        let connected = self.connected()?;
        connected.control.send(&Message::VotePeersPending)?;
        let deadline = Deadline::after(self.config.timeout);
        connected.control.wait_until("peers_pending", deadline, |s| s.view.pending_result.take())
    }

    /// Reduces `buf` (elements of `dtype`, as bytes) with every peer of the group, in place:
    /// on success every peer holds the same bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (nothing sent) if `buf` is not a whole number of aligned
    /// elements; [`Error::PeerLost`] if a neighbour fails; [`Error::CollectiveMismatch`] if a
    /// peer called another collective; [`Error::Timeout`].
    pub fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp, tag: u64) -> Result<Info> {
        let started = Instant::now();
        let connected = self.connected()?;
        let elem = dtype.size();
        if !buf.len().is_multiple_of(elem) {
            return Err(Error::InvalidArgument(format!(
                "buffer of {} bytes is not a whole number of {} elements",
                buf.len(),
                dtype.name()
            )));
        }
        if !(buf.as_ptr() as usize).is_multiple_of(elem) {
            return Err(Error::InvalidArgument(format!(
                "buffer is not aligned to its {elem}-byte {} elements",
                dtype.name()
            )));
        }
        let mut data = self.data.lock().expect("data lock poisoned");
        let pos = self.topology.lock().expect("topology lock poisoned").clone().ok_or(Error::NotConnected)?;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let world = pos.group_size();
        if world == 1 {
            return Ok(Info { world_size: 1, tx_bytes: 0, rx_bytes: 0, elapsed: started.elapsed() });
        }
        let header = OpHeader {
            collective: CollectiveKind::AllReduce.code(),
            epoch: pos.epoch,
            seq,
            tag,
            dtype: dtype.code(),
            op: op.code(),
            count: (buf.len() / elem) as u64,
        };
        let (next, prev) = (pos.next().peer, pos.prev().peer);
        let DataPlane { outgoing, incoming, scratch } = &mut *data;
        let (Some(send), Some(recv)) = (outgoing.get_mut(&next), incoming.get_mut(&prev)) else {
            return Err(Error::PeerLost {
                peer: next,
                operation: "all_reduce",
                reason: "no data connection: call update_topology".into(),
            });
        };
        let job = RingJob {
            dtype,
            op,
            header,
            session: connected.session,
            buf,
            world,
            rank: pos.rank,
            chunk_bytes: self.config.chunk_bytes,
            scratch,
        };
        log::trace!("all_reduce seq {seq} tag {tag}: {} {} x{}", op.name(), dtype.name(), header.count);
        let members: Vec<PeerId> = pos.ring.iter().map(|m| m.peer).collect();
        let abort = || {
            let state = connected.control.lock();
            if let Err(e) = state.check_connected() {
                return Some(e);
            }
            let gone = members.iter().find(|p| state.view.removed.contains(p))?;
            Some(Error::PeerLost {
                peer: *gone,
                operation: "all_reduce",
                reason: "the master removed it from the run".into(),
            })
        };
        match ring::run(job, send, recv, Deadline::after(self.config.timeout), &abort) {
            Ok(t) => Ok(Info { world_size: world, tx_bytes: t.tx_bytes, rx_bytes: t.rx_bytes, elapsed: started.elapsed() }),
            Err(e) => {
                // The streams may hold half a chunk: they can never be used again.
                outgoing.remove(&next);
                incoming.remove(&prev);
                // If the master expelled us (we were frozen, say) or is gone, that is the news,
                // not the closed stream that made us notice.
                connected.control.lock().check_connected()?;
                Err(match e {
                    RingError::Lost { side, reason } => Error::PeerLost {
                        peer: if side == Side::Next { next } else { prev },
                        operation: "all_reduce",
                        reason,
                    },
                    RingError::Mismatch { theirs } => Error::CollectiveMismatch {
                        peer: prev,
                        ours: describe(&header),
                        theirs: describe(&theirs),
                    },
                    RingError::Malformed(reason) => Error::Protocol(format!("from {prev}: {reason}")),
                    RingError::Timeout(e) | RingError::Aborted(e) => e,
                })
            }
        }
    }

    /// Members of the whole run, once accepted.
    pub fn world_size(&self) -> Option<usize> {
        self.position().map(|p| p.world_size)
    }

    /// Members of this peer's group, once accepted.
    pub fn group_world_size(&self) -> Option<usize> {
        self.position().map(|p| p.group_size())
    }

    /// This peer's index in its group's ring, once accepted.
    pub fn rank(&self) -> Option<usize> {
        self.position().map(|p| p.rank)
    }

    /// This peer's id, once registered.
    pub fn peer_id(&self) -> Option<PeerId> {
        self.connected.lock().expect("connect lock poisoned").as_ref().map(|c| c.me)
    }

    /// Leaves the run and closes every connection. Later calls fail with [`Error::Closed`] or
    /// [`Error::NotConnected`]; closing twice is harmless.
    pub fn close(&self) {
        if let Some(c) = self.connected.lock().expect("connect lock poisoned").take() {
            c.control.close();
        }
        *self.topology.lock().expect("topology lock poisoned") = None;
        *self.data.lock().expect("data lock poisoned") = DataPlane::default();
    }

    fn position(&self) -> Option<RingPosition> {
        self.topology.lock().expect("topology lock poisoned").clone()
    }

    fn connected(&self) -> Result<Arc<Connected>> {
        let c = self.connected.lock().expect("connect lock poisoned").clone().ok_or(Error::NotConnected)?;
        c.control.lock().check_connected()?;
        Ok(c)
    }

    /// Follows the master's topologies until one that includes us is committed: open the
    /// connections each one asks for, report ready (or who is unreachable), repeat if the
    /// master supersedes it.
    fn await_topology(&self, c: &Connected, deadline: Deadline, operation: &'static str) -> Result<()> {
        let mut data = self.data.lock().expect("data lock poisoned");
        let mut handled: Option<Epoch> = None;
        enum Step {
            Establish(Epoch, Vec<Member>),
            Done(Epoch, Vec<Member>),
        }
        loop {
            let step = c.control.wait_until(operation, deadline, |s| {
                if let Some((e, m)) = &s.view.issued {
                    if Some(*e) != handled {
                        return Some(Step::Establish(*e, m.clone()));
                    }
                }
                match &s.view.committed {
                    Some((e, m)) if Some(*e) == handled => Some(Step::Done(*e, m.clone())),
                    _ => None,
                }
            })?;
            match step {
                Step::Establish(epoch, members) => {
                    let pos = c.control.lock().view.position(epoch, &members);
                    match c.listener.establish(&mut data, &c.control, &pos, &self.config, deadline, operation) {
                        Ok(()) => c.control.send(&Message::TopologyReady { epoch })?,
                        Err(EstablishError::Unreachable(peer, reason)) => {
                            log::warn!("{}: cannot reach {peer}: {reason}", c.me);
                            c.control.send(&Message::PeerUnreachable { epoch, peer })?;
                        }
                        Err(EstablishError::Superseded) => {}
                        Err(EstablishError::Fatal(e)) => return Err(e),
                    }
                    handled = Some(epoch);
                }
                Step::Done(epoch, members) => {
                    let pos = c.control.lock().view.position(epoch, &members);
                    for s in data.outgoing.values().chain(data.incoming.values()).flatten() {
                        set_nonblocking(s)?;
                    }
                    log::info!(
                        "{}: topology {} in force: rank {} of {} (run of {})",
                        c.me,
                        epoch.0,
                        pos.rank,
                        pos.group_size(),
                        pos.world_size
                    );
                    *self.topology.lock().expect("topology lock poisoned") = Some(pos);
                    return Ok(());
                }
            }
        }
    }

    fn advertised_addr(&self, master: &TcpStream, port: u16) -> Result<String> {
        let Some(addr) = &self.config.advertise_addr else {
            let local = master.local_addr().map_err(|source| Error::Io {
                context: "reading the local address of the master connection".into(),
                source,
            })?;
            return Ok(SocketAddr::new(local.ip(), port).to_string());
        };
        if addr.parse::<SocketAddr>().is_ok() {
            return Ok(addr.clone());
        }
        match addr.rsplit_once(':') {
            Some((host, p)) if !host.contains(':') && p.parse::<u16>().is_ok() => Ok(addr.clone()),
            _ if addr.contains(':') => Ok(format!("[{addr}]:{port}")),
            _ => Ok(format!("{addr}:{port}")),
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.close();
    }
}

fn set_nonblocking(s: &TcpStream) -> Result<()> {
    s.set_nonblocking(true).map_err(|source| Error::Io { context: "configuring a data stream".into(), source })
}

fn describe(h: &OpHeader) -> String {
    let dtype = DType::from_code(h.dtype).map_or("?", DType::name);
    let op = ReduceOp::from_code(h.op).map_or("?", ReduceOp::name);
    let kind = if h.collective == CollectiveKind::AllReduce.code() { "all_reduce" } else { "collective" };
    format!("{kind}(count={}, dtype={dtype}, op={op}, tag={}, topology={})", h.count, h.tag, h.epoch.0)
}
