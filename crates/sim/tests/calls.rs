//! Every pair of calls that cannot complete together, split across three live peers of the
//! simulation (`docs/protocol.md`, "No call waits for a call that will never come"): each ends at
//! once on every peer, the one made last too, and a matching all-reduce then passes.

use shoal_sim::{check_calls, run_calls, Call};
use std::time::Duration;

/// The simulation's heartbeat timeout is 1 s: its interval, a quarter of it, bounds every
/// call's end after the last call was made, with room for a few messages' latency.
const WITHIN: Duration = Duration::from_millis(250);

fn seeds() -> u64 {
    std::env::var("SHOAL_SIM_CALL_SEEDS").map_or(100, |v| v.parse().expect("SHOAL_SIM_CALL_SEEDS is a number"))
}

#[test]
fn every_pair_of_calls_ends_at_once_on_every_peer() {
    let pairs: Vec<(Call, Call)> =
        Call::ALL.iter().flat_map(|&a| Call::ALL.iter().filter(move |&&b| b != a).map(move |&b| (a, b))).collect();
    let mut slowest = Duration::ZERO;
    for (first, others) in pairs {
        for seed in 0..seeds() {
            let report = run_calls(seed, first, others);
            if let Err(v) = check_calls(&report, WITHIN) {
                panic!(
                    "{first:?} against {others:?}, seed {seed} ({}): {}\ncalls: {:#?}\nreplay: SHOAL_SIM_TRACE=1 \
                     SHOAL_SIM_CALLS={first:?},{others:?},{seed} cargo test -p shoal-sim --test calls replay -- \
                     --nocapture",
                    report.shape, v.0, report.scripted
                );
            }
            let last = report.scripted.iter().map(|c| c.made).max().unwrap_or_default();
            slowest =
                slowest.max(report.scripted.iter().map(|c| c.ended.saturating_sub(last)).max().unwrap_or_default());
        }
    }
    eprintln!("every call ended within {slowest:?} of the last call made");
}

/// `SHOAL_SIM_CALLS=First,Others,seed`: runs one scripted run and prints what happened.
#[test]
fn replay() {
    let Ok(spec) = std::env::var("SHOAL_SIM_CALLS") else { return };
    let parts: Vec<&str> = spec.split(',').collect();
    let call = |name: &str| *Call::ALL.iter().find(|c| format!("{c:?}") == name).expect("a call's name");
    let (first, others, seed) = (call(parts[0]), call(parts[1]), parts[2].parse().expect("a seed"));
    let report = run_calls(seed, first, others);
    eprintln!("{}\n{:#?}\nafter: {:?}", report.shape, report.scripted, report.after);
    check_calls(&report, WITHIN).unwrap();
}
