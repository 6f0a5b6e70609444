//! How close the heuristic gets in a short budget to what it finds in a long one, on random
//! asymmetric instances: `cargo run --release -p shoal-topology --example solver -- [N] [SHORT_S]
//! [LONG_S] [SEEDS]` (defaults 64 peers, 1 s, 60 s, 3 seeds).
#![allow(clippy::disallowed_methods)] // it times the search by the clock

use shoal_topology::{lower_bound, Costs, Search};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<f64> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let arg = |i: usize, default: f64| args.get(i).copied().unwrap_or(default);
    let (n, short, long, seeds) = (arg(0, 64.0) as usize, arg(1, 1.0), arg(2, 60.0), arg(3, 3.0) as u64);
    for seed in 1..=seeds {
        let costs = random(n, seed);
        let bound = lower_bound(&costs);
        let started = Instant::now();
        let walkers: u64 = std::env::var("WALKERS").ok().and_then(|w| w.parse().ok()).unwrap_or(1);
        let quick = (0..walkers)
            .map(|w| {
                let mut s = Search::new(costs.clone(), None, seed * 7 + w);
                run_for(&mut s, Duration::from_secs_f64(short / walkers as f64));
                s
            })
            .min_by_key(|s| s.best().1)
            .unwrap();
        let quick_time = started.elapsed().as_secs_f64();
        let mut slow = Search::new(costs.clone(), None, seed + 1000);
        run_for(&mut slow, Duration::from_secs_f64(long));
        let (q, s) = (quick.best().1 as f64, slow.best().1 as f64);
        println!(
            "seed {seed}: {short} s ({} kicks, {quick_time:.2} s): {q}; {long} s ({} kicks): {s}; \
             ratio {:.4}; assignment bound {bound} ({:.4} of the long tour)",
            quick.rounds(),
            slow.rounds(),
            q / s.min(q),
            bound as f64 / s.min(q),
        );
    }
}

/// Kicks `search` in small batches until `budget` has passed on the clock.
fn run_for(search: &mut Search, budget: Duration) {
    let until = Instant::now() + budget;
    while Instant::now() < until {
        search.run(16);
    }
}

/// Uniform costs 1..=1000 per directed edge.
fn random(n: usize, seed: u64) -> Costs {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let cost = (0..n * n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            1 + s % 1000
        })
        .collect();
    Costs::new(n, cost)
}
