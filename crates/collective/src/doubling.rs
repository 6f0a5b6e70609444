//! Recursive-doubling all-reduce: `log2` rounds of whole-buffer exchanges, for small buffers in
//! large groups.
//!
//! With `p` the largest power of two up to `world`, ranks `0..p` run the rounds: in round `k`
//! rank `r` sends what it holds to `r ^ 2^k`, keeps what comes back aside, and folds the two in
//! rank order ([`Fold`]). After round `k` the `2^(k+1)` ranks of each aligned block hold the same
//! bytes: the two halves each held one value (by induction) and both sides fold lower half then
//! upper half. The `world - p` ranks past `p` send their input to `r - p` first, which folds it
//! in before its rounds; in the last round both values it folds also go to its partner past `p`,
//! which folds them as it does (rather than take its result: a quantized collective's result
//! would change when encoded again).
//!
//! Each rank sends and receives `len` elements per round, `log2 p` hops in all (one more where
//! `world` is not a power of two), against one-shot's `world - 1` buffers per rank and the
//! ring's `2 (world - 1)` hops: the schedule for small buffers once a group is too large for
//! one-shot's `world²` messages. It keeps `log2 world` buffers aside.
//!
//! The confirmation goes straight to every rank up to [`DIRECT_CONFIRM_MAX`] ranks (one hop), by
//! doubling distances beyond ([`Confirm::Doubling`], `log2 world` links per rank).

use crate::schedule::{chunks, Combine, Confirm, Fold, RecvAction, RecvUnit, Schedule, SendUnit};

/// Largest group whose tokens go straight to every rank.
pub const DIRECT_CONFIRM_MAX: usize = 8;

/// The schedule of `rank` among `world` ranks over `len` elements, in chunks of at most
/// `chunk_elems` elements.
///
/// # Panics
/// If `world` is zero, `rank >= world`, or `chunk_elems` is zero.
///
/// # Examples
/// ```
/// let plan = shoal_collective::doubling::all_reduce(1, 4, 8, 8);
/// // Round 0 with rank 0, round 1 with rank 3: each fold waits for the one before.
/// assert_eq!(plan.sends.iter().map(|u| (u.to, u.after_combine)).collect::<Vec<_>>(), [(0, 0), (3, 1)]);
/// let folds = &plan.combine.unwrap().folds;
/// assert_eq!(folds.iter().map(|f| f.ranks.clone()).collect::<Vec<_>>(), [vec![0, 1], vec![1, 3]]);
/// ```
pub fn all_reduce(rank: usize, world: usize, len: usize, chunk_elems: usize) -> Schedule {
    assert!(world > 0 && rank < world, "rank {rank} outside a group of {world}");
    assert!(chunk_elems > 0, "chunk size of zero elements");
    let p = 1usize << (usize::BITS - 1 - world.leading_zeros());
    let confirm = if world > DIRECT_CONFIRM_MAX { Confirm::Doubling } else { Confirm::Direct };
    let mut plan = Schedule { world, rank, sends: Vec::new(), recvs: Vec::new(), confirm, combine: None };
    let whole = || chunks(0..len, chunk_elems);
    let send = |plan: &mut Schedule, to: usize, after_combine: usize| {
        plan.sends.extend(whole().map(|range| SendUnit { after_combine, ..SendUnit::new(to, range) }));
    };
    let recv = |plan: &mut Schedule, from: usize, action: RecvAction| {
        plan.recvs.extend(whole().map(|range| RecvUnit { from, range, action }));
    };
    let rounds: Vec<usize> = (0..usize::BITS).map(|k| 1usize << k).take_while(|&d| d < p).collect();
    // Where a rank below p has one, its partner past p.
    let extra = |r: usize| (r + p < world).then_some(r + p);
    if rank >= p {
        // Past the largest power of two: our input to our partner below, then the two values
        // its last round folds, from it and its last partner, folded here as there.
        let i = rank - p;
        send(&mut plan, i, 0);
        let last = *rounds.last().expect("p > 1 where a rank is past it");
        let q = i ^ last;
        for from in [i.min(q), i.max(q)] {
            recv(&mut plan, from, RecvAction::Stash);
        }
        let fold = Fold { ranks: vec![i.min(q), i.max(q)], after_sends: 0, completes: true };
        plan.combine = Some(Combine { range: 0..len, folds: vec![fold] });
        return plan;
    }
    let mut folds = Vec::new();
    if let Some(e) = extra(rank) {
        recv(&mut plan, e, RecvAction::Stash);
        folds.push(Fold { ranks: vec![rank, e], after_sends: 0, completes: false });
    }
    for (k, &d) in rounds.iter().enumerate() {
        let q = rank ^ d;
        send(&mut plan, q, folds.len());
        if k + 1 == rounds.len() {
            // What the last round folds also goes to the ranks past p of both sides.
            for e in [extra(q), extra(rank)].into_iter().flatten() {
                send(&mut plan, e, folds.len());
            }
        }
        recv(&mut plan, q, RecvAction::Stash);
        // The fold overwrites what this round's sends read: after them.
        let completes = k + 1 == rounds.len();
        folds.push(Fold { ranks: vec![rank.min(q), rank.max(q)], after_sends: plan.sends.len(), completes });
    }
    if !folds.is_empty() {
        plan.combine = Some(Combine { range: 0..len, folds });
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::testing::all_reduce_differs;
    use crate::ReduceOp;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        /// Powers of two and not, in every interleaving the dependencies allow.
        #[test]
        fn matches_a_naive_reduction(
            world in 1usize..=20,
            len in 0usize..40,
            chunk in 1usize..9,
            op in prop::sample::select(ReduceOp::ALL.to_vec()),
            seed in any::<u64>(),
        ) {
            prop_assert_eq!(all_reduce_differs(all_reduce, (world, len, chunk), op, seed), None);
        }
    }

    #[test]
    fn log_rounds_and_log_buffers_aside() {
        for world in 1usize..=70 {
            let p = 1usize << (usize::BITS - 1 - world.leading_zeros());
            let rounds = p.trailing_zeros() as usize;
            for rank in 0..world {
                let plan = all_reduce(rank, world, 10, 10);
                let kept = plan.stashed().len();
                if rank >= p {
                    // Its input out, the last round's two values in.
                    assert_eq!((plan.sends.len(), kept, plan.folds()), (1, 2, 1), "{rank} of {world}");
                    continue;
                }
                // A buffer to and from each round's partner; in the last round also to the ranks
                // past p on both sides; in from our own partner past p first.
                let extras = |r: usize| usize::from(r + p < world);
                let last = rank ^ (p / 2);
                let sends = rounds + if rounds > 0 { extras(last) + extras(rank) } else { 0 };
                assert_eq!(plan.sends.len(), sends, "{rank} of {world}");
                assert_eq!(kept, rounds + extras(rank), "{rank} of {world}");
                assert_eq!(plan.folds(), kept);
            }
        }
    }
}
