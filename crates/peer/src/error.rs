//! The peer library's error type.

use crate::named::Described;
use shoal_engine::Malformed;
use shoal_proto::peer::OpId;
use shoal_wire::{Api, Misuse, PeerId, Reason};
use std::time::Duration;

/// Everything a communicator call can fail with. The Python layer maps each variant to an
/// exception class (see `docs/errors.md`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// API misuse: the call needs a connected communicator.
    #[error("the communicator is not connected: call connect() first")]
    NotConnected,
    /// API misuse: `connect` was called twice.
    #[error("the communicator is already connected")]
    AlreadyConnected,
    /// API misuse: the communicator was closed.
    #[error("the communicator is closed")]
    Closed,
    /// API misuse across peers: they made calls that can never complete together (one ran a
    /// collective while another voted to change the topology), each named with its peers. Every
    /// such call fails; nothing is lost.
    #[error("usage error: {0}")]
    Misuse(Misuse),
    /// API misuse of this communicator, or buffers a member found unfit for its group; nothing is
    /// lost.
    #[error("usage error: {0}")]
    Usage(Usage),
    /// API misuse: an argument is unusable; nothing was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The master cannot be reached, or stopped answering.
    #[error("master {addr} unreachable: {reason}")]
    MasterUnreachable {
        /// The master's address.
        addr: String,
        /// What went wrong.
        reason: String,
    },
    /// The master refused this peer's proof of the run's secret (wrong, or none where the run
    /// has one).
    #[error("the master refused this peer's credentials: {reason}")]
    Authentication {
        /// The master's reason.
        reason: String,
    },
    /// The master expelled this peer; it must connect again as a new peer.
    #[error("expelled from the run by the master: {reason}")]
    Kicked {
        /// The master's reason.
        reason: String,
    },
    /// A peer taking part in the operation was lost; the operation can be retried.
    #[error("lost {peer} during {operation}: {reason}")]
    PeerLost {
        /// The lost peer.
        peer: PeerId,
        /// The operation that failed.
        operation: &'static str,
        /// What was observed.
        reason: String,
    },
    /// The connection to the master broke during a call that counts on the master (a vote, a
    /// sync); the peer dials it again, as a master restarted from its state directory expects.
    /// What the call did is lost with the master: call again (retryable, like
    /// [`Error::PeerLost`]).
    #[error("{operation} interrupted: {reason}")]
    MasterInterrupted {
        /// The call.
        operation: &'static str,
        /// What happened.
        reason: String,
    },
    /// A shared-state sync ended without effect: every participant gets this error.
    #[error("sync_shared_state failed: {reason}")]
    SyncFailed {
        /// Calling again can succeed (a participant was lost); otherwise the calls do not fit
        /// together (different tensors, revisions or strategies).
        retryable: bool,
        /// Why.
        reason: String,
    },
    /// Fewer peers than required were accepted within the bound.
    #[error("only {have} of the {want} peers required were accepted within {:.1} s", after.as_secs_f64())]
    TooFewPeers {
        /// Accepted peers at the deadline.
        have: usize,
        /// Peers required.
        want: usize,
        /// The bound.
        after: Duration,
    },
    /// A collective with a deadline ran without this peer: it had not called it in time. Nothing
    /// was done here (the buffer is as it was) and the peer is a member still; its next call
    /// meets the others' next (`docs/protocol.md`, "Collectives with a deadline").
    #[error(
        "{operation} (collective {sequence} of topology {topology}) ran without this peer, which had not called it \
         by its deadline: it ran among ranks {included:?}; nothing was done here"
    )]
    Excluded {
        /// The call.
        operation: &'static str,
        /// The topology it ran in.
        topology: u64,
        /// Its number there.
        sequence: u64,
        /// The ranks it ran among.
        included: Vec<usize>,
        /// How many later collectives this peer heard the others run already: its next calls
        /// of that many are left out at once (a recipe skips ahead through them).
        ahead: u64,
        /// Whether peers waited to join when the master decided it, as [`crate::Info::peers_pending`]
        /// says to the members that took part.
        peers_pending: bool,
    },
    /// The operation did not finish within its bound.
    #[error("{operation} did not finish within {:.1} s", after.as_secs_f64())]
    Timeout {
        /// The operation.
        operation: &'static str,
        /// The bound.
        after: Duration,
    },
    /// Peers called different collectives (count, dtype, op, tag or kind differ), or the two
    /// ends of a tagged transfer differ (count or dtype).
    #[error("collective mismatch: we called {ours}; {}", called(.theirs))]
    CollectiveMismatch {
        /// A peer whose call differs from its neighbour's.
        peer: PeerId,
        /// Our call.
        ours: Described,
        /// The calls that differ, each with its peer: the other's, or both where another member
        /// found the difference.
        theirs: Vec<(PeerId, Described)>,
    },
    /// Another party broke the protocol (malformed bytes, an answer that does not fit the call).
    #[error("protocol error: {0}")]
    Protocol(Protocol),
    /// A `SHOAL_*` variable is invalid.
    #[error(transparent)]
    Config(#[from] shoal_config::ConfigError),
    /// A local socket operation failed (for example binding the listen address).
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// A short name of what went wrong, for counters and metrics: `"peer_lost"`, `"timeout"`,
    /// `"mismatch"`, ...
    pub fn cause(&self) -> &'static str {
        match self {
            Error::NotConnected | Error::AlreadyConnected | Error::Closed | Error::Misuse(_) | Error::Usage(_) => {
                "misuse"
            }
            Error::InvalidArgument(_) => "invalid_argument",
            Error::MasterUnreachable { .. } => "master_unreachable",
            Error::Authentication { .. } => "authentication",
            Error::Kicked { .. } => "kicked",
            Error::PeerLost { .. } => "peer_lost",
            Error::MasterInterrupted { .. } => "master_interrupted",
            Error::SyncFailed { .. } => "sync_failed",
            Error::TooFewPeers { .. } => "too_few_peers",
            Error::Timeout { .. } => "timeout",
            Error::Excluded { .. } => "excluded",
            Error::CollectiveMismatch { .. } => "mismatch",
            Error::Protocol(_) => "protocol",
            Error::Config(_) => "config",
            Error::Io { .. } => "io",
        }
    }
}

/// How a call misused this communicator ([`Error::Usage`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Usage {
    /// `.0` was called while another call of this communicator was in progress.
    #[error("{0} called while another call of this communicator is in progress")]
    Busy(Api),
    /// A collective under a tag that another in flight (not waited for yet) uses.
    #[error("{call} with tag {tag} called while another with that tag is in flight (not waited for yet)")]
    TagInFlight {
        /// The call.
        call: &'static str,
        /// Its tag.
        tag: u64,
    },
    /// A collective's buffers do not fit its group: every member fails it alike.
    #[error(transparent)]
    Misfit(#[from] Misfit),
    /// Member `peer`'s buffers did not fit the group, and it failed the collective for every member.
    #[error("{peer}: {reason}")]
    MemberMisfit {
        /// The member.
        peer: PeerId,
        /// What it found.
        reason: Reason,
    },
    /// An operation was waited for again, after it failed.
    #[error("this {what} was waited for already, and failed: {failed}")]
    WaitedAgain {
        /// What was waited for (a collective, a vote).
        what: &'static str,
        /// How it failed.
        failed: String,
    },
    /// A transfer named a rank the group in force does not have, or this member's own: most
    /// often the group changed since the caller chose the rank (a member lost, ranks moved up),
    /// which a retry with that rank does not mend.
    #[error(
        "{call} with rank {rank}, {}: the group in force (topology {epoch}) has ranks 0..{world} (did it change \
         since the rank was chosen?)",
        if *ours { "this member's own" } else { "which it does not have" }
    )]
    RankUnfit {
        /// The call.
        call: &'static str,
        /// The rank it named.
        rank: usize,
        /// Whether that is the caller's own rank.
        ours: bool,
        /// The members of the group in force.
        world: usize,
        /// The topology in force.
        epoch: u64,
    },
    /// The master refused this newcomer's catch-up: its tensors are not its group's.
    #[error("{0}")]
    CatchUpRefused(String),
}

/// How another party broke the protocol ([`Error::Protocol`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Protocol {
    /// Member `peer` sent bytes that are no frame of an operation here.
    #[error("from {peer}: {what}")]
    Malformed {
        /// The member.
        peer: PeerId,
        /// What it sent.
        what: Malformed,
    },
    /// A call that is no collective was ended by the master's abort of collective `op`, which
    /// only a collective's call gets.
    #[error("{call} ended by an abort of {op}: {reason}")]
    Aborted {
        /// The call.
        call: &'static str,
        /// The collective.
        op: OpId,
        /// Why the master aborted it.
        reason: Reason,
    },
    /// A call that is no collective was ended by collective `op`, unconfirmed.
    #[error("{call} ended by {op}")]
    Unconfirmed {
        /// The call.
        call: &'static str,
        /// The collective.
        op: OpId,
    },
    /// The master's catch-up plan has `plan` entries for this peer's `state` tensors.
    #[error("a catch-up plan of {plan} tensors for {state}")]
    PlanMisfit {
        /// Entries in the plan.
        plan: usize,
        /// Tensors of the state.
        state: usize,
    },
}

impl From<Protocol> for Error {
    fn from(protocol: Protocol) -> Self {
        Error::Protocol(protocol)
    }
}

/// How a collective's buffers do not fit its group.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Misfit {
    /// A broadcast's root is not a member.
    #[error("{kind} from root {root} in a group of {world}")]
    NoSuchRoot {
        /// The collective.
        kind: &'static str,
        /// The root asked for.
        root: usize,
        /// The group's size.
        world: usize,
    },
    /// An all-gather's output (a reduce-scatter's input) is not `world` blocks of the other buffer.
    #[error(
        "{kind}'s {what} holds {whole} bytes, not {world} blocks of {block} bytes: the group has {world} member{}",
        if *world == 1 { "" } else { "s" }
    )]
    Blocks {
        /// The collective.
        kind: &'static str,
        /// The buffer that holds the blocks: `output` or `input`.
        what: &'static str,
        /// Its bytes.
        whole: usize,
        /// The group's size.
        world: usize,
        /// Bytes of the other buffer: one block.
        block: usize,
    },
}

impl From<Usage> for Error {
    fn from(usage: Usage) -> Self {
        Error::Usage(usage)
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `calls` as "p1 called x; p2 called y".
fn called(calls: &[(PeerId, Described)]) -> String {
    let each: Vec<String> = calls.iter().map(|(peer, call)| format!("{peer} called {call}")).collect();
    each.join("; ")
}
