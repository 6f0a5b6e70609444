//! The progress engine's core: many collectives in flight over one topology's links.
//!
//! [`Exec`] owns, for one topology, a *link* to each member it exchanges data with: a pool of
//! [`Lane`]s to it and a pool from it (the ring's two neighbours are linked before the topology
//! is in force; others when a schedule first needs them, see [`Exec::missing`]). It advances
//! every collective posted to it, each a [`Schedule`](shoal_collective::schedule::Schedule) of sends, receives and reductions. Their
//! chunks travel as frames ([`FRAME_BYTES`] of header, then the chunk): the header names the
//! collective (its whole [`OpHeader`]: a peer that runs another collective is caught at its first
//! frame) and the chunk's unit in the receiver's schedule, so any lane of a link carries any
//! collective's chunk, and a free lane takes the next chunk for its member of the next collective
//! in turn (round-robin: a large collective cannot starve a small one), every other time of the
//! collective whose chunk arrived last instead (what it forwards was just reduced and is still
//! in the cache). The confirmation tokens are frames too.
//!
//! A frame may arrive before its collective is posted here (the predecessor's caller was quicker):
//! it is kept aside and applied when the collective is posted. Past [`MAX_EARLY_BYTES`] kept, the
//! lanes are left unread while no collective is in flight here: the frames of one that is may
//! be behind them, and nothing else waits. Only chunks that depend on no send of ours can come
//! early, so a collective sends at most its first segment ahead of its slowest participant.
//!
//! Every decision is [`Machine`]'s, a sans-IO machine whose inputs are `handle_*` calls and
//! whose outputs are `poll_*` calls (see `machine.rs`); [`Exec`] is that machine plus its lanes.
//! [`Exec::pump`] moves what can move without blocking and returns what happened to which
//! collective; it never sleeps, so the tests below step whole rings in one thread over in-memory
//! lanes (and machines alone, frames carried by hand), and the communicator drives it with
//! `poll(2)` from whichever thread waits.
//!
//! A lane that fails (the peer died, a reset, a malformed frame) fails every collective in flight
//! over the links: their streams may hold half a frame and can never be used again.
#![warn(missing_docs)]

mod machine;
mod p2p;

pub use machine::{Held, Incoming, LinksFailed, Machine, Outgoing};
pub use p2p::{Direction, End, Pull, TransferSpec};

use shoal_collective::Algorithm;
use shoal_collective::{Codec, CollectiveKind, DType, ReduceOp};
use shoal_transport::Lane;
use shoal_wire::{DataFrame as Frame, DataFrameError, Epoch, OpHeader, DATA_FRAME_BYTES as FRAME_BYTES};
use std::collections::BTreeMap;
use std::io::{ErrorKind, IoSlice};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

/// The original bytes of every part of a buffer a collective changed, so that a failed
/// collective can put the buffer back as it was. Each range is saved just before its first
/// change, so the copy is spread over the collective (overlapping the network wait) rather
/// than paid up front; a collective that fails early saved little.
#[derive(Debug, Default)]
pub struct Backup {
    words: Vec<u64>,
    /// Byte ranges saved, in the order they were saved.
    saved: Vec<std::ops::Range<usize>>,
}

impl Backup {
    /// Bytes it can save without growing.
    pub fn capacity(&self) -> usize {
        self.words.len() * 8
    }

    /// Forgets what was saved, ready for a buffer of `len` bytes.
    pub fn reset(&mut self, len: usize) {
        self.saved.clear();
        let words = len.div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
    }

    fn save(&mut self, buf: &[u8], range: std::ops::Range<usize>) {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.words);
        copy_past_cache(&mut bytes[range.clone()], &buf[range.clone()]);
        self.saved.push(range);
    }

    /// Puts every saved range back into `buf`.
    pub fn restore(&self, buf: &mut [u8]) {
        let bytes: &[u8] = bytemuck::cast_slice(&self.words);
        for r in &self.saved {
            buf[r.clone()].copy_from_slice(&bytes[r.clone()]);
        }
    }

    /// Bytes saved so far.
    #[cfg(test)]
    fn saved_bytes(&self) -> usize {
        self.saved.iter().map(|r| r.len()).sum()
    }
}

/// Copies `src` into `dst`; a large copy with non-temporal stores on x86-64. A backup is
/// written once and read only if its collective fails: stores that bypass the cache skip
/// reading each destination line first and leave the cache to the bytes the collective moves
/// next (2 peers on one host, 64 MiB all-reduce: the backup's copies were 45% of the time).
fn copy_past_cache(dst: &mut [u8], src: &[u8]) {
    const STREAM_FROM: usize = 64 << 10;
    assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= STREAM_FROM {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        dst[..head].copy_from_slice(&src[..head]);
        let blocks = (dst.len() - head) / 16;
        // SAFETY: SSE2 is part of x86-64; `dst[head..]` is 16-byte aligned and both slices
        // hold `blocks` whole 16-byte blocks from `head` on; unaligned loads from `src`.
        unsafe {
            let (d, s) = (dst.as_mut_ptr().add(head).cast::<__m128i>(), src.as_ptr().add(head).cast::<__m128i>());
            for i in 0..blocks {
                _mm_stream_si128(d.add(i), _mm_loadu_si128(s.add(i)));
            }
            _mm_sfence();
        }
        let done = head + blocks * 16;
        dst[done..].copy_from_slice(&src[done..]);
        return;
    }
    dst.copy_from_slice(src);
}

/// Bytes moved by one collective.
#[derive(Debug, Default, Clone, Copy)]
pub struct Traffic {
    /// Bytes of chunks sent, headers not counted.
    pub tx_bytes: u64,
    /// Bytes of chunks received.
    pub rx_bytes: u64,
    /// A transfer the receiver read out of the sender's memory.
    pub single_copy: bool,
}

/// Why a collective failed here; `rank` is the member at the other end of the link concerned.
#[derive(Debug, Clone)]
pub enum LinkError {
    /// A stream to or from `rank` failed.
    #[allow(missing_docs)]
    Lost { rank: usize, reason: String },
    /// `rank` started another collective.
    #[allow(missing_docs)]
    Mismatch { rank: usize, theirs: OpHeader },
    /// `rank` sent bytes that are not a frame of an operation here.
    #[allow(missing_docs)]
    Malformed { rank: usize, what: Malformed },
}

/// How a member broke the data protocol: what it sent is no frame of an operation here. The
/// stream is out of step and can never be used again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Malformed {
    /// A header that is not a data frame's.
    #[error(transparent)]
    Header(#[from] DataFrameError),
    /// A frame of another topology than the link's.
    #[error("a frame of topology {got} in topology {ours}")]
    ForeignTopology {
        /// The frame's topology.
        got: u64,
        /// The link's.
        ours: u64,
    },
    /// A frame of a collective that ended here.
    #[error("a frame of collective {seq}, which ended here")]
    Ended {
        /// The collective's number.
        seq: u64,
    },
    /// A frame of a collective of a derived group that the sender is not in.
    #[error("a frame of derived group {derived:#x}, which the sender is not in")]
    Outsider {
        /// The derived group.
        derived: u64,
    },
    /// An early chunk (of a collective not posted here yet) larger than can be kept.
    #[error("an early chunk of {len} bytes (at most {MAX_EARLY_BYTES})")]
    EarlyTooLarge {
        /// Its bytes.
        len: u32,
    },
    /// A chunk the schedule has not from that member.
    #[error("chunk {place} from a member that sends {expected}")]
    NoSuchChunk {
        /// Its place among the member's chunks.
        place: usize,
        /// Chunks the member sends.
        expected: usize,
    },
    /// A chunk of the wrong size, or a second time.
    #[error("chunk {place} of {len} bytes (expected {expected}{})", if *again { ", once" } else { "" })]
    BadChunk {
        /// Its place among the member's chunks.
        place: usize,
        /// Its bytes.
        len: u32,
        /// The bytes the schedule has.
        expected: usize,
        /// It came before.
        again: bool,
    },
    /// A confirmation token of a rank that sends none over this link, or one too many.
    #[error("a token of rank {origin} in a group of {world}")]
    BadToken {
        /// The rank it names.
        origin: u32,
        /// The group's size.
        world: u32,
    },
    /// A confirmation token whose body is not the [`TOKEN_BYTES`] it carries.
    #[error("a token of {len} bytes (a token carries {TOKEN_BYTES})")]
    TokenLength {
        /// Its body's bytes.
        len: u32,
    },
    /// An answer to a send never made here.
    #[error("an answer to send {n}, never made")]
    UnknownAnswer {
        /// The send's number.
        n: u64,
    },
    /// More sends waiting for receives than are kept.
    #[error("more than {} sends waiting for receives", p2p::MAX_WAITING_OFFERS)]
    TooManyOffers,
    /// A pull of a send that offered none.
    #[error("a pull of send {n}, which offered none")]
    PullNotOffered {
        /// The send's number.
        n: u64,
    },
    /// A second offer with a number already waiting here.
    #[error("offer {n} twice")]
    OfferTwice {
        /// The send's number.
        n: u64,
    },
    /// A confirmation of a transfer that pulled nothing here.
    #[error("a confirmation of transfer {n}, which pulled nothing here")]
    ConfirmNotPulled {
        /// The transfer's number.
        n: u64,
    },
    /// A receiver's word that every part of a transfer arrived, before every part left here.
    #[error("transfer {n} said received before all its parts left")]
    ReceivedEarly {
        /// The transfer's number.
        n: u64,
    },
    /// A part of a transfer not accepted here.
    #[error("a part of transfer {n}, which is not accepted here")]
    PartNotAccepted {
        /// The transfer's number.
        n: u64,
    },
    /// A part of the wrong size, out of range, or a second time.
    #[error("part {part} of {len} bytes of transfer {n} (expected {expected})")]
    BadPart {
        /// The transfer's number.
        n: u64,
        /// The part's number.
        part: usize,
        /// Its bytes.
        len: u32,
        /// The bytes expected.
        expected: usize,
    },
}

impl LinkError {
    /// The member at the other end.
    pub fn rank(&self) -> usize {
        match self {
            LinkError::Lost { rank, .. } | LinkError::Mismatch { rank, .. } | LinkError::Malformed { rank, .. } => {
                *rank
            }
        }
    }
}

/// Buffers of early frames kept for reuse: a fresh one per chunk would fault in a chunk's pages.
const SPARE_BODIES: usize = 64;
/// Most bytes of frames kept for collectives not posted yet, over all lanes.
pub const MAX_EARLY_BYTES: usize = 256 << 20;

/// A confirmation token's body: how long after its call its origin held the result,
/// microseconds, u64 little-endian (`docs/wire.md`).
pub const TOKEN_BYTES: usize = 8;
/// How long a chunk of a collective not posted here yet waits in its lane before it is read
/// aside ([`Machine::handle_held`]): members post a batch of collectives within microseconds of
/// each other, and a chunk read aside costs a copy more; one that waits holds up what follows it
/// on the lane, for at most this long.
const EARLY_GRACE: Duration = Duration::from_millis(1);
/// Most bytes a one-shot collective keeps of the other members' inputs: past it, the ring.
pub const MAX_STASH_BYTES: usize = 256 << 20;

/// A caller's buffer, lent to the engine for one collective: whoever posts it keeps the memory
/// alive and untouched until the collective is taken back ([`Exec::take`]).
#[derive(Debug, Clone, Copy)]
pub struct RawBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `RawBuf` is only dereferenced by the engine, under the engine's lock, while the
// poster guarantees the memory is alive and not used elsewhere (see the type's docs).
unsafe impl Send for RawBuf {}

impl RawBuf {
    /// Lends `buf`, under the promise above.
    pub fn new(buf: &mut [u8]) -> Self {
        RawBuf { ptr: NonNull::new(buf.as_mut_ptr()).unwrap_or(NonNull::dangling()), len: buf.len() }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where it lies in this process, for a receiver on the same host to read it from there.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }

    /// A buffer the engine only reads (a send's), under the same promise.
    pub fn of_shared(buf: &[u8]) -> Self {
        RawBuf { ptr: NonNull::new(buf.as_ptr().cast_mut()).unwrap_or(NonNull::dangling()), len: buf.len() }
    }

    /// Copies `range` of the buffer into `into`. The buffer must still be lent and not in the
    /// engine's use (the call is not posted yet, or has been taken out).
    pub fn read_into(&self, range: std::ops::Range<usize>, into: &mut [u8]) {
        // SAFETY: the caller's promise, as above.
        let whole = unsafe { self.slice() };
        into.copy_from_slice(&whole[range]);
    }

    /// Copies `range` of the buffer to the start of `to`, another buffer (they must not
    /// overlap), both under the promise of [`RawBuf::read_into`].
    pub fn copy_to(&self, range: std::ops::Range<usize>, to: &RawBuf) {
        let (from, to_start) = (self.ptr.as_ptr() as usize, to.ptr.as_ptr() as usize);
        assert!(
            from + self.len <= to_start || to_start + to.len <= from || range.is_empty(),
            "copy between overlapping buffers"
        );
        // SAFETY: the caller's promise, as above; the two do not overlap (checked).
        let (whole, to) = unsafe { (self.slice(), to.slice()) };
        to[..range.len()].copy_from_slice(&whole[range]);
    }

    /// Writes `bytes` at `at`, under the promise of [`RawBuf::read_into`].
    pub fn write(&self, at: usize, bytes: &[u8]) {
        // SAFETY: the caller's promise, as above.
        let whole = unsafe { self.slice() };
        whole[at..at + bytes.len()].copy_from_slice(bytes);
    }

    /// The buffer.
    ///
    /// # Safety
    /// Only while the buffer is lent to the engine (see the type's docs), and not while another
    /// slice of it is in use.
    unsafe fn slice<'a>(self) -> &'a mut [u8] {
        // SAFETY: the caller's promise; an empty buffer may dangle, and is never dereferenced.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// Names a collective among those over one topology's links: the group it runs in (0, the
/// topology's whole group, or a derived group's name) and its number in that group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct OpKey {
    /// The derived group ([`OpHeader::derived`]); 0 for the whole group.
    pub derived: u64,
    /// Its number there ([`OpHeader::seq`]).
    pub seq: u64,
}

impl OpKey {
    /// The key of the collective `header` names.
    pub fn of(header: &OpHeader) -> Self {
        OpKey { derived: header.derived, seq: header.seq }
    }
}

/// One collective to post: `buf` is the whole buffer its schedule works on.
pub struct OpSpec {
    /// The call every member must have made alike: its first frame carries it.
    pub header: OpHeader,
    /// The topology's ranks of the members of the group it runs in, by their rank there; empty
    /// for the topology's whole group. A derived group's collective runs its schedule over
    /// these members alone, on the links the topology has.
    pub members: Vec<usize>,
    /// The verb.
    pub kind: CollectiveKind,
    /// The buffer its schedule works on.
    pub buf: RawBuf,
    /// Its elements' type.
    pub dtype: DType,
    /// The reduction, where the verb reduces.
    pub op: ReduceOp,
    /// Which schedule moves its data.
    pub algorithm: Algorithm,
    /// A broadcast's root.
    pub root: usize,
    /// The host of each rank, for a hierarchical all-reduce (else empty).
    pub hosts: Vec<usize>,
    /// The largest chunk a frame carries.
    pub chunk_bytes: usize,
    /// The format its chunks travel in, if quantized (each chunk is encoded once, as it first leaves).
    pub codec: Option<Codec>,
    /// Where to save what it overwrites: a spare kept from an earlier collective, so that a
    /// large one does not allocate (and fault in) a copy of its buffer every time.
    pub backup: Backup,
    /// When its caller called: how long after it we held the result travels in our tokens
    /// ([`Taken::ready`]).
    pub called: Instant,
}

/// What happened to a collective ([`Exec::pump`]).
#[derive(Debug)]
pub enum OpEvent {
    /// Every chunk moved: its lap runs.
    DataDone,
    /// Its lap came round: every participant holds the result.
    Confirmed,
    /// It failed here.
    Failed(LinkError),
    /// Its lap cannot finish (a lane failed after its data moved).
    LapBroken(String),
}

/// What the caller gets back of a collective taken out ([`Exec::take`]).
pub struct Taken {
    /// What it moved.
    pub traffic: Traffic,
    /// How long after its call each member of the group held the result, by rank in the group,
    /// as its token said (ours too); `None` where no token came (its lap did not finish). All
    /// participants get the same figures: the lap carries each member's own to every other.
    pub ready: Vec<Option<Duration>>,
    /// What its buffer held where it changed: put back if it failed.
    backup: Backup,
    buf: RawBuf,
}

impl Taken {
    /// Puts back what the collective changed in its buffer.
    pub fn restore(&self) {
        // SAFETY: the buffer is still lent to us: its caller waits for this collective's end.
        self.backup.restore(unsafe { self.buf.slice() });
    }

    /// The backup, to lend to a later collective.
    pub fn into_backup(self) -> Backup {
        self.backup
    }
}

/// What moved over the link with one member, for stats and logs.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LinkStats {
    /// Lanes to it.
    pub lanes_out: usize,
    /// Lanes from it.
    pub lanes_in: usize,
    /// Chunk bytes sent to it, frame headers not counted.
    pub tx_bytes: u64,
    /// Chunk bytes received from it, frame headers not counted.
    pub rx_bytes: u64,
    /// What carries its lanes (`Lane::kind`), `"mixed"` if they differ.
    pub transport: &'static str,
    /// How long the link was saturated: some lane to it held a frame that its stream had no
    /// room for (from the write that found it full until the frame's last byte went in). A link
    /// that holds a schedule back is saturated, and then moves bytes as fast as it can.
    pub saturated: Duration,
    /// Bytes written to it (frame headers included) while it was saturated: over
    /// [`LinkStats::saturated`], what the link carries (`docs/topology.md`, "Drift").
    pub saturated_bytes: u64,
    /// Lanes to it whose frame waits for room.
    blocked_lanes: usize,
    /// Since when one has, and the bytes written to it since.
    backlog: Option<(Instant, u64)>,
}

impl LinkStats {
    /// A lane to the member found its stream full with a frame to write.
    fn blocked(&mut self, now: Instant) {
        if self.blocked_lanes == 0 {
            self.backlog = Some((now, 0));
        }
        self.blocked_lanes += 1;
    }

    /// `n` bytes written to the member.
    fn wrote(&mut self, n: usize) {
        if let Some((_, bytes)) = &mut self.backlog {
            *bytes += n as u64;
        }
    }

    /// A blocked lane's frame went in whole.
    fn unblocked(&mut self, now: Instant) {
        self.blocked_lanes -= 1;
        if self.blocked_lanes == 0 {
            let (since, bytes) = self.backlog.take().expect("a stretch under way");
            self.saturated += now.saturating_duration_since(since);
            self.saturated_bytes += bytes;
        }
    }

    /// A lane carried by `kind` ([`Lane::kind`]) joined the link.
    fn carried_by(&mut self, kind: &'static str) {
        self.transport = match self.transport {
            "" => kind,
            same if same == kind => same,
            _ => "mixed",
        };
    }
}

/// A lane to a member, and the frame it is writing.
struct SendLane<L> {
    lane: L,
    /// The member it leads to.
    to: usize,
    out: Option<Outgoing>,
    /// Bytes of the frame (header, then body) written.
    written: usize,
    /// Its frame waits for room in the stream ([`LinkStats::saturated`]).
    blocked: bool,
}

/// A lane from a member, and the frame it is reading.
struct RecvLane<L> {
    lane: L,
    /// The member it comes from.
    from: usize,
    /// The member closed it between frames: nothing more comes on it.
    closed: bool,
    header: [u8; FRAME_BYTES],
    header_got: usize,
    receiving: Option<Incoming>,
    scratch: Vec<u64>,
}

impl<L> RecvLane<L> {
    /// Since when it holds a chunk for a collective not posted here ([`Incoming::held`]).
    fn held(&self) -> Option<Instant> {
        self.receiving.as_ref().and_then(Incoming::held)
    }
}

/// The engine over one topology's links: the [`Machine`] and its lanes.
pub struct Exec<L> {
    machine: Machine,
    send: Vec<SendLane<L>>,
    recv: Vec<RecvLane<L>>,
    /// By member, during a pump: the machine had no frame for it, so its other free lanes do not
    /// ask again (what a later write makes ready goes out at the next pump, which that write's
    /// progress brings).
    dry: Vec<bool>,
}

/// What one [`Exec::pump`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pumped {
    /// Some bytes moved: pump again.
    Progress,
    /// Nothing can move until the lanes are ready.
    Idle,
}

/// The links a collective lacks ([`Exec::missing`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Missing {
    /// Members it sends to with no lanes to them: dial them.
    pub to: Vec<usize>,
    /// Members it receives from with no lanes from them: take their pools when they arrive.
    pub from: Vec<usize>,
}

impl Missing {
    /// Whether no link is missing.
    pub fn is_empty(&self) -> bool {
        self.to.is_empty() && self.from.is_empty()
    }
}

impl<L: Lane> Exec<L> {
    /// The engine of topology `epoch`, where we are `rank` of `world`, with no links yet.
    pub fn new(epoch: Epoch, rank: usize, world: usize) -> Self {
        Exec { machine: Machine::new(epoch, rank, world), send: Vec::new(), recv: Vec::new(), dry: vec![false; world] }
    }

    /// Adds a pool of lanes to member `to`.
    pub fn add_send(&mut self, to: usize, lanes: Vec<L>) {
        let kinds: Vec<_> = lanes.iter().map(|l| (l.kind(), l.partner_pid())).collect();
        self.machine.handle_lanes(to, true, &kinds);
        let new = lanes.into_iter().map(|lane| SendLane { lane, to, out: None, written: 0, blocked: false });
        self.send.extend(new);
    }

    /// The TCP sockets of our lanes to member `to`, TLS or not (none for shared-memory lanes).
    pub fn tcp_lanes_to(&self, to: usize) -> Vec<std::os::fd::RawFd> {
        let tcp = self.send.iter().filter(|s| s.to == to && matches!(s.lane.kind(), "tcp" | "tls"));
        tcp.filter_map(|s| s.lane.pollable()).collect()
    }

    /// Adds a pool of lanes from member `from`.
    pub fn add_recv(&mut self, from: usize, lanes: Vec<L>) {
        let kinds: Vec<_> = lanes.iter().map(|l| (l.kind(), l.partner_pid())).collect();
        self.machine.handle_lanes(from, false, &kinds);
        let new = lanes.into_iter().map(|lane| RecvLane {
            lane,
            from,
            closed: false,
            header: [0; FRAME_BYTES],
            header_got: 0,
            receiving: None,
            scratch: Vec::new(),
        });
        self.recv.extend(new);
    }

    /// The topology this engine runs in.
    pub fn epoch(&self) -> Epoch {
        self.machine.epoch()
    }

    /// Collectives and transfers posted and not taken.
    pub fn in_flight(&self) -> usize {
        self.machine.in_flight()
    }

    /// What moved over each link, by member.
    pub fn stats(&self) -> &BTreeMap<usize, LinkStats> {
        self.machine.stats()
    }

    /// Whether a collective in flight lacks a link: cheap, unlike [`Exec::missing`].
    pub fn awaiting(&self) -> bool {
        self.machine.awaiting()
    }

    /// The links the collectives in flight need and that are not here.
    pub fn missing(&self) -> Missing {
        self.machine.missing()
    }

    /// Starts collective `spec` ([`Machine::post`]).
    pub fn post(&mut self, spec: OpSpec) {
        self.machine.post(spec);
    }

    /// Starts tagged transfer `id` ([`Machine::post_transfer`]).
    pub fn post_transfer(&mut self, id: u64, spec: TransferSpec) {
        self.machine.post_transfer(id, spec);
    }

    /// Takes transfer `id` out ([`Machine::take_transfer`]).
    pub fn take_transfer(&mut self, id: u64) -> Option<Traffic> {
        self.machine.take_transfer(id)
    }

    /// The member at the other end of transfer `id`, once known: a receive from any member's is
    /// the member whose offer it took ([`Machine::transfer_peer`]).
    pub fn transfer_peer(&self, id: u64) -> Option<usize> {
        self.machine.transfer_peer(id)
    }

    /// Transfer `id`'s number and other end, and whether its outcome rests on the other end's
    /// word ([`Machine::transfer_outcome`]).
    pub fn transfer_outcome(&self, id: u64) -> (Option<(u64, usize)>, bool) {
        self.machine.transfer_outcome(id)
    }

    /// Whether transfer `id` still waits for the other end's call
    /// ([`Machine::transfer_unmatched`]).
    pub fn transfer_unmatched(&self, id: u64) -> Option<u64> {
        self.machine.transfer_unmatched(id)
    }

    /// Whether the transfer member `rank` waits on with us can only complete by a call of ours
    /// not made yet ([`Machine::transfer_stuck`]).
    pub fn transfer_stuck(&self, rank: usize, send: bool, tag: u64, seen: u64) -> bool {
        self.machine.transfer_stuck(rank, send, tag, seen)
    }

    /// How transfers ended since the last call.
    pub fn transfer_events(&mut self) -> Vec<(u64, Result<(), LinkError>)> {
        self.machine.poll_transfer_events()
    }

    /// Fails every collective in flight: the link to `rank` cannot be had.
    pub fn unreachable(&mut self, rank: usize, reason: String) {
        self.machine.handle_broken(LinkError::Lost { rank, reason });
    }

    /// Takes collective `key` out ([`Machine::take`]).
    pub fn take(&mut self, key: OpKey) -> Option<Taken> {
        self.machine.take(key)
    }

    /// The members collective `key` still moves data with (none once its data moved).
    pub fn waits_on(&self, key: OpKey) -> Vec<usize> {
        self.machine.waits_on(key)
    }

    /// What happened to collectives since the last call.
    pub fn events(&mut self) -> Vec<(OpKey, OpEvent)> {
        self.machine.poll_events()
    }

    /// Saves ahead the next range a collective will change ([`Machine::save_ahead`]).
    pub fn save_ahead(&mut self) -> bool {
        self.machine.save_ahead()
    }

    /// The lanes to poll: (lane, wants to read, wants to write).
    pub fn interest(&self) -> impl Iterator<Item = (&L, bool, bool)> {
        self.waits().into_iter().map(|(recv, i, read, write)| {
            let lane = if recv { &self.recv[i].lane } else { &self.send[i].lane };
            (lane, read, write)
        })
    }

    /// Readies every lane the driver is about to poll for something ([`Lane::arm`]); false if
    /// one can move now or failed (the next pump finds out): then the driver must not sleep. A
    /// lane held back (no interest) is not asked: bytes it holds ready wait for the engine.
    pub fn arm(&mut self) -> bool {
        self.waits().into_iter().filter(|&(_, _, read, write)| read || write).all(|(recv, i, _, _)| {
            let lane = if recv { &mut self.recv[i].lane } else { &mut self.send[i].lane };
            lane.arm().unwrap_or(false)
        })
    }

    /// The lanes waited on: (a receiving lane?, its index, wants to read, wants to write).
    fn waits(&self) -> Vec<(bool, usize, bool, bool)> {
        if self.machine.broken() {
            return Vec::new();
        }
        let reading = self.machine.reading();
        let mut wanted: BTreeMap<usize, bool> = BTreeMap::new();
        let recv = self.recv.iter().enumerate().filter(|(_, l)| !l.closed);
        // A lane holding a chunk until its collective is posted is not read meanwhile.
        let recv = recv.map(|(i, l)| (true, i, (reading || l.receiving.is_some()) && l.held().is_none(), false));
        let send: Vec<_> = self
            .send
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let wants = l.out.is_some() || *wanted.entry(l.to).or_insert_with(|| self.machine.has_frame_for(l.to));
                (false, i, false, wants)
            })
            .collect();
        recv.chain(send).collect()
    }

    /// When a chunk held in its lane for a collective not posted here is read aside, if any
    /// is: the driver's wait ends by then.
    pub fn held_until(&self) -> Option<Instant> {
        let since = self.recv.iter().filter_map(|l| l.held()).min()?;
        since.checked_add(self.machine.early_grace)
    }

    /// Moves every byte that can move `now`, without blocking. Time is an argument: whoever
    /// drives it (the peer's driver, the simulator) says what time it is.
    pub fn pump(&mut self, now: Instant) -> Pumped {
        if self.machine.broken() {
            return Pumped::Idle;
        }
        let mut progress = false;
        for i in 0..self.recv.len() {
            match self.pump_recv(i, now) {
                Ok(p) => progress |= p,
                Err(LinksFailed) => return Pumped::Progress,
            }
        }
        self.dry.fill(false);
        for i in 0..self.send.len() {
            match self.pump_send(i, now) {
                Ok(p) => progress |= p,
                Err(reason) => {
                    let rank = self.send[i].to;
                    self.machine.handle_broken(LinkError::Lost { rank, reason });
                    return Pumped::Progress;
                }
            }
        }
        self.machine.advance();
        for pull in self.machine.poll_pulls() {
            progress = true;
            // SAFETY: a posted receive's buffer is lent to the engine until it is taken.
            let whole = unsafe { pull.buf.slice() };
            let read = shoal_transport::shm::read_process(pull.pid, pull.addr, &mut whole[pull.piece.clone()]);
            self.machine.handle_pulled(&pull, read);
        }
        if progress {
            Pumped::Progress
        } else {
            Pumped::Idle
        }
    }

    /// Closes the lanes once they failed. The driver calls it once every collective over them
    /// has its verdict: the first failure must reach the master before the closed streams make
    /// the others report theirs (a mismatch, not the "connection closed" that follows it).
    pub fn release_if_broken(&mut self) {
        if self.machine.broken() {
            self.send.clear();
            self.recv.clear();
            self.machine.handle_released();
        }
    }

    /// Reads what lane `i` has into the machine.
    fn pump_recv(&mut self, i: usize, now: Instant) -> Result<bool, LinksFailed> {
        let mut progress = false;
        let RecvLane { lane, from, closed, header, header_got, receiving, scratch } = &mut self.recv[i];
        let (machine, from) = (&mut self.machine, *from);
        if *closed {
            return Ok(false);
        }
        let lost = |machine: &mut Machine, reason: String| {
            machine.handle_broken(LinkError::Lost { rank: from, reason });
            LinksFailed
        };
        loop {
            let Some(mut rx) = receiving.take() else {
                if !machine.reading() {
                    return Ok(progress);
                }
                let n = match read_some(lane, &mut header[*header_got..]) {
                    Ok(None) => return Ok(progress),
                    Ok(Some(0)) if *header_got > 0 => {
                        return Err(lost(machine, "connection closed mid-frame".into()));
                    }
                    Ok(Some(0)) => {
                        *closed = true;
                        return machine.handle_closed(from).map(|()| true);
                    }
                    Ok(Some(n)) => n,
                    Err(e) => return Err(lost(machine, e.to_string())),
                };
                progress = true;
                *header_got += n;
                if *header_got == FRAME_BYTES {
                    *header_got = 0;
                    *receiving = machine.handle_header(from, header, now)?;
                }
                continue;
            };
            if rx.held().is_some() {
                match machine.handle_held(from, rx, now)? {
                    Held::Waiting(rx) => {
                        *receiving = Some(rx);
                        return Ok(progress);
                    }
                    Held::Placed(next) => {
                        *receiving = next;
                        progress = true;
                    }
                    Held::Aside(rx) => *receiving = Some(rx),
                }
                continue;
            }
            if rx.reduced_from_aside() {
                // A lane that can lend the chunk where it lies (shared memory) is reduced from
                // there: one copy fewer than reading it into the scratch buffer first.
                let (len, elem) = (rx.len(), machine.elem_of(rx.key()));
                let failed = |machine: &mut Machine, e: std::io::Error| {
                    let closed = e.kind() == ErrorKind::UnexpectedEof;
                    lost(machine, if closed { "connection closed mid-frame".into() } else { e.to_string() })
                };
                match lane.peek(len) {
                    // The chunk lies where the stream put it: reduced there if aligned for its
                    // dtype (frames of other sizes before it may shift it), else read aside.
                    Ok(Some(src)) if src.as_ptr().align_offset(elem) == 0 => {
                        machine.handle_body(from, &mut rx, len);
                        machine.handle_chunk(from, rx, src)?;
                        lane.consume(len).map_err(|e| failed(machine, e))?;
                        progress = true;
                        continue;
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => {
                        *receiving = Some(rx);
                        return Ok(progress);
                    }
                    Err(e) if e.kind() == ErrorKind::Unsupported => {}
                    Err(e) => return Err(failed(machine, e)),
                }
            }
            let target = machine.body_target(&mut rx, scratch);
            let n = if target.is_empty() {
                0
            } else {
                match read_some(lane, target) {
                    Ok(None) => {
                        *receiving = Some(rx);
                        return Ok(progress);
                    }
                    Ok(Some(0)) => return Err(lost(machine, "connection closed".into())),
                    Ok(Some(n)) => n,
                    Err(e) => return Err(lost(machine, e.to_string())),
                }
            };
            progress = true;
            machine.handle_body(from, &mut rx, n);
            if rx.complete() {
                let aside: &[u8] = bytemuck::cast_slice(scratch.as_slice());
                machine.handle_chunk(from, rx, aside)?;
            } else {
                *receiving = Some(rx);
            }
        }
    }

    /// Writes what lane `i` may send; `Err(why)` if the lane failed.
    fn pump_send(&mut self, i: usize, now: Instant) -> Result<bool, String> {
        let mut progress = false;
        let SendLane { lane, to, out, written, blocked } = &mut self.send[i];
        let (machine, to) = (&mut self.machine, *to);
        loop {
            if out.is_none() && !self.dry[to] {
                *out = machine.poll_frame(to, now);
                *written = 0;
                self.dry[to] = out.is_none();
            }
            let Some(frame) = out.as_ref() else { return Ok(progress) };
            let payload = machine.payload(frame);
            let (header_left, body_done) =
                if *written < FRAME_BYTES { (&frame.header[*written..], 0) } else { (&[][..], *written - FRAME_BYTES) };
            let body_left = &payload[body_done..];
            let result = if header_left.is_empty() {
                lane.write(body_left)
            } else {
                lane.write_vectored(&[IoSlice::new(header_left), IoSlice::new(body_left)])
            };
            let n = match result {
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if !*blocked {
                        *blocked = true;
                        machine.handle_blocked(to, now);
                    }
                    return Ok(progress);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.to_string()),
            };
            progress = true;
            let (body, total) = (n.saturating_sub(header_left.len()), FRAME_BYTES + payload.len());
            *written += n;
            machine.handle_written(to, frame, n, body);
            if *written == total {
                if *blocked {
                    *blocked = false;
                    machine.handle_unblocked(to, now);
                }
                machine.handle_sent(to, out.take().expect("a frame"));
            }
        }
    }

    /// Where each lane stands, for a failure's log.
    pub fn describe(&self) -> String {
        let send = self.send.iter().map(|l| format!("to {}: {}", l.to, l.lane.describe()));
        let lanes: Vec<String> =
            send.chain(self.recv.iter().map(|l| format!("from {}: {}", l.from, l.lane.describe()))).collect();
        format!("{} over {lanes:?}", self.machine.describe())
    }
}

/// Reads what `lane` has into `buf` (not empty): `None` if nothing yet, `Some(0)` at the end of
/// the stream.
fn read_some(lane: &mut impl Lane, buf: &mut [u8]) -> std::io::Result<Option<usize>> {
    loop {
        return match lane.read(buf) {
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(None),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => Err(e),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_wire::FrameKind;

    /// The time a test pumps at: the engine reads no clock, but an `Instant` comes only from one.
    #[allow(clippy::disallowed_methods)]
    fn now() -> Instant {
        Instant::now()
    }
    use shoal_transport::lane::mem::{self, Control, Faults, MemLane};

    /// Links rank `from` to rank `to` with a pool of `pool` in-memory connections shaped by
    /// `faults`.
    fn link(execs: &mut [Exec<MemLane>], from: usize, to: usize, pool: usize, faults: Faults) -> Vec<Control> {
        let (mut send, mut recv, mut controls) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..pool {
            let (tx, rx, control) = mem::pair(&format!("{from}->{to}#{i}"), faults);
            send.push(tx);
            recv.push(rx);
            controls.push(control);
        }
        execs[from].add_send(to, send);
        execs[to].add_recv(from, recv);
        controls
    }

    fn engines(world: usize) -> Vec<Exec<MemLane>> {
        (0..world).map(|r| Exec::new(Epoch(1), r, world)).collect()
    }

    /// `world` engines whose link from rank r to r + 1 is a pool of `pool` connections.
    fn ring(world: usize, pool: usize, faults: Faults) -> (Vec<Exec<MemLane>>, Vec<Vec<Control>>) {
        let mut execs = engines(world);
        let controls = (0..world).map(|r| link(&mut execs, r, (r + 1) % world, pool, faults)).collect();
        (execs, controls)
    }

    /// `world` engines linked each to every other.
    fn mesh(world: usize, pool: usize, faults: Faults) -> Vec<Exec<MemLane>> {
        let mut execs = engines(world);
        for from in 0..world {
            for to in (0..world).filter(|&t| t != from) {
                link(&mut execs, from, to, pool, faults);
            }
        }
        execs
    }

    /// A u64 sum over `buf`: collective `seq` with `tag`, run by `algorithm`.
    fn sum_spec(buf: &mut [u64], seq: u64, tag: u64, algorithm: Algorithm, chunk_bytes: usize) -> OpSpec {
        OpSpec {
            header: header_of(seq, buf.len(), tag, algorithm),
            members: Vec::new(),
            kind: CollectiveKind::AllReduce,
            root: 0,
            hosts: Vec::new(),
            buf: RawBuf::new(bytemuck::cast_slice_mut(buf)),
            dtype: DType::U64,
            op: ReduceOp::Sum,
            algorithm,
            chunk_bytes,
            codec: None,
            backup: Backup::default(),
            called: now(),
        }
    }

    /// A float32 average over `buf` (two elements a word) whose chunks travel by `codec`.
    fn quantized_spec(
        buf: &mut [u64],
        seq: u64,
        tag: u64,
        algorithm: Algorithm,
        chunk_bytes: usize,
        codec: Codec,
    ) -> OpSpec {
        let mut spec = sum_spec(buf, seq, tag, algorithm, chunk_bytes);
        (spec.dtype, spec.op, spec.codec) = (DType::F32, ReduceOp::Avg, Some(codec));
        let h = &mut spec.header;
        (h.dtype, h.op, h.count) = (DType::F32.code(), ReduceOp::Avg.code(), 2 * h.count);
        (h.quantization, h.block) = shoal_collective::Quantization::to_wire(Some(codec.quantization()));
        spec
    }

    /// Rank `rank`'s input to quantized collective `seq`: float32 values in [-5, 5), two a word.
    fn float_input(rank: usize, seq: u64, words: usize) -> Vec<u64> {
        let mut x = (rank as u64 + 1) * 0x9e37_79b9 + seq * 7919;
        let mut value = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            u64::from(((x >> 40) as f32 / (1 << 24) as f32 * 10.0 - 5.0).to_bits())
        };
        (0..words).map(|_| value() | value() << 32).collect()
    }

    fn header_of(seq: u64, count: usize, tag: u64, algorithm: Algorithm) -> OpHeader {
        OpHeader {
            collective: CollectiveKind::AllReduce.code(),
            algorithm: algorithm.code(),
            epoch: Epoch(1),
            derived: 0,
            seq,
            tag,
            dtype: DType::U64.code(),
            op: ReduceOp::Sum.code(),
            count: count as u64,
            root: 0,
            quantization: 0,
            block: 0,
        }
    }

    /// The key of collective `seq` of the topology's whole group.
    fn key(seq: u64) -> OpKey {
        OpKey { derived: 0, seq }
    }

    /// Rank `rank`'s input to collective `seq`.
    fn input(rank: usize, seq: u64, words: usize) -> Vec<u64> {
        (0..words).map(|k| (rank * 1_000_003 + k * 7) as u64 + seq * 11).collect()
    }

    /// A collective of one rank: its buffer and how it ended.
    struct Run {
        buf: Vec<u64>,
        ended: Option<Result<(), String>>,
        taken: Option<Taken>,
    }

    /// Posts collectives `seqs[r]` of `sizes` words on every rank `r` at round `posted_at[r][i]`,
    /// steps every engine in turn in one thread, `between(round)` first, until every collective
    /// is confirmed or failed; returns each rank's runs. Ring all-reduces.
    fn run_all(
        execs: &mut [Exec<MemLane>],
        sizes: &[usize],
        tags: &[Vec<u64>],
        posted_at: &[Vec<usize>],
        chunk_bytes: usize,
        between: impl FnMut(usize),
    ) -> Vec<Vec<Run>> {
        let algorithms = vec![vec![Algorithm::Ring; sizes.len()]; execs.len()];
        run_mixed(execs, sizes, tags, &algorithms, posted_at, chunk_bytes, between)
    }

    /// [`run_all`] with the algorithm of each collective on each rank.
    fn run_mixed(
        execs: &mut [Exec<MemLane>],
        sizes: &[usize],
        tags: &[Vec<u64>],
        algorithms: &[Vec<Algorithm>],
        posted_at: &[Vec<usize>],
        chunk_bytes: usize,
        between: impl FnMut(usize),
    ) -> Vec<Vec<Run>> {
        run_shaped(execs, sizes, tags, algorithms, posted_at, (chunk_bytes, None), between)
    }

    /// [`run_mixed`], quantized float32 averages of [`float_input`] where `codec` is given.
    fn run_shaped(
        execs: &mut [Exec<MemLane>],
        sizes: &[usize],
        tags: &[Vec<u64>],
        algorithms: &[Vec<Algorithm>],
        posted_at: &[Vec<usize>],
        (chunk_bytes, codec): (usize, Option<Codec>),
        mut between: impl FnMut(usize),
    ) -> Vec<Vec<Run>> {
        let world = execs.len();
        let input = if codec.is_some() { float_input } else { input };
        let mut runs: Vec<Vec<Run>> = (0..world)
            .map(|r| {
                (0..sizes.len()).map(|i| Run { buf: input(r, i as u64, sizes[i]), ended: None, taken: None }).collect()
            })
            .collect();
        for round in 0..1_000_000 {
            between(round);
            let mut moved = false;
            for (rank, exec) in execs.iter_mut().enumerate() {
                for (i, run) in runs[rank].iter_mut().enumerate() {
                    if posted_at[rank][i] == round {
                        let (seq, tag, algorithm) = (i as u64, tags[rank][i], algorithms[rank][i]);
                        let mut spec = match codec {
                            Some(c) => quantized_spec(&mut run.buf, seq, tag, algorithm, chunk_bytes, c),
                            None => sum_spec(&mut run.buf, seq, tag, algorithm, chunk_bytes),
                        };
                        if matches!(spec.algorithm, Algorithm::Hierarchical | Algorithm::TwoLevel) {
                            // Two hosts (or sites), ranks alternating between them.
                            spec.hosts = (0..world).map(|r| r % 2).collect();
                        }
                        exec.post(spec);
                        moved = true;
                    }
                }
                moved |= exec.pump(now()) == Pumped::Progress;
                // As the driver does while it waits.
                while exec.save_ahead() {}
                for (seq, event) in exec.events() {
                    let run = &mut runs[rank][seq.seq as usize];
                    let ended = match event {
                        OpEvent::DataDone => continue,
                        OpEvent::Confirmed => Ok(()),
                        OpEvent::Failed(e) => Err(format!("{e:?}")),
                        OpEvent::LapBroken(why) => Err(format!("lap: {why}")),
                    };
                    run.ended = Some(ended);
                    run.taken = exec.take(seq);
                    moved = true;
                }
                exec.release_if_broken();
            }
            if runs.iter().flatten().all(|r| r.ended.is_some()) {
                return runs;
            }
            if !moved && round >= 10_000 {
                let states: Vec<String> = execs.iter().map(|e| e.describe()).collect();
                panic!("stuck at round {round}: {states:#?}");
            }
        }
        panic!("the ring never finished");
    }

    fn sum(world: usize, seq: u64, words: usize) -> Vec<u64> {
        (0..words).map(|k| (0..world).map(|r| input(r, seq, words)[k]).fold(0u64, u64::wrapping_add)).collect()
    }

    /// Several collectives of different sizes in flight at once, posted at different moments on
    /// each peer (frames arrive before their collective is posted), over lanes that fragment
    /// every read and write and hold little: every peer ends with every sum, for every pool and
    /// ring size.
    /// Collectives of derived groups run beside the whole group's over the same links, each
    /// over its members alone and numbered on its own (every group has a collective 0 and 1),
    /// posted in a different order on every member: each member ends with its group's sum.
    #[test]
    fn derived_groups_run_beside_the_whole_group_over_the_same_links() {
        let world = 4;
        let mut execs = mesh(world, 2, Faults::default());
        let groups: [(u64, Vec<usize>, Algorithm); 4] = [
            (0, Vec::new(), Algorithm::Ring),
            (0xa, vec![3, 1], Algorithm::Ring),
            (0xb, vec![0, 2], Algorithm::OneShot),
            (0xc, vec![2, 0, 3], Algorithm::Ring),
        ];
        let members = |g: usize| if g == 0 { (0..world).collect() } else { groups[g].1.clone() };
        let words = 301;
        let name = |g: usize, seq: u64| g as u64 * 10 + seq;
        // Each rank's collectives: (group, number), its buffer.
        type Ops = Vec<((usize, u64), Vec<u64>)>;
        let mut runs: Vec<Ops> = (0..world)
            .map(|r| {
                let mine = (0..groups.len()).filter(|&g| members(g).contains(&r));
                let mut ops: Vec<(usize, u64)> = mine.flat_map(|g| [(g, 0), (g, 1)]).collect();
                if r % 2 == 1 {
                    // Groups in another order (each group's collectives in order).
                    ops.sort_by_key(|&(g, seq)| (std::cmp::Reverse(g), seq));
                }
                ops.into_iter().map(|(g, seq)| ((g, seq), input(r, name(g, seq), words))).collect()
            })
            .collect();
        for (r, exec) in execs.iter_mut().enumerate() {
            for ((g, seq), buf) in &mut runs[r] {
                let mut spec = sum_spec(buf, *seq, 1, groups[*g].2, 256);
                (spec.header.derived, spec.members) = (groups[*g].0, groups[*g].1.clone());
                exec.post(spec);
            }
        }
        let mut confirmed = vec![0; world];
        for _ in 0..100_000 {
            for (r, exec) in execs.iter_mut().enumerate() {
                exec.pump(now());
                for (key, event) in exec.events() {
                    match event {
                        OpEvent::DataDone => {}
                        OpEvent::Confirmed => {
                            confirmed[r] += 1;
                            exec.take(key).expect("posted");
                        }
                        other => panic!("rank {r}, {key:?}: {other:?}"),
                    }
                }
            }
            if (0..world).all(|r| confirmed[r] == runs[r].len()) {
                break;
            }
        }
        for (r, ops) in runs.iter().enumerate() {
            assert_eq!(confirmed[r], ops.len(), "rank {r}");
            for ((g, seq), buf) in ops {
                let want: Vec<u64> =
                    (0..words).map(|k| members(*g).iter().map(|&m| input(m, name(*g, *seq), words)[k]).sum()).collect();
                assert_eq!(*buf, want, "rank {r}, group {g}, collective {seq}");
            }
        }
    }

    /// A frame of a derived group from a member of the topology outside it fails the links,
    /// named; the collective's buffer is put back.
    #[test]
    fn a_frame_of_a_derived_group_from_outside_it_is_refused() {
        let mut execs = mesh(3, 1, Faults::default());
        let mut ours = input(1, 0, 64);
        let mut theirs = input(0, 0, 64);
        let mut spec = sum_spec(&mut ours, 0, 1, Algorithm::Ring, 256);
        (spec.header.derived, spec.members) = (0xa, vec![2, 1]);
        execs[1].post(spec);
        // Rank 0 believes itself in the group, with rank 1.
        let mut spec = sum_spec(&mut theirs, 0, 1, Algorithm::Ring, 256);
        (spec.header.derived, spec.members) = (0xa, vec![0, 1]);
        execs[0].post(spec);
        let mut events = Vec::new();
        for _ in 0..20 {
            execs[0].pump(now());
            execs[1].pump(now());
            events.extend(execs[1].events());
        }
        let outsider = Malformed::Outsider { derived: 0xa };
        let key = OpKey { derived: 0xa, seq: 0 };
        assert!(
            matches!(&events[..], [(k, OpEvent::Failed(LinkError::Malformed { rank: 0, what }))] if *k == key && *what == outsider),
            "{events:?}"
        );
        execs[1].take(key).expect("posted").restore();
        assert_eq!(ours, input(1, 0, 64), "restored");
    }

    #[test]
    fn concurrent_collectives_hold_their_sums_over_fragmented_backpressured_lanes() {
        for (world, pool, max_io, chunk) in [(2, 1, 7, 4096), (3, 2, 13, 4096), (4, 3, 4096, 16 << 10)] {
            let sizes = [100, 1500, 1, 5000, 0];
            let faults = Faults { capacity: 3 * max_io, max_io, reset_after: None };
            let (mut execs, _) = ring(world, pool, faults);
            let tags: Vec<Vec<u64>> = (0..world).map(|_| vec![1, 2, 3, 4, 5]).collect();
            // Rank r posts collective i at round 40 * r * i: the later ranks are the slow callers.
            let posted_at: Vec<Vec<usize>> = (0..world).map(|r| (0..5).map(|i| 40 * r * i).collect()).collect();
            let runs = run_all(&mut execs, &sizes, &tags, &posted_at, chunk, |_| {});
            for (rank, runs) in runs.iter().enumerate() {
                for (i, run) in runs.iter().enumerate() {
                    assert_eq!(run.ended, Some(Ok(())), "world {world}, rank {rank}, collective {i}");
                    assert_eq!(run.buf, sum(world, i as u64, sizes[i]), "world {world}, rank {rank}, collective {i}");
                }
            }
        }
    }

    /// A chunk of a collective not posted here yet waits in its lane, costing no copy, as long
    /// as the grace allows; past it the chunk is read aside, so that a collective posted here
    /// whose chunks follow it on the lane moves. Rank 0 posts collectives 0 and 1 at once; rank
    /// 1 posts 1 only once 0 is done there (a caller that waits for each), so chunks of 1 come
    /// first on the single lane. With an endless grace the lane stays held and 0 never ends;
    /// with none, every sum holds.
    #[test]
    fn an_early_chunk_waits_in_its_lane_for_the_grace_then_is_read_aside() {
        for grace in [Duration::MAX, Duration::ZERO] {
            let (mut execs, _) = ring(2, 1, Faults { capacity: 1 << 20, max_io: 1 << 20, reset_after: None });
            for exec in &mut execs {
                exec.machine.early_grace = grace;
            }
            let sizes = [20_000, 20_000];
            let mut bufs: Vec<Vec<Vec<u64>>> =
                (0..2).map(|r| (0..2).map(|i| input(r, i as u64, sizes[i])).collect()).collect();
            let [first, second] = bufs[0].get_disjoint_mut([0, 1]).unwrap();
            execs[0].post(sum_spec(first, 0, 1, Algorithm::Ring, 4096));
            execs[0].post(sum_spec(second, 1, 2, Algorithm::Ring, 4096));
            execs[1].post(sum_spec(&mut bufs[1][0], 0, 1, Algorithm::Ring, 4096));
            let (mut confirmed, mut held, mut early_bytes) = (vec![0; 2], false, 0);
            for _ in 0..20_000 {
                if confirmed == [2, 2] {
                    break;
                }
                for (rank, exec) in execs.iter_mut().enumerate() {
                    exec.pump(now());
                    held |= exec.recv.iter().any(|l| l.held().is_some());
                    early_bytes = early_bytes.max(exec.machine.early_bytes());
                    for (seq, event) in exec.events() {
                        if matches!(event, OpEvent::Confirmed) {
                            confirmed[rank] += 1;
                            exec.take(seq);
                            if (rank, seq) == (1, key(0)) {
                                exec.post(sum_spec(&mut bufs[1][1], 1, 2, Algorithm::Ring, 4096));
                            }
                        }
                    }
                }
            }
            if grace == Duration::MAX {
                assert!(held, "a chunk of collective 1 waited in the lane");
                assert_eq!(early_bytes, 0, "nothing was read aside");
                assert_eq!(confirmed, [0, 0], "collective 0's chunks stay behind the held one");
                continue;
            }
            assert!(early_bytes > 0, "collective 1's chunks were read aside");
            assert_eq!(confirmed, [2, 2]);
            for bufs in &bufs {
                assert_eq!(bufs[0], sum(2, 0, sizes[0]));
                assert_eq!(bufs[1], sum(2, 1, sizes[1]));
            }
        }
    }

    /// A link stalled for a while (a slow or frozen path) delays the collectives, nothing more.
    #[test]
    fn a_stalled_link_delays_the_results_without_changing_them() {
        let (mut execs, controls) = ring(3, 1, Faults { capacity: 256, max_io: 64, reset_after: None });
        let link = controls[1][0].clone();
        let tags = vec![vec![1, 2]; 3];
        let runs = run_all(&mut execs, &[500, 70], &tags, &vec![vec![0, 0]; 3], 512, |round| {
            link.stall((3..400).contains(&round));
        });
        for runs in &runs {
            assert_eq!(runs[0].buf, sum(3, 0, 500));
            assert_eq!(runs[1].buf, sum(3, 1, 70));
        }
    }

    /// Only the link that holds the schedule back counts as saturated: its writes found the
    /// lanes full while frames waited. The link back, wide and never stalled, never is; and a
    /// saturated stretch ends with its frames, so nothing stays open once the work is done.
    #[test]
    fn only_the_link_that_holds_a_collective_back_is_saturated() {
        let mut execs = engines(2);
        let narrow = link(&mut execs, 0, 1, 2, Faults { capacity: 512, max_io: 256, reset_after: None });
        link(&mut execs, 1, 0, 2, Faults { capacity: 1 << 20, max_io: 1 << 20, reset_after: None });
        let runs = run_all(&mut execs, &[6000, 3000], &vec![vec![1, 2]; 2], &vec![vec![0, 0]; 2], 4096, |round| {
            for lane in &narrow {
                lane.stall(round % 4 != 0);
            }
        });
        assert_eq!(runs[0][0].buf, sum(2, 0, 6000));
        let (slow, wide) = (execs[0].stats()[&1], execs[1].stats()[&0]);
        assert!(slow.saturated > Duration::ZERO, "{slow:?}");
        assert!(
            slow.saturated_bytes > 0 && slow.saturated_bytes <= slow.tx_bytes + 64 * FRAME_BYTES as u64,
            "{slow:?}"
        );
        assert_eq!((wide.saturated, wide.saturated_bytes), (Duration::ZERO, 0), "{wide:?}");
        assert!(slow.backlog.is_none() && slow.blocked_lanes == 0, "the stretch ended with the frames: {slow:?}");
    }

    /// A connection that resets mid-flight (a peer killed, a path cut) fails every collective in
    /// flight on both its ends; each failed peer's backup puts its buffers back as they were.
    #[test]
    fn a_reset_link_fails_every_collective_in_flight_and_every_buffer_restores() {
        let faults = Faults { capacity: 1024, max_io: 512, reset_after: None };
        let (mut execs, controls) = ring(3, 1, faults);
        let link = controls[1][0].clone();
        let sizes = [2000, 3000];
        let tags = vec![vec![1, 2]; 3];
        let runs = run_all(&mut execs, &sizes, &tags, &vec![vec![0, 0]; 3], 1024, |_| {
            if link.carried() > 6000 {
                link.reset();
            }
        });
        for (rank, runs) in runs.iter().enumerate() {
            for (i, run) in runs.iter().enumerate() {
                if rank != 0 {
                    assert!(run.ended.as_ref().is_some_and(Result::is_err), "rank {rank}: {:?}", run.ended);
                }
                if run.ended.as_ref().is_some_and(Result::is_err) {
                    let mut buf = run.buf.clone();
                    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
                    let taken = run.taken.as_ref().expect("taken");
                    taken.backup.restore(bytes);
                    assert_eq!(buf, input(rank, i as u64, sizes[i]), "rank {rank}'s buffer {i} is not restored");
                }
            }
        }
    }

    /// A predecessor that runs another collective (here: another tag) is caught at its first
    /// frame.
    #[test]
    fn a_predecessor_running_another_collective_is_a_mismatch() {
        let (mut execs, _) = ring(2, 1, Faults::default());
        let runs = run_all(&mut execs, &[64], &[vec![1], vec![2]], &[vec![0], vec![0]], 4096, |_| {});
        let mismatched = runs
            .iter()
            .flatten()
            .filter(|r| r.ended.as_ref().is_some_and(|e| e.as_ref().is_err_and(|e| e.contains("Mismatch"))));
        assert!(mismatched.count() > 0);
    }

    /// Free lanes take the collectives in flight in turn: a small collective posted behind a
    /// large one over a single lane is done long before it.
    #[test]
    fn a_small_collective_is_not_starved_by_a_large_one() {
        let (mut execs, _) = ring(2, 1, Faults { capacity: 8192, max_io: 8192, reset_after: None });
        let tags = vec![vec![1, 2]; 2];
        let mut finished: Vec<(usize, u64)> = Vec::new();
        let sizes = [1 << 20, 16];
        let mut runs: Vec<Vec<Vec<u64>>> = (0..2).map(|r| vec![input(r, 0, sizes[0]), input(r, 1, sizes[1])]).collect();
        for (rank, exec) in execs.iter_mut().enumerate() {
            for (i, buf) in runs[rank].iter_mut().enumerate() {
                exec.post(sum_spec(buf, i as u64, tags[rank][i], Algorithm::Ring, 64 << 10));
            }
        }
        for round in 0..100_000 {
            for exec in &mut execs {
                exec.pump(now());
                for (seq, event) in exec.events() {
                    if matches!(event, OpEvent::Confirmed) {
                        finished.push((round, seq.seq));
                        exec.take(seq);
                    }
                }
            }
            if finished.len() == 4 {
                break;
            }
        }
        let small = finished.iter().filter(|(_, s)| *s == 1).map(|(r, _)| *r).max().unwrap();
        let large = finished.iter().filter(|(_, s)| *s == 0).map(|(r, _)| *r).min().unwrap();
        assert!(small * 10 < large, "small done at round {small}, large at {large}");
        assert_eq!(runs[0][1], sum(2, 1, 16));
    }

    /// What member 0's collective 0 (an all-reduce of 64 words, rank 1 of 2) ends with when
    /// `bytes` arrive on its lane from member 0 instead of its frames.
    fn fed(bytes: &[u8]) -> Vec<(OpKey, OpEvent)> {
        let (tx, rx, _) = mem::pair("0->1", Faults::default());
        let (tx2, _rx2, _) = mem::pair("1->0", Faults::default());
        let mut exec = Exec::new(Epoch(1), 1, 2);
        exec.add_send(0, vec![tx2]);
        exec.add_recv(0, vec![rx]);
        let mut stranger = tx;
        std::io::Write::write_all(&mut stranger, bytes).unwrap();
        let mut buf = vec![0u64; 64];
        exec.post(sum_spec(&mut buf, 0, 1, Algorithm::Ring, 4096));
        for _ in 0..10 {
            exec.pump(now());
        }
        exec.events()
    }

    /// A frame that is not one (a stranger's bytes, a desynchronised stream) fails the pool.
    #[test]
    fn garbage_on_a_lane_fails_every_collective_in_flight() {
        let events = fed(&[0xab; FRAME_BYTES]);
        let bad_magic = Malformed::Header(DataFrameError::BadMagic { got: 0xabab_abab });
        assert!(
            matches!(&events[..], [(k, OpEvent::Failed(LinkError::Malformed { rank: 0, what }))] if *what == bad_magic && *k == key(0)),
            "{events:?}"
        );
    }

    /// Carries every frame machine `from` has for machine `to` by hand, each body in two pieces;
    /// whether any moved.
    fn carry(machines: &mut [Machine], from: usize, to: usize, scratch: &mut Vec<u64>) -> bool {
        let mut carried = false;
        while let Some(out) = machines[from].poll_frame(to, now()) {
            let (header, body) = (out.header, machines[from].payload(&out).to_vec());
            machines[from].handle_written(to, &out, FRAME_BYTES + body.len(), body.len());
            machines[from].handle_sent(to, out);
            carried = true;
            let m = &mut machines[to];
            let Some(mut rx) = m.handle_header(from, &header, now()).expect("well formed") else { continue };
            let half = body.len() / 2;
            for piece in [&body[..half], &body[half..]] {
                m.body_target(&mut rx, scratch)[..piece.len()].copy_from_slice(piece);
                m.handle_body(from, &mut rx, piece.len());
            }
            assert!(rx.complete());
            m.handle_chunk(from, rx, bytemuck::cast_slice(scratch.as_slice())).expect("applied");
        }
        carried
    }

    /// Every confirmation token carries how long after its call its origin held the result, and
    /// the lap takes each member's figure to every other: all members end with the same figures,
    /// from which the late member shows (it called last, so held the result soonest after its
    /// call). Ring (tokens forwarded) and one-shot (tokens straight to each).
    #[test]
    fn the_lap_tells_every_member_how_long_after_its_call_each_held_the_result() {
        let world = 3;
        for algorithm in [Algorithm::Ring, Algorithm::OneShot] {
            let mut machines: Vec<Machine> = (0..world).map(|r| Machine::new(Epoch(1), r, world)).collect();
            for (r, m) in machines.iter_mut().enumerate() {
                for other in (0..world).filter(|&o| o != r) {
                    m.handle_lanes(other, true, &[("mem", None)]);
                    m.handle_lanes(other, false, &[("mem", None)]);
                }
            }
            let mut bufs: Vec<Vec<u64>> = (0..world).map(|r| input(r, 0, 300)).collect();
            // Rank 0 called 400 ms before the last, rank 1 200 ms.
            let early = [400, 200, 0].map(|ms| now() - Duration::from_millis(ms));
            for (r, m) in machines.iter_mut().enumerate() {
                m.post(OpSpec { called: early[r], ..sum_spec(&mut bufs[r], 0, 1, algorithm, 256) });
            }
            let mut scratch = Vec::new();
            let mut confirmed = 0;
            while confirmed < world {
                let mut carried = false;
                for from in 0..world {
                    for to in (0..world).filter(|&t| t != from) {
                        carried |= carry(&mut machines, from, to, &mut scratch);
                    }
                }
                for m in &mut machines {
                    m.advance();
                    confirmed += m.poll_events().iter().filter(|(_, e)| matches!(e, OpEvent::Confirmed)).count();
                }
                assert!(carried || confirmed == world, "{algorithm:?}: stalled");
            }
            let ready: Vec<Vec<Option<Duration>>> =
                machines.iter_mut().map(|m| m.take(key(0)).unwrap().ready).collect();
            assert!(
                ready.iter().all(|r| *r == ready[0]),
                "{algorithm:?}: every member has the same figures: {ready:?}"
            );
            let r: Vec<Duration> = ready[0].iter().map(|d| d.expect("every member's figure")).collect();
            assert!(r[0] >= Duration::from_millis(400) && r[1] >= Duration::from_millis(200), "{algorithm:?}: {r:?}");
            assert!(r[2] < Duration::from_millis(150) && r[1] < r[0], "{algorithm:?}: {r:?}");
        }
    }

    /// The machine alone, no lane anywhere: each frame it asks to send is carried by hand to the
    /// other member's machine, as a simulator would. Three members all-reduce with ring and
    /// one-shot schedules and every machine confirms every sum. Then a frame of another topology
    /// reaches one mid-collective: its links fail, named by what was wrong, and its buffer, half
    /// reduced, restores.
    #[test]
    fn machines_alone_agree_over_frames_carried_by_hand() {
        let world = 3;
        let mut machines: Vec<Machine> = (0..world).map(|r| Machine::new(Epoch(1), r, world)).collect();
        for (r, m) in machines.iter_mut().enumerate() {
            for other in (0..world).filter(|&o| o != r) {
                m.handle_lanes(other, true, &[("mem", None)]);
                m.handle_lanes(other, false, &[("mem", None)]);
            }
        }
        let sizes = [700, 5, 700];
        let algorithms = [Algorithm::Ring, Algorithm::OneShot, Algorithm::Ring];
        let mut bufs: Vec<Vec<Vec<u64>>> =
            (0..world).map(|r| (0..3).map(|i| input(r, i as u64, sizes[i])).collect()).collect();
        for (r, m) in machines.iter_mut().enumerate() {
            for (i, buf) in bufs[r].iter_mut().enumerate().take(2) {
                m.post(sum_spec(buf, i as u64, 1, algorithms[i], 256));
            }
        }
        let (mut confirmed, mut scratch) = (vec![0; world], Vec::new());
        for _ in 0..1000 {
            let mut carried = false;
            for from in 0..world {
                for to in (0..world).filter(|&t| t != from) {
                    carried |= carry(&mut machines, from, to, &mut scratch);
                }
            }
            for (r, m) in machines.iter_mut().enumerate() {
                m.advance();
                for (seq, event) in m.poll_events() {
                    assert!(matches!(event, OpEvent::DataDone | OpEvent::Confirmed), "rank {r} {seq:?}: {event:?}");
                    confirmed[r] += usize::from(matches!(event, OpEvent::Confirmed));
                }
            }
            if !carried {
                break;
            }
        }
        assert_eq!(confirmed, vec![2; world]);
        for (r, bufs) in bufs.iter().enumerate() {
            for (i, buf) in bufs.iter().enumerate().take(2) {
                assert_eq!(*buf, sum(world, i as u64, sizes[i]), "rank {r}, collective {i}");
            }
        }
        for (r, m) in machines.iter_mut().enumerate() {
            m.post(sum_spec(&mut bufs[r][2], 2, 1, Algorithm::Ring, 256));
        }
        assert!(carry(&mut machines, 0, 1, &mut scratch), "rank 1 reduced a chunk of rank 0's");
        machines[1].advance();
        assert_ne!(bufs[1][2], input(1, 2, sizes[2]), "half reduced");
        let foreign = Frame { kind: FrameKind::Token, len: 0, unit: 0, op: header_of(2, 700, 1, Algorithm::Ring) };
        let foreign = Frame { op: OpHeader { epoch: Epoch(9), ..foreign.op }, ..foreign };
        assert_eq!(machines[1].handle_header(0, &foreign.encode(), now()).err(), Some(LinksFailed));
        let events = machines[1].poll_events();
        let what = Malformed::ForeignTopology { got: 9, ours: 1 };
        assert!(
            matches!(&events[..], [(k, OpEvent::Failed(LinkError::Malformed { rank: 0, what: w }))] if *w == what && *k == key(2)),
            "{events:?}"
        );
        machines[1].take(key(2)).expect("posted").restore();
        assert_eq!(bufs[1][2], input(1, 2, sizes[2]), "restored");
    }

    /// Well-formed headers out of step with what runs here fail the pool too, each named by what
    /// was wrong with it (the peer's `ProtocolError` carries it).
    #[test]
    fn a_frame_out_of_step_is_named_by_what_is_wrong() {
        let ours = header_of(0, 64, 1, Algorithm::Ring);
        let frame = |kind, unit, op| Frame { kind, len: 0, unit, op };
        let token = Frame { len: TOKEN_BYTES as u32, ..frame(FrameKind::Token, 7, ours) };
        let cases = [
            (
                frame(FrameKind::Chunk, 0, OpHeader { epoch: Epoch(9), ..ours }),
                Malformed::ForeignTopology { got: 9, ours: 1 },
            ),
            (frame(FrameKind::Chunk, 99, ours), Malformed::NoSuchChunk { place: 99, expected: 2 }),
            (token, Malformed::BadToken { origin: 7, world: 2 }),
            (frame(FrameKind::Token, 1, ours), Malformed::TokenLength { len: 0 }),
            (frame(FrameKind::Accept, 0, OpHeader { seq: 5, ..ours }), Malformed::UnknownAnswer { n: 5 }),
            (frame(FrameKind::Part, 0, OpHeader { seq: 2, ..ours }), Malformed::PartNotAccepted { n: 2 }),
        ];
        for (sent, want) in cases {
            let mut bytes = sent.encode().to_vec();
            bytes.resize(FRAME_BYTES + sent.len as usize, 0);
            let events = fed(&bytes);
            assert!(
                matches!(&events[..], [(k, OpEvent::Failed(LinkError::Malformed { rank: 0, what }))] if *what == want && *k == key(0)),
                "{sent:?}: {events:?}"
            );
        }
    }

    /// One-shot and ring collectives in flight together over every link, posted at different
    /// moments, over lanes that fragment every read and write: every peer ends with every sum,
    /// bit for bit.
    #[test]
    fn one_shot_and_ring_collectives_share_the_links() {
        for (world, pool, max_io) in [(2, 1, 7), (3, 2, 13), (5, 1, 4096)] {
            let sizes = [100, 1500, 1, 0, 700];
            let faults = Faults { capacity: 3 * max_io, max_io, reset_after: None };
            let mut execs = mesh(world, pool, faults);
            let tags: Vec<Vec<u64>> = (0..world).map(|_| vec![1, 2, 3, 4, 5]).collect();
            let kinds = [Algorithm::OneShot, Algorithm::Ring, Algorithm::OneShot, Algorithm::OneShot, Algorithm::Ring];
            let algorithms = vec![kinds.to_vec(); world];
            let posted_at: Vec<Vec<usize>> = (0..world).map(|r| (0..5).map(|i| 30 * r * i).collect()).collect();
            let runs = run_mixed(&mut execs, &sizes, &tags, &algorithms, &posted_at, 4096, |_| {});
            for (rank, runs) in runs.iter().enumerate() {
                for (i, run) in runs.iter().enumerate() {
                    assert_eq!(run.ended, Some(Ok(())), "world {world}, rank {rank}, collective {i}");
                    assert_eq!(run.buf, sum(world, i as u64, sizes[i]), "world {world}, rank {rank}, collective {i}");
                }
            }
            // Each one-shot sent its buffer to every other member: the links' counts show it.
            let stats = execs[0].stats();
            assert_eq!(stats.len(), world - 1, "a link to every other member");
            if world > 2 {
                // Collectives 0, 2 and 3 (of 100, 1 and 0 words) ran one-shot.
                let oneshot_bytes = 8 * (100 + 1) as u64;
                assert_eq!(stats[&2].tx_bytes, oneshot_bytes, "only one-shots use a link off the ring");
            }
        }
    }

    /// Engines linked only around the ring: a one-shot collective asks for links to the other
    /// members ([`Exec::missing`]), waits for them (the driver dials them and takes the pools
    /// that arrive), then completes over them, and a later one reuses them.
    #[test]
    fn links_off_the_ring_are_opened_when_a_schedule_needs_them_and_reused() {
        let world = 4;
        let (mut execs, _) = ring(world, 1, Faults::default());
        let mut bufs: Vec<Vec<Vec<u64>>> = (0..world).map(|r| vec![input(r, 0, 64), input(r, 1, 64)]).collect();
        let post = |exec: &mut Exec<MemLane>, buf: &mut Vec<u64>, seq: u64| {
            exec.post(sum_spec(buf, seq, 1 + seq, Algorithm::OneShot, 4096));
        };
        for (rank, exec) in execs.iter_mut().enumerate() {
            assert!(!exec.awaiting());
            post(exec, &mut bufs[rank][0], 0);
            assert!(exec.awaiting());
            // Rank r sends only to r + 1 and receives only from r - 1 around the ring.
            let others = |skip: usize| (0..world).filter(|&o| o != rank && o != skip).collect();
            let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
            assert_eq!(exec.missing(), Missing { to: others(next), from: others(prev) });
        }
        for _ in 0..100 {
            for exec in &mut execs {
                exec.pump(now());
            }
        }
        assert!(
            execs.iter_mut().all(|e| e.events().iter().all(|(_, ev)| matches!(ev, OpEvent::DataDone))),
            "no link, no result"
        );
        // The driver's part: dial what is missing, take what arrives.
        for from in 0..world {
            for to in execs[from].missing().to {
                link(&mut execs, from, to, 2, Faults::default());
            }
        }
        assert!(execs.iter().all(|e| !e.awaiting() && e.missing().is_empty()));
        let mut confirmed = 0;
        for round in 0..10_000 {
            if round == 50 {
                for (rank, exec) in execs.iter_mut().enumerate() {
                    post(exec, &mut bufs[rank][1], 1);
                    assert!(!exec.awaiting(), "the second collective reuses the links");
                }
            }
            for exec in &mut execs {
                exec.pump(now());
                for (seq, event) in exec.events() {
                    assert!(!matches!(event, OpEvent::Failed(_) | OpEvent::LapBroken(_)), "{event:?}");
                    if matches!(event, OpEvent::Confirmed) {
                        confirmed += 1;
                        exec.take(seq);
                    }
                }
            }
            if confirmed == 2 * world {
                break;
            }
        }
        assert_eq!(confirmed, 2 * world);
        for buf in &bufs {
            assert_eq!(buf[0], sum(world, 0, 64));
            assert_eq!(buf[1], sum(world, 1, 64));
        }
        assert_eq!(execs[0].stats()[&2].lanes_out, 2, "the link opened on demand");
    }

    /// A member that leaves right after its collective confirmed (its process exits) closes its
    /// streams: the others, still waiting for another member's token, confirm all the same; a
    /// later collective that needs the member fails at once, naming it.
    #[test]
    fn a_member_leaving_after_its_collective_fails_only_what_needs_it() {
        let world = 3;
        let mut linked = engines(world);
        let mut slow = Vec::new();
        for from in 0..world {
            for to in (0..world).filter(|&t| t != from) {
                let controls = link(&mut linked, from, to, 1, Faults::default());
                if (from, to) == (2, 0) {
                    slow = controls;
                }
            }
        }
        // Rank 2's token to rank 0 (the frame after its data) arrives only once rank 1 left.
        let got_data_of_2 = |exec: &Exec<MemLane>| exec.machine.received_all_from(key(0), 2);
        let mut execs: Vec<Option<Exec<MemLane>>> = linked.into_iter().map(Some).collect();
        let mut bufs: Vec<Vec<u64>> = (0..world).map(|r| input(r, 0, 32)).collect();
        let spec = |buf: &mut Vec<u64>, seq: u64| sum_spec(buf, seq, 1 + seq, Algorithm::OneShot, 4096);
        for (exec, buf) in execs.iter_mut().zip(&mut bufs) {
            exec.as_mut().unwrap().post(spec(buf, 0));
        }
        let mut confirmed = [false; 3];
        for _ in 0..1000 {
            for rank in [1, 0, 2] {
                let Some(exec) = execs[rank].as_mut() else { continue };
                exec.pump(now());
                let hold = execs[1].is_some() && execs[0].as_ref().is_some_and(got_data_of_2);
                slow[0].stall(hold);
                let Some(exec) = execs[rank].as_mut() else { continue };
                for (seq, event) in exec.events() {
                    assert!(!matches!(event, OpEvent::Failed(_) | OpEvent::LapBroken(_)), "rank {rank}: {event:?}");
                    if matches!(event, OpEvent::Confirmed) {
                        confirmed[rank] = true;
                        exec.take(seq);
                    }
                }
                if rank == 1 && confirmed[1] && execs[1].is_some() {
                    assert!(!confirmed[0], "rank 0 still waits for rank 2's token");
                    execs[1] = None;
                }
            }
            if confirmed.iter().all(|&c| c) {
                break;
            }
        }
        assert_eq!(confirmed, [true; 3]);
        assert_eq!(bufs[0], sum(world, 0, 32));
        assert_eq!(bufs[2], sum(world, 0, 32));
        let mut next = input(0, 1, 32);
        let exec = execs[0].as_mut().unwrap();
        for _ in 0..10 {
            exec.pump(now());
        }
        exec.post(spec(&mut next, 1));
        let events = exec.events();
        assert!(
            matches!(&events[..], [(k, OpEvent::Failed(LinkError::Lost { rank: 1, .. }))] if *k == key(1)),
            "{events:?}"
        );
        assert_eq!(exec.stats()[&1].lanes_in, 0);
    }

    /// Members that chose different algorithms (different settings) find out at the first
    /// frame: a mismatch naming the algorithm, never misread chunks.
    #[test]
    fn members_running_different_algorithms_is_a_mismatch() {
        let mut execs = mesh(2, 1, Faults::default());
        let algorithms = vec![vec![Algorithm::Ring], vec![Algorithm::OneShot]];
        let runs = run_mixed(&mut execs, &[64], &[vec![1], vec![1]], &algorithms, &[vec![0], vec![0]], 4096, |_| {});
        assert!(runs.iter().flatten().all(|r| r.ended.as_ref().is_some_and(Result::is_err)));
        let mismatch = |r: &&Run| r.ended.as_ref().is_some_and(|e| e.as_ref().is_err_and(|e| e.contains("Mismatch")));
        assert!(runs.iter().flatten().any(|r| mismatch(&r)), "{:?}", runs[0][0].ended);
    }

    /// One-shot and two-shot collectives that fail, before or after folding (the engine saving
    /// ahead meanwhile), put the whole buffer back.
    #[test]
    fn a_failed_one_shot_or_two_shot_restores_its_buffer() {
        let cases = [Algorithm::OneShot, Algorithm::TwoShot].into_iter().flat_map(|a| [(a, 800), (a, 2456), (a, 3000)]);
        for (algorithm, reset_at) in cases {
            let faults = Faults { capacity: 1024, max_io: 512, reset_after: None };
            let mut execs = engines(3);
            let c01 = link(&mut execs, 0, 1, 1, faults);
            for (from, to) in [(0, 2), (1, 0), (1, 2), (2, 0), (2, 1)] {
                link(&mut execs, from, to, 1, faults);
            }
            let algorithms = vec![vec![algorithm]; 3];
            // Rank 0's first frames to rank 1 get through, and then the link resets.
            let runs = run_mixed(&mut execs, &[300], &vec![vec![1]; 3], &algorithms, &vec![vec![0]; 3], 4096, |_| {
                if c01[0].carried() >= reset_at {
                    c01[0].reset();
                }
            });
            assert_failed_and_restored(&runs, |rank| input(rank, 0, 300), algorithm);
        }
    }

    /// Someone's only collective failed, and every failed one's backup restores `input(rank)`.
    fn assert_failed_and_restored(runs: &[Vec<Run>], input: impl Fn(usize) -> Vec<u64>, algorithm: Algorithm) {
        for (rank, run) in runs.iter().map(|r| &r[0]).enumerate() {
            if run.ended.as_ref().is_some_and(Result::is_err) {
                let mut buf = run.buf.clone();
                run.taken.as_ref().expect("taken").backup.restore(bytemuck::cast_slice_mut(&mut buf));
                assert_eq!(buf, input(rank), "{algorithm:?}: rank {rank}'s buffer is not restored");
            }
        }
        assert!(runs.iter().any(|r| r[0].ended.as_ref().is_some_and(Result::is_err)), "the reset failed someone");
    }

    /// Two-shot collectives (each block to its owner, folded, then to everyone) in flight with
    /// ring ones over fragmenting lanes: every peer ends with every sum.
    #[test]
    fn two_shot_collectives_hold_their_sums() {
        beside_a_ring_every_sum_holds(Algorithm::TwoShot, [(2, 7), (3, 13), (4, 4096)], 4096);
    }

    #[test]
    fn hierarchical_collectives_hold_their_sums_beside_the_ring() {
        beside_a_ring_every_sum_holds(Algorithm::Hierarchical, [(2, 7), (3, 13), (5, 4096)], 64);
    }

    /// Four collectives by `algorithm` and one around the ring, for each (world, largest IO of
    /// the lanes), posted at different times over a mesh of fragmenting lanes: every peer ends
    /// with every sum.
    fn beside_a_ring_every_sum_holds(algorithm: Algorithm, cases: [(usize, usize); 3], chunk_bytes: usize) {
        for (world, max_io) in cases {
            let sizes = [100, 1, 0, 777, 50];
            let faults = Faults { capacity: 3 * max_io, max_io, reset_after: None };
            let mut execs = mesh(world, 2, faults);
            let kinds = [algorithm, algorithm, algorithm, algorithm, Algorithm::Ring];
            let posted_at: Vec<Vec<usize>> = (0..world).map(|r| (0..5).map(|i| 20 * r * i).collect()).collect();
            let tags = vec![vec![1, 2, 3, 4, 5]; world];
            let runs =
                run_mixed(&mut execs, &sizes, &tags, &vec![kinds.to_vec(); world], &posted_at, chunk_bytes, |_| {});
            for (rank, runs) in runs.iter().enumerate() {
                for (i, run) in runs.iter().enumerate() {
                    assert_eq!(run.ended, Some(Ok(())), "world {world}, rank {rank}, collective {i}");
                    assert_eq!(run.buf, sum(world, i as u64, sizes[i]), "world {world}, rank {rank}, collective {i}");
                }
            }
        }
    }

    /// Quantized all-reduces by every algorithm, several in flight over fragmenting lanes: every
    /// peer ends with the same bytes, near the exact average, having sent each chunk encoded.
    #[test]
    fn quantized_collectives_end_bit_identical_by_every_algorithm() {
        // Largest error seen over these inputs, times about three.
        for (name, bound) in [("fp16", 0.01), ("bf16", 0.075), ("int8", 0.1), ("int4", 1.75)] {
            let block = name.starts_with("int").then_some(64);
            let q = shoal_collective::Quantization::parse(name, block).unwrap();
            let codec = q.codec(DType::F32, Some(ReduceOp::Avg)).unwrap().unwrap();
            for (algorithm, world) in Algorithm::ALL.into_iter().flat_map(|a| [(a, 2), (a, 3), (a, 4)]) {
                let sites: Vec<usize> = (0..world).map(|r| r % 2).collect();
                if algorithm == Algorithm::TwoLevel && !shoal_collective::twolevel::quantizes(world, &sites) {
                    // One site of two and one of one: chosen only unquantized.
                    continue;
                }
                let sizes = [1000, 1, 3000];
                let faults = Faults { capacity: 3 * 1000, max_io: 1000, reset_after: None };
                let mut execs = mesh(world, 2, faults);
                let posted_at: Vec<Vec<usize>> = (0..world).map(|r| vec![0, 5 * r, 10 * r]).collect();
                let (tags, algorithms) = (vec![vec![1, 2, 3]; world], vec![vec![algorithm; 3]; world]);
                let runs = run_shaped(&mut execs, &sizes, &tags, &algorithms, &posted_at, (2048, Some(codec)), |_| {});
                let case = format!("{name}, {algorithm:?}, world {world}");
                for (i, &words) in sizes.iter().enumerate() {
                    let inputs: Vec<Vec<u64>> = (0..world).map(|r| float_input(r, i as u64, words)).collect();
                    let floats = |w: &[u64]| -> Vec<f32> { bytemuck::cast_slice(w).to_vec() };
                    let exact: Vec<f64> = (0..2 * words)
                        .map(|k| inputs.iter().map(|w| f64::from(floats(w)[k])).sum::<f64>() / world as f64)
                        .collect();
                    for (rank, run) in runs.iter().map(|r| &r[i]).enumerate() {
                        assert_eq!(run.ended, Some(Ok(())), "{case}: rank {rank}, collective {i}");
                        assert_eq!(run.buf, runs[0][i].buf, "{case}: rank {rank} differs from rank 0, collective {i}");
                        let worst = floats(&run.buf)
                            .iter()
                            .zip(&exact)
                            .map(|(a, b)| (f64::from(*a) - b).abs())
                            .fold(0.0, f64::max);
                        assert!(worst <= bound, "{case}: rank {rank}, collective {i}: error {worst}");
                        // Every chunk went out encoded: the bytes sent are the encoded sizes.
                        let elems = (2048 / 4, 2 * words);
                        let plan =
                            algorithm.schedule(CollectiveKind::AllReduce, (rank, world), &sites, elems.1, 0, elems.0);
                        let encoded: usize = plan.sends.iter().map(|u| codec.encoded_len(u.range.len())).sum();
                        let sent = run.taken.as_ref().expect("taken").traffic.tx_bytes;
                        assert_eq!(sent, encoded as u64, "{case}: rank {rank}, collective {i}");
                    }
                }
            }
        }
    }

    /// A quantized collective cut by a reset restores the buffer as it was, although it
    /// replaced what it sent by its decoded values.
    #[test]
    fn a_failed_quantized_collective_restores_its_buffer() {
        let codec = shoal_collective::Quantization::parse("int8", None).unwrap().codec(DType::F32, None).unwrap();
        for algorithm in Algorithm::ALL {
            let faults = Faults { capacity: 1024, max_io: 512, reset_after: None };
            let mut execs = engines(3);
            let cut = link(&mut execs, 2, 0, 1, faults);
            for (from, to) in [(0, 1), (0, 2), (1, 0), (1, 2), (2, 1)] {
                link(&mut execs, from, to, 1, faults);
            }
            let algorithms = vec![vec![algorithm]; 3];
            let runs = run_shaped(
                &mut execs,
                &[3000],
                &vec![vec![1]; 3],
                &algorithms,
                &vec![vec![0]; 3],
                (4096, codec),
                |_| {
                    if cut[0].carried() >= 3000 {
                        cut[0].reset();
                    }
                },
            );
            assert_failed_and_restored(&runs, |rank| float_input(rank, 0, 3000), algorithm);
        }
    }

    /// A transfer of rank `peer`'s.
    fn transfer(direction: Direction, peer: usize, tag: u64, buf: &mut [u64]) -> TransferSpec {
        let buf = RawBuf::new(bytemuck::cast_slice_mut(buf));
        TransferSpec { direction, peer: End::Member(peer), tag, dtype: DType::U64, buf, chunk_bytes: 1000 }
    }

    /// A receive from any other member of three.
    fn recv_any(tag: u64, buf: &mut [u64]) -> TransferSpec {
        TransferSpec { peer: End::AnyOf(vec![1, 2]), ..transfer(Direction::Recv, 0, tag, buf) }
    }

    /// Pumps every engine until `done` holds of the transfers' ends, by (rank, id); takes each
    /// ended transfer out.
    fn pump_transfers(
        execs: &mut [Exec<MemLane>],
        ended: &mut BTreeMap<(usize, u64), Result<(), String>>,
        done: impl Fn(&BTreeMap<(usize, u64), Result<(), String>>) -> bool,
    ) {
        for _ in 0..100_000 {
            for (rank, exec) in execs.iter_mut().enumerate() {
                exec.pump(now());
                for (id, result) in exec.transfer_events() {
                    exec.take_transfer(id).expect("in flight");
                    ended.insert((rank, id), result.map_err(|e| format!("{e:?}")));
                }
            }
            if done(ended) {
                return;
            }
        }
        let states: Vec<String> = execs.iter().map(|e| e.describe()).collect();
        panic!("transfers stuck: {ended:?}, {states:#?}");
    }

    #[test]
    fn tagged_transfers_match_by_tag_in_any_order_beside_a_collective() {
        let faults = Faults { capacity: 1500, max_io: 300, reset_after: None };
        let mut execs = mesh(2, 3, faults);
        // Sizes: empty, under one part, several parts with a short last one; tag 9 twice.
        let sizes = [0usize, 17, 1000, 333, 250];
        let tags = [1u64, 2, 9, 9, 3];
        let mut sent: Vec<Vec<u64>> = sizes.iter().enumerate().map(|(i, &n)| input(0, i as u64, n)).collect();
        let mut got: Vec<Vec<u64>> = sizes.iter().map(|&n| vec![0; n]).collect();
        let mut reduce = [input(0, 7, 3000), input(1, 7, 3000)];
        for (rank, buf) in reduce.iter_mut().enumerate() {
            execs[rank].post(sum_spec(buf, 0, 99, Algorithm::Ring, 1024));
        }
        for (i, buf) in sent.iter_mut().enumerate() {
            execs[0].post_transfer(i as u64, transfer(Direction::Send, 1, tags[i], buf));
        }
        let mut ended = BTreeMap::new();
        // Every offer arrives before any receive is posted: none moves data yet.
        pump_transfers(&mut execs, &mut ended, |_| true);
        for _ in 0..200 {
            execs.iter_mut().for_each(|e| _ = e.pump(now()));
        }
        assert!(execs[0].transfer_events().is_empty(), "a send ended before its receive was posted");
        // Receives in another order; the first receive for tag 9 gets the first send with it.
        for i in [4usize, 2, 0, 3, 1] {
            execs[1].post_transfer(10 + i as u64, transfer(Direction::Recv, 0, tags[i], &mut got[i]));
        }
        pump_transfers(&mut execs, &mut ended, |e| e.len() == 2 * sizes.len());
        assert!(ended.values().all(Result::is_ok), "{ended:?}");
        assert_eq!(got, sent);
        // The collective ran alongside over the same lanes.
        let mut confirmed = 0;
        for _ in 0..10_000 {
            for exec in execs.iter_mut() {
                exec.pump(now());
                confirmed += exec.events().iter().filter(|(_, e)| matches!(e, OpEvent::Confirmed)).count();
            }
        }
        assert_eq!(confirmed, 2);
        assert_eq!(reduce[0], sum(2, 7, 3000));
        assert_eq!(reduce[0], reduce[1]);
    }

    /// Several sends with one tag match the receives with it in the order each side made them,
    /// whichever lane each offer takes and whether the receives come first or last; a send taken
    /// out before its offer left holds none of the later ones up.
    #[test]
    fn sends_with_one_tag_match_its_receives_in_the_order_both_sides_made_them() {
        let faults = Faults { capacity: 700, max_io: 90, reset_after: None };
        let mut execs = mesh(2, 4, faults);
        let mut ended = BTreeMap::new();
        let mut sent: Vec<Vec<u64>> = (0..12).map(|i| input(0, i, 40)).collect();
        let mut got: Vec<Vec<u64>> = vec![vec![0; 40]; 12];
        // Half the receives first, then every send (one given up at once), then the rest.
        for (i, buf) in got.iter_mut().enumerate().take(6) {
            execs[1].post_transfer(100 + i as u64, transfer(Direction::Recv, 0, 4, buf));
        }
        let mut dropped = vec![0u64; 40];
        for (i, buf) in sent.iter_mut().enumerate() {
            execs[0].post_transfer(i as u64, transfer(Direction::Send, 1, 4, buf));
            if i == 3 {
                execs[0].post_transfer(50, transfer(Direction::Send, 1, 4, &mut dropped));
                assert!(execs[0].take_transfer(50).is_some());
            }
        }
        for (i, buf) in got.iter_mut().enumerate().skip(6) {
            execs[1].post_transfer(100 + i as u64, transfer(Direction::Recv, 0, 4, buf));
        }
        pump_transfers(&mut execs, &mut ended, |e| e.len() == 24);
        assert!(ended.values().all(Result::is_ok), "{ended:?}");
        assert_eq!(got, sent, "the n-th receive gets the n-th send");
    }

    /// A receive from any member takes the offer of whichever member sends first, and says whose;
    /// offers arrived before it are taken in the order they came; one from a member it does not
    /// wait on serves a named receive posted earlier first.
    #[test]
    fn a_receive_from_any_member_takes_the_first_send_with_its_tag_and_names_its_sender() {
        let mut execs = mesh(3, 2, Faults::default());
        let mut ended = BTreeMap::new();
        let (mut from1, mut from2) = (input(1, 0, 30), input(2, 0, 30));
        let (mut a, mut b) = (vec![0u64; 30], vec![0u64; 30]);
        execs[0].post_transfer(1, recv_any(5, &mut a));
        assert_eq!((execs[0].transfer_unmatched(1), execs[0].transfer_peer(1)), (Some(u64::MAX), None));
        // It serves any member's send while it waits: neither holds anything up.
        assert!(!execs[0].transfer_stuck(1, true, 5, 0) && !execs[0].transfer_stuck(2, true, 5, 0));
        assert!(execs[0].transfer_stuck(1, true, 6, 0), "another tag");
        execs[2].post_transfer(1, transfer(Direction::Send, 0, 5, &mut from2));
        pump_transfers(&mut execs, &mut ended, |e| e.contains_key(&(0, 1)));
        assert_eq!(ended[&(0, 1)], Ok(()));
        assert_eq!(a, from2);
        // A named receive from rank 1 posted before a receive from any gets rank 1's send.
        execs[0].post_transfer(2, transfer(Direction::Recv, 1, 5, &mut b));
        execs[0].post_transfer(3, recv_any(5, &mut a));
        execs[1].post_transfer(1, transfer(Direction::Send, 0, 5, &mut from1));
        pump_transfers(&mut execs, &mut ended, |e| e.contains_key(&(0, 2)) && e.contains_key(&(1, 1)));
        assert_eq!((b.clone(), execs[0].transfer_unmatched(3)), (from1.clone(), Some(u64::MAX)));
        // Offers waiting before it: the first to arrive.
        let mut again = input(2, 1, 30);
        execs[2].post_transfer(2, transfer(Direction::Send, 0, 5, &mut again));
        pump_transfers(&mut execs, &mut ended, |e| e.contains_key(&(0, 3)));
        assert_eq!(a, again);
        execs[1].post_transfer(2, transfer(Direction::Send, 0, 5, &mut from1));
        pump_transfers(&mut execs, &mut ended, |_| true);
        for _ in 0..200 {
            execs.iter_mut().for_each(|e| _ = e.pump(now()));
        }
        execs[0].post_transfer(4, recv_any(5, &mut a));
        assert_eq!(execs[0].transfer_peer(4), Some(1), "it took the offer waiting from rank 1");
        pump_transfers(&mut execs, &mut ended, |e| e.contains_key(&(0, 4)));
        assert!(ended.values().all(Result::is_ok), "{ended:?}");
        assert_eq!(a, from1);
    }

    /// What a waiting transfer reports of itself, and how its other end judges it: a receive
    /// waits on a send not yet made only once every offer sent to it arrived; a send waits on a
    /// receive until one with its tag is posted, or took its offer already.
    #[test]
    fn a_waiting_transfer_is_stuck_until_the_other_end_posts_its_match() {
        let mut execs = mesh(2, 1, Faults::default());
        let (mut a, mut b, mut c) = (vec![1u64; 4], vec![0u64; 4], vec![0u64; 4]);
        // Rank 1 receives tag 7 from rank 0, which has sent nothing.
        execs[1].post_transfer(1, transfer(Direction::Recv, 0, 7, &mut b));
        assert_eq!(execs[1].transfer_unmatched(1), Some(0));
        assert!(execs[0].transfer_stuck(1, false, 7, 0));
        // Rank 0 sends tag 8: offered, not seen yet by rank 1's report, which is then no proof.
        execs[0].post_transfer(2, transfer(Direction::Send, 1, 8, &mut a));
        let mut ended = BTreeMap::new();
        pump_transfers(&mut execs, &mut ended, |_| true);
        assert!(!execs[0].transfer_stuck(1, false, 7, 0), "an offer the receiver had not seen");
        assert_eq!(execs[1].transfer_unmatched(1), Some(1), "it has seen that offer now");
        assert!(execs[0].transfer_stuck(1, false, 7, 1));
        // Rank 0's send of tag 8 waits on rank 1: stuck until a receive with its tag is posted.
        assert_eq!(execs[0].transfer_unmatched(2), Some(0));
        assert!(execs[1].transfer_stuck(0, true, 8, 0));
        assert!(!execs[1].transfer_stuck(0, true, 7, 0), "a receive of ours with that tag serves it");
        execs[1].post_transfer(3, transfer(Direction::Recv, 0, 8, &mut c));
        assert!(!execs[1].transfer_stuck(0, true, 8, 0));
        pump_transfers(&mut execs, &mut ended, |e| e.len() == 2);
        assert_eq!((execs[0].transfer_unmatched(2), execs[1].transfer_unmatched(3)), (None, None));
        assert_eq!(c, a);
        // The send's wait, announced before its answer came, reaches rank 1 after its receive
        // ended: its offer was taken, so it holds nothing up (the simulator's seed 224 had a
        // member judge it stuck, and end the votes of its group for a transfer that completed).
        assert!(!execs[1].transfer_stuck(0, true, 8, 0), "send #0 was answered");
        execs[0].post_transfer(4, transfer(Direction::Send, 1, 8, &mut a));
        assert_eq!(execs[0].transfer_unmatched(4), Some(1), "a send reports its number");
        assert!(execs[1].transfer_stuck(0, true, 8, 1), "send #1 is not");
        // A rank that is not a member, or ours, never holds anything up.
        assert!(!execs[0].transfer_stuck(0, false, 7, 0) && !execs[0].transfer_stuck(5, false, 7, 0));
    }

    #[test]
    fn a_size_or_dtype_mismatch_fails_both_ends_and_the_link_carries_on() {
        let mut execs = mesh(2, 2, Faults::default());
        let (mut a, mut b) = (vec![5u64; 10], vec![0u64; 12]);
        execs[0].post_transfer(1, transfer(Direction::Send, 1, 4, &mut a));
        execs[1].post_transfer(2, transfer(Direction::Recv, 0, 4, &mut b));
        let mut ended = BTreeMap::new();
        pump_transfers(&mut execs, &mut ended, |e| e.len() == 2);
        for end in [(0, 1), (1, 2)] {
            assert!(ended[&end].as_ref().is_err_and(|e| e.contains("Mismatch")), "{end:?}: {ended:?}");
        }
        assert_eq!(b, vec![0; 12], "a refused transfer moves no data");
        // A dtype mismatch: same bytes, another type.
        let mut c = vec![0u64; 10];
        execs[0].post_transfer(3, transfer(Direction::Send, 1, 5, &mut a));
        let mut wrong = transfer(Direction::Recv, 0, 5, &mut c);
        wrong.dtype = DType::F64;
        execs[1].post_transfer(4, wrong);
        pump_transfers(&mut execs, &mut ended, |e| e.len() == 4);
        assert!(ended[&(0, 3)].is_err() && ended[&(1, 4)].is_err(), "{ended:?}");
        // The lanes hold no half transfer: the next one moves.
        execs[0].post_transfer(5, transfer(Direction::Send, 1, 4, &mut a));
        execs[1].post_transfer(6, transfer(Direction::Recv, 0, 4, &mut c));
        pump_transfers(&mut execs, &mut ended, |e| e.len() == 6);
        assert!(ended[&(0, 5)].is_ok() && ended[&(1, 6)].is_ok(), "{ended:?}");
        assert_eq!(c, a);
    }

    #[test]
    fn a_transfer_with_a_member_that_left_fails_alone() {
        let mut execs = mesh(3, 1, Faults::default());
        // Rank 1 leaves, closing its streams; rank 2 notices.
        execs.remove(1);
        for _ in 0..10 {
            execs.iter_mut().for_each(|e| _ = e.pump(now()));
        }
        let (mut a, mut b, mut c) = (input(2, 0, 100), vec![0u64; 100], vec![0u64; 100]);
        // Ranks 0 and 2 are now engines 0 and 1.
        execs[1].post_transfer(1, transfer(Direction::Send, 0, 3, &mut a));
        execs[1].post_transfer(2, transfer(Direction::Recv, 1, 3, &mut c));
        execs[0].post_transfer(3, transfer(Direction::Recv, 2, 3, &mut b));
        let mut ended = BTreeMap::new();
        pump_transfers(&mut execs, &mut ended, |e| e.len() == 3);
        assert!(ended[&(1, 2)].as_ref().is_err_and(|e| e.contains("rank: 1")), "{ended:?}");
        assert!(ended[&(1, 1)].is_ok() && ended[&(0, 3)].is_ok(), "{ended:?}");
        assert_eq!(b, a);
    }

    #[test]
    fn a_withdrawn_send_is_never_received_and_a_reset_fails_both_ends() {
        let faults = Faults { capacity: 4096, max_io: 512, reset_after: None };
        let mut execs = engines(2);
        let to_1 = link(&mut execs, 0, 1, 1, faults);
        link(&mut execs, 1, 0, 1, faults);
        let (mut a, mut b) = (input(0, 1, 5000), vec![0u64; 5000]);
        execs[0].post_transfer(1, transfer(Direction::Send, 1, 8, &mut a));
        for _ in 0..50 {
            execs.iter_mut().for_each(|e| _ = e.pump(now()));
        }
        // The sender gives up before the receive is posted (its bound passed).
        assert!(execs[0].take_transfer(1).is_some());
        execs[1].post_transfer(2, transfer(Direction::Recv, 0, 8, &mut b));
        let mut ended = BTreeMap::new();
        for _ in 0..200 {
            pump_transfers(&mut execs, &mut ended, |_| true);
        }
        assert!(ended.is_empty(), "the withdrawn offer matched: {ended:?}");
        // A new send matches the waiting receive; the link resets mid-way: both ends fail.
        execs[0].post_transfer(3, transfer(Direction::Send, 1, 8, &mut a));
        for _ in 0..100 {
            execs.iter_mut().for_each(|e| _ = e.pump(now()));
            if to_1[0].carried() > 10_000 {
                to_1[0].reset();
            }
        }
        pump_transfers(&mut execs, &mut ended, |e| e.len() == 2);
        assert!(ended[&(0, 3)].is_err() && ended[&(1, 2)].is_err(), "{ended:?}");
    }

    /// A send whose parts are all written still waits for the receiver to say they arrived: the
    /// receiver's links failing (here a third member's stream reset mid-frame) while the parts
    /// are on their way fail both ends, never the receive alone (a soak's finding: the send
    /// ended as its last part left, the receive failed 0.17 s later). The send that fails there
    /// says its outcome was the receiver's to tell (its driver asks the receiver, `P2pOutcome`).
    #[test]
    fn a_send_ends_once_its_receiver_has_every_part_and_fails_with_it() {
        let faults = Faults { capacity: 1 << 20, max_io: 512, reset_after: None };
        let mut execs = engines(3);
        for (from, to) in [(0, 1), (1, 0), (1, 2), (2, 0), (0, 2)] {
            link(&mut execs, from, to, 1, faults);
        }
        let from_2 = link(&mut execs, 2, 1, 1, faults);
        let (mut a, mut got_a) = (input(0, 1, 5000), vec![0u64; 5000]);
        let (mut c, mut got_c) = (input(2, 1, 5000), vec![0u64; 5000]);
        execs[1].post_transfer(1, transfer(Direction::Recv, 0, 8, &mut got_a));
        execs[1].post_transfer(2, transfer(Direction::Recv, 2, 8, &mut got_c));
        execs[0].post_transfer(3, transfer(Direction::Send, 1, 8, &mut a));
        execs[2].post_transfer(4, transfer(Direction::Send, 1, 8, &mut c));
        // Both offers answered; then the senders write on while the receiver reads nothing.
        let senders = |execs: &mut [Exec<MemLane>], rounds| {
            for _ in 0..rounds {
                execs[0].pump(now());
                execs[2].pump(now());
            }
        };
        senders(&mut execs, 10);
        execs[1].pump(now());
        senders(&mut execs, 2000);
        assert_eq!((execs[0].transfer_unmatched(3), execs[2].transfer_unmatched(4)), (None, None), "both accepted");
        let early = execs[0].transfer_events();
        assert!(early.is_empty(), "the send ended with its parts still on their way: {early:?}");
        // Rank 2's stream to the receiver resets mid-frame: every link of the receiver's fails.
        from_2[0].reset();
        let mut ended = BTreeMap::new();
        pump_transfers(&mut execs, &mut ended, |e| e.len() == 2);
        execs[1].release_if_broken(); // as its driver does: its streams close
        let mut sent = Vec::new();
        while sent.is_empty() {
            execs[0].pump(now());
            sent = execs[0].transfer_events();
        }
        // Failed waiting for the receiver's word: only the receiver knows how it ended there.
        assert!(sent[0].1.is_err(), "{sent:?}");
        assert_eq!(execs[0].transfer_outcome(3), (Some((0, 1)), true), "the send's outcome is the receiver's");
        execs[0].take_transfer(3);
        assert!(ended.values().all(|r| r.is_err()), "both receives fail: {ended:?}");
    }

    /// Two engines whose lanes say the other end runs in process `pid`, as shared-memory lanes
    /// between processes on one host do.
    fn on_one_host(pid: u32, faults: Faults) -> (Vec<Exec<MemLane>>, Control) {
        let mut execs = engines(2);
        let mut to_1 = None;
        for (from, to) in [(0, 1), (1, 0)] {
            let (tx, rx, control) = mem::pair(&format!("{from}->{to}"), faults);
            execs[from].add_send(to, vec![tx.with_partner_pid(pid)]);
            execs[to].add_recv(from, vec![rx.with_partner_pid(pid)]);
            to_1.get_or_insert(control);
        }
        (execs, to_1.expect("linked"))
    }

    /// Pumps both engines until transfers `ids` (rank, id) ended; takes them out with what they
    /// moved.
    fn transfers_end(execs: &mut [Exec<MemLane>], ids: &[(usize, u64)]) -> BTreeMap<(usize, u64), (bool, Traffic)> {
        let mut ended = BTreeMap::new();
        for _ in 0..10_000 {
            for (rank, exec) in execs.iter_mut().enumerate() {
                exec.pump(now());
                for (id, result) in exec.transfer_events() {
                    ended.insert((rank, id), (result.is_ok(), exec.take_transfer(id).expect("in flight")));
                }
            }
            if ids.iter().all(|k| ended.contains_key(k)) {
                return ended;
            }
        }
        panic!("transfers stuck: {ended:?}");
    }

    #[test]
    fn a_large_transfer_on_one_host_is_read_straight_out_of_the_senders_memory() {
        let faults = Faults { capacity: 4096, max_io: 1024, reset_after: None };
        let (mut execs, to_1) = on_one_host(std::process::id(), faults);
        let words = p2p::PULL_MIN_BYTES / 8 * 5 + 3;
        let (mut big, mut small) = (input(0, 1, words), input(0, 2, 100));
        let (mut got_big, mut got_small) = (vec![0u64; words], vec![0u64; 100]);
        execs[0].post_transfer(1, transfer(Direction::Send, 1, 5, &mut big));
        execs[0].post_transfer(2, transfer(Direction::Send, 1, 6, &mut small));
        execs[1].post_transfer(3, transfer(Direction::Recv, 0, 6, &mut got_small));
        execs[1].post_transfer(4, transfer(Direction::Recv, 0, 5, &mut got_big));
        let ended = transfers_end(&mut execs, &[(0, 1), (0, 2), (1, 3), (1, 4)]);
        assert!(ended.values().all(|(ok, _)| *ok), "{ended:?}");
        assert_eq!((got_big, got_small), (big.clone(), small));
        let bytes = (words * 8) as u64;
        for (end, tx, rx) in [((0, 1), bytes, 0), ((1, 4), 0, bytes)] {
            let t = ended[&end].1;
            assert!(t.single_copy && (t.tx_bytes, t.rx_bytes) == (tx, rx), "{end:?}: {t:?}");
        }
        assert!(!ended[&(0, 2)].1.single_copy, "a small one goes in parts");
        assert!(to_1.carried() < 4096, "the large one's bytes never crossed the lanes: {}", to_1.carried());

        // A sender that gives up once the receiver has read its buffer: the receiver drops
        // what it read and takes the next send with that tag.
        let mut into = vec![0u64; words];
        execs[0].post_transfer(5, transfer(Direction::Send, 1, 7, &mut big));
        execs[0].pump(now());
        execs[1].post_transfer(6, transfer(Direction::Recv, 0, 7, &mut into));
        execs[1].pump(now());
        assert_eq!(into, big, "read whole in one pump");
        assert!(execs[0].take_transfer(5).is_some(), "the sender gives up");
        let mut second = input(0, 9, words);
        execs[0].post_transfer(7, transfer(Direction::Send, 1, 7, &mut second));
        let ended = transfers_end(&mut execs, &[(0, 7), (1, 6)]);
        assert!(ended.values().all(|(ok, t)| *ok && t.single_copy), "{ended:?}");
        assert_eq!(into, second);
    }

    #[test]
    fn a_pull_that_finds_no_such_process_falls_back_to_parts() {
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        gone.wait().unwrap();
        let (mut execs, to_1) = on_one_host(gone.id(), Faults::default());
        let words = p2p::PULL_MIN_BYTES / 8 * 2;
        let (mut a, mut b) = (input(0, 3, words), vec![0u64; words]);
        execs[0].post_transfer(1, transfer(Direction::Send, 1, 5, &mut a));
        execs[1].post_transfer(2, transfer(Direction::Recv, 0, 5, &mut b));
        let ended = transfers_end(&mut execs, &[(0, 1), (1, 2)]);
        assert!(ended.values().all(|(ok, t)| *ok && !t.single_copy), "{ended:?}");
        assert_eq!(b, a);
        assert!(to_1.carried() > (words * 8) as u64, "its bytes crossed the lanes");
    }

    #[test]
    fn a_backup_puts_back_exactly_what_was_saved() {
        let original: Vec<u8> = (0..100u8).collect();
        let mut buf = original.clone();
        let mut backup = Backup::default();
        backup.reset(buf.len());
        backup.save(&buf, 10..20);
        backup.save(&buf, 50..90);
        assert_eq!(backup.saved_bytes(), 50);
        buf[10..20].fill(0xff);
        buf[50..90].fill(0xee);
        backup.restore(&mut buf);
        assert_eq!(buf, original);
        // A reset forgets: restoring changes nothing.
        backup.reset(buf.len());
        buf[0] = 7;
        backup.restore(&mut buf);
        assert_eq!(buf[0], 7);
    }

    #[test]
    fn large_saves_at_any_alignment_put_back_every_byte() {
        let original: Vec<u8> = (0..300_017u32).map(|i| (i * 31 + i / 97) as u8).collect();
        for (start, end) in [(0, 300_017), (3, 200_000), (70_001, 300_000), (5, 70_000)] {
            let mut buf = original.clone();
            let mut backup = Backup::default();
            backup.reset(buf.len());
            backup.save(&buf, start..end);
            buf[start..end].fill(0);
            backup.restore(&mut buf);
            assert!(buf == original, "{start}..{end}");
        }
    }
}
