//! The progress engine's core: many ring all-reduces in flight over one ring's lanes.
//!
//! [`Exec`] owns the pool of [`Lane`]s to our ring successor and the pool from our predecessor
//! for one topology, and advances every collective posted to it. Their chunks travel as frames
//! ([`FRAME_BYTES`] of header, then the chunk): the header names the collective (its whole
//! [`OpHeader`]: a predecessor that runs another collective is caught at its first frame) and the
//! chunk's unit in the schedule, so any lane carries any collective's chunk, and a free lane takes
//! the next chunk of the next collective in turn (round-robin: a large collective cannot starve a
//! small one). The confirmation lap's tokens are frames too.
//!
//! A frame may arrive before its collective is posted here (the predecessor's caller was quicker):
//! it is kept aside and applied when the collective is posted. Past [`MAX_EARLY_BYTES`] kept, the
//! lanes are left unread while no collective is in flight here: the frames of one that is may
//! be behind them, and nothing else waits. Only chunks that depend on no send of ours can come
//! early, so a collective sends at most its first segment ahead of its slowest participant.
//!
//! [`Exec::pump`] moves what can move without blocking and returns what happened to which
//! collective; it never sleeps, so the tests below step whole rings in one thread over in-memory
//! lanes, and the communicator drives it with `poll(2)` from whichever thread waits.
//!
//! A lane that fails (the peer died, a reset, a malformed frame) fails every collective in flight
//! over the pool: their streams may hold half a frame and can never be used again.
#![allow(unsafe_code)]

use shoal_collective::ring::{RecvAction, RingAllReduce};
use shoal_collective::{finish_avg, reduce_into, DType, ReduceOp};
use shoal_transport::Lane;
use shoal_wire::{Epoch, OpHeader};
use std::collections::{BTreeMap, VecDeque};
use std::io::{ErrorKind, IoSlice};
use std::ptr::NonNull;

/// The original bytes of every part of a buffer a collective changed, so that a failed
/// collective can put the buffer back as it was. Each range is saved just before its first
/// change, so the copy is spread over the collective (overlapping the network wait) rather
/// than paid up front; a collective that fails early saved little.
#[derive(Debug, Default)]
pub(crate) struct Backup {
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
        bytes[range.clone()].copy_from_slice(&buf[range.clone()]);
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

/// Bytes moved by one collective.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Traffic {
    pub tx_bytes: u64,
    pub rx_bytes: u64,
}

/// Which neighbour a failure concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Next,
    Prev,
}

#[derive(Debug, Clone)]
pub(crate) enum RingError {
    /// A stream to or from a neighbour failed.
    Lost { side: Side, reason: String },
    /// The predecessor started another collective.
    Mismatch { theirs: OpHeader },
    /// The predecessor sent bytes that are not an operation header.
    Malformed(String),
}

/// Bytes of a frame's header.
pub(crate) const FRAME_BYTES: usize = 56;
const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"SHF1");
const KIND_CHUNK: u8 = 1;
const KIND_TOKEN: u8 = 2;
/// Buffers of early frames kept for reuse: a fresh one per chunk would fault in a chunk's pages.
const SPARE_BODIES: usize = 64;
/// Most bytes of frames kept for collectives not posted yet, over all lanes of a pool.
pub(crate) const MAX_EARLY_BYTES: usize = 256 << 20;

/// A caller's buffer, lent to the engine for one collective: whoever posts it keeps the memory
/// alive and untouched until the collective is taken back ([`Exec::take`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `RawBuf` is only dereferenced by the engine, under the engine's lock, while the
// poster guarantees the memory is alive and not used elsewhere (see the type's docs).
unsafe impl Send for RawBuf {}

impl RawBuf {
    pub fn new(buf: &mut [u8]) -> Self {
        RawBuf { ptr: NonNull::new(buf.as_mut_ptr()).unwrap_or(NonNull::dangling()), len: buf.len() }
    }

    pub fn len(&self) -> usize {
        self.len
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

/// One frame's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Frame {
    kind: u8,
    /// Chunk: bytes that follow; token: 0.
    len: u32,
    /// Chunk: the unit of the schedule; token: the rank whose token it is.
    unit: u32,
    op: OpHeader,
}

impl Frame {
    fn encode(&self) -> [u8; FRAME_BYTES] {
        let mut b = [0u8; FRAME_BYTES];
        b[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[4] = self.kind;
        b[5] = self.op.collective;
        b[6] = self.op.dtype;
        b[7] = self.op.op;
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.unit.to_le_bytes());
        b[16..24].copy_from_slice(&self.op.epoch.0.to_le_bytes());
        b[24..32].copy_from_slice(&self.op.seq.to_le_bytes());
        b[32..40].copy_from_slice(&self.op.tag.to_le_bytes());
        b[40..48].copy_from_slice(&self.op.count.to_le_bytes());
        b
    }

    fn decode(b: &[u8; FRAME_BYTES]) -> Result<Frame, String> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(0) != FRAME_MAGIC {
            return Err(format!("a frame without its magic ({:#010x})", u32_at(0)));
        }
        let kind = b[4];
        if kind != KIND_CHUNK && kind != KIND_TOKEN {
            return Err(format!("a frame of unknown kind {kind}"));
        }
        let op = OpHeader {
            collective: b[5],
            epoch: Epoch(u64_at(16)),
            seq: u64_at(24),
            tag: u64_at(32),
            dtype: b[6],
            op: b[7],
            count: u64_at(40),
        };
        Ok(Frame { kind, len: u32_at(8), unit: u32_at(12), op })
    }
}

/// One ring all-reduce to post.
pub(crate) struct OpSpec {
    pub header: OpHeader,
    pub buf: RawBuf,
    pub dtype: DType,
    pub op: ReduceOp,
    pub world: usize,
    pub rank: usize,
    pub chunk_bytes: usize,
    /// Where to save what it overwrites: a spare kept from an earlier collective, so that a
    /// large one does not allocate (and fault in) a copy of its buffer every time.
    pub backup: Backup,
}

/// What happened to a collective ([`Exec::pump`]).
#[derive(Debug)]
pub(crate) enum OpEvent {
    /// Every chunk moved: its lap runs.
    DataDone,
    /// Its lap came round: every participant holds the result.
    Confirmed,
    /// It failed here.
    Failed(RingError),
    /// Its lap cannot finish (a lane failed after its data moved).
    LapBroken(String),
}

/// What the caller gets back of a collective taken out ([`Exec::take`]).
pub(crate) struct Taken {
    pub traffic: Traffic,
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

struct OpExec {
    spec: OpSpec,
    plan: RingAllReduce,
    elem: usize,
    /// The next send unit to hand to a lane, and units whose bytes all left.
    next_send: usize,
    sent: usize,
    recv_done: Vec<bool>,
    received: usize,
    /// Units over the same elements share one save: the first unit with each range.
    first_unit: Vec<usize>,
    saved: Vec<bool>,
    save_cursor: usize,
    backup: Backup,
    traffic: Traffic,
    data_done: bool,
    /// Tokens received, and those to send (ours first once the data moved, then forwards).
    tokens_in: usize,
    tokens_out: usize,
    outbox: VecDeque<u32>,
    /// Tokens received before the data moved: forwarded after ours.
    held: Vec<u32>,
    /// Events not returned yet.
    events: Vec<OpEvent>,
    finished: bool,
}

impl OpExec {
    fn new(mut spec: OpSpec) -> Self {
        let elem = spec.dtype.size();
        let chunk_elems = (spec.chunk_bytes / elem).max(1);
        let plan = RingAllReduce::new(spec.rank, spec.world, spec.buf.len / elem, chunk_elems);
        let mut first_of_range = std::collections::HashMap::with_capacity(plan.recvs.len());
        let first_unit: Vec<usize> =
            plan.recvs.iter().enumerate().map(|(i, u)| *first_of_range.entry(u.range.start).or_insert(i)).collect();
        let mut backup = std::mem::take(&mut spec.backup);
        backup.reset(spec.buf.len);
        OpExec {
            saved: vec![false; plan.recvs.len()],
            recv_done: vec![false; plan.recvs.len()],
            first_unit,
            plan,
            elem,
            spec,
            next_send: 0,
            sent: 0,
            received: 0,
            save_cursor: 0,
            backup,
            traffic: Traffic::default(),
            data_done: false,
            tokens_in: 0,
            tokens_out: 0,
            outbox: VecDeque::new(),
            held: Vec::new(),
            events: Vec::new(),
            finished: false,
        }
    }

    fn bytes(&self, range: &std::ops::Range<usize>) -> std::ops::Range<usize> {
        range.start * self.elem..range.end * self.elem
    }

    /// Saves the original bytes of receive unit `unit`'s range unless already saved.
    fn save_before_change(&mut self, unit: usize) {
        let first = self.first_unit[unit];
        if !self.saved[first] {
            self.saved[first] = true;
            let r = self.bytes(&self.plan.recvs[unit].range);
            // SAFETY: lent to the engine; the only slice of it in use.
            self.backup.save(unsafe { self.spec.buf.slice() }, r);
        }
    }

    /// The next send unit, if it may leave now.
    fn sendable(&self) -> Option<usize> {
        let u = self.plan.sends.get(self.next_send)?;
        u.after_recv.is_none_or(|j| self.recv_done[j]).then_some(self.next_send)
    }

    /// Applies received unit `unit` whose bytes are in `src` (for a reduction) or in place.
    fn complete_recv(&mut self, unit: usize, src: Option<&[u8]>) {
        let r = self.bytes(&self.plan.recvs[unit].range);
        if let RecvAction::Reduce { last } = self.plan.recvs[unit].action {
            self.save_before_change(unit);
            let src = src.expect("a reduction has its chunk aside");
            // SAFETY: lent to the engine; the only slice of it in use.
            let dst = &mut unsafe { self.spec.buf.slice() }[r];
            // Lengths match and both buffers are aligned: checked at the API boundary and here.
            reduce_into(self.spec.dtype, self.spec.op, dst, src).expect("aligned buffers");
            if last && self.spec.op == ReduceOp::Avg {
                finish_avg(self.spec.dtype, dst, self.spec.world).expect("aligned buffer");
            }
        }
        if unit == 0 {
            crate::failpoint::failpoint("all_reduce.reduce_scatter");
        } else if self.plan.recvs[unit].action == RecvAction::Copy
            && (unit == 0 || self.plan.recvs[unit - 1].action != RecvAction::Copy)
        {
            crate::failpoint::failpoint("all_reduce.all_gather");
        }
        self.recv_done[unit] = true;
        self.received += 1;
    }

    /// A token of `origin`'s arrived.
    fn token(&mut self, origin: u32) -> Result<(), RingError> {
        let world = self.spec.world as u32;
        if origin >= world || origin as usize == self.spec.rank {
            return Err(RingError::Malformed(format!("a token of rank {origin} in a ring of {world}")));
        }
        self.tokens_in += 1;
        if origin != (self.spec.rank as u32 + 1) % world {
            if self.data_done {
                self.outbox.push_back(origin);
            } else {
                self.held.push(origin);
            }
        }
        Ok(())
    }

    /// Records what the latest moves completed.
    fn check(&mut self) {
        if self.finished {
            return;
        }
        if !self.data_done && self.sent == self.plan.sends.len() && self.received == self.plan.recvs.len() {
            self.data_done = true;
            self.events.push(OpEvent::DataDone);
            self.outbox.push_back(self.spec.rank as u32);
            self.outbox.extend(self.held.drain(..));
        }
        let laps = self.spec.world - 1;
        if self.data_done && self.tokens_in == laps && self.tokens_out == laps {
            self.finished = true;
            self.events.push(OpEvent::Confirmed);
        }
    }
}

/// What a sending lane is writing.
enum Sending {
    Chunk { seq: u64, start: usize, len: usize },
    Token { seq: u64 },
}

struct SendLane<L> {
    lane: L,
    frame: [u8; FRAME_BYTES],
    /// Bytes of the frame (header, then chunk) written.
    written: usize,
    sending: Option<Sending>,
}

/// Where a frame's chunk goes.
enum Dest {
    /// Into the caller's buffer at this byte offset (all-gather).
    Buf(usize),
    /// Into the lane's scratch, to reduce once complete.
    Scratch,
    /// Kept aside: the collective is not posted yet.
    Early(Vec<u8>),
}

struct Receiving {
    frame: Frame,
    got: usize,
    dest: Dest,
}

struct RecvLane<L> {
    lane: L,
    header: [u8; FRAME_BYTES],
    header_got: usize,
    receiving: Option<Receiving>,
    scratch: Vec<u64>,
}

/// A frame that arrived before its collective was posted.
struct Early {
    frame: Frame,
    body: Vec<u8>,
}

/// The engine over one topology's pools to our successor and from our predecessor.
pub(crate) struct Exec<L> {
    epoch: Epoch,
    send: Vec<SendLane<L>>,
    recv: Vec<RecvLane<L>>,
    ops: BTreeMap<u64, OpExec>,
    /// The highest number posted so far: frames of lower numbers not in `ops` are stale.
    posted: Option<u64>,
    early: BTreeMap<u64, Vec<Early>>,
    early_bytes: usize,
    /// Buffers of early frames applied, to receive the next ones without allocating.
    spare_bodies: Vec<Vec<u8>>,
    /// The collective the last free lane took a frame of: the next lane starts after it.
    turn: u64,
    /// Why the pools failed, once they did: nothing more moves.
    broken: Option<RingError>,
}

/// What one [`Exec::pump`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pumped {
    /// Some bytes moved: pump again.
    Progress,
    /// Nothing can move until the lanes are ready.
    Idle,
}

impl<L: Lane> Exec<L> {
    /// The engine of topology `epoch` over `send` (to our successor) and `recv` (from our
    /// predecessor).
    pub fn new(epoch: Epoch, send: Vec<L>, recv: Vec<L>) -> Self {
        let send = send.into_iter().map(|lane| SendLane { lane, frame: [0; FRAME_BYTES], written: 0, sending: None });
        let recv = recv.into_iter().map(|lane| RecvLane {
            lane,
            header: [0; FRAME_BYTES],
            header_got: 0,
            receiving: None,
            scratch: Vec::new(),
        });
        Exec {
            epoch,
            send: send.collect(),
            recv: recv.collect(),
            ops: BTreeMap::new(),
            posted: None,
            early: BTreeMap::new(),
            early_bytes: 0,
            spare_bodies: Vec::new(),
            turn: 0,
            broken: None,
        }
    }

    /// The topology this engine runs in.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// Collectives posted and not taken.
    pub fn in_flight(&self) -> usize {
        self.ops.len()
    }

    /// Starts collective `spec`, numbered `spec.header.seq` (above every number posted before):
    /// frames that came early for it are applied now.
    pub fn post(&mut self, spec: OpSpec) {
        let seq = spec.header.seq;
        debug_assert!(self.posted.is_none_or(|p| p < seq), "collectives are posted in order");
        self.posted = Some(seq);
        let mut op = OpExec::new(spec);
        if let Some(e) = &self.broken {
            op.events.push(OpEvent::Failed(e.clone()));
            op.finished = true;
        } else if self.send.is_empty() || self.recv.is_empty() {
            // A group of one never posts: no lanes means the pools were not established.
            let reason = "no data connection: a collective failed before and the ring has not re-formed yet";
            op.events.push(OpEvent::Failed(RingError::Lost { side: Side::Next, reason: reason.into() }));
            op.finished = true;
        } else {
            for early in self.early.remove(&seq).unwrap_or_default() {
                self.early_bytes -= early.body.len();
                match apply_early(&mut op, early) {
                    Ok(body) => self.spare_body(body),
                    Err(e) => {
                        op.events.push(OpEvent::Failed(e));
                        op.finished = true;
                        break;
                    }
                }
            }
        }
        let failed = self.broken.is_none() && op.finished;
        self.ops.insert(seq, op);
        if failed {
            let reason = format!("collective {seq} failed over these streams");
            self.break_lanes(RingError::Lost { side: Side::Prev, reason });
        }
    }

    /// Takes collective `seq` out: done, failed, or stopped by the peer. One that had not
    /// finished leaves half its frames in the lanes, which fail for every other collective.
    pub fn take(&mut self, seq: u64) -> Option<Taken> {
        let op = self.ops.remove(&seq)?;
        if !op.finished {
            let reason = format!("collective {seq} stopped mid-flight");
            self.break_lanes(RingError::Lost { side: Side::Next, reason });
        }
        Some(Taken { traffic: op.traffic, backup: op.backup, buf: op.spec.buf })
    }

    /// What happened to collectives since the last call.
    pub fn events(&mut self) -> Vec<(u64, OpEvent)> {
        let mut out = Vec::new();
        for (seq, op) in &mut self.ops {
            out.extend(op.events.drain(..).map(|e| (*seq, e)));
        }
        out
    }

    /// Saves ahead the next range a collective will change, while nothing else can move; false
    /// once every range is saved.
    pub fn save_ahead(&mut self) -> bool {
        for op in self.ops.values_mut().filter(|o| !o.finished) {
            while op.save_cursor < op.plan.recvs.len() {
                let unit = op.save_cursor;
                op.save_cursor += 1;
                if !op.saved[op.first_unit[unit]] {
                    op.save_before_change(unit);
                    return true;
                }
            }
        }
        false
    }

    /// The lanes to poll: (lane, wants to read, wants to write).
    pub fn interest(&self) -> impl Iterator<Item = (&L, bool, bool)> {
        let lanes = if self.broken.is_some() { 0 } else { usize::MAX };
        let reading = self.early_bytes < MAX_EARLY_BYTES || self.ops.values().any(|o| !o.finished);
        let writing = self.ops.values().any(|o| !o.outbox.is_empty() || o.sendable().is_some());
        let recv = self.recv.iter().take(lanes).map(move |l| (&l.lane, reading || l.receiving.is_some(), false));
        let send = self.send.iter().take(lanes).map(move |l| (&l.lane, false, l.sending.is_some() || writing));
        recv.chain(send)
    }

    /// Moves every byte that can move now, without blocking.
    pub fn pump(&mut self) -> Pumped {
        if self.broken.is_some() {
            return Pumped::Idle;
        }
        let mut progress = false;
        for i in 0..self.recv.len() {
            match self.pump_recv(i) {
                Ok(p) => progress |= p,
                Err((seq, e)) => {
                    self.fail(seq, e);
                    return Pumped::Progress;
                }
            }
        }
        for i in 0..self.send.len() {
            match self.pump_send(i) {
                Ok(p) => progress |= p,
                Err(reason) => {
                    self.break_lanes(RingError::Lost { side: Side::Next, reason });
                    return Pumped::Progress;
                }
            }
        }
        for op in self.ops.values_mut() {
            op.check();
        }
        if progress {
            Pumped::Progress
        } else {
            Pumped::Idle
        }
    }

    /// A failure `e` of collective `seq` (or, without one, of the lanes): every collective fails,
    /// the others as lost over the lanes `e` broke.
    fn fail(&mut self, seq: Option<u64>, e: RingError) {
        match seq.and_then(|s| self.ops.get_mut(&s)).filter(|o| !o.finished) {
            Some(op) => {
                op.events.push(OpEvent::Failed(e.clone()));
                op.finished = true;
                let reason = format!("collective {} failed over these streams: {e:?}", seq.expect("found"));
                self.break_lanes(RingError::Lost { side: Side::Prev, reason });
            }
            None => self.break_lanes(e),
        }
    }

    /// The lanes failed with `e`: every collective still in flight fails with it, or asks, once
    /// its data moved.
    fn break_lanes(&mut self, e: RingError) {
        let e = self.broken.get_or_insert(e).clone();
        for op in self.ops.values_mut().filter(|o| !o.finished) {
            op.finished = true;
            op.events.push(if op.data_done {
                OpEvent::LapBroken(format!("the streams failed: {e:?}"))
            } else {
                OpEvent::Failed(e.clone())
            });
        }
        self.early.clear();
        self.early_bytes = 0;
    }

    /// Closes the lanes once they failed. The driver calls it once every collective over them
    /// has its verdict: the first failure must reach the master before the closed streams make
    /// the neighbours report theirs (a mismatch, not the "connection closed" that follows it).
    pub fn release_if_broken(&mut self) {
        if self.broken.is_some() {
            self.send.clear();
            self.recv.clear();
        }
    }

    /// Reads what lane `i` has; `Err((collective, why))` on failure.
    fn pump_recv(&mut self, i: usize) -> Result<bool, (Option<u64>, RingError)> {
        let mut progress = false;
        loop {
            let lane = &mut self.recv[i];
            let Some(rx) = lane.receiving.as_mut() else {
                if self.early_bytes >= MAX_EARLY_BYTES && self.ops.values().all(|o| o.finished) {
                    return Ok(progress);
                }
                let Some(n) = read_some(&mut lane.lane, &mut lane.header[lane.header_got..])? else {
                    return Ok(progress);
                };
                progress = true;
                lane.header_got += n;
                if lane.header_got == FRAME_BYTES {
                    lane.header_got = 0;
                    let frame = Frame::decode(&lane.header).map_err(|e| (None, RingError::Malformed(e)))?;
                    self.begin_frame(i, frame)?;
                }
                continue;
            };
            let seq = rx.frame.op.seq;
            let len = rx.frame.len as usize;
            let target: &mut [u8] = match &mut rx.dest {
                Dest::Buf(start) => {
                    let op = self.ops.get(&seq).expect("a frame into a buffer has its collective");
                    // SAFETY: lent to the engine; the only slice of it in use until the read ends.
                    let whole = unsafe { op.spec.buf.slice() };
                    &mut whole[*start + rx.got..*start + len]
                }
                Dest::Scratch => {
                    let s: &mut [u8] = bytemuck::cast_slice_mut(&mut lane.scratch);
                    &mut s[rx.got..len]
                }
                Dest::Early(body) => &mut body[rx.got..len],
            };
            let n = if target.is_empty() {
                0
            } else {
                let Some(n) = read_some(&mut lane.lane, target)? else { return Ok(progress) };
                n
            };
            progress = true;
            rx.got += n;
            if let Some(op) = self.ops.get_mut(&seq) {
                op.traffic.rx_bytes += n as u64;
            }
            if rx.got < len {
                continue;
            }
            let rx = lane.receiving.take().expect("receiving");
            let unit = rx.frame.unit as usize;
            match rx.dest {
                Dest::Buf(_) => self.ops.get_mut(&seq).expect("posted").complete_recv(unit, None),
                Dest::Scratch => {
                    let src: &[u8] = bytemuck::cast_slice(&lane.scratch);
                    self.ops.get_mut(&seq).expect("posted").complete_recv(unit, Some(&src[..len]));
                }
                Dest::Early(body) => {
                    let early = Early { frame: rx.frame, body };
                    self.early_bytes -= early.body.len();
                    // Posted while its chunk arrived: applied now.
                    match self.ops.get_mut(&seq) {
                        Some(op) => {
                            let body = apply_early(op, early).map_err(|e| (Some(seq), e))?;
                            self.spare_body(body);
                        }
                        None => {
                            self.early_bytes += early.body.len();
                            self.early.entry(seq).or_default().push(early);
                        }
                    }
                }
            }
        }
    }

    /// A frame's header arrived on receiving lane `i`: decides where its chunk goes.
    fn begin_frame(&mut self, i: usize, frame: Frame) -> Result<(), (Option<u64>, RingError)> {
        let seq = frame.op.seq;
        if frame.op.epoch != self.epoch {
            let why = format!("a frame of topology {} in topology {}", frame.op.epoch.0, self.epoch.0);
            return Err((None, RingError::Malformed(why)));
        }
        let Some(op) = self.ops.get_mut(&seq) else {
            if self.posted.is_some_and(|p| seq <= p) {
                let why = format!("a frame of collective {seq}, which ended here");
                return Err((None, RingError::Malformed(why)));
            }
            // Early: keep it until the collective is posted here.
            let body = if frame.kind == KIND_CHUNK {
                if frame.len as usize > MAX_EARLY_BYTES {
                    return Err((None, RingError::Malformed(format!("a chunk of {} bytes", frame.len))));
                }
                self.early_bytes += frame.len as usize;
                let mut body = self.spare_bodies.pop().unwrap_or_default();
                body.clear();
                body.resize(frame.len as usize, 0);
                body
            } else {
                Vec::new()
            };
            if frame.kind == KIND_TOKEN || frame.len == 0 {
                self.early.entry(seq).or_default().push(Early { frame, body });
            } else {
                self.recv[i].receiving = Some(Receiving { frame, got: 0, dest: Dest::Early(body) });
            }
            return Ok(());
        };
        if frame.op != op.spec.header {
            return Err((Some(seq), RingError::Mismatch { theirs: frame.op }));
        }
        if frame.kind == KIND_TOKEN {
            return op.token(frame.unit).map_err(|e| (Some(seq), e));
        }
        let dest = chunk_dest(op, &frame).map_err(|e| (Some(seq), e))?;
        if let Dest::Scratch = dest {
            let words = (frame.len as usize).div_ceil(8);
            let scratch = &mut self.recv[i].scratch;
            if scratch.len() < words {
                scratch.resize(words, 0);
            }
        }
        if frame.len == 0 {
            op.complete_recv(frame.unit as usize, Some(&[]));
            return Ok(());
        }
        self.recv[i].receiving = Some(Receiving { frame, got: 0, dest });
        Ok(())
    }

    /// Writes what lane `i` may send; `Err(why)` if the lane failed.
    fn pump_send(&mut self, i: usize) -> Result<bool, String> {
        let mut progress = false;
        loop {
            if self.send[i].sending.is_none() && !self.next_frame(i) {
                return Ok(progress);
            }
            let lane = &mut self.send[i];
            let (seq, payload): (u64, &[u8]) = match lane.sending.as_ref().expect("a frame") {
                Sending::Chunk { seq, start, len, .. } => {
                    // SAFETY: lent to the engine; the only slice of it in use until the write ends.
                    let whole: &[u8] = unsafe { self.ops[seq].spec.buf.slice() };
                    (*seq, &whole[*start..*start + *len])
                }
                Sending::Token { seq } => (*seq, &[]),
            };
            let (header_left, body_done) = if lane.written < FRAME_BYTES {
                (&lane.frame[lane.written..], 0)
            } else {
                (&[][..], lane.written - FRAME_BYTES)
            };
            let body_left = &payload[body_done..];
            let written = if header_left.is_empty() {
                lane.lane.write(body_left)
            } else {
                lane.lane.write_vectored(&[IoSlice::new(header_left), IoSlice::new(body_left)])
            };
            let n = match written {
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(progress),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.to_string()),
            };
            progress = true;
            let body = n.saturating_sub(header_left.len());
            lane.written += n;
            let op = self.ops.get_mut(&seq).expect("a frame of a collective in flight");
            op.traffic.tx_bytes += body as u64;
            if lane.written == FRAME_BYTES + payload.len() {
                lane.written = 0;
                match lane.sending.take().expect("a frame") {
                    Sending::Chunk { .. } => op.sent += 1,
                    Sending::Token { .. } => op.tokens_out += 1,
                }
                op.check();
            }
        }
    }

    /// Gives free lane `i` the next frame: the next collective in turn with a token or a chunk
    /// that may leave. False if none has.
    fn next_frame(&mut self, i: usize) -> bool {
        let turn = self.turn;
        let order = self.ops.range(turn + 1..).chain(self.ops.range(..=turn)).map(|(s, _)| *s);
        let pick = order.into_iter().find(|s| {
            let op = &self.ops[s];
            !op.finished && (!op.outbox.is_empty() || op.sendable().is_some())
        });
        let Some(seq) = pick else { return false };
        self.turn = seq;
        let op = self.ops.get_mut(&seq).expect("picked");
        let (frame, sending) = if let Some(origin) = op.outbox.pop_front() {
            (Frame { kind: KIND_TOKEN, len: 0, unit: origin, op: op.spec.header }, Sending::Token { seq })
        } else {
            let unit = op.sendable().expect("picked");
            op.next_send += 1;
            let r = op.bytes(&op.plan.sends[unit].range);
            let frame = Frame { kind: KIND_CHUNK, len: r.len() as u32, unit: unit as u32, op: op.spec.header };
            (frame, Sending::Chunk { seq, start: r.start, len: r.len() })
        };
        let lane = &mut self.send[i];
        lane.frame = frame.encode();
        lane.written = 0;
        lane.sending = Some(sending);
        true
    }

    /// Keeps an early frame's buffer for the next one (a few chunks' worth at most).
    fn spare_body(&mut self, body: Vec<u8>) {
        if self.spare_bodies.len() < SPARE_BODIES && body.capacity() > 0 {
            self.spare_bodies.push(body);
        }
    }

    /// Where each lane stands, for a failure's log.
    pub fn describe(&self) -> String {
        let ops: Vec<String> = self
            .ops
            .iter()
            .map(|(s, o)| {
                format!("#{s}: sent {}/{}, received {}/{}", o.sent, o.plan.sends.len(), o.received, o.plan.recvs.len())
            })
            .collect();
        let send = self.send.iter().map(|l| l.lane.describe());
        let lanes: Vec<String> = send.chain(self.recv.iter().map(|l| l.lane.describe())).collect();
        format!("collectives [{}] over {lanes:?}", ops.join("; "))
    }
}

/// Reads what `lane` has into `buf`: `None` if nothing yet; the end of the stream or an error
/// loses the predecessor.
fn read_some(lane: &mut impl Lane, buf: &mut [u8]) -> Result<Option<usize>, (Option<u64>, RingError)> {
    let lost = |reason: String| (None, RingError::Lost { side: Side::Prev, reason });
    loop {
        return match lane.read(buf) {
            Ok(0) => Err(lost("connection closed".into())),
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(None),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => Err(lost(e.to_string())),
        };
    }
}

/// Where the chunk of `frame` (a frame of `op`) goes, checked against the schedule.
fn chunk_dest(op: &mut OpExec, frame: &Frame) -> Result<Dest, RingError> {
    let unit = frame.unit as usize;
    let Some(u) = op.plan.recvs.get(unit) else {
        return Err(RingError::Malformed(format!("chunk {unit} of a schedule of {}", op.plan.recvs.len())));
    };
    let r = op.bytes(&u.range);
    if op.recv_done[unit] || frame.len as usize != r.len() {
        return Err(RingError::Malformed(format!(
            "chunk {unit} of {} bytes (expected {}{})",
            frame.len,
            r.len(),
            if op.recv_done[unit] { ", once" } else { "" }
        )));
    }
    Ok(match u.action {
        RecvAction::Copy => {
            op.save_before_change(unit);
            Dest::Buf(r.start)
        }
        RecvAction::Reduce { .. } => Dest::Scratch,
    })
}

/// Applies a frame that came before its collective was posted; returns its body's buffer.
fn apply_early(op: &mut OpExec, early: Early) -> Result<Vec<u8>, RingError> {
    if early.frame.op != op.spec.header {
        return Err(RingError::Mismatch { theirs: early.frame.op });
    }
    if early.frame.kind == KIND_TOKEN {
        return op.token(early.frame.unit).map(|()| early.body);
    }
    match chunk_dest(op, &early.frame)? {
        Dest::Buf(start) => {
            // SAFETY: lent to the engine; the only slice of it in use.
            let whole = unsafe { op.spec.buf.slice() };
            whole[start..start + early.body.len()].copy_from_slice(&early.body);
            op.traffic.rx_bytes += early.body.len() as u64;
            op.complete_recv(early.frame.unit as usize, None);
        }
        _ => {
            op.traffic.rx_bytes += early.body.len() as u64;
            op.complete_recv(early.frame.unit as usize, Some(&early.body));
        }
    }
    Ok(early.body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_collective::CollectiveKind;
    use shoal_transport::lane::mem::{self, Control, Faults, MemLane};

    /// `world` engines whose link from rank r to r + 1 is a pool of `pool` in-memory connections
    /// shaped by `faults`.
    fn ring(world: usize, pool: usize, faults: Faults) -> (Vec<Exec<MemLane>>, Vec<Vec<Control>>) {
        let mut lanes: Vec<(Vec<MemLane>, Vec<MemLane>)> = (0..world).map(|_| (Vec::new(), Vec::new())).collect();
        let mut controls = Vec::new();
        for r in 0..world {
            let mut link = Vec::new();
            for i in 0..pool {
                let (tx, rx, control) = mem::pair(&format!("{r}->{}#{i}", (r + 1) % world), faults);
                lanes[r].0.push(tx);
                lanes[(r + 1) % world].1.push(rx);
                link.push(control);
            }
            controls.push(link);
        }
        (lanes.into_iter().map(|(s, r)| Exec::new(Epoch(1), s, r)).collect(), controls)
    }

    fn header(seq: u64, count: usize, tag: u64) -> OpHeader {
        OpHeader {
            collective: CollectiveKind::AllReduce.code(),
            epoch: Epoch(1),
            seq,
            tag,
            dtype: DType::U64.code(),
            op: ReduceOp::Sum.code(),
            count: count as u64,
        }
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
    /// is confirmed or failed; returns each rank's runs.
    fn run_all(
        execs: &mut [Exec<MemLane>],
        sizes: &[usize],
        tags: &[Vec<u64>],
        posted_at: &[Vec<usize>],
        chunk_bytes: usize,
        mut between: impl FnMut(usize),
    ) -> Vec<Vec<Run>> {
        let world = execs.len();
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
                        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut run.buf);
                        exec.post(OpSpec {
                            header: header(i as u64, sizes[i], tags[rank][i]),
                            buf: RawBuf::new(bytes),
                            dtype: DType::U64,
                            op: ReduceOp::Sum,
                            world,
                            rank,
                            chunk_bytes,
                            backup: Backup::default(),
                        });
                        moved = true;
                    }
                }
                moved |= exec.pump() == Pumped::Progress;
                for (seq, event) in exec.events() {
                    let run = &mut runs[rank][seq as usize];
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
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
                let header = header(i as u64, sizes[i], tags[rank][i]);
                exec.post(OpSpec {
                    header,
                    buf: RawBuf::new(bytes),
                    dtype: DType::U64,
                    op: ReduceOp::Sum,
                    world: 2,
                    rank,
                    chunk_bytes: 64 << 10,
                    backup: Backup::default(),
                });
            }
        }
        for round in 0..100_000 {
            for exec in &mut execs {
                exec.pump();
                for (seq, event) in exec.events() {
                    if matches!(event, OpEvent::Confirmed) {
                        finished.push((round, seq));
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

    /// A frame that is not one (a stranger's bytes, a desynchronised stream) fails the pool.
    #[test]
    fn garbage_on_a_lane_fails_every_collective_in_flight() {
        let (tx, rx, _) = mem::pair("0->1", Faults::default());
        let (tx2, rx2, _) = mem::pair("1->0", Faults::default());
        let mut exec = Exec::new(Epoch(1), vec![tx2], vec![rx]);
        let mut stranger = tx;
        std::io::Write::write_all(&mut stranger, &[0xab; FRAME_BYTES]).unwrap();
        let mut buf = vec![0u64; 64];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
        exec.post(OpSpec {
            header: header(0, 64, 1),
            buf: RawBuf::new(bytes),
            dtype: DType::U64,
            op: ReduceOp::Sum,
            world: 2,
            rank: 1,
            chunk_bytes: 4096,
            backup: Backup::default(),
        });
        for _ in 0..10 {
            exec.pump();
        }
        let events = exec.events();
        assert!(
            matches!(&events[..], [(0, OpEvent::Failed(RingError::Malformed(why)))] if why.contains("magic")),
            "{events:?}"
        );
        drop((rx2, stranger));
    }

    #[test]
    fn frames_round_trip() {
        let f = Frame { kind: KIND_CHUNK, len: 4096, unit: 7, op: header(3, 100, 9) };
        assert_eq!(Frame::decode(&f.encode()), Ok(f));
        let mut bad = f.encode();
        bad[4] = 9;
        assert!(Frame::decode(&bad).unwrap_err().contains("kind"));
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
}
