//! The WAN lab's delay program (see `docs/lab.md`).
//!
//! The kernel here has no `netem`, so added latency is made in user space: inside a lab host's
//! network namespace, iptables sends incoming packets to netfilter queues (`NFQUEUE`), one
//! queue per delay; [`run`] reads each packet's id from the queue, holds it for that queue's
//! delay and then accepts it. Nothing of the packet is copied to user space (metadata only),
//! large segments stay whole (`F_GSO`), and every queue is FIFO with one delay, so one batch
//! verdict releases everything that is due.
//!
//! Fail-open at every level: iptables rules use `--queue-bypass` (no reader, no delay), the
//! queues accept when full or when a notification cannot be delivered (`F_FAIL_OPEN`), and on
//! exit (its time-to-live, or an error) the program accepts what it still holds.
//!
//! One program serves a whole lab: it opens a queue socket inside each host's namespace (a
//! socket stays in the namespace it was made in) and waits on all of them at once, so a lab
//! of 64 hosts costs one process rather than 64.

pub mod msg;

#[cfg(target_os = "linux")]
mod queue;
#[cfg(target_os = "linux")]
pub use queue::{run, Stats};

use std::time::Duration;

/// One netfilter queue, the network namespace it is in, and the delay its packets get.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueDelay {
    /// A named namespace (`ip netns add NAME`, a file under `/run/netns`), or `None`: the
    /// caller's own.
    pub namespace: Option<String>,
    pub queue: u16,
    pub delay: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{context}: {source}")]
    Os { context: String, source: std::io::Error },
    #[error("the kernel refused {what} on queue {queue}: {source}")]
    Refused { what: &'static str, queue: u16, source: std::io::Error },
    #[error("queue {queue} is listed twice in {namespace}")]
    DuplicateQueue { queue: u16, namespace: String },
}
