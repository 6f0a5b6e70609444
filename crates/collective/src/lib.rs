//! shoal's data plane as pure computation: element types, reduction operators and their kernels,
//! and the schedules that say which bytes each rank sends, receives and reduces at every step.
//!
//! Nothing here touches a socket, a thread or a clock. The peer library executes these schedules
//! over TCP; the tests here execute every rank's schedule in memory and compare with a naive
//! reduction. `docs/algorithms.md` describes each schedule and its bytes on the wire.
#![warn(missing_docs)]
#![deny(unsafe_code)]

mod algorithm;
pub mod doubling;
mod dtype;
pub mod hier;
mod kernels;
pub mod oneshot;
pub mod quant;
pub mod ring;
pub mod schedule;
pub mod twolevel;
pub mod twoshot;

pub use algorithm::Algorithm;
pub use dtype::{CollectiveKind, DType, ReduceOp};
pub use kernels::{finish_avg, reduce_into, KernelError};
pub use quant::{Codec, Format, QuantError, Quantization};
