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

use std::ops::Range;

/// The complete plan of one rank for one ring all-reduce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingAllReduce {
    /// What this rank sends to its successor, in stream order.
    pub sends: Vec<SendUnit>,
    /// What this rank receives from its predecessor, in stream order. The predecessor's
    /// `sends` list has the same ranges in the same order.
    pub recvs: Vec<RecvUnit>,
}

/// One chunk this rank sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendUnit {
    /// Elements of the buffer to send.
    pub range: Range<usize>,
    /// Index into `recvs` of the unit that must be complete before this one is sent.
    pub after_recv: Option<usize>,
}

/// One chunk this rank receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvUnit {
    /// Elements of the buffer the chunk belongs to.
    pub range: Range<usize>,
    /// What to do with the received elements.
    pub action: RecvAction,
}

/// What to do with a received chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvAction {
    /// Reduce into the local buffer. `last` marks the final reduce-scatter step, after which
    /// the chunk holds the complete reduction (and an average is divided).
    Reduce {
        /// Whether this completes the chunk's reduction.
        last: bool,
    },
    /// Copy into the local buffer (all-gather).
    Copy,
}

impl RingAllReduce {
    /// The schedule of `rank` in a ring of `world` ranks over `len` elements, in chunks of at
    /// most `chunk_elems` elements.
    ///
    /// # Panics
    /// If `world` is zero, `rank >= world`, or `chunk_elems` is zero.
    ///
    /// # Examples
    /// ```
    /// use shoal_collective::ring::RingAllReduce;
    /// let plan = RingAllReduce::new(0, 3, 9, 2);
    /// // 2 * (world - 1) steps of one 3-element segment each, in chunks of 2 and 1 elements.
    /// assert_eq!(plan.sends.len(), 4 * 2);
    /// assert_eq!(plan.sends[0].range, 0..2);
    /// ```
    pub fn new(rank: usize, world: usize, len: usize, chunk_elems: usize) -> Self {
        assert!(world > 0 && rank < world, "rank {rank} outside a ring of {world}");
        assert!(chunk_elems > 0, "chunk size of zero elements");
        let steps = 2 * (world - 1);
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
                recvs.push(RecvUnit { range, action });
            }
        }
        for s in 0..steps {
            for (c, range) in chunks(segment(s as isize), chunk_elems).enumerate() {
                let after_recv = s.checked_sub(1).map(|prev| recv_step_start[prev] + c);
                if let Some(i) = after_recv {
                    debug_assert_eq!(recvs[i].range, range, "pipeline dependency on another chunk");
                }
                sends.push(SendUnit { range, after_recv });
            }
        }
        RingAllReduce { sends, recvs }
    }
}

/// The elements of segment `j` when `len` elements are cut into `world` nearly equal segments:
/// the first `len % world` segments hold one element more.
pub fn segment_range(j: usize, world: usize, len: usize) -> Range<usize> {
    debug_assert!(j < world);
    let (base, extra) = (len / world, len % world);
    let start = j * base + j.min(extra);
    start..start + base + usize::from(j < extra)
}

fn chunks(range: Range<usize>, chunk_elems: usize) -> impl Iterator<Item = Range<usize>> {
    let end = range.end;
    range.clone().step_by(chunk_elems).map(move |start| start..(start + chunk_elems).min(end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{finish_avg, reduce_into, DType, ReduceOp};
    use proptest::prelude::*;

    /// Runs every rank's schedule in memory. `pick` chooses which ready action runs next, so a
    /// test can explore any interleaving the dependencies allow. Returns every rank's buffer.
    fn run_ring(
        inputs: &[Vec<i64>],
        op: ReduceOp,
        chunk_elems: usize,
        mut pick: impl FnMut(usize) -> usize,
    ) -> Vec<Vec<i64>> {
        let world = inputs.len();
        let len = inputs[0].len();
        let plans: Vec<_> = (0..world).map(|r| RingAllReduce::new(r, world, len, chunk_elems)).collect();
        let mut bufs: Vec<Vec<i64>> = inputs.to_vec();
        // In-flight chunks on the link from rank r to r+1, in order.
        let mut links: Vec<std::collections::VecDeque<Vec<i64>>> = vec![Default::default(); world];
        let (mut sent, mut received) = (vec![0usize; world], vec![0usize; world]);
        loop {
            // Ready actions: (rank, is_send).
            let mut ready = Vec::new();
            for r in 0..world {
                if let Some(u) = plans[r].sends.get(sent[r]) {
                    if u.after_recv.is_none_or(|i| i < received[r]) {
                        ready.push((r, true));
                    }
                }
                let prev = (r + world - 1) % world;
                if received[r] < plans[r].recvs.len() && !links[prev].is_empty() {
                    ready.push((r, false));
                }
            }
            if ready.is_empty() {
                break;
            }
            let (r, is_send) = ready[pick(ready.len())];
            if is_send {
                let u = &plans[r].sends[sent[r]];
                links[r].push_back(bufs[r][u.range.clone()].to_vec());
                sent[r] += 1;
            } else {
                let prev = (r + world - 1) % world;
                let data = links[prev].pop_front().unwrap();
                let u = &plans[r].recvs[received[r]];
                assert_eq!(data.len(), u.range.len(), "stream desynchronised");
                let dst = &mut bufs[r][u.range.clone()];
                match u.action {
                    RecvAction::Copy => dst.copy_from_slice(&data),
                    RecvAction::Reduce { last } => {
                        let d: &mut [u8] = bytemuck::cast_slice_mut(dst);
                        reduce_into(DType::I64, op, d, bytemuck::cast_slice(&data)).unwrap();
                        if last && op == ReduceOp::Avg {
                            finish_avg(DType::I64, d, world).unwrap();
                        }
                    }
                }
                received[r] += 1;
            }
        }
        for r in 0..world {
            assert_eq!(sent[r], plans[r].sends.len(), "rank {r} stalled");
            assert_eq!(received[r], plans[r].recvs.len(), "rank {r} stalled");
        }
        bufs
    }

    fn naive(inputs: &[Vec<i64>], op: ReduceOp) -> Vec<i64> {
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
            let inputs: Vec<Vec<i64>> = (0..world)
                .map(|_| (0..len).map(|_| { rng = xorshift(rng); (rng % 2001) as i64 - 1000 }).collect())
                .collect();
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
            let plan = RingAllReduce::new(world / 2, world, len, 7);
            let sent: usize = plan.sends.iter().map(|u| u.range.len()).sum();
            let received: usize = plan.recvs.iter().map(|u| u.range.len()).sum();
            assert_eq!(sent, 2 * (world - 1) * len / world);
            assert_eq!(received, sent);
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

    fn xorshift(mut x: u64) -> u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}
