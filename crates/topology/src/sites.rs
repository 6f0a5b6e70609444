//! Sites: members whose mutual round trip is short, as a datacenter's or a region's are.
//!
//! Two members are *near* if either measured a round trip to the other of at most `near_us`; a
//! site is a connected group of near members (so a site's diameter may exceed `near_us`, as a
//! region's does). Sites are numbered in the order of their first member.

use crate::Links;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Link;

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
