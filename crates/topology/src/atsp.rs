//! The asymmetric travelling-salesman problem over [`Costs`]: the cheapest cycle through every
//! member, where `a -> b` may cost other than `b -> a` (a WAN link's two directions differ, and
//! a round trip through a third site may beat a direct route).
//!
//! - [`exact`]: Held–Karp dynamic programming, `O(2^n n^2)`: used up to [`EXACT_MAX`] members
//!   (12 members take about a millisecond).
//! - [`Search`]: an anytime heuristic for larger groups. It starts from the best nearest-neighbour
//!   tour, descends with *segment insertion* (move any run of consecutive members, unreversed,
//!   between two others: the reversal-free 3-opt move, which keeps every edge's direction and so
//!   suits asymmetric costs), then iterates: a double-bridge kick of the current tour, descent
//!   again, keep it if no worse. Every call of [`Search::run`] continues where the last stopped,
//!   so a master can improve a plan in slices between other work.
//! - [`lower_bound`]: the assignment-problem bound (each member's successor chosen freely, no
//!   subtours forbidden), solved exactly by the Hungarian method: what large instances are
//!   checked against.
//!
//! A tour is a list of member indices, each once; it closes from the last back to the first.
//!
//! Budgets are counted in kicks, never read off a clock: a search is a pure function of its
//! instance, start, seed and budget, so the master that runs it stays a deterministic machine
//! (the simulator replays it by seed). [`kicks_within`] turns a time budget into kicks.

use crate::Costs;
use std::time::Duration;

/// How far apart, at most, a kick's three cuts are: a local kick lets descent repair the tour
/// around it alone, so thousands run per second.
const KICK_SPAN: usize = 30;

/// A kick's result is kept if it costs at most the best plus this fraction of it (1 / this).
const ACCEPT_WORSE: u64 = 200;
/// Kicks without a new best after which the search returns to the best.
const STALE: u64 = 2000;

/// Groups up to this size are solved exactly.
pub const EXACT_MAX: usize = 12;

/// Seconds one kick takes per `n^1.5` members: measured at 16, 64 and 256 members (19 µs,
/// 184 µs, 1.4 ms a kick; `examples/solver.rs`), within 15% of this at each.
const KICK_SECONDS: f64 = 0.35e-6;

/// About how many kicks a search over `n` members makes in `budget` on the machines measured
/// (at least one).
pub fn kicks_within(n: usize, budget: Duration) -> u64 {
    let per_kick = KICK_SECONDS * (n.max(2) as f64).powf(1.5);
    (budget.as_secs_f64() / per_kick).max(1.0) as u64
}

/// What `tour` costs, closing edge included.
pub fn tour_cost(costs: &Costs, tour: &[usize]) -> u64 {
    let n = tour.len();
    (0..n).map(|i| costs.get(tour[i], tour[(i + 1) % n])).sum()
}

/// The cheapest tour, starting at member 0.
///
/// # Panics
/// If there are more than [`EXACT_MAX`] + 4 members (the table would not be small).
pub fn exact(costs: &Costs) -> Vec<usize> {
    let n = costs.len();
    assert!(n <= EXACT_MAX + 4, "exact tour of {n} members");
    if n <= 2 {
        return (0..n).collect();
    }
    // Paths from member 0 through the members of `mask` (bit k: member k + 1), ending at `j + 1`.
    let m = n - 1;
    let full = (1usize << m) - 1;
    let mut best = vec![u64::MAX; (1 << m) * m];
    let mut from = vec![u8::MAX; (1 << m) * m];
    for j in 0..m {
        best[(1 << j) * m + j] = costs.get(0, j + 1);
    }
    for mask in 1..=full {
        for j in 0..m {
            let here = best[mask * m + j];
            if mask & (1 << j) == 0 || here == u64::MAX {
                continue;
            }
            for k in 0..m {
                if mask & (1 << k) != 0 {
                    continue;
                }
                let next = mask | (1 << k);
                let c = here + costs.get(j + 1, k + 1);
                if c < best[next * m + k] {
                    best[next * m + k] = c;
                    from[next * m + k] = j as u8;
                }
            }
        }
    }
    let last = (0..m).min_by_key(|&j| best[full * m + j] + costs.get(j + 1, 0)).expect("n > 2");
    let (mut tour, mut mask, mut j) = (Vec::with_capacity(n), full, last);
    loop {
        tour.push(j + 1);
        let prev = from[mask * m + j];
        mask &= !(1 << j);
        if prev == u8::MAX {
            break;
        }
        j = prev as usize;
    }
    tour.push(0);
    tour.reverse();
    tour
}

/// The best tour found in `kicks` kicks: exact up to [`EXACT_MAX`] members, else [`Search`] from
/// `start` (a previous tour) or from scratch.
pub fn solve(costs: &Costs, start: Option<Vec<usize>>, kicks: u64) -> Vec<usize> {
    solve_while(costs, start, kicks, || true)
}

/// As [`solve`], kicking only while `go_on` says so (see [`Search::run_while`]).
pub fn solve_while(costs: &Costs, start: Option<Vec<usize>>, kicks: u64, go_on: impl FnMut() -> bool) -> Vec<usize> {
    if costs.len() <= EXACT_MAX {
        return exact(costs);
    }
    let mut search = Search::new(costs.clone(), start, 1);
    search.run_while(kicks, go_on);
    search.best().0.to_vec()
}

/// An iterated local search over one instance (see the module docs), resumable.
#[derive(Debug, Clone)]
pub struct Search {
    costs: Costs,
    near: Near,
    best: Vec<usize>,
    best_cost: u64,
    current: Vec<usize>,
    current_cost: u64,
    rng: u64,
    rounds: u64,
    since_best: u64,
}

impl Search {
    /// A search from `start` (which must name every member once) or, without one, from the best
    /// nearest-neighbour tour; it descends to a local optimum at once. `seed` drives the kicks.
    ///
    /// # Panics
    /// If `start` is not a permutation of the members.
    pub fn new(costs: Costs, start: Option<Vec<usize>>, seed: u64) -> Self {
        let n = costs.len();
        let mut tour = match start {
            Some(t) => {
                let mut seen = vec![false; n];
                assert!(t.len() == n && t.iter().all(|&m| m < n && !std::mem::replace(&mut seen[m], true)));
                t
            }
            None => {
                (0..n).map(|s| nearest_neighbour(&costs, s)).min_by_key(|t| tour_cost(&costs, t)).unwrap_or_default()
            }
        };
        let near = Near::new(&costs);
        descend(&costs, &near, &mut tour, 0..n);
        let cost = tour_cost(&costs, &tour);
        Search {
            costs,
            near,
            best: tour.clone(),
            best_cost: cost,
            current: tour,
            current_cost: cost,
            rng: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            rounds: 0,
            since_best: 0,
        }
    }

    /// The best tour so far and its cost.
    pub fn best(&self) -> (&[usize], u64) {
        (&self.best, self.best_cost)
    }

    /// Kicks run so far.
    pub fn rounds(&self) -> u64 {
        self.rounds
    }

    /// Kicks and descends `kicks` more times. True if the best tour improved.
    pub fn run(&mut self, kicks: u64) -> bool {
        self.run_while(kicks, || true)
    }

    /// As [`Search::run`], asking `go_on` before each kick and stopping at its first no: a
    /// caller's bound that is not in kicks (a master's wall clock, on a machine too busy for the
    /// kicks it calibrated). The search stays a pure function of the answers `go_on` gave.
    pub fn run_while(&mut self, kicks: u64, mut go_on: impl FnMut() -> bool) -> bool {
        let n = self.costs.len();
        let before = self.best_cost;
        if n < 8 {
            // Too few members for a double bridge; descent already found what it can.
            return false;
        }
        for _ in 0..kicks {
            if !go_on() {
                break;
            }
            let mut next = self.current.clone();
            let cuts = self.double_bridge(&mut next);
            descend(&self.costs, &self.near, &mut next, cuts);
            let cost = tour_cost(&self.costs, &next);
            // A slightly worse tour is taken too (within ACCEPT_WORSE of the best), so the search
            // walks out of a deep local optimum; after STALE kicks without a new best it goes
            // back to the best.
            if cost <= self.current_cost || cost <= self.best_cost + self.best_cost / ACCEPT_WORSE {
                self.current = next;
                self.current_cost = cost;
                if cost < self.best_cost {
                    self.best = self.current.clone();
                    self.best_cost = cost;
                    self.since_best = 0;
                }
            }
            self.since_best += 1;
            if self.since_best >= STALE {
                self.current = self.best.clone();
                self.current_cost = self.best_cost;
                self.since_best = 0;
            }
            self.rounds += 1;
        }
        self.best_cost < before
    }

    /// Cuts the tour at three places close together (within [`KICK_SPAN`] members, at a random
    /// spot) and swaps the two middle pieces: `A B C D` becomes `A C B D`, a move descent cannot
    /// undo in one step, that reverses nothing. Returns the members next to the cuts.
    fn double_bridge(&mut self, tour: &mut Vec<usize>) -> Vec<usize> {
        let n = tour.len();
        tour.rotate_left((self.next_random() % n as u64) as usize);
        let span = KICK_SPAN.min(n - 1) as u64;
        let a = 1 + (self.next_random() % (span - 2)) as usize;
        let b = a + 1 + (self.next_random() % (span - a as u64 - 1)) as usize;
        let c = b + 1 + (self.next_random() % (span - b as u64)) as usize;
        let mut next = Vec::with_capacity(n);
        next.extend_from_slice(&tour[..a]);
        next.extend_from_slice(&tour[b..c]);
        next.extend_from_slice(&tour[a..b]);
        next.extend_from_slice(&tour[c..]);
        *tour = next;
        [a - 1, a, b - 1, b, c - 1, c % n].iter().map(|&k| tour[k]).collect()
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// The tour that always goes to the cheapest member not yet visited, from `start`.
fn nearest_neighbour(costs: &Costs, start: usize) -> Vec<usize> {
    let n = costs.len();
    let mut seen = vec![false; n];
    let mut tour = vec![start];
    seen[start] = true;
    while tour.len() < n {
        let at = *tour.last().expect("not empty");
        let next = (0..n).filter(|&j| !seen[j]).min_by_key(|&j| costs.get(at, j)).expect("someone left");
        seen[next] = true;
        tour.push(next);
    }
    tour
}

/// Candidate neighbours per member: how many of the cheapest edges into and out of each member
/// descent tries (a good tour rarely uses an edge outside them).
const NEAR: usize = 10;

/// For each member, the members cheapest to come from and to go to.
#[derive(Debug, Clone)]
struct Near {
    from: Vec<Vec<usize>>,
    to: Vec<Vec<usize>>,
}

impl Near {
    fn new(costs: &Costs) -> Self {
        let n = costs.len();
        let cheapest = |key: &dyn Fn(usize) -> u64, m: usize| {
            let mut others: Vec<usize> = (0..n).filter(|&o| o != m).collect();
            others.sort_by_key(|&o| key(o));
            others.truncate(NEAR);
            others
        };
        Near {
            from: (0..n).map(|m| cheapest(&|o| costs.get(o, m), m)).collect(),
            to: (0..n).map(|m| cheapest(&|o| costs.get(m, o), m)).collect(),
        }
    }
}

/// Segment insertion until no move improves: any run of consecutive members (up to `n - 3`),
/// moved unreversed between two members outside it, one of whose two new edges is among the
/// cheapest ([`NEAR`]) of its end. Only segments starting at an *active* member are tried (all at
/// first, those around a kick's cuts after it); a move activates the members whose edges it
/// changed, and descent ends when none is left.
fn descend(costs: &Costs, near: &Near, tour: &mut Vec<usize>, active: impl IntoIterator<Item = usize>) {
    let n = tour.len();
    if n < 4 {
        return;
    }
    let mut queued = vec![false; n];
    let mut queue = std::collections::VecDeque::new();
    fn wake(m: usize, queued: &mut [bool], queue: &mut std::collections::VecDeque<usize>) {
        if !std::mem::replace(&mut queued[m], true) {
            queue.push_back(m);
        }
    }
    for m in active {
        wake(m, &mut queued, &mut queue);
    }
    let mut pos = vec![0; n];
    let mut stale = true;
    while let Some(m) = queue.pop_front() {
        queued[m] = false;
        if stale {
            for (k, &t) in tour.iter().enumerate() {
                pos[t] = k;
            }
        }
        match improve_at(costs, near, tour, &pos, pos[m]) {
            Some(touched) => {
                stale = true;
                for t in touched {
                    wake(t, &mut queued, &mut queue);
                }
            }
            None => stale = false,
        }
    }
}

/// Applies the first improving move of a segment starting at position `i`, if any, and returns
/// the members whose edges it changed.
fn improve_at(costs: &Costs, near: &Near, tour: &mut Vec<usize>, pos: &[usize], i: usize) -> Option<[usize; 6]> {
    let n = tour.len();
    let c = |a: usize, b: usize| costs.get(a, b) as i128;
    for len in 1..=n - 3 {
        let (p, s0) = (tour[(i + n - 1) % n], tour[i]);
        let (se, q) = (tour[(i + len - 1) % n], tour[(i + len) % n]);
        let removed = c(p, q) - c(p, s0) - c(se, q);
        let inside = |k: usize| (k + n - i) % n < len;
        // Between `a` and `b`, consecutive once the segment is out: `a` cheap to come from, or
        // `b` cheap to go to. Next to `p` and `q`, where it was, is no move.
        let by_from =
            near.from[s0].iter().filter(|&&a| a != p && !inside(pos[a])).map(|&a| (a, tour[(pos[a] + 1) % n]));
        let by_to =
            near.to[se].iter().filter(|&&b| b != q && !inside(pos[b])).map(|&b| (tour[(pos[b] + n - 1) % n], b));
        for (a, b) in by_from.chain(by_to) {
            if removed + c(a, s0) + c(se, b) - c(a, b) < 0 {
                move_segment(tour, i, len, pos[a]);
                return Some([p, s0, se, q, a, b]);
            }
        }
    }
    None
}

/// Moves the `len` members from position `i` (cyclically) to just after position `k`.
fn move_segment(tour: &mut Vec<usize>, i: usize, len: usize, k: usize) {
    let n = tour.len();
    let segment: Vec<usize> = (0..len).map(|d| tour[(i + d) % n]).collect();
    let after = tour[k];
    // The rest, in tour order from just after the segment.
    let rest = (0..n - len).map(|d| tour[(i + len + d) % n]);
    let mut next = Vec::with_capacity(n);
    for m in rest {
        next.push(m);
        if m == after {
            next.extend_from_slice(&segment);
        }
    }
    *tour = next;
}

/// The assignment-problem lower bound on any tour's cost: every member picks a successor other
/// than itself, each member picked once, at the least total cost (Hungarian method, `O(n^3)`).
/// A tour is such an assignment, so none costs less.
pub fn lower_bound(costs: &Costs) -> u64 {
    let n = costs.len();
    if n < 2 {
        return 0;
    }
    // e-maxx's formulation, 1-based, with potentials `u` (rows) and `v` (columns).
    const BIG: i128 = i128::MAX / 4;
    let a = |i: usize, j: usize| if i == j { BIG } else { costs.get(i - 1, j - 1) as i128 };
    let (mut u, mut v) = (vec![0i128; n + 1], vec![0i128; n + 1]);
    let (mut p, mut way) = (vec![0usize; n + 1], vec![0usize; n + 1]);
    for i in 1..=n {
        p[0] = i;
        let mut j0 = 0;
        let mut minv = vec![BIG; n + 1];
        let mut used = vec![false; n + 1];
        loop {
            used[j0] = true;
            let (i0, mut delta, mut j1) = (p[j0], BIG, 0);
            for j in 1..=n {
                if !used[j] {
                    let cur = a(i0, j) - u[i0] - v[j];
                    if cur < minv[j] {
                        minv[j] = cur;
                        way[j] = j0;
                    }
                    if minv[j] < delta {
                        delta = minv[j];
                        j1 = j;
                    }
                }
            }
            for j in 0..=n {
                if used[j] {
                    u[p[j]] += delta;
                    v[j] -= delta;
                } else {
                    minv[j] -= delta;
                }
            }
            j0 = j1;
            if p[j0] == 0 {
                break;
            }
        }
        loop {
            let j1 = way[j0];
            p[j0] = p[j1];
            j0 = j1;
            if j0 == 0 {
                break;
            }
        }
    }
    (1..=n).map(|j| a(p[j], j) as u64).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    /// The same instance, start, seed and budget give the same tour, however fast the machine.
    #[test]
    fn a_search_is_a_pure_function_of_its_budget() {
        let costs = random_costs(40, 3);
        let run = || {
            let mut search = Search::new(costs.clone(), None, 9);
            search.run(300);
            search.best().0.to_vec()
        };
        assert_eq!(run(), run());
        assert!(kicks_within(64, Duration::from_secs(1)) > kicks_within(256, Duration::from_secs(1)));
        assert_eq!(kicks_within(1000, Duration::ZERO), 1);
    }

    fn random_costs(n: usize, seed: u64) -> Costs {
        let mut s = seed | 1;
        let mut cost = Vec::with_capacity(n * n);
        for _ in 0..n * n {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            cost.push(1 + s % 1000);
        }
        Costs::new(n, cost)
    }

    fn brute_force(costs: &Costs) -> u64 {
        fn go(costs: &Costs, tour: &mut Vec<usize>, left: &mut Vec<usize>, best: &mut u64) {
            if left.is_empty() {
                *best = (*best).min(tour_cost(costs, tour));
                return;
            }
            for i in 0..left.len() {
                let m = left.remove(i);
                tour.push(m);
                go(costs, tour, left, best);
                tour.pop();
                left.insert(i, m);
            }
        }
        let mut best = u64::MAX;
        go(costs, &mut vec![0], &mut (1..costs.len()).collect(), &mut best);
        best
    }

    fn is_tour(t: &[usize], n: usize) -> bool {
        let mut s = t.to_vec();
        s.sort_unstable();
        s == (0..n).collect::<Vec<_>>()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn exact_matches_brute_force(n in 1usize..=8, seed in any::<u64>()) {
            let costs = random_costs(n, seed);
            let tour = exact(&costs);
            prop_assert!(is_tour(&tour, n));
            prop_assert_eq!(tour_cost(&costs, &tour), brute_force(&costs));
            prop_assert!(lower_bound(&costs) <= tour_cost(&costs, &tour) || n < 2);
        }

        #[test]
        fn segment_moves_keep_a_tour(n in 4usize..20, i in 0usize..20, len in 1usize..18, m in 0usize..20) {
            let (i, len) = (i % n, 1 + len % (n - 3));
            let k = (i + len + m % (n - len - 1)) % n;
            let mut tour: Vec<usize> = (0..n).collect();
            move_segment(&mut tour, i, len, k);
            prop_assert!(is_tour(&tour, n));
        }
    }

    #[test]
    fn search_comes_within_two_percent_of_the_optimum() {
        let (mut total, mut optimum) = (0, 0);
        for seed in 0..24u64 {
            let n = 13 + (seed % 4) as usize;
            let costs = random_costs(n, seed + 1);
            let mut search = Search::new(costs.clone(), None, seed);
            search.run(2000);
            let (tour, cost) = search.best();
            assert!(is_tour(tour, n));
            assert_eq!(cost, tour_cost(&costs, tour));
            let best = tour_cost(&costs, &exact(&costs));
            assert!(cost as f64 <= best as f64 * 1.05, "seed {seed}: {cost} against the optimum {best}");
            (total, optimum) = (total + cost, optimum + best);
        }
        assert!(total as f64 <= optimum as f64 * 1.02, "{total} against {optimum} in all");
    }

    #[test]
    fn a_search_stops_at_its_callers_first_no() {
        let costs = random_costs(20, 3);
        let mut asked = 0;
        let mut search = Search::new(costs.clone(), None, 1);
        search.run_while(1000, || {
            asked += 1;
            asked <= 7
        });
        assert_eq!((search.rounds(), asked), (7, 8), "seven kicks, then the no");
        // The kicks it made are those of a search without the bound: the same best tour.
        let mut free = Search::new(costs, None, 1);
        free.run(7);
        assert_eq!(search.best(), free.best());
    }

    #[test]
    fn exact_takes_twelve_members() {
        let costs = random_costs(12, 7);
        let tour = exact(&costs);
        assert!(is_tour(&tour, 12));
        assert!(tour_cost(&costs, &tour) >= lower_bound(&costs));
    }

    #[test]
    fn large_instances_come_close_to_the_assignment_bound() {
        for seed in 1..=3 {
            let costs = random_costs(64, seed);
            let tour = solve(&costs, None, 200);
            assert!(is_tour(&tour, 64));
            let (cost, bound) = (tour_cost(&costs, &tour), lower_bound(&costs));
            // Random asymmetric instances have an optimum a few percent above the bound.
            assert!(cost as f64 <= bound as f64 * 1.15, "seed {seed}: tour {cost}, bound {bound}");
        }
    }

    #[test]
    fn two_sites_are_crossed_twice() {
        // Members 0..6 alternate between two sites: cheap inside, dear between.
        let n = 16;
        let cost = (0..n * n).map(|e| if (e / n) % 2 == (e % n) % 2 { 1 } else { 100 }).collect();
        let costs = Costs::new(n, cost);
        let tour = solve(&costs, None, 50);
        let crossings = (0..n).filter(|&i| tour[i] % 2 != tour[(i + 1) % n] % 2).count();
        assert_eq!(crossings, 2, "{tour:?}");
    }
}
