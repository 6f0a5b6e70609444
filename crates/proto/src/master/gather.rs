//! Collectives with a deadline (`docs/protocol.md`, "Collectives with a deadline"): the master
//! decides which members a collective runs among, so that a member that has not called it by the
//! deadline is left out by agreement rather than waited for.
//!
//! Each member that calls collective `seq` of the committed topology with a deadline says so
//! (`Gather`). Once every member still in the run has, or once the deadline (counted from the
//! moment the minimum had called: an early member does not start it) has passed, the master names
//! the members that called, in ring order, to every member of the ring (`Gathered`). Those run
//! the collective among themselves, with the usual agreement over exactly that set (the record
//! of the collective lists them alone: [`Master::gathered_members`]), and each tells the master
//! once it committed (`OpDone { decided: true }`). The others end their call of it, whenever
//! they make it, with nothing done, once its fate is known: left out if it committed
//! (`OpCommitted`), failed like its participants if it was aborted (`OpAborted`). So every
//! member's collective of that number has one outcome, and their next calls meet. The decision
//! is one message from one machine, so every member learns the same set.

use super::{Master, Timer};
use shoal_wire::{Epoch, FailureKind, Message, OpFailure, PeerId};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// Most collectives with a deadline a group may have undecided at once: a member runs a few at
/// a time (`max_in_flight`), so only one that invents numbers gets near it.
pub const MAX_GATHERING: usize = 64;

/// Decisions kept per group to name the participants of a collective reported later. A
/// collective's first report comes within its call's bound of the decision, and members run
/// only a few past it, so the oldest of this many is long settled.
pub const MAX_GATHERED: usize = 1024;

/// A collective with a deadline the master decided: the members it runs among, in ring order,
/// whether peers waited to join then, and its fate once known (committed, or aborted with this
/// failure).
#[derive(Debug, Clone)]
pub(super) struct Decided {
    included: Vec<PeerId>,
    pending: bool,
    fate: Option<Result<(), OpFailure>>,
}

/// A collective with a deadline, called by some members and not decided yet.
#[derive(Debug, Clone)]
pub(super) struct Gathering {
    /// When the minimum number of members had called (the deadline counts from then, so one
    /// member far ahead of the others does not leave them out), or when newcomers were answered
    /// after that (`restart_gathers`); `None` while fewer have called.
    since: Option<Instant>,
    /// The first member's deadline and minimum (0: more than half the ring).
    deadline: Duration,
    min: usize,
    /// The members that called it.
    called: BTreeSet<PeerId>,
    /// The first member's: those it never runs without (a broadcast's root).
    needs: Vec<PeerId>,
}

impl Gathering {
    /// The fewest members it may run among, of `live`.
    fn least(&self, live: usize) -> usize {
        if self.min == 0 {
            live / 2 + 1
        } else {
            self.min
        }
    }

    /// When the deadline passes (never, for one past the clock's range).
    fn due(&self) -> Option<Instant> {
        self.since?.checked_add(self.deadline)
    }
}

impl Master {
    /// `peer` called collective `seq` of `epoch` with a deadline (`Message::Gather`).
    #[allow(clippy::too_many_arguments)] // the message's fields, and who sent it when.
    pub(super) fn gather(
        &mut self,
        now: Instant,
        peer: PeerId,
        epoch: Epoch,
        seq: u64,
        deadline_ms: u64,
        min: u32,
        needs: Vec<PeerId>,
    ) {
        if epoch != self.g.ring_epoch {
            // Called in a replaced ring: it fails as any collective reported there.
            let reason = format!("topology {} was replaced by topology {}", epoch.0, self.g.ring_epoch.0);
            let failure = OpFailure::new(FailureKind::Superseded, peer, reason);
            return self.send_to_peer(peer, Message::OpAborted { epoch, derived: 0, seq, failure });
        }
        if self.g.issued > epoch && !self.g.gathered.contains_key(&(epoch, seq)) {
            // A newer topology replaces the ring, and its members make their next calls there:
            // this one can never be decided. It fails for all, as a collective the re-form cut.
            let reason = format!(
                "topology {} was issued before collective {seq} of topology {} was decided",
                self.g.issued.0, epoch.0
            );
            let failure = OpFailure::new(FailureKind::Superseded, peer, reason);
            return self.abort_unstarted(peer, epoch, seq, failure);
        }
        if let Some(d) = self.g.gathered.get(&(epoch, seq)) {
            let (included, pending, fate) = (d.included.clone(), d.pending, d.fate.clone());
            self.send_to_peer(peer, Message::Gathered { epoch, seq, included, pending });
            return match fate {
                Some(Ok(())) => self.send_to_peer(peer, Message::OpCommitted { epoch, derived: 0, seq }),
                Some(Err(failure)) => self.send_to_peer(peer, Message::OpAborted { epoch, derived: 0, seq, failure }),
                None => {}
            };
        }
        if let Some(failure) = self.aborted(epoch, seq) {
            // Aborted before it was decided (a member gave it up for a vote): it fails here too.
            return self.send_to_peer(peer, Message::OpAborted { epoch, derived: 0, seq, failure });
        }
        if !self.g.gathering.contains_key(&(epoch, seq)) && self.g.gathering.len() >= MAX_GATHERING {
            return self.violation(peer, super::PeerMisbehaved::TooManyOpenCollectives);
        }
        let deadline = Duration::from_millis(deadline_ms);
        // Only members can call it.
        let needs = needs.into_iter().filter(|p| self.g.ring.contains(p)).collect();
        let entry = self.g.gathering.entry((epoch, seq)).or_insert_with(|| Gathering {
            since: None,
            deadline,
            min: min as usize,
            called: BTreeSet::new(),
            needs,
        });
        entry.called.insert(peer);
        self.decide_gathers(now);
    }

    /// Decides every collective of the focused group whose members all called it, or whose
    /// deadline passed with enough of them; arms the group's timer for the next deadline.
    pub(super) fn decide_gathers(&mut self, now: Instant) {
        let live: Vec<PeerId> = self.g.ring.iter().copied().filter(|p| self.peers.contains_key(p)).collect();
        for g in self.g.gathering.values_mut() {
            if g.since.is_none() && live.iter().filter(|p| g.called.contains(p)).count() >= g.least(live.len()) {
                g.since = Some(now);
            }
        }
        let ready: Vec<((Epoch, u64), Vec<PeerId>)> = self
            .g
            .gathering
            .iter()
            .filter_map(|(key, g)| {
                let called: Vec<PeerId> = live.iter().copied().filter(|p| g.called.contains(p)).collect();
                // A newcomer that has made no call since its admission, or whose first
                // peers_pending waits for its tentative answer, is in no position to call yet:
                // not late (`restart_gathers`).
                let newcomer = |p: &PeerId| self.g.tentative.contains_key(p) || self.peers[p].fresh;
                let held = live.iter().any(|p| !g.called.contains(p) && newcomer(p));
                let due = g.due().is_some_and(|due| now >= due);
                // One it needs that left the run: the new topology ends it (`supersede_gathers`).
                let needed = g.needs.iter().all(|p| g.called.contains(p));
                let decided =
                    needed && (called.len() == live.len() || (due && called.len() >= g.least(live.len()) && !held));
                decided.then_some((*key, called))
            })
            .collect();
        for ((epoch, seq), included) in ready {
            let g = self.g.gathering.remove(&(epoch, seq)).expect("listed");
            let left_out: Vec<String> = live.iter().filter(|p| !included.contains(p)).map(|p| p.to_string()).collect();
            if !left_out.is_empty() {
                log::info!(
                    "group {}: collective {seq} of topology {} runs without {} (not called {:.3} s after the first {}, \
                     {} of {} called)",
                    self.focus.0,
                    epoch.0,
                    left_out.join(", "),
                    g.deadline.as_secs_f64(),
                    g.least(live.len()),
                    included.len(),
                    live.len()
                );
            }
            if self.g.gathered.len() >= MAX_GATHERED {
                self.g.gathered.pop_first();
            }
            // Whether newcomers wait, told with the decision: one message, so every member acts
            // on the same answer at the same point of its calls without a vote of the whole
            // group, which would wait for the straggler the deadline left out.
            let pending = self.admission_due();
            self.g.gathered.insert((epoch, seq), Decided { included: included.clone(), pending, fate: None });
            for &p in &live {
                self.send_to_peer(p, Message::Gathered { epoch, seq, included: included.clone(), pending });
            }
        }
        let next = self.g.gathering.values().filter_map(Gathering::due).filter(|t| *t > now).min();
        match next {
            Some(at) => self.timers.set(Timer::Gather(self.focus), at),
            None => self.timers.clear(Timer::Gather(self.focus)),
        }
        debug_assert!(self.g.gathering.keys().all(|k| !self.g.gathered.contains_key(k)), "decided, yet gathering");
    }

    /// Newcomers' first `peers_pending` votes were answered: they go on to the call the others
    /// are in, so the deadline of a collective with one not decided yet counts from now.
    pub(super) fn restart_gathers(&mut self, now: Instant) {
        for g in self.g.gathering.values_mut() {
            g.since = g.since.map(|since| since.max(now));
        }
        self.decide_gathers(now);
    }

    /// The participants the master decided for collective `seq` of `epoch` of the focused
    /// group, if it was called with a deadline.
    pub(super) fn gathered_members(&self, epoch: Epoch, seq: u64) -> Option<&[PeerId]> {
        self.g.gathered.get(&(epoch, seq)).map(|d| d.included.as_slice())
    }

    /// Collective `seq` of `epoch` of the focused group's whole group, if it was called with a
    /// deadline, committed (`Ok`) or was aborted: the members left out of it learn so, and end
    /// their call of it alike. Once only.
    pub(super) fn gathered_fate(&mut self, epoch: Epoch, seq: u64, fate: Result<(), OpFailure>) {
        let Some(d) = self.g.gathered.get_mut(&(epoch, seq)).filter(|d| d.fate.is_none()) else { return };
        d.fate = Some(fate.clone());
        let left_out: Vec<PeerId> = self.g.ring.iter().copied().filter(|p| !d.included.contains(p)).collect();
        let message = match fate {
            Ok(()) => Message::OpCommitted { epoch, derived: 0, seq },
            Err(failure) => Message::OpAborted { epoch, derived: 0, seq, failure },
        };
        for p in left_out {
            self.send_to_peer(p, message.clone());
        }
    }

    /// The collectives with a deadline of the focused group's ring whose members all left the
    /// run before any told how it ended: nobody holds their result, so they failed.
    pub(super) fn abandon_gathered(&mut self) {
        let orphaned: Vec<((Epoch, u64), PeerId)> = self
            .g
            .gathered
            .iter()
            .filter(|(_, d)| d.fate.is_none() && d.included.iter().all(|p| !self.peers.contains_key(p)))
            .filter_map(|(k, d)| Some((*k, *d.included.first()?)))
            .collect();
        for ((epoch, seq), first) in orphaned {
            let reason = format!("every member collective {seq} ran among left the run");
            self.gathered_fate(epoch, seq, Err(OpFailure::new(FailureKind::PeerLost, first, reason)));
        }
    }

    /// Topology `next` was issued to the focused group: the members that have not called a
    /// collective with a deadline of the ring in force yet make their next call in `next`, so one
    /// not decided yet never will be. It fails (retryably, as a collective a re-form cuts short),
    /// told to every member as any abort is: those that called it retry it in `next`, and one
    /// that calls it later fails its call alike, having done nothing (`PeerView::fail_next`).
    pub(super) fn supersede_gathers(&mut self, next: Epoch) {
        let open = std::mem::take(&mut self.g.gathering);
        for ((epoch, seq), g) in open {
            let reason =
                format!("topology {} was issued before collective {seq} of topology {} was decided", next.0, epoch.0);
            let Some(&any) = g.called.iter().next() else { continue };
            let failure = OpFailure::new(FailureKind::Superseded, any, reason);
            if epoch == self.g.ring_epoch {
                self.abort_unstarted(any, epoch, seq, failure);
            }
        }
        self.timers.clear(Timer::Gather(self.focus));
    }

    /// A new topology replaces the focused group's ring: its collectives with a deadline are
    /// over, and one still undecided fails for the members that called it (none can be: a
    /// topology commits only once every member is between calls).
    pub(super) fn close_gathers(&mut self, next: Epoch) {
        self.supersede_gathers(next);
        // Its participants told how each ended before they joined `next` (on the connection
        // their readiness came by): none is left to wait for. Should one be, it fails, so that
        // nobody left out of it waits for its bound.
        let open: Vec<(Epoch, u64)> =
            self.g.gathered.iter().filter(|(k, d)| k.0 < next && d.fate.is_none()).map(|(k, _)| *k).collect();
        for (epoch, seq) in open {
            log::warn!("collective {seq} of topology {} ended untold: it fails for the members left out", epoch.0);
            let me = self.g.ring.first().copied().unwrap_or(PeerId(0));
            let reason = format!("topology {} was replaced by topology {} during collective {seq}", epoch.0, next.0);
            self.gathered_fate(epoch, seq, Err(OpFailure::new(FailureKind::Superseded, me, reason)));
        }
        self.g.gathered.retain(|(epoch, _), _| *epoch >= next);
    }
}
