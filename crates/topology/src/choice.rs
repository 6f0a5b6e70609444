//! Where the small-message all-reduces stop paying, from measured links: the largest buffers
//! one-shot and two-shot should take over the ring (`docs/algorithms.md`, `docs/topology.md`).
//!
//! Each algorithm's time is a latency plus bytes over the slowest rate, for `n` members and `S`
//! bytes (one-way delays are half the measured round trips):
//!
//! - one-shot: every input straight to every member, then a token straight back: the largest
//!   round trip, plus `(n - 1) S` through each member's uplink;
//! - two-level, which runs in one-shot's place in a group of more than [`ONESHOT_WORLD_MAX`]
//!   members over `H` sites some of which hold several: inputs to each site's leader, partials
//!   among the leaders, results back, and a token the same way: the largest round trip too (the
//!   hops inside a site cost little), plus `(H - 1) S` through a leader's uplink. It is weighed
//!   against the ring alone: two-shot's `2 (n - 1)` messages per member cost such a group far
//!   more than its bytes say;
//! - two-shot: two direct hops and a token: one and a half of the largest round trip, plus
//!   `2 (n - 1) / n S` per member;
//! - the ring: `2 (n - 1)` steps in which each chunk travels `n - 1` consecutive edges per phase,
//!   then the confirmation lap: three times `(n - 1) / n` of the ring's summed one-way delay, plus
//!   `2 (n - 1) / n S` over its slowest edge.
//!
//! The direct algorithms' byte terms carry [`DIRECT_PENALTY`]: sending to every member at once
//! moved bytes that much slower than the ring's one neighbour in the lab (`two-sites`, 4 peers,
//! 4 to 64 MiB: 21.5 ms per MB for two-shot and 40 for one-shot's 1.5× the bytes, against the
//! ring's 13.6). The crossovers of these lines are the limits. On one machine (a largest round trip under
//! [`WAN_RTT_US`]) the model does not hold (the reduction's work, not the wire, decides there) and
//! there are no limits from it.

use crate::{ring_edges, Links};

/// Members past which a small all-reduce does not run one-shot: by doubling on one host, two-level
/// across sites (or hosts) some of which hold several members (`shoal_peer`'s `algorithm_for`).
pub const ONESHOT_WORLD_MAX: usize = 8;
/// How much slower per byte the direct algorithms move their bytes than the ring.
pub const DIRECT_PENALTY: f64 = 1.5;
/// Round trips below this are one machine's or one rack's: no limits are derived.
pub const WAN_RTT_US: u32 = 1_000;
/// The most bytes the limits allow one-shot and two-shot, whatever the model says: they keep
/// every member's input aside.
pub const MOST_ONESHOT_BYTES: u64 = 16 << 20;
pub const MOST_TWOSHOT_BYTES: u64 = 64 << 20;

/// The largest all-reduce, in bytes, that runs one-shot (or two-level in its place), and two-shot
/// above that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// One-shot (two-level in its place) up to this.
    pub oneshot_max: u64,
    /// Two-shot above `oneshot_max`, up to this.
    pub twoshot_max: u64,
}

/// The limits for the ring `order` (indices into `links`), if every link it needs was measured
/// and the group spans a wide-area path. `sites` gives each of `links`' members its site
/// ([`crate::sites()`]): where the group's small all-reduces run two-level over them, that is
/// the direct schedule weighed.
pub fn limits(links: &Links, order: &[usize], sites: &[usize]) -> Option<Limits> {
    let n = order.len();
    if n < 2 {
        return None;
    }
    let pairs = || order.iter().flat_map(|&a| order.iter().filter(move |&&b| b != a).map(move |&b| (a, b)));
    let max_rtt =
        pairs().map(|(a, b)| links.get(a, b).map(|l| l.rtt_us)).try_fold(0, |most, rtt| Some(most.max(rtt?)))?;
    if max_rtt < WAN_RTT_US {
        return None;
    }
    let min_rate = links.slowest(pairs())?;
    let ring_rate = links.slowest(ring_edges(order))?;
    let ring_delay: f64 = ring_edges(order).map(|(a, b)| links.get(a, b).map_or(0, |l| l.rtt_us) as f64 / 2e6).sum();
    let (nf, rtt) = (n as f64, max_rtt as f64 / 1e6);
    // (latency s, seconds per byte)
    let held: std::collections::BTreeSet<usize> = order.iter().map(|&i| sites[i]).collect();
    let two_level = n > ONESHOT_WORLD_MAX && (2..n).contains(&held.len());
    let fanout = if two_level { held.len() as f64 - 1.0 } else { nf - 1.0 };
    let oneshot = (rtt, DIRECT_PENALTY * fanout / min_rate);
    let twoshot = (1.5 * rtt, DIRECT_PENALTY * 2.0 * (nf - 1.0) / nf / min_rate);
    let ring = (3.0 * (nf - 1.0) / nf * ring_delay, 2.0 * (nf - 1.0) / nf / ring_rate);
    // The largest size at which `a` takes no longer than `b`.
    let up_to = |a: (f64, f64), b: (f64, f64)| -> f64 {
        if a.1 <= b.1 {
            if a.0 <= b.0 {
                f64::INFINITY
            } else {
                0.0
            }
        } else {
            ((b.0 - a.0) / (a.1 - b.1)).max(0.0)
        }
    };
    let bytes = |s: f64, most: u64| if s.is_finite() { (s as u64).min(most) } else { most };
    // In a large group over sites, two-shot's 2 (n - 1) messages per member cost far more than
    // its bytes say (the lab's `world`, 64 peers: 1.15 / 1.32 / 2.18 s at 64 KiB / 256 KiB / 1 MiB
    // against two-level's 391 / 448 / 704 ms): two-level is weighed against the ring alone.
    let direct_up_to = if two_level { up_to(oneshot, ring) } else { up_to(oneshot, twoshot).min(up_to(oneshot, ring)) };
    let oneshot_max = bytes(direct_up_to, MOST_ONESHOT_BYTES);
    let twoshot_max = bytes(up_to(twoshot, ring), MOST_TWOSHOT_BYTES).max(oneshot_max);
    Some(Limits { oneshot_max, twoshot_max })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Link;

    fn two_sites(inside_rtt: u32, between_rtt: u32, rate: u64) -> Links {
        let mut links = Links::new(4);
        for a in 0..4 {
            for b in 0..4 {
                if a != b {
                    let rtt_us = if a / 2 == b / 2 { inside_rtt } else { between_rtt };
                    links.set(a, b, Link { rtt_us, bytes_per_s: rate });
                }
            }
        }
        links
    }

    #[test]
    fn across_a_wan_one_shot_runs_up_to_megabytes() {
        // The lab's two-sites: 1 ms inside, 40 ms between, ~120 MB/s. Measured there (4 peers):
        // one-shot fastest to 1 MiB (67 ms against 85 two-shot, 109 ring), two-shot at 4 MiB
        // (120 against 137 ring, 169 one-shot), the ring at 16 MiB (289 against 319 two-shot).
        let l = limits(&two_sites(1_000, 40_000, 120_000_000), &[0, 1, 2, 3], &[0, 0, 1, 1]).unwrap();
        assert!((512 << 10..4 << 20).contains(&l.oneshot_max), "{l:?}");
        assert!((4 << 20..16 << 20).contains(&l.twoshot_max), "{l:?}");
    }

    #[test]
    fn a_large_group_over_sites_weighs_two_level_in_one_shots_place() {
        // The lab's `world` at 64 peers as small probes measure it: five sites, 1 ms inside and up
        // to 255 ms between, ~1 MB/s. One-shot's 63 inputs per member lose to two-shot even at
        // 4 KiB there; two-level's four partials per leader run to megabytes, weighed against the
        // ring alone.
        let (n, sites) = (64, (0..64).map(|i| i % 5).collect::<Vec<_>>());
        let mut links = Links::new(n);
        for a in 0..n {
            for b in (0..n).filter(|&b| b != a) {
                let rtt_us = if sites[a] == sites[b] { 1_000 } else { 255_000 };
                links.set(a, b, Link { rtt_us, bytes_per_s: 1_000_000 });
            }
        }
        let order: Vec<usize> = (0..n).collect();
        let alone: Vec<usize> = (0..n).collect();
        assert!(limits(&links, &order, &alone).unwrap().oneshot_max < 4 << 10);
        assert!(limits(&links, &order, &sites).unwrap().oneshot_max >= 1 << 20);
        // At most ONESHOT_WORLD_MAX members the direct schedule is one-shot, sites or not.
        let few = &order[..ONESHOT_WORLD_MAX];
        assert_eq!(limits(&links, few, &sites), limits(&links, few, &alone));
    }

    #[test]
    fn on_one_machine_there_are_no_limits() {
        assert_eq!(limits(&two_sites(50, 80, 2_000_000_000), &[0, 1, 2, 3], &[0; 4]), None);
        assert_eq!(limits(&Links::new(4), &[0, 1, 2, 3], &[0, 1, 2, 3]), None, "nothing measured");
    }
}
