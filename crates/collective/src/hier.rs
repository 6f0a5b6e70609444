//! Hierarchical all-reduce, for a group whose members share hosts.
//!
//! Members are grouped by host; each host's lowest rank is its *leader*. In three overlapping
//! phases, pipelined chunk by chunk:
//!
//! 1. **Within each host** the members reduce along a chain, highest rank first: each adds what
//!    it received from the member above it into its own buffer and passes the sum down, so the
//!    leader receives its host's sum of every chunk (one copy per member, over shared memory).
//! 2. **Between hosts** the leaders run the ring all-reduce ([`crate::ring`]) among themselves:
//!    a leader forwards a reduce-scatter chunk once both its ring predecessor's part and its own
//!    host's sum of that chunk arrived ([`SendUnit::and_after_recv`]). Only leaders cross hosts,
//!    each sending `2 (H - 1) / H` of the buffer for `H` hosts, whatever the members per host.
//! 3. **Within each host** the leader passes every final chunk up the chain, each member copying
//!    it into place and passing it on.
//!
//! Every element is final at exactly one leader (the ring's owner of its segment) and copied
//! from there, so every member ends bit-identical. With every member on its own host this is
//! the ring; with one host, a chain reduce then a chain broadcast.

use crate::ring::{self, segment_range};
use crate::schedule::{chunks, Confirm, RecvAction, RecvUnit, Schedule, SendUnit};
use std::collections::BTreeMap;
use std::ops::Range;

/// The schedule of `rank` among the members placed on `hosts` (host of each rank, any labels;
/// empty: each member on its own) over `len` elements, in chunks of at most `chunk_elems`.
///
/// # Panics
/// If `rank` is outside the group, `hosts` names a host for another number of members, or
/// `chunk_elems` is zero.
///
/// # Examples
/// ```
/// // Ranks 0 and 2 on one host, 1 and 3 on another: 0 and 1 lead, 2 and 3 send them their input.
/// let plan = shoal_collective::hier::all_reduce(2, 4, &[7, 9, 7, 9], 8, 8);
/// assert_eq!(plan.sends[0].to, 0);
/// assert!(plan.recvs.iter().all(|u| u.from == 0));
/// ```
pub fn all_reduce(rank: usize, world: usize, hosts: &[usize], len: usize, chunk_elems: usize) -> Schedule {
    assert!(world > 0 && rank < world, "rank {rank} outside a group of {world}");
    assert!(hosts.is_empty() || hosts.len() == world, "hosts of {} members in a group of {world}", hosts.len());
    assert!(chunk_elems > 0, "chunk size of zero elements");
    let host = |r: usize| if hosts.is_empty() { r } else { hosts[r] };
    // Each host's members in rank order, hosts in the order of their leaders' ranks.
    let mut by_host: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for r in 0..world {
        by_host.entry(host(r)).or_default().push(r);
    }
    let mut members: Vec<Vec<usize>> = by_host.into_values().collect();
    members.sort_by_key(|m| m[0]);
    let leaders: Vec<usize> = members.iter().map(|m| m[0]).collect();
    let h = leaders.len();
    let chain = members.iter().find(|m| m.contains(&rank)).expect("every rank has a host");
    let place = chain.iter().position(|&r| r == rank).expect("in its chain");
    let (below, above) = (place.checked_sub(1).map(|i| chain[i]), chain.get(place + 1).copied());
    // Every chunk of the buffer, cut as the leaders' ring cuts it.
    let all: Vec<Range<usize>> = (0..h).flat_map(|j| chunks(segment_range(j, h, len), chunk_elems)).collect();

    let mut plan =
        Schedule { world, rank, sends: Vec::new(), recvs: Vec::new(), confirm: Confirm::around(world), combine: None };
    let key = |r: &Range<usize>| (r.start, r.end);
    // A leader among several finishes the segment after its own in the ring: its host's sum of
    // it and the ring's last part are both final reductions there, in whichever order they come.
    let leader_of = leaders.iter().position(|&l| l == rank).filter(|_| h > 1);
    let finished_here = |r: &Range<usize>| match leader_of {
        Some(li) => segment_range((li + 1) % h, h, len).contains(&r.start),
        None => h == 1 && below.is_none(),
    };
    // Phase 1 in: the sum of the members above us, chunk by chunk.
    let mut host_sum: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    if let Some(from) = above {
        for range in &all {
            host_sum.insert(key(range), plan.recvs.len());
            let action = RecvAction::Reduce { last: finished_here(range) };
            plan.recvs.push(RecvUnit { from, range: range.clone(), action });
        }
    }
    // Where each chunk is final here: the last receive that writes it.
    let mut final_at: BTreeMap<(usize, usize), usize> = host_sum.clone();
    if let Some(to) = below {
        // Phase 1 out: our sum (ours plus those above) down the chain.
        for range in &all {
            let after_recv = host_sum.get(&key(range)).copied();
            plan.sends.push(SendUnit { after_recv, ..SendUnit::new(to, range.clone()) });
        }
        // Phase 3 in: the result from below.
        for range in &all {
            final_at.insert(key(range), plan.recvs.len());
            plan.recvs.push(RecvUnit { from: to, range: range.clone(), action: RecvAction::Copy });
        }
    } else if let Some(li) = leader_of {
        // Phase 2: the leaders' ring. A chunk we forward that holds our own contribution (not a
        // final copy) waits for our host's sum of it too.
        let ring = ring::all_reduce(li, h, len, chunk_elems);
        let offset = plan.recvs.len();
        for u in &ring.recvs {
            final_at.insert(key(&u.range), plan.recvs.len());
            plan.recvs.push(RecvUnit { from: leaders[u.from], ..u.clone() });
        }
        for u in ring.sends {
            let copied = u.after_recv.is_some_and(|i| ring.recvs[i].action == RecvAction::Copy);
            let own = if copied { None } else { host_sum.get(&key(&u.range)).copied() };
            let (after_recv, and_after_recv) = match u.after_recv {
                Some(i) => (Some(i + offset), own),
                None => (own, None),
            };
            plan.sends.push(SendUnit { to: leaders[u.to], after_recv, and_after_recv, ..u });
        }
    }
    // Phase 3 out: the result up the chain, each chunk once it is final here (where we finish
    // it, once both its final reductions came).
    if let Some(to) = above {
        for range in &all {
            let after_recv = final_at.get(&key(range)).copied();
            let own = host_sum.get(&key(range)).copied().filter(|&i| Some(i) != after_recv && finished_here(range));
            plan.sends.push(SendUnit { after_recv, and_after_recv: own, ..SendUnit::new(to, range.clone()) });
        }
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
        #![proptest_config(ProptestConfig::with_cases(400))]
        /// Any placement of members on hosts, in every interleaving the dependencies allow.
        #[test]
        fn matches_a_naive_reduction_for_any_placement(
            hosts in prop::collection::vec(0usize..3, 1..=8),
            len in 0usize..40,
            chunk in 1usize..9,
            op in prop::sample::select(ReduceOp::ALL.to_vec()),
            seed in any::<u64>(),
        ) {
            let world = hosts.len();
            let plan = |rank, world, len, chunk| all_reduce(rank, world, &hosts, len, chunk);
            prop_assert_eq!(all_reduce_differs(plan, (world, len, chunk), op, seed), None);
        }
    }

    #[test]
    fn only_leaders_cross_hosts_and_each_member_sends_the_buffer_once_inside() {
        // Two hosts of three members: the leaders (0, 1) send 2 (H - 1) / H = 1 buffer between
        // hosts, and a buffer up their chain; the others a buffer down and (but the top) one up.
        let hosts = [0, 1, 0, 1, 0, 1];
        let len = 60;
        for rank in 0..6 {
            let plan = all_reduce(rank, 6, &hosts, len, 7);
            let cross: usize = plan.sends.iter().filter(|u| hosts[u.to] != hosts[rank]).map(|u| u.range.len()).sum();
            let inside: usize = plan.sends.iter().filter(|u| hosts[u.to] == hosts[rank]).map(|u| u.range.len()).sum();
            let top = rank >= 4;
            assert_eq!(cross, if rank < 2 { len } else { 0 }, "rank {rank}");
            assert_eq!(inside, if rank < 2 || top { len } else { 2 * len }, "rank {rank}");
        }
    }
}
