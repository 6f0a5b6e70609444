//! A deterministic simulation of shoal's protocol.
//!
//! The master is the real [`shoal_proto::master::Master`], and each peer is the real
//! [`shoal_proto::peer::Peer`], the state machine `crates/peer` ships: every decision a peer makes
//! (joining re-formed topologies before every call, numbering collectives, when a collective stops,
//! reporting failures and asking for verdicts, retrying refused votes, heartbeats, declaring a
//! silent master lost) is the shipped code's. So is every byte of data: each peer's data plane is
//! the engine `crates/peer` ships ([`shoal_engine::Exec`]: the real schedules, folding,
//! confirmation lap and backups), driven as `crates/peer` drives it, over simulated connections
//! whose bytes the seeded network carries in pieces (`net.rs`). Every collective and algorithm
//! runs in turn (all-reduce around the ring, one-shot, two-shot, hierarchical and by doubling,
//! three of them quantized to bf16 and int8, all-gather, reduce-scatter, broadcast around the ring and one-shot
//! from a root that varies; one element per block or segment, values summed), several at once
//! where the seed batches them, in group 0 or another, among 2 to 5 peers and in one run of 1000
//! among 8 to 64. In half the runs every batch also exchanges tagged transfers around the ring
//! (`isend` to the next rank, `recv` from the one before, posted with its first collective and
//! waited for after its collectives), on the shipped engine, their bookkeeping the shipped
//! [`shoal_proto::peer::Transfers`]. What it models: opening a topology's connections (dialing a
//! dead peer fails) and fetching shared state (which fails from a dead donor). The seed
//! picks the application's loop for every peer: the README's (`update_topology` after a failure),
//! retry-only, or PCCL's (`peers_pending` at the top of every iteration; a newcomer starts there),
//! and whether every iteration syncs its shared state before its collective, as the README's
//! does (the state's revision counts the collectives; a newcomer fetches it). A seeded network carries every message with random
//! latency, first-in first-out per connection, and injects faults: crashes, freezes (SIGSTOP),
//! stalled links (a cut-off path), connection resets, and newcomers joining mid-operation.
//!
//! Checked after every run ([`check`]):
//! - **agreement**: for every collective, every participant still in the run at the end returned
//!   the same outcome, and every success holds what its collective makes of exactly the
//!   participants' inputs (their sum; the inputs in rank order; its own block's sum; the root's;
//!   a quantized sum within 5% of the exact one, and bit-identical on every member);
//! - **restored buffers**: every collective that failed left its buffer exactly as it was;
//! - **transfers**: every received buffer holds what its sender sent, and no transfer ends in a
//!   usage error, nor at its bound unless a peer was cut off (a transfer has no agreement: the two
//!   ends may see it end apart, and the loop goes on whatever they saw);
//! - **bounded calls**: no call outlived its bound (the model enforces bounds and records any
//!   call that ends by its deadline; a timeout is allowed only where a peer was cut off), and no
//!   collective, vote or `peers_pending` ran to its whole bound in a run without a frozen or
//!   cut-off peer;
//! - **one major operation at a time**: the master never tracks a collective of a replaced ring,
//!   and never issues a topology while a member of the current ring still runs a collective it
//!   could complete;
//! - **calls in step**: no call ends in a usage error (the application's calls are the same on
//!   every peer, so only the protocol could put them out of step);
//! - **convergence**: once faults stop, the committed ring is exactly the live peers, and every
//!   one of them is in it.
//!
//! [`run_calls`] scripts one more scenario: three live peers, one makes one call, the other two
//! another that cannot complete with it (every pair of `all_reduce`, `barrier`, `peers_pending`,
//! `update_topology`, `sync_shared_state`, `optimize_topology` and tagged transfers around the
//! ring), in an order and with gaps the seed picks; [`check_calls`] has every call end at once with
//! the error naming the calls, and the matching all-reduce after them pass at the first try. The
//! waiters a call never serves are judged by [`shoal_proto::peer::Peer::judge_waiters`], as
//! `crates/peer`'s driver does.
//!
//! [`run_large`] runs one more: 1,000 peers (or any number past 64, where collectives are the ring
//! all-reduce over one element) join at once, one crashes, a newcomer joins; [`check`] holds it
//! to the same invariants, and its [`Large`] and [`MasterCost`] say how long the master took to
//! commit the topologies without the crashed member and with the newcomer (simulated time) and
//! what its handlers cost (real time).
//!
//! `run(seed)` is a pure function of the seed: a failing seed reproduces exactly.

mod model;
mod net;

pub use model::{
    check, check_calls, run, run_calls, run_large, Call, Large, MasterCost, Outcome, Report, Scripted, Violation,
};
