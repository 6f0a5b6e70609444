//! The data plane's state, which whoever drives it holds: the pools of a topology being
//! established, the engine of the one in force and where its members run, and the records of
//! the calls in flight (collectives and tagged transfers) until their callers take them. The
//! driver (`communicator.rs`) and the calls that post to it (`transfer.rs`, ...) import this;
//! it imports neither.

use crate::error::{Error, Protocol, Result};
use crate::info::Info;
use crate::links::{Dialer, Staged};
use crate::named::Described;
use shoal_collective::{Algorithm, Codec, CollectiveKind, DType, Quantization, ReduceOp};
use shoal_engine::{Backup, Direction, Exec, LinkError, OpKey, RawBuf, Taken};
use shoal_proto::bounds::Observed;
use shoal_proto::peer::{
    CallError, CallId, Cutoff, Ended, EngineEnd, OpId, Peer, RingPosition, Stop, TransferName, Transfers, Value,
};
use shoal_wire::{Epoch, Misuse, OpHeader, PeerId};
use std::any::Any;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long the driver keeps retrying non-blocking IO (yielding the CPU in between) before it
/// sleeps in `poll(2)`. A sleep and wake-up cost tens of microseconds per hop, which dominates
/// small collectives (4 KiB, 2 peers: 71 µs median without, 55 µs with); yielding keeps a
/// spinning peer from starving a neighbour on the same core.
pub(crate) const SPIN: Duration = Duration::from_micros(50);
/// The spin where this host runs at least two members of the group per core, so that the peers
/// a spinning driver waits for mostly wait for a core themselves. A long spin then falls into
/// convoys: 4 peers on 2 cores, 4 KiB one-shot, the slowest peer's median swung between 150 and
/// 390 µs from run to run with 50 µs, and stayed within 151–185 µs with 5 µs. Not none: one
/// yield lets the peer on this core send what we wait for (without it, 380 µs). With 3 peers on
/// 2 cores the long spin is still the faster (104–114 µs against 124–141).
pub(crate) const OVERSUBSCRIBED_SPIN: Duration = Duration::from_micros(5);
/// How long of the spin the driver does not even yield, where this host runs no more members of
/// the group than it has cores: a yield is a system call, and the bytes a small collective
/// waits for arrive within microseconds (4 KiB, 2 peers on 2 cores: 19.2 µs median with a yield
/// per pass, 17.2 µs without). Past it, yields, so that another thread of the process (or of the
/// machine) that wants this core gets it.
pub(crate) const BUSY_SPIN: Duration = Duration::from_micros(10);
/// How the state machine ended a call.
pub(crate) type CallResult = std::result::Result<Value, CallError>;

/// Where the members of a topology run, for its collectives' schedules and its driver.
#[derive(Debug)]
pub(crate) struct Placement {
    /// The topology it describes (`None` before the first).
    pub epoch: Option<shoal_wire::Epoch>,
    /// The host of each rank, numbered in order of first appearance: its site where the master
    /// placed every member in one (`optimize_topology`), else as their advertised addresses say.
    /// Every member sees the same ones, so decides alike (members of one host that advertise
    /// different addresses count as two, which costs speed, not results).
    pub hosts: Vec<usize>,
    /// How long the driver spins before it sleeps: [`OVERSUBSCRIBED_SPIN`] where at least two
    /// members per core share our address (the cores this process may use).
    pub spin: Duration,
    /// How long of it without yielding: [`BUSY_SPIN`] where each member sharing our address
    /// can have a core, else none.
    pub busy_spin: Duration,
}

impl Default for Placement {
    fn default() -> Self {
        Placement { epoch: None, hosts: Vec::new(), spin: SPIN, busy_spin: Duration::ZERO }
    }
}

impl Placement {
    /// The host of each of `members` (ranks of the topology; empty: every member, as they are),
    /// numbered in order of first appearance among them.
    pub fn hosts_of(&self, members: &[usize]) -> std::borrow::Cow<'_, [usize]> {
        if members.is_empty() {
            return std::borrow::Cow::Borrowed(&self.hosts);
        }
        numbered(members.iter().map(|&r| self.hosts[r])).into()
    }

    pub fn of(position: &RingPosition) -> Placement {
        let host = |addr: &str| match addr.parse::<SocketAddr>() {
            Ok(a) => a.ip().to_string(),
            Err(_) => addr.rsplit_once(':').map_or(addr, |(h, _)| h).to_string(),
        };
        let addresses = numbered(position.ring.iter().map(|m| host(&m.addr)));
        let here = addresses.iter().filter(|&&h| h == addresses[position.rank]).count();
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        let spin = if here >= 2 * cores { OVERSUBSCRIBED_SPIN } else { SPIN };
        let busy_spin = if here <= cores { BUSY_SPIN } else { Duration::ZERO };
        let hosts = match position.ring.iter().map(|m| m.site).collect::<Option<Vec<u16>>>() {
            Some(sites) => numbered(sites),
            None => addresses,
        };
        Placement { epoch: Some(position.epoch), hosts, spin, busy_spin }
    }
}

/// Each item's number among the distinct items, numbered in order of first appearance.
pub(crate) fn numbered<T: PartialEq>(items: impl IntoIterator<Item = T>) -> Vec<usize> {
    let mut seen: Vec<T> = Vec::new();
    items
        .into_iter()
        .map(|item| {
            seen.iter().position(|s| *s == item).unwrap_or_else(|| {
                seen.push(item);
                seen.len() - 1
            })
        })
        .collect()
}

/// Our rank in, and the size of, the group of `members` (the topology's rank of each, by their
/// rank in the group; empty: the topology's whole group) at `position`.
pub(crate) fn place(position: &RingPosition, members: &[usize]) -> (usize, usize) {
    if members.is_empty() {
        return (position.rank, position.group_size());
    }
    let rank = members.iter().position(|&r| r == position.rank).expect("we are in the group we run in");
    (rank, members.len())
}

pub(crate) type Owner = Box<dyn Any + Send>;

/// A collective called and not yet returned.
pub(crate) struct Collective {
    /// The buffer its schedule works on.
    pub buf: RawBuf,
    /// What keeps the buffer alive where the caller does not wait ([`crate::Work`]).
    pub owner: Option<Owner>,
    pub request: Request,
    /// The derived group it runs in (0: the whole group).
    pub derived: u64,
    pub extra: Extra,
    pub count: u64,
    pub started: Instant,
    /// Once it runs: how.
    pub posted: Option<Posted>,
    /// A collective with a deadline: the ranks it ran among, as the master named them.
    pub included: Vec<usize>,
    /// Our own error for it, which stands where no verdict comes.
    pub local: Option<Error>,
    /// The bound it was called with, and the kind and size of collective whose durations that
    /// followed ([`OpBounds`]; `None` where it follows none).
    pub bound: Duration,
    pub class: Option<OpClass>,
}

/// A kind of collective and a size class: a factor of 16 in bytes.
pub(crate) type OpClass = (&'static str, u32);

/// The durations of collectives that ended, by kind and size class: where
/// [`crate::CommunicatorConfig::timeout_floor`] is set, the bound of the next one of that kind and
/// size follows them ([`shoal_proto::bounds`]), between the floor and `timeout`.
#[derive(Default)]
pub(crate) struct OpBounds(HashMap<OpClass, Observed>);

impl OpBounds {
    /// The class of a collective `kind` over `bytes`.
    pub fn class(kind: CollectiveKind, bytes: usize) -> OpClass {
        (kind.name(), bytes.max(1).ilog2() / 4)
    }

    /// The bound of a collective of `class` called now.
    pub fn bound(&self, config: &crate::CommunicatorConfig, class: OpClass) -> Duration {
        match config.timeout_floor {
            Some(_) => self.0.get(&class).map_or(config.timeout, Observed::bound),
            None => config.timeout,
        }
    }

    /// A collective of `class`, called with `bound`, ended after `took` with `outcome`: one
    /// that succeeded took that long; one that ran out of time took longer than its bound (twice
    /// it is assumed, so that a bound too short for a run grows back).
    pub fn ended(
        &mut self,
        config: &crate::CommunicatorConfig,
        class: OpClass,
        (bound, took): (Duration, Duration),
        outcome: &Result<Info>,
    ) {
        let Some(floor) = config.timeout_floor else { return };
        let sample = match outcome {
            Ok(_) => took,
            Err(Error::Timeout { .. }) => bound.saturating_mul(2),
            Err(_) => return,
        };
        let ceiling = config.timeout;
        let observed = self.0.entry(class).or_insert_with(|| Observed::new(floor.min(ceiling), ceiling, ceiling));
        observed.observe(sample);
    }
}

/// What a collective call asks for, besides its buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request {
    pub kind: CollectiveKind,
    pub dtype: DType,
    pub op: ReduceOp,
    pub tag: u64,
    /// A broadcast's root rank.
    pub root: usize,
    /// The algorithm asked for, if any.
    pub algorithm: Option<Algorithm>,
    /// How its chunks are quantized, if at all.
    pub quantization: Option<Quantization>,
    /// When it leaves out members that have not called it (a collective with a deadline).
    pub cutoff: Option<Cutoff>,
}

impl Request {
    /// The codec of its chunks; `Ok(None)` unquantized (or where quantizing changes nothing).
    pub fn codec(&self) -> Result<Option<Codec>> {
        let Some(q) = self.quantization else { return Ok(None) };
        let op = match self.kind {
            CollectiveKind::AllReduce | CollectiveKind::ReduceScatter => Some(self.op),
            CollectiveKind::AllGather => None,
            CollectiveKind::Broadcast | CollectiveKind::Barrier => {
                return Err(Error::InvalidArgument(format!(
                    "quantization applies to all_reduce, reduce_scatter and all_gather, not {}",
                    self.kind.name()
                )))
            }
        };
        q.codec(self.dtype, op).map_err(|e| Error::InvalidArgument(e.to_string()))
    }
}

/// What a collective does with the caller's buffers besides its schedule's.
pub(crate) enum Extra {
    None,
    /// All-gather: a copy of the caller's input, copied into its block of the output when
    /// posted, and what that block held, put back if it fails. With a deadline that left members
    /// out, the schedule runs over a buffer of the included members' blocks alone (`narrowed`,
    /// with the caller's output, which gets each block on success).
    Gather {
        inp: AlignedBytes,
        before: Option<AlignedBytes>,
        narrowed: Option<(RawBuf, AlignedBytes)>,
    },
    /// Reduce-scatter: where our block of the reduced copy of the input goes on success; the
    /// copy.
    Scatter {
        out: RawBuf,
        _work: AlignedBytes,
    },
    /// Barrier: the byte its schedule moves (see `barrier_work` in `communicator.rs`).
    Arrived {
        _byte: Box<[u8; 1]>,
    },
}

/// Bytes aligned for every element type, from [`Spares`] and given back to them when dropped.
pub(crate) struct AlignedBytes {
    words: Vec<u64>,
    pub len: usize,
    spares: Spares,
}

impl AlignedBytes {
    pub fn as_ref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    pub fn as_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        self.spares.give(std::mem::take(&mut self.words));
    }
}

/// Most buffers [`Spares`] keeps.
pub(crate) const MAX_SPARES: usize = 4;

/// The buffers of the copies that all-gathers and reduce-scatters make (their input, what the
/// output held), kept for the next ones once they end: a large buffer allocated afresh costs a
/// page fault per page at its first write, which made a 64 MiB reduce-scatter between two
/// processes 2.7 times as slow as an all-reduce of the same bytes. At most [`MAX_SPARES`], the
/// smallest dropped first.
#[derive(Clone, Default)]
pub(crate) struct Spares(Arc<Mutex<Vec<Vec<u64>>>>);

impl Spares {
    /// `len` bytes, whatever they held.
    pub fn take(&self, len: usize) -> AlignedBytes {
        let words = len.div_ceil(8);
        let mut spares = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        // The smallest that holds it, else the largest, grown.
        spares.sort_by_key(Vec::capacity);
        let mut taken = match spares.iter().position(|w| w.capacity() >= words) {
            Some(i) => spares.remove(i),
            None => spares.pop().unwrap_or_default(),
        };
        drop(spares);
        taken.resize(words, 0);
        AlignedBytes { words: taken, len, spares: self.clone() }
    }

    /// A copy of `bytes`.
    pub fn copy_of(&self, bytes: &[u8]) -> AlignedBytes {
        let mut copy = self.take(bytes.len());
        copy.as_mut().copy_from_slice(bytes);
        copy
    }

    fn give(&self, words: Vec<u64>) {
        if words.capacity() == 0 {
            return;
        }
        let mut spares = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        spares.push(words);
        if spares.len() > MAX_SPARES {
            spares.sort_by_key(Vec::capacity);
            spares.remove(0);
        }
    }
}

/// A collective in the engine: its name, its header, where it runs and how.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Posted {
    pub id: OpId,
    pub header: OpHeader,
    pub world: usize,
    pub rank: usize,
    pub algorithm: Algorithm,
}

/// What the driver tracks of the calls of a communicator.
#[derive(Default)]
pub(crate) struct Calls {
    pub collectives: HashMap<CallId, Collective>,
    /// The collectives posted to the engine, by their key there.
    pub by_key: HashMap<OpKey, CallId>,
    /// Collectives taken out of the engine before they ended, by key, with what the caller gets
    /// back of them.
    pub taken: HashMap<OpKey, Taken>,
    /// Tagged transfers called and not yet ended.
    pub transfers: Transfers<TransferCall, Error>,
    /// Collectives and transfers that ended, until their caller takes them.
    pub finished: HashMap<CallId, Finished>,
    /// Other calls that ended, until their caller takes them.
    pub ended: HashMap<CallId, CallResult>,
}

impl Calls {
    /// The collectives in the engine: their key there, and their name.
    pub fn posted(&self) -> impl Iterator<Item = (OpKey, OpId)> + '_ {
        self.by_key.iter().filter_map(|(key, call)| Some((*key, self.collectives.get(call)?.posted?.id)))
    }

    /// Whether a collective with `tag` is in flight, or ended and not waited for yet (in flight
    /// until waited for: whether it ended already depends on timing, which must not decide
    /// whether a call is refused).
    pub fn in_use(&self, what: TagUse) -> bool {
        self.finished.values().any(|f| f.2 == Some(what))
            || self.collectives.values().any(|o| TagUse(o.derived, o.request.tag) == what)
    }

    /// Whether call `call` ended, and its caller has not taken its result yet.
    pub fn ended_or_finished(&self, call: CallId) -> bool {
        self.ended.contains_key(&call) || self.finished.contains_key(&call)
    }

    /// Whether a collective or transfer is in flight.
    pub fn busy(&self) -> bool {
        !self.collectives.is_empty() || !self.transfers.is_empty()
    }
}

/// How a collective or transfer ended: its result, its buffer's owner, and a collective's tag,
/// in use until its caller takes this.
pub(crate) type Finished = (Result<Info>, Option<Owner>, Option<TagUse>);

/// A collective's tag in the space of its group's (the whole one, 0, or a derived one). Tagged
/// transfers need no such check: several with one tag match in the order they were made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TagUse(pub u64, pub u64);

/// The pools a peer holds, owned by whoever runs collectives.
#[derive(Default)]
pub(crate) struct DataPlane {
    /// The pools of the topology being established.
    pub staged: Staged,
    /// The engine of the topology our calls run in, over its links.
    pub exec: Option<Exec<shoal_transport::Stream>>,
    /// Where the engines of superseded topologies close their pools.
    pub closer: crate::closer::Closer<Exec<shoal_transport::Stream>>,
    /// That topology: who each rank is, and where to dial it.
    pub position: Option<RingPosition>,
    /// Where the members of [`DataPlane::position`] run, worked out once at take-up.
    pub placement: Placement,
    /// The collectives called and not yet returned, and how calls ended.
    pub calls: Calls,
    /// Backups of collectives that ended, to lend to the next ones.
    pub spare_backups: Vec<Backup>,
    /// The buffers of all-gathers' and reduce-scatters' copies (the communicator's).
    pub spares: Spares,
    /// The communicator's counters.
    pub stats: Arc<crate::stats::Stats>,
    /// How long collectives took, by kind and size: the bounds of the next.
    pub bounds: OpBounds,
}

impl DataPlane {
    /// Whether the engine in force has collectives or transfers in flight.
    pub fn in_flight(&self) -> bool {
        self.exec.as_ref().is_some_and(|e| e.in_flight() > 0 || self.calls.transfers.asking())
    }

    /// Our links in the topology in force, by rank.
    pub fn links(&self) -> Vec<crate::LinkInfo> {
        let (Some(exec), Some(position)) = (self.exec.as_ref(), self.position.as_ref()) else { return Vec::new() };
        let (mine, ring) = (&position.ring[position.rank], &position.ring);
        let reversed = |m| [Dialer::of(mine, m), Dialer::of(m, mine)].contains(&Dialer::Receiver);
        let info = |(&rank, s): (&usize, &shoal_engine::LinkStats)| crate::LinkInfo {
            peer: ring[rank].peer,
            rank,
            path: if reversed(&ring[rank]) { "reverse" } else { "direct" },
            dialable: ring[rank].dialable,
            streams_out: s.lanes_out,
            streams_in: s.lanes_in,
            tx_bytes: s.tx_bytes,
            rx_bytes: s.rx_bytes,
            saturated: s.saturated,
            saturated_bytes: s.saturated_bytes,
            transport: s.transport,
        };
        exec.stats().iter().map(info).collect()
    }

    /// Counts call `call`, which ended with `outcome`.
    pub fn record_end(&self, call: shoal_proto::peer::CallId, outcome: &crate::Result<crate::Info>) {
        let epoch = self.position.as_ref().map_or(0, |p| p.epoch.0);
        self.stats.ended(call, outcome, epoch, self.links());
    }
}

/// What the driver keeps with a transfer called and not yet ended ([`Transfer::data`]).
pub(crate) struct TransferCall {
    pub buf: RawBuf,
    pub owner: Option<Owner>,
    pub dtype: DType,
    /// The size of the group it runs in.
    pub world: usize,
    /// A derived group's members, by their rank in the topology (empty for the whole group).
    pub members: Vec<usize>,
    /// Our rank in that group.
    pub rank: usize,
    pub started: Instant,
}

/// A transfer called and not yet ended, as the transfers' machine tracks it.
pub(crate) type Transfer = shoal_proto::peer::Transfer<TransferCall, Error>;

/// Which end of transfer `t` we are.
fn direction(t: &Transfer) -> Direction {
    if t.send {
        Direction::Send
    } else {
        Direction::Recv
    }
}

fn operation(t: &Transfer) -> &'static str {
    direction(t).name()
}

/// Transfer `t` as its caller made it.
fn described(t: &Transfer) -> Described {
    let (count, dtype) = ((t.data.buf.len() / t.data.dtype.size()) as u64, t.data.dtype.code());
    Described::Transfer { send: t.send, count, dtype, tag: t.tag, rank: t.rank }
}

/// Ends the transfers the engine ended. A failure that broke the engine's lanes closes them at
/// once where no collective runs over them (which close once theirs have their verdicts): the
/// other ends' transfers over the lanes that did not fail would wait for their bound.
///
/// A transfer that failed while its outcome rested on the other end's word asks that end what
/// became of it there ([`shoal_proto::peer::Transfers::handle_engine`]).
pub(crate) fn engine_ended(
    peer: &mut Peer,
    data: &mut DataPlane,
    events: Vec<(u64, std::result::Result<(), LinkError>)>,
) {
    let now = Instant::now();
    if events.iter().any(|(_, r)| r.is_err()) && data.calls.by_key.is_empty() {
        if let Some(exec) = data.exec.as_mut() {
            exec.release_if_broken();
        }
    }
    for (id, result) in events {
        let call = CallId(id);
        let Some(t) = data.calls.transfers.get(call) else { continue };
        let lost = matches!(result, Err(LinkError::Lost { .. }));
        let result = result.map_err(|e| link_error(t, e));
        let (matched, uncertain) = data.exec.as_ref().map_or((None, false), |e| e.transfer_outcome(call.0));
        let end = EngineEnd { matched: matched.and_then(|m| member(data.position.as_ref(), m)), uncertain };
        data.calls.transfers.handle_engine(call, result, lost, end, peer, now);
    }
    take_ended(data);
}

/// A transfer's number and the member at the other end, from the engine's number and rank.
fn member(position: Option<&RingPosition>, (number, rank): (u64, usize)) -> Option<(u64, PeerId)> {
    Some((number, position?.ring.get(rank)?.peer))
}

/// A member asks what became here of its transfer `asked` with us.
pub(crate) fn p2p_outcome(peer: &mut Peer, data: &mut DataPlane, asked: TransferName) {
    let (exec, position) = (data.exec.as_ref(), data.position.as_ref());
    let in_flight = |call: CallId| member(position, exec?.transfer_outcome(call.0).0?);
    data.calls.transfers.handle_outcome_asked(asked, in_flight, peer);
    take_ended(data);
}

/// Whether our transfer `told` succeeded at its other end.
pub(crate) fn p2p_decided(data: &mut DataPlane, told: TransferName, done: bool) {
    data.calls.transfers.handle_decided(told, done);
    take_ended(data);
}

/// Ends, before the driver sleeps, the transfers that cannot end otherwise
/// ([`shoal_proto::peer::Transfers::handle_stalled`]).
pub(crate) fn stop_stalled(peer: &mut Peer, data: &mut DataPlane) {
    note_uncertain(data);
    data.calls.transfers.handle_stalled(peer, Instant::now());
    take_ended(data);
}

/// Topology `epoch` replaces the one the transfers in flight run in: its links close, and ranks
/// may name other members now; each ends with a retryable error, but one whose outcome rests
/// on the other end's word asks that end. What the engine did before counts first.
pub(crate) fn superseded(peer: &mut Peer, data: &mut DataPlane, epoch: Epoch) {
    if let Some(events) = data.exec.as_mut().map(|e| e.transfer_events()) {
        engine_ended(peer, data, events);
    }
    note_uncertain(data);
    data.calls.transfers.handle_taken_up(epoch, peer, Instant::now());
    take_ended(data);
}

/// Tells the transfers which of them wait for the other end's word on their outcome.
fn note_uncertain(data: &mut DataPlane) {
    let (exec, position) = (data.exec.as_ref(), data.position.as_ref());
    data.calls.transfers.handle_uncertain(|call| match exec?.transfer_outcome(call.0) {
        (Some(matched), true) => member(position, matched),
        _ => None,
    });
}

/// The transfer our caller waits on with `peer` can never complete: the other end is in a call
/// that waits for ours (`misuse` names both). Nothing if that wait is over.
pub(crate) fn p2p_apart(data: &mut DataPlane, peer: PeerId, misuse: Misuse) {
    let exec = data.exec.as_ref();
    let unmatched = |call: CallId| exec.is_some_and(|e| e.transfer_unmatched(call.0).is_some());
    data.calls.transfers.handle_apart(peer, misuse, unmatched);
    take_ended(data);
}

/// Takes the transfers that ended out of the engine, and keeps their ends for their callers.
fn take_ended(data: &mut DataPlane) {
    while let Some(Ended { call, transfer: t, result }) = data.calls.transfers.poll_ended() {
        let result = result.map_err(|stop| stop_error(&t, stop));
        // Its member's rank in the group: where a derived group's ranks name topology ranks.
        let rank = data.exec.as_ref().and_then(|e| e.transfer_peer(call.0));
        let members = &t.data.members;
        let peer = rank.map(|r| if members.is_empty() { r } else { members.iter().position(|&m| m == r).unwrap_or(r) });
        let traffic = data.exec.as_mut().and_then(|e| e.take_transfer(call.0)).unwrap_or_default();
        let outcome = result.map(|()| Info {
            world_size: t.data.world,
            tx_bytes: traffic.tx_bytes,
            rx_bytes: traffic.rx_bytes,
            elapsed: t.data.started.elapsed(),
            topology: t.epoch.0,
            sequence: 0,
            algorithm: if traffic.single_copy { Algorithm::SingleCopy } else { Algorithm::Direct },
            peer,
            lateness: Vec::new(),
            rank: t.data.rank,
            included: Vec::new(),
            peers_pending: None,
        });
        if let Err(e) = &outcome {
            log::debug!("{} failed: {e}", described(&t));
        }
        data.record_end(call, &outcome);
        data.calls.finished.insert(call, (outcome, t.data.owner, None));
    }
}

/// What a transfer's stop means for its caller.
fn stop_error(t: &Transfer, stop: Stop<Error>) -> Error {
    let lost = |reason: String| Error::PeerLost { peer: t.peer, operation: operation(t), reason };
    match stop {
        Stop::Failed(e) => e,
        Stop::Removed => lost("the master removed it from the run".into()),
        Stop::Replaced => lost(format!("the master replaces topology {} (a member was lost or admitted)", t.epoch.0)),
        Stop::Superseded(epoch) => {
            lost(format!("topology {} replaced topology {} while it was in flight", epoch.0, t.epoch.0))
        }
        Stop::Apart(misuse) => Error::Misuse(misuse),
        Stop::Timeout => Error::Timeout { operation: operation(t), after: t.deadline - t.data.started },
    }
}

/// What the engine's failure of transfer `t` means for its caller.
fn link_error(t: &Transfer, e: LinkError) -> Error {
    match e {
        LinkError::Lost { rank, reason } if Some(rank) == t.rank => {
            Error::PeerLost { peer: t.peer, operation: operation(t), reason }
        }
        // Another link failed, and took the streams with it.
        LinkError::Lost { rank, reason } => Error::PeerLost {
            peer: t.peer,
            operation: operation(t),
            reason: format!("the streams failed over rank {rank}: {reason}"),
        },
        LinkError::Mismatch { theirs: h, .. } => {
            let theirs = Described::Transfer { send: !t.send, count: h.count, dtype: h.dtype, tag: h.tag, rank: None };
            Error::CollectiveMismatch { peer: t.peer, ours: described(t), theirs: vec![(t.peer, theirs)] }
        }
        LinkError::Malformed { what, .. } => Protocol::Malformed { peer: t.peer, what }.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_wire::{Epoch, GroupId, Member, PeerId};

    fn position(addrs: &[&str], sites: Option<&[u16]>, rank: usize) -> RingPosition {
        let ring = addrs.iter().enumerate().map(|(i, addr)| Member {
            peer: PeerId(i as u32 + 1),
            group: GroupId(0),
            addr: (*addr).to_string(),
            site: sites.map(|s| s[i]),
            dialable: true,
            seen: None,
        });
        RingPosition { epoch: Epoch(3), rank, ring: ring.collect(), world_size: addrs.len(), limits: None }
    }

    /// A kind's bound falls to what it takes, never below the floor, and grows back after
    /// collectives of it ran out of time; a pinned bound stays the timeout.
    #[test]
    fn a_kinds_bound_follows_its_durations_and_grows_back_after_timeouts() {
        let ms = Duration::from_millis;
        let mut config = crate::CommunicatorConfig::from_env("127.0.0.1:1").unwrap();
        (config.timeout, config.timeout_floor) = (ms(20_000), Some(ms(1000)));
        let mut bounds = OpBounds::default();
        let (small, large) =
            (OpBounds::class(CollectiveKind::AllReduce, 64), OpBounds::class(CollectiveKind::AllReduce, 64 << 20));
        assert_ne!(small, large, "sizes a factor of 16 and more apart are told apart");
        let ok: Result<Info> = Ok(Info {
            world_size: 2,
            tx_bytes: 0,
            rx_bytes: 0,
            elapsed: ms(5),
            topology: 1,
            sequence: 0,
            algorithm: Algorithm::Ring,
            peer: None,
            lateness: Vec::new(),
            rank: 0,
            included: vec![0, 1],
            peers_pending: None,
        });
        for _ in 0..8 {
            assert_eq!(bounds.bound(&config, small), ms(20_000), "the timeout until a few ended");
            bounds.ended(&config, small, (bounds.bound(&config, small), ms(5)), &ok);
        }
        assert_eq!(bounds.bound(&config, small), ms(1000), "quick: the floor");
        assert_eq!(bounds.bound(&config, large), ms(20_000), "another size follows its own");
        let timed_out = Err(Error::Timeout { operation: "all_reduce", after: ms(1000) });
        for _ in 0..9 {
            bounds.ended(&config, small, (bounds.bound(&config, small), ms(1000)), &timed_out);
        }
        assert!(bounds.bound(&config, small) >= ms(2000), "grown back: {:?}", bounds.bound(&config, small));
        config.timeout_floor = None;
        assert_eq!(bounds.bound(&config, small), ms(20_000), "pinned");
    }

    #[test]
    fn copies_reuse_the_buffers_of_those_that_ended_and_keep_a_few() {
        let spares = Spares::default();
        let first = spares.copy_of(&[7u8; 1 << 20]);
        let at = first.as_ref().as_ptr();
        drop(first);
        // The next copy, no larger, takes the same memory (no fresh pages to fault in)...
        let again = spares.copy_of(&[1u8; 1000]);
        assert_eq!((again.as_ref().as_ptr(), again.as_ref()), (at, &[1u8; 1000][..]));
        // ...and one larger grows the largest kept, keeping its bytes initialized.
        drop(again);
        let larger = spares.take((1 << 20) + 5);
        assert_eq!(larger.as_ref().len(), (1 << 20) + 5);
        drop(larger);
        let held: Vec<_> = (1..=MAX_SPARES + 2).map(|k| spares.take(k << 10)).collect();
        drop(held);
        let kept = spares.0.lock().unwrap();
        assert_eq!(kept.len(), MAX_SPARES, "at most MAX_SPARES kept");
        assert!(kept.iter().all(|w| w.capacity() >= (4 << 10) / 8), "the smallest are dropped first");
    }

    #[test]
    fn hosts_are_numbered_by_address_or_by_site() {
        let addrs = ["10.0.0.2:7000", "10.0.0.1:7000", "10.0.0.2:7001", "[::1]:7000", "name:1"];
        let placed = Placement::of(&position(&addrs, None, 0));
        assert_eq!((placed.epoch, placed.hosts), (Some(Epoch(3)), vec![0, 1, 0, 2, 3]));
        let sites = [4, 4, 9, 9, 4];
        assert_eq!(Placement::of(&position(&addrs, Some(&sites), 0)).hosts, vec![0, 0, 1, 1, 0]);
    }

    #[test]
    fn a_driver_spins_briefly_only_where_two_members_or_more_share_each_core() {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        let spin = |here: usize, elsewhere: usize| {
            let mut addrs = vec!["127.0.0.1:1"; here];
            addrs.extend(vec!["10.9.9.9:1"; elsewhere]);
            (Placement::of(&position(&addrs, None, 0)).spin, Placement::of(&position(&addrs, None, here - 1)).spin)
        };
        assert_eq!(spin(2 * cores, 3), (OVERSUBSCRIBED_SPIN, OVERSUBSCRIBED_SPIN));
        assert_eq!(spin(2 * cores - 1, 3), (SPIN, SPIN));
        // Those elsewhere count their own host's members.
        let mut addrs = vec!["127.0.0.1:1"; 2 * cores];
        addrs.push("10.9.9.9:1");
        assert_eq!(Placement::of(&position(&addrs, None, 2 * cores)).spin, SPIN);
        assert_eq!(Placement::default().spin, SPIN);
        // Without yielding only while every member here can have a core.
        let busy = |here: usize| Placement::of(&position(&vec!["127.0.0.1:1"; here], None, 0)).busy_spin;
        assert_eq!((busy(1), busy(cores), busy(cores + 1)), (BUSY_SPIN, BUSY_SPIN, Duration::ZERO));
    }
}
