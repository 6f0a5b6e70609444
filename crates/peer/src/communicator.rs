//! The communicator: one peer's handle on a run.

use crate::config::CommunicatorConfig;
use crate::control::Control;
use crate::error::{Error, Result};
use crate::failpoint::failpoint;
use crate::links::{DataPlane, EstablishError, Listener};
use crate::ring::{self, RingError, RingJob, Side, Stop};
use crate::Deadline;
use shoal_collective::{CollectiveKind, DType, ReduceOp};
use shoal_proto::peer::{Interrupt, LapInterrupt, RingPosition, TopologyStep, Verdict, VoteAbort};
use shoal_wire::{Epoch, FailureKind, GroupId, Member, Message, OpFailure, OpHeader, PeerId, SessionId, Vote};
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
    topology: Mutex<Option<RingPosition>>,
}

pub(crate) struct Connected {
    pub control: Arc<Control>,
    pub listener: Listener,
    pub me: PeerId,
    pub session: SessionId,
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
        let deadline = Deadline::after(timeout.unwrap_or(self.config.timeout));
        self.join(deadline)?;
        let too_few = |have| Error::TooFewPeers { have, want: min_world_size, after: deadline.bound() };
        loop {
            let have = self.world_size().unwrap_or(0);
            if have >= min_world_size {
                return Ok(());
            }
            let step = deadline.left("connect").and_then(|left| {
                if self.vote_peers_pending(deadline)? {
                    self.vote_update_topology(deadline)
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
        match self.await_topology(&connected, deadline, Await::Connect) {
            Ok(_) => {
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
        self.ended(self.vote_update_topology(Deadline::after(self.config.timeout)))
    }

    fn vote_update_topology(&self, deadline: Deadline) -> Result<()> {
        let connected = self.connected()?;
        // A vote that crossed a topology the master issued meanwhile (a member was lost) is not
        // counted: join that topology and vote again, within the call's bound.
        loop {
            self.follow_topology(&connected, deadline, "update_topology")?;
            let collectives = {
                let mut s = connected.control.lock();
                let collectives = s.view.cast_vote(Vote::UpdateTopology);
                if !s.view.vote_needed() {
                    log::debug!("{}: update_topology after a failure: the ring re-formed already", connected.me);
                    return Ok(());
                }
                collectives
            };
            connected.control.send(&Message::VoteUpdateTopology { collectives })?;
            match self.await_topology(&connected, deadline, Await::Vote)? {
                Awaited::InForce => return Ok(()),
                Awaited::VoteRefused => continue,
            }
        }
    }

    /// Whether peers wait to be admitted. A vote among the accepted peers: every one of them
    /// must call it, and all get the same answer.
    ///
    /// # Errors
    /// [`Error::NotConnected`], [`Error::MasterUnreachable`], [`Error::Timeout`].
    pub fn peers_pending(&self) -> Result<bool> {
        self.ended(self.vote_peers_pending(Deadline::after(self.config.timeout)))
    }

    fn vote_peers_pending(&self, deadline: Deadline) -> Result<bool> {
        let connected = self.connected()?;
        // A vote cast just before a topology was issued is not counted: join it, vote again.
        loop {
            self.follow_topology(&connected, deadline, "peers_pending")?;
            let collectives = connected.control.lock().view.cast_vote(Vote::PeersPending);
            connected.control.send(&Message::VotePeersPending { collectives })?;
            failpoint("peers_pending.after_vote");
            let answer = connected.control.wait_until("peers_pending", deadline, |s| {
                match s.view.pending_aborted.take() {
                    Some(VoteAbort { retry: true, .. }) => return Some(Ok(None)),
                    Some(VoteAbort { retry: false, reason }) => return Some(Err(Error::Misuse(reason))),
                    None => {}
                }
                s.view.pending_result.take().map(|pending| Ok(Some(pending)))
            })??;
            if let Some(pending) = answer {
                return Ok(pending);
            }
        }
    }

    /// Reduces `buf` (elements of `dtype`, as bytes) with every peer of the group, in place:
    /// on success every peer holds the same bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (nothing sent) if `buf` is not a whole number of aligned
    /// elements; [`Error::PeerLost`] if a neighbour fails; [`Error::CollectiveMismatch`] if a
    /// peer called another collective; [`Error::Timeout`].
    pub fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp, tag: u64) -> Result<Info> {
        self.ended(self.run_all_reduce(buf, dtype, op, tag))
    }

    fn run_all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp, tag: u64) -> Result<Info> {
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
        // An empty buffer has no element to align (numpy gives it any address); it still runs as a
        // collective, as in torch.distributed, so every peer counts it.
        if !buf.is_empty() && !(buf.as_ptr() as usize).is_multiple_of(elem) {
            return Err(Error::InvalidArgument(format!(
                "buffer is not aligned to its {elem}-byte {} elements",
                dtype.name()
            )));
        }
        let deadline = Deadline::after(self.config.timeout);
        self.follow_topology(&connected, deadline, "all_reduce")?;
        let mut data = self.data.lock().unwrap_or_else(PoisonError::into_inner);
        let pos = self.topology.lock().unwrap_or_else(PoisonError::into_inner).clone().ok_or(Error::NotConnected)?;
        let world = pos.group_size();
        let count = (buf.len() / elem) as u64;
        // Numbered within the topology: every member counts the same collectives in the same
        // order, so (epoch, seq) names this collective at the master and on every peer.
        let numbered = connected.control.lock().view.start_collective();
        let (epoch, seq) = match numbered {
            Ok(name) => name,
            Err((epoch, seq, failure)) => {
                // The others failed this call before we started it: it fails here too, untouched.
                return Err(op_error(failure, &all_reduce_header(epoch, seq, tag, dtype, op, count)));
            }
        };
        debug_assert_eq!(epoch, pos.epoch, "the view and the position agree on the topology");
        if world == 1 {
            return Ok(Info {
                world_size: 1,
                tx_bytes: 0,
                rx_bytes: 0,
                elapsed: started.elapsed(),
                topology: epoch.0,
                sequence: seq,
            });
        }
        let header = all_reduce_header(epoch, seq, tag, dtype, op, count);
        let (next, prev) = (pos.next().peer, pos.prev().peer);
        let DataPlane { outgoing, incoming, scratch, backup } = &mut *data;
        log::trace!("all_reduce seq {seq} tag {tag}: {} {} x{}", op.name(), dtype.name(), header.count);
        let members: Vec<PeerId> = pos.ring.iter().map(|m| m.peer).collect();
        let control = &connected.control;
        let abort = || {
            let state = control.lock();
            if let Err(e) = state.check_connected() {
                return Some(e);
            }
            Some(match state.view.interrupt(epoch, seq, &members)? {
                Interrupt::Aborted(f) => op_error(f, &header),
                Interrupt::Blocked(why) => Error::Misuse(why),
                Interrupt::MemberLost(peer) => Error::PeerLost {
                    peer,
                    operation: "all_reduce",
                    reason: "the master removed it from the run".into(),
                },
            })
        };
        let watch = || {
            let mut state = control.lock();
            if let Err(e) = state.check_connected() {
                return Some(Stop::Fail(e));
            }
            Some(match state.view.lap_interrupt(epoch, seq, &members)? {
                LapInterrupt::Verdict(v) => Stop::Verdict(v),
                LapInterrupt::MemberLost(peer) => Stop::Ask(format!("the master removed {peer}")),
            })
        };
        let ran = match (outgoing.get_mut(&next), incoming.get_mut(&prev)) {
            (Some(send), Some(recv)) => {
                let job = RingJob {
                    dtype,
                    op,
                    header,
                    session: connected.session,
                    buf: &mut *buf,
                    world,
                    rank: pos.rank,
                    chunk_bytes: self.config.chunk_bytes,
                    scratch,
                    backup,
                };
                ring::run(job, send, recv, deadline, &abort, &control.waker).map(|traffic| {
                    failpoint("all_reduce.before_confirm");
                    let (send, recv) = (&mut send[0], &mut recv[0]);
                    (traffic, ring::confirm(send, recv, pos.rank, world, seq, deadline, &watch, &control.waker))
                })
            }
            _ => {
                backup.reset(0);
                let reason = "no data connection: a collective failed before and the ring has not re-formed yet";
                let side = if outgoing.contains_key(&next) { Side::Prev } else { Side::Next };
                Err(RingError::Lost { side, reason: reason.into() })
            }
        };
        let error = match ran {
            Ok((traffic, confirmed)) => {
                let info = || Info {
                    world_size: world,
                    tx_bytes: traffic.tx_bytes,
                    rx_bytes: traffic.rx_bytes,
                    elapsed: started.elapsed(),
                    topology: epoch.0,
                    sequence: seq,
                };
                let stop = match confirmed {
                    Ok(()) => {
                        // Every participant holds the result: committed without the master, which
                        // hears of it only if it asks (to answer a participant that could not tell).
                        control.commit_on_our_own(epoch, seq);
                        failpoint("all_reduce.after_commit");
                        return Ok(info());
                    }
                    Err(stop) => stop,
                };
                // The lap may have stopped mid-token: these streams are done for.
                outgoing.remove(&next);
                incoming.remove(&prev);
                let verdict = match stop {
                    Stop::Verdict(v) => Ok(v),
                    Stop::Fail(e) => Err(e),
                    Stop::Ask(reason) => {
                        log::info!("{}: collective {seq} finished here, asking the master ({reason})", connected.me);
                        self.ask_verdict(&connected, epoch, seq, deadline)
                    }
                };
                match verdict {
                    Ok(Verdict::Committed) => return Ok(info()),
                    Ok(Verdict::Aborted(f)) => op_error(f, &header),
                    Err(e) => e,
                }
            }
            Err(e) => {
                let (local, failure) = ring_error(e, &header, connected.me, next, prev);
                let decided = control.lock().view.verdicts.remove(&(epoch, seq));
                match (decided, failure) {
                    (Some(Verdict::Aborted(f)), _) => op_error(f, &header),
                    // Tell the master, which aborts the collective for everyone: peers still
                    // waiting on data stop now rather than when they notice by themselves. The
                    // verdict names the first failure reported, so every participant gets the
                    // same cause (a mismatch, not the closed stream that followed it). The
                    // streams stay open until then, so no neighbour sees them close first.
                    (_, Some(failure)) => self.report_failure(&connected, &header, failure).unwrap_or(local),
                    _ => local,
                }
            }
        };
        // Every participant restores its buffer: the collective never happened.
        backup.restore(buf);
        // The streams may hold half a chunk: they can never be used again.
        outgoing.remove(&next);
        incoming.remove(&prev);
        // If the master expelled us (we were frozen, say) or is gone, that is the news, not the
        // closed stream that made us notice.
        control.lock().check_connected()?;
        Err(error)
    }

    /// Reports a collective failed here; returns the error of the master's verdict, if it comes
    /// within a heartbeat timeout.
    fn report_failure(&self, c: &Connected, header: &OpHeader, failure: OpFailure) -> Option<Error> {
        let (epoch, seq) = (header.epoch, header.seq);
        c.control.send(&Message::OpFailed { epoch, seq, failure }).ok()?;
        let grace = Deadline::after(self.config.heartbeat_timeout);
        match c.control.wait_until("all_reduce", grace, |s| s.view.verdicts.remove(&(epoch, seq))).ok()? {
            Verdict::Aborted(f) => Some(op_error(f, header)),
            Verdict::Committed => None,
        }
    }

    /// Reports that we hold the complete result of collective `seq` and waits for the master's
    /// verdict. Every participant still in the run reports within its own bound, so the verdict
    /// comes within ours and a heartbeat timeout, or the master is as good as lost.
    fn ask_verdict(&self, c: &Connected, epoch: Epoch, seq: u64, deadline: Deadline) -> Result<Verdict> {
        c.control.send(&Message::OpDone { epoch, seq, decided: false })?;
        let deadline = deadline.extended(self.config.heartbeat_timeout);
        c.control.wait_until("all_reduce", deadline, |s| s.view.verdicts.remove(&(epoch, seq)))
    }

    /// Records how a call that reached the run ended, for the retry rule
    /// ([`shoal_proto::peer::PeerView::vote_needed`]). Errors raised before anything was sent
    /// (arguments, not connected) and the loss of the master or of our place say nothing of it.
    pub(crate) fn ended<T>(&self, result: Result<T>) -> Result<T> {
        let ok = match &result {
            Ok(_) => true,
            Err(
                Error::PeerLost { .. }
                | Error::CollectiveMismatch { .. }
                | Error::Misuse(_)
                | Error::SyncFailed { .. }
                | Error::Timeout { .. },
            ) => false,
            Err(_) => return result,
        };
        if let Some(c) = &*self.connected.lock().unwrap_or_else(PoisonError::into_inner) {
            c.control.lock().view.call_ended(ok);
        }
        result
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
        *self.topology.lock().unwrap_or_else(PoisonError::into_inner) = None;
        *self.data.lock().unwrap_or_else(PoisonError::into_inner) = DataPlane::default();
    }

    pub(crate) fn position(&self) -> Option<RingPosition> {
        self.topology.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub(crate) fn connected(&self) -> Result<Arc<Connected>> {
        let c = self.connected.lock().unwrap_or_else(PoisonError::into_inner).clone().ok_or(Error::NotConnected)?;
        c.control.lock().check_connected()?;
        Ok(c)
    }

    /// Joins a topology the master issued since our last call, if any, before the call itself:
    /// after a failure the master re-forms the ring by itself, and every survivor's next call,
    /// whichever it is, opens the new connections and runs in the new topology once all are
    /// ready (`docs/protocol.md`, "Retry").
    pub(crate) fn follow_topology(&self, c: &Connected, deadline: Deadline, operation: &'static str) -> Result<()> {
        let (issued, committed) = {
            let s = c.control.lock();
            let committed = s.view.committed.clone();
            let issued = s.view.issued.as_ref().is_some_and(|(e, _)| committed.as_ref().is_none_or(|(c, _)| c < e));
            (issued, committed)
        };
        if issued {
            self.await_topology(c, deadline, Await::Follow(operation))?;
        } else if let Some((epoch, members)) = committed.filter(|(e, _)| self.position().is_none_or(|p| p.epoch != *e))
        {
            // It came into force between calls: we reported ready in a call that then failed (its
            // vote was abandoned, say). Its pools are ours already; take it up.
            let mut data = self.data.lock().unwrap_or_else(PoisonError::into_inner);
            self.take_up(c, &mut data, epoch, &members)?;
        }
        Ok(())
    }

    /// Makes topology `epoch`, in force with our pools established, the one our calls run in.
    fn take_up(&self, c: &Connected, data: &mut DataPlane, epoch: Epoch, members: &[Member]) -> Result<()> {
        let pos = c.control.lock().view.position(epoch, members);
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
        *self.topology.lock().unwrap_or_else(PoisonError::into_inner) = Some(pos);
        Ok(())
    }

    /// Follows the master's topologies until one that includes us is committed: open the
    /// connections each one asks for, report ready (or who is unreachable), repeat if the
    /// master supersedes it.
    fn await_topology(&self, c: &Connected, deadline: Deadline, call: Await) -> Result<Awaited> {
        let operation = call.operation();
        let mut data = self.data.lock().unwrap_or_else(PoisonError::into_inner);
        // A topology this peer reported ready in during an earlier call (one whose vote was then
        // abandoned, say) is not established again: that would re-dial, and so close, the pool
        // its successor already took.
        let mut handled: Option<Epoch> = c.control.lock().view.ready_in;
        loop {
            let step =
                c.control.wait_until(operation, deadline, |s| s.view.topology_step(handled, call == Await::Vote))?;
            match step {
                TopologyStep::VoteRefused => return Ok(Awaited::VoteRefused),
                TopologyStep::VoteAbandoned(reason) => return Err(Error::Misuse(reason)),
                TopologyStep::Establish(epoch, members) => {
                    let pos = c.control.lock().view.position(epoch, &members);
                    match c.listener.establish(&mut data, &c.control, &pos, &self.config, deadline, operation) {
                        Ok(()) => {
                            failpoint(if call == Await::Connect {
                                "connect.before_ready"
                            } else {
                                "update_topology.before_ready"
                            });
                            // Before the report: its commit may arrive before send returns.
                            c.control.lock().view.ready_in = Some(epoch);
                            c.control.send(&Message::TopologyReady { epoch })?;
                        }
                        Err(EstablishError::Unreachable(peer, reason)) => {
                            log::warn!("{}: cannot reach {peer}: {reason}", c.me);
                            c.control.send(&Message::PeerUnreachable { epoch, peer })?;
                        }
                        Err(EstablishError::Superseded) => {}
                        Err(EstablishError::Fatal(e)) => return Err(e),
                    }
                    handled = Some(epoch);
                }
                TopologyStep::InForce(epoch, members) => {
                    self.take_up(c, &mut data, epoch, &members)?;
                    return Ok(Awaited::InForce);
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

/// How a wait for a topology ended.
enum Awaited {
    /// The topology is in force.
    InForce,
    /// Our `update_topology` vote was not counted (a topology was being connected): vote again.
    VoteRefused,
}

/// Which call waits for a topology to come into force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Await {
    /// `connect`: a newcomer waits to be admitted.
    Connect,
    /// `update_topology`: our vote may be abandoned (the others made another call).
    Vote,
    /// Another call joins a topology issued without a vote (a re-formed ring) before it runs.
    Follow(&'static str),
}

impl Await {
    fn operation(self) -> &'static str {
        match self {
            Await::Connect => "connect",
            Await::Vote => "update_topology",
            Await::Follow(operation) => operation,
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

/// What a failed ring run means for the caller, and what to tell the master (nothing where the
/// master already decided).
fn ring_error(e: RingError, header: &OpHeader, me: PeerId, next: PeerId, prev: PeerId) -> (Error, Option<OpFailure>) {
    match e {
        RingError::Lost { side, reason } => {
            let peer = if side == Side::Next { next } else { prev };
            let failure = OpFailure::new(FailureKind::PeerLost, peer, format!("{me} lost {peer}: {reason}"));
            (Error::PeerLost { peer, operation: "all_reduce", reason }, Some(failure))
        }
        RingError::Mismatch { theirs } => {
            // The verdict carries both calls with their peers: a participant that did not see the
            // difference itself (the predecessor, say) must not read either as its own.
            let (ours, theirs) = (describe(header), format!("{prev} called {}", describe(&theirs)));
            let failure = OpFailure::new(FailureKind::Mismatch, prev, format!("{me} called {ours}; {theirs}"));
            (Error::CollectiveMismatch { peer: prev, ours, theirs }, Some(failure))
        }
        RingError::Malformed(reason) => {
            let failure = OpFailure::new(FailureKind::Protocol, prev, format!("{prev} sent {me} {reason}"));
            (Error::Protocol(format!("from {prev}: {reason}")), Some(failure))
        }
        RingError::Timeout(e) => {
            let failure = OpFailure::new(FailureKind::Timeout, me, format!("{me}: {e}"));
            (e, Some(failure))
        }
        RingError::Aborted(e) => {
            let failure = match &e {
                Error::PeerLost { peer, reason, .. } => {
                    Some(OpFailure::new(FailureKind::PeerLost, *peer, reason.clone()))
                }
                Error::Misuse(reason) => Some(OpFailure::new(FailureKind::Misuse, me, reason.clone())),
                _ => None,
            };
            (e, failure)
        }
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

fn all_reduce_header(epoch: Epoch, seq: u64, tag: u64, dtype: DType, op: ReduceOp, count: u64) -> OpHeader {
    OpHeader {
        collective: CollectiveKind::AllReduce.code(),
        epoch,
        seq,
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
