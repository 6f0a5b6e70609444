//! Tagged point-to-point transfers: a send to one member, matched there with a receive from us
//! by tag, in any order of calls on either side.
//!
//! A transfer is a rendezvous over the link's lanes, beside the collectives:
//!
//! ```text
//!  sender                               receiver
//!  send(tag 7) ── Offer #n (tag, dtype, count) ──▶ kept until a receive from us with tag 7
//!                                                   is posted (the earliest such, if several)
//!              ◀──────── Accept #n ──────────────  dtype and count match
//!              ── Part #n/0, Part #n/1, ... ────▶  straight into the receive's buffer
//!              ◀──────── Received #n ───────────  done once every part arrived
//!  done
//!
//!              ◀──────── Refuse #n (its dtype, count) ─  they differ: both ends fail with a
//!                                                         mismatch that names both calls
//!  (timed out before an answer)
//!              ── Withdraw #n ─────────────────▶  the offer goes; a receive that took it
//!                                                   waits for another send
//! ```
//!
//! Between processes on one host (shared-memory lanes, whose kernel-checked peer credentials
//! name the other process), an offer of [`PULL_MIN_BYTES`] or more also carries the address of
//! the sender's buffer, and the receiver copies it straight from there into its own with
//! `process_vm_readv(2)`: one copy instead of two through a ring, and no lane busy with it.
//!
//! ```text
//!  send(tag 7) ── Offer #n (…, address) ──────▶  reads the buffer out of the sender's process
//!              ◀──────── Pulled #n ───────────   every byte read
//!  done        ── Confirmed #n ──────────────▶   done: the sender held its buffer throughout
//! ```
//!
//! The receiver ends only on `Confirmed`: a sender whose call gave up before `Pulled` arrived
//! sent `Withdraw` instead, and the receive waits for another send, whatever it read.
//!
//! Either way the end that decides ends first (the receiver, once it holds every part; the
//! sender, once it knows its buffer was read while it held it) and the other on its word, one
//! frame behind: a send never ends while its parts are still on their way, so links that fail
//! under them fail both ends. (Stopped while that word travels, the end waiting for it asks the
//! decider through the master how it ended: `shoal_proto::peer::Transfers`.) A read the
//! kernel refuses (another user, Yama's `ptrace_scope`) or that finds no such memory falls back
//! to `Accept` and parts; after a refusal, that member's offers are answered with `Accept`.
//!
//! `#n` numbers the sender's transfers to that member, so parts of two transfers with one tag
//! never mix, whatever lane each part takes. An offer also names the sender's previous transfer to
//! that member with its tag that was still in flight when it was posted: several with one tag
//! match the receives posted for it in the order both sides made them (MPI's "non-overtaking"),
//! whatever lane each offer takes; an offer that overtook that one waits until it is answered or
//! withdrawn. (A link, not a count per tag: nothing is kept per tag once its transfers end.)
//!
//! A receive from any of several members ([`End::AnyOf`]) takes the earliest offer with its tag,
//! from whichever of them, that is next in its sender's order; an arriving offer goes to the
//! earliest posted receive that can take it, from its member or from any.
//!
//! No data moves before its receive is posted: calls in any order need no buffer beyond a few
//! bytes per waiting offer ([`MAX_WAITING_OFFERS`]), and a lane never carries bytes nobody asked
//! for ahead of those somebody waits for.

use super::{Frame, LinkError, Malformed, RawBuf, Traffic};
use shoal_collective::Algorithm;
use shoal_collective::DType;
use shoal_wire::{Epoch, FrameKind, OpHeader};
use std::collections::{BTreeMap, VecDeque};

/// Smallest transfer a receiver on the same host reads straight out of the sender's memory;
/// below it the two copies through a ring cost less than the system call.
pub const PULL_MIN_BYTES: usize = 64 << 10;
/// Most bytes of one transfer a pump reads out of the sender's memory: other operations move
/// in between.
const PULL_PIECE_BYTES: usize = 2 << 20;

/// Most offers kept waiting for their receive, from all members together: past it, the member
/// whose offer overflows is malformed (an application with that many sends unanswered has lost
/// track of its tags).
pub const MAX_WAITING_OFFERS: usize = 4096;

/// Which end of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// `send`: ours goes to the member.
    Send,
    /// `recv`: the member's comes into ours.
    Recv,
}

impl Direction {
    /// The verb's name.
    pub fn name(self) -> &'static str {
        match self {
            Direction::Send => "send",
            Direction::Recv => "recv",
        }
    }
}

/// The other end of a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// This member, by rank.
    Member(usize),
    /// Whichever of these members (by rank) sends first: a receive from any member of a group.
    AnyOf(Vec<usize>),
}

impl End {
    /// The member, where one is named.
    pub fn member(&self) -> Option<usize> {
        match self {
            End::Member(p) => Some(*p),
            End::AnyOf(_) => None,
        }
    }

    /// Whether member `rank` may be the other end.
    pub fn admits(&self, rank: usize) -> bool {
        match self {
            End::Member(p) => *p == rank,
            End::AnyOf(members) => members.contains(&rank),
        }
    }
}

/// A transfer to post: `buf` is sent to, or received from, member `peer`.
pub struct TransferSpec {
    /// Which end we are.
    pub direction: Direction,
    /// The member at the other end: a receive may take the first of several.
    pub peer: End,
    /// What matches it with the other end's call.
    pub tag: u64,
    /// Its elements' type: both ends must agree, as on its size.
    pub dtype: DType,
    /// What is sent, or where it is received.
    pub buf: RawBuf,
    /// The largest part a frame carries.
    pub chunk_bytes: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// A send whose offer is not on a lane yet.
    Offering,
    /// A send waiting for the receiver's answer.
    Offered,
    /// A receive waiting for an offer.
    Waiting,
    /// Parts move.
    Moving,
    /// A send whose every part was written, waiting for the receiver's `Received`.
    Delivered,
    /// The end that decides (a receive that holds every part, a send whose buffer was read),
    /// waiting for its word to the other end (`Received`, `Confirmed`) to be written: links that
    /// fail before fail it too, as they fail the other end, still waiting for that word.
    Acknowledging,
    /// A receive reading the sender's buffer at `addr` out of process `pid`.
    Pulling { pid: u32, addr: u64 },
    /// A receive that read all of it, waiting for the sender's `Confirmed`.
    Confirming,
}

struct Transfer {
    spec: TransferSpec,
    /// The member at the other end, once known (a receive from any member: once it took an offer).
    peer: Option<usize>,
    /// The sender's number of it among its transfers to the receiver, once known here.
    number: Option<u64>,
    /// A send: 1 + the number of our previous send to its member with its tag still posted when
    /// it was (0: none), which the receiver answers first. A receive: its offer's.
    after: u64,
    stage: Stage,
    part_bytes: usize,
    parts: usize,
    /// Parts handed to lanes (a send).
    next_part: usize,
    /// Parts written (a send) or received (a receive).
    done_parts: usize,
    /// Which parts arrived (a receive).
    got: Vec<bool>,
    /// Bytes read out of the sender's memory (a receive that pulls).
    pulled: usize,
    /// Whether its offer carried the buffer's address (a send).
    offered_pull: bool,
    /// Whether the receiver said every part arrived (a send).
    received: bool,
    traffic: Traffic,
    finished: bool,
}

/// A piece of a sender's buffer for a receive to read out of the sender's process
/// (`process_vm_readv(2)`): the one read the driver does for the machine.
pub struct Pull {
    /// The receive.
    pub id: u64,
    /// The sender's process.
    pub pid: u32,
    /// The piece's address in the sender's process.
    pub addr: u64,
    /// The receive's buffer.
    pub buf: RawBuf,
    /// Where in the receive's buffer the piece goes.
    pub piece: std::ops::Range<usize>,
}

/// The bytes of an outgoing part: (transfer, start, length) in its buffer.
pub(super) type PartRange = (u64, usize, usize);

/// Where an arriving part goes: into transfer `id`'s buffer at `start`.
pub(super) struct PartDest {
    pub id: u64,
    pub start: usize,
}

/// The transfers of one topology's engine, by the id the caller gave them.
pub(super) struct Transfers {
    epoch: Epoch,
    ops: BTreeMap<u64, Transfer>,
    /// Per member: the number of our next send to it.
    next_number: Vec<u64>,
    /// Per member: our offers that left for it, and its offers that arrived here. A receive
    /// waiting on a member that has seen every offer the member sent it waits for one not yet
    /// made ([`Transfers::stuck`]).
    offers_sent: Vec<u64>,
    offers_seen: Vec<u64>,
    /// Per member: the numbers of its offers a receive of ours took, or that it withdrew. A send
    /// waiting on us whose offer is among them waits only for news already on its way.
    answered: Vec<Answered>,
    /// Offers no receive matched yet, as they arrived: (member, its offer, the address it offers
    /// to pull, or 0).
    offers: Vec<(usize, OpHeader, u64)>,
    /// Per member: its process where our lanes to it say it runs on this host and may be read
    /// from (`Some(None)` where a lane says otherwise, or the kernel refused a read).
    partners: Vec<Option<Option<u32>>>,
    /// Bytes pulls moved since [`Transfers::pulled`]: (member, sent to it, received from it).
    pulled: Vec<(usize, u64, u64)>,
    /// Answers and withdrawals to send, by member; they outlive the transfer they concern.
    control: VecDeque<(usize, Frame)>,
    events: Vec<(u64, Result<(), LinkError>)>,
    /// The transfer the last free lane took a part of: the next lane starts after it.
    turn: u64,
}

impl Transfers {
    pub fn new(epoch: Epoch, world: usize) -> Self {
        Transfers {
            epoch,
            ops: BTreeMap::new(),
            next_number: vec![0; world],
            offers_sent: vec![0; world],
            offers_seen: vec![0; world],
            answered: (0..world).map(|_| Answered::default()).collect(),
            offers: Vec::new(),
            partners: vec![None; world],
            pulled: Vec::new(),
            control: VecDeque::new(),
            events: Vec::new(),
            turn: 0,
        }
    }

    /// A lane to or from `member` leads to process `pid` (or cannot tell): pulls need every lane
    /// to name the same one.
    pub fn note_partner(&mut self, member: usize, pid: Option<u32>) {
        let known = &mut self.partners[member];
        *known = match *known {
            None => Some(pid),
            Some(Some(p)) if pid == Some(p) => Some(Some(p)),
            Some(_) => Some(None),
        };
    }

    /// The process of `member`, where a transfer may be pulled from it.
    fn partner(&self, member: usize) -> Option<u32> {
        self.partners[member].flatten()
    }

    /// Transfers posted and not taken.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether a transfer still moves.
    pub fn busy(&self) -> bool {
        self.ops.values().any(|t| !t.finished)
    }

    /// The members the transfers still moving exchange frames with (both ways: answers go back);
    /// a receive from any member, with every member until it took an offer.
    pub fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        let world = self.next_number.len();
        let moving = self.ops.values().filter(|t| !t.finished);
        moving.flat_map(move |t| (0..world).filter(move |&r| t.peer.map_or(t.spec.peer.admits(r), |p| p == r)))
    }

    /// Starts transfer `id`. A receive takes the earliest waiting offer that fits it.
    pub fn post(&mut self, id: u64, spec: TransferSpec) {
        debug_assert!(!self.ops.contains_key(&id), "transfer ids are unique");
        let elem = spec.dtype.size();
        let part_bytes = (spec.chunk_bytes / elem).max(1) * elem;
        let parts = spec.buf.len().div_ceil(part_bytes);
        let (number, after, stage) = match (spec.direction, spec.peer.member()) {
            (Direction::Send, Some(peer)) => {
                let same = |t: &&Transfer| {
                    t.spec.direction == Direction::Send && t.peer == Some(peer) && t.spec.tag == spec.tag
                };
                let previous = self.ops.values().filter(same).filter_map(|t| t.number).max();
                let n = &mut self.next_number[peer];
                *n += 1;
                (Some(*n - 1), previous.map_or(0, |p| p + 1), Stage::Offering)
            }
            (Direction::Send, None) => panic!("a send goes to a member"),
            (Direction::Recv, _) => (None, 0, Stage::Waiting),
        };
        let got = if spec.direction == Direction::Recv { vec![false; parts] } else { Vec::new() };
        let (peer, direction) = (spec.peer.member(), spec.direction);
        let transfer = Transfer {
            spec,
            peer,
            number,
            after,
            stage,
            part_bytes,
            parts,
            next_part: 0,
            done_parts: 0,
            got,
            pulled: 0,
            offered_pull: false,
            received: false,
            traffic: Traffic::default(),
            finished: false,
        };
        self.ops.insert(id, transfer);
        if direction == Direction::Recv {
            self.match_waiting(id);
        }
    }

    /// Receive `id` takes the earliest waiting offer that fits it and whose predecessor with its
    /// tag was answered.
    fn match_waiting(&mut self, id: u64) {
        let t = &self.ops[&id];
        let fits = |(from, o, _): &(usize, OpHeader, u64)| {
            t.spec.peer.admits(*from) && o.tag == t.spec.tag && self.is_next(*from, o)
        };
        if let Some(k) = self.offers.iter().position(fits) {
            let (from, offer, addr) = self.offers.remove(k);
            self.answer(id, from, offer, addr);
        }
    }

    /// Whether `offer` from member `from` is the next of its tag from there to match: the send
    /// before it with its tag (its `derived` field: its number + 1, or 0) was answered or withdrawn.
    fn is_next(&self, from: usize, offer: &OpHeader) -> bool {
        offer.derived == 0 || self.answered[from].contains(offer.derived - 1)
    }

    /// The earliest posted receive still waiting that may take an offer from `from` with `tag`.
    fn waiting_for(&self, from: usize, tag: u64) -> Option<u64> {
        let waiting = |t: &Transfer| {
            t.spec.direction == Direction::Recv
                && t.stage == Stage::Waiting
                && !t.finished
                && t.spec.peer.admits(from)
                && t.spec.tag == tag
        };
        self.ops.iter().find(|(_, t)| waiting(t)).map(|(id, _)| *id)
    }

    /// Offer `n` with `tag` from `from` is answered or withdrawn: the one after it with its tag,
    /// if it waits here, goes to the earliest receive waiting for it.
    fn taken(&mut self, from: usize, tag: u64, n: u64) {
        self.answered[from].insert(n);
        let next = self.offers.iter().position(|(f, o, _)| *f == from && o.tag == tag && o.derived == n + 1);
        if let (Some(k), Some(id)) = (next, self.waiting_for(from, tag)) {
            let (from, offer, addr) = self.offers.remove(k);
            self.answer(id, from, offer, addr);
        }
    }

    /// Receive `id` answers `offer` from member `from`: pulls from `addr` in the sender's
    /// process where it offers that and we may, else asks for parts.
    fn answer(&mut self, id: u64, from: usize, offer: OpHeader, addr: u64) {
        let pid = self.partner(from).filter(|_| addr != 0);
        let t = self.ops.get_mut(&id).expect("posted");
        let ours = header(self.epoch, &t.spec, offer.seq, offer.derived);
        t.peer = Some(from);
        if offer.dtype != ours.dtype || offer.count != ours.count {
            self.control.push_back((from, control_frame(FrameKind::Refuse, ours)));
            self.end(id, Err(LinkError::Mismatch { rank: from, theirs: offer }));
            self.taken(from, offer.tag, offer.seq);
            return;
        }
        (t.number, t.after) = (Some(offer.seq), offer.derived);
        if let Some(pid) = pid {
            (t.stage, t.pulled) = (Stage::Pulling { pid, addr }, 0);
        } else {
            self.control.push_back((from, control_frame(FrameKind::Accept, ours)));
            t.stage = Stage::Moving;
            self.check(id);
        }
        self.taken(from, offer.tag, offer.seq);
    }

    /// Whether transfer `id` waits for the other end to make its call: a send not yet answered, or
    /// a receive no offer matched; for a send, its number among our sends to that member, and for
    /// a receive, how many offers from that member arrived so far (the other end compares them
    /// with those it answered, or sent: [`Transfers::stuck`]); for a receive from any member,
    /// `u64::MAX` (each member judges by its sends in flight alone).
    pub fn unmatched(&self, id: u64) -> Option<u64> {
        let t = self.ops.get(&id).filter(|t| !t.finished)?;
        match (t.stage, t.peer) {
            (Stage::Offering | Stage::Offered, _) => Some(t.number.expect("a send is numbered")),
            (Stage::Waiting, Some(peer)) => Some(self.offers_seen[peer]),
            (Stage::Waiting, None) => Some(u64::MAX),
            _ => None,
        }
    }

    /// Whether member `peer`'s transfer with us can only complete by a call we have not made:
    /// its send (`send`, numbered `seen`) finds no receive of ours with `tag` posted, and no
    /// receive of ours took its offer already (whose answer is on its way, and the send's end
    /// with it); its receive, having seen `seen` of our offers, finds no send of ours with `tag`
    /// in flight and no offer it has not seen yet.
    pub fn stuck(&self, peer: usize, send: bool, tag: u64, seen: u64) -> bool {
        let ours = if send { Direction::Recv } else { Direction::Send };
        let serving = self.ops.values().any(|t| {
            // A receive of ours from any member serves its send while it waits.
            let with = t.peer == Some(peer) || (t.peer.is_none() && t.spec.peer.admits(peer));
            !t.finished && with && t.spec.tag == tag && t.spec.direction == ours
        });
        !serving && if send { !self.answered[peer].contains(seen) } else { self.offers_sent[peer] <= seen }
    }

    /// A piece of every receive that pulls from its sender's memory, to read now.
    pub fn pulls(&self) -> Vec<Pull> {
        let pulling = self.ops.iter().filter(|(_, t)| !t.finished);
        pulling
            .filter_map(|(&id, t)| match t.stage {
                Stage::Pulling { pid, addr } => {
                    let piece = t.pulled..t.spec.buf.len().min(t.pulled + PULL_PIECE_BYTES);
                    Some(Pull { id, pid, addr: addr + piece.start as u64, buf: t.spec.buf, piece })
                }
                _ => None,
            })
            .collect()
    }

    /// What reading `pull` out of its sender's process gave.
    pub fn handle_pulled(&mut self, pull: &Pull, read: std::io::Result<usize>) {
        let epoch = self.epoch;
        let id = pull.id;
        let t = self.ops.get_mut(&id).expect("pulling");
        let Stage::Pulling { pid, .. } = t.stage else { unreachable!("a pull of a transfer that pulls") };
        debug_assert_eq!(t.pulled, pull.piece.start, "one pull at a time");
        let (from, n) = (t.peer.expect("answered"), t.number.expect("answered"));
        match read {
            Ok(got) if got > 0 => {
                t.pulled += got;
                t.traffic.rx_bytes += got as u64;
                self.pulled.push((from, 0, got as u64));
                if t.pulled == t.spec.buf.len() {
                    t.stage = Stage::Confirming;
                    t.traffic.single_copy = true;
                    let h = header(epoch, &t.spec, n, t.after);
                    self.control.push_back((from, control_frame(FrameKind::Pulled, h)));
                }
            }
            outcome => {
                // The kernel refused, or the memory is not as offered (the sender withdrew,
                // or died): the parts come over the lanes instead, and a sender that
                // withdrew or died fails or re-matches this receive as for any other.
                log::debug!("transfer {id} #{n}: reading process {pid} gave {outcome:?}; asking for parts");
                if outcome.is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied) {
                    self.partners[from] = Some(None);
                }
                (t.stage, t.pulled, t.traffic) = (Stage::Moving, 0, Traffic::default());
                self.control.push_back((from, control_frame(FrameKind::Accept, header(epoch, &t.spec, n, t.after))));
                self.check(id);
            }
        }
    }

    /// What pulls moved since the last call: (member, bytes sent to it, bytes received from it).
    pub fn pulled(&mut self) -> Vec<(usize, u64, u64)> {
        std::mem::take(&mut self.pulled)
    }

    /// Transfer `id` ended with `result` (once).
    fn end(&mut self, id: u64, result: Result<(), LinkError>) {
        let t = self.ops.get_mut(&id).expect("posted");
        log::trace!("transfer {id} ended: {result:?}");
        if !t.finished {
            t.finished = true;
            self.events.push((id, result));
        }
    }

    /// Moves transfer `id` on once every part moved: a receive ends and says so, a send waits
    /// for that.
    fn check(&mut self, id: u64) {
        let epoch = self.epoch;
        let t = self.ops.get_mut(&id).expect("posted");
        if t.finished || t.stage != Stage::Moving || t.done_parts < t.parts {
            return;
        }
        if t.spec.direction == Direction::Send {
            if t.received {
                return self.end(id, Ok(()));
            }
            t.stage = Stage::Delivered;
            return;
        }
        let h = header(epoch, &t.spec, t.number.expect("answered"), t.after);
        self.control.push_back((t.peer.expect("answered"), control_frame(FrameKind::Received, h)));
        t.stage = Stage::Acknowledging;
    }

    /// Control frame `frame` went whole into a stream to member `to`: the transfer it decides,
    /// if any, ends.
    pub fn sent(&mut self, to: usize, frame: &Frame) {
        let direction = match frame.kind {
            FrameKind::Received => Direction::Recv,
            FrameKind::Confirmed => Direction::Send,
            _ => return,
        };
        let deciding = |t: &Transfer| {
            t.spec.direction == direction
                && t.peer == Some(to)
                && t.number == Some(frame.op.seq)
                && t.stage == Stage::Acknowledging
                && !t.finished
        };
        // None: given up meanwhile, its word sent all the same (the other end holds it).
        if let Some(id) = self.ops.iter().find(|(_, t)| deciding(t)).map(|(id, _)| *id) {
            self.end(id, Ok(()));
        }
    }

    /// A transfer frame from member `from`: the destination of its bytes, if it is a part.
    pub fn on_frame(&mut self, from: usize, frame: &Frame) -> Result<Option<PartDest>, LinkError> {
        let malformed = |what: Malformed| LinkError::Malformed { rank: from, what };
        let n = frame.op.seq;
        log::trace!("transfer frame {:?} #{n} (tag {}) from rank {from}", frame.kind, frame.op.tag);
        // Our send to `from` numbered `n`, not ended, in one of `stages`.
        let sending = |ops: &BTreeMap<u64, Transfer>, stages: &[Stage]| {
            ops.iter()
                .find(|(_, t)| {
                    t.spec.direction == Direction::Send
                        && t.peer == Some(from)
                        && t.number == Some(n)
                        && stages.contains(&t.stage)
                        && !t.finished
                })
                .map(|(id, _)| *id)
        };
        // Our send to `from` numbered `n`, still waiting for its answer.
        let offered = |ops: &BTreeMap<u64, Transfer>| sending(ops, &[Stage::Offered]);
        // Our receive from `from` numbered `n`, not ended, in `stage` if one is given.
        let receiving = |ops: &BTreeMap<u64, Transfer>, stage: Option<Stage>| {
            ops.iter()
                .find(|(_, t)| {
                    t.spec.direction == Direction::Recv
                        && t.peer == Some(from)
                        && t.number == Some(n)
                        && !t.finished
                        && stage.is_none_or(|s| t.stage == s)
                })
                .map(|(id, _)| *id)
        };
        // An answer to a send we gave up (withdrew) or one we never made.
        let stale = |next: u64| if n < next { Ok(None) } else { Err(malformed(Malformed::UnknownAnswer { n })) };
        match frame.kind {
            FrameKind::Offer => {
                self.offers_seen[from] += 1;
                // The address to pull from, if any, rides in the frame's unit and root.
                let addr = u64::from(frame.unit) | u64::from(frame.op.root) << 32;
                let offer = OpHeader { root: 0, ..frame.op };
                if self.answered[from].contains(n) {
                    // Withdrawn before it arrived (its withdrawal took another lane): gone.
                    return Ok(None);
                }
                if self.offers.iter().any(|(f, o, _)| *f == from && o.seq == n) {
                    return Err(malformed(Malformed::OfferTwice { n }));
                }
                let next = self.is_next(from, &offer);
                match self.waiting_for(from, offer.tag).filter(|_| next) {
                    Some(id) => self.answer(id, from, offer, addr),
                    None if self.offers.len() >= MAX_WAITING_OFFERS => {
                        return Err(malformed(Malformed::TooManyOffers));
                    }
                    None => self.offers.push((from, offer, addr)),
                }
                Ok(None)
            }
            FrameKind::Pulled => {
                let Some(id) = offered(&self.ops) else { return stale(self.next_number[from]) };
                let t = self.ops.get_mut(&id).expect("found");
                if !t.offered_pull {
                    return Err(malformed(Malformed::PullNotOffered { n }));
                }
                let len = t.spec.buf.len() as u64;
                t.traffic.tx_bytes += len;
                t.traffic.single_copy = true;
                self.pulled.push((from, len, 0));
                let h = header(self.epoch, &t.spec, n, t.after);
                self.control.push_back((from, control_frame(FrameKind::Confirmed, h)));
                t.stage = Stage::Acknowledging;
                Ok(None)
            }
            FrameKind::Confirmed => {
                let Some(id) = receiving(&self.ops, Some(Stage::Confirming)) else {
                    return Err(malformed(Malformed::ConfirmNotPulled { n }));
                };
                self.end(id, Ok(()));
                Ok(None)
            }
            FrameKind::Received => {
                let Some(id) = sending(&self.ops, &[Stage::Moving, Stage::Delivered]) else {
                    return stale(self.next_number[from]);
                };
                // Every part arrived: the last ones' writes may not be seen done here yet (lanes
                // report them on their own), and the send ends with them.
                let t = self.ops.get_mut(&id).expect("found");
                if t.next_part < t.parts {
                    return Err(malformed(Malformed::ReceivedEarly { n }));
                }
                t.received = true;
                if t.stage == Stage::Delivered {
                    self.end(id, Ok(()));
                }
                Ok(None)
            }
            FrameKind::Accept => {
                let Some(id) = offered(&self.ops) else { return stale(self.next_number[from]) };
                self.ops.get_mut(&id).expect("found").stage = Stage::Moving;
                self.check(id);
                Ok(None)
            }
            FrameKind::Refuse => {
                let Some(id) = offered(&self.ops) else { return stale(self.next_number[from]) };
                self.end(id, Err(LinkError::Mismatch { rank: from, theirs: frame.op }));
                Ok(None)
            }
            FrameKind::Withdraw => {
                self.offers.retain(|(f, o, _)| !(*f == from && o.seq == n));
                // A receive that took the offer got nothing yet (no part leaves before our answer
                // arrives, and the sender withdraws only before): it waits for another send.
                if let Some(id) = receiving(&self.ops, None) {
                    let t = self.ops.get_mut(&id).expect("found");
                    (t.number, t.stage, t.pulled, t.traffic) = (None, Stage::Waiting, 0, Traffic::default());
                    t.peer = t.spec.peer.member();
                    self.match_waiting(id);
                }
                self.taken(from, frame.op.tag, n);
                Ok(None)
            }
            _ => {
                let part = frame.unit as usize;
                let Some(id) = receiving(&self.ops, Some(Stage::Moving)) else {
                    return Err(malformed(Malformed::PartNotAccepted { n }));
                };
                let t = self.ops.get_mut(&id).expect("found");
                let start = part * t.part_bytes;
                let expected = t.part_bytes.min(t.spec.buf.len().saturating_sub(start));
                if part >= t.parts || t.got[part] || frame.len as usize != expected {
                    return Err(malformed(Malformed::BadPart { n, part, len: frame.len, expected }));
                }
                t.got[part] = true;
                Ok(Some(PartDest { id, start }))
            }
        }
    }

    /// The member at the other end of transfer `id`, once known.
    pub fn peer(&self, id: u64) -> Option<usize> {
        self.ops.get(&id)?.peer
    }

    /// The sender's number of transfer `id` among its transfers to the receiver, and the member
    /// at the other end, once matched.
    pub fn matched(&self, id: u64) -> Option<(u64, usize)> {
        let t = self.ops.get(&id)?;
        Some((t.number?, t.peer?))
    }

    /// Whether transfer `id`, ended or not, waits for the other end's word on its outcome: a send
    /// whose every part was written, a receive that pulled everything (if it failed there, only
    /// the other end knows how it ended).
    pub fn uncertain(&self, id: u64) -> bool {
        self.ops.get(&id).is_some_and(|t| {
            matches!(t.stage, Stage::Delivered | Stage::Confirming) || (t.stage == Stage::Moving && t.received)
        })
    }

    /// Transfer `id`'s buffer.
    pub fn buf(&self, id: u64) -> RawBuf {
        self.ops[&id].spec.buf
    }

    /// `n` bytes of transfer `id` moved (in or out).
    pub fn count(&mut self, id: u64, n: usize, outgoing: bool) {
        let t = &mut self.ops.get_mut(&id).expect("in flight").traffic;
        if outgoing {
            t.tx_bytes += n as u64;
        } else {
            t.rx_bytes += n as u64;
        }
    }

    /// A part of transfer `id` was written, or received whole.
    pub fn part_done(&mut self, id: u64) {
        self.ops.get_mut(&id).expect("in flight").done_parts += 1;
        self.check(id);
    }

    /// Whether a frame for member `to` may leave now.
    pub fn has_frame_for(&self, to: usize) -> bool {
        self.control.iter().any(|(t, _)| *t == to) || self.ops.values().any(|t| t.sendable(to))
    }

    /// The next frame for member `to`: answers first, then the next transfer in turn's offer or
    /// part (with its bytes' transfer and range).
    pub fn next_frame(&mut self, to: usize) -> Option<(Frame, Option<PartRange>)> {
        if let Some(k) = self.control.iter().position(|(t, _)| *t == to) {
            log::trace!("transfer frame {:?} #{} to rank {to}", self.control[k].1.kind, self.control[k].1.op.seq);
            return self.control.remove(k).map(|(_, f)| (f, None));
        }
        let turn = self.turn;
        let order = self.ops.range(turn + 1..).chain(self.ops.range(..=turn)).map(|(id, _)| *id);
        let id = order.into_iter().find(|id| self.ops[id].sendable(to))?;
        self.turn = id;
        let epoch = self.epoch;
        let t = self.ops.get_mut(&id).expect("picked");
        let h = header(epoch, &t.spec, t.number.expect("a send is numbered"), t.after);
        log::trace!("transfer {id} #{} to rank {to}: {:?}, part {}", h.seq, t.stage, t.next_part);
        if t.stage == Stage::Offering {
            t.stage = Stage::Offered;
            self.offers_sent[to] += 1;
            let mut offer = control_frame(FrameKind::Offer, h);
            if t.spec.buf.len() >= PULL_MIN_BYTES && self.partners[to].flatten().is_some() {
                let addr = t.spec.buf.addr();
                (offer.unit, offer.op.root) = (addr as u32, (addr >> 32) as u32);
                t.offered_pull = true;
            }
            return Some((offer, None));
        }
        let part = t.next_part;
        t.next_part += 1;
        let start = part * t.part_bytes;
        let len = t.part_bytes.min(t.spec.buf.len() - start);
        Some((Frame { kind: FrameKind::Part, len: len as u32, unit: part as u32, op: h }, Some((id, start, len))))
    }

    /// Every transfer still moving with member `peer` fails with `e`: its streams closed. A
    /// receive from any member that took no offer yet waits on the others.
    pub fn fail_peer(&mut self, peer: usize, e: &LinkError) {
        self.fail_where(e, |t| t.peer == Some(peer));
        self.offers.retain(|(from, _, _)| *from != peer);
    }

    /// Transfer `id` fails with `e`, unless it ended.
    pub fn fail(&mut self, id: u64, e: LinkError) {
        self.end(id, Err(e));
    }

    /// Every transfer still moving fails with `e`; answers not sent are dropped.
    pub fn fail_all(&mut self, e: &LinkError) {
        self.fail_where(e, |_| true);
        self.control.clear();
        self.offers.clear();
    }

    /// Every transfer still moving that `which` picks fails with `e`.
    fn fail_where(&mut self, e: &LinkError, which: impl Fn(&Transfer) -> bool) {
        let ids: Vec<u64> = self.ops.iter().filter(|(_, t)| !t.finished && which(t)).map(|(id, _)| *id).collect();
        for id in ids {
            self.end(id, Err(e.clone()));
        }
    }

    /// What happened to transfers since the last call.
    pub fn events(&mut self) -> Vec<(u64, Result<(), LinkError>)> {
        std::mem::take(&mut self.events)
    }

    /// Takes transfer `id` out, ended or not: what it moved, and whether the lanes are broken
    /// (it stopped with parts on them). A send the receiver had not answered is withdrawn.
    pub fn take(&mut self, id: u64) -> Option<(Traffic, bool)> {
        let t = self.ops.remove(&id)?;
        // A receive that took an offer leaves its sender waiting for an answer it never gets (a
        // decider taking its word back, too): as with parts on the lanes, the links go.
        let torn = !t.finished
            && matches!(t.stage, Stage::Moving | Stage::Pulling { .. } | Stage::Confirming | Stage::Acknowledging);
        // Withdrawn, even before its offer left: the receiver's later offers with its tag must
        // not wait for it.
        if !t.finished && matches!(t.stage, Stage::Offering | Stage::Offered) {
            let h = header(self.epoch, &t.spec, t.number.expect("a send is numbered"), t.after);
            self.control.push_back((t.peer.expect("a send's member"), control_frame(FrameKind::Withdraw, h)));
        }
        // Given up before its word to the other end left: the word goes too, and that end, its
        // links gone, asks and hears that it failed here.
        if !t.finished && t.stage == Stage::Acknowledging {
            let kind = if t.spec.direction == Direction::Recv { FrameKind::Received } else { FrameKind::Confirmed };
            let word = |(to, f): &(usize, Frame)| Some(*to) == t.peer && Some(f.op.seq) == t.number && f.kind == kind;
            self.control.retain(|c| !word(c));
        }
        self.events.retain(|(e, _)| *e != id);
        Some((t.traffic, torn))
    }

    /// Where each transfer stands, for a failure's log.
    pub fn describe(&self) -> String {
        let ops: Vec<String> = self
            .ops
            .iter()
            .map(|(id, t)| {
                let rank = t.peer.map_or("any".to_string(), |p| p.to_string());
                format!(
                    "{} {id} (tag {}, rank {rank}): {:?}, {}/{} parts",
                    t.spec.direction.name(),
                    t.spec.tag,
                    t.stage,
                    t.done_parts,
                    t.parts
                )
            })
            .collect();
        format!("transfers [{}], {} offers waiting", ops.join("; "), self.offers.len())
    }
}

impl Transfer {
    /// Whether a frame of this send may leave for member `to` now.
    fn sendable(&self, to: usize) -> bool {
        !self.finished
            && self.spec.direction == Direction::Send
            && self.peer == Some(to)
            && (self.stage == Stage::Offering || (self.stage == Stage::Moving && self.next_part < self.parts))
    }
}

/// The numbers of one member's offers that are answered: all below `below`, and those above it
/// answered out of order (offers cross lanes), so that it stays as small as the reordering.
#[derive(Default)]
struct Answered {
    below: u64,
    above: std::collections::BTreeSet<u64>,
}

impl Answered {
    fn insert(&mut self, n: u64) {
        if n >= self.below {
            self.above.insert(n);
        }
        while self.above.remove(&self.below) {
            self.below += 1;
        }
        debug_assert!(self.above.iter().all(|&a| a > self.below), "an answered number left behind");
    }

    fn contains(&self, n: u64) -> bool {
        n < self.below || self.above.contains(&n)
    }
}

/// The header of the transfer `spec` numbered `number`, after the send `after` - 1 with its tag
/// (0: none), as its sender's frames carry it (a receiver's answers carry its own dtype and count).
/// A transfer runs in no derived group: that field carries `after`.
fn header(epoch: Epoch, spec: &TransferSpec, number: u64, after: u64) -> OpHeader {
    OpHeader {
        collective: 0,
        algorithm: Algorithm::Direct.code(),
        epoch,
        derived: after,
        seq: number,
        tag: spec.tag,
        dtype: spec.dtype.code(),
        op: 0,
        count: (spec.buf.len() / spec.dtype.size()) as u64,
        root: 0,
        quantization: 0,
        block: 0,
    }
}

fn control_frame(kind: FrameKind, op: OpHeader) -> Frame {
    Frame { kind, len: 0, unit: 0, op }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An offer whose withdrawal overtook it on another lane is dropped as it arrives: no receive
    /// takes it (its sender gave up), and the sender's next offer with its tag is the next to match.
    #[test]
    fn an_offer_withdrawn_before_it_arrived_is_dropped() {
        let mut p2p = Transfers::new(Epoch(1), 2);
        let mut buf = [0u8; 8];
        let spec = |buf: &mut [u8]| TransferSpec {
            direction: Direction::Send,
            peer: End::Member(1),
            tag: 7,
            dtype: DType::U8,
            buf: RawBuf::new(buf),
            chunk_bytes: 8,
        };
        let frame = |kind, number, after| control_frame(kind, header(Epoch(1), &spec(&mut [0u8; 8]), number, after));
        p2p.on_frame(1, &frame(FrameKind::Withdraw, 0, 0)).unwrap();
        p2p.on_frame(1, &frame(FrameKind::Offer, 0, 0)).unwrap();
        p2p.post(1, TransferSpec { direction: Direction::Recv, ..spec(&mut buf) });
        assert_eq!(p2p.unmatched(1), Some(1), "the withdrawn offer is not taken");
        // Send #2 came after #1 (with the same tag), which is on its way: it waits for #1.
        p2p.on_frame(1, &frame(FrameKind::Offer, 2, 2)).unwrap();
        assert_eq!(p2p.unmatched(1), Some(2), "#2 overtook #1");
        assert!(p2p.on_frame(1, &frame(FrameKind::Offer, 2, 2)).is_err(), "an offer twice");
        p2p.on_frame(1, &frame(FrameKind::Offer, 1, 1)).unwrap();
        assert_eq!((p2p.unmatched(1), p2p.peer(1), p2p.ops[&1].number), (None, Some(1), Some(1)), "#1 first");
    }

    /// A receive that holds every part ends once its `Received` left; given up before (its call
    /// abandoned), it takes the word back and the links go, so that its sender, waiting for that
    /// word, fails at once (and, asking, hears it failed here) rather than wait out its bound.
    #[test]
    fn a_receive_given_up_before_its_word_left_takes_it_back_and_tears_the_links() {
        for given_up in [false, true] {
            let mut p2p = Transfers::new(Epoch(1), 2);
            let mut buf = [0u8; 16];
            let spec = TransferSpec {
                direction: Direction::Recv,
                peer: End::Member(1),
                tag: 7,
                dtype: DType::U8,
                buf: RawBuf::new(&mut buf),
                chunk_bytes: 8,
            };
            let h = header(Epoch(1), &spec, 0, 0);
            p2p.post(1, spec);
            p2p.on_frame(1, &control_frame(FrameKind::Offer, h)).unwrap();
            assert_eq!(p2p.next_frame(1).map(|(f, _)| f.kind), Some(FrameKind::Accept));
            for part in 0..2 {
                let frame = Frame { kind: FrameKind::Part, len: 8, unit: part, op: h };
                assert!(p2p.on_frame(1, &frame).unwrap().is_some(), "part {part} goes into the buffer");
                p2p.part_done(1);
            }
            assert!(p2p.events().is_empty(), "not ended before its word left");
            if given_up {
                assert_eq!(p2p.take(1).map(|(_, torn)| torn), Some(true), "the links go");
                assert!(p2p.next_frame(1).is_none(), "the word is taken back");
                continue;
            }
            let (word, _) = p2p.next_frame(1).expect("its word");
            assert_eq!((word.kind, word.op.seq), (FrameKind::Received, 0));
            p2p.sent(1, &word);
            assert!(matches!(p2p.events()[..], [(1, Ok(()))]), "ends once its word left");
        }
    }

    /// Offers answered out of order are kept until the numbers below them are, then folded.
    #[test]
    fn answered_numbers_fold_as_the_gaps_below_them_fill() {
        let mut a = Answered::default();
        for n in [1, 3, 0] {
            a.insert(n);
        }
        assert!(a.contains(0) && a.contains(1) && !a.contains(2) && a.contains(3) && !a.contains(4));
        assert_eq!((a.below, a.above.len()), (2, 1));
        a.insert(2);
        assert_eq!((a.below, a.above.len()), (4, 0));
        a.insert(1);
        assert_eq!((a.below, a.above.len()), (4, 0), "an old number again changes nothing");
    }
}
