//! Ring all-reduce: a reduce-scatter followed by an all-gather, pipelined in chunks.
//!
//! The buffer of `len` elements is cut into `world` segments of nearly equal size, and each
//! segment into chunks of at most `chunk_elems` elements. There are `2 * (world - 1)` steps. At
//! step `s` rank `r` sends segment `(r - s) mod world` to its successor and receives segment
//! `(r - s - 1) mod world` from its predecessor. In the first `world - 1` steps (reduce-scatter)
//! a received chunk is reduced into the local buffer; after the last of them rank `r` holds the
//! complete reduction of segment `(r + 1) mod world`. In the remaining steps (all-gather) the
//! received chunk is copied into place.
//!
//! The segment a rank receives at step `s` is the one it sends at step `s + 1`, so the chunk
//! `c` sent at step `s + 1` may leave as soon as chunk `c` received at step `s` is reduced: that
//! is the pipeline, and the only ordering the executor has to respect ([`SendUnit::after_recv`]).
//!
//! Every element of segment `j` is accumulated in the same order on every run — rank `j`'s value,
//! then `j + 1`'s, and so on around the ring — and the final value is copied, never recomputed,
//! so every rank ends with bit-identical bytes whatever the timing.
//!
//! Each rank sends and receives `2 * (world - 1) / world * len` elements.

use crate::schedule::{chunks, Confirm, RecvAction, RecvUnit, Schedule, SendUnit};
use std::ops::Range;

/// The schedule of `rank` in a ring of `world` ranks over `len` elements, in chunks of at most
/// `chunk_elems` elements.
///
/// # Panics
/// If `world` is zero, `rank >= world`, or `chunk_elems` is zero.
///
/// # Examples
/// ```
/// let plan = shoal_collective::ring::all_reduce(0, 3, 9, 2);
/// // 2 * (world - 1) steps of one 3-element segment each, in chunks of 2 and 1 elements.
/// assert_eq!(plan.sends.len(), 4 * 2);
/// assert_eq!(plan.sends[0].range, 0..2);
/// ```
pub fn all_reduce(rank: usize, world: usize, len: usize, chunk_elems: usize) -> Schedule {
    assert!(world > 0 && rank < world, "rank {rank} outside a ring of {world}");
    assert!(chunk_elems > 0, "chunk size of zero elements");
    let steps = 2 * (world - 1);
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let segment = |s: isize| -> Range<usize> {
        let j = (rank as isize - s).rem_euclid(world as isize) as usize;
        segment_range(j, world, len)
    };
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    // Index in `recvs` where each step's units start, to resolve the pipeline dependency.
    let mut recv_step_start = Vec::with_capacity(steps);
    for s in 0..steps {
        recv_step_start.push(recvs.len());
        let action = if s + 1 < world { RecvAction::Reduce { last: s + 2 == world } } else { RecvAction::Copy };
        for range in chunks(segment(s as isize + 1), chunk_elems) {
            recvs.push(RecvUnit { from: prev, range, action });
        }
    }
    for s in 0..steps {
        for (c, range) in chunks(segment(s as isize), chunk_elems).enumerate() {
            let after_recv = s.checked_sub(1).map(|prev| recv_step_start[prev] + c);
            if let Some(i) = after_recv {
                debug_assert_eq!(recvs[i].range, range, "pipeline dependency on another chunk");
            }
            sends.push(SendUnit { to: next, range, after_recv, and_after_recv: None, after_combine: 0 });
        }
    }
    Schedule { world, rank, sends, recvs, confirm: Confirm::around(world), combine: None }
}

/// The ring all-gather of `rank` among `world` ranks over a buffer of `world` blocks of `block`
/// elements, rank `r`'s own in block `r`: at step `s` (of `world - 1`) rank `r` sends block
/// `(r - s) mod world` to its successor and copies block `(r - s - 1) mod world` from its
/// predecessor into place, pipelined in chunks as the all-reduce's second half.
pub fn all_gather(rank: usize, world: usize, block: usize, chunk_elems: usize) -> Schedule {
    steps(rank, world, chunk_elems, world.saturating_sub(1), |s| {
        let j = |k: isize| (rank as isize - k).rem_euclid(world as isize) as usize * block;
        (j(s as isize)..j(s as isize) + block, j(s as isize + 1)..j(s as isize + 1) + block, RecvAction::Copy)
    })
}

/// The ring reduce-scatter of `rank` among `world` ranks over a buffer of `world` blocks of
/// `block` elements: at step `s` (of `world - 1`) rank `r` sends block `(r - s - 1) mod world`
/// and reduces block `(r - s - 2) mod world` from its predecessor into its own, so that after
/// the last step block `r` holds the reduction of every rank's block `r` (accumulated from rank
/// `r + 1`'s around the ring, and divided once for an average). The other blocks hold partial
/// sums: the caller keeps only block `r`.
pub fn reduce_scatter(rank: usize, world: usize, block: usize, chunk_elems: usize) -> Schedule {
    steps(rank, world, chunk_elems, world.saturating_sub(1), |s| {
        let j = |k: isize| (rank as isize - k).rem_euclid(world as isize) as usize * block;
        let last = s + 2 == world;
        (
            j(s as isize + 1)..j(s as isize + 1) + block,
            j(s as isize + 2)..j(s as isize + 2) + block,
            RecvAction::Reduce { last },
        )
    })
}

/// The ring broadcast of `root`'s `len` elements: the root sends every chunk to its successor,
/// and every other rank copies each chunk from its predecessor into place and passes it on,
/// unless its successor is the root. Every rank receives `len` elements (the root none).
pub fn broadcast(rank: usize, world: usize, root: usize, len: usize, chunk_elems: usize) -> Schedule {
    assert!(world > 0 && rank < world && root < world, "rank {rank} or root {root} outside a ring of {world}");
    assert!(chunk_elems > 0, "chunk size of zero elements");
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let mut schedule =
        Schedule { world, rank, sends: Vec::new(), recvs: Vec::new(), confirm: Confirm::around(world), combine: None };
    if world == 1 {
        return schedule;
    }
    for (c, range) in chunks(0..len, chunk_elems).enumerate() {
        if rank != root {
            schedule.recvs.push(RecvUnit { from: prev, range: range.clone(), action: RecvAction::Copy });
        }
        if next != root {
            let after_recv = (rank != root).then_some(c);
            schedule.sends.push(SendUnit { to: next, range, after_recv, and_after_recv: None, after_combine: 0 });
        }
    }
    schedule
}

/// Steps of a ring phase: step `s` sends `step(s).0` to the successor and receives `step(s).1`
/// from the predecessor, doing `step(s).2` with it; chunk `c` of step `s + 1` is sent once
/// chunk `c` of step `s` arrived (the block received at one step is the one sent at the next).
fn steps(
    rank: usize,
    world: usize,
    chunk_elems: usize,
    count: usize,
    step: impl Fn(usize) -> (Range<usize>, Range<usize>, RecvAction),
) -> Schedule {
    assert!(world > 0 && rank < world, "rank {rank} outside a ring of {world}");
    assert!(chunk_elems > 0, "chunk size of zero elements");
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let (mut sends, mut recvs) = (Vec::new(), Vec::new());
    let mut recv_step_start = Vec::with_capacity(count);
    for s in 0..count {
        let (send, recv, action) = step(s);
        recv_step_start.push(recvs.len());
        recvs.extend(chunks(recv, chunk_elems).map(|range| RecvUnit { from: prev, range, action }));
        for (c, range) in chunks(send, chunk_elems).enumerate() {
            let after_recv = s.checked_sub(1).map(|p| recv_step_start[p] + c);
            sends.push(SendUnit { to: next, range, after_recv, and_after_recv: None, after_combine: 0 });
        }
    }
    Schedule { world, rank, sends, recvs, confirm: Confirm::around(world), combine: None }
}

/// The elements of segment `j` when `len` elements are cut into `world` nearly equal segments:
/// the first `len % world` segments hold one element more.
pub fn segment_range(j: usize, world: usize, len: usize) -> Range<usize> {
    debug_assert!(j < world);
    let (base, extra) = (len / world, len % world);
    let start = j * base + j.min(extra);
    start..start + base + usize::from(j < extra)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::testing::{inputs, naive, run, xorshift};
    use crate::ReduceOp;
    use proptest::prelude::*;

    /// Runs every rank's ring schedule in memory, in the interleaving `pick` chooses.
    fn run_ring(
        inputs: &[Vec<i64>],
        op: ReduceOp,
        chunk_elems: usize,
        pick: impl FnMut(usize) -> usize,
    ) -> Vec<Vec<i64>> {
        let (world, len) = (inputs.len(), inputs[0].len());
        let plans: Vec<_> = (0..world).map(|r| all_reduce(r, world, len, chunk_elems)).collect();
        run(&plans, inputs, op, pick)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn every_interleaving_matches_a_naive_reduction(
            world in 1usize..=9,
            len in 0usize..70,
            chunk in 1usize..9,
            op in prop::sample::select(ReduceOp::ALL.to_vec()),
            seed in any::<u64>(),
        ) {
            let mut rng = seed | 1;
            let inputs = inputs(world, len, &mut rng);
            let out = run_ring(&inputs, op, chunk, |n| { rng = xorshift(rng); (rng % n as u64) as usize });
            let want = naive(&inputs, op);
            for (r, buf) in out.iter().enumerate() {
                prop_assert_eq!(buf, &want, "rank {} differs", r);
            }
        }
    }

    #[test]
    fn large_world_and_awkward_lengths() {
        for (world, len, chunk) in [(64, 1000, 7), (64, 63, 1), (7, 1, 3), (2, 0, 4), (64, 4097, 16)] {
            let inputs: Vec<Vec<i64>> =
                (0..world).map(|r| (0..len).map(|i| (r * 31 + i) as i64 % 97).collect()).collect();
            let out = run_ring(&inputs, ReduceOp::Sum, chunk, |_| 0);
            let want = naive(&inputs, ReduceOp::Sum);
            assert!(out.iter().all(|b| b == &want), "world {world} len {len}");
        }
    }

    #[test]
    fn bytes_on_the_wire_match_the_formula() {
        // Each rank sends 2 (world - 1) / world of the buffer, exactly when world divides len.
        for world in 1..=9 {
            let len = world * 60;
            let plan = all_reduce(world / 2, world, len, 7);
            let sent: usize = plan.sends.iter().map(|u| u.range.len()).sum();
            let received: usize = plan.recvs.iter().map(|u| u.range.len()).sum();
            assert_eq!(sent, 2 * (world - 1) * len / world);
            assert_eq!(received, sent);
        }
    }

    /// Runs every rank's schedule of `plan` over `inputs`, in a random interleaving.
    fn run_plans(inputs: &[Vec<i64>], op: ReduceOp, seed: u64, plan: impl Fn(usize) -> Schedule) -> Vec<Vec<i64>> {
        let plans: Vec<_> = (0..inputs.len()).map(plan).collect();
        let mut rng = seed | 1;
        run(&plans, inputs, op, |n| {
            rng = xorshift(rng);
            (rng % n as u64) as usize
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(150))]
        #[test]
        fn all_gather_reduce_scatter_and_broadcast_match_their_definitions(
            world in 1usize..=7,
            block in 0usize..12,
            chunk in 1usize..5,
            root in 0usize..7,
            op in prop::sample::select(ReduceOp::ALL.to_vec()),
            seed in any::<u64>(),
        ) {
            let root = root % world;
            let mut rng = seed | 1;
            let len = world * block;
            let inputs = inputs(world, len, &mut rng);
            // All-gather: rank r contributes block r; everyone ends with every block.
            let out = run_plans(&inputs, op, seed, |r| all_gather(r, world, block, chunk));
            let gathered: Vec<i64> = (0..world).flat_map(|r| inputs[r][r * block..(r + 1) * block].to_vec()).collect();
            for buf in &out {
                prop_assert_eq!(buf, &gathered);
            }
            // Reduce-scatter: rank r's block r is every rank's block r reduced.
            let out = run_plans(&inputs, op, seed, |r| reduce_scatter(r, world, block, chunk));
            let want = naive(&inputs, op);
            for (r, buf) in out.iter().enumerate() {
                prop_assert_eq!(&buf[r * block..(r + 1) * block], &want[r * block..(r + 1) * block], "rank {}", r);
            }
            // Broadcast, around the ring and straight from the root.
            for out in [
                run_plans(&inputs, op, seed, |r| broadcast(r, world, root, len, chunk)),
                run_plans(&inputs, op, seed, |r| crate::oneshot::broadcast(r, world, root, len, chunk)),
            ] {
                for buf in &out {
                    prop_assert_eq!(buf, &inputs[root]);
                }
            }
        }
    }

    #[test]
    fn segments_tile_the_buffer() {
        for world in 1..=9 {
            for len in 0..30 {
                let mut next = 0;
                for j in 0..world {
                    let r = segment_range(j, world, len);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}
