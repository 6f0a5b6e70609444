//! Two-shot all-reduce: a direct reduce-scatter, then a direct all-gather.
//!
//! The buffer is cut into `world` blocks as the ring cuts it ([`segment_range`]); rank `j` owns
//! block `j`. First every rank sends each block straight to its owner, which keeps them aside;
//! once it holds every rank's copy of its block, the owner folds them in rank order (as one-shot
//! folds the whole buffer, so the result does not depend on timing) and sends the result straight
//! to every other rank, which copies it into place. Every rank ends with bytes copied from the
//! block's owner, bit-identical; tokens then go straight to every rank ([`Confirm::Direct`]).
//!
//! Each rank sends and receives `2 (world - 1) / world · len` elements, as around the ring, in two
//! hops rather than `2 (world - 1)`, and keeps `(world - 1) / world · len` aside: the schedule for
//! buffers too large for one-shot and too small for the ring's pipeline to pay off on long paths.

use crate::ring::segment_range;
use crate::schedule::{chunks, Combine, Confirm, RecvAction, RecvUnit, Schedule, SendUnit};

/// The schedule of `rank` among `world` ranks over `len` elements, in chunks of at most
/// `chunk_elems` elements.
///
/// # Panics
/// If `world` is zero, `rank >= world`, or `chunk_elems` is zero.
///
/// # Examples
/// ```
/// let plan = shoal_collective::twoshot::all_reduce(0, 2, 10, 8);
/// // Block 1 to its owner, then the folded block 0 to rank 1, once folded.
/// assert_eq!(plan.sends.iter().map(|u| (u.to, u.range.clone(), u.after_combine)).collect::<Vec<_>>(),
///            [(1, 5..10, 0), (1, 0..5, 1)]);
/// ```
pub fn all_reduce(rank: usize, world: usize, len: usize, chunk_elems: usize) -> Schedule {
    assert!(world > 0 && rank < world, "rank {rank} outside a group of {world}");
    assert!(chunk_elems > 0, "chunk size of zero elements");
    let others = || (1..world).map(|k| (rank + k) % world);
    let block = |j: usize| segment_range(j, world, len);
    let mut sends: Vec<SendUnit> = others()
        .flat_map(|to| {
            chunks(block(to), chunk_elems).map(move |range| SendUnit {
                to,
                range,
                after_recv: None,
                and_after_recv: None,
                after_combine: 0,
            })
        })
        .collect();
    let mut recvs: Vec<RecvUnit> = others()
        .flat_map(|from| {
            chunks(block(rank), chunk_elems).map(move |range| RecvUnit { from, range, action: RecvAction::Stash })
        })
        .collect();
    for range in chunks(block(rank), chunk_elems) {
        sends.extend(others().map(|to| SendUnit {
            to,
            range: range.clone(),
            after_recv: None,
            and_after_recv: None,
            after_combine: 1,
        }));
    }
    recvs.extend(others().flat_map(|from| {
        chunks(block(from), chunk_elems).map(move |range| RecvUnit { from, range, action: RecvAction::Copy })
    }));
    // The fold writes our block, which no send of the first half reads.
    let combine = (world > 1).then(|| Combine::everyone(world, block(rank), 0));
    Schedule { world, rank, sends, recvs, confirm: Confirm::Direct, combine }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_on_the_wire_match_the_ring() {
        for world in 1..=8 {
            let len = world * 30;
            let plan = all_reduce(world / 2, world, len, 7);
            let sent: usize = plan.sends.iter().map(|u| u.range.len()).sum();
            assert_eq!(sent, 2 * (world - 1) * len / world);
            assert_eq!(plan.peers_to().len(), world - 1);
        }
    }
}
