//! One-shot all-reduce: every rank sends its whole buffer straight to every other, and each
//! reduces all the inputs itself.
//!
//! Once every input arrived, rank `r`'s buffer becomes `x_0 ∘ x_1 ∘ … ∘ x_{world-1}`, folded in
//! rank order on every rank, so every rank ends with bit-identical bytes (the order of the fold
//! is fixed; `∘` is commutative for every operator and type, so which operand is the
//! accumulator does not matter). Each rank then sends its confirmation token straight to every
//! other ([`Confirm::Direct`]): agreement costs one more one-way latency, not a lap of the ring.
//!
//! Each rank sends and receives `(world - 1) * len` elements and keeps `(world - 1) * len` of
//! other ranks' inputs aside: the schedule for small buffers, where one round trip beats the
//! ring's `2 (world - 1)` hops.

use crate::schedule::{chunks, Combine, Confirm, RecvAction, RecvUnit, Schedule, SendUnit};

/// The schedule of `rank` among `world` ranks over `len` elements, in chunks of at most
/// `chunk_elems` elements.
///
/// # Panics
/// If `world` is zero, `rank >= world`, or `chunk_elems` is zero.
///
/// # Examples
/// ```
/// let plan = shoal_collective::oneshot::all_reduce(1, 3, 4, 8);
/// // The whole buffer to each of the two others, first the next rank.
/// assert_eq!(plan.sends.iter().map(|u| u.to).collect::<Vec<_>>(), [2, 0]);
/// assert_eq!(plan.recvs.len(), 2);
/// ```
pub fn all_reduce(rank: usize, world: usize, len: usize, chunk_elems: usize) -> Schedule {
    assert!(world > 0 && rank < world, "rank {rank} outside a group of {world}");
    assert!(chunk_elems > 0, "chunk size of zero elements");
    let others = || (1..world).map(|k| (rank + k) % world);
    let mut sends = Vec::new();
    // Chunk by chunk to every other rank, so that every one of them starts receiving at once.
    for range in chunks(0..len, chunk_elems) {
        sends.extend(others().map(|to| SendUnit::new(to, range.clone())));
    }
    let recvs = others()
        .flat_map(|from| {
            chunks(0..len, chunk_elems).map(move |range| RecvUnit { from, range, action: RecvAction::Stash })
        })
        .collect();
    // The fold overwrites the buffer every send reads: after them.
    let combine = (world > 1).then(|| Combine::everyone(world, 0..len, sends.len()));
    Schedule { world, rank, sends, recvs, confirm: Confirm::Direct, combine }
}

/// The direct broadcast of `root`'s `len` elements: the root sends them straight to every other
/// rank, which copies them into place, and every rank sends its token straight to every other.
pub fn broadcast(rank: usize, world: usize, root: usize, len: usize, chunk_elems: usize) -> Schedule {
    assert!(world > 0 && rank < world && root < world, "rank {rank} or root {root} outside a group of {world}");
    assert!(chunk_elems > 0, "chunk size of zero elements");
    let mut schedule =
        Schedule { world, rank, sends: Vec::new(), recvs: Vec::new(), confirm: Confirm::Direct, combine: None };
    for range in chunks(0..len, chunk_elems) {
        if rank == root {
            let to = (1..world).map(|k| (rank + k) % world);
            schedule.sends.extend(to.map(|to| SendUnit {
                to,
                range: range.clone(),
                after_recv: None,
                and_after_recv: None,
                after_combine: 0,
            }));
        } else {
            schedule.recvs.push(RecvUnit { from: root, range, action: RecvAction::Copy });
        }
    }
    schedule
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_on_the_wire_and_confirmation() {
        for world in 1..=6 {
            let plan = all_reduce(0, world, 100, 30);
            let sent: usize = plan.sends.iter().map(|u| u.range.len()).sum();
            assert_eq!(sent, (world - 1) * 100);
            assert_eq!(plan.peers_from().len(), world - 1);
            assert_eq!(plan.peers_to().len(), world - 1);
            assert_eq!(plan.token_targets().len(), world - 1);
            assert_eq!(plan.forward_token(1 % world), Vec::<usize>::new());
            assert!(plan.combines() == (world > 1));
        }
    }
}
