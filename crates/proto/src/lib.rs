//! shoal's protocol logic as sans-IO state machines.
//!
//! [`master::Master`] decides membership: who is registered, who is accepted, which topology is
//! in force, and the votes (`update_topology`, `peers_pending`) that change or query it.
//! [`peer::Peer`] is a peer's side: every step of its calls, what it tells the master, and what
//! it asks of the thread that moves its data.
//!
//! Nothing here touches a socket, a thread or a clock: time arrives as an argument, output
//! leaves through `poll_output`, and the same inputs always give the same outputs. That is what
//! lets the drivers stay thin and the protocol be tested deterministically. `docs/protocol.md`
//! holds the state diagram and the message table.
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod auth;
pub mod ballot;
pub mod bounds;
pub mod loglimit;
pub mod master;
pub mod peer;

/// Where a test's time starts: the machines read no clock, but an `Instant` comes only from one.
#[cfg(test)]
#[allow(clippy::disallowed_methods)]
pub(crate) fn test_start() -> std::time::Instant {
    std::time::Instant::now()
}

/// `call`, made by the peers numbered `peers`: how a test names one side of a usage error.
#[cfg(test)]
pub(crate) fn made(peers: &[u32], call: shoal_wire::Call) -> shoal_wire::Called {
    shoal_wire::Called::new(peers.iter().map(|p| shoal_wire::PeerId(*p)), call)
}

/// The failure of collective `seq` of topology `epoch` whose calls differ: peer `ours` found its
/// count different from peer `theirs`'s (`ours` and `theirs` differ).
#[cfg(test)]
pub(crate) fn mismatched(epoch: u64, seq: u64, ours: u32, theirs: u32) -> shoal_wire::OpFailure {
    use shoal_wire::{Epoch, OpHeader, PeerId};
    let call = OpHeader {
        collective: 1,
        algorithm: 1,
        epoch: Epoch(epoch),
        derived: 0,
        seq,
        tag: 0,
        dtype: 9,
        op: 1,
        count: 10,
        root: 0,
        quantization: 0,
        block: 0,
    };
    let theirs = (PeerId(theirs), OpHeader { count: 11, ..call });
    shoal_wire::OpFailure::mismatch(shoal_wire::Mismatch::new((PeerId(ours), call), theirs))
}
