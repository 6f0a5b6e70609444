//! shoal's peer library: a [`Communicator`] joins a run through the master, is admitted by the
//! accepted peers' vote, and runs collectives peer to peer over TCP.
//!
//! Every protocol decision is made by `shoal_proto::peer::Peer`, a sans-IO state machine (the
//! same one `crates/sim` tests through thousands of faulty runs); the schedules and kernels live
//! in `shoal-collective`. This crate drives them with sockets and threads: one feeds the state
//! machine the master's messages, one the passing of time, one accepts data connections. Calls
//! run on the caller's thread, which carries out the state machine's actions and drives every
//! data stream with non-blocking IO.
//!
//! A panic is a bug, but it must not turn every later call into another panic: every lock is
//! taken with `unwrap_or_else(PoisonError::into_inner)`, so a lock a panic left poisoned still
//! serves (each holder leaves its state consistent before any call that can fail).
#![warn(missing_docs)]
#![deny(unsafe_code)]

mod catchup;
mod closer;
mod communicator;
mod config;
mod control;
mod deadline;
mod driver;
mod error;
mod fetch;
mod groups;
mod info;
mod links;
mod named;
mod plane;
mod stats;
mod sync;
mod tags;
mod topology;
mod transfer;

pub use catchup::{CatchUpInfo, CatchUpProgress};
pub use communicator::{Communicator, Vote, Work};
pub use config::{
    CommunicatorConfig, DEFAULT_CHUNK_BYTES, DEFAULT_CONNECTIONS, DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_TIMEOUT,
    DEFAULT_TIMEOUT_FLOOR, MAX_CONNECTIONS,
};
pub use deadline::Deadline;
pub use error::{Error, Misfit, Protocol, Result, Usage};
pub use fetch::StateTensor;
pub use info::{Info, LinkInfo, STRAGGLER_FLOOR};
pub use named::Described;
pub use shoal_collective::Algorithm;
pub use shoal_collective::{DType, Format, Quantization, ReduceOp};
pub use shoal_engine::Malformed;
pub use shoal_proto::master::Strategy;
pub use shoal_proto::peer::Cutoff;
pub use shoal_topology::Link;
pub use shoal_wire::{
    Api, Call, Called, LinkReport, Misuse, OpCounters, PeerId, PeerReport, Point, RunningOp, DURATION_BOUNDS_US,
};
pub use sync::SyncInfo;
pub use tags::PROBE_TAGS;
