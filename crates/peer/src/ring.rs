//! Executes a [`RingAllReduce`] schedule over the pools to our successor and predecessor.
//!
//! [`RingExec`] moves what can move without blocking over pools of [`Lane`]s (TCP streams, or
//! in-memory lanes that let the tests below step a whole ring in one thread, deterministically,
//! with fragmented IO, backpressure, stalls and resets). [`run`] drives it on one thread — the
//! caller's — with non-blocking IO and `poll(2)`: it writes
//! chunks straight from the user's buffer as soon as their pipeline dependency is met, reads
//! reduce-scatter chunks into a per-stream scratch buffer and reduces them into the user's buffer,
//! and reads all-gather chunks directly into place. No thread hand-off sits on the path, which
//! keeps small all-reduces at a few system calls per hop, and no copy but the kernel's.
//!
//! Chunk `k` of the schedule travels on stream `k mod lanes`, where `lanes` grows with the buffer
//! size up to the pool size ([`lanes`]). Both ends derive the same assignment: the receiving
//! end's pool is the sending end's pool, and its list of chunks to receive is the sender's list
//! of chunks to send.

use crate::control::Waker;
use crate::Deadline;
use shoal_collective::ring::{RecvAction, RingAllReduce};
use shoal_collective::{finish_avg, reduce_into, DType, ReduceOp};
use shoal_transport::Lane;
use shoal_transport::PollFd;
use shoal_wire::{decode_frame, encode_frame, Message, OpHeader, SessionId};
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::time::Duration;

/// A collective uses one more stream of the pool per this many bytes of buffer. Small collectives
/// ride one stream: every extra stream costs a header and a wake-up per hop, which dominated
/// small all-reduces (4 KiB across processes: 440 µs on 4 streams, 85 µs on one).
const BYTES_PER_LANE: usize = 256 << 10;
/// Longest a poll waits before the deadline is looked at again.
const POLL_SLICE: Duration = Duration::from_millis(50);
/// How long a driver waits between pumps of lanes it cannot poll (in-memory lanes).
const UNPOLLABLE_SLICE: Duration = Duration::from_millis(1);
/// How long the executor keeps retrying non-blocking IO (yielding the CPU in between) before it
/// sleeps in `poll(2)`. A sleep and wake-up cost tens of microseconds per hop, which dominates
/// small collectives (4 KiB, 2 peers: 71 µs median without, 55 µs with); yielding keeps a
/// spinning peer from starving a neighbour on the same core.
const SPIN: Duration = Duration::from_micros(50);

/// One ring all-reduce to run.
pub(crate) struct RingJob<'a> {
    pub dtype: DType,
    pub op: ReduceOp,
    pub header: OpHeader,
    pub session: SessionId,
    pub buf: &'a mut [u8],
    pub world: usize,
    pub rank: usize,
    pub chunk_bytes: usize,
    /// Receive buffers kept between collectives, one per stream; grown as needed.
    pub scratch: &'a mut Vec<Vec<u64>>,
    /// Where the caller's bytes are saved before the collective first changes them.
    pub backup: &'a mut Backup,
}

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

#[derive(Debug)]
pub(crate) enum RingError {
    /// A stream to or from a neighbour failed.
    Lost { side: Side, reason: String },
    /// The predecessor started another collective.
    Mismatch { theirs: OpHeader },
    /// The predecessor sent bytes that are not an operation header.
    Malformed(String),
    /// The deadline passed.
    Timeout(crate::Error),
    /// The peer's state machine stopped the collective (a verdict, a removed member, a vote it
    /// can never complete against, expulsion): it ends the call.
    Stopped,
}

struct SendLane {
    header_sent: usize,
    unit: usize,
    offset: usize,
}

struct RecvLane {
    header: Vec<u8>,
    header_got: usize,
    unit: usize,
    offset: usize,
}

/// What one [`RingExec::pump`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pumped {
    /// Every chunk was sent and received.
    Done,
    /// Some bytes moved: pump again.
    Progress,
    /// Nothing can move until the lanes are ready.
    Idle,
}

/// Runs `job` to completion over `send` (to our successor) and `recv` (from our predecessor).
/// Whenever it is about to sleep it asks `running` whether the peer still wants it moved (a
/// member of the ring removed by the master: a dead or frozen peer never closes its streams).
pub(crate) fn run<L: Lane>(
    job: RingJob<'_>,
    send: &mut [L],
    recv: &mut [L],
    deadline: Deadline,
    running: &dyn Fn() -> bool,
    waker: &Waker,
) -> Result<Traffic, RingError> {
    assert!(job.world > 1 && !send.is_empty() && !recv.is_empty(), "a ring needs neighbours");
    let mut exec = RingExec::new(job, send.len(), recv.len());
    let (send, recv) = (&mut send[..exec.send_lanes], &mut recv[..exec.recv_lanes]);
    let result = drive(&mut exec, send, recv, deadline, running, waker);
    if let Err(e) = &result {
        // Where every lane stood: enough to tell a dead peer from a desynchronised stream.
        let s: Vec<(usize, usize, usize)> = exec.sends.iter().map(|l| (l.header_sent, l.unit, l.offset)).collect();
        let r: Vec<(usize, usize, usize)> = exec.recvs.iter().map(|l| (l.header_got, l.unit, l.offset)).collect();
        let names = |v: &[L]| -> Vec<String> { v.iter().map(Lane::describe).collect() };
        log::debug!(
            "all_reduce seq {} failed ({e:?}) with {} send and {} receive chunks; lanes as \
             (header bytes, chunk, offset): send {s:?} on {:?}, receive {r:?} on {:?}",
            exec.job.header.seq,
            exec.plan.sends.len(),
            exec.plan.recvs.len(),
            names(send),
            names(recv),
        );
    }
    result
}

/// Pumps `exec` until it is done, sleeping in `poll(2)` (or, over lanes that cannot be polled,
/// briefly) whenever nothing can move.
fn drive<L: Lane>(
    exec: &mut RingExec<'_>,
    send: &mut [L],
    recv: &mut [L],
    deadline: Deadline,
    running: &dyn Fn() -> bool,
    waker: &Waker,
) -> Result<Traffic, RingError> {
    let mut idle_since: Option<std::time::Instant> = None;
    loop {
        match exec.pump(send, recv)? {
            Pumped::Done => return Ok(exec.traffic),
            Pumped::Progress => {
                idle_since = None;
                continue;
            }
            Pumped::Idle => {}
        }
        // Nothing to do until the network delivers: save ahead what we will overwrite, so that
        // on a real network the backup costs no time at all.
        if exec.save_ahead() {
            continue;
        }
        let now = std::time::Instant::now();
        if now.duration_since(*idle_since.get_or_insert(now)) < SPIN {
            std::thread::yield_now();
            continue;
        }
        let mut fds: Vec<PollFd> = Vec::with_capacity(send.len() + recv.len() + 1);
        let mut unpollable = false;
        let mut watch = |lane: &L, want_read: bool, want_write: bool| match lane.pollable() {
            Some(fd) => {
                let mut fd = PollFd::from_raw(fd);
                (fd.want_read, fd.want_write) = (want_read, want_write);
                fds.push(fd);
            }
            None => unpollable = true,
        };
        for (i, lane) in recv.iter().enumerate() {
            watch(lane, exec.wants_read(i), false);
        }
        for (i, lane) in send.iter().enumerate() {
            watch(lane, false, exec.wants_write(i));
        }
        let mut wake = PollFd::new(waker.fd());
        wake.want_read = true;
        fds.push(wake);
        waker.drain();
        if !running() {
            return Err(RingError::Stopped);
        }
        let left = deadline.left("all_reduce").map_err(RingError::Timeout)?;
        let slice = if unpollable { UNPOLLABLE_SLICE } else { POLL_SLICE };
        shoal_transport::poll(&mut fds, left.min(slice))
            .map_err(|e| RingError::Lost { side: Side::Prev, reason: format!("poll: {e}") })?;
    }
}

/// How many streams of a pool of `pool` a collective of `units` chunks over `buf_bytes` uses.
fn lanes(pool: usize, units: usize, buf_bytes: usize) -> usize {
    pool.min(units).min(buf_bytes.div_ceil(BYTES_PER_LANE)).max(1)
}

/// One ring all-reduce in progress over pools of lanes it does not own: [`RingExec::pump`] moves
/// what can move without blocking, so a driver can sleep on the lanes' readiness in between, or a
/// test can step several peers' executors in one thread.
pub(crate) struct RingExec<'a> {
    job: RingJob<'a>,
    plan: RingAllReduce,
    header: Vec<u8>,
    elem: usize,
    /// Streams of each pool the collective uses.
    send_lanes: usize,
    recv_lanes: usize,
    sends: Vec<SendLane>,
    recvs: Vec<RecvLane>,
    /// Receive buffers, one per receiving lane, taken from the job for the collective.
    scratch: Vec<Vec<u64>>,
    scratch_words: usize,
    recv_done: Vec<bool>,
    traffic: Traffic,
    first_unit: Vec<usize>,
    saved: Vec<bool>,
    /// Where [`RingExec::save_ahead`] goes on.
    save_cursor: usize,
    /// The first receive unit of the all-gather.
    first_copy: usize,
}

impl<'a> RingExec<'a> {
    /// The collective `job`, over pools of `send_pool` streams to the successor and `recv_pool`
    /// from the predecessor (it uses the first [`RingExec::lanes`] of each).
    pub fn new(job: RingJob<'a>, send_pool: usize, recv_pool: usize) -> Self {
        let elem = job.dtype.size();
        debug_assert_eq!(job.buf.len() % elem, 0);
        let chunk_elems = (job.chunk_bytes / elem).max(1);
        let plan = RingAllReduce::new(job.rank, job.world, job.buf.len() / elem, chunk_elems);
        // An `Op` header holds no string: it always encodes.
        let header = encode_frame(job.session, &Message::Op(job.header)).expect("an Op header encodes");
        let send_lanes = lanes(send_pool, plan.sends.len(), job.buf.len());
        let recv_lanes = lanes(recv_pool, plan.recvs.len(), job.buf.len());
        let sends = (0..send_lanes).map(|i| SendLane { header_sent: 0, unit: i, offset: 0 }).collect();
        let recvs = (0..recv_lanes)
            .map(|i| RecvLane { header: vec![0; header.len()], header_got: 0, unit: i, offset: 0 })
            .collect();
        // Reduce-scatter chunks land in scratch first; the largest one sets its size.
        let largest = plan.recvs.iter().map(|u| u.range.len()).max().unwrap_or(0);
        let scratch_words = (largest * elem).div_ceil(8);
        let mut scratch = std::mem::take(job.scratch);
        scratch.resize_with(recv_lanes.max(scratch.len()), Vec::new);
        for s in &mut scratch[..recv_lanes] {
            if s.len() < scratch_words {
                s.resize(scratch_words, 0);
            }
        }
        // Units over the same elements (a segment's chunk is reduced, later overwritten) share one
        // save: `first_unit[u]` is the first unit with `u`'s range.
        let mut first_of_range = std::collections::HashMap::with_capacity(plan.recvs.len());
        let first_unit: Vec<usize> =
            plan.recvs.iter().enumerate().map(|(i, u)| *first_of_range.entry(u.range.start).or_insert(i)).collect();
        let saved = vec![false; plan.recvs.len()];
        job.backup.reset(job.buf.len());
        let first_copy = plan.recvs.iter().position(|u| u.action == RecvAction::Copy).unwrap_or(usize::MAX);
        let recv_done = vec![false; plan.recvs.len()];
        RingExec {
            job,
            plan,
            header,
            elem,
            send_lanes,
            recv_lanes,
            sends,
            recvs,
            scratch,
            scratch_words,
            recv_done,
            traffic: Traffic::default(),
            first_unit,
            saved,
            save_cursor: 0,
            first_copy,
        }
    }

    /// Moves every byte that can move now over `send` and `recv` (the lanes the collective uses,
    /// in order), without blocking.
    ///
    /// # Errors
    /// A lane failed, or the predecessor sent another collective's header or a malformed one.
    pub fn pump<L: Lane>(&mut self, send: &mut [L], recv: &mut [L]) -> Result<Pumped, RingError> {
        let mut progress = false;
        for (i, stream) in recv.iter_mut().enumerate() {
            progress |= self.pump_recv(i, stream)?;
        }
        for (i, stream) in send.iter_mut().enumerate() {
            progress |= self.pump_send(i, stream)?;
        }
        let finished =
            (0..self.sends.len()).all(|i| self.send_finished(i)) && (0..self.recvs.len()).all(|i| !self.wants_read(i));
        if finished {
            debug_assert!(self.recv_done.iter().all(|d| *d), "finished with chunks not received");
            return Ok(Pumped::Done);
        }
        Ok(if progress { Pumped::Progress } else { Pumped::Idle })
    }

    /// Whether receiving lane `i` has bytes to read.
    fn wants_read(&self, i: usize) -> bool {
        let lane = &self.recvs[i];
        lane.header_got < self.header.len() || lane.unit < self.plan.recvs.len()
    }

    /// Whether sending lane `i` has bytes it may send now.
    fn wants_write(&self, i: usize) -> bool {
        let lane = &self.sends[i];
        if lane.header_sent < self.header.len() {
            return true;
        }
        self.plan.sends.get(lane.unit).is_some_and(|u| u.after_recv.is_none_or(|j| self.recv_done[j]))
    }

    fn send_finished(&self, i: usize) -> bool {
        let lane = &self.sends[i];
        lane.header_sent == self.header.len() && lane.unit >= self.plan.sends.len()
    }

    /// Saves the next receive unit not yet saved, in schedule order; false if all are.
    fn save_ahead(&mut self) -> bool {
        while self.save_cursor < self.plan.recvs.len() {
            let unit = self.save_cursor;
            self.save_cursor += 1;
            if !self.saved[self.first_unit[unit]] {
                self.save_before_change(unit);
                return true;
            }
        }
        false
    }

    /// Saves the original bytes of receive unit `unit`'s range unless already saved.
    fn save_before_change(&mut self, unit: usize) {
        let first = self.first_unit[unit];
        if !self.saved[first] {
            self.saved[first] = true;
            let r = &self.plan.recvs[unit].range;
            self.job.backup.save(self.job.buf, r.start * self.elem..r.end * self.elem);
        }
    }

    fn pump_send(&mut self, i: usize, stream: &mut impl Write) -> Result<bool, RingError> {
        let mut progress = false;
        while self.wants_write(i) {
            let lane = &mut self.sends[i];
            let header_left = &self.header[lane.header_sent..];
            let unit = self.plan.sends.get(lane.unit).filter(|u| u.after_recv.is_none_or(|j| self.recv_done[j]));
            let (unit_bytes, unit_len): (&[u8], usize) = match unit {
                Some(u) => {
                    let (start, end) = (u.range.start * self.elem, u.range.end * self.elem);
                    (&self.job.buf[start + lane.offset..end], end - start)
                }
                None => (&[], 0),
            };
            // The header goes out with the lane's first chunk in one system call.
            let written = if header_left.is_empty() {
                stream.write(unit_bytes)
            } else {
                stream.write_vectored(&[IoSlice::new(header_left), IoSlice::new(unit_bytes)])
            };
            let n = match written {
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(RingError::Lost { side: Side::Next, reason: e.to_string() }),
            };
            progress = true;
            let from_header = n.min(header_left.len());
            lane.header_sent += from_header;
            let from_unit = n - from_header;
            self.traffic.tx_bytes += from_unit as u64;
            lane.offset += from_unit;
            if unit_len > 0 && lane.offset == unit_len {
                lane.unit += self.send_lanes;
                lane.offset = 0;
            }
        }
        Ok(progress)
    }

    fn pump_recv(&mut self, i: usize, stream: &mut impl Read) -> Result<bool, RingError> {
        let mut progress = false;
        let header_len = self.header.len();
        loop {
            let (unit, offset, header_got) = (self.recvs[i].unit, self.recvs[i].offset, self.recvs[i].header_got);
            if header_got == header_len
                && offset == 0
                && self.plan.recvs.get(unit).is_some_and(|u| u.action == RecvAction::Copy)
            {
                self.save_before_change(unit);
            }
            let lane = &mut self.recvs[i];
            let target: &mut [u8] = if lane.header_got < header_len {
                &mut lane.header[lane.header_got..]
            } else if let Some(u) = self.plan.recvs.get(lane.unit) {
                let (start, end) = (u.range.start * self.elem, u.range.end * self.elem);
                match u.action {
                    RecvAction::Copy => &mut self.job.buf[start + lane.offset..end],
                    RecvAction::Reduce { .. } => {
                        let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut self.scratch[i][..self.scratch_words]);
                        &mut scratch[lane.offset..end - start]
                    }
                }
            } else {
                return Ok(progress);
            };
            let n = match stream.read(target) {
                Ok(0) => return Err(RingError::Lost { side: Side::Prev, reason: "connection closed".into() }),
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(progress),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(RingError::Lost { side: Side::Prev, reason: e.to_string() }),
            };
            progress = true;
            if lane.header_got < header_len {
                lane.header_got += n;
                if lane.header_got == header_len {
                    self.check_header(&self.recvs[i].header)?;
                }
                continue;
            }
            self.traffic.rx_bytes += n as u64;
            lane.offset += n;
            let (unit, offset) = (lane.unit, lane.offset);
            let u = &self.plan.recvs[unit];
            let (start, end) = (u.range.start * self.elem, u.range.end * self.elem);
            if offset < end - start {
                continue;
            }
            if let RecvAction::Reduce { last } = u.action {
                self.save_before_change(unit);
                let dst = &mut self.job.buf[start..end];
                let src: &[u8] = bytemuck::cast_slice(&self.scratch[i][..self.scratch_words]);
                // Lengths match and both buffers are aligned: checked at the API boundary.
                reduce_into(self.job.dtype, self.job.op, dst, &src[..end - start]).expect("aligned buffers");
                if last && self.job.op == ReduceOp::Avg {
                    finish_avg(self.job.dtype, dst, self.job.world).expect("aligned buffer");
                }
            }
            // Test hooks: die having received the first chunk of either half.
            if unit == 0 {
                crate::failpoint::failpoint("all_reduce.reduce_scatter");
            } else if unit == self.first_copy {
                crate::failpoint::failpoint("all_reduce.all_gather");
            }
            self.recv_done[unit] = true;
            let lane = &mut self.recvs[i];
            lane.unit += self.recv_lanes;
            lane.offset = 0;
        }
    }

    fn check_header(&self, bytes: &[u8]) -> Result<(), RingError> {
        let theirs = match decode_frame(bytes) {
            Ok((session, Message::Op(h))) if session == self.job.session => h,
            Ok((session, m)) => {
                return Err(RingError::Malformed(format!(
                    "expected Op in {:?}, got {} in {session:?}",
                    self.job.session,
                    m.name()
                )))
            }
            Err(e) => return Err(RingError::Malformed(e.to_string())),
        };
        // Everything must match, the number too: a peer that ran one collective more than us is
        // as much a mismatch as one that passed another count.
        if theirs != self.job.header {
            return Err(RingError::Mismatch { theirs });
        }
        Ok(())
    }
}

impl Drop for RingExec<'_> {
    fn drop(&mut self) {
        // The receive buffers outlive the collective, at the size of the largest so far.
        *self.job.scratch = std::mem::take(&mut self.scratch);
    }
}

/// A token of the confirmation lap: `SHDN`, the rank that finished, the collective's number.
const TOKEN_BYTES: usize = 16;
const TOKEN_MAGIC: u32 = u32::from_le_bytes(*b"SHDN");

/// Why [`confirm`] stopped before every participant was known to have finished.
#[derive(Debug)]
pub(crate) enum Stop {
    /// The peer's state machine stopped the lap (a verdict, a removed member, its bound).
    Stopped,
    /// The lap cannot finish here (a stream broke, a bad token): ask the master.
    Broken(String),
}

/// The confirmation lap that follows a successful ring: every participant that holds the complete
/// result sends a token to its successor and forwards its predecessor's tokens, except those
/// that would return to where they started. Each participant sends and receives exactly
/// `world - 1` tokens, on the first stream of each direction after the collective's bytes; one
/// that received them all knows every participant finished and may commit on its own. The token
/// of the participant `world - 1` places behind arrives after `world - 1` hops.
///
/// `running` is asked before every sleep whether to go on.
#[allow(clippy::too_many_arguments)]
pub(crate) fn confirm(
    send: &mut impl Lane,
    recv: &mut impl Lane,
    rank: usize,
    world: usize,
    seq: u64,
    deadline: Deadline,
    running: &dyn Fn() -> bool,
    waker: &Waker,
) -> Result<(), Stop> {
    let token = |origin: usize| -> [u8; TOKEN_BYTES] {
        let mut t = [0u8; TOKEN_BYTES];
        t[..4].copy_from_slice(&TOKEN_MAGIC.to_le_bytes());
        t[4..8].copy_from_slice(&(origin as u32).to_le_bytes());
        t[8..].copy_from_slice(&seq.to_le_bytes());
        t
    };
    let next = (rank + 1) % world;
    let mut outbox: Vec<u8> = token(rank).to_vec();
    let mut sent = 0;
    let mut inbox = [0u8; TOKEN_BYTES];
    let (mut got, mut received) = (0, 0);
    let mut idle_since: Option<std::time::Instant> = None;
    let broken = |what: &str, e: std::io::Error| Stop::Broken(format!("confirmation lap: {what}: {e}"));
    while received < world - 1 || sent < (world - 1) * TOKEN_BYTES {
        let mut progress = false;
        while sent < outbox.len() {
            match send.write(&outbox[sent..]) {
                Ok(n) => {
                    sent += n;
                    progress = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(broken("sending", e)),
            }
        }
        while received < world - 1 {
            match recv.read(&mut inbox[got..]) {
                Ok(0) => return Err(Stop::Broken("confirmation lap: predecessor closed the stream".into())),
                Ok(n) => {
                    got += n;
                    progress = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(broken("receiving", e)),
            }
            if got < TOKEN_BYTES {
                continue;
            }
            got = 0;
            received += 1;
            let magic = u32::from_le_bytes(inbox[..4].try_into().expect("4 bytes"));
            let origin = u32::from_le_bytes(inbox[4..8].try_into().expect("4 bytes")) as usize;
            let their_seq = u64::from_le_bytes(inbox[8..].try_into().expect("8 bytes"));
            if magic != TOKEN_MAGIC || their_seq != seq || origin >= world || origin == rank {
                return Err(Stop::Broken(format!(
                    "confirmation lap: bad token (magic {magic:#x}, rank {origin}, collective {their_seq})"
                )));
            }
            if origin != next {
                outbox.extend_from_slice(&inbox);
            }
        }
        if progress {
            idle_since = None;
            continue;
        }
        let now = std::time::Instant::now();
        if now.duration_since(*idle_since.get_or_insert(now)) < SPIN {
            std::thread::yield_now();
            continue;
        }
        waker.drain();
        if !running() {
            return Err(Stop::Stopped);
        }
        let left = deadline.left("all_reduce").map_err(|e| Stop::Broken(e.to_string()))?;
        let (Some(recv_fd), Some(send_fd)) = (recv.pollable(), send.pollable()) else {
            std::thread::sleep(left.min(UNPOLLABLE_SLICE));
            continue;
        };
        let mut fds = [PollFd::from_raw(recv_fd), PollFd::from_raw(send_fd), PollFd::new(waker.fd())];
        fds[0].want_read = received < world - 1;
        fds[1].want_write = sent < outbox.len();
        fds[2].want_read = true;
        shoal_transport::poll(&mut fds, left.min(POLL_SLICE)).map_err(|e| broken("poll", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_collective::CollectiveKind;
    use shoal_transport::lane::mem::{self, Control, Faults, MemLane};
    use shoal_wire::Epoch;

    /// One peer of a simulated ring: its buffer and what the executor keeps between collectives.
    struct Member {
        buf: Vec<u64>,
        scratch: Vec<Vec<u64>>,
        backup: Backup,
        /// Lanes to the successor and from the predecessor.
        send: Vec<MemLane>,
        recv: Vec<MemLane>,
    }

    /// `world` peers whose link from rank r to r + 1 is a pool of `pool` in-memory connections
    /// shaped by `faults`, each peer's buffer `inputs[r]` (u64 words holding `dtype` elements).
    fn ring(world: usize, pool: usize, faults: Faults, inputs: Vec<Vec<u64>>) -> (Vec<Member>, Vec<Vec<Control>>) {
        let mut members: Vec<Member> = inputs
            .into_iter()
            .map(|buf| Member { buf, scratch: Vec::new(), backup: Backup::default(), send: vec![], recv: vec![] })
            .collect();
        let mut controls = Vec::new();
        for r in 0..world {
            let mut link = Vec::new();
            for i in 0..pool {
                let (tx, rx, control) = mem::pair(&format!("{r}->{}#{i}", (r + 1) % world), faults);
                members[r].send.push(tx);
                members[(r + 1) % world].recv.push(rx);
                link.push(control);
            }
            controls.push(link);
        }
        (members, controls)
    }

    fn header(dtype: DType, op: ReduceOp, count: usize, tag: u64) -> OpHeader {
        OpHeader {
            collective: CollectiveKind::AllReduce.code(),
            epoch: Epoch(1),
            seq: 0,
            tag,
            dtype: dtype.code(),
            op: op.code(),
            count: count as u64,
        }
    }

    /// Steps every member's executor in turn, in one thread, until each is done or failed;
    /// `between(round)` runs before every round (to stall, resume or reset links). A failed
    /// member drops its lanes, as the real peer does.
    fn run_all(
        members: &mut [Member],
        dtype: DType,
        op: ReduceOp,
        tags: &[u64],
        chunk_bytes: usize,
        mut between: impl FnMut(usize),
    ) -> Vec<Result<(), RingError>> {
        let world = members.len();
        let mut lanes: Vec<(Vec<MemLane>, Vec<MemLane>)> =
            members.iter_mut().map(|m| (std::mem::take(&mut m.send), std::mem::take(&mut m.recv))).collect();
        let mut execs: Vec<Option<RingExec<'_>>> = members
            .iter_mut()
            .enumerate()
            .map(|(rank, m)| {
                let buf: &mut [u8] = bytemuck::cast_slice_mut(&mut m.buf);
                let count = buf.len() / dtype.size();
                let job = RingJob {
                    dtype,
                    op,
                    header: header(dtype, op, count, tags[rank]),
                    session: SessionId(9),
                    buf,
                    world,
                    rank,
                    chunk_bytes,
                    scratch: &mut m.scratch,
                    backup: &mut m.backup,
                };
                let (send, recv) = &lanes[rank];
                Some(RingExec::new(job, send.len(), recv.len()))
            })
            .collect();
        let mut results: Vec<Option<Result<(), RingError>>> = (0..world).map(|_| None).collect();
        for round in 0..1_000_000 {
            between(round);
            let mut moved = false;
            for rank in 0..world {
                let Some(exec) = execs[rank].as_mut() else { continue };
                let (send, recv) = &mut lanes[rank];
                let (s, r) = (exec.send_lanes, exec.recv_lanes);
                match exec.pump(&mut send[..s], &mut recv[..r]) {
                    Ok(Pumped::Idle) => {}
                    Ok(Pumped::Progress) => moved = true,
                    Ok(Pumped::Done) => {
                        results[rank] = Some(Ok(()));
                        execs[rank] = None;
                        moved = true;
                    }
                    Err(e) => {
                        results[rank] = Some(Err(e));
                        execs[rank] = None;
                        lanes[rank] = (Vec::new(), Vec::new());
                        moved = true;
                    }
                }
            }
            if results.iter().all(Option::is_some) {
                return results.into_iter().map(Option::unwrap).collect();
            }
            assert!(moved || round < 10_000, "the ring is stuck at round {round}: {results:?}");
        }
        panic!("the ring never finished");
    }

    fn expected(inputs: &[Vec<u64>], f: impl Fn(u64, u64) -> u64) -> Vec<u64> {
        (0..inputs[0].len()).map(|k| inputs.iter().map(|v| v[k]).reduce(&f).unwrap()).collect()
    }

    /// The executor over lanes that fragment every read and write to a few bytes and hold little:
    /// every peer ends with the sum, for every pool and ring size.
    #[test]
    fn every_peer_holds_the_result_over_fragmented_backpressured_lanes() {
        for (world, pool, words, max_io, chunk) in
            [(2, 1, 100, 7, 64), (3, 2, 1000, 13, 256), (4, 3, 100_000, 4096, 16 << 10)]
        {
            let inputs: Vec<Vec<u64>> =
                (0..world).map(|r| (0..words).map(|k| (r * 1_000_003 + k * 7) as u64).collect()).collect();
            let faults = Faults { capacity: 3 * max_io, max_io, reset_after: None };
            let (mut members, _) = ring(world, pool, faults, inputs.clone());
            let results = run_all(&mut members, DType::U64, ReduceOp::Sum, &vec![5; world], chunk, |_| {});
            let sum = expected(&inputs, u64::wrapping_add);
            for (rank, (m, r)) in members.iter().zip(results).enumerate() {
                assert!(r.is_ok(), "world {world}, rank {rank}: {r:?}");
                assert_eq!(m.buf, sum, "world {world}, pool {pool}: rank {rank} holds another result");
            }
            let max = expected(&inputs, u64::max);
            let (mut members, _) = ring(world, pool, faults, inputs.clone());
            run_all(&mut members, DType::U64, ReduceOp::Max, &vec![5; world], chunk, |_| {});
            assert!(members.iter().all(|m| m.buf == max));
        }
    }

    /// A link stalled for a while (a slow or frozen path) delays the collective, nothing more.
    #[test]
    fn a_stalled_link_delays_the_result_without_changing_it() {
        let inputs: Vec<Vec<u64>> = (0..3).map(|r| vec![r as u64 + 1; 500]).collect();
        let (mut members, controls) = ring(3, 1, Faults { capacity: 256, max_io: 64, reset_after: None }, inputs);
        let link = controls[1][0].clone();
        let results = run_all(&mut members, DType::U64, ReduceOp::Sum, &[1, 1, 1], 512, |round| {
            link.stall((3..400).contains(&round));
        });
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        assert!(members.iter().all(|m| m.buf == vec![6; 500]));
    }

    /// A connection that resets mid-collective (a peer killed, a path cut) fails the collective on
    /// both its ends, naming the side; each failed peer's backup puts its buffer back as it was.
    #[test]
    fn a_reset_link_fails_both_ends_and_every_buffer_restores() {
        let inputs: Vec<Vec<u64>> = (0..3).map(|r| (0..2000).map(|k| (r * 10_000 + k) as u64).collect()).collect();
        let faults = Faults { capacity: 1024, max_io: 512, reset_after: None };
        let (mut members, controls) = ring(3, 1, faults, inputs.clone());
        let link = controls[1][0].clone();
        let results = run_all(&mut members, DType::U64, ReduceOp::Sum, &[1, 1, 1], 1024, |_| {
            if link.carried() > 4000 {
                link.reset();
            }
        });
        assert!(matches!(results[1], Err(RingError::Lost { side: Side::Next, .. })), "{:?}", results[1]);
        assert!(matches!(results[2], Err(RingError::Lost { side: Side::Prev, .. })), "{:?}", results[2]);
        for (rank, (m, r)) in members.iter_mut().zip(&results).enumerate() {
            if r.is_err() {
                let buf: &mut [u8] = bytemuck::cast_slice_mut(&mut m.buf);
                m.backup.restore(buf);
                assert_eq!(m.buf, inputs[rank], "rank {rank}'s buffer is not restored");
            }
        }
    }

    /// A predecessor that runs another collective (here: another tag) is caught at its header.
    #[test]
    fn a_predecessor_running_another_collective_is_a_mismatch() {
        let inputs: Vec<Vec<u64>> = (0..2).map(|_| vec![1; 64]).collect();
        let (mut members, _) = ring(2, 1, Faults::default(), inputs);
        let results = run_all(&mut members, DType::U64, ReduceOp::Sum, &[1, 2], 128, |_| {});
        assert!(
            results.iter().any(|r| matches!(r, Err(RingError::Mismatch { theirs }) if theirs.tag != 0)),
            "{results:?}"
        );
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
    fn small_buffers_ride_one_lane_and_large_ones_the_whole_pool() {
        assert_eq!(lanes(4, 2, 4096), 1);
        assert_eq!(lanes(4, 0, 0), 1, "an empty buffer still sends its header on one lane");
        assert_eq!(lanes(4, 3, 600 << 10), 3);
        assert_eq!(lanes(4, 96, 64 << 20), 4);
        assert_eq!(lanes(1, 96, 64 << 20), 1);
    }
}
