//! What one rank does in one collective: the chunks it sends to whom, the chunks it receives
//! from whom and what it does with each, and how it learns that every participant holds the
//! result. The algorithms ([`crate::ring`], [`crate::oneshot`]) build a [`Schedule`]; the peer's
//! engine executes it over its links, and the tests here execute every rank's schedule in memory.
//!
//! The units a rank receives from one sender are that sender's units for it, in the same order
//! and with the same ranges: a frame on the wire names its unit, so the two sides agree on which
//! bytes a chunk carries whatever lane carried it.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

/// The complete plan of one rank for one collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Ranks in the group.
    pub world: usize,
    /// This rank.
    pub rank: usize,
    /// What this rank sends, in the order it may leave.
    pub sends: Vec<SendUnit>,
    /// What this rank receives; a frame names its index here.
    pub recvs: Vec<RecvUnit>,
    /// How the participants confirm that each holds the result, once its data moved.
    pub confirm: Confirm,
    /// Where the inputs kept aside are folded into the buffer, if anywhere.
    pub combine: Option<Combine>,
}

/// The fold of every rank's input over `range` (elements), in rank order: this rank's own from
/// its buffer, the others' from what it kept aside ([`RecvAction::Stash`]). It runs once every
/// unit to keep aside arrived and at least `after_sends` of this rank's sends left (those that
/// read the range); sends marked [`SendUnit::after_combine`] wait for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Combine {
    /// Elements folded.
    pub range: Range<usize>,
    /// Sends that must have left first.
    pub after_sends: usize,
}

/// One chunk this rank sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendUnit {
    /// The rank it goes to.
    pub to: usize,
    /// Elements of the buffer to send.
    pub range: Range<usize>,
    /// Index into `recvs` of the unit that must be complete before this one is sent.
    pub after_recv: Option<usize>,
    /// A second unit it waits for: a hierarchical leader forwards a chunk once both its ring
    /// predecessor's part and its own host's sum arrived.
    pub and_after_recv: Option<usize>,
    /// Whether it waits for the fold ([`Schedule::combine`]): it sends folded elements.
    pub after_combine: bool,
}

impl SendUnit {
    /// A unit to `to` over `range` that waits for nothing.
    pub fn new(to: usize, range: Range<usize>) -> Self {
        SendUnit { to, range, after_recv: None, and_after_recv: None, after_combine: false }
    }

    /// Whether it may leave, given which receive units are complete and whether the fold ran.
    pub fn ready(&self, received: impl Fn(usize) -> bool, combined: bool) -> bool {
        self.after_recv.is_none_or(&received)
            && self.and_after_recv.is_none_or(&received)
            && (!self.after_combine || combined)
    }
}

/// One chunk this rank receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvUnit {
    /// The rank it comes from.
    pub from: usize,
    /// Elements of the buffer the chunk belongs to.
    pub range: Range<usize>,
    /// What to do with the received elements.
    pub action: RecvAction,
}

/// What to do with a received chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvAction {
    /// Reduce into the local buffer. `last` marks a final reduction of these elements: once
    /// every receive of the same elements marked `last` is applied (one, except at a
    /// hierarchical leader, [`crate::hier`]), they hold the complete result and an average is
    /// divided.
    Reduce {
        /// Whether this completes the elements' reduction.
        last: bool,
    },
    /// Copy into the local buffer.
    Copy,
    /// Keep aside as the sender's input, for the fold ([`Schedule::combine`]).
    Stash,
}

/// How the participants learn that every one of them holds the result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirm {
    /// Each rank's token goes round the ring, forwarded by every other rank: `world - 1` hops.
    Ring,
    /// Each rank sends its token straight to every other: one hop.
    Direct,
}

impl Schedule {
    /// Whether part of the result is every rank's input folded in rank order.
    pub fn combines(&self) -> bool {
        self.combine.is_some()
    }

    /// How many final reductions (`Reduce { last: true }`) each range has, by its first element.
    pub fn final_reductions(&self) -> BTreeMap<usize, usize> {
        let mut lasts = BTreeMap::new();
        for u in &self.recvs {
            if u.action == (RecvAction::Reduce { last: true }) {
                *lasts.entry(u.range.start).or_default() += 1;
            }
        }
        lasts
    }

    /// The ranks this rank sends chunks or tokens to.
    pub fn peers_to(&self) -> BTreeSet<usize> {
        self.sends.iter().map(|u| u.to).chain(self.token_targets()).collect()
    }

    /// The ranks this rank receives chunks or tokens from.
    pub fn peers_from(&self) -> BTreeSet<usize> {
        let tokens = (0..self.world).filter(|&o| o != self.rank).map(|o| self.token_from(o));
        self.recvs.iter().map(|u| u.from).chain(tokens).collect()
    }

    /// Where rank `origin`'s confirmation token goes next from here, if anywhere.
    pub fn forward_token(&self, origin: usize) -> Option<usize> {
        match self.confirm {
            Confirm::Ring => {
                let next = (self.rank + 1) % self.world;
                (next != origin).then_some(next)
            }
            Confirm::Direct => None,
        }
    }

    /// The rank that `origin`'s token reaches this rank from.
    pub fn token_from(&self, origin: usize) -> usize {
        match self.confirm {
            Confirm::Ring => (self.rank + self.world - 1) % self.world,
            Confirm::Direct => origin,
        }
    }

    /// Where this rank's own token goes once its data moved.
    pub fn token_targets(&self) -> Vec<usize> {
        match self.confirm {
            Confirm::Ring if self.world > 1 => vec![(self.rank + 1) % self.world],
            Confirm::Ring => Vec::new(),
            Confirm::Direct => (0..self.world).filter(|&r| r != self.rank).collect(),
        }
    }
}

/// Cuts `range` into chunks of at most `chunk_elems` elements.
pub(crate) fn chunks(range: Range<usize>, chunk_elems: usize) -> impl Iterator<Item = Range<usize>> {
    let end = range.end;
    range.clone().step_by(chunk_elems).map(move |start| start..(start + chunk_elems).min(end))
}

#[cfg(test)]
pub(crate) mod testing {
    //! Every rank's schedule run in memory, in any order the dependencies allow.
    use super::*;
    use crate::{finish_avg, reduce_into, DType, ReduceOp};
    use std::collections::{BTreeMap, VecDeque};

    /// Runs every rank's schedule. `pick` chooses which ready action runs next, so a test can
    /// explore any interleaving. Returns every rank's buffer.
    pub fn run(
        plans: &[Schedule],
        inputs: &[Vec<i64>],
        op: ReduceOp,
        mut pick: impl FnMut(usize) -> usize,
    ) -> Vec<Vec<i64>> {
        let world = inputs.len();
        let mut bufs: Vec<Vec<i64>> = inputs.to_vec();
        let mut stash: Vec<BTreeMap<usize, Vec<i64>>> = vec![BTreeMap::new(); world];
        // In-flight chunks on the link from rank a to rank b, in order.
        let mut links: BTreeMap<(usize, usize), VecDeque<Vec<i64>>> = BTreeMap::new();
        let (mut sent, mut received) = (vec![0usize; world], vec![vec![false; 0]; world]);
        for (r, p) in plans.iter().enumerate() {
            received[r] = vec![false; p.recvs.len()];
        }
        let mut combined = vec![false; world];
        // Final reductions still to come, by rank and first element.
        let mut lasts: Vec<BTreeMap<usize, usize>> = plans.iter().map(Schedule::final_reductions).collect();
        // The next unit each rank expects from each sender, in order.
        let next_from =
            |p: &Schedule, got: &[bool], from: usize| (0..p.recvs.len()).find(|&i| p.recvs[i].from == from && !got[i]);
        loop {
            let mut ready = Vec::new();
            for (r, p) in plans.iter().enumerate() {
                if let Some(c) = p.combine.as_ref().filter(|_| !combined[r]) {
                    let stashed = (0..p.recvs.len()).all(|k| p.recvs[k].action != RecvAction::Stash || received[r][k]);
                    if stashed && sent[r] >= c.after_sends {
                        fold(&mut bufs[r], &stash[r], c.range.clone(), r, world, op);
                        combined[r] = true;
                    }
                }
                if let Some(u) = p.sends.get(sent[r]) {
                    if u.ready(|i| received[r][i], combined[r]) {
                        ready.push((r, None));
                    }
                }
                for from in p.peers_from() {
                    if links.get(&(from, r)).is_some_and(|l| !l.is_empty()) {
                        ready.push((r, Some(from)));
                    }
                }
            }
            if ready.is_empty() {
                break;
            }
            let (r, from) = ready[pick(ready.len())];
            let p = &plans[r];
            let Some(from) = from else {
                let u = &p.sends[sent[r]];
                links.entry((r, u.to)).or_default().push_back(bufs[r][u.range.clone()].to_vec());
                sent[r] += 1;
                continue;
            };
            let data = links.get_mut(&(from, r)).unwrap().pop_front().unwrap();
            let i = next_from(p, &received[r], from).expect("a chunk nobody expects");
            let u = &p.recvs[i];
            assert_eq!(data.len(), u.range.len(), "stream desynchronised");
            let dst = &mut bufs[r][u.range.clone()];
            match u.action {
                RecvAction::Copy => dst.copy_from_slice(&data),
                RecvAction::Reduce { last } => {
                    let d: &mut [u8] = bytemuck::cast_slice_mut(dst);
                    reduce_into(DType::I64, op, d, bytemuck::cast_slice(&data)).unwrap();
                    let left = lasts[r].entry(u.range.start).or_default();
                    *left = left.saturating_sub(usize::from(last));
                    if last && *left == 0 && op == ReduceOp::Avg {
                        finish_avg(DType::I64, d, world).unwrap();
                    }
                }
                RecvAction::Stash => {
                    let s = stash[r].entry(from).or_insert_with(|| vec![0; inputs[r].len()]);
                    s[u.range.clone()].copy_from_slice(&data);
                }
            }
            received[r][i] = true;
        }
        for (r, p) in plans.iter().enumerate() {
            assert_eq!(sent[r], p.sends.len(), "rank {r} stalled");
            assert!(received[r].iter().all(|&g| g), "rank {r} stalled");
            assert_eq!(combined[r], p.combines(), "rank {r} never folded");
        }
        bufs
    }

    /// Runs every rank's all-reduce schedule from `plan(rank, world, len, chunk)` over random
    /// inputs in a random interleaving; the first rank whose result differs from a naive
    /// reduction, if any.
    pub fn all_reduce_differs(
        plan: impl Fn(usize, usize, usize, usize) -> Schedule,
        (world, len, chunk): (usize, usize, usize),
        op: ReduceOp,
        seed: u64,
    ) -> Option<usize> {
        let mut rng = seed | 1;
        let inputs = inputs(world, len, &mut rng);
        let plans: Vec<_> = (0..world).map(|r| plan(r, world, len, chunk)).collect();
        let out = run(&plans, &inputs, op, |n| {
            rng = xorshift(rng);
            (rng % n as u64) as usize
        });
        let want = naive(&inputs, op);
        out.iter().position(|buf| buf != &want)
    }

    /// Folds every rank's input over `range` into `buf` in rank order, as the engine does.
    fn fold(
        buf: &mut [i64],
        stash: &BTreeMap<usize, Vec<i64>>,
        range: Range<usize>,
        rank: usize,
        world: usize,
        op: ReduceOp,
    ) {
        for e in range {
            let value = |k: usize| if k == rank { buf[e] } else { stash[&k][e] };
            let mut acc = vec![value(0)];
            for k in 1..world {
                let d: &mut [u8] = bytemuck::cast_slice_mut(&mut acc);
                reduce_into(DType::I64, op, d, bytemuck::cast_slice(&[value(k)])).unwrap();
            }
            if op == ReduceOp::Avg {
                finish_avg(DType::I64, bytemuck::cast_slice_mut(&mut acc), world).unwrap();
            }
            buf[e] = acc[0];
        }
    }

    /// The reduction of `inputs` element by element, in rank order.
    pub fn naive(inputs: &[Vec<i64>], op: ReduceOp) -> Vec<i64> {
        let world = inputs.len();
        (0..inputs[0].len())
            .map(|i| {
                let mut acc = inputs[0][i];
                for x in &inputs[1..] {
                    acc = match op {
                        ReduceOp::Sum | ReduceOp::Avg => acc.wrapping_add(x[i]),
                        ReduceOp::Prod => acc.wrapping_mul(x[i]),
                        ReduceOp::Min => acc.min(x[i]),
                        ReduceOp::Max => acc.max(x[i]),
                    };
                }
                if op == ReduceOp::Avg {
                    acc / world as i64
                } else {
                    acc
                }
            })
            .collect()
    }

    pub fn xorshift(mut x: u64) -> u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }

    /// `world` random inputs of `len` elements.
    pub fn inputs(world: usize, len: usize, rng: &mut u64) -> Vec<Vec<i64>> {
        (0..world)
            .map(|_| {
                (0..len)
                    .map(|_| {
                        *rng = xorshift(*rng);
                        (*rng % 2001) as i64 - 1000
                    })
                    .collect()
            })
            .collect()
    }
}
