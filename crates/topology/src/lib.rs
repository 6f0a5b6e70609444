//! Ring planning over measured links: which order of the members a ring should follow, and which
//! members share a site.
//!
//! A ring all-reduce sends every byte over every edge of its ring once per phase, so the order of
//! the members decides which links it crosses: a group spread over sites should cross each slow
//! link as few times as possible. [`Links`] holds what the peers measured (one-way rate and round
//! trip, per ordered pair); [`Costs`] turns that into the cost of each directed edge, and the
//! ring is a shortest Hamiltonian cycle over those costs: an asymmetric travelling-salesman
//! problem ([`atsp`]). [`sites`](mod@sites) groups members whose mutual round trip is short.
//!
//! Pure code: no IO, no threads, and time only where a caller passes a deadline.

pub mod atsp;
pub mod choice;
pub mod sites;

pub use atsp::{exact, kicks_within, lower_bound, solve, solve_while, tour_cost, Search, EXACT_MAX};
pub use choice::{limits, Limits, ONESHOT_WORLD_MAX};
pub use sites::{grouping_pays, sites};

/// What one peer measured of its link to another: its round trip and the rate its bytes reached
/// the other end at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Link {
    /// Round-trip time, microseconds.
    pub rtt_us: u32,
    /// Bytes per second from the measuring peer to the other.
    pub bytes_per_s: u64,
}

/// The bytes a ring step moves per edge in the cost model: one pipelined chunk's worth, so that a
/// link's round trip and its rate both count ([`Costs::from_links`]).
pub const NOMINAL_STEP_BYTES: u64 = 1 << 20;

/// Measured links between `n` members, by ordered pair; `None` where nothing was measured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Links {
    n: usize,
    links: Vec<Option<Link>>,
}

impl Links {
    /// `n` members, nothing measured.
    pub fn new(n: usize) -> Self {
        Links { n, links: vec![None; n * n] }
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether there are no members.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// What `from` measured towards `to`.
    pub fn get(&self, from: usize, to: usize) -> Option<Link> {
        self.links[from * self.n + to]
    }

    /// Records what `from` measured towards `to`.
    ///
    /// # Panics
    /// If either is out of range or they are the same member.
    pub fn set(&mut self, from: usize, to: usize, link: Link) {
        assert!(from < self.n && to < self.n && from != to, "link {from} -> {to} among {} members", self.n);
        self.links[from * self.n + to] = Some(link);
    }

    /// The slowest rate, in bytes per second, over the links `pairs` names, if every one was
    /// measured at a rate.
    pub fn slowest(&self, pairs: impl IntoIterator<Item = (usize, usize)>) -> Option<f64> {
        pairs.into_iter().try_fold(f64::INFINITY, |least, (a, b)| {
            let rate = self.get(a, b)?.bytes_per_s;
            (rate > 0).then(|| least.min(rate as f64))
        })
    }

    /// The same links among the members `keep` names, in that order.
    pub fn subset(&self, keep: &[usize]) -> Links {
        let mut sub = Links::new(keep.len());
        for (i, &a) in keep.iter().enumerate() {
            for (j, &b) in keep.iter().enumerate() {
                sub.links[i * keep.len() + j] = if i == j { None } else { self.get(a, b) };
            }
        }
        sub
    }
}

/// The edges of the ring `order`, from each member to the next, the closing one included.
pub fn ring_edges(order: &[usize]) -> impl Iterator<Item = (usize, usize)> + '_ {
    (0..order.len()).map(move |k| (order[k], order[(k + 1) % order.len()]))
}

/// The cost of every directed edge, in microseconds: what one ring step of
/// [`NOMINAL_STEP_BYTES`] takes over it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Costs {
    n: usize,
    cost: Vec<u64>,
}

impl Costs {
    /// Costs from explicit values, `cost[i * n + j]` for edge `i -> j` (the diagonal is ignored).
    ///
    /// # Panics
    /// If `cost` does not hold `n * n` values.
    pub fn new(n: usize, cost: Vec<u64>) -> Self {
        assert_eq!(cost.len(), n * n, "{} costs for {n} members", cost.len());
        Costs { n, cost }
    }

    /// Each measured edge costs half its round trip plus the time [`NOMINAL_STEP_BYTES`] take at
    /// its rate; an edge nobody measured costs ten times the dearest measured one (or a second),
    /// so a ring uses it only when it must.
    pub fn from_links(links: &Links) -> Self {
        let n = links.len();
        let measured = |l: Link| {
            let transfer = (NOMINAL_STEP_BYTES as u128 * 1_000_000 / l.bytes_per_s.max(1) as u128) as u64;
            u64::from(l.rtt_us) / 2 + transfer
        };
        let mut cost: Vec<Option<u64>> = Vec::with_capacity(n * n);
        for i in 0..n {
            for j in 0..n {
                cost.push(if i == j { Some(0) } else { links.get(i, j).map(measured) });
            }
        }
        let unknown = cost.iter().flatten().max().map_or(1_000_000, |&m| m.saturating_mul(10).max(1_000_000));
        Costs { n, cost: cost.into_iter().map(|c| c.unwrap_or(unknown)).collect() }
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether there are no members.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The cost of edge `from -> to`.
    #[inline]
    pub fn get(&self, from: usize, to: usize) -> u64 {
        self.cost[from * self.n + to]
    }
}
