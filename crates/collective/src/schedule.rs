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

/// Where a schedule folds inputs kept aside into the buffer: over `range` (elements), one fold
/// after another. Each fold runs once every unit to keep aside from its ranks arrived, the one
/// before it ran, and at least `after_sends` of this rank's sends left (those that read the
/// range); a send waits for as many folds as its [`SendUnit::after_combine`] says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Combine {
    /// Elements folded.
    pub range: Range<usize>,
    /// The folds, in the order they run.
    pub folds: Vec<Fold>,
}

/// One fold: the inputs of `ranks` over the combined range, in that order: this rank's from
/// its buffer (what the folds before left there), the others' from what it kept aside from them
/// ([`RecvAction::Stash`]). The same ranks in the same order on every rank that folds them give
/// bit-identical bytes: the order is fixed, and `∘` is commutative for every operator and type,
/// so which operand is the accumulator does not matter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fold {
    /// Whose inputs, in the order folded; each other rank's are kept aside for this fold alone.
    pub ranks: Vec<usize>,
    /// Sends that must have left first.
    pub after_sends: usize,
    /// Whether it completes the reduction: an average divides after it.
    pub completes: bool,
}

impl Combine {
    /// One fold of every rank's input over `range`, once `after_sends` sends left: one-shot's
    /// and two-shot's.
    pub fn everyone(world: usize, range: Range<usize>, after_sends: usize) -> Self {
        Combine { range, folds: vec![Fold { ranks: (0..world).collect(), after_sends, completes: true }] }
    }
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
    /// How many folds ([`Schedule::combine`]) it waits for: it sends folded elements.
    pub after_combine: usize,
}

impl SendUnit {
    /// A unit to `to` over `range` that waits for nothing.
    pub fn new(to: usize, range: Range<usize>) -> Self {
        SendUnit { to, range, after_recv: None, and_after_recv: None, after_combine: 0 }
    }

    /// Whether it may leave, given which receive units are complete and how many folds ran.
    pub fn ready(&self, received: impl Fn(usize) -> bool, folds: usize) -> bool {
        self.after_recv.is_none_or(&received)
            && self.and_after_recv.is_none_or(&received)
            && self.after_combine <= folds
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
    /// Keep aside as the sender's input, for the fold of its rank ([`Schedule::combine`]).
    Stash,
}

/// How the participants learn that every one of them holds the result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Confirm {
    /// Each rank's token goes round the ring, forwarded by every other rank: `world - 1` hops.
    Ring,
    /// Each rank sends its token straight to every other: one hop.
    Direct,
    /// By doubling distances (a dissemination barrier that carries every rank's token): rank `r`
    /// sends its own token to every rank a power of two ahead (`r + 1`, `r + 2`, `r + 4`, ...),
    /// and forwards the token of the rank `j` behind it to each `r + 2^k` with `2^k > j` that
    /// lacks it. At most `ceil(log2 world)` hops (a token goes straight to the ranks a power of two
    /// ahead, then on), each rank sending and receiving about `world - 1` tokens over
    /// `ceil(log2 world)` links each way.
    Doubling,
    /// Through each site's leader (the leader of each rank, by rank; a leader's is itself): a
    /// member sends its token to its leader; a leader sends its own and its members' to every
    /// other leader and to its members, and the other leaders' to its members. Three hops, one
    /// of them between sites, each rank sending over the links its data took.
    Leaders(Vec<usize>),
}

/// Largest group whose ring schedules confirm around the ring ([`Confirm::around`]).
pub const RING_CONFIRM_MAX: usize = 8;

impl Confirm {
    /// How a ring schedule among `world` ranks confirms: around the ring in a small group,
    /// where its `world - 1` hops cost little and it needs no link beyond the ring's; by
    /// doubling past [`RING_CONFIRM_MAX`], where a lap of 64 members' tokens took longer than
    /// the all-reduce's data.
    pub fn around(world: usize) -> Confirm {
        if world > RING_CONFIRM_MAX {
            Confirm::Doubling
        } else {
            Confirm::Ring
        }
    }
}

impl Schedule {
    /// Whether part of the result is inputs kept aside, folded.
    pub fn combines(&self) -> bool {
        self.combine.is_some()
    }

    /// How many folds it runs.
    pub fn folds(&self) -> usize {
        self.combine.as_ref().map_or(0, |c| c.folds.len())
    }

    /// The ranks whose inputs it keeps aside, in rank order: one slot of the buffer's size each.
    pub fn stashed(&self) -> Vec<usize> {
        let ranks: BTreeSet<usize> =
            self.recvs.iter().filter(|u| u.action == RecvAction::Stash).map(|u| u.from).collect();
        ranks.into_iter().collect()
    }

    /// The fold that reads what is kept aside from `rank`, by index.
    pub fn fold_of(&self, rank: usize) -> Option<usize> {
        self.combine.as_ref()?.folds.iter().position(|f| f.ranks.contains(&rank))
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

    /// Where rank `origin`'s confirmation token goes next from here (another rank's: this
    /// rank's own go to [`Schedule::token_targets`]).
    pub fn forward_token(&self, origin: usize) -> Vec<usize> {
        match &self.confirm {
            Confirm::Ring => {
                let next = (self.rank + 1) % self.world;
                if next != origin {
                    vec![next]
                } else {
                    Vec::new()
                }
            }
            Confirm::Direct => Vec::new(),
            Confirm::Doubling => self.doubling_targets(self.behind(origin)),
            Confirm::Leaders(leader) if leader[origin] == self.rank => self.site_targets(leader, Some(origin)),
            Confirm::Leaders(leader) if leader[self.rank] == self.rank => self.site_targets(leader, None),
            Confirm::Leaders(_) => Vec::new(),
        }
    }

    /// The rank that `origin`'s token reaches this rank from.
    pub fn token_from(&self, origin: usize) -> usize {
        match &self.confirm {
            Confirm::Ring => (self.rank + self.world - 1) % self.world,
            Confirm::Direct => origin,
            // Learned in the round of the distance's highest bit, from that far behind.
            Confirm::Doubling => {
                let j = self.behind(origin);
                let high = 1usize << (usize::BITS - 1 - j.leading_zeros());
                (self.rank + self.world - high) % self.world
            }
            // A leader has its members' from them and the other sites' from their leaders;
            // a member has every token from its leader.
            Confirm::Leaders(leader) if leader[origin] == self.rank => origin,
            Confirm::Leaders(leader) if leader[self.rank] == self.rank => leader[origin],
            Confirm::Leaders(leader) => leader[self.rank],
        }
    }

    /// Where this rank's own token goes once its data moved.
    pub fn token_targets(&self) -> Vec<usize> {
        match &self.confirm {
            Confirm::Ring if self.world > 1 => vec![(self.rank + 1) % self.world],
            Confirm::Ring => Vec::new(),
            Confirm::Direct => (0..self.world).filter(|&r| r != self.rank).collect(),
            Confirm::Doubling => self.doubling_targets(0),
            Confirm::Leaders(leader) if leader[self.rank] == self.rank => self.site_targets(leader, Some(self.rank)),
            Confirm::Leaders(leader) => vec![leader[self.rank]],
        }
    }

    /// How many tokens this rank sends in all, its own and those it forwards.
    pub fn tokens_sent(&self) -> usize {
        match &self.confirm {
            Confirm::Ring | Confirm::Direct => self.world - 1,
            Confirm::Doubling => (0..self.world).map(|j| self.doubling_targets(j).len()).sum(),
            Confirm::Leaders(_) => {
                let forwarded: usize =
                    (0..self.world).filter(|&o| o != self.rank).map(|o| self.forward_token(o).len()).sum();
                self.token_targets().len() + forwarded
            }
        }
    }

    /// Where a leader sends a token of its own site's (`own`: the origin, its own or a
    /// member's): to every other leader and its other members; another site's (`None`): to its
    /// members.
    fn site_targets(&self, leader: &[usize], own: Option<usize>) -> Vec<usize> {
        let member = |r: usize| leader[r] == self.rank && r != self.rank && Some(r) != own;
        let leads = |r: usize| own.is_some() && leader[r] == r && r != self.rank;
        (0..self.world).filter(|&r| member(r) || leads(r)).collect()
    }

    /// How far `origin` is behind this rank, going round the group.
    fn behind(&self, origin: usize) -> usize {
        (self.rank + self.world - origin) % self.world
    }

    /// Where the token of the rank `j` behind this one goes by doubling: in round `k` to the
    /// rank `2^k` ahead, once held (`2^k > j`; it was learned in an earlier round, or is our
    /// own), while that rank lacks it (`j < world - 2^k`: it holds the `2^k` behind itself).
    fn doubling_targets(&self, j: usize) -> Vec<usize> {
        let rounds = (0..usize::BITS).map(|k| 1usize << k).take_while(|&d| d < self.world);
        rounds.filter(|&d| d > j && j < self.world - d).map(|d| (self.rank + d) % self.world).collect()
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
        // Folds run, by rank.
        let mut combined = vec![0usize; world];
        // Final reductions still to come, by rank and first element.
        let mut lasts: Vec<BTreeMap<usize, usize>> = plans.iter().map(Schedule::final_reductions).collect();
        // The next unit each rank expects from each sender, in order.
        let next_from =
            |p: &Schedule, got: &[bool], from: usize| (0..p.recvs.len()).find(|&i| p.recvs[i].from == from && !got[i]);
        loop {
            let mut ready = Vec::new();
            for (r, p) in plans.iter().enumerate() {
                if let Some(c) = p.combine.as_ref() {
                    while let Some(f) = c.folds.get(combined[r]) {
                        let k = combined[r];
                        let stashed = (0..p.recvs.len()).all(|i| {
                            p.recvs[i].action != RecvAction::Stash
                                || p.fold_of(p.recvs[i].from) != Some(k)
                                || received[r][i]
                        });
                        if !stashed || sent[r] < f.after_sends {
                            break;
                        }
                        fold(&mut bufs[r], &stash[r], c.range.clone(), (r, world), f, op);
                        combined[r] += 1;
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
            assert_eq!(combined[r], p.folds(), "rank {r} did not fold");
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

    /// Runs `f` over `range` of `buf`, as the engine does.
    fn fold(
        buf: &mut [i64],
        stash: &BTreeMap<usize, Vec<i64>>,
        range: Range<usize>,
        (rank, world): (usize, usize),
        f: &Fold,
        op: ReduceOp,
    ) {
        for e in range {
            let value = |k: usize| if k == rank { buf[e] } else { stash[&k][e] };
            let mut acc = vec![value(f.ranks[0])];
            for &k in &f.ranks[1..] {
                let d: &mut [u8] = bytemuck::cast_slice_mut(&mut acc);
                reduce_into(DType::I64, op, d, bytemuck::cast_slice(&[value(k)])).unwrap();
            }
            if op == ReduceOp::Avg && f.completes {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// Every rank's tokens, delivered as the engine forwards them: each rank gets every other
    /// rank's token exactly once, from the rank `token_from` names, sends what `tokens_sent`
    /// says; returns the most hops a token took.
    fn confirm(world: usize, confirm: Confirm) -> usize {
        let plans: Vec<Schedule> = (0..world)
            .map(|rank| Schedule {
                world,
                rank,
                sends: Vec::new(),
                recvs: Vec::new(),
                confirm: confirm.clone(),
                combine: None,
            })
            .collect();
        // (from, to, origin, hops)
        let mut wire: VecDeque<(usize, usize, usize, usize)> = VecDeque::new();
        let mut sent = vec![0; world];
        for p in &plans {
            for to in p.token_targets() {
                wire.push_back((p.rank, to, p.rank, 1));
                sent[p.rank] += 1;
            }
        }
        let mut got = vec![BTreeSet::new(); world];
        let mut most = 0;
        while let Some((from, to, origin, hops)) = wire.pop_front() {
            let p = &plans[to];
            assert_ne!(origin, to, "{confirm:?} {world}: rank {to} got its own token");
            assert_eq!(p.token_from(origin), from, "{confirm:?} {world}: rank {origin}'s token reached {to}");
            assert!(got[to].insert(origin), "{confirm:?} {world}: rank {to} got {origin}'s token twice");
            most = most.max(hops);
            for next in p.forward_token(origin) {
                wire.push_back((to, next, origin, hops + 1));
                sent[to] += 1;
            }
        }
        for p in &plans {
            assert_eq!(got[p.rank].len(), world - 1, "{confirm:?} {world}: rank {} lacks tokens", p.rank);
            assert_eq!(sent[p.rank], p.tokens_sent(), "{confirm:?} {world}: rank {}", p.rank);
            let froms: BTreeSet<usize> = (0..world).filter(|&o| o != p.rank).map(|o| p.token_from(o)).collect();
            assert!(froms.iter().all(|f| p.peers_from().contains(f)));
        }
        most
    }

    #[test]
    fn every_rank_gets_every_token_once_and_doubling_takes_log_hops() {
        for world in 1usize..=70 {
            let log = (usize::BITS - (world.max(1) - 1).leading_zeros()) as usize; // ceil(log2 world)
            assert_eq!(confirm(world, Confirm::Ring), world.saturating_sub(1));
            assert_eq!(confirm(world, Confirm::Direct), usize::from(world > 1));
            // A token goes straight to each rank a power of two ahead, then on: as many hops as
            // the distance has bits, at most ceil(log2 world).
            let bits = (1..world).map(|j| j.count_ones() as usize).max().unwrap_or(0);
            assert_eq!(confirm(world, Confirm::Doubling), bits, "{world}");
            assert!(bits <= log);
            // Through leaders: at most member to leader, leader to leader, leader to member.
            for sites in [1, 3, 7] {
                let leaders = crate::twolevel::leaders(world, &(0..world).map(|r| r % sites).collect::<Vec<_>>());
                let hops = confirm(world, Confirm::Leaders(leaders));
                assert!(hops <= 3 && (world == 1 || hops >= 1), "{world} in {sites} sites: {hops} hops");
            }
        }
        assert_eq!(confirm(1000, Confirm::Doubling), 9); // 511 = 0b111111111
                                                         // Each rank links to ceil(log2 world) others and sends about world - 1 tokens.
        let p = Schedule {
            world: 1000,
            rank: 7,
            sends: Vec::new(),
            recvs: Vec::new(),
            confirm: Confirm::Doubling,
            combine: None,
        };
        assert_eq!(p.token_targets().len(), 10);
        assert!((999..1010).contains(&p.tokens_sent()), "{}", p.tokens_sent());
    }
}
