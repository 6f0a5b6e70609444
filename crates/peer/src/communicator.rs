//! The communicator: one peer's handle on a run.

use crate::config::{CommunicatorConfig, DEFAULT_CHUNK_BYTES};
use crate::control::Control;
use crate::engine::{Backup, Exec, LinkError, OpEvent, OpSpec, Pumped, RawBuf};
use crate::error::{Error, Result};
use crate::failpoint::failpoint;
use crate::fetch::Snapshots;
use crate::info::{Info, LinkInfo};
use crate::links::Listener;
use crate::plane::{AlignedBytes, CallResult, Collective, DataPlane, Extra, Owner, Placement, Posted, Request, TagUse};
use crate::stats::Stats;
use crate::Deadline;
use shoal_collective::Algorithm;
use shoal_collective::{CollectiveKind, DType, Quantization, ReduceOp};
use shoal_proto::auth::{DataKey, RunKey};
use shoal_proto::peer::{
    Action, CallError, CallId, CallKind, Established, OpId, OpProgress, PeerConfig, RingPosition, Value,
};
use shoal_transport::{Conn, Lane, PollFd, TlsConfig};
use shoal_wire::PeerReport;
use shoal_wire::{FailureKind, GroupId, OpFailure, OpHeader, PeerId, SessionId};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// How often [`Communicator::connect_until`] asks whether newcomers wait to be admitted.
const ADMISSION_POLL: Duration = Duration::from_millis(50);
/// Longest a poll on the data streams waits before the driver looks around again.
const POLL_SLICE: Duration = Duration::from_millis(50);
/// How long the progress thread, woken for work an async call started, leaves the lock to that
/// caller before it drives.
const HANDOFF_GRACE: Duration = Duration::from_micros(100);

/// One peer's membership in a run: joins through the master, is admitted by the accepted
/// peers' vote, and runs collectives with the other peers of its group.
///
/// Every method takes `&self` and is safe to call from several threads. Collectives run several
/// at once; other calls wait for those called before them. Every blocking call ends within its
/// bound.
pub struct Communicator {
    pub(crate) config: CommunicatorConfig,
    connected: Mutex<Option<Arc<Connected>>>,
    /// The data plane: whoever holds it drives every collective in flight.
    pub(crate) data: Arc<Mutex<DataPlane>>,
    /// Drives the state machine and the engine, for whichever thread holds the data plane.
    driver: Arc<Driver>,
    /// What the last `optimize_topology` measured.
    pub(crate) measured: Mutex<Option<crate::info::Measurements>>,
    /// The counters, shared with the data plane and the timer thread.
    stats: Arc<Stats>,
    /// TLS for every connection, loaded from `config.tls`.
    tls: Option<TlsConfig>,
}

/// What [`Communicator::connect_catching_up`] runs once registered, before admission; false
/// ends the connect (the catch-up failed).
pub(crate) type CatchUp<'a> = dyn FnMut(&Control, &Listener, PeerId, SessionId, &DataKey, Deadline) -> bool + 'a;

pub(crate) struct Connected {
    pub control: Arc<Control>,
    pub listener: Listener,
    pub me: PeerId,
    pub session: SessionId,
    /// The run's key for data connections (`shoal_proto::auth::DataKey`).
    pub data_key: DataKey,
}

impl Communicator {
    /// A communicator that will join the run at `config.master_addr`. Touches no network; reads
    /// the TLS files if `config.tls` names them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if a setting is out of range or a TLS file unusable.
    pub fn new(config: CommunicatorConfig) -> Result<Self> {
        config.validate()?;
        shoal_config::init_logging();
        let tls = config.tls.as_ref().map(TlsConfig::load).transpose().map_err(Error::InvalidArgument)?;
        let stats = Arc::new(Stats::default());
        Ok(Communicator {
            connected: Mutex::new(None),
            data: Arc::new(Mutex::new(DataPlane { stats: Arc::clone(&stats), ..DataPlane::default() })),
            stats,
            driver: Arc::new(Driver { config: config.clone(), progress: Progress::default() }),
            measured: Mutex::new(None),
            config,
            tls,
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
        self.connect_with(timeout, min_world_size, None)
    }

    /// [`Communicator::connect_until`], running `catch_up` once registered, before admission.
    pub(crate) fn connect_with(
        &self,
        timeout: Option<Duration>,
        min_world_size: usize,
        catch_up: Option<&mut CatchUp<'_>>,
    ) -> Result<()> {
        let deadline = Deadline::after(timeout.unwrap_or(self.config.timeout));
        self.join(deadline, catch_up)?;
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

    fn join(&self, deadline: Deadline, mut catch_up: Option<&mut CatchUp<'_>>) -> Result<()> {
        let mut slot = self.connected.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() {
            return Err(Error::AlreadyConnected);
        }
        let snapshots = Snapshots::new(self.config.catchup_rate, self.config.heartbeat_timeout);
        let listener = Listener::start(&self.config.listen_addr, self.tls.clone(), Arc::clone(&snapshots))?;
        let addr = self.config.master_addr.clone();
        let stream =
            Conn::dial(&addr, deadline.left("connect")?, self.tls.as_ref()).map_err(|e| dial_error(&addr, e))?;
        let data_addr = self.advertised_addr(&stream, listener.port)?;
        let key = self.config.secret.as_deref().map(RunKey::from_secret);
        let peer_config = PeerConfig {
            heartbeat_timeout: self.config.heartbeat_timeout,
            key,
            max_in_flight: self.config.max_in_flight,
            reconnect: true,
        };
        let control = Control::start(&addr, stream, self.tls.clone(), peer_config, Arc::clone(&self.stats), snapshots)?;
        let group = GroupId(self.config.group);
        let bound = deadline.left("connect")?;
        let call = control.own_input(|p, now| p.connect(group, data_addr.clone(), bound, now));
        let mut data = self.lock_data();
        let mut me = None;
        let joined = self.run_call(&control, &listener, &mut data, call, "connect", |_, action| {
            let Action::Registered { me: id, session, data_key } = action else {
                unreachable!("connect moves no data")
            };
            log::info!("registered as {id} in group {} advertising {data_addr}", group.0);
            listener.set_identity(id, session, data_key.clone(), &data_addr);
            if let Some(catch_up) = catch_up.as_mut() {
                if !catch_up(&control, &listener, id, session, &data_key, deadline) {
                    // The caller returns the catch-up's own error; we leave the run.
                    return Some(Err(shoal_proto::peer::CallError::Interrupted("the catch-up failed".into())));
                }
            }
            me = Some((id, session, data_key));
            None
        });
        match (joined, me) {
            (Ok(_), Some((me, session, data_key))) => {
                *self.driver.progress.control.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(Arc::clone(&control));
                *slot = Some(Arc::new(Connected { control, listener, me, session, data_key }));
                Ok(())
            }
            (Ok(_), None) => unreachable!("a peer is accepted once registered"),
            (Err(e), _) => {
                control.close();
                Err(call_error(&control, e, "connect", bound))
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

    /// Whether [`Communicator::update_topology`] has something to apply: peers wait to be
    /// admitted, or the master re-planned the ring around a link that slowed down
    /// (`docs/topology.md`, "Drift"). A vote among the accepted peers: every one of them
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

    /// Casts the `peers_pending` vote and returns at once; [`Communicator::wait_vote`] gives its
    /// answer. The vote takes its place among this peer's calls now: it begins once the
    /// collectives started before it ended, and collectives started after it wait for it, as if
    /// `peers_pending` had been called here, so every peer that casts it at the same point of its
    /// calls gets the same answer. Meanwhile the caller computes: the round trip to the master
    /// costs it nothing. Wait for every vote cast (its answer is kept until then).
    ///
    /// # Errors
    /// [`Error::NotConnected`]; the vote's own errors come from [`Communicator::wait_vote`].
    pub fn peers_pending_async(&self) -> Result<Vote> {
        let c = self.connected()?;
        let _data = self.lock_data(); // in order with the collectives this thread starts
        let call = c.control.own_input(|p, now| p.call(CallKind::PeersPending, self.config.timeout, now));
        Ok(Vote { call })
    }

    /// Waits for the answer of a vote [`Communicator::peers_pending_async`] cast, driving the
    /// collectives in flight meanwhile.
    ///
    /// # Errors
    /// As [`Communicator::peers_pending`].
    pub fn wait_vote(&self, vote: Vote) -> Result<bool> {
        let c = self.connected()?;
        let mut data = self.lock_data();
        let result = self.run_call(&c.control, &c.listener, &mut data, vote.call, "peers_pending", |_, action| {
            unreachable!("peers_pending moves no data, yet the peer asked for {action:?}")
        });
        match result.map_err(|e| call_error(&c.control, e, "peers_pending", self.config.timeout))? {
            Value::Pending(pending) => Ok(pending),
            other => unreachable!("peers_pending returned {other:?}"),
        }
    }

    /// Whether a vote [`Communicator::peers_pending_async`] cast has its answer.
    pub fn vote_done(&self, vote: &Vote) -> bool {
        self.lock_data().calls.ended.contains_key(&vote.call)
    }

    /// A call that moves no data of its own: `update_topology` or `peers_pending`.
    pub(crate) fn vote(&self, kind: CallKind, bound: Duration) -> Result<Value> {
        let c = self.connected()?;
        let operation = kind.name();
        let mut data = self.lock_data();
        let call = c.control.own_input(|p, now| p.call(kind, bound, now));
        if operation == "peers_pending" {
            failpoint("peers_pending.after_vote");
        }
        let result = self.run_call(&c.control, &c.listener, &mut data, call, operation, |_, action| {
            unreachable!("{operation} moves no data, yet the peer asked for {action:?}")
        });
        result.map_err(|e| call_error(&c.control, e, operation, bound))
    }

    /// Reduces `buf` (elements of `dtype`, as bytes) with every peer of the group, in place:
    /// on success every peer holds the same bytes. Collectives started with
    /// [`Communicator::all_reduce_async`] before it move while it runs. With `quantization`
    /// its chunks travel in that format, each encoded once by the peer that sends it first and
    /// decoded alike everywhere (that peer too), so every peer still ends bit-identical.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (nothing sent) if `buf` is not a whole number of aligned
    /// elements, or `quantization` does not apply to `dtype` and `op`; [`Error::PeerLost`] if a
    /// neighbour fails; [`Error::CollectiveMismatch`] if a peer called another collective;
    /// [`Error::Timeout`].
    pub fn all_reduce(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        tag: u64,
        algorithm: Option<Algorithm>,
        quantization: Option<Quantization>,
    ) -> Result<Info> {
        check_buffer(buf, dtype)?;
        let request = Request { kind: CollectiveKind::AllReduce, dtype, op, tag, root: 0, algorithm, quantization };
        self.collective(RawBuf::new(buf), request, Extra::None)
    }

    /// Gathers every member's `inp` into `out`, in rank order: `out` holds `world` times `inp`'s
    /// elements, and ends with member `r`'s `inp` at block `r` on every member.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`]; [`Error::Misuse`] on every member if `out` is not
    /// `world` times `inp` in the group the collective runs in (a member was lost since the
    /// call was written, say).
    pub fn all_gather(
        &self,
        out: &mut [u8],
        inp: &[u8],
        dtype: DType,
        tag: u64,
        quantization: Option<Quantization>,
    ) -> Result<Info> {
        check_buffer(out, dtype)?;
        check_buffer(inp, dtype)?;
        let extra = Extra::Gather { inp: inp.to_vec(), before: None };
        self.collective(RawBuf::new(out), gather_request(dtype, tag, quantization), extra)
    }

    /// Reduces every member's `inp` block by block and leaves block `r` in member `r`'s `out`:
    /// `inp` holds `world` times `out`'s elements; `inp` is left as it was.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`].
    pub fn reduce_scatter(
        &self,
        out: &mut [u8],
        inp: &[u8],
        dtype: DType,
        op: ReduceOp,
        tag: u64,
        quantization: Option<Quantization>,
    ) -> Result<Info> {
        check_buffer(out, dtype)?;
        check_buffer(inp, dtype)?;
        let (buf, extra) = scatter_work(out, inp);
        self.collective(buf, scatter_request(dtype, op, tag, quantization), extra)
    }

    /// Copies member `root`'s `buf` into every other member's `buf`.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`]; [`Error::Misuse`] on every member if `root` is not a
    /// rank of the group the collective runs in.
    pub fn broadcast(
        &self,
        buf: &mut [u8],
        dtype: DType,
        root: usize,
        tag: u64,
        algorithm: Option<Algorithm>,
    ) -> Result<Info> {
        check_buffer(buf, dtype)?;
        let (kind, op) = (CollectiveKind::Broadcast, ReduceOp::Sum);
        let request = Request { kind, dtype, op, tag, root, algorithm, quantization: None };
        self.collective(RawBuf::new(buf), request, Extra::None)
    }

    /// Returns once every member of the group called it (or with the error of a lost member).
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    pub fn barrier(&self, tag: u64) -> Result<Info> {
        let (buf, extra) = barrier_work();
        self.collective(buf, barrier_request(tag), extra)
    }

    /// Runs collective `request` over `buf` and waits for it.
    fn collective(&self, buf: RawBuf, request: Request, extra: Extra) -> Result<Info> {
        let c = self.connected()?;
        let mut data = self.lock_data();
        let call = self.start_collective(&c, &mut data, buf, None, request, extra)?;
        // The buffers are borrowed for this call only: they must be out of the engine when we
        // return.
        self.finish_call(&c, data, call, request.kind.name())
    }

    /// Drives collective or transfer `call` (with every other in flight) until it ended.
    pub(crate) fn finish_call(
        &self,
        c: &Connected,
        mut data: DataGuard<'_>,
        call: CallId,
        operation: &'static str,
    ) -> Result<Info> {
        self.driver.drive(&c.control, &c.listener, &mut data, Some(call), None, operation, |_, a| {
            unreachable!("{operation} asked for {a:?}")
        });
        data.calls.finished.remove(&call).expect("driven until it ended").0
    }

    /// Posts collective or transfer `call` if it may run, and leaves it to the progress thread.
    pub(crate) fn leave_running<B>(
        &self,
        c: &Arc<Connected>,
        mut data: DataGuard<'_>,
        call: CallId,
        operation: &'static str,
    ) -> Work<B> {
        self.driver.drive(&c.control, &c.listener, &mut data, None, Some(Instant::now()), operation, |_, a| {
            unreachable!("{operation} asked for {a:?}")
        });
        // Started once; letting go of the guard wakes it if the call is still in flight.
        self.progress_thread(c);
        drop(data);
        Work { call, buf: None, result: None }
    }

    /// Starts reducing `buf` like [`Communicator::all_reduce`] and returns at once: the
    /// collective moves while the caller computes, with up to `SHOAL_MAX_IN_FLIGHT` others
    /// (more wait for one of them to end), each named by its `tag` among those in flight: a tag
    /// is in flight until [`Communicator::wait`] returned for it. [`Communicator::wait`] returns
    /// what it did; [`Work::into_buffer`] the buffer, reduced or (after a failure) as it was. A
    /// work dropped without a wait keeps its tag, and its buffer, for good.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`] for a bad buffer; [`Error::Misuse`] if a collective with
    /// `tag` is in flight already.
    pub fn all_reduce_async<B>(
        &self,
        mut buf: B,
        dtype: DType,
        op: ReduceOp,
        tag: u64,
        algorithm: Option<Algorithm>,
        quantization: Option<Quantization>,
    ) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        check_buffer(buf.as_mut(), dtype)?;
        let request = Request { kind: CollectiveKind::AllReduce, dtype, op, tag, root: 0, algorithm, quantization };
        self.start_async(buf, request, |b| (RawBuf::new(b.as_mut()), Extra::None))
    }

    /// Starts [`Communicator::all_gather`] into `out` and returns at once, like
    /// [`Communicator::all_reduce_async`]; `inp` is copied before it returns.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_async`].
    pub fn all_gather_async<B>(
        &self,
        mut out: B,
        inp: &[u8],
        dtype: DType,
        tag: u64,
        quantization: Option<Quantization>,
    ) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        check_buffer(out.as_mut(), dtype)?;
        check_buffer(inp, dtype)?;
        let extra = Extra::Gather { inp: inp.to_vec(), before: None };
        self.start_async(out, gather_request(dtype, tag, quantization), |b| (RawBuf::new(b.as_mut()), extra))
    }

    /// Starts [`Communicator::reduce_scatter`] into `out` and returns at once, like
    /// [`Communicator::all_reduce_async`]; `inp` is copied before it returns.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_async`].
    pub fn reduce_scatter_async<B>(
        &self,
        mut out: B,
        inp: &[u8],
        dtype: DType,
        op: ReduceOp,
        tag: u64,
        quantization: Option<Quantization>,
    ) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        check_buffer(out.as_mut(), dtype)?;
        check_buffer(inp, dtype)?;
        let request = scatter_request(dtype, op, tag, quantization);
        self.start_async(out, request, |b| scatter_work(b.as_mut(), inp))
    }

    /// Starts [`Communicator::broadcast`] of `buf` and returns at once, like
    /// [`Communicator::all_reduce_async`].
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_async`].
    pub fn broadcast_async<B>(
        &self,
        mut buf: B,
        dtype: DType,
        root: usize,
        tag: u64,
        algorithm: Option<Algorithm>,
    ) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        check_buffer(buf.as_mut(), dtype)?;
        let (kind, op) = (CollectiveKind::Broadcast, ReduceOp::Sum);
        let request = Request { kind, dtype, op, tag, root, algorithm, quantization: None };
        self.start_async(buf, request, |b| (RawBuf::new(b.as_mut()), Extra::None))
    }

    /// Starts [`Communicator::barrier`] and returns at once.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_async`].
    pub fn barrier_async(&self, tag: u64) -> Result<Work<()>> {
        self.start_async((), barrier_request(tag), |_| barrier_work())
    }

    /// Registers collective `request` over `buf`, which the engine keeps until it ended
    /// (`lend` says which memory of it the schedule works on), posts it if it may run, and
    /// leaves it to the progress thread.
    fn start_async<B: Send + 'static>(
        &self,
        buf: B,
        request: Request,
        lend: impl FnOnce(&mut B) -> (RawBuf, Extra),
    ) -> Result<Work<B>> {
        let c = self.connected()?;
        let mut owned: Box<B> = Box::new(buf);
        let (raw, extra) = lend(&mut owned);
        let mut data = self.lock_data();
        let call = self.start_collective(&c, &mut data, raw, Some(owned), request, extra)?;
        Ok(self.leave_running(&c, data, call, request.kind.name()))
    }

    /// Waits until `work` ended, at most `timeout` (default: as long as its bound): what it did,
    /// or why it failed. Calling again returns what it did, or [`Error::Misuse`] naming the
    /// failure.
    ///
    /// # Errors
    /// Those of [`Communicator::all_reduce`]; [`Error::Timeout`] if `timeout` passed first (the
    /// collective goes on: wait again).
    pub fn wait<B: 'static>(&self, work: &mut Work<B>, timeout: Option<Duration>) -> Result<Info> {
        if work.result.is_none() {
            let c = self.connected()?;
            let until = timeout.map(|t| Instant::now() + t);
            let mut data = self.lock_data();
            self.driver.drive(&c.control, &c.listener, &mut data, Some(work.call), until, "wait", |_, a| {
                unreachable!("a collective asked for {a:?}")
            });
            let finished = data.calls.finished.remove(&work.call);
            drop(data);
            match finished {
                Some((result, buf, _)) => {
                    work.result = Some(result.as_ref().map(|i| *i).map_err(ToString::to_string));
                    work.buf = buf.map(|b| b.downcast::<B>().expect("the work's own buffer"));
                    return result;
                }
                None => {
                    let after = timeout.unwrap_or(self.config.timeout);
                    return Err(Error::Timeout { operation: "wait", after });
                }
            }
        }
        match work.result.as_ref().expect("ended") {
            Ok(info) => Ok(*info),
            Err(e) => Err(Error::Misuse(format!("this collective was waited for already, and failed: {e}"))),
        }
    }

    /// Reduces every buffer of `bufs` (each with its element type) in place, up to
    /// `max_in_flight` at a time, tagged `tag`, `tag + 1`, ... Retries after a peer loss: when it
    /// returns, every buffer was reduced exactly once in the final world, all in one topology
    /// (the inputs are copied first, so that a batch cut by a loss, or begun before the topology
    /// changed and ended after, starts over from them on every survivor alike).
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`], other than [`Error::PeerLost`], with every buffer as it
    /// was; [`Error::InvalidArgument`] if `max_in_flight` is zero.
    pub fn all_reduce_many(
        &self,
        bufs: &mut [(&mut [u8], DType)],
        op: ReduceOp,
        max_in_flight: usize,
        tag: u64,
        quantization: Option<Quantization>,
    ) -> Result<Vec<Info>> {
        if max_in_flight == 0 {
            return Err(Error::InvalidArgument("max_in_flight must be at least 1".into()));
        }
        let c = self.connected()?;
        for (buf, dtype) in bufs.iter() {
            check_buffer(buf, *dtype)?;
        }
        let originals: Vec<Vec<u8>> = bufs.iter().map(|(b, _)| b.to_vec()).collect();
        loop {
            let results = self.reduce_batch(&c, bufs, (op, quantization), max_in_flight, tag);
            let mut topologies = results.iter().filter_map(|r| r.as_ref().ok().map(|i| i.topology));
            let first = topologies.next();
            let one_world = topologies.all(|t| Some(t) == first);
            if one_world && results.iter().all(Result::is_ok) {
                return results.into_iter().collect();
            }
            // Every survivor sees the same collectives fail, or the same batch span a change of
            // topology (the first ones ran with the lost peer, the last ones without it): all
            // start over from the inputs, so that every buffer is reduced in the final world.
            for ((buf, _), original) in bufs.iter_mut().zip(&originals) {
                buf.copy_from_slice(original);
            }
            let retry = results.iter().all(|r| matches!(r, Ok(_) | Err(Error::PeerLost { .. })));
            if !retry {
                let other = results.into_iter().filter_map(Result::err).find(|e| !matches!(e, Error::PeerLost { .. }));
                return Err(other.expect("an error other than a loss"));
            }
        }
    }

    /// One pass of [`Communicator::all_reduce_many`]: every buffer's collective, each waited
    /// for (the buffers are borrowed); one that could not start ends the pass with its error.
    fn reduce_batch(
        &self,
        c: &Connected,
        bufs: &mut [(&mut [u8], DType)],
        (op, quantization): (ReduceOp, Option<Quantization>),
        max_in_flight: usize,
        tag: u64,
    ) -> Vec<Result<Info>> {
        let wait = |call: CallId| {
            let mut data = self.lock_data();
            self.driver.drive(&c.control, &c.listener, &mut data, Some(call), None, "all_reduce", |_, a| {
                unreachable!("a collective asked for {a:?}")
            });
            data.calls.finished.remove(&call).expect("driven until it ended").0
        };
        let (mut infos, mut refused) = (Vec::with_capacity(bufs.len()), None);
        let mut in_flight = std::collections::VecDeque::new();
        for (i, (buf, dtype)) in bufs.iter_mut().enumerate() {
            if in_flight.len() == max_in_flight {
                infos.push(wait(in_flight.pop_front().expect("full")));
            }
            let mut data = self.lock_data();
            let request = Request {
                kind: CollectiveKind::AllReduce,
                dtype: *dtype,
                op,
                tag: tag.wrapping_add(i as u64),
                root: 0,
                algorithm: None,
                quantization,
            };
            match self.start_collective(c, &mut data, RawBuf::new(buf), None, request, Extra::None) {
                Ok(call) => in_flight.push_back(call),
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
            // Post it now if it may run: the next wait drives it with the others.
            self.driver.drive(&c.control, &c.listener, &mut data, None, Some(Instant::now()), "all_reduce", |_, a| {
                unreachable!("all_reduce asked for {a:?}")
            });
        }
        // Every buffer must be out of the engine before we return.
        infos.extend(in_flight.into_iter().map(wait));
        infos.extend(refused.map(Err));
        infos
    }

    /// Our links in the topology in force: to every member we exchanged data with, by rank.
    pub fn links(&self) -> Vec<LinkInfo> {
        self.lock_data().links()
    }

    /// This communicator's counters since it was created: operations by kind (started,
    /// succeeded, failed, bytes, durations), failures by cause, the operations in flight, and its
    /// links in the topology in force with the rate each carried while operations ran. The master
    /// receives the same with every heartbeat, for its metrics and status page.
    pub fn stats(&self) -> PeerReport {
        self.stats.report()
    }

    /// Whether `work` ended (then [`Communicator::wait`] returns at once).
    pub fn done<B: 'static>(&self, work: &Work<B>) -> bool {
        work.result.is_some() || self.lock_data().calls.finished.contains_key(&work.call)
    }

    /// Registers collective call `request` over `buf`, owned by `owner` if the caller does not
    /// wait for it.
    fn start_collective(
        &self,
        c: &Connected,
        data: &mut DataPlane,
        buf: RawBuf,
        owner: Option<Owner>,
        mut request: Request,
        extra: Extra,
    ) -> Result<CallId> {
        let Request { kind, dtype, tag, algorithm, .. } = request;
        if let Some(a) = algorithm.filter(|a| !a.runs(kind)) {
            return Err(Error::InvalidArgument(format!("{} does not run {}", a.name(), kind.name())));
        }
        if request.codec()?.is_none() {
            // Quantizing changes nothing here (fp16 of an f16 tensor): it runs as it is.
            request.quantization = None;
        }
        if data.calls.in_use(TagUse::Collective(tag)) {
            return Err(Error::Misuse(format!(
                "{} with tag {tag} called while another collective with that tag is in flight (not waited for yet)",
                kind.name()
            )));
        }
        let bound = self.config.timeout;
        let call = c.control.own_input(|p, now| p.call(CallKind::Collective(verb(kind, tag)), bound, now));
        let count = (buf.len() / dtype.size()) as u64;
        data.stats.started(call, kind.name(), tag, buf.len() as u64);
        let record =
            Collective { buf, owner, request, extra, count, started: Instant::now(), posted: None, local: None };
        data.calls.collectives.insert(call, record);
        Ok(call)
    }

    /// Locks the data plane, asking the progress thread to let go of it first.
    pub(crate) fn lock_data(&self) -> DataGuard<'_> {
        let progress = &self.driver.progress;
        // Uncontended (no progress thread driving): no wake-up, which would cost a lone
        // collective system calls.
        let data = match self.data.try_lock() {
            Ok(data) => data,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                progress.waiters.fetch_add(1, Ordering::SeqCst);
                if let Some(control) = progress.control.lock().unwrap_or_else(PoisonError::into_inner).as_ref() {
                    control.interrupt();
                }
                let data = self.data.lock().unwrap_or_else(PoisonError::into_inner);
                progress.waiters.fetch_sub(1, Ordering::SeqCst);
                data
            }
        };
        DataGuard { data, progress }
    }

    /// The thread that drives collectives in flight while no caller waits, started once.
    fn progress_thread(&self, c: &Arc<Connected>) -> std::thread::Thread {
        self.driver
            .progress
            .thread
            .get_or_init(|| {
                let (data, driver, c) = (Arc::clone(&self.data), Arc::clone(&self.driver), Arc::clone(c));
                std::thread::Builder::new()
                    .name("shoal-progress".into())
                    .spawn(move || driver.progress_loop(&data, &c))
                    .expect("spawning the progress thread")
                    .thread()
                    .clone()
            })
            .clone()
    }

    /// Runs call `call` (a vote, a sync, connect) to its end; see [`Driver::drive`].
    pub(crate) fn run_call(
        &self,
        control: &Control,
        listener: &Listener,
        data: &mut DataPlane,
        call: CallId,
        operation: &'static str,
        own: impl FnMut(&mut DataPlane, Action) -> Option<CallResult>,
    ) -> CallResult {
        self.driver.drive(control, listener, data, Some(call), None, operation, own);
        data.calls.ended.remove(&call).expect("driven until it ended")
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
        self.driver.progress.control.lock().unwrap_or_else(PoisonError::into_inner).take();
        self.driver.progress.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.driver.progress.thread.get() {
            thread.unpark();
        }
        *self.lock_data() = DataPlane::default();
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

    fn advertised_addr(&self, master: &Conn, port: u16) -> Result<String> {
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

/// The error of a failed dial of the master at `addr`: a TLS handshake refused (a certificate of
/// another CA, or one end without TLS) is a matter of credentials, which no retry mends.
pub(crate) fn dial_error(addr: &str, e: std::io::Error) -> Error {
    if shoal_transport::tls::is_tls_error(&e) {
        return Error::Authentication { reason: crate::control::tls_refusal(&e) };
    }
    Error::MasterUnreachable { addr: addr.to_string(), reason: e.to_string() }
}

/// The error a call returns for how the state machine ended it.
pub(crate) fn call_error(control: &Control, e: CallError, operation: &'static str, bound: Duration) -> Error {
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
        CallError::Interrupted(reason) => Error::MasterInterrupted { operation, reason },
    }
}

/// Topology `position.epoch`, in force with our pools established, is the one our calls run in:
/// its engine takes the links to our ring neighbours; it links to other members when a schedule
/// first needs them.
fn take_up(data: &mut DataPlane, position: &RingPosition) {
    crate::plane::superseded(data, position.epoch.0);
    let (rank, world) = (position.rank, position.group_size());
    let me = position.ring[rank].peer;
    let mut exec = Exec::new(position.epoch, rank, world);
    if world > 1 {
        let prev = (rank + world - 1) % world;
        // Both halves come non-blocking from the listener (`links.rs`).
        // Our successor's pool, and those dialed to other members in the same round trip.
        for (peer, send) in std::mem::take(&mut data.staged.outgoing) {
            if let Some(rank) = position.ring.iter().position(|m| m.peer == peer).filter(|_| !send.is_empty()) {
                exec.add_send(rank, send);
            }
        }
        if let Some(recv) = data.staged.incoming.remove(&position.ring[prev].peer).filter(|p| !p.is_empty()) {
            exec.add_recv(prev, recv);
        }
    }
    data.exec = Some(exec);
    data.position = Some(position.clone());
    data.placement = Placement::of(position);
    data.calls.taken.clear();
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

/// What a collective's failure over the link to `them` means for the caller, and the failure
/// to report to the master.
fn link_error(e: LinkError, header: &OpHeader, me: PeerId, them: PeerId) -> (Error, OpFailure) {
    match e {
        LinkError::Lost { reason, .. } => {
            let failure = OpFailure::new(FailureKind::PeerLost, them, format!("{me} lost {them}: {reason}"));
            (Error::PeerLost { peer: them, operation: operation(header), reason }, failure)
        }
        LinkError::Mismatch { theirs, .. } => {
            // The verdict carries both calls with their peers: a participant that did not see the
            // difference itself must not read either as its own.
            let (ours, theirs) = (describe(header), format!("{them} called {}", describe(&theirs)));
            let failure = OpFailure::new(FailureKind::Mismatch, them, format!("{me} called {ours}; {theirs}"));
            (Error::CollectiveMismatch { peer: them, ours, theirs }, failure)
        }
        LinkError::Malformed { reason, .. } => {
            let failure = OpFailure::new(FailureKind::Protocol, them, format!("{them} sent {me} {reason}"));
            (Error::Protocol(format!("from {them}: {reason}")), failure)
        }
    }
}

/// The error a participant returns for a collective the master aborted.
fn op_error(f: OpFailure, header: &OpHeader) -> Error {
    match f.kind {
        FailureKind::Mismatch => Error::CollectiveMismatch { peer: f.peer, ours: describe(header), theirs: f.reason },
        FailureKind::Misuse => Error::Misuse(f.reason),
        _ => Error::PeerLost { peer: f.peer, operation: operation(header), reason: f.reason },
    }
}

/// The name of the collective `header` names.
fn operation(header: &OpHeader) -> &'static str {
    CollectiveKind::from_code(header.collective).map_or("collective", CollectiveKind::name)
}

fn op_header(id: OpId, request: &Request, algorithm: Algorithm, count: u64) -> OpHeader {
    let (quantization, block) = Quantization::to_wire(request.quantization);
    OpHeader {
        collective: request.kind.code(),
        algorithm: algorithm.code(),
        epoch: id.epoch,
        seq: id.seq.0,
        tag: request.tag,
        dtype: request.dtype.code(),
        op: request.op.code(),
        count,
        root: request.root as u32,
        quantization,
        block,
    }
}

/// Whether a collective's buffers fit a group of `world`: an all-gather's output (a
/// reduce-scatter's input) holds `world` blocks of its other buffer; a broadcast's root is a
/// member.
fn fits(record: &Collective, world: usize) -> std::result::Result<(), String> {
    let kind = record.request.kind.name();
    let (whole, block) = match &record.extra {
        Extra::Gather { inp, .. } => (record.buf.len(), inp.len()),
        Extra::Scatter { out, .. } => (record.buf.len(), out.len()),
        Extra::None if record.request.kind == CollectiveKind::Broadcast && record.request.root >= world => {
            return Err(format!("{kind} from root {} in a group of {world}", record.request.root));
        }
        Extra::None | Extra::Arrived { .. } => return Ok(()),
    };
    if whole != world * block {
        let what = if matches!(record.extra, Extra::Gather { .. }) { "output" } else { "input" };
        return Err(format!(
            "{kind}'s {what} holds {whole} bytes, not {world} blocks of {block} bytes: the group has {world} member{}",
            if world == 1 { "" } else { "s" }
        ));
    }
    Ok(())
}

/// The call a collective of `kind` with `tag` is part of, as its caller knows it.
fn verb(kind: CollectiveKind, tag: u64) -> &'static str {
    match kind {
        // The barrier that `optimize_topology` starts with.
        CollectiveKind::Barrier if tag == crate::tags::BARRIER_TAG => "optimize_topology",
        kind => kind.name(),
    }
}

fn describe(h: &OpHeader) -> String {
    let dtype = DType::from_code(h.dtype).map_or("?", DType::name);
    let op = ReduceOp::from_code(h.op).map_or("?", ReduceOp::name);
    let kind = CollectiveKind::from_code(h.collective).map_or("collective", |k| verb(k, h.tag));
    let algorithm = Algorithm::from_code(h.algorithm).map_or("?", Algorithm::name);
    let root =
        if h.collective == CollectiveKind::Broadcast.code() { format!(", root={}", h.root) } else { String::new() };
    let quantization = match shoal_collective::Format::from_code(h.quantization) {
        None => String::new(),
        Some(f) if f.is_blockwise() => format!(", quantization={}/{}", f.name(), h.block),
        Some(f) => format!(", quantization={}", f.name()),
    };
    format!(
        "{kind}(count={}, dtype={dtype}, op={op}{root}{quantization}, tag={}, algorithm={algorithm}, topology={}, \
         number={})",
        h.count, h.tag, h.epoch.0, h.seq
    )
}

/// A `peers_pending` vote cast with [`Communicator::peers_pending_async`]: wait for it with
/// [`Communicator::wait_vote`].
#[derive(Debug)]
#[must_use = "a vote's answer is kept until it is waited for"]
pub struct Vote {
    call: CallId,
}

/// A collective started with [`Communicator::all_reduce_async`]: [`Communicator::wait`] for it,
/// then [`Work::into_buffer`] gives the buffer back.
pub struct Work<B> {
    call: CallId,
    buf: Option<Box<B>>,
    /// How it ended, once waited for.
    result: Option<std::result::Result<Info, String>>,
}

impl<B> Work<B> {
    /// The buffer, once [`Communicator::wait`] returned: reduced, or as it was if the collective
    /// failed. `None` before.
    pub fn into_buffer(self) -> Option<B> {
        self.buf.map(|b| *b)
    }
}

/// What owns a buffer lent to the engine: a [`Work`]'s, until its caller takes it back.
fn gather_request(dtype: DType, tag: u64, quantization: Option<Quantization>) -> Request {
    let kind = CollectiveKind::AllGather;
    Request { kind, dtype, op: ReduceOp::Sum, tag, root: 0, algorithm: None, quantization }
}

fn scatter_request(dtype: DType, op: ReduceOp, tag: u64, quantization: Option<Quantization>) -> Request {
    Request { kind: CollectiveKind::ReduceScatter, dtype, op, tag, root: 0, algorithm: None, quantization }
}

fn barrier_request(tag: u64) -> Request {
    let kind = CollectiveKind::Barrier;
    Request { kind, dtype: DType::U8, op: ReduceOp::Sum, tag, root: 0, algorithm: None, quantization: None }
}

/// A barrier's buffer: one byte each member sends every other, which proves that it called.
fn barrier_work() -> (RawBuf, Extra) {
    let mut byte = Box::new([1u8]);
    (RawBuf::new(&mut byte[..]), Extra::Arrived { _byte: byte })
}

/// A reduce-scatter's buffers: the schedule reduces into a copy of the input, whose block goes
/// to `out` on success.
fn scatter_work(out: &mut [u8], inp: &[u8]) -> (RawBuf, Extra) {
    let mut work = AlignedBytes::copy_of(inp);
    let buf = RawBuf::new(work.as_mut());
    (buf, Extra::Scatter { out: RawBuf::new(out), _work: work })
}

/// The progress thread's state, shared with the callers.
#[derive(Default)]
pub(crate) struct Progress {
    /// Callers waiting for the data plane: the progress thread lets go of it for them.
    waiters: AtomicUsize,
    thread: OnceLock<std::thread::Thread>,
    stop: std::sync::atomic::AtomicBool,
    /// The control of the run we are in, whose waker interrupts a driver's sleep.
    control: Mutex<Option<Arc<Control>>>,
}

/// The data plane, held by a caller. Letting go of it with operations still in flight wakes the
/// progress thread, which never waits for the lock: the caller drove them while it held it.
pub(crate) struct DataGuard<'a> {
    data: std::sync::MutexGuard<'a, DataPlane>,
    progress: &'a Progress,
}

impl std::ops::Deref for DataGuard<'_> {
    type Target = DataPlane;

    fn deref(&self) -> &DataPlane {
        &self.data
    }
}

impl std::ops::DerefMut for DataGuard<'_> {
    fn deref_mut(&mut self) -> &mut DataPlane {
        &mut self.data
    }
}

impl Drop for DataGuard<'_> {
    fn drop(&mut self) {
        if let Some(thread) = self.progress.thread.get().filter(|_| self.data.calls.busy()) {
            thread.unpark();
        }
    }
}

/// Drives the state machine's actions and the engine, on whichever thread holds the data plane.
struct Driver {
    config: CommunicatorConfig,
    progress: Progress,
}

impl Driver {
    /// Carries out what the state machine asks until call `call` ended (or, without one, until
    /// no collective is in flight, or `until`, or a caller wants the data plane): opens and
    /// takes up topologies, moves every collective in flight, and hands what only this call
    /// does (fetching state) to `own`, which may end the call early with its result.
    #[allow(clippy::too_many_arguments)]
    fn drive(
        &self,
        control: &Control,
        listener: &Listener,
        data: &mut DataPlane,
        call: Option<CallId>,
        until: Option<Instant>,
        operation: &'static str,
        mut own: impl FnMut(&mut DataPlane, Action) -> Option<CallResult>,
    ) {
        let mut idle_since: Option<Instant> = None;
        loop {
            let ended = |data: &DataPlane, call: CallId| {
                data.calls.ended.contains_key(&call) || data.calls.finished.contains_key(&call)
            };
            if call.is_some_and(|call| ended(data, call)) {
                return;
            }
            let in_flight = data.exec.as_ref().is_some_and(|e| e.in_flight() > 0);
            // Nothing in the engine: sleep until the state machine has something (a verdict,
            // a topology), within `until`; a call without a bound of its own ends within the
            // state machine's.
            let action = match (in_flight, call, until) {
                (true, ..) => control.poll_action(),
                (false, Some(_), None) => Some(control.next_action()),
                (false, _, until) => {
                    let wanted = || call.is_none() && self.progress.waiters.load(Ordering::SeqCst) > 0;
                    control.wait_action(until.unwrap_or_else(Instant::now), wanted)
                }
            };
            if let Some(action) = action {
                idle_since = None;
                match action {
                    Action::Done { call: ended, result } => self.ended(control, data, ended, result),
                    Action::Establish { position, deadline } => {
                        let deadline = Deadline::until(deadline, self.config.timeout);
                        let outcome =
                            listener.establish(&mut data.staged, control, &position, &self.config, deadline, operation);
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
                    Action::RunCollective { call: c, op, position, .. } => {
                        self.post(control, listener, data, c, op, &position)
                    }
                    action => {
                        if let Some(result) = own(data, action) {
                            let call = call.expect("only a call's own driver is asked for its actions");
                            data.calls.ended.insert(call, result);
                        }
                    }
                }
                continue;
            }
            if data.exec.as_ref().is_some_and(|e| e.awaiting()) {
                self.link(listener, data);
            }
            let Some(exec) = data.exec.as_mut().filter(|e| e.in_flight() > 0) else {
                let waited_out = until.is_none_or(|u| Instant::now() >= u);
                let wanted = self.progress.waiters.load(Ordering::SeqCst) > 0;
                if (call.is_none() && (waited_out || wanted)) || (call.is_some() && until.is_some() && waited_out) {
                    return;
                }
                continue;
            };
            let moved = exec.pump() == Pumped::Progress;
            let events = exec.events();
            let transfers = exec.transfer_events();
            let news = !events.is_empty() || !transfers.is_empty();
            crate::plane::engine_ended(data, transfers);
            if !events.is_empty() {
                self.report(control, data, events);
                self.take_stopped(control, data);
            }
            if moved || news {
                idle_since = None;
                continue;
            }
            if call.is_none() && self.progress.waiters.load(Ordering::SeqCst) > 0 {
                return;
            }
            if until.is_some_and(|u| Instant::now() >= u) {
                return;
            }
            let exec = data.exec.as_mut().expect("in flight");
            // Nothing to do until the network delivers: save ahead what the collectives will
            // overwrite, so that on a real network the backups cost no time at all.
            if exec.save_ahead() {
                continue;
            }
            let now = Instant::now();
            let idle = now.duration_since(*idle_since.get_or_insert(now));
            if idle < data.placement.spin {
                if idle < data.placement.busy_spin {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
                continue;
            }
            // About to sleep. A wake-up from here on (an action, a caller that wants the data
            // plane) interrupts the poll below: what came before is seen by the checks that follow.
            control.waker.drain();
            if call.is_none() && self.progress.waiters.load(Ordering::SeqCst) > 0 {
                return;
            }
            if data.exec.as_ref().is_some_and(|e| e.awaiting()) {
                listener.arrived().drain();
                self.link(listener, data);
            }
            // Whatever stops a collective short of the master's decision (a removed member, a vote
            // it can never complete against) stops it now.
            let ids: Vec<OpId> = data.calls.collectives.values().filter_map(|c| c.posted.map(|p| p.id)).collect();
            control.own_input(|p, now| {
                for id in &ids {
                    p.handle_collective(*id, OpProgress::Stalled, now);
                }
            });
            self.take_stopped(control, data);
            if !data.calls.transfers.is_empty() {
                crate::plane::stop_stalled(&control.lock(), data, self.config.timeout);
            }
            if control.lock().has_action() || call.is_some_and(|call| ended(data, call)) {
                continue;
            }
            let Some(exec) = data.exec.as_mut().filter(|e| e.in_flight() > 0) else { continue };
            if !exec.arm() {
                continue;
            }
            let mut fds: Vec<PollFd> = Vec::new();
            for (lane, read, write) in exec.interest() {
                let mut fd = PollFd::from_raw(lane.pollable().expect("TCP and shared-memory lanes poll"));
                (fd.want_read, fd.want_write) = lane.poll_events(read, write);
                fds.push(fd);
            }
            let mut wake = PollFd::new(control.waker.fd());
            wake.want_read = true;
            fds.push(wake);
            // Waiting for a member to link to us: its pool's arrival wakes us.
            if exec.awaiting() {
                let mut arrived = PollFd::new(listener.arrived().fd());
                arrived.want_read = true;
                fds.push(arrived);
            }
            let slice = until.map_or(POLL_SLICE, |u| u.saturating_duration_since(Instant::now()).min(POLL_SLICE));
            let slice = exec.held_until().map_or(slice, |h| h.saturating_duration_since(Instant::now()).min(slice));
            if let Err(e) = shoal_transport::poll(&mut fds, slice) {
                log::warn!("poll over the data streams: {e}");
            }
        }
    }

    /// The progress thread: drives collectives in flight whenever no caller holds the data plane.
    fn progress_loop(&self, data: &Mutex<DataPlane>, c: &Connected) {
        let progress = &self.progress;
        while !progress.stop.load(Ordering::SeqCst) {
            // Never wait for the lock: a caller holding it drives, and wakes us when it lets go
            // with work left ([`DataGuard`]; else we look again 10 ms later).
            let held = match data.try_lock() {
                Ok(data) => Some(data),
                Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            };
            let idle = match held {
                Some(mut data) if progress.waiters.load(Ordering::SeqCst) == 0 => {
                    let in_flight = data.calls.busy();
                    if in_flight {
                        let until = Some(Instant::now() + POLL_SLICE);
                        self.drive(&c.control, &c.listener, &mut data, None, until, "all_reduce", |_, a| {
                            unreachable!("a collective asked for {a:?}")
                        });
                    }
                    (!in_flight).then_some(POLL_SLICE)
                }
                other => {
                    drop(other);
                    Some(Duration::from_millis(10))
                }
            };
            if let Some(idle) = idle {
                std::thread::park_timeout(idle);
                // Woken for work a call just started or left behind: that caller drove it, and
                // most often comes straight back to wait for it (or to post the next), driving it
                // itself. Taking the lock first would make it wait for us to let go.
                std::thread::sleep(HANDOFF_GRACE);
            }
        }
    }

    /// Posts collective `id` of call `call` to the engine, and links to the members it needs.
    fn post(
        &self,
        control: &Control,
        listener: &Listener,
        data: &mut DataPlane,
        call: CallId,
        id: OpId,
        position: &RingPosition,
    ) {
        let record = data.calls.collectives.get_mut(&call).expect("a collective called here");
        let (world, rank) = (position.group_size(), position.rank);
        let request = record.request;
        if data.placement.epoch != Some(position.epoch) {
            data.placement = Placement::of(position);
        }
        let hosts = &data.placement.hosts;
        let group = (world, hosts.iter().max().map_or(1, |h| h + 1));
        let codec = request.codec().expect("checked when called");
        // What travels decides: a quantized buffer is as small as its encoding.
        let wire = codec.map_or(record.buf.len(), |c| c.encoded_len(record.count as usize));
        let algorithm = self.config.algorithm_for(request.kind, request.algorithm, wire, group, position.limits);
        let header = op_header(id, &request, algorithm, record.count);
        record.posted = Some(Posted { id, header, world, rank, algorithm });
        log::trace!("{}", describe(&header));
        // Buffers shaped for another group (it changed since the call) fail on every member alike.
        if let Err(why) = fits(record, world) {
            let me = position.ring[rank].peer;
            record.local = Some(Error::Misuse(why.clone()));
            data.calls.by_seq.insert(id.seq.0, call);
            let failure = OpFailure::new(FailureKind::Misuse, me, why);
            control.own_input(|p, now| p.handle_collective(id, OpProgress::Failed(failure), now));
            return;
        }
        if let Extra::Gather { inp, before } = &mut record.extra {
            let block = rank * inp.len()..(rank + 1) * inp.len();
            *before = Some(record.buf.read(block.clone()));
            record.buf.write(block.start, inp);
        }
        let spec = OpSpec {
            header,
            kind: request.kind,
            buf: record.buf,
            dtype: request.dtype,
            op: request.op,
            algorithm,
            root: request.root,
            hosts: if algorithm == Algorithm::Hierarchical { hosts.clone() } else { Vec::new() },
            chunk_bytes: self.config.chunk_bytes.unwrap_or(DEFAULT_CHUNK_BYTES),
            codec,
            backup: spare_backup(&mut data.spare_backups, record.buf.len()),
        };
        let exec = data.exec.get_or_insert_with(|| Exec::new(id.epoch, rank, world));
        debug_assert_eq!(exec.epoch(), id.epoch, "a collective runs in the topology taken up");
        exec.post(spec);
        let awaiting = exec.awaiting();
        data.calls.by_seq.insert(id.seq.0, call);
        if awaiting {
            self.link(listener, data);
        }
        let events = data.exec.as_mut().expect("posted").events();
        self.report(control, data, events);
    }

    /// Opens our half of every link the collectives in flight need and lack, and takes the
    /// other half of each where its member opened it already. A member we cannot reach fails
    /// them, as a lost one would.
    fn link(&self, listener: &Listener, data: &mut DataPlane) {
        let (Some(exec), Some(position)) = (data.exec.as_mut(), data.position.as_ref()) else { return };
        if position.epoch != exec.epoch() {
            return;
        }
        let missing = exec.missing();
        let me = position.ring[position.rank].peer;
        // Every missing link at once: each dial waits a round trip.
        let deadline = Deadline::after(self.config.timeout);
        let open = |k: usize| listener.open(&position.ring[missing.to[k]], position.epoch, &self.config, deadline);
        for (&to, opened) in missing.to.iter().zip(crate::links::at_once(missing.to.len(), open)) {
            let member = &position.ring[to];
            match opened {
                Ok(pool) => {
                    log::info!("{me}: linked to {} (rank {to}) over {} streams", member.peer, pool.len());
                    exec.add_send(to, pool);
                }
                Err(reason) => {
                    log::warn!("{me}: cannot link to {} (rank {to}): {reason}", member.peer);
                    exec.unreachable(to, reason);
                }
            }
        }
        for from in missing.from {
            let peer = position.ring[from].peer;
            if let Some(pool) = listener.take_pool(peer, position.epoch) {
                log::info!("{me}: {peer} (rank {from}) linked to us over {} streams", pool.len());
                exec.add_recv(from, pool);
            }
        }
    }

    /// Tells the state machine what the engine did.
    fn report(&self, control: &Control, data: &mut DataPlane, events: Vec<(u64, OpEvent)>) {
        if events.is_empty() {
            return;
        }
        let me = control.lock().registered().map_or(PeerId(0), |(me, _)| me);
        let mut news = Vec::with_capacity(events.len());
        for (seq, event) in events {
            let Some(record) = data.calls.by_seq.get(&seq).and_then(|c| data.calls.collectives.get_mut(c)) else {
                continue;
            };
            let Posted { id, header, .. } = record.posted.expect("posted");
            news.push((
                id,
                match event {
                    OpEvent::DataDone => {
                        failpoint("all_reduce.before_confirm");
                        OpProgress::DataDone
                    }
                    OpEvent::Confirmed => OpProgress::Confirmed,
                    OpEvent::LapBroken(reason) => OpProgress::LapBroken(reason),
                    OpEvent::Failed(e) => {
                        // Where every collective stood: enough to tell a dead peer from a
                        // desynchronised stream.
                        log::debug!(
                            "{id} failed ({e:?}): {}",
                            data.exec.as_ref().map_or(String::new(), |x| x.describe())
                        );
                        let them = data.position.as_ref().map_or(PeerId(0), |p| p.ring[e.rank()].peer);
                        let (error, failure) = link_error(e, &header, me, them);
                        record.local = Some(error);
                        OpProgress::Failed(failure)
                    }
                },
            ));
        }
        control.own_input(|p, now| {
            for (id, progress) in news {
                p.handle_collective(id, progress, now);
            }
        });
    }

    /// Takes out of the engine the collectives the state machine stopped (a verdict, a lost
    /// member, the bound): their frames can no longer move.
    fn take_stopped(&self, control: &Control, data: &mut DataPlane) {
        let Some(exec) = data.exec.as_mut() else { return };
        let posted: Vec<(u64, OpId)> = data
            .calls
            .by_seq
            .iter()
            .filter_map(|(seq, call)| data.calls.collectives.get(call).and_then(|c| c.posted).map(|p| (*seq, p.id)))
            .collect();
        let peer = control.lock();
        let stopped: Vec<u64> = posted.into_iter().filter(|(_, id)| !peer.running(*id)).map(|(s, _)| s).collect();
        drop(peer);
        for seq in stopped {
            if let Some(taken) = exec.take(seq) {
                data.calls.taken.insert(seq, taken);
            }
        }
    }

    /// Call `call` ended with `result`.
    fn ended(&self, control: &Control, data: &mut DataPlane, call: CallId, result: CallResult) {
        let Some(record) = data.calls.collectives.remove(&call) else {
            data.calls.ended.insert(call, result);
            return;
        };
        let seq = record.posted.map(|p| p.id.seq.0);
        let taken = seq.and_then(|seq| {
            data.calls.by_seq.remove(&seq);
            data.exec.as_mut().and_then(|e| e.take(seq)).or_else(|| data.calls.taken.remove(&seq))
        });
        // Failed streams close once every collective over them has its verdict, as the old
        // ring did: the first failure reached the master before the neighbours see them close
        // (a mismatch, not the "connection closed" that follows it).
        if data.calls.by_seq.is_empty() {
            if let Some(exec) = data.exec.as_mut() {
                exec.release_if_broken();
            }
        }
        let traffic = taken.as_ref().map(|t| t.traffic).unwrap_or_default();
        let (request, operation) = (record.request, record.request.kind.name());
        let outcome = match result {
            // A group of one posts nothing: its buffers must fit it all the same.
            Ok(Value::Collective(_)) if record.posted.is_none() && fits(&record, 1).is_err() => {
                Err(Error::Misuse(fits(&record, 1).expect_err("checked")))
            }
            Ok(Value::Collective(id)) => {
                failpoint("all_reduce.after_commit");
                let rank = record.posted.map_or(0, |p| p.rank);
                match &record.extra {
                    Extra::Scatter { out, .. } => {
                        out.write(0, &record.buf.read(rank * out.len()..(rank + 1) * out.len()))
                    }
                    // Posted, the input went into place then; alone, it is all there is.
                    Extra::Gather { inp, .. } if record.posted.is_none() => record.buf.write(0, inp),
                    _ => {}
                }
                Ok(Info {
                    world_size: record.posted.map_or(1, |p| p.world),
                    tx_bytes: traffic.tx_bytes,
                    rx_bytes: traffic.rx_bytes,
                    elapsed: record.started.elapsed(),
                    topology: id.epoch.0,
                    sequence: id.seq.0,
                    // A group of one posts nothing: what it would have run.
                    algorithm: record.posted.map_or_else(
                        || self.config.algorithm_for(request.kind, request.algorithm, record.buf.len(), (1, 1), None),
                        |p| p.algorithm,
                    ),
                })
            }
            Ok(other) => unreachable!("{operation} returned {other:?}"),
            Err(e) => {
                // Every participant restores its buffer: the collective never happened.
                if let Some(t) = &taken {
                    t.restore();
                }
                if let (Extra::Gather { inp, before: Some(before) }, Some(posted)) = (&record.extra, record.posted) {
                    record.buf.write(posted.rank * inp.len(), before);
                }
                let algorithm = record.posted.map_or(Algorithm::Ring, |p| p.algorithm);
                let header = |id: OpId| op_header(id, &request, algorithm, record.count);
                let bound = self.config.timeout;
                // If the master expelled us (we were frozen, say) or is gone, that is the news,
                // not the closed stream that made us notice.
                Err(match control.check_connected() {
                    Err(gone) => gone,
                    Ok(()) => match e {
                        CallError::Aborted { op: id, failure } => op_error(failure, &header(id)),
                        // Our own error stands; where the state machine stopped the collective (a
                        // removed member, a blocking vote, the bound), the failure it reported.
                        CallError::Unconfirmed { op: id, failure } => {
                            record.local.unwrap_or_else(|| match failure.kind {
                                FailureKind::Timeout => Error::Timeout { operation, after: bound },
                                _ => op_error(failure, &header(id)),
                            })
                        }
                        e => call_error(control, e, operation, bound),
                    },
                })
            }
        };
        if let Some(t) = taken {
            data.spare_backups.push(t.into_backup());
        }
        data.record_end(call, &outcome);
        data.calls.finished.insert(call, (outcome, record.owner, TagUse::Collective(request.tag)));
    }
}

/// The spare backup that fits `len` bytes best: the smallest large enough, or else the largest.
fn spare_backup(spares: &mut Vec<Backup>, len: usize) -> Backup {
    spares.sort_by_key(Backup::capacity);
    match spares.iter().position(|b| b.capacity() >= len) {
        Some(i) => spares.remove(i),
        None => spares.pop().unwrap_or_default(),
    }
}

/// Checks that `buf` holds whole, aligned elements of `dtype`.
pub(crate) fn check_buffer(buf: &[u8], dtype: DType) -> Result<()> {
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
    Ok(())
}
