//! What calls, links and measurements report: plain values every other module may hold.

use shoal_collective::Algorithm;
use shoal_topology::Link;
use shoal_wire::PeerId;
use std::time::Duration;

/// What a completed collective reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    /// Peers that took part.
    pub world_size: usize,
    /// Bytes this peer sent.
    pub tx_bytes: u64,
    /// Bytes this peer received.
    pub rx_bytes: u64,
    /// Wall time of the call.
    pub elapsed: Duration,
    /// The topology the collective ran in.
    pub topology: u64,
    /// The collective's number within its topology: with `topology`, it names the collective
    /// on every participant.
    pub sequence: u64,
    /// How it moved its data.
    pub algorithm: Algorithm,
    /// A tagged transfer: the member at the other end, by its rank in the group (for a receive
    /// from any member, the one whose send it took). `None` for a collective.
    pub peer: Option<usize>,
    /// How much later than the earliest member each member of the group called, by rank in the
    /// group (0 for the earliest): every member ended its part together, so a member that held
    /// the result sooner after its call called that much later (`docs/protocol.md`,
    /// "Stragglers"). The same figures on every member, to about a hop's latency. Empty where
    /// not measured: a transfer, a broadcast (whose root holds the result from its call), a
    /// group of one, or a collective whose lap did not finish (the master decided it).
    pub lateness: Vec<Duration>,
    /// Our own rank in the group: which of `lateness` is ours.
    pub rank: usize,
    /// The ranks in the group that took part: all of them, but for a collective with a deadline
    /// that left some out (`Communicator::all_reduce_with_deadline`). Empty for a transfer.
    pub included: Vec<usize>,
    /// For a collective with a deadline: whether peers waited to join when the master decided
    /// who takes part, what `peers_pending` would have answered then. Every member, left out or
    /// not, hears the same, so a loop can admit them at its next step without a vote of the
    /// whole group (which waits for a straggler). `None` for any other call.
    pub peers_pending: Option<bool>,
}

impl Info {
    /// The member that held the others up, by rank in the group: the latest to call, where it
    /// was at least [`STRAGGLER_FLOOR`] and a tenth of the earliest member's call late (two
    /// members a few microseconds apart hold nobody up).
    pub fn last(&self) -> Option<usize> {
        let (last, &late) = self.lateness.iter().enumerate().max_by_key(|(_, l)| **l)?;
        // The earliest member called this much before we did, and ended when we did.
        let earliest = self.elapsed + self.lateness[self.rank];
        (late >= STRAGGLER_FLOOR && late * 10 >= earliest).then_some(last)
    }
}

/// The least lateness that makes a member the one that held the others up ([`Info::last`]).
pub const STRAGGLER_FLOOR: Duration = Duration::from_millis(1);

/// A link to another member of our group in the topology in force, and what moved over it
/// ([`crate::Communicator::links`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    /// The member.
    pub peer: PeerId,
    /// Its rank in the group.
    pub rank: usize,
    /// Streams we send on.
    pub streams_out: usize,
    /// Streams we receive on.
    pub streams_in: usize,
    /// Chunk bytes sent to it in this topology.
    pub tx_bytes: u64,
    /// Chunk bytes received from it in this topology.
    pub rx_bytes: u64,
    /// How long, in this topology, some frame of ours to it waited for room in its stream (the
    /// link was saturated), and the bytes written meanwhile: their ratio is what the link
    /// carries, as the master watches it for drift (`docs/topology.md`).
    pub saturated: std::time::Duration,
    /// Bytes written to it, frame headers included, while it was saturated.
    pub saturated_bytes: u64,
    /// What carries the streams: `"shm"` (shared memory, a member on this host), `"tcp"`,
    /// `"tls"` (TCP with TLS), or `"mixed"` where the two ends chose differently
    /// (`SHOAL_TRANSPORT`).
    pub transport: &'static str,
    /// How its pools were opened: `"direct"`, each by its sender, or `"reverse"`, a member that
    /// cannot be dialed opened one itself for the other's data (`docs/nat.md`).
    pub path: &'static str,
    /// Whether the member can be dialed, as the master found when it joined.
    pub dialable: bool,
}

/// What the members of one ring measured of their links to each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Measurements {
    /// The members, in the order of the ring they were measured in.
    pub members: Vec<PeerId>,
    /// `links[i][j]`: what `members[i]` measured towards `members[j]`.
    pub links: Vec<Vec<Option<Link>>>,
    /// Whether some member grew a pool.
    pub grew: bool,
}
