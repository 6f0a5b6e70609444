//! shoal's peer library: a [`Communicator`] joins a run through the master, is admitted by the
//! accepted peers' vote, and runs collectives peer to peer over TCP.
//!
//! The protocol decisions live in `shoal-proto` (what the master's messages mean), the
//! schedules and kernels in `shoal-collective`; this crate drives them with sockets and
//! threads. Threads: one reads the master's messages, one sends heartbeats, one accepts data
//! connections. Collectives run on the caller's thread, which drives every data stream with
//! non-blocking IO.
//!
//! A panic is a bug, but it must not turn every later call into another panic: every lock is
//! taken with `unwrap_or_else(PoisonError::into_inner)`, so a lock a panic left poisoned still
//! serves (each holder leaves its state consistent before any call that can fail).
#![warn(missing_docs)]
#![deny(unsafe_code)]

mod communicator;
mod config;
mod control;
mod deadline;
mod error;
mod failpoint;
mod links;
mod ring;
mod sync;

pub use communicator::{Communicator, Info};
pub use config::{
    CommunicatorConfig, DEFAULT_CHUNK_BYTES, DEFAULT_CONNECTIONS, DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_TIMEOUT,
    MAX_CONNECTIONS,
};
pub use deadline::Deadline;
pub use error::{Error, Result};
pub use shoal_collective::{DType, ReduceOp};
pub use shoal_proto::master::Strategy;
pub use shoal_wire::PeerId;
pub use sync::{StateTensor, SyncInfo};
