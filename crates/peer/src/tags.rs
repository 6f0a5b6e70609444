//! The tags the library keeps for its own transfers and collectives (`optimize_topology`'s,
//! `split`'s).

/// Tags from here up are the library's own; applications' transfers use those below.
pub const PROBE_TAGS: u64 = 1 << 63;
/// The tags of the collectives around the measurement: the barrier that starts it and the gather
/// that shares every member's row.
pub(crate) const BARRIER_TAG: u64 = u64::MAX - 1;
pub(crate) const GATHER_TAG: u64 = u64::MAX;
/// The tag of the all-gather that derives groups (`Communicator::split`).
pub(crate) const SPLIT_TAG: u64 = u64::MAX - 2;
