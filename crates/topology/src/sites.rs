//! Sites: members whose mutual round trip is short, as a datacenter's or a region's are.
//!
//! Two members are *near* if either measured a round trip to the other of at most `near_us`; a
//! site is a connected group of near members (so a site's diameter may exceed `near_us`, as a
//! region's does). Sites are numbered in the order of their first member.

use crate::{ring_edges, Links};

/// The round trip under which two members share a site, unless configured: well above a
/// datacenter's or a metro region's, well below the 20 ms or more between regions.
pub const DEFAULT_NEAR_US: u32 = 5_000;

/// Each member's site among `links`' members.
pub fn sites(links: &Links, near_us: u32) -> Vec<usize> {
    let n = links.len();
    let mut parent: Vec<usize> = (0..n).collect();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    for i in 0..n {
        for j in i + 1..n {
            let near = [links.get(i, j), links.get(j, i)].into_iter().flatten().any(|l| l.rtt_us <= near_us);
            if near {
                let (a, b) = (root(&mut parent, i), root(&mut parent, j));
                parent[a.max(b)] = a.min(b);
            }
        }
    }
    let mut label: Vec<Option<usize>> = vec![None; n];
    let mut next = 0;
    (0..n)
        .map(|i| {
            let r = root(&mut parent, i);
            *label[r].get_or_insert_with(|| {
                next += 1;
                next - 1
            })
        })
        .collect()
}

/// How much faster the cost model must predict the hierarchical all-reduce before sites are
/// used: the model leaves out latency and the reduction's own work.
pub const HIERARCHY_MARGIN: f64 = 1.2;

/// Whether an all-reduce over the ring `order` (indices into `links`) runs faster grouped by
/// `sites` (each member's site, by index) than around the ring, as the bandwidth model says:
///
/// - the ring sends `2 (n - 1) / n` of the buffer over each of its edges, so it takes that over
///   the slowest edge's rate;
/// - the hierarchical schedule (`shoal_collective::hier`) sends the whole buffer along each
///   site's chain, and `2 (H - 1) / H` of it around the ring of the `H` sites' leaders (their
///   first members in `order`). A leader's uplink carries both, so the two add up: the slowest
///   chain link's time plus the slowest leader link's.
///
/// True only if the hierarchy is predicted [`HIERARCHY_MARGIN`] times faster, there are at least
/// two sites and some site has two members, and every link it needs was measured.
pub fn grouping_pays(links: &Links, order: &[usize], sites: &[usize]) -> bool {
    let n = order.len();
    let h = order.iter().map(|&m| sites[m]).collect::<std::collections::BTreeSet<_>>().len();
    if n < 3 || h < 2 || h == n {
        return false;
    }
    let Some(ring_rate) = links.slowest(ring_edges(order)) else { return false };
    // Chains run both ways: down to the leader, then back up.
    let chain = ring_edges(order).filter(|&(a, b)| sites[a] == sites[b]).flat_map(|(a, b)| [(a, b), (b, a)]);
    let Some(chain_rate) = links.slowest(chain) else { return false };
    let mut leaders: Vec<usize> = Vec::new();
    for &m in order {
        if leaders.iter().all(|&l| sites[l] != sites[m]) {
            leaders.push(m);
        }
    }
    let Some(leader_rate) = links.slowest(ring_edges(&leaders)) else { return false };
    let ring_time = 2.0 * (n - 1) as f64 / n as f64 / ring_rate;
    let hier_time = 1.0 / chain_rate + 2.0 * (h - 1) as f64 / h as f64 / leader_rate;
    hier_time * HIERARCHY_MARGIN < ring_time
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Link;

    /// Links between `sites` members: `near` bytes per second inside a site, `far` between.
    fn two_rates(sites: &[usize], near: u64, far: u64) -> Links {
        let mut links = Links::new(sites.len());
        for a in 0..sites.len() {
            for b in 0..sites.len() {
                if a != b {
                    let bytes_per_s = if sites[a] == sites[b] { near } else { far };
                    links.set(a, b, Link { rtt_us: 1, bytes_per_s });
                }
            }
        }
        links
    }

    #[test]
    fn grouping_pays_where_sites_are_much_faster_inside() {
        let sites = [0, 0, 1, 1];
        let order = [0, 1, 2, 3];
        // Shared memory inside, a WAN between: the leaders send 1x the buffer, the ring 1.5x.
        assert!(grouping_pays(&two_rates(&sites, 5_000_000_000, 50_000_000), &order, &sites));
        // The same rate everywhere: the leaders' uplinks carry the chains' bytes too.
        assert!(!grouping_pays(&two_rates(&sites, 100_000_000, 100_000_000), &order, &sites));
        assert!(!grouping_pays(&two_rates(&sites, 110_000_000, 50_000_000), &order, &sites));
        // One site, or a site per member: nothing to group.
        assert!(!grouping_pays(&two_rates(&[0; 4], 1, 1), &order, &[0; 4]));
        assert!(!grouping_pays(&two_rates(&[0, 1, 2, 3], 1, 1), &order, &[0, 1, 2, 3]));
        // A link never measured: no prediction, no grouping.
        assert!(!grouping_pays(&Links::new(4), &order, &sites));
    }

    #[test]
    fn members_group_by_round_trip() {
        // 0, 2 and 4 in one site, 1 and 3 in another; 5 alone; 2 only measured one direction.
        let mut links = Links::new(6);
        let rtt = |a: usize, b: usize| match (a % 2 == b % 2, a.max(b) == 5) {
            (_, true) => 90_000,
            (true, false) => 800,
            (false, false) => 40_000,
        };
        for a in 0..6 {
            for b in 0..6 {
                if a != b && (a, b) != (2, 4) {
                    links.set(a, b, Link { rtt_us: rtt(a, b), bytes_per_s: 1 });
                }
            }
        }
        assert_eq!(sites(&links, DEFAULT_NEAR_US), [0, 1, 0, 1, 0, 2]);
        assert_eq!(sites(&links, 100_000), [0; 6]);
    }
}
