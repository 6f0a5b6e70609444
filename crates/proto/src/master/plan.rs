//! The ring's order (`optimize_topology`, `docs/topology.md`).
//!
//! Every accepted peer measures its links to the others and votes `update_topology` with them.
//! When the vote passes and every voter measured, the master solves the asymmetric
//! travelling-salesman problem over the costs of those links (`shoal_topology`): exactly up to
//! [`EXACT_MAX`] members, else a heuristic within [`FIRST_ANSWER`]. The answer is the
//! [`Plan`]: every topology issued from then on lists its measured members in the plan's order,
//! those that left dropped and the order re-solved (within [`REPLAN`] for a large group), and
//! members nobody measured after them in their usual order. A large group's plan keeps improving
//! in slices of [`SLICE`] while the run goes on, applied at the next topology.
//!
//! **Drift.** Peers report how long each link was saturated and what it carried meanwhile
//! ([`shoal_wire::LinkReport`]). Once a network link (TCP or TLS) gathered [`DRIFT_WINDOW`] of
//! saturated time, the master compares its rate with the plan's: below the plan's by a factor
//! of [`DRIFT_FACTOR`], on a link saturated for at least [`BOTTLENECK_SHARE`] of its peer's
//! time in operations (the one holding them back), the plan takes the new rate and the ring is
//! re-solved within [`REPLAN`]. An order at least [`REPLAN_GAIN`] cheaper is applied at the next
//! topology, and `peers_pending` answers true until then, so a loop that calls
//! `update_topology` only when peers wait applies it too. Only slowdowns are judged: a link
//! saturated in short stretches (its stream took a frame soon after it was full) reads faster
//! than it is, and a link that got faster shows it only once something else stops holding it
//! back; the next `optimize_topology` measures it again.

use super::{Master, MasterEvent, Output, Timer};
use shoal_topology::{kicks_within, solve_while, tour_cost, Costs, Link, Links, Search, EXACT_MAX};
use shoal_wire::{AlgorithmLimits, GroupId, Measured, PeerId, PeerReport};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The heuristic's budget for a new plan: in kicks, about this long on the machines measured
/// (`shoal_topology::kicks_within`), and no longer than this by the driver's clock where it
/// gives one ([`super::MasterConfig::search_clock`]).
pub const FIRST_ANSWER: Duration = Duration::from_secs(1);
/// Its budget to re-solve after the group changed (a member left).
pub const REPLAN: Duration = Duration::from_millis(100);
/// One slice of improvement in the background, and the pause between two.
pub const SLICE: Duration = Duration::from_millis(10);
const SLICE_EVERY: Duration = Duration::from_millis(100);
/// Groups up to this size have their measured matrix logged at info level.
const LOGGED_MATRIX: usize = 16;
/// Slices in a row without improvement after which the background search stops.
const FRUITLESS_SLICES: u32 = 100;
/// Saturated time a link gathers in reports before its rate is compared with the plan's.
pub const DRIFT_WINDOW: Duration = Duration::from_millis(250);
/// How far below the plan's a saturated link's rate may fall before it counts as drifted
/// (SCALE-CCL sees WAN rates swing by ±100%).
pub const DRIFT_FACTOR: f64 = 2.0;
/// The share of its peer's time in operations that a link must have been saturated to count as
/// the one holding them back. A link that waits on another carries short bursts that TCP never
/// ramps up to the path's rate (saturated briefly, and slowly): not a drift of its own.
pub const BOTTLENECK_SHARE: f64 = 0.5;
/// How much cheaper a ring re-solved for drifted links must be than the one in force to replace it.
pub const REPLAN_GAIN: f64 = 0.1;

/// The last measured links and the best ring over them.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The measured members, indexing `links`.
    members: Vec<PeerId>,
    links: Links,
    /// The best ring found over `members`.
    order: Vec<PeerId>,
    /// The background search, for a large group, while it still finds better.
    search: Option<Search>,
    fruitless: u32,
    /// Saturated time and bytes each link reported, by (from, to).
    drift: BTreeMap<(PeerId, PeerId), Window>,
    /// The order was re-solved for drifted links and waits for the next topology.
    replanned: bool,
}

/// What a link reported of its saturated time (and its peer of its time in operations): the
/// totals last seen, and what gathered since its rate was last judged.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    seen: [u64; 3],
    bytes: u64,
    us: u64,
    busy_us: u64,
}

impl Plan {
    /// The measured members.
    pub fn members(&self) -> &[PeerId] {
        &self.members
    }

    /// What `from` measured towards `to`.
    pub fn link(&self, from: PeerId, to: PeerId) -> Option<Link> {
        let at = |p| self.members.iter().position(|m| *m == p);
        self.links.get(at(from)?, at(to)?)
    }

    /// The best ring found over the measured members.
    pub fn order(&self) -> &[PeerId] {
        &self.order
    }

    /// Whether the order was re-solved for drifted links and waits for the next topology.
    pub fn replanned(&self) -> bool {
        self.replanned
    }

    /// The site of every measured member, where round trips cluster into several sites and
    /// some site holds two members or more (`shoal_topology::sites`); none otherwise. The
    /// two-level all-reduce follows them, and the hierarchical one where
    /// [`AlgorithmLimits::hierarchical`] says grouping pays.
    pub fn sites(&self) -> BTreeMap<PeerId, u16> {
        let sites = shoal_topology::sites(&self.links, shoal_topology::sites::DEFAULT_NEAR_US);
        let count = sites.iter().max().map_or(0, |s| s + 1);
        if count < 2 || count == sites.len() {
            return BTreeMap::new();
        }
        let sites: BTreeMap<PeerId, u16> = self.members.iter().zip(sites).map(|(p, s)| (*p, s as u16)).collect();
        debug_assert_eq!(sites.len(), self.members.len(), "a site for every member planned");
        sites
    }
}

impl Master {
    /// The plan of `group`'s last `optimize_topology`, if one passed.
    pub fn plan(&self, group: GroupId) -> Option<&Plan> {
        self.group(group)?.plan.as_ref()
    }

    /// Checks what `voter` measured (links to members of the ring, each at most once, none to
    /// itself) and keeps it for the tally.
    pub(super) fn record_measured(
        &mut self,
        voter: PeerId,
        measured: Option<Vec<Measured>>,
    ) -> Result<(), super::PeerMisbehaved> {
        debug_assert!(
            !matches!(self.g.phase, super::Phase::AwaitingConnections { .. }),
            "links measured while a topology connects"
        );
        if let Some(links) = &measured {
            let mut seen = std::collections::BTreeSet::new();
            for l in links {
                if l.peer == voter || !seen.insert(l.peer) {
                    return Err(super::PeerMisbehaved::MeasuredTwice { voter, to: l.peer });
                }
            }
        }
        debug_assert!(
            measured.as_ref().is_none_or(|l| l.len() <= shoal_wire::MAX_MEMBERS),
            "the wire caps what a vote measured"
        );
        self.g.measured.insert(voter, measured);
        Ok(())
    }

    /// Whether every voter of the passed ballot measured: the vote was `optimize_topology`'s.
    pub(super) fn every_voter_measured(&self, voters: &[PeerId]) -> bool {
        voters.iter().all(|v| self.g.measured.get(v).is_some_and(Option::is_some))
    }

    /// A new plan over `voters` (in ring order) from what they measured; links to members that
    /// are gone are ignored.
    pub(super) fn make_plan(&mut self, voters: &[PeerId]) {
        debug_assert!(self.every_voter_measured(voters), "a ring planned over links nobody measured");
        let mut links = Links::new(voters.len());
        for (i, v) in voters.iter().enumerate() {
            for m in self.g.measured.get(v).cloned().flatten().unwrap_or_default() {
                if let Some(j) = voters.iter().position(|p| *p == m.peer) {
                    links.set(i, j, Link { rtt_us: m.rtt_us, bytes_per_s: m.bytes_per_s });
                }
            }
        }
        let costs = Costs::from_links(&links);
        let before = tour_cost(&costs, &(0..voters.len()).collect::<Vec<_>>());
        let budget = self.budget(FIRST_ANSWER);
        let tour = solve_while(&costs, None, budget.kicks(voters.len()), || budget.go_on());
        let after = tour_cost(&costs, &tour);
        let order: Vec<PeerId> = tour.iter().map(|&i| voters[i]).collect();
        assert!(same_members(&order, voters), "a planned ring holds every voter once");
        debug_assert!(voters.len() > EXACT_MAX || after <= before, "an exact plan costs more than the voters' order");
        // A large group's matrix would flood the log: its lines at debug level.
        let level = if voters.len() <= LOGGED_MATRIX { log::Level::Info } else { log::Level::Debug };
        log::log!(level, "measured links (from -> to: round trip, rate):\n{}", describe(voters, &links));
        let search = (voters.len() > EXACT_MAX).then(|| Search::new(costs, Some(tour), voters.len() as u64));
        self.g.plan = Some(Plan {
            members: voters.to_vec(),
            links,
            order: order.clone(),
            search,
            fruitless: 0,
            drift: BTreeMap::new(),
            replanned: false,
        });
        self.outputs.push_back(Output::Event(MasterEvent::RingPlanned {
            group: self.focus,
            members: order,
            cost_us: after,
            before_us: before,
        }));
    }

    /// `members` in the order a topology lists them: the planned ones in the plan's order, then
    /// the others as given.
    pub(super) fn planned(&mut self, members: Vec<PeerId>) -> Vec<PeerId> {
        let budget = self.budget(REPLAN);
        let Some(plan) = &mut self.g.plan else { return members };
        debug_assert!(same_members(&plan.order, &plan.members), "the plan's order is not its members");
        plan.replanned = false;
        let kept: Vec<usize> =
            plan.order.iter().filter(|p| members.contains(p)).map(|p| index(&plan.members, *p)).collect();
        if kept.len() < 2 {
            return members;
        }
        let mut order: Vec<PeerId> = if kept.len() == plan.members.len() {
            plan.order.clone()
        } else {
            // Members left: the order without them, improved over the links among those that stay.
            let costs = Costs::from_links(&plan.links.subset(&kept));
            let start = (0..kept.len()).collect();
            let tour = solve_while(&costs, Some(start), budget.kicks(kept.len()), || budget.go_on());
            tour.iter().map(|&i| plan.members[kept[i]]).collect()
        };
        order.extend(members.iter().filter(|p| !plan.members.contains(p)));
        assert!(same_members(&order, &members), "a topology's order holds each of its members once");
        order
    }

    /// Takes what `from` reported of its links' saturated time; re-plans the ring if a link
    /// drifted (see the module docs).
    pub(super) fn watch_drift(&mut self, now: Instant, from: PeerId, report: &PeerReport) {
        debug_assert!(self.peers.contains_key(&from), "links reported by {from}, which is gone");
        let Some(plan) = &mut self.g.plan else { return };
        let mut drifted = Vec::new();
        for l in &report.links {
            // Shared memory's rate is the cores', not the network's: no ring order changes it.
            let Some(planned) = plan.link(from, l.peer).filter(|_| matches!(l.transport.as_str(), "tcp" | "tls"))
            else {
                continue;
            };
            let w = plan.drift.entry((from, l.peer)).or_default();
            let totals = [l.saturated_bytes, l.saturated_us, report.busy_us];
            // The totals start again with each topology.
            let seen = if totals.iter().zip(w.seen).any(|(t, s)| *t < s) { [0; 3] } else { w.seen };
            // A peer's totals are its word: added without overflow, however large.
            w.bytes = w.bytes.saturating_add(totals[0] - seen[0]);
            w.us = w.us.saturating_add(totals[1] - seen[1]);
            w.busy_us = w.busy_us.saturating_add(totals[2] - seen[2]);
            w.seen = totals;
            if w.us < DRIFT_WINDOW.as_micros() as u64 {
                continue;
            }
            let rate = (u128::from(w.bytes) * 1_000_000 / u128::from(w.us)).min(u64::MAX.into()) as u64;
            let share = w.us as f64 / w.busy_us.max(1) as f64;
            (w.bytes, w.us, w.busy_us) = (0, 0, 0);
            if share >= BOTTLENECK_SHARE && (rate as f64) < planned.bytes_per_s as f64 / DRIFT_FACTOR {
                drifted.push((l.peer, planned, rate));
            }
        }
        debug_assert!(drifted.iter().all(|(to, ..)| plan.link(from, *to).is_some()), "only planned links drift");
        if !drifted.is_empty() {
            self.replan(now, from, &drifted);
        }
    }

    /// Re-solves the ring with the new `rate` of each link from `from` that `drifted`.
    fn replan(&mut self, now: Instant, from: PeerId, drifted: &[(PeerId, Link, u64)]) {
        let budget = self.budget(REPLAN);
        let plan = self.g.plan.as_mut().expect("a plan to drift from");
        let i = index(&plan.members, from);
        for &(to, planned, rate) in drifted {
            let mbit = |b: u64| b as f64 * 8.0 / 1e6;
            log::info!(
                "link {from} -> {to} drifted: {:.1} Mbit/s while saturated, {:.1} Mbit/s planned",
                mbit(rate),
                mbit(planned.bytes_per_s)
            );
            plan.links.set(i, index(&plan.members, to), Link { bytes_per_s: rate, ..planned });
        }
        let costs = Costs::from_links(&plan.links);
        let current: Vec<usize> = plan.order.iter().map(|p| index(&plan.members, *p)).collect();
        let before = tour_cost(&costs, &current);
        let tour = solve_while(&costs, Some(current), budget.kicks(plan.members.len()), || budget.go_on());
        let after = tour_cost(&costs, &tour);
        debug_assert!(after <= before, "a search from the ring in force never ends on a worse one");
        plan.search =
            (plan.members.len() > EXACT_MAX).then(|| Search::new(costs, Some(tour.clone()), plan.members.len() as u64));
        plan.fruitless = 0;
        if after as f64 <= before as f64 * (1.0 - REPLAN_GAIN) {
            plan.order = tour.iter().map(|&i| plan.members[i]).collect();
            assert!(same_members(&plan.order, &plan.members), "a re-planned ring holds every member once");
            plan.replanned = true;
            log::info!(
                "ring re-planned for drifted links: {before} -> {after} µs per round of steps, at the next topology"
            );
            let members = plan.order.clone();
            self.outputs.push_back(Output::Event(MasterEvent::RingPlanned {
                group: self.focus,
                members,
                cost_us: after,
                before_us: before,
            }));
        }
        self.arm_plan_slice(now);
    }

    /// A slice of the background search, when one runs: a better ring is kept for the next
    /// topology.
    pub(super) fn improve_plan(&mut self, now: Instant) {
        let budget = self.budget(SLICE);
        let Some(plan) = &mut self.g.plan else { return };
        let Some(search) = &mut plan.search else { return };
        debug_assert!(plan.members.len() > EXACT_MAX, "an exact plan is searched on");
        if search.run_while(budget.kicks(plan.members.len()), || budget.go_on()) {
            let (tour, cost) = search.best();
            plan.order = tour.iter().map(|&i| plan.members[i]).collect();
            assert!(same_members(&plan.order, &plan.members), "an improved ring holds every member once");
            plan.fruitless = 0;
            log::info!("ring plan improved in the background: cost {cost} µs, applied at the next topology");
        } else {
            plan.fruitless += 1;
        }
        if plan.fruitless >= FRUITLESS_SLICES {
            plan.search = None;
        }
        self.arm_plan_slice(now);
    }

    /// The small-message limits of a ring of `members` in this order
    /// (`shoal_topology::limits`), and whether grouping them by their sites pays
    /// (`shoal_topology::grouping_pays`), judged over the measured ones where they are more than
    /// half of them: a newcomer nobody measured yet leaves the run's choices as they were.
    pub(super) fn limits(&self, members: &[PeerId]) -> Option<AlgorithmLimits> {
        let plan = self.g.plan.as_ref()?;
        let order: Vec<usize> = members.iter().filter_map(|p| plan.members.iter().position(|m| m == p)).collect();
        if 2 * order.len() <= members.len() {
            return None;
        }
        let sites = shoal_topology::sites(&plan.links, shoal_topology::sites::DEFAULT_NEAR_US);
        let l = shoal_topology::limits(&plan.links, &order, &sites)?;
        let hierarchical = shoal_topology::grouping_pays(&plan.links, &order, &sites);
        Some(AlgorithmLimits { oneshot_max: l.oneshot_max, twoshot_max: l.twoshot_max, hierarchical })
    }

    pub(super) fn arm_plan_slice(&mut self, now: Instant) {
        match self.g.plan.as_ref().and_then(|p| p.search.as_ref()) {
            Some(_) => self.timers.set(Timer::ImprovePlan(self.focus), now + SLICE_EVERY),
            None => self.timers.clear(Timer::ImprovePlan(self.focus)),
        }
    }
}

/// Whether `order` holds exactly the peers of `members`, each once.
fn same_members(order: &[PeerId], members: &[PeerId]) -> bool {
    let (mut a, mut b) = (order.to_vec(), members.to_vec());
    a.sort_unstable();
    b.sort_unstable();
    a == b && a.windows(2).all(|w| w[0] != w[1])
}

fn index(members: &[PeerId], p: PeerId) -> usize {
    members.iter().position(|m| *m == p).expect("a planned member")
}

/// The links as lines for the log.
fn describe(members: &[PeerId], links: &Links) -> String {
    let mut by_pair = BTreeMap::new();
    for (i, a) in members.iter().enumerate() {
        for (j, b) in members.iter().enumerate() {
            if let Some(l) = (i != j).then(|| links.get(i, j)).flatten() {
                by_pair.insert((a, b), l);
            }
        }
    }
    let lines: Vec<String> = by_pair
        .iter()
        .map(|((a, b), l)| {
            format!("  {a} -> {b}: {:.2} ms, {:.1} Mbit/s", l.rtt_us as f64 / 1e3, l.bytes_per_s as f64 * 8.0 / 1e6)
        })
        .collect();
    lines.join("\n")
}

impl Master {
    /// What a search may spend of `budget`: kicks at the configured effort (a fraction of it),
    /// and the time left on the driver's clock if it gave one.
    fn budget(&self, budget: Duration) -> Budget {
        let time = budget.mul_f64(self.config.search_effort.clamp(0.0, 1.0));
        Budget { time, deadline: self.config.search_clock.map(|clock| (clock, clock() + time)) }
    }
}

/// A search's budget: in kicks, and by the driver's clock if it has one.
struct Budget {
    time: Duration,
    /// The clock, and when the search must end by it.
    deadline: Option<(fn() -> Instant, Instant)>,
}

impl Budget {
    /// The kicks a search over `n` members makes within it on the machines measured.
    fn kicks(&self, n: usize) -> u64 {
        kicks_within(n, self.time)
    }

    /// Whether the clock leaves time for another kick.
    fn go_on(&self) -> bool {
        self.deadline.is_none_or(|(clock, end)| clock() < end)
    }
}
