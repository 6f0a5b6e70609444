//! Two-level all-reduce: one-shot within each site, then among the sites' leaders, then back
//! down (the shape of Penny's multinode all-reduce), for small buffers in large groups spread
//! over sites.
//!
//! Members are grouped by site; each site's lowest rank is its *leader*. Every other member
//! sends its input straight to its leader; the leader folds its site's inputs in rank order
//! (its *partial*), sends the partial straight to every other leader, folds the leaders'
//! partials in rank order, and sends the result to its members, which copy it into place. Every
//! leader folds the same partials in the same order, so every member ends bit-identical
//! ([`Fold`]).
//!
//! The data crosses the slow links between sites once (three one-way delays in all, two of them
//! inside a site) and each member exchanges one buffer with its leader, where one-shot sends
//! `world - 1` buffers per member across every link: `world²` messages against about `world +
//! H²` for `H` sites. Tokens take the same road ([`Confirm::Leaders`]).
//!
//! In a quantized collective a leader's partial and result take the values its encoding gives
//! them when they are sent. A leader without members sends no result, so its own would differ
//! from the others': [`quantizes`] says where every leader's result is encoded alike.

use crate::schedule::{chunks, Combine, Confirm, Fold, RecvAction, RecvUnit, Schedule, SendUnit};
use std::collections::BTreeMap;

/// Each rank's leader (its site's lowest rank), for the members placed on `sites` (the site of
/// each rank, any labels; empty: each member on its own).
///
/// # Panics
/// If `sites` names a site for another number of members than `world`.
pub fn leaders(world: usize, sites: &[usize]) -> Vec<usize> {
    assert!(sites.is_empty() || sites.len() == world, "sites of {} members in a group of {world}", sites.len());
    if sites.is_empty() {
        return (0..world).collect();
    }
    let mut first: BTreeMap<usize, usize> = BTreeMap::new();
    sites.iter().enumerate().map(|(r, s)| *first.entry(*s).or_insert(r)).collect()
}

/// Whether a quantized collective over `sites` ends bit-identical on every member: every site
/// has several members (every leader's result is encoded on its way to them), or none has
/// (nobody's is).
pub fn quantizes(world: usize, sites: &[usize]) -> bool {
    let leader = leaders(world, sites);
    let mut size = vec![0usize; world];
    for l in &leader {
        size[*l] += 1;
    }
    let sizes: Vec<usize> = (0..world).filter(|&r| leader[r] == r).map(|r| size[r]).collect();
    sizes.iter().all(|&s| s > 1) || sizes.iter().all(|&s| s == 1)
}

/// The schedule of `rank` among the members placed on `sites` (as [`leaders`] takes them) over
/// `len` elements, in chunks of at most `chunk_elems`.
///
/// # Panics
/// If `rank` is outside the group, `sites` names a site for another number of members, or
/// `chunk_elems` is zero.
///
/// # Examples
/// ```
/// // Ranks 0 and 2 in one site, 1 and 3 in another: 0 and 1 lead; 2 sends its input to 0 and
/// // takes the result from it.
/// let plan = shoal_collective::twolevel::all_reduce(2, 4, &[7, 9, 7, 9], 8, 8);
/// assert_eq!(plan.sends.iter().map(|u| u.to).collect::<Vec<_>>(), [0]);
/// assert_eq!(plan.recvs.iter().map(|u| u.from).collect::<Vec<_>>(), [0]);
/// ```
pub fn all_reduce(rank: usize, world: usize, sites: &[usize], len: usize, chunk_elems: usize) -> Schedule {
    assert!(world > 0 && rank < world, "rank {rank} outside a group of {world}");
    assert!(chunk_elems > 0, "chunk size of zero elements");
    let leader = leaders(world, sites);
    let whole = || chunks(0..len, chunk_elems);
    let mut plan = Schedule {
        world,
        rank,
        sends: Vec::new(),
        recvs: Vec::new(),
        confirm: Confirm::Leaders(leader.clone()),
        combine: None,
    };
    let mine = leader[rank];
    if mine != rank {
        // A member: our input to our leader, the result back.
        plan.sends.extend(whole().map(|range| SendUnit::new(mine, range)));
        plan.recvs.extend(whole().map(|range| RecvUnit { from: mine, range, action: RecvAction::Copy }));
        return plan;
    }
    let members: Vec<usize> = (0..world).filter(|&r| leader[r] == rank).collect();
    let heads: Vec<usize> = (0..world).filter(|&r| leader[r] == r).collect();
    let others: Vec<usize> = heads.iter().copied().filter(|&r| r != rank).collect();
    let below: Vec<usize> = members.iter().copied().filter(|&r| r != rank).collect();
    let mut folds = Vec::new();
    // In from our members, their inputs; from the other leaders, their partials.
    for &from in below.iter().chain(&others) {
        plan.recvs.extend(whole().map(|range| RecvUnit { from, range, action: RecvAction::Stash }));
    }
    if !below.is_empty() {
        folds.push(Fold { ranks: members, after_sends: 0, completes: others.is_empty() });
    }
    // Our partial to every other leader, chunk by chunk to each at once.
    for range in whole() {
        plan.sends.extend(
            others.iter().map(|&to| SendUnit { after_combine: folds.len(), ..SendUnit::new(to, range.clone()) }),
        );
    }
    if !others.is_empty() {
        // The fold overwrites what the sends to the leaders read: after them.
        folds.push(Fold { ranks: heads, after_sends: plan.sends.len(), completes: true });
    }
    // The result to our members.
    for range in whole() {
        plan.sends.extend(
            below.iter().map(|&to| SendUnit { after_combine: folds.len(), ..SendUnit::new(to, range.clone()) }),
        );
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
        #![proptest_config(ProptestConfig::with_cases(400))]
        /// Any placement of members in sites, in every interleaving the dependencies allow.
        #[test]
        fn matches_a_naive_reduction_for_any_placement(
            sites in prop::collection::vec(0usize..4, 1..=12),
            len in 0usize..40,
            chunk in 1usize..9,
            op in prop::sample::select(ReduceOp::ALL.to_vec()),
            seed in any::<u64>(),
        ) {
            let world = sites.len();
            let plan = |rank, world, len, chunk| all_reduce(rank, world, &sites, len, chunk);
            prop_assert_eq!(all_reduce_differs(plan, (world, len, chunk), op, seed), None);
        }
    }

    #[test]
    fn only_leaders_cross_sites_and_tokens_follow_them() {
        // Three sites of 4, 3 and 1 members: each member exchanges one buffer with its leader,
        // each leader one with every other leader and one with each of its members.
        let sites = [0, 0, 1, 1, 0, 1, 2, 0];
        let (world, len) = (sites.len(), 10);
        let mut frames = 0;
        for rank in 0..world {
            let plan = all_reduce(rank, world, &sites, len, len);
            let cross = plan.sends.iter().filter(|u| sites[u.to] != sites[rank]).count();
            let inside = plan.sends.iter().filter(|u| sites[u.to] == sites[rank]).count();
            let (lead, size) = ([0, 2, 6].contains(&rank), [4, 3, 1][sites[rank]]);
            assert_eq!(cross, if lead { 2 } else { 0 }, "rank {rank}");
            assert_eq!(inside, if lead { size - 1 } else { 1 }, "rank {rank}");
            assert_eq!(plan.peers_to(), plan.peers_from(), "rank {rank}");
            // Every token of another rank reaches us exactly once, from one rank.
            let (leader, mut sent) = (leaders(world, &sites), plan.token_targets().len());
            for origin in (0..world).filter(|&o| o != rank) {
                let from = plan.token_from(origin);
                assert!(from == leader[rank] || leader[from] == from || leader[origin] == rank, "{origin} at {rank}");
                sent += plan.forward_token(origin).len();
            }
            assert_eq!(sent, plan.tokens_sent(), "rank {rank}");
            frames += plan.tokens_sent();
        }
        // Each token reaches every other rank once: world (world - 1) deliveries, some forwarded.
        assert_eq!(frames, world * (world - 1));
    }

    #[test]
    fn quantizes_where_every_leader_sends_its_result_or_none_does() {
        assert!(quantizes(4, &[]));
        assert!(quantizes(4, &[0, 1, 0, 1]));
        assert!(quantizes(4, &[0, 0, 0, 0]));
        assert!(!quantizes(3, &[0, 1, 0]));
    }
}
