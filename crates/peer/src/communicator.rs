//! The communicator: one peer's handle on a run.

use crate::config::CommunicatorConfig;
use crate::control::Control;
use crate::driver::{call_error, Connected, DataGuard, Driver, Progress};
use crate::error::{Error, Result, Usage};
use crate::fetch::Snapshots;
use crate::info::{Info, LinkInfo};
use crate::links::Listener;
use crate::named::verb;
use crate::plane::{CallResult, Collective, DataPlane, Extra, OpBounds, Owner, Request, Spares, TagUse};
use crate::stats::Stats;
use crate::Deadline;
use shoal_collective::Algorithm;
use shoal_collective::{CollectiveKind, DType, Quantization, ReduceOp};
use shoal_config::failpoint;
use shoal_engine::RawBuf;
use shoal_proto::auth::{DataKey, RunKey};
use shoal_proto::peer::{Action, CallId, CallKind, Cutoff, Derived, PeerConfig, RingPosition, Value};
use shoal_transport::{Conn, TlsConfig};
use shoal_wire::PeerReport;
use shoal_wire::{GroupId, PeerId, SessionId};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How often [`Communicator::connect_until`] asks whether newcomers wait to be admitted.
const ADMISSION_POLL: Duration = Duration::from_millis(50);

/// One peer's membership in a run: joins through the master, is admitted by the accepted
/// peers' vote, and runs collectives with the other peers of its group.
///
/// Every method takes `&self` and is safe to call from several threads. Collectives run several
/// at once; other calls wait for those called before them. Every blocking call ends within its
/// bound.
///
/// A communicator may also be a *derived group* ([`Communicator::split`],
/// [`Communicator::new_group`]): some members of the group it was derived from, admitted by
/// none, whose collectives and transfers run over that group's connections by their own ranks.
/// It shares everything else with the communicator it came from; the calls of the whole group
/// (admission, votes, shared-state syncs) are refused on it.
pub struct Communicator {
    pub(crate) shared: Arc<Shared>,
    /// The derived group this handle runs in; `None` for the whole group.
    pub(crate) derived: Option<Derived>,
    /// Groups derived from this one so far (at least as many as any member derived): numbers
    /// the next one's name.
    pub(crate) derivations: AtomicU64,
}

/// What a communicator and the groups derived from it share: the membership, the connections,
/// the data plane.
pub struct Shared {
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
    /// The buffers of all-gathers' and reduce-scatters' copies, shared with the data plane.
    spares: Spares,
}

/// What [`Communicator::connect_catching_up`] runs once registered, before admission; false
/// ends the connect (the catch-up failed).
pub(crate) type CatchUp<'a> = dyn FnMut(&Control, &Listener, PeerId, SessionId, &DataKey, Deadline) -> bool + 'a;

impl Communicator {
    /// A communicator that will join the run at `config.master_addr`. Touches no network; reads
    /// the TLS files if `config.tls` names them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if a setting is out of range or a TLS file unusable.
    pub fn new(config: CommunicatorConfig) -> Result<Self> {
        config.validate()?;
        shoal_config::init_logging();
        // Pools of many streams need more descriptors than a process may open by default.
        if let Err(e) = shoal_transport::raise_open_files_limit() {
            log::warn!("could not raise the limit on open files: {e}");
        }
        let tls =
            config.tls.as_ref().map(TlsConfig::load).transpose().map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let (stats, spares) = (Arc::new(Stats::default()), Spares::default());
        let data = DataPlane { stats: Arc::clone(&stats), spares: spares.clone(), ..DataPlane::default() };
        let shared = Shared {
            connected: Mutex::new(None),
            data: Arc::new(Mutex::new(data)),
            stats,
            driver: Arc::new(Driver { config: config.clone(), progress: Progress::default() }),
            measured: Mutex::new(None),
            config,
            tls,
            spares,
        };
        Ok(Communicator { shared: Arc::new(shared), derived: None, derivations: AtomicU64::new(0) })
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

    /// [`Communicator::connect`], then waits until this peer's group has at least `min_world_size`
    /// accepted members, admitting newcomers as they register. Every accepted member must be in
    /// this call (or in the same `peers_pending` / `update_topology` loop): admission is their
    /// vote. Other groups neither count nor vote.
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
        self.whole_group("connect")?;
        let deadline = Deadline::after(timeout.unwrap_or(self.config.timeout));
        self.join(deadline, catch_up)?;
        let too_few = |have| Error::TooFewPeers { have, want: min_world_size, after: deadline.bound() };
        loop {
            let have = self.group_world_size().unwrap_or(0);
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
        let catching_up = catch_up.is_some();
        let call = control.own_input(|p, now| p.connect(group, data_addr.clone(), catching_up, bound, now));
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
        self.whole_group("peers_pending")?;
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
        self.whole_group(kind.api().name())?;
        let c = self.connected()?;
        let operation = kind.api().name();
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
        self.collective(
            RawBuf::new(buf),
            all_reduce_request(dtype, op, tag, algorithm, quantization, None),
            Extra::None,
        )
    }

    /// [`Communicator::all_reduce`] that waits for no member longer than `cutoff` says: the
    /// members that have not called it `cutoff.deadline` after `cutoff.min` had are left out by
    /// agreement, and it runs among the others, whose result
    /// is over exactly them (an average divides by their number): [`Info::included`] names them.
    /// A member left out gets [`Error::Excluded`], its buffer untouched, and stays a member
    /// (`docs/protocol.md`, "Collectives with a deadline"). Every member must call it with a
    /// deadline; the first member's figures stand.
    ///
    /// # Errors
    /// [`Error::Excluded`] where this member was left out; otherwise as
    /// [`Communicator::all_reduce`] (a derived group refuses a deadline: [`Error::InvalidArgument`]).
    #[allow(clippy::too_many_arguments)] // all_reduce's, and the cutoff.
    pub fn all_reduce_with_deadline(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        tag: u64,
        algorithm: Option<Algorithm>,
        quantization: Option<Quantization>,
        cutoff: Cutoff,
    ) -> Result<Info> {
        check_buffer(buf, dtype)?;
        let request = all_reduce_request(dtype, op, tag, algorithm, quantization, Some(cutoff));
        self.collective(RawBuf::new(buf), request, Extra::None)
    }

    /// Starts [`Communicator::all_reduce_with_deadline`] and returns at once, like
    /// [`Communicator::all_reduce_async`].
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_async`].
    #[allow(clippy::too_many_arguments)] // all_reduce_async's, and the cutoff.
    pub fn all_reduce_async_with_deadline<B>(
        &self,
        mut buf: B,
        dtype: DType,
        op: ReduceOp,
        tag: u64,
        algorithm: Option<Algorithm>,
        quantization: Option<Quantization>,
        cutoff: Cutoff,
    ) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        check_buffer(buf.as_mut(), dtype)?;
        let request = all_reduce_request(dtype, op, tag, algorithm, quantization, Some(cutoff));
        self.start_async(buf, request, |b| (RawBuf::new(b.as_mut()), Extra::None))
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
        self.all_gather_as(out, inp, gather_request(dtype, tag, quantization, None))
    }

    /// [`Communicator::all_gather`] that waits for no member longer than `cutoff` says, as
    /// [`Communicator::all_reduce_with_deadline`]: the included members' blocks of `out` fill
    /// ([`Info::included`] names them), the others' stay as they were; a member left out gets
    /// [`Error::Excluded`], `out` untouched.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`] and [`Communicator::all_reduce_with_deadline`].
    pub fn all_gather_with_deadline(
        &self,
        out: &mut [u8],
        inp: &[u8],
        dtype: DType,
        tag: u64,
        quantization: Option<Quantization>,
        cutoff: Cutoff,
    ) -> Result<Info> {
        self.all_gather_as(out, inp, gather_request(dtype, tag, quantization, Some(cutoff)))
    }

    fn all_gather_as(&self, out: &mut [u8], inp: &[u8], request: Request) -> Result<Info> {
        check_buffer(out, request.dtype)?;
        check_buffer(inp, request.dtype)?;
        self.collective(RawBuf::new(out), request, gather_extra(&self.shared.spares, inp))
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
        self.reduce_scatter_as(out, inp, scatter_request(dtype, op, tag, quantization, None))
    }

    /// [`Communicator::reduce_scatter`] that waits for no member longer than `cutoff` says, as
    /// [`Communicator::all_reduce_with_deadline`]: each included member's `out` holds its block
    /// reduced over the included members' inputs alone ([`Info::included`] names them); a member
    /// left out gets [`Error::Excluded`], `out` untouched.
    ///
    /// # Errors
    /// As [`Communicator::reduce_scatter`] and [`Communicator::all_reduce_with_deadline`].
    #[allow(clippy::too_many_arguments)] // reduce_scatter's, and the cutoff.
    pub fn reduce_scatter_with_deadline(
        &self,
        out: &mut [u8],
        inp: &[u8],
        dtype: DType,
        op: ReduceOp,
        tag: u64,
        quantization: Option<Quantization>,
        cutoff: Cutoff,
    ) -> Result<Info> {
        self.reduce_scatter_as(out, inp, scatter_request(dtype, op, tag, quantization, Some(cutoff)))
    }

    fn reduce_scatter_as(&self, out: &mut [u8], inp: &[u8], request: Request) -> Result<Info> {
        check_buffer(out, request.dtype)?;
        check_buffer(inp, request.dtype)?;
        let (buf, extra) = scatter_work(&self.shared.spares, out, inp);
        self.collective(buf, request, extra)
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
        self.collective(RawBuf::new(buf), broadcast_request(dtype, root, tag, algorithm, None), Extra::None)
    }

    /// [`Communicator::broadcast`] that waits for no member but `root` longer than `cutoff`
    /// says, as [`Communicator::all_reduce_with_deadline`]: the included members
    /// ([`Info::included`], the root always among them) receive the root's `buf`; a member left
    /// out gets [`Error::Excluded`], `buf` untouched.
    ///
    /// # Errors
    /// As [`Communicator::broadcast`] and [`Communicator::all_reduce_with_deadline`].
    pub fn broadcast_with_deadline(
        &self,
        buf: &mut [u8],
        dtype: DType,
        root: usize,
        tag: u64,
        algorithm: Option<Algorithm>,
        cutoff: Cutoff,
    ) -> Result<Info> {
        check_buffer(buf, dtype)?;
        let request = broadcast_request(dtype, root, tag, algorithm, Some(cutoff));
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
        let request = all_reduce_request(dtype, op, tag, algorithm, quantization, None);
        self.start_async(buf, request, |b| (RawBuf::new(b.as_mut()), Extra::None))
    }

    /// Starts [`Communicator::all_gather`] into `out` and returns at once, like
    /// [`Communicator::all_reduce_async`]; `inp` is copied before it returns.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_async`].
    pub fn all_gather_async<B>(
        &self,
        out: B,
        inp: &[u8],
        dtype: DType,
        tag: u64,
        quantization: Option<Quantization>,
    ) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        self.all_gather_async_as(out, inp, gather_request(dtype, tag, quantization, None))
    }

    /// Starts [`Communicator::all_gather_with_deadline`] into `out` and returns at once, like
    /// [`Communicator::all_gather_async`].
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_async`].
    pub fn all_gather_async_with_deadline<B>(
        &self,
        out: B,
        inp: &[u8],
        dtype: DType,
        tag: u64,
        quantization: Option<Quantization>,
        cutoff: Cutoff,
    ) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        self.all_gather_async_as(out, inp, gather_request(dtype, tag, quantization, Some(cutoff)))
    }

    fn all_gather_async_as<B>(&self, mut out: B, inp: &[u8], request: Request) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        check_buffer(out.as_mut(), request.dtype)?;
        check_buffer(inp, request.dtype)?;
        let extra = gather_extra(&self.shared.spares, inp);
        self.start_async(out, request, |b| (RawBuf::new(b.as_mut()), extra))
    }

    /// Starts [`Communicator::reduce_scatter`] into `out` and returns at once, like
    /// [`Communicator::all_reduce_async`]; `inp` is copied before it returns.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_async`].
    pub fn reduce_scatter_async<B>(
        &self,
        out: B,
        inp: &[u8],
        dtype: DType,
        op: ReduceOp,
        tag: u64,
        quantization: Option<Quantization>,
    ) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        self.reduce_scatter_async_as(out, inp, scatter_request(dtype, op, tag, quantization, None))
    }

    /// Starts [`Communicator::reduce_scatter_with_deadline`] into `out` and returns at once,
    /// like [`Communicator::reduce_scatter_async`].
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_async`].
    #[allow(clippy::too_many_arguments)] // reduce_scatter_async's, and the cutoff.
    pub fn reduce_scatter_async_with_deadline<B>(
        &self,
        out: B,
        inp: &[u8],
        dtype: DType,
        op: ReduceOp,
        tag: u64,
        quantization: Option<Quantization>,
        cutoff: Cutoff,
    ) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        self.reduce_scatter_async_as(out, inp, scatter_request(dtype, op, tag, quantization, Some(cutoff)))
    }

    fn reduce_scatter_async_as<B>(&self, mut out: B, inp: &[u8], request: Request) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        check_buffer(out.as_mut(), request.dtype)?;
        check_buffer(inp, request.dtype)?;
        let spares = &self.shared.spares;
        self.start_async(out, request, |b| scatter_work(spares, b.as_mut(), inp))
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
        let request = broadcast_request(dtype, root, tag, algorithm, None);
        self.start_async(buf, request, |b| (RawBuf::new(b.as_mut()), Extra::None))
    }

    /// Starts [`Communicator::broadcast_with_deadline`] and returns at once, like
    /// [`Communicator::broadcast_async`].
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_async`].
    pub fn broadcast_async_with_deadline<B>(
        &self,
        mut buf: B,
        dtype: DType,
        root: usize,
        tag: u64,
        algorithm: Option<Algorithm>,
        cutoff: Cutoff,
    ) -> Result<Work<B>>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        check_buffer(buf.as_mut(), dtype)?;
        let request = broadcast_request(dtype, root, tag, algorithm, Some(cutoff));
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
            // Out of the run (kicked, the master lost), the call still holds the buffer until
            // the data plane ends it, which the loss brings about at once: drive it to its end
            // here, so that the buffer is restored when this returns, never later (a caller
            // that reuses or frees it would be written over).
            let (c, out) = match self.connected() {
                Ok(c) => (c, None),
                Err(e) => match self.connected.lock().unwrap_or_else(PoisonError::into_inner).clone() {
                    Some(c) => (c, Some(e)),
                    None => return Err(e),
                },
            };
            let until = timeout.map(|t| Instant::now() + t);
            let mut data = self.lock_data();
            self.driver.drive(&c.control, &c.listener, &mut data, Some(work.call), until, "wait", |_, a| {
                unreachable!("a collective asked for {a:?}")
            });
            let finished = data.calls.finished.remove(&work.call);
            drop(data);
            match finished {
                Some((result, buf, _)) => {
                    let result = result.map_err(|e| c.ahead_now(e));
                    work.result = Some(result.as_ref().map(Info::clone).map_err(ToString::to_string));
                    work.buf = buf.map(|b| b.downcast::<B>().expect("the work's own buffer"));
                    return result;
                }
                None => {
                    let after = timeout.unwrap_or(self.config.timeout);
                    return Err(out.unwrap_or(Error::Timeout { operation: "wait", after }));
                }
            }
        }
        match work.result.as_ref().expect("ended") {
            Ok(info) => Ok(info.clone()),
            Err(e) => Err(Usage::WaitedAgain { what: "collective", failed: e.clone() }.into()),
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
                cutoff: None,
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
        let derived = self.derived.as_ref().map_or(0, |d| d.id);
        if data.calls.in_use(TagUse(derived, tag)) {
            return Err(Usage::TagInFlight { call: kind.name(), tag }.into());
        }
        // What optimize_topology runs to measure the links varies by design: it follows nothing.
        let class = (tag < crate::PROBE_TAGS).then(|| OpBounds::class(kind, buf.len()));
        let bound = class.map_or(self.config.timeout, |class| data.bounds.bound(&self.config, class));
        let collective = match request.cutoff {
            None => CallKind::Collective(verb(kind, tag), self.derived.clone()),
            Some(_) if self.derived.is_some() => {
                return Err(Error::InvalidArgument(
                    "a deadline applies to the whole group's collectives, not a derived group's".into(),
                ))
            }
            // A broadcast never runs without its root.
            Some(cutoff) => {
                CallKind::Gathered(verb(kind, tag), cutoff, (kind == CollectiveKind::Broadcast).then_some(request.root))
            }
        };
        let call = c.control.own_input(|p, now| p.call(collective, bound, now));
        let count = (buf.len() / dtype.size()) as u64;
        data.stats.started(call, kind.name(), tag, buf.len() as u64);
        let record = Collective {
            buf,
            owner,
            request,
            derived,
            extra,
            count,
            started: Instant::now(),
            posted: None,
            included: Vec::new(),
            local: None,
            bound,
            class,
        };
        data.calls.collectives.insert(call, record);
        Ok(call)
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

    /// Accepted peers of the whole run, every group's, when this peer's group's topology was
    /// issued; once accepted.
    pub fn world_size(&self) -> Option<usize> {
        self.position().map(|p| p.world_size)
    }

    /// Members of this peer's group (of a derived group: those of its members still in the
    /// run), once accepted.
    pub fn group_world_size(&self) -> Option<usize> {
        self.position().map(|p| self.placed(&p).1)
    }

    /// This peer's index in its group's ring (in a derived group's order), once accepted.
    pub fn rank(&self) -> Option<usize> {
        self.position().map(|p| self.placed(&p).0)
    }

    /// This peer's id, once registered.
    pub fn peer_id(&self) -> Option<PeerId> {
        self.connected.lock().unwrap_or_else(PoisonError::into_inner).as_ref().map(|c| c.me)
    }

    /// Leaves the run and closes every connection. Later calls fail with [`Error::Closed`] or
    /// [`Error::NotConnected`], on this communicator and every group derived from it; closing
    /// twice is harmless. A derived group's `close` does nothing: it was admitted by none, and
    /// leaves with the communicator it came from.
    pub fn close(&self) {
        if self.derived.is_none() {
            self.leave();
        }
    }
}

impl Shared {
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

    /// Leaves the run and closes every connection ([`Communicator::close`]).
    fn leave(&self) {
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

impl std::ops::Deref for Communicator {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.shared
    }
}

impl Drop for Shared {
    /// The last handle on the run (the communicator, or a group derived from it) leaves it.
    fn drop(&mut self) {
        self.leave();
    }
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
fn all_reduce_request(
    dtype: DType,
    op: ReduceOp,
    tag: u64,
    algorithm: Option<Algorithm>,
    quantization: Option<Quantization>,
    cutoff: Option<Cutoff>,
) -> Request {
    Request { kind: CollectiveKind::AllReduce, dtype, op, tag, root: 0, algorithm, quantization, cutoff }
}

fn gather_request(dtype: DType, tag: u64, quantization: Option<Quantization>, cutoff: Option<Cutoff>) -> Request {
    let kind = CollectiveKind::AllGather;
    Request { kind, dtype, op: ReduceOp::Sum, tag, root: 0, algorithm: None, quantization, cutoff }
}

fn scatter_request(
    dtype: DType,
    op: ReduceOp,
    tag: u64,
    quantization: Option<Quantization>,
    cutoff: Option<Cutoff>,
) -> Request {
    let kind = CollectiveKind::ReduceScatter;
    Request { kind, dtype, op, tag, root: 0, algorithm: None, quantization, cutoff }
}

fn broadcast_request(
    dtype: DType,
    root: usize,
    tag: u64,
    algorithm: Option<Algorithm>,
    cutoff: Option<Cutoff>,
) -> Request {
    let (kind, op) = (CollectiveKind::Broadcast, ReduceOp::Sum);
    Request { kind, dtype, op, tag, root, algorithm, quantization: None, cutoff }
}

/// An all-gather's extra: a copy of the caller's input.
fn gather_extra(spares: &Spares, inp: &[u8]) -> Extra {
    Extra::Gather { inp: spares.copy_of(inp), before: None, narrowed: None }
}

fn barrier_request(tag: u64) -> Request {
    let kind = CollectiveKind::Barrier;
    Request {
        kind,
        dtype: DType::U8,
        op: ReduceOp::Sum,
        tag,
        root: 0,
        algorithm: None,
        quantization: None,
        cutoff: None,
    }
}

/// A barrier's buffer: one byte each member sends every other, which proves that it called.
fn barrier_work() -> (RawBuf, Extra) {
    let mut byte = Box::new([1u8]);
    (RawBuf::new(&mut byte[..]), Extra::Arrived { _byte: byte })
}

/// A reduce-scatter's buffers: the schedule reduces into a copy of the input, whose block goes
/// to `out` on success.
fn scatter_work(spares: &Spares, out: &mut [u8], inp: &[u8]) -> (RawBuf, Extra) {
    let mut work = spares.copy_of(inp);
    let buf = RawBuf::new(work.as_mut());
    (buf, Extra::Scatter { out: RawBuf::new(out), _work: work })
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
