//! The driver: whichever thread holds the data plane carries out what the peer's state machine
//! asks (open and take up topologies, post collectives, fetch state), pumps the engine and reports
//! what it did, until the call it waits for ended; the progress thread drives while nobody waits
//! (`docs/architecture.md`, "Threads"). The calls (`communicator.rs`) submit to it and wait.

use crate::config::{CommunicatorConfig, DEFAULT_CHUNK_BYTES};
use crate::control::Control;
use crate::error::{Error, Misfit, Protocol, Usage};
use crate::info::Info;
use crate::links::{Dialer, Listener};
use crate::named::{verb_of, Described};
use crate::plane::{CallResult, Collective, DataPlane, Extra, Placement, Posted, Request, Spares, TagUse};
use crate::Deadline;
use shoal_collective::{Algorithm, CollectiveKind, Quantization};
use shoal_config::failpoint;
use shoal_engine::{Backup, Exec, LinkError, OpEvent, OpKey, OpSpec, Pumped, RawBuf};
use shoal_proto::auth::DataKey;
use shoal_proto::peer::{
    Action, CallError, CallId, Established, OpId, OpProgress, RingPosition, Seq, Value, WaitNote, P2P_PATIENCE,
};
use shoal_transport::{Lane, PollFd};
use shoal_wire::{Epoch, FailureKind, Member, Mismatch, OpFailure, OpHeader, PeerId, Reason, SessionId};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Longest a poll on the data streams waits before the driver looks around again.
const POLL_SLICE: Duration = Duration::from_millis(50);
/// How long the progress thread, woken for work an async call started, leaves the lock to that
/// caller before it drives.
const HANDOFF_GRACE: Duration = Duration::from_micros(100);

pub(crate) struct Connected {
    pub control: Arc<Control>,
    pub listener: Listener,
    pub me: PeerId,
    pub session: SessionId,
    /// The run's key for data connections (`shoal_proto::auth::DataKey`).
    pub data_key: DataKey,
}

impl Connected {
    /// `e`, where it says this peer was left out of a collective, with how far ahead the others
    /// are now: a collective waited for late (`Communicator::wait`) ended long before, and they
    /// may have run more without us since.
    pub fn ahead_now(&self, e: Error) -> Error {
        match e {
            Error::Excluded { operation, topology, sequence, included, peers_pending, .. } => {
                let op = OpId { epoch: Epoch(topology), derived: 0, seq: Seq(sequence) };
                let ahead = self.control.lock().decided_ahead(op);
                Error::Excluded { operation, topology, sequence, included, ahead, peers_pending }
            }
            e => e,
        }
    }
}

/// Topology `position.epoch`, in force with our pools established, is the one our calls run in:
/// its engine takes the links to our ring neighbours; it links to other members when a schedule
/// first needs them. The engine it replaces closes its pools off this thread (`closer.rs`).
pub(crate) fn take_up(data: &mut DataPlane, position: &RingPosition) {
    let (rank, world) = (position.rank, position.group_size());
    let me = position.ring[rank].peer;
    let mut exec = Exec::new(position.epoch, rank, world);
    if world > 1 {
        // Both halves come non-blocking from the listener (`links.rs`): our successor's pool and
        // our predecessor's, and those to and from other members in the same round trip.
        let rank_of = |peer: PeerId| position.ring.iter().position(|m| m.peer == peer);
        for (peer, send) in std::mem::take(&mut data.staged.outgoing) {
            if let Some(rank) = rank_of(peer).filter(|_| !send.is_empty()) {
                exec.add_send(rank, send);
            }
        }
        for (peer, recv) in std::mem::take(&mut data.staged.incoming) {
            if let Some(rank) = rank_of(peer).filter(|_| !recv.is_empty()) {
                exec.add_recv(rank, recv);
            }
        }
    }
    if let Some(superseded) = data.exec.replace(exec) {
        data.closer.close(superseded);
    }
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

/// What a collective's failure over the link to `them` means for the caller, and the failure
/// to report to the master.
pub(crate) fn link_error(e: LinkError, header: &OpHeader, me: PeerId, them: PeerId) -> (Error, OpFailure) {
    match e {
        LinkError::Lost { reason, .. } => {
            let failure = OpFailure::new(FailureKind::PeerLost, them, format!("{me} lost {them}: {reason}"));
            (Error::PeerLost { peer: them, operation: operation(header), reason }, failure)
        }
        LinkError::Mismatch { theirs, .. } => {
            // The verdict carries both calls with their peers: a participant that did not see the
            // difference itself must not read either as its own.
            let failure = OpFailure::mismatch(Mismatch::new((me, *header), (them, theirs)));
            let (ours, theirs) = (Described::Collective(*header), vec![(them, Described::Collective(theirs))]);
            (Error::CollectiveMismatch { peer: them, ours, theirs }, failure)
        }
        LinkError::Malformed { what, .. } => {
            let failure = OpFailure::new(FailureKind::Protocol, them, format!("{them} sent {me} {what}"));
            (Protocol::Malformed { peer: them, what }.into(), failure)
        }
    }
}

/// The error a participant returns for a collective the master aborted.
pub(crate) fn op_error(f: OpFailure, header: &OpHeader) -> Error {
    // The wire carries a mismatch exactly with a failure of that kind.
    if let Some(m) = f.reason.mismatch() {
        let theirs = [m.ours, m.theirs].map(|(p, h)| (p, Described::Collective(h))).to_vec();
        return Error::CollectiveMismatch { peer: f.peer, ours: Described::Collective(*header), theirs };
    }
    match f.kind {
        FailureKind::Misuse => match f.reason {
            Reason::Misuse(misuse) => Error::Misuse(*misuse),
            reason => Usage::MemberMisfit { peer: f.peer, reason }.into(),
        },
        _ => Error::PeerLost { peer: f.peer, operation: operation(header), reason: f.reason.to_string() },
    }
}

/// The name of the collective `header` names.
pub(crate) fn operation(header: &OpHeader) -> &'static str {
    CollectiveKind::from_code(header.collective).map_or("collective", CollectiveKind::name)
}

/// The engine's key of collective `id`.
pub(crate) fn op_key(id: OpId) -> OpKey {
    OpKey { derived: id.derived, seq: id.seq.0 }
}

pub(crate) fn op_header(id: OpId, request: &Request, algorithm: Algorithm, count: u64) -> OpHeader {
    let (quantization, block) = Quantization::to_wire(request.quantization);
    OpHeader {
        collective: request.kind.code(),
        algorithm: algorithm.code(),
        epoch: id.epoch,
        derived: id.derived,
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
pub(crate) fn fits(record: &Collective, world: usize) -> std::result::Result<(), Misfit> {
    let kind = record.request.kind.name();
    let (whole, block) = match &record.extra {
        Extra::Gather { inp, .. } => (record.buf.len(), inp.len),
        Extra::Scatter { out, .. } => (record.buf.len(), out.len()),
        Extra::None if record.request.kind == CollectiveKind::Broadcast && record.request.root >= world => {
            return Err(Misfit::NoSuchRoot { kind, root: record.request.root, world });
        }
        Extra::None | Extra::Arrived { .. } => return Ok(()),
    };
    if whole != world * block {
        let what = if matches!(record.extra, Extra::Gather { .. }) { "output" } else { "input" };
        return Err(Misfit::Blocks { kind, what, whole, world, block });
    }
    Ok(())
}

/// Shapes collective `record` with a deadline, whose buffers fit the whole group of `whole`
/// members, to run among `included` alone (ranks in the whole group, ascending): an all-gather
/// gathers their blocks into a buffer of its own, spread into the caller's output on success; a
/// reduce-scatter reduces their blocks of its copy of the input; a broadcast's root is named by
/// its rank among them. So the left-out members' blocks stay as they were.
fn narrow(record: &mut Collective, included: &[usize], whole: usize, spares: &Spares) -> Result<(), Misfit> {
    fits(record, whole)?;
    let kind = record.request.kind;
    match &mut record.extra {
        Extra::Gather { inp, narrowed, .. } => {
            let mut work = spares.take(included.len() * inp.len);
            let out = std::mem::replace(&mut record.buf, RawBuf::new(work.as_mut()));
            *narrowed = Some((out, work));
        }
        Extra::Scatter { out, _work } => {
            let (block, work) = (out.len(), _work.as_mut());
            for (i, &r) in included.iter().enumerate() {
                work.copy_within(r * block..(r + 1) * block, i * block);
            }
            record.buf = RawBuf::new(&mut work[..included.len() * block]);
        }
        Extra::None if kind == CollectiveKind::Broadcast => {
            let root = record.request.root;
            // The master waits for the root: one left out is a bug, failed as a misfit.
            let no_root = Misfit::NoSuchRoot { kind: kind.name(), root, world: included.len() };
            record.request.root = included.iter().position(|&r| r == root).ok_or(no_root)?;
        }
        Extra::None | Extra::Arrived { .. } => {}
    }
    record.count = (record.buf.len() / record.request.dtype.size()) as u64;
    Ok(())
}

/// The progress thread's state, shared with the callers.
#[derive(Default)]
pub(crate) struct Progress {
    /// Callers waiting for the data plane: the progress thread lets go of it for them.
    pub waiters: AtomicUsize,
    pub thread: OnceLock<std::thread::Thread>,
    pub stop: std::sync::atomic::AtomicBool,
    /// The control of the run we are in, whose waker interrupts a driver's sleep.
    pub control: Mutex<Option<Arc<Control>>>,
}

/// The data plane, held by a caller. Letting go of it with operations still in flight wakes the
/// progress thread, which never waits for the lock: the caller drove them while it held it.
pub(crate) struct DataGuard<'a> {
    pub data: std::sync::MutexGuard<'a, DataPlane>,
    pub progress: &'a Progress,
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
pub(crate) struct Driver {
    pub config: CommunicatorConfig,
    pub progress: Progress,
}

impl Driver {
    /// Carries out what the state machine asks until call `call` ended (or, without one, until
    /// no collective is in flight, or `until`, or a caller wants the data plane): opens and
    /// takes up topologies, moves every collective in flight, and hands what only this call
    /// does (fetching state) to `own`, which may end the call early with its result.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn drive(
        &self,
        control: &Control,
        listener: &Listener,
        data: &mut DataPlane,
        call: Option<CallId>,
        until: Option<Instant>,
        operation: &'static str,
        own: impl FnMut(&mut DataPlane, Action) -> Option<CallResult>,
    ) {
        self.drive_until(control, listener, data, call, until, operation, own);
        // The caller stops waiting (its transfer ended, or its own wait timed out).
        if let Some(call) = call.filter(|c| data.calls.transfers.announced(*c)) {
            control.own_input(|p, _| data.calls.transfers.handle_resumed(call, p));
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn drive_until(
        &self,
        control: &Control,
        listener: &Listener,
        data: &mut DataPlane,
        call: Option<CallId>,
        until: Option<Instant>,
        operation: &'static str,
        mut own: impl FnMut(&mut DataPlane, Action) -> Option<CallResult>,
    ) {
        let entered = Instant::now();
        let mut idle_since: Option<Instant> = None;
        // A caller that wants the data plane takes it from the progress thread.
        let wanted = || call.is_none() && self.caller_waits();
        loop {
            if call.is_some_and(|call| data.calls.ended_or_finished(call)) {
                return;
            }
            if let Some(action) = self.next_action(control, data, call, until) {
                idle_since = None;
                self.dispatch(control, listener, data, call, operation, &mut own, action);
                continue;
            }
            if data.exec.as_ref().is_some_and(|e| e.awaiting()) {
                self.link(listener, data);
            }
            if !data.in_flight() {
                let waited_out = until.is_none_or(|u| Instant::now() >= u);
                if (call.is_none() && (waited_out || self.caller_waits()))
                    || (call.is_some() && until.is_some() && waited_out)
                {
                    return;
                }
                continue;
            }
            if self.pump(control, data) {
                idle_since = None;
                continue;
            }
            if wanted() || until.is_some_and(|u| Instant::now() >= u) {
                return;
            }
            // Nothing to do until the network delivers: save ahead what the collectives will
            // overwrite, so that on a real network the backups cost no time at all.
            if data.exec.as_mut().expect("in flight").save_ahead() {
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
            if wanted() {
                return;
            }
            if self.before_sleep(control, listener, data, call, entered) {
                continue;
            }
            self.sleep(control, listener, data, until);
        }
    }

    /// Whether a caller waits for the data plane (the progress thread, which drives without a
    /// call of its own, lets go of it then).
    fn caller_waits(&self) -> bool {
        self.progress.waiters.load(Ordering::SeqCst) > 0
    }

    /// The state machine's next action: at once while collectives are in flight; otherwise
    /// waiting for one (within `until`, or the state machine's own bound for a call).
    fn next_action(
        &self,
        control: &Control,
        data: &DataPlane,
        call: Option<CallId>,
        until: Option<Instant>,
    ) -> Option<Action> {
        match (data.in_flight(), call, until) {
            (true, ..) => control.poll_action(),
            (false, Some(_), None) => Some(control.next_action()),
            (false, _, until) => {
                control.wait_action(until.unwrap_or_else(Instant::now), || call.is_none() && self.caller_waits())
            }
        }
    }

    /// Carries out one action of the state machine's, for `call` (run by `operation`); hands
    /// what only that call does to `own`.
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &self,
        control: &Control,
        listener: &Listener,
        data: &mut DataPlane,
        call: Option<CallId>,
        operation: &'static str,
        own: &mut impl FnMut(&mut DataPlane, Action) -> Option<CallResult>,
        action: Action,
    ) {
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
            Action::TakeUp(position) => {
                control.own_input(|p, _| crate::plane::superseded(p, data, position.epoch));
                take_up(data, &position)
            }
            Action::RunCollective { call: c, op, position, group, .. } => {
                self.post(control, listener, data, c, op, (&position, group))
            }
            Action::MemberWaits(_) => self.judge_waiters(control, data, call),
            Action::P2pApart { peer, misuse } => crate::plane::p2p_apart(data, peer, misuse),
            Action::P2pOutcome(asked) => control.own_input(|p, _| crate::plane::p2p_outcome(p, data, asked)),
            Action::P2pDecided(told, done) => crate::plane::p2p_decided(data, told, done),
            action => {
                if let Some(result) = own(data, action) {
                    let call = call.expect("only a call's own driver is asked for its actions");
                    data.calls.ended.insert(call, result);
                }
            }
        }
    }

    /// Moves what the engine can move now and reports what it did; whether anything happened.
    fn pump(&self, control: &Control, data: &mut DataPlane) -> bool {
        let exec = data.exec.as_mut().expect("in flight");
        let moved = exec.pump(Instant::now()) == Pumped::Progress;
        let events = exec.events();
        let transfers = exec.transfer_events();
        let news = !events.is_empty() || !transfers.is_empty();
        control.own_input(|p, _| crate::plane::engine_ended(p, data, transfers));
        if !events.is_empty() {
            self.report(control, data, events);
            self.take_stopped(control, data);
        }
        moved || news
    }

    /// What must happen before the driver sleeps, as nothing moves: links taken, collectives
    /// and transfers stopped that can no longer complete, a long wait announced. Whether that
    /// left something to do at once.
    fn before_sleep(
        &self,
        control: &Control,
        listener: &Listener,
        data: &mut DataPlane,
        call: Option<CallId>,
        entered: Instant,
    ) -> bool {
        if data.exec.as_ref().is_some_and(|e| e.awaiting()) {
            listener.arrived().drain();
            self.link(listener, data);
        }
        // Whatever stops a collective short of the master's decision (the removal of a member
        // it moves data with, a vote it can never complete against) stops it now.
        let waits_on = |key: OpKey| match (data.exec.as_ref(), data.position.as_ref()) {
            (Some(exec), Some(position)) => exec.waits_on(key).into_iter().map(|r| position.ring[r].peer).collect(),
            _ => Vec::new(),
        };
        let stalled: Vec<(OpId, Vec<PeerId>)> = data.calls.posted().map(|(key, id)| (id, waits_on(key))).collect();
        control.own_input(|p, now| {
            for (id, waits_on) in stalled {
                p.handle_collective(id, OpProgress::Stalled { waits_on }, now);
            }
        });
        self.take_stopped(control, data);
        if !data.calls.transfers.is_empty() || data.calls.transfers.owes() {
            control.own_input(|p, _| crate::plane::stop_stalled(p, data));
        }
        if let Some(call) = call.filter(|c| data.calls.transfers.get(*c).is_some() && entered.elapsed() >= P2P_PATIENCE)
        {
            let (transfers, exec) = (&mut data.calls.transfers, data.exec.as_ref());
            let unmatched = || exec.and_then(|e| e.transfer_unmatched(call.0));
            control.own_input(|p, _| transfers.handle_waiting(call, entered.elapsed(), unmatched, p));
        }
        control.lock().has_action() || call.is_some_and(|call| data.calls.ended_or_finished(call)) || !data.in_flight()
    }

    /// Sleeps until a lane in flight can move, an action or a caller wakes us, a member links
    /// to us, or the slice (within `until`, and an early frame's grace) ends.
    fn sleep(&self, control: &Control, listener: &Listener, data: &mut DataPlane, until: Option<Instant>) {
        let exec = data.exec.as_mut().expect("in flight");
        if !exec.arm() {
            return;
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

    /// Says which members' transfers with us our caller's call can never let complete
    /// ([`shoal_proto::peer::Peer::judge_waiters`]), as our engine sees them.
    fn judge_waiters(&self, control: &Control, data: &DataPlane, call: Option<CallId>) {
        let (Some(call), Some(exec), Some(position)) = (call, data.exec.as_ref(), data.position.as_ref()) else {
            return;
        };
        let collective = data
            .calls
            .collectives
            .get(&call)
            .and_then(|c| c.posted.as_ref())
            .and_then(|p| Some((p.id, verb_of(&p.header)?)));
        let stuck = |waiter: PeerId, note: &WaitNote| {
            let rank = position.ring.iter().position(|m| m.peer == waiter);
            rank.is_some_and(|rank| exec.transfer_stuck(rank, note.send, note.tag, note.seen))
        };
        control.own_input(|p, now| p.judge_waiters(call, collective, stuck, now));
    }

    /// The progress thread: drives collectives in flight whenever no caller holds the data plane.
    pub(crate) fn progress_loop(&self, data: &Mutex<DataPlane>, c: &Connected) {
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

    /// Posts collective `id` of call `call` to the engine, and links to the members it needs:
    /// at our `position` in the topology, among the ring's members or those of a derived group
    /// (`members`: the ring's rank of each, by their rank in the group; empty: the whole ring).
    pub(crate) fn post(
        &self,
        control: &Control,
        listener: &Listener,
        data: &mut DataPlane,
        call: CallId,
        id: OpId,
        (position, members): (&RingPosition, Vec<usize>),
    ) {
        let record = data.calls.collectives.get_mut(&call).expect("a collective called here");
        let (rank, world) = crate::plane::place(position, &members);
        let mut narrowed = Ok(());
        if record.request.cutoff.is_some() {
            // The whole group's collective, among the members the master named.
            record.included.clone_from(&members);
            if world < position.group_size() {
                narrowed = narrow(record, &members, position.group_size(), &data.spares);
            }
        }
        let request = record.request;
        if data.placement.epoch != Some(position.epoch) {
            data.placement = Placement::of(position);
        }
        let hosts = data.placement.hosts_of(&members);
        let group = (world, hosts.iter().max().map_or(1, |h| h + 1));
        let codec = request.codec().expect("checked when called");
        // What travels decides: a quantized buffer is as small as its encoding.
        let wire = codec.map_or(record.buf.len(), |c| c.encoded_len(record.count as usize));
        let mut algorithm = self.config.algorithm_for(request.kind, request.algorithm, wire, group, position.limits);
        if algorithm == Algorithm::TwoLevel && codec.is_some() && !shoal_collective::twolevel::quantizes(world, &hosts)
        {
            // A leader without members would keep a result its encoding did not round.
            algorithm = Algorithm::OneShot;
        }
        let header = op_header(id, &request, algorithm, record.count);
        record.posted = Some(Posted { id, header, world, rank, algorithm });
        log::trace!("{}", Described::Collective(header));
        // Buffers shaped for another group (it changed since the call) fail on every member alike.
        if let Err(why) = narrowed.and_then(|()| fits(record, world)) {
            let me = position.ring[position.rank].peer;
            let failure = OpFailure::new(FailureKind::Misuse, me, why.to_string());
            record.local = Some(Usage::Misfit(why).into());
            data.calls.by_key.insert(op_key(id), call);
            control.own_input(|p, now| p.handle_collective(id, OpProgress::Failed(failure), now));
            return;
        }
        if let Extra::Gather { inp, before, .. } = &mut record.extra {
            let block = rank * inp.len..(rank + 1) * inp.len;
            let mut held = data.spares.take(block.len());
            record.buf.read_into(block.clone(), held.as_mut());
            *before = Some(held);
            record.buf.write(block.start, inp.as_ref());
        }
        let spec = OpSpec {
            header,
            members,
            kind: request.kind,
            buf: record.buf,
            dtype: request.dtype,
            op: request.op,
            algorithm,
            root: request.root,
            hosts: if matches!(algorithm, Algorithm::Hierarchical | Algorithm::TwoLevel) {
                hosts.into_owned()
            } else {
                Vec::new()
            },
            chunk_bytes: self.config.chunk_bytes.unwrap_or(DEFAULT_CHUNK_BYTES),
            codec,
            backup: spare_backup(&mut data.spare_backups, record.buf.len()),
            called: record.started,
        };
        let exec = data.exec.get_or_insert_with(|| Exec::new(id.epoch, position.rank, position.group_size()));
        debug_assert_eq!(exec.epoch(), id.epoch, "a collective runs in the topology taken up");
        exec.post(spec);
        let awaiting = exec.awaiting();
        data.calls.by_key.insert(op_key(id), call);
        if awaiting {
            self.link(listener, data);
        }
        let events = data.exec.as_mut().expect("posted").events();
        self.report(control, data, events);
    }

    /// Opens our half of every link the collectives in flight need and lack, and takes the
    /// other half of each where its member opened it already. A member we cannot reach fails
    /// them, as a lost one would.
    pub(crate) fn link(&self, listener: &Listener, data: &mut DataPlane) {
        let (Some(exec), Some(position)) = (data.exec.as_mut(), data.position.as_ref()) else { return };
        if position.epoch != exec.epoch() {
            return;
        }
        let missing = exec.missing();
        let (ring, epoch) = (&position.ring, position.epoch);
        let mine = &ring[position.rank];
        let me = mine.peer;
        // Each pool is dialed by its sender, or by its receiver where only the sender can be
        // dialed (`links::Dialer`): what we dial, and what we take as its member dialed it.
        let (mut sends, mut receives) = (Vec::new(), Vec::new());
        for &to in &missing.to {
            match Dialer::of(mine, &ring[to]) {
                Dialer::Sender => sends.push(to),
                Dialer::Receiver => {
                    if let Some(pool) = listener.take_reverse(ring[to].peer, epoch) {
                        log::info!("{me}: {} (rank {to}) linked us to it over {} streams", ring[to].peer, pool.len());
                        exec.add_send(to, pool);
                    }
                }
                Dialer::Nobody => exec.unreachable(to, format!("neither {me} nor {} can be dialed", ring[to].peer)),
            }
        }
        for &from in &missing.from {
            match Dialer::of(&ring[from], mine) {
                Dialer::Sender => {
                    if let Some(pool) = listener.take_pool(ring[from].peer, epoch) {
                        log::info!("{me}: {} (rank {from}) linked to us over {} streams", ring[from].peer, pool.len());
                        exec.add_recv(from, pool);
                    }
                }
                Dialer::Receiver => receives.push(from),
                Dialer::Nobody => exec.unreachable(from, format!("neither {me} nor {} can be dialed", ring[from].peer)),
            }
        }
        // Every missing link at once: each dial waits a round trip.
        let deadline = Deadline::after(self.config.timeout);
        for (reverse, ranks) in [(false, sends), (true, receives)] {
            let members: Vec<&Member> = ranks.iter().map(|&r| &ring[r]).collect();
            for (&rank, opened) in ranks.iter().zip(listener.open(&members, reverse, epoch, &self.config, deadline)) {
                let peer = ring[rank].peer;
                match opened {
                    Ok(pool) if reverse => {
                        log::info!("{me}: linked {peer} (rank {rank}) to us over {} streams", pool.len());
                        exec.add_recv(rank, pool);
                    }
                    Ok(pool) => {
                        log::info!("{me}: linked to {peer} (rank {rank}) over {} streams", pool.len());
                        exec.add_send(rank, pool);
                    }
                    Err(reason) => {
                        log::warn!("{me}: cannot link to {peer} (rank {rank}): {reason}");
                        exec.unreachable(rank, reason.to_string());
                    }
                }
            }
        }
    }

    /// Tells the state machine what the engine did.
    pub(crate) fn report(&self, control: &Control, data: &mut DataPlane, events: Vec<(OpKey, OpEvent)>) {
        if events.is_empty() {
            return;
        }
        let me = control.lock().registered().map_or(PeerId(0), |(me, _)| me);
        let mut news = Vec::with_capacity(events.len());
        for (key, event) in events {
            let Some(record) = data.calls.by_key.get(&key).and_then(|c| data.calls.collectives.get_mut(c)) else {
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
    /// member, the bound): their frames can no longer move. Where one holds the result and asks
    /// the master, failed streams close once nothing moves over them: the verdict waits for the
    /// other participants' reports, and they learn of the failure only by the streams closing
    /// (holding them open until the verdict kept them waiting for tokens until their bound).
    pub(crate) fn take_stopped(&self, control: &Control, data: &mut DataPlane) {
        let Some(exec) = data.exec.as_mut() else { return };
        let posted: Vec<(OpKey, OpId)> = data.calls.posted().collect();
        let peer = control.lock();
        let stopped: Vec<OpKey> = posted.iter().filter(|(_, id)| !peer.running(*id)).map(|(k, _)| *k).collect();
        let asking = posted.iter().any(|(_, id)| peer.asking(*id));
        drop(peer);
        for key in stopped {
            if let Some(taken) = exec.take(key) {
                data.calls.taken.insert(key, taken);
            }
        }
        if asking && exec.in_flight() == 0 {
            exec.release_if_broken();
        }
    }

    /// Call `call` ended with `result`.
    pub(crate) fn ended(&self, control: &Control, data: &mut DataPlane, call: CallId, result: CallResult) {
        let Some(record) = data.calls.collectives.remove(&call) else {
            data.calls.ended.insert(call, result);
            return;
        };
        let key = record.posted.map(|p| op_key(p.id));
        let taken = key.and_then(|key| {
            data.calls.by_key.remove(&key);
            data.exec.as_mut().and_then(|e| e.take(key)).or_else(|| data.calls.taken.remove(&key))
        });
        // Failed streams close once every collective over them has its verdict, as the old
        // ring did: the first failure reached the master before the neighbours see them close
        // (a mismatch, not the "connection closed" that follows it). A participant that asks
        // for the verdict cannot wait that long: see take_stopped.
        if data.calls.by_key.is_empty() {
            if let Some(exec) = data.exec.as_mut() {
                exec.release_if_broken();
            }
        }
        let traffic = taken.as_ref().map(|t| t.traffic).unwrap_or_default();
        let ready = taken.as_ref().map_or(&[][..], |t| &t.ready[..]);
        let lateness = if record.request.kind == CollectiveKind::Broadcast { Vec::new() } else { lateness(ready) };
        let (request, operation) = (record.request, record.request.kind.name());
        // Where it posted nothing, our rank and the size of the group it ran in: a group of one,
        // or (with a deadline, which ran among us alone) the whole group.
        let alone = match (request.cutoff, data.position.as_ref()) {
            (Some(_), Some(p)) => (p.rank, p.group_size()),
            _ => (0, 1),
        };
        let outcome = match result {
            // A group of one posts nothing: its buffers must fit it all the same (a collective
            // with a deadline that ran among us alone: the whole group).
            Ok(Value::Collective(_)) if record.posted.is_none() && fits(&record, alone.1).is_err() => {
                Err(Usage::Misfit(fits(&record, alone.1).expect_err("checked")).into())
            }
            Ok(Value::Collective(id)) => {
                failpoint("all_reduce.after_commit");
                let rank = record.posted.map_or(alone.0, |p| p.rank);
                match &record.extra {
                    Extra::Scatter { out, .. } => record.buf.copy_to(rank * out.len()..(rank + 1) * out.len(), out),
                    // Posted, the input went into place then; alone, it is all there is.
                    Extra::Gather { inp, .. } if record.posted.is_none() => {
                        record.buf.write(rank * inp.len, inp.as_ref())
                    }
                    Extra::Gather { inp, narrowed: Some((out, work)), .. } => {
                        let block = inp.len;
                        for (i, &r) in record.included.iter().enumerate() {
                            out.write(r * block, &work.as_ref()[i * block..(i + 1) * block]);
                        }
                    }
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
                    peer: None,
                    lateness,
                    rank,
                    included: match (record.posted, record.included.is_empty()) {
                        (None, _) => vec![alone.0],
                        (Some(p), true) => (0..p.world).collect(),
                        (Some(_), false) => record.included,
                    },
                    peers_pending: request.cutoff.and_then(|_| control.lock().pending_at(id)),
                })
            }
            Ok(other) => unreachable!("{operation} returned {other:?}"),
            Err(e) => {
                // Every participant restores its buffer: the collective never happened.
                if let Some(t) = &taken {
                    t.restore();
                }
                if let (Extra::Gather { inp, before: Some(before), .. }, Some(posted)) = (&record.extra, record.posted)
                {
                    record.buf.write(posted.rank * inp.len, before.as_ref());
                }
                let algorithm = record.posted.map_or(Algorithm::Ring, |p| p.algorithm);
                let header = |id: OpId| op_header(id, &request, algorithm, record.count);
                let bound = record.bound;
                let me = data.position.as_ref().map(|p| p.ring[p.rank].peer);
                // If the master expelled us (we were frozen, say) or is gone, that is the news,
                // not the closed stream that made us notice.
                Err(match control.check_connected() {
                    Err(gone) => gone,
                    Ok(()) => match e {
                        // Ours ran out of time, and the master stopped it for every member.
                        CallError::Aborted { failure, .. }
                            if failure.kind == FailureKind::Timeout && Some(failure.peer) == me =>
                        {
                            record.local.unwrap_or(Error::Timeout { operation, after: bound })
                        }
                        CallError::Aborted { op: id, failure } => op_error(failure, &header(id)),
                        // Our own error stands; where the state machine stopped the collective (a
                        // removed member, a blocking vote, the bound), the failure it reported.
                        CallError::Unconfirmed { op: id, failure } => match record.local {
                            // Calls that differ once a member was lost follow from the loss (as
                            // the master's verdict says, `ops.rs`): retryable.
                            Some(Error::CollectiveMismatch { .. }) if failure.kind == FailureKind::PeerLost => {
                                op_error(failure, &header(id))
                            }
                            Some(local) => local,
                            None if failure.kind == FailureKind::Timeout => Error::Timeout { operation, after: bound },
                            None => op_error(failure, &header(id)),
                        },
                        e => call_error(control, e, operation, bound),
                    },
                })
            }
        };
        if let Some(t) = taken {
            data.spare_backups.push(t.into_backup());
        }
        if let Some(class) = record.class {
            data.bounds.ended(&self.config, class, (record.bound, record.started.elapsed()), &outcome);
        }
        data.record_end(call, &outcome);
        data.calls.finished.insert(call, (outcome, record.owner, Some(TagUse(record.derived, request.tag))));
    }
}

/// How much later than the earliest member each member called, from how long after its call
/// each held the result (every member's figure, else nothing: `Info::lateness`).
fn lateness(ready: &[Option<Duration>]) -> Vec<Duration> {
    let Some(ready) = ready.iter().copied().collect::<Option<Vec<Duration>>>() else { return Vec::new() };
    let most = ready.iter().max().copied().unwrap_or_default();
    ready.into_iter().map(|r| most - r).collect()
}

/// The spare backup that fits `len` bytes best: the smallest large enough, or else the largest.
pub(crate) fn spare_backup(spares: &mut Vec<Backup>, len: usize) -> Backup {
    spares.sort_by_key(Backup::capacity);
    match spares.iter().position(|b| b.capacity() >= len) {
        Some(i) => spares.remove(i),
        None => spares.pop().unwrap_or_default(),
    }
}

/// The error a call returns for how the state machine ended it.
pub(crate) fn call_error(control: &Control, e: CallError, operation: &'static str, bound: Duration) -> Error {
    match e {
        CallError::Timeout => Error::Timeout { operation, after: bound },
        CallError::Misuse(misuse) => Error::Misuse(misuse),
        CallError::SyncFailed { retryable, reason } => Error::SyncFailed { retryable, reason },
        CallError::Gone(gone) => control.gone_error(gone),
        CallError::Busy(call) => Usage::Busy(call).into(),
        CallError::Aborted { op, failure } => Protocol::Aborted { call: operation, op, reason: failure.reason }.into(),
        CallError::Unconfirmed { op, .. } => Protocol::Unconfirmed { call: operation, op }.into(),
        CallError::Interrupted(reason) => Error::MasterInterrupted { operation, reason },
        CallError::Excluded { op, included, ahead } => {
            // A collective of the whole group: its ranks are the ring's.
            let (ring, peers_pending) = {
                let peer = control.lock();
                (peer.position().map(|p| p.ring).unwrap_or_default(), peer.pending_at(op).unwrap_or_default())
            };
            let included = included.iter().filter_map(|p| ring.iter().position(|m| m.peer == *p)).collect();
            Error::Excluded { operation, topology: op.epoch.0, sequence: op.seq.0, included, ahead, peers_pending }
        }
    }
}
