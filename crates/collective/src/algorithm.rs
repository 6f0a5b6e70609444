//! How a collective moves its data: the [`Algorithm`]s, and the schedule each builds for a
//! rank. The schedules' vocabulary is `schedule.rs`; each algorithm's steps are its own file.

use crate::schedule::Schedule;
use crate::CollectiveKind;

/// How an all-reduce moves its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Reduce-scatter then all-gather around the ring ([`crate::ring`]): bandwidth-optimal.
    Ring,
    /// Every rank's buffer to every other ([`crate::oneshot`]): one round trip.
    OneShot,
    /// Every block straight to its owner, then every owner's result straight to every other
    /// ([`crate::twoshot`]): two hops, the ring's bytes.
    TwoShot,
    /// Within each host along a chain, between hosts around a ring of one leader per host
    /// ([`crate::hier`]): only leaders cross hosts.
    Hierarchical,
    /// Recursive doubling ([`crate::doubling`]): `log2 n` rounds of whole-buffer exchanges with
    /// one partner each, for small buffers in large groups.
    Doubling,
    /// One-shot within each site to its leader, among the leaders, and back down
    /// ([`crate::twolevel`]): small buffers in large groups spread over sites.
    TwoLevel,
    /// Straight from one member to another: a tagged point-to-point send and receive. It runs
    /// no collective.
    Direct,
    /// A tagged point-to-point transfer the receiver read straight out of the sender's memory
    /// (both on one host): one copy. It runs no collective, and no frame names it.
    SingleCopy,
}

impl Algorithm {
    /// Every algorithm of collectives.
    pub const ALL: [Algorithm; 6] = [
        Algorithm::Ring,
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::Hierarchical,
        Algorithm::Doubling,
        Algorithm::TwoLevel,
    ];

    /// Wire code.
    pub fn code(self) -> u8 {
        match self {
            Algorithm::Ring => 1,
            Algorithm::OneShot => 2,
            Algorithm::TwoShot => 3,
            Algorithm::Direct => 4,
            Algorithm::Hierarchical => 5,
            Algorithm::SingleCopy => 6,
            Algorithm::Doubling => 7,
            Algorithm::TwoLevel => 8,
        }
    }

    /// The algorithm of wire code `code`.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.code() == code)
    }

    /// Name for the API, errors and logs.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::OneShot => "oneshot",
            Algorithm::TwoShot => "twoshot",
            Algorithm::Direct => "direct",
            Algorithm::Hierarchical => "hierarchical",
            Algorithm::SingleCopy => "single_copy",
            Algorithm::Doubling => "doubling",
            Algorithm::TwoLevel => "twolevel",
        }
    }

    /// The algorithm called `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    /// Whether it runs collectives of `kind`.
    pub fn runs(self, kind: CollectiveKind) -> bool {
        if matches!(self, Algorithm::Direct | Algorithm::SingleCopy) {
            return false;
        }
        match kind {
            CollectiveKind::AllReduce => true,
            CollectiveKind::Broadcast => matches!(self, Algorithm::Ring | Algorithm::OneShot),
            CollectiveKind::AllGather | CollectiveKind::ReduceScatter => self == Algorithm::Ring,
            CollectiveKind::Barrier => self == Algorithm::OneShot,
        }
    }

    /// The schedule of `rank` among `world` ranks for a collective of `kind` over a buffer of
    /// `len` elements (all-gather and reduce-scatter: `world` blocks of `len / world`), from
    /// `root` for a broadcast, in chunks of at most `chunk_elems` elements. `hosts` places each
    /// rank on a host or site, for the hierarchical and two-level all-reduces (empty: each on its
    /// own).
    ///
    /// # Panics
    /// If the algorithm does not run `kind` ([`Algorithm::runs`]).
    pub fn schedule(
        self,
        kind: CollectiveKind,
        (rank, world): (usize, usize),
        hosts: &[usize],
        len: usize,
        root: usize,
        chunk_elems: usize,
    ) -> Schedule {
        assert!(self.runs(kind), "{} does not run {}", self.name(), kind.name());
        match (kind, self) {
            (_, Algorithm::Direct | Algorithm::SingleCopy) => unreachable!("asserted above"),
            (CollectiveKind::AllReduce, Algorithm::Ring) => crate::ring::all_reduce(rank, world, len, chunk_elems),
            (CollectiveKind::AllReduce, Algorithm::OneShot) => {
                crate::oneshot::all_reduce(rank, world, len, chunk_elems)
            }
            (CollectiveKind::AllReduce, Algorithm::TwoShot) => {
                crate::twoshot::all_reduce(rank, world, len, chunk_elems)
            }
            (CollectiveKind::AllReduce, Algorithm::Hierarchical) => {
                crate::hier::all_reduce(rank, world, hosts, len, chunk_elems)
            }
            (CollectiveKind::AllReduce, Algorithm::Doubling) => {
                crate::doubling::all_reduce(rank, world, len, chunk_elems)
            }
            (CollectiveKind::AllReduce, Algorithm::TwoLevel) => {
                crate::twolevel::all_reduce(rank, world, hosts, len, chunk_elems)
            }
            (CollectiveKind::AllGather, _) => crate::ring::all_gather(rank, world, len / world, chunk_elems),
            (CollectiveKind::ReduceScatter, _) => crate::ring::reduce_scatter(rank, world, len / world, chunk_elems),
            (CollectiveKind::Broadcast, Algorithm::Ring) => crate::ring::broadcast(rank, world, root, len, chunk_elems),
            (CollectiveKind::Broadcast, _) => crate::oneshot::broadcast(rank, world, root, len, chunk_elems),
            // Each member's byte (see `CollectiveKind::Barrier`) straight to every other.
            (CollectiveKind::Barrier, _) => crate::oneshot::all_reduce(rank, world, len, chunk_elems),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::testing::all_reduce_differs;
    use crate::ReduceOp;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        /// Every algorithm's all-reduce, in every interleaving its dependencies allow.
        #[test]
        fn every_algorithm_matches_a_naive_reduction(
            algorithm in prop::sample::select(Algorithm::ALL.to_vec()),
            world in 1usize..=8,
            len in 0usize..40,
            chunk in 1usize..9,
            op in prop::sample::select(ReduceOp::ALL.to_vec()),
            seed in any::<u64>(),
        ) {
            let plan = |rank, world, len, chunk| algorithm.schedule(CollectiveKind::AllReduce, (rank, world), &[], len, 0, chunk);
            prop_assert_eq!(all_reduce_differs(plan, (world, len, chunk), op, seed), None);
        }
    }
}
