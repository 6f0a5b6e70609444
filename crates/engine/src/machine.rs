//! The data plane of one topology as a sans-IO machine: [`Machine`].
//!
//! Everything that happens to an operation is decided here: its schedule's sends, receives and
//! reductions over chunks, quantization, a tagged transfer's matching, the confirmation lap, what
//! a backup saves and when a buffer is put back, its failure. The machine never touches a lane;
//! it is told what arrived and what left, and says what to send, in the shape of
//! `shoal_proto::peer::Peer`:
//!
//! - inputs, `handle_*`: a frame's header read ([`Machine::handle_header`]), its body's bytes
//!   ([`Machine::handle_body`], [`Machine::handle_chunk`]), a frame written
//!   ([`Machine::handle_written`], [`Machine::handle_sent`]), a lane closed or failed, a stream
//!   full or drained, a read out of another process's memory ([`Machine::handle_pulled`]);
//!   time is an argument;
//! - outputs, `poll_*`: the next frame for a free lane to a member ([`Machine::poll_frame`]),
//!   what happened to each operation ([`Machine::poll_events`],
//!   [`Machine::poll_transfer_events`]), the pieces of other processes' memory to read
//!   ([`Machine::poll_pulls`]).
//!
//! Bodies are not copied through it: a header's answer ([`Incoming`]) says where its body goes
//! ([`Machine::body_target`]: the caller's buffer, a stash, the lane's scratch), and a frame to
//! send names its body ([`Machine::payload`]), so a lane reads and writes them in place.
//! [`crate::Exec`] is this machine plus the only IO, its lanes.

use crate::p2p::{self, End, Pull};
use crate::{
    Backup, LinkError, LinkStats, Malformed, Missing, OpEvent, OpKey, OpSpec, Taken, Traffic, TransferSpec,
    EARLY_GRACE, MAX_EARLY_BYTES, SPARE_BODIES, TOKEN_BYTES,
};
use shoal_collective::schedule::{RecvAction, Schedule};
use shoal_collective::{finish_avg, reduce_into, Codec, ReduceOp};
use shoal_wire::{DataFrame as Frame, Epoch, FrameKind, DATA_FRAME_BYTES as FRAME_BYTES};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The links failed: the machine recorded why and failed what was in flight; nothing more moves
/// over them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinksFailed;

/// A frame on its way in: its header read, where its body goes, how much of it came.
pub struct Incoming {
    frame: Frame,
    /// The unit of our schedule it is (an early frame's is found once its collective is posted).
    unit: usize,
    got: usize,
    dest: Dest,
}

impl Incoming {
    /// Its body's length.
    pub fn len(&self) -> usize {
        self.frame.len as usize
    }

    /// Whether its body is empty.
    pub fn is_empty(&self) -> bool {
        self.frame.len == 0
    }

    /// Since when it waits in its lane for its collective to be posted here
    /// ([`Machine::handle_held`]).
    pub fn held(&self) -> Option<Instant> {
        match self.dest {
            Dest::Unposted(since) => Some(since),
            _ => None,
        }
    }

    /// Whether its whole body, none of it read yet, is to be reduced from aside: a lane that can
    /// lend it where it lies may hand it to [`Machine::handle_chunk`] as it is.
    pub fn reduced_from_aside(&self) -> bool {
        matches!(self.dest, Dest::Scratch) && self.got == 0 && self.frame.len > 0
    }

    /// Whether its whole body was read.
    pub fn complete(&self) -> bool {
        self.got == self.frame.len as usize
    }

    /// The collective it belongs to.
    pub fn key(&self) -> OpKey {
        OpKey::of(&self.frame.op)
    }
}

/// What [`Machine::handle_held`] made of a frame held in its lane.
pub enum Held {
    /// Still held: its collective is not posted, and the grace is not over.
    Waiting(Incoming),
    /// Placed: its collective was posted since (the frame is handled as if it arrived now).
    Placed(Option<Incoming>),
    /// Read aside, into a buffer of its own: what follows it on the lane moves.
    Aside(Incoming),
}

/// A frame on its way out: its header, then its body ([`Machine::payload`]).
pub struct Outgoing {
    /// The encoded header.
    pub header: [u8; FRAME_BYTES],
    body: Sending,
}

/// What a frame going out carries.
enum Sending {
    Chunk {
        key: OpKey,
        start: usize,
        len: usize,
    },
    /// A quantized collective's chunk, encoded.
    Encoded {
        key: OpKey,
        body: Arc<[u8]>,
    },
    /// A confirmation token, its body (how long after its call its origin held the result).
    Token {
        key: OpKey,
        body: [u8; TOKEN_BYTES],
    },
    /// A part of transfer `id`.
    Part {
        id: u64,
        start: usize,
        len: usize,
    },
    /// A transfer's offer, answer or withdrawal.
    Control,
}

/// Where a frame's chunk goes.
enum Dest {
    /// Into the caller's buffer at this byte offset (all-gather).
    Buf(usize),
    /// Into the lane's scratch, to reduce once complete.
    Scratch,
    /// Into the collective's stash at this byte offset, to combine once everything moved.
    Stash(usize),
    /// Left in the lane since then: the collective is not posted yet, and most often is within
    /// microseconds (its caller is posting a batch); past [`EARLY_GRACE`] it is kept aside.
    Unposted(Instant),
    /// Into the lane's scratch: a confirmation token's body, applied once complete.
    Token,
    /// Kept aside: the collective is not posted yet.
    Early(Vec<u8>),
    /// Into a receive's buffer (a tagged transfer).
    Part(p2p::PartDest),
}

/// A frame that arrived before its collective was posted.
struct Early {
    from: usize,
    frame: Frame,
    body: Vec<u8>,
}

/// The data plane of one topology, without its lanes: every collective and tagged transfer in
/// flight over the links to the other members (see the module's docs).
pub struct Machine {
    epoch: Epoch,
    rank: usize,
    world: usize,
    /// By member.
    stats: BTreeMap<usize, LinkStats>,
    /// Members every lane from which was closed: they left.
    gone: Vec<bool>,
    ops: BTreeMap<OpKey, OpExec>,
    /// The tagged point-to-point transfers in flight.
    p2p: p2p::Transfers,
    /// Whether the next free lane looks at the transfers before the collectives: they take
    /// turns.
    p2p_turn: bool,
    /// The highest number posted so far in each group: frames of lower numbers not in `ops`
    /// are stale.
    posted: BTreeMap<u64, u64>,
    early: BTreeMap<OpKey, Vec<Early>>,
    early_bytes: usize,
    /// How long an early chunk waits in its lane before it is read aside ([`EARLY_GRACE`]).
    pub(crate) early_grace: Duration,
    /// Buffers of early frames applied, to receive the next ones without allocating.
    spare_bodies: Vec<Vec<u8>>,
    /// The collective the last free lane took a frame of: the next lane starts after it.
    turn: OpKey,
    /// The collective whose chunk arrived last, and whether the next free lane looks at it
    /// first: what it forwards next was just reduced, and is still in the cache. Every other
    /// frame goes round-robin, so it cannot starve the others.
    hot: Option<OpKey>,
    hot_turn: bool,
    /// Why the links failed, once they did: nothing more moves.
    broken: Option<LinkError>,
    /// Whether a collective in flight lacks a link ([`Machine::missing`]).
    awaiting: bool,
}

impl Machine {
    /// The machine of topology `epoch`, where we are `rank` of `world`, with no links yet.
    pub fn new(epoch: Epoch, rank: usize, world: usize) -> Self {
        assert!(rank < world, "rank {rank} of {world}");
        Machine {
            epoch,
            rank,
            world,
            stats: BTreeMap::new(),
            gone: vec![false; world],
            ops: BTreeMap::new(),
            p2p: p2p::Transfers::new(epoch, world),
            p2p_turn: false,
            posted: BTreeMap::new(),
            early: BTreeMap::new(),
            early_bytes: 0,
            early_grace: EARLY_GRACE,
            spare_bodies: Vec::new(),
            turn: OpKey::default(),
            hot: None,
            hot_turn: false,
            broken: None,
            awaiting: false,
        }
    }

    /// The topology it runs in.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// Collectives and transfers posted and not taken.
    pub fn in_flight(&self) -> usize {
        self.ops.len() + self.p2p.len()
    }

    /// What moved over each link, by member.
    pub fn stats(&self) -> &BTreeMap<usize, LinkStats> {
        &self.stats
    }

    /// Whether the links failed: nothing more moves over them.
    pub fn broken(&self) -> bool {
        self.broken.is_some()
    }

    /// Whether a collective in flight lacks a link: cheap, unlike [`Machine::missing`].
    pub fn awaiting(&self) -> bool {
        self.awaiting
    }

    /// The links the operations in flight need and that are not here.
    pub fn missing(&self) -> Missing {
        let mut missing = Missing::default();
        if self.broken.is_some() {
            return missing;
        }
        for op in self.ops.values() {
            self.missing_for(op, &mut missing);
        }
        self.missing_for_transfers(&mut missing);
        missing
    }

    /// Adds to `missing` the links the transfers still moving need (both ways: the receiver
    /// answers) and lack.
    fn missing_for_transfers(&self, missing: &mut Missing) {
        let peers: Vec<usize> = self.p2p.peers().collect();
        self.want_links(peers.iter().copied(), peers.iter().copied(), missing);
    }

    /// Adds to `missing` the links `op` needs and lacks.
    fn missing_for(&self, op: &OpExec, missing: &mut Missing) {
        if !op.finished {
            self.want_links(op.peers_to.iter().copied(), op.peers_from.iter().copied(), missing);
        }
    }

    /// Adds to `missing` the links to members `to` and from members `from` that are not here
    /// (from a member that left, none is coming).
    fn want_links(
        &self,
        to: impl IntoIterator<Item = usize>,
        from: impl IntoIterator<Item = usize>,
        missing: &mut Missing,
    ) {
        let lanes = |r: usize| self.stats.get(&r).copied().unwrap_or_default();
        for to in to {
            if lanes(to).lanes_out == 0 && !missing.to.contains(&to) {
                missing.to.push(to);
            }
        }
        for from in from {
            if lanes(from).lanes_in == 0 && !missing.from.contains(&from) && !self.gone[from] {
                missing.from.push(from);
            }
        }
    }

    /// Lanes `lanes` (each: what carries it, the process at its other end where known) now lead
    /// to member `to` (`outgoing`) or come from it.
    pub fn handle_lanes(&mut self, member: usize, outgoing: bool, lanes: &[(&'static str, Option<u32>)]) {
        assert!(member < self.world && member != self.rank, "lanes with member {member}");
        let stats = self.stats.entry(member).or_default();
        if outgoing {
            stats.lanes_out += lanes.len();
        } else {
            stats.lanes_in += lanes.len();
            self.gone[member] = false;
        }
        for &(kind, pid) in lanes {
            stats.carried_by(kind);
            self.p2p.note_partner(member, pid);
        }
        self.awaiting = !self.missing().is_empty();
    }

    /// Starts collective `spec`, numbered `spec.header.seq` (above every number posted before in
    /// its group): frames that came early for it are applied now. Lanes it needs and that are
    /// not here yet ([`Machine::missing`]) may be added while it runs.
    pub fn post(&mut self, spec: OpSpec) {
        let key = OpKey::of(&spec.header);
        let seq = key.seq;
        debug_assert!(self.posted.get(&key.derived).is_none_or(|&p| p < seq), "collectives are posted in order");
        debug_assert_eq!(spec.header.epoch, self.epoch, "a collective of this topology");
        self.posted.insert(key.derived, seq);
        let mut op = OpExec::new(spec, self.rank, self.world);
        if let Some(e) = &self.broken {
            op.events.push(OpEvent::Failed(e.clone()));
            op.finished = true;
        } else {
            for early in self.early.remove(&key).unwrap_or_default() {
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
        if let Some(gone) = op.peers_from.iter().copied().find(|&r| !op.finished && self.gone[r]) {
            let reason = "connection closed: it left after an earlier collective".to_string();
            op.events.push(OpEvent::Failed(LinkError::Lost { rank: gone, reason }));
            op.finished = true;
        }
        let failed = self.broken.is_none() && op.finished;
        self.ops.insert(key, op);
        if failed {
            let reason = format!("collective {seq} failed over these streams");
            self.break_lanes(LinkError::Lost { rank: self.rank, reason });
        }
        // A group of one moves nothing: done at once.
        let op = self.ops.get_mut(&key).expect("posted");
        op.check();
        if self.broken.is_none() && !self.awaiting {
            let mut missing = Missing::default();
            self.missing_for(&self.ops[&key], &mut missing);
            self.awaiting = !missing.is_empty();
        }
        debug_assert!(self.posted.get(&key.derived) == Some(&seq) && self.ops.contains_key(&key));
    }

    /// Whether a collective of `key` was posted here (it may have ended since).
    fn was_posted(&self, key: OpKey) -> bool {
        self.posted.get(&key.derived).is_some_and(|&p| key.seq <= p)
    }

    /// Starts tagged transfer `id` (a number of the caller's, unique among those in flight)
    /// with member `spec.peer` (or from any), alongside the collectives.
    pub fn post_transfer(&mut self, id: u64, spec: TransferSpec) {
        let member = |r: &usize| *r < self.world && *r != self.rank;
        // A receive from any of several members fails once none is left to send.
        let gone = match &spec.peer {
            End::Member(p) => {
                assert!(member(p), "a transfer with member {p}");
                self.gone[*p].then_some(*p)
            }
            End::AnyOf(members) => {
                assert!(!members.is_empty() && members.iter().all(member), "a transfer with any of {members:?}");
                members.iter().all(|&r| self.gone[r]).then(|| members[members.len() - 1])
            }
        };
        self.p2p.post(id, spec);
        if let Some(e) = &self.broken {
            self.p2p.fail(id, e.clone());
        } else if let Some(peer) = gone {
            let reason = "connection closed: it left earlier".to_string();
            self.p2p.fail(id, LinkError::Lost { rank: peer, reason });
        } else if !self.awaiting {
            let mut missing = Missing::default();
            self.missing_for_transfers(&mut missing);
            self.awaiting = !missing.is_empty();
        }
    }

    /// Takes transfer `id` out, ended or not: what it moved. One stopped with parts on the
    /// lanes leaves them unusable for every other operation.
    pub fn take_transfer(&mut self, id: u64) -> Option<Traffic> {
        let (traffic, torn) = self.p2p.take(id)?;
        if torn {
            self.break_lanes(LinkError::Lost { rank: self.rank, reason: format!("transfer {id} stopped mid-flight") });
        }
        if self.awaiting {
            self.awaiting = !self.missing().is_empty();
        }
        Some(traffic)
    }

    /// The member at the other end of transfer `id`, once known: for a receive from any member,
    /// once it took an offer.
    pub fn transfer_peer(&self, id: u64) -> Option<usize> {
        self.p2p.peer(id)
    }

    /// The sender's number of transfer `id` and the member at the other end, once matched; and
    /// whether it waits for the other end's word on its outcome (failed there, only that end
    /// knows how it ended: `docs/algorithms.md`, "Tagged point-to-point").
    pub fn transfer_outcome(&self, id: u64) -> (Option<(u64, usize)>, bool) {
        (self.p2p.matched(id), self.p2p.uncertain(id))
    }

    /// Whether transfer `id` still waits for the other end's call ([`Machine::transfer_stuck`]
    /// there): `Some` with, for a receive, the count of that member's offers seen.
    pub fn transfer_unmatched(&self, id: u64) -> Option<u64> {
        self.p2p.unmatched(id)
    }

    /// Whether the transfer member `rank` waits on with us (what it reported of it) can only
    /// complete by a call of ours not made yet.
    pub fn transfer_stuck(&self, rank: usize, send: bool, tag: u64, seen: u64) -> bool {
        rank < self.world && rank != self.rank && self.p2p.stuck(rank, send, tag, seen)
    }

    /// Takes collective `key` out: done, failed, or stopped by the peer. One that had not
    /// finished leaves half its frames in the lanes, which fail for every other collective.
    pub fn take(&mut self, key: OpKey) -> Option<Taken> {
        let op = self.ops.remove(&key)?;
        if !op.finished {
            let reason = format!("collective {} stopped mid-flight", key.seq);
            self.break_lanes(LinkError::Lost { rank: self.rank, reason });
        }
        if self.awaiting {
            self.awaiting = !self.missing().is_empty();
        }
        debug_assert!(!self.ops.contains_key(&key));
        let ready = op.ready.iter().map(|us| us.map(Duration::from_micros)).collect();
        Some(Taken { traffic: op.traffic, ready, backup: op.backup, buf: op.spec.buf })
    }

    /// The members collective `key` still moves data with (none once its data moved).
    pub fn waits_on(&self, key: OpKey) -> Vec<usize> {
        self.ops.get(&key).map_or_else(Vec::new, OpExec::waits_on_members)
    }

    /// Saves ahead the next range a collective will change, while nothing else can move; false
    /// once every range is saved.
    pub fn save_ahead(&mut self) -> bool {
        for op in self.ops.values_mut().filter(|o| !o.finished) {
            if op.plan.combines() && !op.saved_fold {
                op.save_fold();
                return true;
            }
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

    /// Whether lanes are to be read: not while frames kept for collectives not posted here fill
    /// their allowance and nothing in flight waits for what may be behind them.
    pub fn reading(&self) -> bool {
        self.early_bytes < MAX_EARLY_BYTES || self.ops.values().any(|o| !o.finished) || self.p2p.busy()
    }

    /// The size of an element of collective `key` (posted): a chunk reduced where a lane lends
    /// it must be aligned to it.
    pub fn elem_of(&self, key: OpKey) -> usize {
        self.ops[&key].elem
    }

    /// Whether a frame for member `to` may leave now ([`Machine::poll_frame`]).
    pub fn has_frame_for(&self, to: usize) -> bool {
        self.ops.values().any(|o| o.has_frame_for(to)) || self.p2p.has_frame_for(to)
    }

    /// What happened to collectives since the last call.
    pub fn poll_events(&mut self) -> Vec<(OpKey, OpEvent)> {
        let mut out = Vec::new();
        for (key, op) in &mut self.ops {
            out.extend(op.events.drain(..).map(|e| (*key, e)));
        }
        out
    }

    /// How transfers ended since the last call.
    pub fn poll_transfer_events(&mut self) -> Vec<(u64, Result<(), LinkError>)> {
        self.p2p.events()
    }

    /// The pieces of other processes' memory to read now, one per transfer that pulls
    /// ([`Machine::handle_pulled`] takes what each read gave).
    pub fn poll_pulls(&self) -> Vec<Pull> {
        self.p2p.pulls()
    }

    /// What reading `pull` out of its sender's process gave: bytes read, or why not.
    pub fn handle_pulled(&mut self, pull: &Pull, read: std::io::Result<usize>) {
        self.p2p.handle_pulled(pull, read);
        for (member, tx, rx) in self.p2p.pulled() {
            let stats = self.stats.entry(member).or_default();
            stats.tx_bytes += tx;
            stats.rx_bytes += rx;
        }
    }

    /// Records what the moves since the last call completed: a fold due, a collective's data
    /// moved (its lap starts), its lap come round.
    pub fn advance(&mut self) {
        for op in self.ops.values_mut() {
            op.check();
        }
    }

    /// The lanes failed with `e` (a stream to or from `e.rank()` broke, or cannot be had): every
    /// operation in flight fails with it, or asks, once its data moved.
    pub fn handle_broken(&mut self, e: LinkError) {
        self.break_lanes(e);
    }

    /// The failed lanes were closed: no link is left.
    pub fn handle_released(&mut self) {
        debug_assert!(self.broken.is_some(), "only failed lanes are released");
        for s in self.stats.values_mut() {
            (s.lanes_out, s.lanes_in) = (0, 0);
        }
        self.gone.fill(false);
    }

    /// A failure `e` of collective `key` (or, without one, of the lanes): every collective
    /// fails, the others as lost over the lanes `e` broke.
    fn fail(&mut self, key: Option<OpKey>, e: LinkError) -> LinksFailed {
        match key.and_then(|k| self.ops.get_mut(&k)).filter(|o| !o.finished) {
            Some(op) => {
                // Once its data moved, another member may hold every token and have committed:
                // only a mismatch (whose member never counts a token of ours, nor we of theirs,
                // so nobody committed) still fails it; anything else asks the master.
                let mismatch = matches!(e, LinkError::Mismatch { .. });
                op.events.push(if op.data_done && !mismatch {
                    OpEvent::LapBroken(format!("{e:?}"))
                } else {
                    OpEvent::Failed(e.clone())
                });
                op.finished = true;
                let reason = format!("collective {} failed over these streams: {e:?}", key.expect("found").seq);
                self.break_lanes(LinkError::Lost { rank: e.rank(), reason });
            }
            None => self.break_lanes(e),
        }
        debug_assert!(self.broken.is_some());
        LinksFailed
    }

    /// The lanes failed with `e`: every collective still in flight fails with it, or asks, once
    /// its data moved.
    fn break_lanes(&mut self, e: LinkError) {
        if self.broken.is_none() {
            log::debug!("the links of topology {} failed: {e:?}", self.epoch.0);
        }
        let e = self.broken.get_or_insert(e).clone();
        self.awaiting = false;
        for op in self.ops.values_mut().filter(|o| !o.finished) {
            op.finished = true;
            op.events.push(if op.data_done {
                OpEvent::LapBroken(format!("the streams failed: {e:?}"))
            } else {
                OpEvent::Failed(e.clone())
            });
        }
        self.p2p.fail_all(&e);
        self.early.clear();
        self.early_bytes = 0;
        debug_assert!(self.ops.values().all(|o| o.finished));
    }

    /// Member `from` closed one of its lanes to us between two frames (it left, having sent all
    /// it had): once every one is closed, only an operation that still expects something from it
    /// fails, as lost.
    pub fn handle_closed(&mut self, from: usize) -> Result<(), LinksFailed> {
        let stats = self.stats.entry(from).or_default();
        assert!(stats.lanes_in > 0, "a lane from member {from} closed that was never added");
        stats.lanes_in -= 1;
        log::debug!("rank {from} closed a stream to us in topology {}", self.epoch.0);
        if stats.lanes_in > 0 {
            return Ok(());
        }
        self.gone[from] = true;
        let lost = LinkError::Lost { rank: from, reason: "connection closed".into() };
        match self.ops.iter().find(|(_, o)| o.expects_from(from)) {
            Some((&key, _)) => Err(self.fail(Some(key), lost)),
            // Closed between frames: the other links hold no half frame, and go on.
            None => {
                self.p2p.fail_peer(from, &lost);
                Ok(())
            }
        }
    }

    /// A frame's header arrived from member `from`: where its body goes (`None` if it has none,
    /// or was applied whole). Checked against the schedule; a malformed or mismatched frame
    /// fails the links.
    pub fn handle_header(
        &mut self,
        from: usize,
        header: &[u8; FRAME_BYTES],
        now: Instant,
    ) -> Result<Option<Incoming>, LinksFailed> {
        debug_assert!(self.broken.is_none(), "nothing is read once the links failed");
        match Frame::decode(header) {
            Ok(frame) => self.begin_frame(from, frame, now).map_err(|(key, e)| self.fail(key, e)),
            Err(e) => Err(self.fail(None, LinkError::Malformed { rank: from, what: e.into() })),
        }
    }

    /// Decides where the body of `frame`, from member `from`, goes.
    fn begin_frame(
        &mut self,
        from: usize,
        frame: Frame,
        now: Instant,
    ) -> Result<Option<Incoming>, (Option<OpKey>, LinkError)> {
        let key = OpKey::of(&frame.op);
        let malformed = |what: Malformed| (None, LinkError::Malformed { rank: from, what });
        if frame.op.epoch != self.epoch {
            return Err(malformed(Malformed::ForeignTopology { got: frame.op.epoch.0, ours: self.epoch.0 }));
        }
        if frame.kind.is_transfer() {
            let dest = self.p2p.on_frame(from, &frame).map_err(|e| (None, e))?;
            return Ok(dest.map(|dest| Incoming { frame, unit: 0, got: 0, dest: Dest::Part(dest) }));
        }
        if frame.kind == FrameKind::Token && frame.len as usize != TOKEN_BYTES {
            return Err(malformed(Malformed::TokenLength { len: frame.len }));
        }
        let Some(op) = self.ops.get_mut(&key) else {
            if self.was_posted(key) {
                return Err(malformed(Malformed::Ended { seq: key.seq }));
            }
            // Early: its chunk waits in the lane for the collective to be posted here.
            if frame.kind == FrameKind::Chunk && frame.len as usize > MAX_EARLY_BYTES {
                return Err(malformed(Malformed::EarlyTooLarge { len: frame.len }));
            }
            if frame.len == 0 {
                self.early.entry(key).or_default().push(Early { from, frame, body: Vec::new() });
                return Ok(None);
            }
            return Ok(Some(Incoming { frame, unit: 0, got: 0, dest: Dest::Unposted(now) }));
        };
        if frame.op != op.spec.header {
            return Err((Some(key), LinkError::Mismatch { rank: from, theirs: frame.op }));
        }
        if frame.kind == FrameKind::Token {
            return Ok(Some(Incoming { frame, unit: 0, got: 0, dest: Dest::Token }));
        }
        let (unit, dest) = chunk_dest(op, &frame, from).map_err(|e| (Some(key), e))?;
        if frame.len == 0 {
            op.complete_recv(unit, Some(&[]));
            return Ok(None);
        }
        Ok(Some(Incoming { frame, unit, got: 0, dest }))
    }

    /// A frame from member `from` held in its lane for its collective ([`Incoming::held`]), at
    /// `now`: placed if the collective was posted since, read aside once the grace is over.
    pub fn handle_held(&mut self, from: usize, mut rx: Incoming, now: Instant) -> Result<Held, LinksFailed> {
        let since = rx.held().expect("a frame held in its lane");
        let (key, len) = (rx.key(), rx.len());
        // Posted since (even ended since): placed as if it arrived now.
        if self.was_posted(key) {
            return self.begin_frame(from, rx.frame, now).map(Held::Placed).map_err(|(key, e)| self.fail(key, e));
        }
        if now.saturating_duration_since(since) < self.early_grace {
            return Ok(Held::Waiting(rx));
        }
        // Not posted yet: kept aside, so that what follows it on the lane moves.
        self.early_bytes += len;
        // A spare's bytes are overwritten by the read: only new ones need zeroing.
        let mut body = self.spare_bodies.pop().unwrap_or_default();
        body.resize(len, 0);
        rx.dest = Dest::Early(body);
        Ok(Held::Aside(rx))
    }

    /// Where the rest of `rx`'s body is to be read: into the caller's buffer, a stash, the
    /// lane's `scratch` (grown to fit), a buffer of its own. Not for a frame held in its lane.
    pub fn body_target<'a>(&'a mut self, rx: &'a mut Incoming, scratch: &'a mut Vec<u64>) -> &'a mut [u8] {
        let (got, len, key) = (rx.got, rx.len(), rx.key());
        match &mut rx.dest {
            Dest::Buf(start) => {
                let op = self.ops.get(&key).expect("a frame into a buffer has its collective");
                // SAFETY: lent to the engine; the only slice of it in use until the read ends.
                let whole = unsafe { op.spec.buf.slice() };
                &mut whole[*start + got..*start + len]
            }
            Dest::Stash(start) => {
                let op = self.ops.get_mut(&key).expect("a frame into a stash has its collective");
                let stash: &mut [u8] = bytemuck::cast_slice_mut(&mut op.stash);
                &mut stash[*start + got..*start + len]
            }
            Dest::Scratch | Dest::Token => {
                let words = len.div_ceil(8);
                if scratch.len() < words {
                    scratch.resize(words, 0);
                }
                let s: &mut [u8] = bytemuck::cast_slice_mut(scratch);
                &mut s[got..len]
            }
            Dest::Early(body) => &mut body[got..len],
            Dest::Unposted(_) => unreachable!("a held frame is placed first"),
            Dest::Part(p) => {
                // SAFETY: lent to the engine; the only slice of it in use until the read ends.
                let whole = unsafe { self.p2p.buf(p.id).slice() };
                &mut whole[p.start + got..p.start + len]
            }
        }
    }

    /// `n` more bytes of `rx`'s body, from member `from`, were read.
    pub fn handle_body(&mut self, from: usize, rx: &mut Incoming, n: usize) {
        debug_assert!(rx.got + n <= rx.len(), "{} + {n} bytes of a {}-byte body", rx.got, rx.len());
        rx.got += n;
        match &rx.dest {
            Dest::Part(p) => self.p2p.count(p.id, n, false),
            // Not the collective's data: counted nowhere.
            Dest::Token => return,
            _ => {
                if let Some(op) = self.ops.get_mut(&rx.key()) {
                    op.traffic.rx_bytes += n as u64;
                }
            }
        }
        self.stats.entry(from).or_default().rx_bytes += n as u64;
    }

    /// `rx`'s whole body, from member `from`, was read: applied. `aside` holds it where it was
    /// read aside (the lane's scratch, or where the lane lends it).
    pub fn handle_chunk(&mut self, from: usize, rx: Incoming, aside: &[u8]) -> Result<(), LinksFailed> {
        debug_assert_eq!(rx.got, rx.len(), "a whole body");
        let (key, unit, len) = (rx.key(), rx.unit, rx.len());
        match rx.dest {
            Dest::Buf(_) | Dest::Stash(_) => {
                self.ops.get_mut(&key).expect("posted").complete_recv(unit, None);
                self.hot = Some(key);
            }
            Dest::Part(p) => self.p2p.part_done(p.id),
            Dest::Unposted(_) => unreachable!("a held frame is placed first"),
            Dest::Scratch => {
                self.ops.get_mut(&key).expect("posted").complete_recv(unit, Some(&aside[..len]));
                self.hot = Some(key);
            }
            Dest::Token => {
                let op = self.ops.get_mut(&key).expect("posted");
                if let Err(e) = op.token(from, rx.frame.unit, token_value(&aside[..len])) {
                    return Err(self.fail(Some(key), e));
                }
            }
            Dest::Early(body) => {
                let early = Early { from, frame: rx.frame, body };
                self.early_bytes -= early.body.len();
                // Posted while its chunk arrived: applied now.
                match self.ops.get_mut(&key) {
                    Some(op) => match apply_early(op, early) {
                        Ok(body) => self.spare_body(body),
                        Err(e) => return Err(self.fail(Some(key), e)),
                    },
                    None => {
                        self.early_bytes += early.body.len();
                        self.early.entry(key).or_default().push(early);
                    }
                }
            }
        }
        Ok(())
    }

    /// The next frame for a free lane to member `to`: collectives and transfers take turns, and
    /// within each the next one in turn with a frame for it that may leave.
    /// `now` is when it leaves: our own confirmation token says how long after its call we held
    /// the result.
    pub fn poll_frame(&mut self, to: usize, now: Instant) -> Option<Outgoing> {
        self.p2p_turn = !self.p2p_turn;
        let transfers_first = self.p2p_turn;
        if transfers_first {
            self.next_transfer_frame(to).or_else(|| self.next_collective_frame(to, now))
        } else {
            self.next_collective_frame(to, now).or_else(|| self.next_transfer_frame(to))
        }
    }

    /// The next transfer frame for member `to`.
    fn next_transfer_frame(&mut self, to: usize) -> Option<Outgoing> {
        let (frame, part) = self.p2p.next_frame(to)?;
        let body = match part {
            Some((id, start, len)) => Sending::Part { id, start, len },
            None => Sending::Control,
        };
        Some(Outgoing { header: frame.encode(), body })
    }

    /// The next collective frame in turn for member `to`.
    fn next_collective_frame(&mut self, to: usize, now: Instant) -> Option<Outgoing> {
        let turn = self.turn;
        self.hot_turn = !self.hot_turn;
        let hot = self.hot.filter(|s| self.hot_turn && self.ops.get(s).is_some_and(|o| o.has_frame_for(to)));
        let pick = hot.or_else(|| {
            let after = (std::ops::Bound::Excluded(turn), std::ops::Bound::Unbounded);
            let mut order = self.ops.range(after).chain(self.ops.range(..=turn)).map(|(k, _)| *k);
            order.find(|k| self.ops[k].has_frame_for(to))
        });
        let key = pick?;
        if hot.is_none() {
            self.turn = key;
        }
        let op = self.ops.get_mut(&key).expect("picked");
        let token = op.outbox.get_mut(&to).and_then(VecDeque::pop_front);
        if op.outbox.get(&to).is_some_and(VecDeque::is_empty) {
            op.outbox.remove(&to);
        }
        let (frame, body) = if let Some(origin) = token {
            let body = op.token_body(origin, now);
            let frame = Frame { kind: FrameKind::Token, len: TOKEN_BYTES as u32, unit: origin, op: op.spec.header };
            (frame, Sending::Token { key, body })
        } else {
            let (unit, place) = op.next_unit_for(to);
            let range = op.plan.sends[unit].range.clone();
            let len = op.wire_len(&range) as u32;
            let frame = Frame { kind: FrameKind::Chunk, len, unit: place, op: op.spec.header };
            match op.spec.codec {
                Some(codec) => (frame, Sending::Encoded { key, body: op.encoded_send(codec, unit) }),
                None => {
                    let r = op.bytes(&range);
                    (frame, Sending::Chunk { key, start: r.start, len: r.len() })
                }
            }
        };
        Some(Outgoing { header: frame.encode(), body })
    }

    /// The body of frame `out`, to write after its header.
    pub fn payload<'a>(&'a self, out: &'a Outgoing) -> &'a [u8] {
        match &out.body {
            Sending::Chunk { key, start, len, .. } => {
                // SAFETY: lent to the engine; the only slice of it in use until the write ends.
                let whole: &[u8] = unsafe { self.ops[key].spec.buf.slice() };
                &whole[*start..*start + *len]
            }
            Sending::Encoded { body, .. } => body,
            Sending::Part { id, start, len } => {
                // SAFETY: as above.
                let whole: &[u8] = unsafe { self.p2p.buf(*id).slice() };
                &whole[*start..*start + *len]
            }
            Sending::Token { body, .. } => body,
            Sending::Control => &[],
        }
    }

    /// `n` more bytes of frame `out` to member `to` went into its stream, `body` of them its
    /// body's.
    pub fn handle_written(&mut self, to: usize, out: &Outgoing, n: usize, body: usize) {
        debug_assert!(body <= n);
        // A token's body is not the collective's data: counted nowhere.
        let body = if matches!(out.body, Sending::Token { .. }) { 0 } else { body };
        let link = self.stats.entry(to).or_default();
        link.tx_bytes += body as u64;
        link.wrote(n);
        match out.body {
            Sending::Chunk { key, .. } | Sending::Encoded { key, .. } | Sending::Token { key, .. } => {
                let op = self.ops.get_mut(&key).expect("a frame of a collective in flight");
                op.traffic.tx_bytes += body as u64;
            }
            Sending::Part { id, .. } => self.p2p.count(id, body, true),
            Sending::Control => {}
        }
    }

    /// A lane to member `to` found its stream full with a frame to write, at `now`.
    pub fn handle_blocked(&mut self, to: usize, now: Instant) {
        self.stats.entry(to).or_default().blocked(now);
    }

    /// A frame that found its lane's stream full went in whole, at `now`.
    pub fn handle_unblocked(&mut self, to: usize, now: Instant) {
        self.stats.entry(to).or_default().unblocked(now);
    }

    /// Frame `out` to member `to` went into its stream whole.
    pub fn handle_sent(&mut self, to: usize, out: Outgoing) {
        match out.body {
            Sending::Chunk { key, .. } | Sending::Encoded { key, .. } => {
                let op = self.ops.get_mut(&key).expect("in flight");
                op.chunk_sent(to);
                op.check();
            }
            Sending::Token { key, .. } => {
                let op = self.ops.get_mut(&key).expect("in flight");
                op.tokens_out += 1;
                op.check();
            }
            Sending::Part { id, .. } => self.p2p.part_done(id),
            Sending::Control => {
                let frame = Frame::decode(&out.header).expect("encoded here");
                self.p2p.sent(to, &frame);
            }
        }
    }

    /// Keeps an early frame's buffer for the next one (a few chunks' worth at most).
    fn spare_body(&mut self, body: Vec<u8>) {
        if self.spare_bodies.len() < SPARE_BODIES && body.capacity() > 0 {
            self.spare_bodies.push(body);
        }
    }

    /// Where each operation stands, for a failure's log.
    pub fn describe(&self) -> String {
        let ops: Vec<String> = self
            .ops
            .iter()
            .map(|(k, o)| {
                let (sent, received) = (o.sent, o.received);
                let (sends, recvs) = (o.plan.sends.len(), o.plan.recvs.len());
                let group = if k.derived == 0 { String::new() } else { format!(" of {:#x}", k.derived) };
                format!("#{}{group}: sent {sent}/{sends}, received {received}/{recvs}", k.seq)
            })
            .collect();
        format!("collectives [{}], {}", ops.join("; "), self.p2p.describe())
    }

    /// Whether collective `key` received everything it receives from member `from`.
    #[cfg(test)]
    pub(crate) fn received_all_from(&self, key: OpKey, from: usize) -> bool {
        self.ops.get(&key).is_some_and(|o| o.sub(from).is_some_and(|f| o.recvs_from[f].iter().all(|&u| o.recv_done[u])))
    }

    /// Bytes kept for collectives not posted here.
    #[cfg(test)]
    pub(crate) fn early_bytes(&self) -> usize {
        self.early_bytes
    }
}

/// A collective in flight. Its schedule runs over the members of its group, by their rank there
/// (`plan.rank`, `plan.world`); what it says to the machine names the topology's ranks
/// (`members` and [`OpExec::sub`] translate).
struct OpExec {
    spec: OpSpec,
    plan: Schedule,
    /// The topology's rank of each member of its group, by rank in the group.
    members: Vec<usize>,
    /// By the topology's rank: its rank in the group, [`NOT_A_MEMBER`] if none.
    index: Vec<usize>,
    elem: usize,
    /// For each member (by rank in the group, as every array of members below), the indices of
    /// the units we send it in order, the next one's place, and how many are still to be written
    /// whole.
    sends_to: Vec<Vec<usize>>,
    next_send: Vec<usize>,
    sends_left: Vec<usize>,
    /// The members it sends chunks or tokens to, and those it receives them from, by the
    /// topology's rank: the links it needs (the schedule's, computed once).
    peers_to: Vec<usize>,
    peers_from: Vec<usize>,
    /// For each member, the indices of the units we receive from it in order: a frame names
    /// its place in this order.
    recvs_from: Vec<Vec<usize>>,
    /// The ranks in the group it sends data to or receives data from.
    partners: Vec<usize>,
    sent: usize,
    recv_done: Vec<bool>,
    received: usize,
    /// Units over the same elements share one save: the first unit with each range.
    first_unit: Vec<usize>,
    /// Final reductions still to come, by the first element of their range: an average is
    /// divided after the last of them.
    lasts: std::collections::BTreeMap<usize, usize>,
    saved: Vec<bool>,
    save_cursor: usize,
    /// Whether the range the schedule folds is saved, and how many of its folds ran.
    saved_fold: bool,
    folded: usize,
    /// Units to keep aside that did not arrive yet, by the fold that reads them.
    to_stash: Vec<usize>,
    /// Each group rank's slot in the stash and the fold that reads it, if it has one (by rank
    /// in the group).
    slot: Vec<(usize, usize)>,
    backup: Backup,
    /// The inputs kept aside ([`Schedule::stashed`]), one slot of the buffer's size each, for a
    /// schedule that folds them (empty otherwise).
    stash: Vec<u64>,
    traffic: Traffic,
    data_done: bool,
    /// Tokens received, in all and from each member, and those to send: (to whom by the
    /// topology's rank, whose), ours first once the data moved.
    tokens_in: usize,
    tokens_from: Vec<usize>,
    /// How many tokens come from each member, by rank in the group.
    tokens_due: Vec<usize>,
    tokens_out: usize,
    /// Tokens the schedule has this rank send in all ([`Schedule::tokens_sent`]).
    tokens_to_send: usize,
    /// Tokens to send, by the topology's member they go to: the origin of each, in order.
    outbox: BTreeMap<usize, VecDeque<u32>>,
    /// Tokens received before the data moved: forwarded after ours.
    held: Vec<u32>,
    /// What each member's token says, by rank in the group: how long after its call it held the
    /// result, microseconds (ours once our first token leaves).
    ready: Vec<Option<u64>>,
    /// Events not returned yet.
    events: Vec<OpEvent>,
    finished: bool,
    /// A quantized collective's chunks as they travel, by the first element of their range
    /// (with its end): each is what the buffer holds over that range (its decoded values), so
    /// what we send is what we hold. A chunk is encoded once, when first sent, and its decoded
    /// values replace the buffer's; a chunk copied into place keeps its bytes to be forwarded as
    /// they came (where it forwards them), never re-encoded; a reduction or the fold over a
    /// range drops its entry.
    encoded: BTreeMap<usize, (usize, Arc<[u8]>)>,
    /// For each receive unit of a quantized collective, whether a send waits for it (forwards
    /// it): only those chunks are kept.
    forwarded: Vec<bool>,
}

/// In [`OpExec::index`]: a rank of the topology outside the collective's group.
const NOT_A_MEMBER: usize = usize::MAX;

impl OpExec {
    /// Collective `spec`, where we are `rank` of the topology's `world`.
    fn new(mut spec: OpSpec, rank: usize, world: usize) -> Self {
        let members: Vec<usize> =
            if spec.members.is_empty() { (0..world).collect() } else { std::mem::take(&mut spec.members) };
        let mut index = vec![NOT_A_MEMBER; world];
        for (r, &m) in members.iter().enumerate() {
            assert!(m < world && index[m] == NOT_A_MEMBER, "member {m} of a group of a topology of {world}, twice?");
            index[m] = r;
        }
        assert_ne!(index[rank], NOT_A_MEMBER, "a collective of a group we are not in");
        let (rank, world) = (index[rank], members.len());
        let elem = spec.dtype.size();
        let chunk_elems = (spec.chunk_bytes / elem).max(1);
        let len = spec.buf.len / elem;
        let plan = spec.algorithm.schedule(spec.kind, (rank, world), &spec.hosts, len, spec.root, chunk_elems);
        let tokens_to_send = plan.tokens_sent();
        // Counted once: a token arrives for each of `world - 1` origins, and checking each
        // against a count made afresh cost a 1,000-member group a billion steps per collective.
        let mut tokens_due = vec![0; world];
        for origin in (0..world).filter(|&o| o != rank) {
            tokens_due[plan.token_from(origin)] += 1;
        }
        let lasts = plan.final_reductions();
        let mut first_of_range = std::collections::HashMap::with_capacity(plan.recvs.len());
        let first_unit: Vec<usize> =
            plan.recvs.iter().enumerate().map(|(i, u)| *first_of_range.entry(u.range.start).or_insert(i)).collect();
        let mut sends_to = vec![Vec::new(); world];
        for (i, u) in plan.sends.iter().enumerate() {
            sends_to[u.to].push(i);
        }
        let mut recvs_from = vec![Vec::new(); world];
        for (i, u) in plan.recvs.iter().enumerate() {
            recvs_from[u.from].push(i);
        }
        let partners = (0..world).filter(|&r| !sends_to[r].is_empty() || !recvs_from[r].is_empty()).collect();
        let mut backup = std::mem::take(&mut spec.backup);
        backup.reset(spec.buf.len);
        // A quantized collective also changes what it sends (to the decoded values): the whole
        // buffer is saved up front rather than range by range.
        let quantized = spec.codec.is_some();
        if quantized {
            // SAFETY: lent to the engine; the only slice of it in use.
            backup.save(unsafe { spec.buf.slice() }, 0..spec.buf.len);
        }
        let stashed = plan.stashed();
        let mut slot = vec![(NOT_A_MEMBER, 0); if plan.combines() { world } else { 0 }];
        for (i, &r) in stashed.iter().enumerate() {
            slot[r].0 = i;
        }
        for (k, f) in plan.combine.iter().flat_map(|c| c.folds.iter().enumerate()) {
            for &r in f.ranks.iter().filter(|&&r| r != rank) {
                slot[r].1 = k;
            }
        }
        let stash = vec![0u64; (stashed.len() * spec.buf.len).div_ceil(8)];
        let mut forwarded = vec![false; if quantized { plan.recvs.len() } else { 0 }];
        for u in plan.sends.iter().filter(|_| quantized) {
            for i in [u.after_recv, u.and_after_recv].into_iter().flatten() {
                forwarded[i] = true;
            }
        }
        let mut to_stash = vec![0; plan.folds()];
        for u in plan.recvs.iter().filter(|u| u.action == RecvAction::Stash) {
            to_stash[slot[u.from].1] += 1;
        }
        OpExec {
            saved: vec![quantized; plan.recvs.len()],
            recv_done: vec![false; plan.recvs.len()],
            first_unit,
            lasts,
            sends_left: sends_to.iter().map(Vec::len).collect(),
            peers_to: plan.peers_to().into_iter().map(|r| members[r]).collect(),
            peers_from: plan.peers_from().into_iter().map(|r| members[r]).collect(),
            members,
            index,
            sends_to,
            partners,
            recvs_from,
            next_send: vec![0; world],
            plan,
            elem,
            spec,
            sent: 0,
            received: 0,
            save_cursor: 0,
            saved_fold: quantized,
            folded: 0,
            to_stash,
            slot,
            backup,
            stash,
            traffic: Traffic::default(),
            data_done: false,
            tokens_in: 0,
            tokens_from: vec![0; world],
            tokens_due,
            tokens_out: 0,
            tokens_to_send,
            outbox: BTreeMap::new(),
            held: Vec::new(),
            ready: vec![None; world],
            events: Vec::new(),
            finished: false,
            encoded: BTreeMap::new(),
            forwarded,
        }
    }

    /// Bytes on the wire of the chunk over `range` (elements).
    fn wire_len(&self, range: &std::ops::Range<usize>) -> usize {
        self.spec.codec.map_or(range.len() * self.elem, |c| c.encoded_len(range.len()))
    }

    /// The encoded chunk of send unit `unit` of a quantized collective: the one kept for its
    /// range, else encoded now, its decoded values left in the buffer.
    fn encoded_send(&mut self, codec: Codec, unit: usize) -> Arc<[u8]> {
        let range = self.plan.sends[unit].range.clone();
        if let Some((end, body)) = self.encoded.get(&range.start) {
            if *end == range.end {
                return Arc::clone(body);
            }
        }
        let mut body = vec![0u8; codec.encoded_len(range.len())];
        let r = self.bytes(&range);
        // SAFETY: lent to the engine; the only slice of it in use.
        let buf = &mut unsafe { self.spec.buf.slice() }[r];
        codec.round_trip(buf, &mut body).expect("aligned buffers");
        let body: Arc<[u8]> = body.into();
        self.forget_encoded(&range);
        self.encoded.insert(range.start, (range.end, Arc::clone(&body)));
        body
    }

    /// Drops the encoded chunks over any of `range`: the buffer changed there.
    fn forget_encoded(&mut self, range: &std::ops::Range<usize>) {
        let stale: Vec<usize> =
            self.encoded.range(..range.end).filter(|(_, (end, _))| *end > range.start).map(|(s, _)| *s).collect();
        for s in stale {
            self.encoded.remove(&s);
        }
    }

    /// Applies received unit `unit` of a quantized collective, whose encoded chunk is `src`.
    fn complete_encoded_recv(&mut self, codec: Codec, unit: usize, src: &[u8]) {
        let u = &self.plan.recvs[unit];
        let range = u.range.clone();
        let r = self.bytes(&range);
        match u.action {
            RecvAction::Reduce { last } => {
                // SAFETY: lent to the engine; the only slice of it in use.
                let dst = &mut unsafe { self.spec.buf.slice() }[r];
                codec.add_decoded(src, dst).expect("aligned buffers");
                self.finish_reduction(unit, last);
                self.forget_encoded(&range);
            }
            RecvAction::Copy => {
                // SAFETY: lent to the engine; the only slice of it in use.
                let dst = &mut unsafe { self.spec.buf.slice() }[r];
                codec.decode(src, dst).expect("aligned buffers");
                self.forget_encoded(&range);
                if self.forwarded[unit] {
                    self.encoded.insert(range.start, (range.end, src.into()));
                }
            }
            RecvAction::Stash => {
                let at = self.stash_offset(unit);
                let stash: &mut [u8] = bytemuck::cast_slice_mut(&mut self.stash);
                codec.decode(src, &mut stash[at..at + r.len()]).expect("aligned buffers");
            }
        }
    }

    /// Counts a reduction of receive unit `unit`'s range: after the last, an average divides.
    fn finish_reduction(&mut self, unit: usize, last: bool) {
        let u = &self.plan.recvs[unit];
        let left = self.lasts.entry(u.range.start).or_default();
        *left = left.saturating_sub(usize::from(last));
        if last && *left == 0 && self.spec.op == ReduceOp::Avg {
            let r = self.bytes(&u.range);
            // SAFETY: lent to the engine; the only slice of it in use.
            let dst = &mut unsafe { self.spec.buf.slice() }[r];
            finish_avg(self.spec.dtype, dst, self.plan.world).expect("aligned buffer");
        }
    }

    fn bytes(&self, range: &std::ops::Range<usize>) -> std::ops::Range<usize> {
        range.start * self.elem..range.end * self.elem
    }

    /// Saves the original bytes of receive unit `unit`'s range unless already saved. A unit kept
    /// aside changes nothing of the buffer (the fold saves what it changes, before).
    fn save_before_change(&mut self, unit: usize) {
        let first = self.first_unit[unit];
        if !self.saved[first] && self.plan.recvs[unit].action != RecvAction::Stash {
            self.saved[first] = true;
            let r = self.bytes(&self.plan.recvs[unit].range);
            // SAFETY: lent to the engine; the only slice of it in use.
            self.backup.save(unsafe { self.spec.buf.slice() }, r);
        }
    }

    /// Saves the range the schedule folds unless saved: the fold changes it all at once.
    fn save_fold(&mut self) {
        if let Some(c) = self.plan.combine.as_ref().filter(|_| !self.saved_fold) {
            self.saved_fold = true;
            let r = self.bytes(&c.range);
            // SAFETY: lent to the engine; the only slice of it in use.
            self.backup.save(unsafe { self.spec.buf.slice() }, r);
        }
    }

    /// The group's rank of the topology's member `member`, if it is in the group.
    fn sub(&self, member: usize) -> Option<usize> {
        self.index.get(member).copied().filter(|&r| r != NOT_A_MEMBER)
    }

    /// The next unit for the topology's member `to`, if it may leave now.
    fn sendable(&self, to: usize) -> Option<usize> {
        let to = self.sub(to)?;
        let i = *self.sends_to[to].get(self.next_send[to])?;
        let u = &self.plan.sends[i];
        u.ready(|j| self.recv_done[j], self.folded).then_some(i)
    }

    /// Takes the next unit for the topology's member `to` (it may leave now): the unit, and its
    /// place among our units for `to`, which is the receiver's among its units from us.
    fn next_unit_for(&mut self, to: usize) -> (usize, u32) {
        let unit = self.sendable(to).expect("a unit that may leave");
        let t = self.index[to];
        let place = self.next_send[t] as u32;
        self.next_send[t] += 1;
        (unit, place)
    }

    /// A chunk for the topology's member `to` went into its stream whole.
    fn chunk_sent(&mut self, to: usize) {
        let t = self.index[to];
        debug_assert!(self.sends_left[t] > 0, "a chunk more than the schedule sends");
        self.sent += 1;
        self.sends_left[t] -= 1;
    }

    /// Queues the tokens of `origins` (ranks in the group) for the members the schedule forwards
    /// each to.
    fn forward_tokens(&mut self, origins: impl IntoIterator<Item = u32>) {
        for origin in origins {
            let to = self.plan.forward_token(origin as usize);
            for r in to {
                self.outbox.entry(self.members[r]).or_default().push_back(origin);
            }
        }
    }

    /// Whether a frame for member `to` may leave now.
    fn has_frame_for(&self, to: usize) -> bool {
        !self.finished && (self.outbox.contains_key(&to) || self.sendable(to).is_some())
    }

    /// Applies received unit `unit` whose bytes are in `src` (for a reduction) or in place.
    /// A quantized collective's chunks are all aside in `src`, encoded.
    fn complete_recv(&mut self, unit: usize, src: Option<&[u8]>) {
        let r = self.bytes(&self.plan.recvs[unit].range);
        if let Some(codec) = self.spec.codec {
            self.complete_encoded_recv(codec, unit, src.expect("a quantized chunk is aside"));
        } else if let RecvAction::Reduce { last } = self.plan.recvs[unit].action {
            self.save_before_change(unit);
            let src = src.expect("a reduction has its chunk aside");
            // SAFETY: lent to the engine; the only slice of it in use.
            let dst = &mut unsafe { self.spec.buf.slice() }[r];
            // Lengths match and both buffers are aligned: checked at the API boundary and here.
            reduce_into(self.spec.dtype, self.spec.op, dst, src).expect("aligned buffers");
            self.finish_reduction(unit, last);
        }
        if unit == 0 {
            shoal_config::failpoint("all_reduce.reduce_scatter");
        } else if self.plan.recvs[unit].action == RecvAction::Copy
            && (unit == 0 || self.plan.recvs[unit - 1].action != RecvAction::Copy)
        {
            shoal_config::failpoint("all_reduce.all_gather");
        }
        self.recv_done[unit] = true;
        self.received += 1;
        if self.plan.recvs[unit].action == RecvAction::Stash {
            self.to_stash[self.slot[self.plan.recvs[unit].from].1] -= 1;
        }
    }

    /// Where in the stash the chunk of unit `unit` goes.
    fn stash_offset(&self, unit: usize) -> usize {
        let u = &self.plan.recvs[unit];
        self.slot[u.from].0 * self.spec.buf.len + self.bytes(&u.range).start
    }

    /// Runs the schedule's next fold over its range: the same fold on every member that runs it
    /// (see `shoal_collective::schedule::Fold`).
    fn fold(&mut self) {
        self.save_fold();
        let Some(c) = self.plan.combine.as_ref() else { return };
        let f = &c.folds[self.folded];
        if c.range.is_empty() {
            // Nothing of ours to fold (two-shot's block of a short buffer): nothing was kept aside.
            self.folded += 1;
            return;
        }
        let r = self.bytes(&c.range);
        let range = c.range.clone();
        let (len, rank, world) = (self.spec.buf.len, self.plan.rank, self.plan.world);
        let (dtype, op) = (self.spec.dtype, self.spec.op);
        // SAFETY: lent to the engine; the only slice of it in use.
        let buf = &mut unsafe { self.spec.buf.slice() }[r.clone()];
        let stash: &mut [u8] = bytemuck::cast_slice_mut(&mut self.stash);
        let at = |k: usize| self.slot[k].0 * len + r.start..self.slot[k].0 * len + r.end;
        if f.ranks[0] == rank {
            for &k in &f.ranks[1..] {
                reduce_into(dtype, op, buf, &stash[at(k)]).expect("aligned buffers");
            }
        } else {
            // Fold into the first rank's input, kept aside, then take the result.
            let first = at(f.ranks[0]);
            for &k in &f.ranks[1..] {
                if k == rank {
                    reduce_into(dtype, op, &mut stash[first.clone()], buf).expect("aligned buffers");
                } else {
                    let (acc, src) = two_ranges(stash, first.clone(), at(k));
                    reduce_into(dtype, op, acc, src).expect("aligned buffers");
                }
            }
            buf.copy_from_slice(&stash[first]);
        }
        if op == ReduceOp::Avg && f.completes {
            finish_avg(dtype, buf, world).expect("aligned buffer");
        }
        self.folded += 1;
        self.forget_encoded(&range);
    }

    /// A token of `origin`'s (a rank in the group), saying it held the result `ready_us` after
    /// its call, arrived from the topology's member `member`.
    fn token(&mut self, member: usize, origin: u32, ready_us: u64) -> Result<(), LinkError> {
        let world = self.plan.world as u32;
        let o = origin as usize;
        let malformed = |what| LinkError::Malformed { rank: member, what };
        let from = self.sub(member).ok_or(malformed(Malformed::Outsider { derived: self.spec.header.derived }))?;
        let expected = self.tokens_expected(from);
        if origin >= world
            || o == self.plan.rank
            || self.plan.token_from(o) != from
            || self.tokens_from[from] == expected
        {
            return Err(malformed(Malformed::BadToken { origin, world }));
        }
        self.tokens_in += 1;
        self.tokens_from[from] += 1;
        self.ready[o] = Some(ready_us);
        if self.data_done {
            self.forward_tokens([origin]);
        } else {
            self.held.push(origin);
        }
        Ok(())
    }

    /// The body of `origin`'s token, leaving `now`: the first of ours records how long after
    /// the call we held the result.
    fn token_body(&mut self, origin: u32, now: Instant) -> [u8; TOKEN_BYTES] {
        let called = self.spec.called;
        let ready = self.ready[origin as usize].get_or_insert_with(|| {
            debug_assert_eq!(origin as usize, self.plan.rank, "a forwarded token's figure came with it");
            now.saturating_duration_since(called).as_micros().min(u64::MAX.into()) as u64
        });
        ready.to_le_bytes()
    }

    /// How many tokens come from the group's member `from`.
    fn tokens_expected(&self, from: usize) -> usize {
        self.tokens_due[from]
    }

    /// Whether anything more of it is to come from the topology's member `member`.
    fn expects_from(&self, member: usize) -> bool {
        let Some(from) = self.sub(member) else { return false };
        !self.finished
            && (self.recvs_from[from].iter().any(|&u| !self.recv_done[u])
                || self.tokens_from[from] < self.tokens_expected(from))
    }

    /// The topology's members it still moves data to or from, in order: a frozen member it does
    /// never lets it finish, one it is done with cannot stop it. Only the ranks its schedule
    /// moves data with are looked at: a ring's two of a thousand.
    fn waits_on_members(&self) -> Vec<usize> {
        if self.data_done {
            return Vec::new();
        }
        let waits = |&r: &usize| self.sends_left[r] > 0 || self.recvs_from[r].iter().any(|&u| !self.recv_done[u]);
        let mut members: Vec<usize> = self.partners.iter().filter(|r| waits(r)).map(|&r| self.members[r]).collect();
        members.sort_unstable();
        members
    }

    /// Records what the latest moves completed.
    fn check(&mut self) {
        if self.finished {
            return;
        }
        while let Some(f) = self.plan.combine.as_ref().and_then(|c| c.folds.get(self.folded)) {
            if self.to_stash[self.folded] > 0 || self.sent < f.after_sends {
                break;
            }
            self.fold();
        }
        let folded = self.folded == self.plan.folds();
        if !self.data_done && folded && self.sent == self.plan.sends.len() && self.received == self.plan.recvs.len() {
            self.data_done = true;
            self.events.push(OpEvent::DataDone);
            let me = self.plan.rank as u32;
            for r in self.plan.token_targets() {
                self.outbox.entry(self.members[r]).or_default().push_back(me);
            }
            let held = std::mem::take(&mut self.held);
            self.forward_tokens(held);
        }
        if self.data_done && self.tokens_in == self.plan.world - 1 && self.tokens_out == self.tokens_to_send {
            self.finished = true;
            self.events.push(OpEvent::Confirmed);
        }
    }
}

/// Where the chunk of `frame` (a frame of `op` from the topology's member `member`) goes,
/// checked against the schedule.
fn chunk_dest(op: &mut OpExec, frame: &Frame, member: usize) -> Result<(usize, Dest), LinkError> {
    let place = frame.unit as usize;
    let malformed = |what: Malformed| LinkError::Malformed { rank: member, what };
    let from = op.sub(member).ok_or(malformed(Malformed::Outsider { derived: frame.op.derived }))?;
    let Some(&unit) = op.recvs_from[from].get(place) else {
        return Err(malformed(Malformed::NoSuchChunk { place, expected: op.recvs_from[from].len() }));
    };
    let u = &op.plan.recvs[unit];
    let r = op.bytes(&u.range);
    let wire = op.wire_len(&u.range);
    if op.recv_done[unit] || frame.len as usize != wire {
        let again = op.recv_done[unit];
        return Err(malformed(Malformed::BadChunk { place, len: frame.len, expected: wire, again }));
    }
    if op.spec.codec.is_some() {
        // Decoded once complete (the whole buffer is saved already).
        return Ok((unit, Dest::Scratch));
    }
    let dest = match u.action {
        RecvAction::Copy => {
            op.save_before_change(unit);
            Dest::Buf(r.start)
        }
        RecvAction::Reduce { .. } => Dest::Scratch,
        RecvAction::Stash => Dest::Stash(op.stash_offset(unit)),
    };
    Ok((unit, dest))
}

/// Applies a frame that came before its collective was posted; returns its body's buffer.
fn apply_early(op: &mut OpExec, early: Early) -> Result<Vec<u8>, LinkError> {
    if early.frame.op != op.spec.header {
        return Err(LinkError::Mismatch { rank: early.from, theirs: early.frame.op });
    }
    if early.frame.kind == FrameKind::Token {
        return op.token(early.from, early.frame.unit, token_value(&early.body)).map(|()| early.body);
    }
    op.traffic.rx_bytes += early.body.len() as u64;
    let (unit, dest) = chunk_dest(op, &early.frame, early.from)?;
    match dest {
        Dest::Buf(start) => {
            // SAFETY: lent to the engine; the only slice of it in use.
            let whole = unsafe { op.spec.buf.slice() };
            whole[start..start + early.body.len()].copy_from_slice(&early.body);
            op.complete_recv(unit, None);
        }
        Dest::Stash(start) => {
            let stash: &mut [u8] = bytemuck::cast_slice_mut(&mut op.stash);
            stash[start..start + early.body.len()].copy_from_slice(&early.body);
            op.complete_recv(unit, None);
        }
        _ => op.complete_recv(unit, Some(&early.body)),
    }
    Ok(early.body)
}

/// The figure a token's body carries (its length checked with its header).
fn token_value(body: &[u8]) -> u64 {
    u64::from_le_bytes(body[..TOKEN_BYTES].try_into().expect("a token's body"))
}

/// Two disjoint ranges of `bytes`: the first mutable, the second to read.
fn two_ranges(bytes: &mut [u8], a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> (&mut [u8], &[u8]) {
    debug_assert!(a.end <= b.start || b.end <= a.start, "overlapping ranges");
    if a.start < b.start {
        let (lo, hi) = bytes.split_at_mut(b.start);
        (&mut lo[a], &hi[..b.len()])
    } else {
        let (lo, hi) = bytes.split_at_mut(a.start);
        (&mut hi[..a.len()], &lo[b])
    }
}
