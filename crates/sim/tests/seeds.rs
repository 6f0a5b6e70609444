//! Many seeds of the simulation, each checked; a failing seed prints the command that replays
//! it, and joins `REGRESSIONS` once fixed.

use shoal_sim::{check, run, Outcome};

/// Seeds that once broke an invariant.
const REGRESSIONS: &[u64] = &[
    // Members that finished collective 39 asked the master, which queried the others; one had
    // never started it (a newer topology was issued, so its next call joined that) and never
    // answered: the askers waited out their bound. It now answers that it never will.
    866,
    // The model took a peer cut off from the master (frozen, then its link stalled) that got no
    // verdict after reporting a failure for a violation; the real peer returns its own error.
    1635,
    // A late report about collective 12 of a replaced ring was kept under the key (group, 12)
    // and decided collective 12 of the next ring: the master's records now carry the epoch.
    112661,
    // A reset between two members after their data moved: both asked the master and kept their
    // broken streams open until its verdict, which waited for the others, which waited for
    // tokens behind those streams until their whole bound. Failed streams now close once
    // nothing in the engine moves over them.
    244,
    // A member frozen past a send's announced wait (`P2pWaits`) served the send once it thawed,
    // then voted peers_pending with the stale wait still noted, judged the send stuck, and the
    // master ended the group's votes with a usage error (the waiter's `P2pResumed` was on its
    // way). A receive that took a send's offer now says the send is not stuck.
    224,
    // A reset between two members broke a third's engine, which failed its send; nothing else
    // ran over its lanes, so they stayed open, and the receiver, its offer answered, waited for
    // parts until its bound. Broken lanes now close at once where no collective runs over them.
    6368,
    // A newcomer's first peers_pending, cast tentatively, was cut short by a ring re-formed for a
    // member that died: its retry no longer counted as its first call, so it met the others' sync
    // vote as a call apart, a usage error everywhere. The retry is now still its first.
    3242,
    // Collectives with a deadline (each seed's scenario as it stood when it broke):
    // a topology issued before a collective was decided left its callers waiting for members
    // that make their next call in the new one: it now fails for every member, to be retried;
    22,
    // a newcomer whose first peers_pending waited for its tentative answer was left out, and its
    // loop fell out of step with the others': it is not late;
    61,
    // a member left out of a collective that then failed among the others went on while they
    // retried: the members left out now end as the collective did;
    378, // a member left out counted it as a failure of its own, and voted update_topology alone;
    743, // a newcomer that had made no call since its admission was left out (found in CI).
    4380,
];

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| v.parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a number")))
}

fn verify(seed: u64) -> [usize; 5] {
    let report = run(seed);
    if let Err(v) = check(&report) {
        panic!(
            "seed {seed} broke an invariant: {}\nfaults: {:#?}\nreplay: SHOAL_SIM_SEED={seed} cargo test -p shoal-sim \
             --test seeds replay -- --nocapture",
            v.0, report.faults
        );
    }
    let aborted = report.collectives.iter().filter(|c| matches!(c.5, Outcome::Err(_))).count();
    [report.successes, aborted, report.syncs, report.transfers, report.transfers_failed]
}

/// `SHOAL_SIM_SEEDS` seeds (default 1000) from `SHOAL_SIM_FIRST` (default 0), spread over the
/// machine's cores: a run is a pure function of its seed, so the order they run in changes
/// nothing.
#[test]
fn every_seed_keeps_every_invariant() {
    let count = env_u64("SHOAL_SIM_SEEDS").unwrap_or(1000);
    let first = env_u64("SHOAL_SIM_FIRST").unwrap_or(0);
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let totals: Vec<[usize; 5]> = std::thread::scope(|scope| {
        let runs: Vec<_> = (0..workers)
            .map(|w| {
                scope.spawn(move || {
                    let mut sums = [0; 5];
                    for seed in (first + w..first + count).step_by(workers as usize) {
                        sums.iter_mut().zip(verify(seed)).for_each(|(sum, n)| *sum += n);
                    }
                    sums
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    });
    let [successes, aborted, syncs, transfers, transfers_failed] =
        totals.iter().fold([0; 5], |sums, t| std::array::from_fn(|k| sums[k] + t[k]));
    eprintln!(
        "{count} seeds: {successes} collectives succeeded, {aborted} failed and agreed; {syncs} syncs; {transfers} \
         transfers completed, {transfers_failed} failed"
    );
    // The runs must exercise every path, or the checks prove nothing.
    assert!(successes > 100 * count as usize, "too few successes: {successes}");
    assert!(count < 20 || aborted > count as usize / 4, "too few failures: {aborted}");
    assert!(count < 20 || syncs > 10 * count as usize, "too few syncs: {syncs}");
    assert!(count < 20 || transfers > 10 * count as usize, "too few transfers: {transfers}");
    assert!(count < 20 || transfers_failed > count as usize / 4, "too few failed transfers: {transfers_failed}");
}

#[test]
fn regressions() {
    for &seed in REGRESSIONS {
        verify(seed);
    }
}

/// `SHOAL_SIM_SEED=N`: runs one seed and prints what happened.
#[test]
fn replay() {
    let Some(seed) = env_u64("SHOAL_SIM_SEED") else { return };
    let report = run(seed);
    eprintln!("{}\nfaults: {:#?}\ngone: {:#?}", report.shape, report.faults, report.gone);
    for c in &report.collectives {
        eprintln!("{c:?}");
    }
    eprintln!("live {:?}, ring {:?}, views {:?}, events {}", report.live, report.ring, report.views, report.events);
    check(&report).unwrap();
}

#[test]
fn a_seed_is_a_pure_function() {
    let (a, b) = (run(7), run(7));
    assert_eq!((a.events, a.successes, a.collectives.len()), (b.events, b.successes, b.collectives.len()));
}

/// A run of `SHOAL_SIM_LARGE` peers (default 1000): every invariant holds, the master commits
/// the topology without a crashed member and the one with a newcomer, and its handling of each
/// event stays cheap. Prints the figures `docs/benchmarks.md` quotes.
#[test]
fn a_large_run_keeps_every_invariant() {
    let peers = env_u64("SHOAL_SIM_LARGE").unwrap_or(1000) as usize;
    let seed = env_u64("SHOAL_SIM_SEED").unwrap_or(1);
    let started = std::time::Instant::now();
    let report = shoal_sim::run_large(seed, peers);
    let real = started.elapsed();
    if let Err(v) = check(&report) {
        panic!("large run of {peers} (seed {seed}) broke an invariant: {}\nfaults: {:#?}", v.0, report.faults);
    }
    let large = report.large.clone().expect("a large run's figures");
    let m = &report.master;
    eprintln!(
        "{peers} peers, seed {seed}: {} events in {real:?}; {} collectives succeeded; slowest one-way latency \
         {:?}\n  crash of {} at {:?}: topology without it committed {:?} later\n  newcomer at {:?}: topology with \
         it committed {:?} later, {:?} after the first member's vote\n  master: {} events, {:?} in all, {:?} each on average, slowest {:?} ({})",
        report.events,
        report.successes,
        large.slowest_latency,
        large.crashed.0,
        large.crashed.1,
        large.crashed.2.map(|c| c - large.crashed.1),
        large.newcomer.1,
        large.newcomer.2.map(|c| c - large.newcomer.1),
        large.newcomer.2.zip(large.voted).map(|(c, v)| c - v),
        m.events,
        m.busy,
        m.busy / m.events.max(1) as u32,
        m.slowest,
        m.slowest_event,
    );
    let commits: Vec<_> = report.commits.iter().map(|(at, e, m)| (*at, e.0, m.len())).collect();
    eprintln!("  commits (when, epoch, members): {commits:?}");
    assert!(large.crashed.2.is_some(), "the master never committed a topology without the crashed member");
    assert!(large.newcomer.2.is_some(), "the newcomer was never admitted");
    // Simulated time, the same on every machine: admitting one and recovering from one loss each
    // take at most three of the slowest round trips once the members vote (a loss needs none).
    let rtt3 = 6 * large.slowest_latency;
    let admitted = large.newcomer.2.zip(large.voted).map(|(c, v)| c - v);
    assert!(
        admitted.is_some_and(|a| a <= rtt3),
        "admission took {admitted:?} after the first vote; 3 round trips: {rtt3:?}"
    );
    let recovered = large.crashed.2.map(|c| c - large.crashed.1);
    assert!(recovered.is_some_and(|r| r <= rtt3), "recovery took {recovered:?}; 3 round trips: {rtt3:?}");
    assert!(report.live.len() == peers, "{} live peers at the end, {peers} expected", report.live.len());
}
