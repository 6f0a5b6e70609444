//! Tagged transfers in flight at a peer, and what ends those its engine cannot: the master
//! removed the other end (frozen or cut off, it never closes its streams), a topology replaces the
//! one they run in, the other end's call can never let them complete, their bound passed.
//!
//! Sans IO, as [`Peer`]: the driver posts each transfer to its engine and here
//! ([`Transfers::start`]), tells what the engine did ([`Transfers::handle_engine`]), what the
//! master said ([`Transfers::handle_apart`], [`Transfers::handle_taken_up`]) and when nothing
//! moves ([`Transfers::handle_stalled`], [`Transfers::handle_waiting`]), with the time as an
//! argument; it takes each transfer that ended with [`Transfers::poll_ended`]. `crates/peer`
//! drives it beside its engine's sockets, `crates/sim` beside its simulated lanes.

use super::{CallId, Peer, TransferName};
use shoal_wire::{Call, Called, Epoch, Misuse, PeerId};
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// How long a caller waits on a transfer that found nothing to match it before it asks, through
/// the master, whether the other end's call ever lets it complete ([`Peer::p2p_waits`]). Most
/// transfers match within it, and cost the master nothing.
pub const P2P_PATIENCE: Duration = Duration::from_millis(100);

/// How long a transfer's loss waits for the news that the other end's call ended apart from ours
/// (`P2pApart`, or the verdict that settles our point): the master sends it before it acts on
/// it, but it travels another way than the streams' close or the new topology.
pub const APART_GRACE: Duration = Duration::from_millis(200);

/// How long a transfer asking what became of it at the other end ([`Transfers::handle_engine`])
/// waits for the answer before it asks again: the question, or its answer, may have been lost
/// with the master (restarted) or the other end's connection to it.
pub const ASK_AGAIN: Duration = Duration::from_secs(1);

/// Most transfers whose outcome is kept, after they ended, for the other end to ask about
/// ([`Transfers::handle_outcome_asked`]): the other end asks within its bound, and a member ends
/// far fewer transfers than this in one.
pub const MAX_DECIDED: usize = 4096;

/// A transfer in flight: with whom, in which topology, until when; and `data`, what its driver
/// keeps with it (its buffer, ...).
#[derive(Debug)]
pub struct Transfer<T, E> {
    /// The member at the other end: [`PeerId::ANY`] for a receive from any member.
    pub peer: PeerId,
    /// Its rank in `epoch`, where one member is named.
    pub rank: Option<usize>,
    /// Ours is the send; otherwise the receive.
    pub send: bool,
    /// What it is matched by, besides its member and direction.
    pub tag: u64,
    /// The topology it runs in.
    pub epoch: Epoch,
    /// Its bound.
    pub deadline: Instant,
    /// What its driver keeps with it.
    pub data: T,
    /// How it fails, held [`APART_GRACE`] from when it was seen: the streams closed, or a new
    /// topology replaces ours, because the other end's call ended apart from ours, whose news is
    /// a moment behind.
    failing: Option<(Stop<E>, Instant)>,
    /// The sender's number of it and the member at the other end, once the engine said.
    matched: Option<(u64, PeerId)>,
    /// Its outcome rests on the other end's word, which has not come ([`EngineEnd::uncertain`]).
    uncertain: bool,
    /// It stopped while its outcome rested on the other end's word: it asked that end what
    /// became of it there, and ends as it did there, or with this stop.
    asking: Option<Asking<E>>,
}

/// A transfer asking what became of it at the other end.
#[derive(Debug)]
struct Asking<E> {
    /// How it ends, if the other end's did not succeed.
    stop: Stop<E>,
    /// When it last asked.
    asked: Instant,
}

impl<T, E> Transfer<T, E> {
    /// A transfer with member `peer` (rank `rank` of topology `epoch`, or any member: `None`),
    /// bound by `deadline`.
    pub fn new(
        peer: PeerId,
        rank: Option<usize>,
        send: bool,
        tag: u64,
        epoch: Epoch,
        deadline: Instant,
        data: T,
    ) -> Self {
        assert_eq!(rank.is_none(), peer == PeerId::ANY, "a member named by its id and rank, or any");
        assert!(rank.is_some() || !send, "a send goes to a member");
        Transfer {
            peer,
            rank,
            send,
            tag,
            epoch,
            deadline,
            data,
            failing: None,
            matched: None,
            uncertain: false,
            asking: None,
        }
    }

    /// The sender's number of it and the member at the other end, once the engine said.
    pub fn matched(&self) -> Option<(u64, PeerId)> {
        self.matched
    }

    /// The call it is, as a usage error names it.
    pub fn call(&self) -> Call {
        Call::Transfer { send: self.send, peer: self.peer, tag: self.tag }
    }
}

/// Why a transfer ended without completing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop<E> {
    /// The engine failed it (the driver's own error for what failed).
    Failed(E),
    /// The master removed the member at the other end from the run.
    Removed,
    /// The master issued a topology that replaces the transfer's (a member was lost or admitted):
    /// the members take up the new one rather than answer in this one.
    Replaced,
    /// Topology `.0` was taken up while the transfer ran in an older one.
    Superseded(Epoch),
    /// The other end's call, or ours, can never let it complete: both calls, named.
    Apart(Misuse),
    /// Its bound passed.
    Timeout,
}

/// The tagged transfers in flight at a peer, and what ends those its engine cannot: a member
/// removed, a topology replaced, a call at the other end that never lets them complete, a bound.
/// Its driver posts each to its engine and here, and feeds in what happened, time an argument.
#[derive(Debug)]
pub struct Transfers<T, E> {
    calls: BTreeMap<CallId, Transfer<T, E>>,
    /// The transfer the caller waits on, announced to the master as waiting for its other end's
    /// call, and that member.
    announced: Option<(CallId, PeerId)>,
    ended: VecDeque<Ended<T, E>>,
    /// Transfers that ended here, for the other end to ask how: (topology, the other end, ours
    /// was the send, the sender's number) and whether it succeeded; the latest [`MAX_DECIDED`].
    decided: VecDeque<((Epoch, PeerId, bool, u64), bool)>,
    /// Questions about transfers still in flight here, answered as they end: (the transfer, the
    /// asker).
    owed: Vec<(CallId, PeerId)>,
    /// Answers to send: the transfer as asked, and whether it succeeded here.
    told: VecDeque<(TransferName, bool)>,
}

/// What the engine knows of a transfer it ended ([`Transfers::handle_engine`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineEnd {
    /// The sender's number of it and the member at the other end, once matched.
    pub matched: Option<(u64, PeerId)>,
    /// It failed while its outcome rested on the other end's word (a send whose every part was
    /// written, waiting for `Received`; a receive that pulled everything, waiting for
    /// `Confirmed`).
    pub uncertain: bool,
}

/// A transfer that ended ([`Transfers::poll_ended`]).
#[derive(Debug)]
pub struct Ended<T, E> {
    /// Its call.
    pub call: CallId,
    /// What it was.
    pub transfer: Transfer<T, E>,
    /// How it ended.
    pub result: Result<(), Stop<E>>,
}

impl<T, E> Default for Transfers<T, E> {
    fn default() -> Self {
        Transfers {
            calls: BTreeMap::new(),
            announced: None,
            ended: VecDeque::new(),
            decided: VecDeque::new(),
            owed: Vec::new(),
            told: VecDeque::new(),
        }
    }
}

impl<T, E> Transfers<T, E> {
    /// Transfer `call` was posted to the engine.
    pub fn start(&mut self, call: CallId, transfer: Transfer<T, E>) {
        assert!(transfer.failing.is_none(), "{call:?} starts failing");
        let old = self.calls.insert(call, transfer);
        assert!(old.is_none(), "{call:?} started twice");
    }

    /// Transfer `call`, while in flight.
    pub fn get(&self, call: CallId) -> Option<&Transfer<T, E>> {
        self.calls.get(&call)
    }

    /// The transfers in flight.
    pub fn iter(&self) -> impl Iterator<Item = (CallId, &Transfer<T, E>)> {
        self.calls.iter().map(|(c, t)| (*c, t))
    }

    /// Whether our caller's wait on `call` was announced, and not resumed yet.
    pub fn announced(&self, call: CallId) -> bool {
        self.announced.is_some_and(|(c, _)| c == call)
    }

    /// Whether none is in flight.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Whether one asks what became of it at the other end: it moves nothing in the engine, yet
    /// waits for an answer or its bound ([`Transfers::handle_stalled`]).
    pub fn asking(&self) -> bool {
        self.calls.values().any(|t| t.asking.is_some())
    }

    /// Whether answers to the other ends' questions wait to be sent ([`Transfers::handle_stalled`]).
    pub fn owes(&self) -> bool {
        !self.told.is_empty()
    }

    /// The engine ended transfer `call` with `result`; `lost`: a failure is the loss of the
    /// streams. That may be the other end's call ending apart from ours, or a call of a third
    /// member's doing so at our point (its new topology closes the old streams): the failure is
    /// held [`APART_GRACE`] for that news, a `P2pApart` or the verdict that settles our point.
    ///
    /// A failure while the outcome rested on the other end's word (`end.uncertain`) is not ours
    /// to decide: `peer` asks the other end, through the master, what became of it there, and it
    /// ends as it did there ([`Transfers::handle_decided`]).
    pub fn handle_engine(
        &mut self,
        call: CallId,
        result: Result<(), E>,
        lost: bool,
        end: EngineEnd,
        peer: &mut Peer,
        now: Instant,
    ) {
        let Some(t) = self.calls.get_mut(&call) else { return };
        (t.matched, t.uncertain) = (end.matched, end.uncertain && end.matched.is_some());
        match result {
            Err(e) if t.uncertain => self.ask(call, Stop::Failed(e), peer, now),
            Err(e) if lost => t.failing = Some((Stop::Failed(e), now)),
            result => self.end(call, result.map_err(Stop::Failed)),
        }
        self.flush(peer);
        assert!(
            self.calls.get(&call).is_none_or(|t| t.failing.is_some() || t.asking.is_some()),
            "{call:?} ended in the engine, yet runs"
        );
    }

    /// The transfers the engine says wait for the other end's word on their outcome
    /// (`uncertain` gives the sender's number and the other end of each such): stopped before
    /// that word, by anything, each asks that end how it ended there rather than fail.
    pub fn handle_uncertain(&mut self, uncertain: impl Fn(CallId) -> Option<(u64, PeerId)>) {
        for (call, t) in self.calls.iter_mut().filter(|(_, t)| t.asking.is_none()) {
            if let Some(matched) = uncertain(*call) {
                (t.matched, t.uncertain) = (Some(matched), true);
            }
        }
    }

    /// Transfer `call` stops with `stop`: if its outcome rests on the other end's word, `peer`
    /// asks that end, through the master, what became of it there; otherwise it ends so.
    fn ask(&mut self, call: CallId, stop: Stop<E>, peer: &mut Peer, now: Instant) {
        let Some(t) = self.calls.get_mut(&call) else { return };
        let Some((number, with)) = t.matched.filter(|_| t.uncertain && t.asking.is_none()) else {
            return self.end(call, Err(stop));
        };
        log::debug!("{} #{number} with {with} stopped at the other end's word: asking it", verb(t.send));
        peer.p2p_outcome(TransferName { peer: with, epoch: t.epoch, number, send: t.send });
        (t.asking, t.failing) = (Some(Asking { stop, asked: now }), None);
    }

    /// A member asks what became here of its transfer `asked` with us (`asked.peer`: the asker),
    /// which stopped while its outcome rested on our word. Answered through `peer` from what
    /// ended here; a transfer still in flight here (`in_flight` gives the engine's number and
    /// other end of one) is answered as it ends. One never seen here failed here.
    pub fn handle_outcome_asked(
        &mut self,
        asked: TransferName,
        in_flight: impl Fn(CallId) -> Option<(u64, PeerId)>,
        peer: &mut Peer,
    ) {
        let TransferName { peer: asker, epoch, number, send } = asked;
        let key = (epoch, asker, !send, number);
        if let Some((_, done)) = self.decided.iter().find(|(k, _)| *k == key) {
            self.told.push_back((asked, *done));
        } else if let Some((call, t)) = self.calls.iter_mut().find(|(c, t)| {
            t.epoch == epoch && t.send != send && t.asking.is_none() && in_flight(**c) == Some((number, asker))
        }) {
            t.matched = Some((number, asker));
            self.owed.push((*call, asker));
        } else {
            self.told.push_back((asked, false));
        }
        self.flush(peer);
    }

    /// The member at the other end of our transfer `told` (`told.peer`) says whether it
    /// succeeded there: ours ends as that one did. Nothing if none asks so (ended meanwhile).
    pub fn handle_decided(&mut self, told: TransferName, done: bool) {
        let TransferName { peer: with, epoch, number, send } = told;
        let asking = |t: &Transfer<T, E>| {
            t.epoch == epoch && t.send == send && t.matched == Some((number, with)) && t.asking.is_some()
        };
        let Some((&call, _)) = self.calls.iter().find(|(_, t)| asking(t)) else { return };
        let t = self.calls.get_mut(&call).expect("found");
        let stop = t.asking.take().expect("asking").stop;
        log::debug!("{} #{number} with {with}: {} there", verb(send), if done { "done" } else { "failed" });
        self.end(call, if done { Ok(()) } else { Err(stop) });
    }

    /// Sends the answers owed: those to questions about transfers that ended since they came.
    fn flush(&mut self, peer: &mut Peer) {
        for (t, done) in self.told.drain(..) {
            peer.p2p_decided(t, done);
        }
    }

    /// Topology `epoch` was taken up: its links replace the ones the transfers in flight run
    /// over, and ranks may name other members now; each ends, retryably.
    /// One whose outcome rests on the other end's word asks that end (through `peer`, at `now`)
    /// and waits for the answer: the other end decided it, whatever topology follows.
    pub fn handle_taken_up(&mut self, epoch: Epoch, peer: &mut Peer, now: Instant) {
        let calls: Vec<CallId> = self.calls.iter().filter(|(_, t)| t.asking.is_none()).map(|(c, _)| *c).collect();
        for call in calls {
            assert!(self.calls[&call].epoch < epoch, "{call:?} runs in a topology taken up after {epoch:?}");
            self.ask(call, Stop::Superseded(epoch), peer, now);
        }
        self.flush(peer);
        assert!(self.calls.values().all(|t| t.asking.is_some()), "a transfer outlives its topology");
    }

    /// The master says that member `peer`'s call can never let the transfer our caller waits on
    /// complete (`misuse` names both calls): it ends. Whether it did (nothing if that wait is over).
    ///
    /// For a receive from any member ([`PeerId::ANY`]) every other member said so, each as it
    /// judged its own sends; one whose send matched the receive since may have answered before
    /// that send's offer arrived here, so the receive ends only if it still finds no match
    /// (`unmatched`).
    pub fn handle_apart(&mut self, peer: PeerId, misuse: Misuse, unmatched: impl FnOnce(CallId) -> bool) -> bool {
        let Some((call, _)) = self.announced.filter(|(_, p)| *p == peer) else { return false };
        if peer == PeerId::ANY && !unmatched(call) {
            log::debug!("{call:?}, a receive from any member, matched a send as every member answered");
            self.announced = None;
            return false;
        }
        assert!(peer == PeerId::ANY || misuse.theirs.peers == [peer], "the other end's call is named: {misuse}");
        self.announced = None;
        log::warn!("{misuse}");
        self.end(call, Err(Stop::Apart(misuse)));
        assert!(self.announced.is_none() && !self.calls.contains_key(&call), "{call:?} apart, yet waited on");
        true
    }

    /// Nothing moves: ends the transfers that cannot end otherwise, as `peer` knows the run at
    /// `now`. Nothing while `peer` has an action to carry out first (a `P2pApart` before the
    /// topology it brings).
    pub fn handle_stalled(&mut self, peer: &mut Peer, now: Instant) {
        self.flush(peer);
        if peer.has_action() || self.calls.is_empty() {
            return;
        }
        // Those asking the other end: its answer, its removal or ours (no answer comes then), or
        // their bound ends them.
        let mut stopped: Vec<(CallId, Stop<E>)> = Vec::new();
        for (call, t) in self.calls.iter_mut() {
            let Some(asking) = &mut t.asking else { continue };
            let (number, with) = t.matched.expect("asks about a matched transfer");
            if peer.removed(with) || peer.gone().is_some() || now >= t.deadline {
                let stop = t.asking.take().expect("asking").stop;
                stopped.push((*call, if now >= t.deadline { Stop::Timeout } else { stop }));
            } else if now >= asking.asked + ASK_AGAIN {
                asking.asked = now;
                peer.p2p_outcome(TransferName { peer: with, epoch: t.epoch, number, send: t.send });
            }
        }
        for (call, stop) in stopped {
            self.end(call, Err(stop));
        }
        // A topology issued after the others' calls at our point ended apart: ours are among them.
        let apart = |peer: &Peer, t: &Transfer<T, E>| {
            t.asking.is_none() && !peer.removed(t.peer) && (t.failing.is_some() || peer.superseded(t.epoch))
        };
        let first = self.calls.values().find(|t| apart(peer, t)).map(Transfer::call);
        let settled = first.and_then(|call| peer.p2p_settled(call));
        debug_assert!(settled.is_none() || first.is_some(), "a transfer told of calls it is not among");
        // (transfer, how it stops, whether it asks the other end first where it waits for its word:
        // what ended it here did not end it there, where it may have completed)
        let mut stopped: Vec<(CallId, Stop<E>, bool)> = Vec::new();
        for (call, t) in self.calls.iter_mut().filter(|(_, t)| t.asking.is_none()) {
            let stop = if peer.removed(t.peer) {
                Some((Stop::Removed, false))
            } else if let Some(m) = settled.as_ref().filter(|_| apart(peer, t)) {
                // Each transfer of ours there is one of those calls.
                let misuse = Misuse::settled(Called::new(m.ours.peers.clone(), t.call()), m.theirs.clone());
                Some((Stop::Apart(misuse), true))
            } else if apart(peer, t) {
                let (_, since) = t.failing.get_or_insert((Stop::Replaced, now));
                (now >= *since + APART_GRACE).then(|| (t.failing.take().expect("held").0, true))
            } else if now >= t.deadline {
                Some((Stop::Timeout, false))
            } else {
                None
            };
            stopped.extend(stop.map(|(s, ask)| (*call, s, ask)));
        }
        for (call, stop, ask) in stopped {
            if ask {
                self.ask(call, stop, peer, now);
            } else {
                self.end(call, Err(stop));
            }
        }
        self.flush(peer);
        assert!(
            self.calls.values().all(|t| now < t.deadline || t.failing.is_some() || t.asking.is_some()),
            "a transfer past its bound is neither ended nor held"
        );
    }

    /// Our caller has waited `waited` on transfer `call`: past [`P2P_PATIENCE`], if `unmatched`
    /// says nothing came to match it (`Some`: the count of the other end's sends to us offered so
    /// far), `peer` announces the wait; once a call. Whether it did.
    pub fn handle_waiting(
        &mut self,
        call: CallId,
        waited: Duration,
        unmatched: impl FnOnce() -> Option<u64>,
        peer: &mut Peer,
    ) -> bool {
        if self.announced.is_some() || waited < P2P_PATIENCE {
            return false;
        }
        let Some(t) = self.calls.get(&call) else { return false };
        let Some(seen) = unmatched() else { return false };
        log::debug!(
            "{} with {} (tag {}) waits for its match: asking whether it ever comes",
            verb(t.send),
            t.peer,
            t.tag
        );
        self.announced = Some((call, t.peer));
        peer.p2p_waits(t.peer, t.send, t.tag, seen);
        assert!(self.announced(call), "{call:?} announced, yet not kept");
        true
    }

    /// Our caller stopped waiting on `call` (it ended, or the caller's own wait timed out): the
    /// wait announced for it, if any, is over.
    pub fn handle_resumed(&mut self, call: CallId, peer: &mut Peer) {
        if let Some((_, other)) = self.announced.filter(|(c, _)| *c == call) {
            self.announced = None;
            peer.p2p_resumed(other);
        }
        assert!(!self.announced(call), "{call:?} resumed, yet announced");
    }

    /// When [`Transfers::handle_stalled`] has something to do with time alone: a bound, or a
    /// held failure's grace.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let due = |t: &Transfer<T, E>| match (&t.failing, &t.asking) {
            (_, Some(asking)) => t.deadline.min(asking.asked + ASK_AGAIN),
            (Some((_, since)), None) => *since + APART_GRACE,
            (None, None) => t.deadline,
        };
        self.calls.values().map(due).min()
    }

    /// A transfer that ended, with how: out of here, for its driver to take out of the engine.
    pub fn poll_ended(&mut self) -> Option<Ended<T, E>> {
        self.ended.pop_front()
    }

    fn end(&mut self, call: CallId, result: Result<(), Stop<E>>) {
        let Some(mut transfer) = self.calls.remove(&call) else { return };
        debug_assert!(self.ended.iter().all(|e| e.call != call), "{call:?} ends twice");
        transfer.failing = None;
        let done = result.is_ok();
        for (_, asker) in self.owed.iter().filter(|(c, _)| *c == call) {
            let (number, _) = transfer.matched.expect("asked about by number");
            let asked = TransferName { peer: *asker, epoch: transfer.epoch, number, send: !transfer.send };
            self.told.push_back((asked, done));
        }
        self.owed.retain(|(c, _)| *c != call);
        if let Some((number, with)) = transfer.matched {
            if self.decided.len() == MAX_DECIDED {
                self.decided.pop_front();
            }
            self.decided.push_back(((transfer.epoch, with, transfer.send, number), done));
        }
        self.ended.push_back(Ended { call, transfer, result });
        assert!(!self.calls.contains_key(&call), "{call:?} ended, yet in flight");
    }
}

/// A transfer's verb: `send` or `recv`.
pub fn verb(send: bool) -> &'static str {
    if send {
        "send"
    } else {
        "recv"
    }
}
