//! The communicator: one peer's handle on a run.

use crate::config::CommunicatorConfig;
use crate::control::Control;
use crate::error::{Error, Result};
use crate::failpoint::failpoint;
use crate::links::{DataPlane, Listener};
use crate::ring::{self, RingError, RingJob, Side, Stop, Traffic};
use crate::Deadline;
use shoal_collective::{CollectiveKind, DType, ReduceOp};
use shoal_proto::auth::{DataKey, RunKey};
use shoal_proto::peer::{Action, CallError, CallKind, Established, OpId, OpProgress, RingPosition, Value};
use shoal_wire::{FailureKind, GroupId, OpFailure, OpHeader, PeerId, SessionId};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How often [`Communicator::connect_until`] asks whether newcomers wait to be admitted.
const ADMISSION_POLL: Duration = Duration::from_millis(50);

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
    /// The topology the collective ran in.
    pub topology: u64,
    /// The collective's number within its topology: with `topology`, it names the collective
    /// on every participant.
    pub sequence: u64,
}

/// One peer's membership in a run: joins through the master, is admitted by the accepted
/// peers' vote, and runs collectives with the other peers of its group.
///
/// Every method takes `&self` and is safe to call from several threads; collectives and
/// topology changes are serialised internally. Every blocking call ends within its bound.
pub struct Communicator {
    pub(crate) config: CommunicatorConfig,
    connected: Mutex<Option<Arc<Connected>>>,
    /// The data pools. Held for the whole of a collective, a topology change or a sync.
    pub(crate) data: Mutex<DataPlane>,
}

pub(crate) struct Connected {
    pub control: Arc<Control>,
    pub listener: Listener,
    pub me: PeerId,
    pub session: SessionId,
    /// The run's key for data connections (`shoal_proto::auth::DataKey`).
    pub data_key: DataKey,
}

impl Communicator {
    /// A communicator that will join the run at `config.master_addr`. Does no IO.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if a setting is out of range.
    pub fn new(config: CommunicatorConfig) -> Result<Self> {
        config.validate()?;
        shoal_config::init_logging();
        Ok(Communicator { config, connected: Mutex::new(None), data: Mutex::new(DataPlane::default()) })
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
        self.connect_until(timeout, 1)
    }

    /// [`Communicator::connect`], then waits until the run has at least `min_world_size`
    /// accepted peers, admitting newcomers as they register. Every accepted peer must be in this
    /// call (or in the same `peers_pending` / `update_topology` loop): admission is their vote.
    ///
    /// # Errors
    /// As [`Communicator::connect`]; [`Error::TooFewPeers`] if the bound passes first, in which
    /// case this peer leaves the run again.
    pub fn connect_until(&self, timeout: Option<Duration>, min_world_size: usize) -> Result<()> {
        let deadline = Deadline::after(timeout.unwrap_or(self.config.timeout));
        self.join(deadline)?;
        let too_few = |have| Error::TooFewPeers { have, want: min_world_size, after: deadline.bound() };
        loop {
            let have = self.world_size().unwrap_or(0);
            if have >= min_world_size {
                return Ok(());
            }
            let step = deadline.left("connect").and_then(|left| {
                if self.vote(CallKind::PeersPending, left)? == Value::Pending(true) {
                    self.vote(CallKind::UpdateTopology, deadline.left("connect")?).map(drop)
                } else {
                    std::thread::sleep(left.min(ADMISSION_POLL));
                    Ok(())
                }
            });
            match step {
                Ok(()) => {}
                Err(Error::Timeout { .. }) => {
                    self.close();
                    return Err(too_few(have));
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn join(&self, deadline: Deadline) -> Result<()> {
        let mut slot = self.connected.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() {
            return Err(Error::AlreadyConnected);
        }
        let listener = Listener::start(&self.config.listen_addr)?;
        let addr = self.config.master_addr.clone();
        let unreachable = |reason: String| Error::MasterUnreachable { addr: addr.clone(), reason };
        let stream =
            shoal_transport::connect(&addr, deadline.left("connect")?).map_err(|e| unreachable(e.to_string()))?;
        let data_addr = self.advertised_addr(&stream, listener.port)?;
        let key = self.config.secret.as_deref().map(RunKey::from_secret);
        let control = Control::start(&addr, stream, self.config.heartbeat_timeout, key)?;
        let group = GroupId(self.config.group);
        let bound = deadline.left("connect")?;
        control.own_input(|p, now| p.connect(group, data_addr.clone(), bound, now));
        let mut data = self.data.lock().unwrap_or_else(PoisonError::into_inner);
        let mut me = None;
        let joined = self.drive(&control, &listener, &mut data, "connect", |_, action| {
            let Action::Registered { me: id, session, data_key } = action else {
                unreachable!("connect moves no data")
            };
            log::info!("registered as {id} in group {} advertising {data_addr}", group.0);
            listener.set_identity(id, session, data_key.clone(), &data_addr);
            me = Some((id, session, data_key));
            None
        });
        match (joined, me) {
            (Ok(_), Some((me, session, data_key))) => {
                *slot = Some(Arc::new(Connected { control, listener, me, session, data_key }));
                Ok(())
            }
            (Ok(_), None) => unreachable!("a peer is accepted once registered"),
            (Err(e), _) => {
                control.close();
                Err(self.call_error(&control, e, "connect", bound))
            }
        }
    }

    /// Votes, with every other accepted peer, to admit all pending peers; returns once the new
    /// topology is in force. Must be called by every accepted peer.
    ///
    /// # Errors
    /// [`Error::NotConnected`], [`Error::MasterUnreachable`], [`Error::Timeout`].
    pub fn update_topology(&self) -> Result<()> {
        self.vote(CallKind::UpdateTopology, self.config.timeout).map(drop)
    }

    /// Whether peers wait to be admitted. A vote among the accepted peers: every one of them
    /// must call it, and all get the same answer.
    ///
    /// # Errors
    /// [`Error::NotConnected`], [`Error::MasterUnreachable`], [`Error::Timeout`].
    pub fn peers_pending(&self) -> Result<bool> {
        match self.vote(CallKind::PeersPending, self.config.timeout)? {
            Value::Pending(pending) => Ok(pending),
            other => unreachable!("peers_pending returned {other:?}"),
        }
    }

    /// A call that moves no data of its own: `update_topology` or `peers_pending`.
    fn vote(&self, kind: CallKind, bound: Duration) -> Result<Value> {
        let c = self.connected()?;
        let operation = kind.name();
        let mut data = self.data.lock().unwrap_or_else(PoisonError::into_inner);
        c.control.own_input(|p, now| p.call(kind, bound, now));
        if operation == "peers_pending" {
            failpoint("peers_pending.after_vote");
        }
        let result = self.drive(&c.control, &c.listener, &mut data, operation, |_, action| {
            unreachable!("{operation} moves no data, yet the peer asked for {action:?}")
        });
        result.map_err(|e| self.call_error(&c.control, e, operation, bound))
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
        let c = self.connected()?;
        let elem = dtype.size();
        if !buf.len().is_multiple_of(elem) {
            return Err(Error::InvalidArgument(format!(
                "buffer of {} bytes is not a whole number of {} elements",
                buf.len(),
                dtype.name()
            )));
        }
        // An empty buffer has no element to align (numpy gives it any address); it still runs as a
        // collective, as in torch.distributed, so every peer counts it.
        if !buf.is_empty() && !(buf.as_ptr() as usize).is_multiple_of(elem) {
            return Err(Error::InvalidArgument(format!(
                "buffer is not aligned to its {elem}-byte {} elements",
                dtype.name()
            )));
        }
        let count = (buf.len() / elem) as u64;
        let header = |id: OpId| all_reduce_header(id, tag, dtype, op, count);
        let bound = self.config.timeout;
        let mut data = self.data.lock().unwrap_or_else(PoisonError::into_inner);
        // Nothing to restore unless the ring runs.
        data.backup.reset(0);
        c.control.own_input(|p, now| p.call(CallKind::Collective, bound, now));
        // What this peer saw of the collective: the ring it ran in, what moved, whether the lap
        // came round, and its own error (which stands where no verdict comes).
        let (mut ring, mut traffic, mut confirmed, mut local) = (None, Traffic::default(), false, None);
        let control = &c.control;
        let result = self.drive(control, &c.listener, &mut data, "all_reduce", |data, action| {
            let Action::RunCollective { op: id, position, deadline } = action else {
                unreachable!("all_reduce asked for {action:?}")
            };
            let header = header(id);
            let (world, rank, next, prev) =
                (position.group_size(), position.rank, position.next().peer, position.prev().peer);
            ring = Some((world, next, prev));
            log::trace!("all_reduce {id} tag {tag}: {} {} x{count}", op.name(), dtype.name());
            let DataPlane { outgoing, incoming, scratch, backup } = data;
            // Asked only before the data plane sleeps: then a removed member or a blocking vote
            // stops the collective, not while its bytes still flow.
            let running = || {
                control.own_input(|p, now| {
                    p.handle_collective(id, OpProgress::Stalled, now);
                    p.running(id)
                })
            };
            let deadline = Deadline::until(deadline, bound);
            let progress = match (outgoing.get_mut(&next), incoming.get_mut(&prev)) {
                (Some(send), Some(recv)) => {
                    let job = RingJob {
                        dtype,
                        op,
                        header,
                        session: c.session,
                        buf: &mut *buf,
                        world,
                        rank,
                        chunk_bytes: self.config.chunk_bytes,
                        scratch,
                        backup,
                    };
                    match ring::run(job, send, recv, deadline, &running, &control.waker) {
                        Ok(moved) => {
                            traffic = moved;
                            control.own_input(|p, now| p.handle_collective(id, OpProgress::DataDone, now));
                            failpoint("all_reduce.before_confirm");
                            let (send, recv) = (&mut send[0], &mut recv[0]);
                            match ring::confirm(send, recv, rank, world, id.seq.0, deadline, &running, &control.waker) {
                                Ok(()) => {
                                    confirmed = true;
                                    Some(OpProgress::Confirmed)
                                }
                                Err(Stop::Broken(reason)) => Some(OpProgress::LapBroken(reason)),
                                Err(Stop::Stopped) => None,
                            }
                        }
                        Err(RingError::Stopped) => None,
                        Err(e) => {
                            let (error, failure) = ring_error(e, &header, c.me, next, prev);
                            local = Some(error);
                            Some(OpProgress::Failed(failure))
                        }
                    }
                }
                _ => {
                    let reason = "no data connection: a collective failed before and the ring has not re-formed yet";
                    let lost = if outgoing.contains_key(&next) { prev } else { next };
                    local = Some(Error::PeerLost { peer: lost, operation: "all_reduce", reason: reason.into() });
                    Some(OpProgress::Failed(OpFailure::new(FailureKind::PeerLost, lost, format!("{}: {reason}", c.me))))
                }
            };
            if let Some(progress) = progress {
                control.own_input(|p, now| p.handle_collective(id, progress, now));
            }
            None
        });
        let DataPlane { outgoing, incoming, backup, .. } = &mut *data;
        if let Some((_, next, prev)) = ring.filter(|_| !(confirmed && result.is_ok())) {
            // The streams may hold half a chunk or half a token: they can never be used again.
            outgoing.remove(&next);
            incoming.remove(&prev);
        }
        let e = match result {
            Ok(Value::Collective(id)) => {
                if confirmed {
                    failpoint("all_reduce.after_commit");
                }
                return Ok(Info {
                    world_size: ring.map_or(1, |(world, ..)| world),
                    tx_bytes: traffic.tx_bytes,
                    rx_bytes: traffic.rx_bytes,
                    elapsed: started.elapsed(),
                    topology: id.epoch.0,
                    sequence: id.seq.0,
                });
            }
            Ok(other) => unreachable!("all_reduce returned {other:?}"),
            Err(e) => e,
        };
        // Every participant restores its buffer: the collective never happened.
        backup.restore(buf);
        // If the master expelled us (we were frozen, say) or is gone, that is the news, not the
        // closed stream that made us notice.
        control.check_connected()?;
        Err(match e {
            CallError::Aborted { op: id, failure } => op_error(failure, &header(id)),
            // Our own error stands; where the state machine stopped the collective (a removed
            // member, a blocking vote, the bound), the failure it reported.
            CallError::Unconfirmed { op: id, failure } => local.unwrap_or_else(|| match failure.kind {
                FailureKind::Timeout => Error::Timeout { operation: "all_reduce", after: bound },
                _ => op_error(failure, &header(id)),
            }),
            e => self.call_error(control, e, "all_reduce", bound),
        })
    }

    /// Carries out what the state machine asks of the call in progress until it is done: opens
    /// and takes up topologies itself, and hands what only this call does (moving a collective's
    /// data, fetching state) to `own`, which may end the call early with its result.
    pub(crate) fn drive(
        &self,
        control: &Control,
        listener: &Listener,
        data: &mut DataPlane,
        operation: &'static str,
        mut own: impl FnMut(&mut DataPlane, Action) -> Option<CallResult>,
    ) -> CallResult {
        loop {
            match control.next_action() {
                Action::Done(result) => return result,
                Action::Establish { position, deadline } => {
                    let deadline = Deadline::until(deadline, self.config.timeout);
                    let outcome = listener.establish(data, control, &position, &self.config, deadline, operation);
                    if outcome == Established::Ready {
                        failpoint(if operation == "connect" {
                            "connect.before_ready"
                        } else {
                            "update_topology.before_ready"
                        });
                    }
                    control.own_input(|p, now| p.handle_established(position.epoch, outcome, now));
                }
                Action::TakeUp(position) => take_up(data, &position),
                action => {
                    if let Some(result) = own(data, action) {
                        return result;
                    }
                }
            }
        }
    }

    /// The error a call returns for how the state machine ended it.
    pub(crate) fn call_error(
        &self,
        control: &Control,
        e: CallError,
        operation: &'static str,
        bound: Duration,
    ) -> Error {
        match e {
            CallError::Timeout => Error::Timeout { operation, after: bound },
            CallError::Misuse(reason) => Error::Misuse(reason),
            CallError::SyncFailed { retryable, reason } => Error::SyncFailed { retryable, reason },
            CallError::Gone(gone) => control.gone_error(gone),
            CallError::Busy(call) => {
                Error::Misuse(format!("{call} called while another call of this communicator is in progress"))
            }
            CallError::Aborted { op, failure } => {
                Error::Protocol(format!("{operation} ended by an abort of {op}: {}", failure.reason))
            }
            CallError::Unconfirmed { op, .. } => Error::Protocol(format!("{operation} ended by {op}")),
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
        self.connected.lock().unwrap_or_else(PoisonError::into_inner).as_ref().map(|c| c.me)
    }

    /// Leaves the run and closes every connection. Later calls fail with [`Error::Closed`] or
    /// [`Error::NotConnected`]; closing twice is harmless.
    pub fn close(&self) {
        if let Some(c) = self.connected.lock().unwrap_or_else(PoisonError::into_inner).take() {
            c.control.close();
        }
        *self.data.lock().unwrap_or_else(PoisonError::into_inner) = DataPlane::default();
    }

    pub(crate) fn position(&self) -> Option<RingPosition> {
        let c = self.connected.lock().unwrap_or_else(PoisonError::into_inner).clone()?;
        let position = c.control.lock().position();
        position
    }

    pub(crate) fn connected(&self) -> Result<Arc<Connected>> {
        let c = self.connected.lock().unwrap_or_else(PoisonError::into_inner).clone().ok_or(Error::NotConnected)?;
        c.control.check_connected()?;
        Ok(c)
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

/// How the state machine ended a call.
pub(crate) type CallResult = std::result::Result<Value, CallError>;

/// Topology `position.epoch`, in force with our pools established, is the one our calls run in:
/// its streams are driven without blocking. A stream that cannot be is dropped with its pool, and
/// the next collective fails over it and is retried in a re-formed ring.
fn take_up(data: &mut DataPlane, position: &RingPosition) {
    for pools in [&mut data.outgoing, &mut data.incoming] {
        pools.retain(|peer, pool| match pool.iter().try_for_each(|s| s.set_nonblocking(true)) {
            Ok(()) => true,
            Err(e) => {
                log::warn!("dropping the streams of {peer}: configuring a data stream: {e}");
                false
            }
        });
    }
    let me = position.ring[position.rank].peer;
    log::info!(
        "{me}: topology {} in force: rank {} of {} (run of {})",
        position.epoch.0,
        position.rank,
        position.group_size(),
        position.world_size
    );
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.close();
    }
}

/// What a failed ring run means for the caller, and the failure to report to the master.
fn ring_error(e: RingError, header: &OpHeader, me: PeerId, next: PeerId, prev: PeerId) -> (Error, OpFailure) {
    match e {
        RingError::Lost { side, reason } => {
            let peer = if side == Side::Next { next } else { prev };
            let failure = OpFailure::new(FailureKind::PeerLost, peer, format!("{me} lost {peer}: {reason}"));
            (Error::PeerLost { peer, operation: "all_reduce", reason }, failure)
        }
        RingError::Mismatch { theirs } => {
            // The verdict carries both calls with their peers: a participant that did not see the
            // difference itself (the predecessor, say) must not read either as its own.
            let (ours, theirs) = (describe(header), format!("{prev} called {}", describe(&theirs)));
            let failure = OpFailure::new(FailureKind::Mismatch, prev, format!("{me} called {ours}; {theirs}"));
            (Error::CollectiveMismatch { peer: prev, ours, theirs }, failure)
        }
        RingError::Malformed(reason) => {
            let failure = OpFailure::new(FailureKind::Protocol, prev, format!("{prev} sent {me} {reason}"));
            (Error::Protocol(format!("from {prev}: {reason}")), failure)
        }
        RingError::Timeout(e) => {
            let failure = OpFailure::new(FailureKind::Timeout, me, format!("{me}: {e}"));
            (e, failure)
        }
        RingError::Stopped => unreachable!("a stopped ring is the state machine's news, not a failure"),
    }
}

/// The error a participant returns for a collective the master aborted.
fn op_error(f: OpFailure, header: &OpHeader) -> Error {
    match f.kind {
        FailureKind::Mismatch => Error::CollectiveMismatch { peer: f.peer, ours: describe(header), theirs: f.reason },
        FailureKind::Misuse => Error::Misuse(f.reason),
        _ => Error::PeerLost { peer: f.peer, operation: "all_reduce", reason: f.reason },
    }
}

fn all_reduce_header(id: OpId, tag: u64, dtype: DType, op: ReduceOp, count: u64) -> OpHeader {
    OpHeader {
        collective: CollectiveKind::AllReduce.code(),
        epoch: id.epoch,
        seq: id.seq.0,
        tag,
        dtype: dtype.code(),
        op: op.code(),
        count,
    }
}

fn describe(h: &OpHeader) -> String {
    let dtype = DType::from_code(h.dtype).map_or("?", DType::name);
    let op = ReduceOp::from_code(h.op).map_or("?", ReduceOp::name);
    let kind = if h.collective == CollectiveKind::AllReduce.code() { "all_reduce" } else { "collective" };
    format!(
        "{kind}(count={}, dtype={dtype}, op={op}, tag={}, topology={}, number={})",
        h.count, h.tag, h.epoch.0, h.seq
    )
}
