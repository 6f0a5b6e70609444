//! Settings of a communicator: explicit values win over `SHOAL_*` variables, which win over
//! the defaults here.

use crate::error::Result;
use shoal_collective::Algorithm;
use shoal_collective::CollectiveKind;
use shoal_config::{env_count, env_seconds, env_value};
use shoal_engine::MAX_STASH_BYTES;
use shoal_wire::{AlgorithmLimits, MAX_STRING_BYTES};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// How a communicator joins a run and moves data.
#[derive(Debug, Clone)]
pub struct CommunicatorConfig {
    /// The master's `host:port`.
    pub master_addr: String,
    /// The peer group to run collectives in.
    pub group: u32,
    /// TCP connections per peer pair (`SHOAL_CONNECTIONS`); `None` chooses per peer (see
    /// [`CommunicatorConfig::pool_size`]), and `optimize_topology` grows a pool whose streams a
    /// window holds back.
    pub connections: Option<usize>,
    /// The most streams `optimize_topology` grows a pool to (`SHOAL_CONNECTIONS_MAX`).
    pub connections_max: usize,
    /// Local address to listen on for data connections (port 0: ephemeral).
    pub listen_addr: String,
    /// `host` or `host:port` other peers dial (`SHOAL_ADVERTISE_ADDR`); by default the local
    /// address of the connection to the master, with the listening port.
    pub advertise_addr: Option<String>,
    /// Largest chunk a schedule pipelines, in bytes (`SHOAL_CHUNK_BYTES`); `None`:
    /// [`DEFAULT_CHUNK_BYTES`]. Every member must have the same setting.
    pub chunk_bytes: Option<usize>,
    /// How long the master may stay silent before it is declared lost
    /// (`SHOAL_HEARTBEAT_TIMEOUT`). The master applies its own setting to peers.
    pub heartbeat_timeout: Duration,
    /// Bound on any blocking call (`SHOAL_TIMEOUT`).
    pub timeout: Duration,
    /// Where collectives' bounds follow how long the collectives of their kind and size took
    /// (`shoal_proto::bounds`: the median and five deviations of the last 64, once 8 ended): the
    /// least of them, the most being `timeout`. `None`, as `SHOAL_TIMEOUT` set makes it: every
    /// call's bound is `timeout`. By default [`DEFAULT_TIMEOUT_FLOOR`].
    pub timeout_floor: Option<Duration>,
    /// The run's secret (`SHOAL_SECRET`), proved to the master when joining; never sent.
    pub secret: Option<Vec<u8>>,
    /// Most collectives in flight at once (`SHOAL_MAX_IN_FLIGHT`); a call beyond waits for one to
    /// end.
    pub max_in_flight: usize,
    /// The all-reduce algorithm of every call that names none (`SHOAL_ALGO`); `None` chooses
    /// per call ([`CommunicatorConfig::algorithm_for`]).
    pub algorithm: Option<Algorithm>,
    /// Largest buffer, in bytes, that an all-reduce left to choose runs one-shot
    /// (`SHOAL_ONESHOT_MAX_BYTES`).
    pub oneshot_max_bytes: usize,
    /// Largest buffer, in bytes, that an all-reduce left to choose runs two-shot, above
    /// [`CommunicatorConfig::oneshot_max_bytes`], in a group that spans hosts
    /// (`SHOAL_TWOSHOT_MAX_BYTES`).
    pub twoshot_max_bytes: usize,
    /// Whether streams to a member on the same host (the same machine and network namespace)
    /// are shared-memory lanes (`SHOAL_TRANSPORT=auto`, the default) or TCP like every other
    /// (`SHOAL_TRANSPORT=tcp`, which keeps the network path testable on one host).
    pub shared_memory: bool,
    /// Most bytes one exchange of `optimize_topology`'s measurement sends each way
    /// (`SHOAL_PROBE_BYTES`): exchanges grow from 256 KiB until one lasts 30 round trips (past
    /// TCP's slow start) or reaches this.
    pub probe_bytes: usize,
    /// TLS for every connection, to the master and between peers (`SHOAL_TLS_CERT`,
    /// `SHOAL_TLS_KEY`, `SHOAL_TLS_CA`); `None` for plaintext.
    pub tls: Option<shoal_transport::TlsFiles>,
    /// Most bytes per second this peer serves newcomers catching up, all together
    /// (`SHOAL_CATCHUP_RATE`); `None`: as fast as the link goes.
    pub catchup_rate: Option<u64>,
    /// Most bytes of shared state this peer copies to serve newcomers catching up
    /// (`SHOAL_CATCHUP_MEMORY`): a larger state is not copied, and newcomers are repaired by the
    /// sync that admits them instead.
    pub catchup_memory: usize,
}

/// Default TCP connections to a peer on another host. Parallel streams get past per-flow
/// window limits and fair queuing on long paths.
pub const DEFAULT_CONNECTIONS: usize = 4;
/// Default for [`CommunicatorConfig::connections_max`]: as many as a pool may hold. A pool only
/// grows while its streams' windows hold them back (`optimize_topology`), doubling each time.
pub const DEFAULT_CONNECTIONS_MAX: usize = MAX_CONNECTIONS;
/// Default pipeline chunk. On one host, with 4 peers on 2 cores and the shared-memory rings
/// (`shm::RING_BYTES`) small enough to stay in the last-level cache, a 64 MiB all-reduce took
/// 82 ms against 98 ms with 1 MiB chunks and 4 MiB rings (over loopback TCP the chunk made no
/// difference). Across a window-bound WAN path the last chunks each ride one stream at that
/// stream's rate: in the lab's long-fat pipe (16 streams) a 64 MiB all-reduce took 612 ms
/// against 645 ms with 1 MiB chunks.
pub const DEFAULT_CHUNK_BYTES: usize = 256 << 10;
/// Default heartbeat timeout: long enough for a congested intercontinental path.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(15);
/// Default bound on a blocking call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// The least bound of a collective whose bound follows its kind's durations
/// ([`CommunicatorConfig::timeout_floor`]): a pause of a member's this long (a checkpoint, an
/// evaluation) is waited for; one longer may fail the collective, retryably, even if nothing
/// else went wrong.
pub const DEFAULT_TIMEOUT_FLOOR: Duration = Duration::from_secs(60);
/// Most connections per pair: each costs a socket pair, buffers and a descriptor on both ends.
/// A path whose windows hold back even 256 streams (a receive window of 32 KiB across 40 ms
/// carries 6.5 Mbit/s a stream, 256 of them 1.7 Gbit/s) wants larger windows, not more streams.
pub const MAX_CONNECTIONS: usize = 256;
/// Default for [`CommunicatorConfig::max_in_flight`].
pub const DEFAULT_MAX_IN_FLIGHT: usize = 64;
/// Most collectives in flight the setting allows: each holds its scratch and backup.
pub const MAX_IN_FLIGHT: usize = 1024;
/// Largest group on one host whose small all-reduces run one-shot; larger ones run by doubling,
/// whose `log2 n` rounds beat one-shot's `n²` messages and the ring's `2 (n - 1)` hops there
/// (loopback, 2 cores, 4 KiB: 8 peers 0.6 ms against one-shot's 0.5; 16 peers 1.3 against 1.9 and
/// the ring's 1.8; 64 peers 12 against 61 and 64). Across hosts doubling is not chosen: each of
/// its rounds costs a one-way delay there, and members cannot tell a LAN from a WAN before
/// `optimize_topology` measures (the lab's `world`, 16 peers, 4 KiB: one-shot 270 ms, doubling
/// 645 ms). Past this size across sites or hosts some of which hold several members, the
/// all-reduces that would run one-shot run two-level (the lab's `world`, 64 peers in five sites,
/// 4 KiB: 336 ms against one-shot's 1.04 s); otherwise one-shot stays.
pub use shoal_topology::ONESHOT_WORLD_MAX;
/// Default for [`CommunicatorConfig::oneshot_max_bytes`].
pub const DEFAULT_ONESHOT_MAX_BYTES: usize = 64 << 10;
/// Largest buffer an all-reduce between two members of one host runs one-shot (within
/// `SHOAL_ONESHOT_MAX_BYTES`): 2 peers over shared memory, one-shot is level with the ring at 4
/// and 8 KiB (within the noise, 12-16 µs either way) and about 1 µs faster at 64 B, but 16 KiB
/// took 18.8 against 17.8 µs and 64 KiB 39.6 against 33.0. Across hosts (loopback TCP standing
/// in) one-shot is ahead up to the general limit: 4 and 16 KiB 41 and 46 µs against 52 and 57,
/// 64 KiB 73 against 72.
pub const PAIR_ONESHOT_MAX_BYTES: usize = 8 << 10;
/// Default for [`CommunicatorConfig::twoshot_max_bytes`].
pub const DEFAULT_TWOSHOT_MAX_BYTES: usize = 4 << 20;
/// Default for [`CommunicatorConfig::probe_bytes`].
pub const DEFAULT_PROBE_BYTES: usize = 64 << 20;
/// Largest [`CommunicatorConfig::probe_bytes`]: two such buffers are allocated per round.
pub const MAX_PROBE_BYTES: usize = 1 << 30;
/// Default for [`CommunicatorConfig::catchup_memory`].
pub const DEFAULT_CATCHUP_MEMORY: usize = 8 << 30;
/// Smallest pipeline chunk: below this, per-chunk overhead dominates.
pub const MIN_CHUNK_BYTES: usize = 4096;

/// Whether the peer at `peer_addr` runs on this host, when we advertise `local_ip`: a loopback
/// address or our own. A name, or another address, is taken to be elsewhere.
pub(crate) fn on_this_host(local_ip: Option<IpAddr>, peer_addr: &str) -> bool {
    matches!(peer_addr.parse::<SocketAddr>(), Ok(a) if a.ip().is_loopback() || Some(a.ip()) == local_ip)
}

impl CommunicatorConfig {
    /// Defaults overridden by the environment.
    ///
    /// # Errors
    /// [`crate::Error::Config`] if a `SHOAL_*` variable is malformed.
    pub fn from_env(master_addr: &str) -> Result<Self> {
        let pinned = env_seconds("SHOAL_TIMEOUT")?;
        let config = CommunicatorConfig {
            master_addr: master_addr.to_string(),
            group: 0,
            connections: env_count("SHOAL_CONNECTIONS")?,
            connections_max: env_count("SHOAL_CONNECTIONS_MAX")?.unwrap_or(DEFAULT_CONNECTIONS_MAX),
            listen_addr: "0.0.0.0:0".to_string(),
            advertise_addr: env_value("SHOAL_ADVERTISE_ADDR"),
            chunk_bytes: env_count("SHOAL_CHUNK_BYTES")?,
            heartbeat_timeout: env_seconds("SHOAL_HEARTBEAT_TIMEOUT")?.unwrap_or(DEFAULT_HEARTBEAT_TIMEOUT),
            timeout: pinned.unwrap_or(DEFAULT_TIMEOUT),
            timeout_floor: pinned.is_none().then_some(DEFAULT_TIMEOUT_FLOOR),
            secret: env_value("SHOAL_SECRET").map(String::into_bytes),
            max_in_flight: env_count("SHOAL_MAX_IN_FLIGHT")?.unwrap_or(DEFAULT_MAX_IN_FLIGHT),
            algorithm: None,
            oneshot_max_bytes: env_count("SHOAL_ONESHOT_MAX_BYTES")?.unwrap_or(DEFAULT_ONESHOT_MAX_BYTES),
            twoshot_max_bytes: env_count("SHOAL_TWOSHOT_MAX_BYTES")?.unwrap_or(DEFAULT_TWOSHOT_MAX_BYTES),
            probe_bytes: env_count("SHOAL_PROBE_BYTES")?.unwrap_or(DEFAULT_PROBE_BYTES),
            tls: shoal_transport::TlsFiles::from_env()?,
            catchup_rate: env_count("SHOAL_CATCHUP_RATE")?.map(|r| r as u64),
            catchup_memory: env_count("SHOAL_CATCHUP_MEMORY")?.unwrap_or(DEFAULT_CATCHUP_MEMORY),
            shared_memory: match env_value("SHOAL_TRANSPORT").as_deref() {
                None | Some("auto") => true,
                Some("tcp") => false,
                Some(other) => {
                    let (name, value, expected) = ("SHOAL_TRANSPORT", other.to_string(), "auto or tcp");
                    return Err(shoal_config::ConfigError { name, value, expected }.into());
                }
            },
        };
        if let Some(name) = env_value("SHOAL_ALGO").filter(|a| a != "auto") {
            let Some(algorithm) = Algorithm::from_name(&name) else {
                let expected = "auto, ring, oneshot, twoshot, hierarchical, doubling or twolevel";
                return Err(shoal_config::ConfigError { name: "SHOAL_ALGO", value: name, expected }.into());
            };
            return Ok(CommunicatorConfig { algorithm: Some(algorithm), ..config });
        }
        Ok(config)
    }

    /// The algorithm of a collective of `kind` over `bytes` in a group of `world` members on
    /// `hosts` hosts, asked for `requested`: what it (or else
    /// [`CommunicatorConfig::algorithm`]) names; otherwise one-shot up to
    /// [`CommunicatorConfig::oneshot_max_bytes`] (between two members of one host, up to
    /// `PAIR_ONESHOT_MAX_BYTES`; an all-reduce in a group on one host of more than
    /// `ONESHOT_WORLD_MAX` by doubling instead; one across sites or hosts some of which hold
    /// several of its members, two-level), then two-shot up to
    /// [`CommunicatorConfig::twoshot_max_bytes`] where the group spans hosts; above, the
    /// hierarchical all-reduce where the group spans hosts and some share one, and where measured
    /// links say grouping pays ([`AlgorithmLimits::hierarchical`]) (only one leader
    /// per host crosses hosts: `2 (H - 1) / H` of the buffer for `H` hosts instead of the ring's
    /// `2 (n - 1) / n`, in fewer long hops), and the ring otherwise (loopback, 2 cores: one-shot
    /// takes 0.43× the ring's time at 4 KiB with 4 peers, 0.94× at 256 KiB). On one
    /// host a hop costs little and the ring's pipeline wins above one-shot's sizes (two-shot took
    /// 2.0× the ring's time at 1 MiB with 4 peers on loopback); across a WAN every hop costs a
    /// one-way delay (the lab's `two-sites`, 4 peers: two-shot 0.75× the ring's time at 1 MiB,
    /// 0.87× at 4 MiB). One-shot
    /// and two-shot keep the members' inputs aside: past [`MAX_STASH_BYTES`] of them, the ring
    /// runs whatever was asked, as it does where doubling's `log2 n + 2` buffers would not fit. Every
    /// member decides alike from the same settings; members whose settings differ may choose
    /// differently, which their first frame shows as a mismatch.
    ///
    /// All-gather and reduce-scatter run around the ring, a barrier one-shot; a broadcast
    /// chooses as an all-reduce (one-shot, or two-shot, straight from the root).
    pub fn algorithm_for(
        &self,
        kind: CollectiveKind,
        requested: Option<Algorithm>,
        bytes: usize,
        (world, hosts): (usize, usize),
        limits: Option<AlgorithmLimits>,
    ) -> Algorithm {
        let spans_hosts = hosts > 1;
        match kind {
            CollectiveKind::AllGather | CollectiveKind::ReduceScatter => return Algorithm::Ring,
            CollectiveKind::Barrier => return Algorithm::OneShot,
            CollectiveKind::AllReduce | CollectiveKind::Broadcast => {}
        }
        let oneshot_fits = bytes.saturating_mul(world) <= MAX_STASH_BYTES;
        // Between two members one-shot saves the ring's second hop for one more copy of the
        // buffer, which on one host weighs more than the hop past a few KiB.
        let oneshot_max = match (world, spans_hosts) {
            (2, false) => self.oneshot_max_bytes.min(PAIR_ONESHOT_MAX_BYTES),
            _ => self.oneshot_max_bytes,
        };
        // A small all-reduce in a large group spread over sites (or hosts) some of which hold
        // several members: one-shot within each and among their leaders, `2 (n - H) + H (H - 1)`
        // buffers for `H` sites where one-shot sends `n (n - 1)`; one-shot otherwise.
        let two_level_group = world > ONESHOT_WORLD_MAX && spans_hosts && hosts < world;
        let direct =
            if kind == CollectiveKind::AllReduce && two_level_group { Algorithm::TwoLevel } else { Algorithm::OneShot };
        // In such a group the master's one-shot limit is two-level's (`shoal_topology::limits`):
        // a broadcast there goes one-shot from its root only up to the settings' limit.
        let direct_max = |l: AlgorithmLimits| match kind {
            CollectiveKind::Broadcast if two_level_group => l.oneshot_max.min(oneshot_max as u64),
            _ => l.oneshot_max,
        };
        // Doubling keeps a buffer aside per round, and one more.
        let doubling_fits = bytes.saturating_mul(world.ilog2() as usize + 2) <= MAX_STASH_BYTES;
        let chosen = match requested.or(self.algorithm) {
            Some(Algorithm::OneShot | Algorithm::TwoShot | Algorithm::TwoLevel) if !oneshot_fits => Algorithm::Ring,
            Some(Algorithm::Doubling) if !doubling_fits => Algorithm::Ring,
            Some(algorithm) => algorithm,
            // The master's limits from measured links (a group across a WAN): what its cost
            // model says is fastest, between two members too; in a large group spread over
            // sites, one-shot within each and among their leaders.
            None if limits.is_some_and(|l| bytes as u64 <= direct_max(l)) && oneshot_fits => direct,
            None if limits.is_some_and(|l| bytes as u64 <= l.twoshot_max) && world > 2 && oneshot_fits => {
                Algorithm::TwoShot
            }
            None if !spans_hosts
                && world > ONESHOT_WORLD_MAX
                && bytes <= oneshot_max
                && kind == CollectiveKind::AllReduce =>
            {
                Algorithm::Doubling
            }
            None if limits.is_none() && world > 1 && bytes <= oneshot_max && oneshot_fits => direct,
            None if limits.is_none() && spans_hosts && world > 2 && bytes <= self.twoshot_max_bytes && oneshot_fits => {
                Algorithm::TwoShot
            }
            None if spans_hosts && hosts < world && limits.is_none_or(|l| l.hierarchical) => Algorithm::Hierarchical,
            None => Algorithm::Ring,
        };
        // A broadcast has no two-shot form: the ring's pipeline moves it as fast.
        if chosen.runs(kind) {
            chosen
        } else {
            Algorithm::Ring
        }
    }

    /// How many streams to open to a peer at `peer_addr`, when we advertise `local_ip`: the
    /// configured number if there is one; otherwise one stream to a peer on this host (nothing
    /// limits a single flow there, and every extra stream costs CPU: 4 peers on 2 cores ran a
    /// 16 MiB all-reduce in 26 ms on one stream per pair and 46 ms on four), and
    /// [`DEFAULT_CONNECTIONS`] to a peer elsewhere.
    pub fn pool_size(&self, local_ip: Option<IpAddr>, peer_addr: &str) -> usize {
        if let Some(n) = self.connections {
            return n;
        }
        if on_this_host(local_ip, peer_addr) {
            1
        } else {
            DEFAULT_CONNECTIONS
        }
    }

    /// Checks ranges.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] naming the setting.
    pub fn validate(&self) -> Result<()> {
        let bad = |s: String| Err(crate::Error::InvalidArgument(s));
        if let Some(n) = self.connections.filter(|n| !(1..=MAX_CONNECTIONS).contains(n)) {
            return bad(format!("connections={n} outside 1..={MAX_CONNECTIONS}"));
        }
        if !(1..=MAX_CONNECTIONS).contains(&self.connections_max) {
            return bad(format!("connections_max={} outside 1..={MAX_CONNECTIONS}", self.connections_max));
        }
        if !(1..=MAX_IN_FLIGHT).contains(&self.max_in_flight) {
            return bad(format!("max_in_flight={} outside 1..={MAX_IN_FLIGHT}", self.max_in_flight));
        }
        if let Some(n) = self.chunk_bytes.filter(|&n| n < MIN_CHUNK_BYTES) {
            return bad(format!("chunk_bytes={n} below {MIN_CHUNK_BYTES}"));
        }
        if !(1..=MAX_PROBE_BYTES).contains(&self.probe_bytes) {
            return bad(format!("probe_bytes={} outside 1..={MAX_PROBE_BYTES}", self.probe_bytes));
        }
        if self.heartbeat_timeout.is_zero() || self.timeout.is_zero() {
            return bad("timeouts must be positive".into());
        }
        if self.secret.as_ref().is_some_and(Vec::is_empty) {
            return bad("secret is empty".into());
        }
        // Sent to the master and every peer as is (with ":port" where it has none): it must fit
        // a message's string, or the join would fail after binding and dialing.
        if let Some(addr) = self.advertise_addr.as_ref().filter(|a| a.len() + ":65535".len() > MAX_STRING_BYTES) {
            let head = shoal_wire::truncate(addr.clone(), 32);
            return bad(format!(
                "advertise_addr {head:?}... is {} bytes; at most {} (with its port)",
                addr.len(),
                MAX_STRING_BYTES
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_buffers_run_one_shot_unless_asked_otherwise() {
        let mut c = CommunicatorConfig::from_env("127.0.0.1:1").unwrap();
        c.algorithm = None;
        let small = c.oneshot_max_bytes;
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, small, (3, 3), None), Algorithm::OneShot);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, small + 1, (3, 3), None), Algorithm::TwoShot);
        assert_eq!(
            c.algorithm_for(CollectiveKind::AllReduce, None, small + 1, (3, 1), None),
            Algorithm::Ring,
            "one host"
        );
        assert_eq!(
            c.algorithm_for(CollectiveKind::AllReduce, None, c.twoshot_max_bytes + 1, (3, 3), None),
            Algorithm::Ring
        );
        // Two members: across hosts as three; on one host only the smallest.
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, small, (2, 2), None), Algorithm::OneShot);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, small + 1, (2, 2), None), Algorithm::Ring);
        let pair = PAIR_ONESHOT_MAX_BYTES;
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, pair, (2, 1), None), Algorithm::OneShot);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, pair + 1, (2, 1), None), Algorithm::Ring);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, 8, (1, 1), None), Algorithm::Ring);
        // Past ONESHOT_WORLD_MAX members on one host, one-shot's all-reduces run by doubling; not
        // across hosts, not a broadcast, and not where the buffers aside would not fit.
        let many = (ONESHOT_WORLD_MAX + 1, 1);
        assert_eq!(
            c.algorithm_for(CollectiveKind::AllReduce, None, small, (ONESHOT_WORLD_MAX, 1), None),
            Algorithm::OneShot
        );
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, small, many, None), Algorithm::Doubling);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, small, (64, 64), None), Algorithm::OneShot);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, small + 1, many, None), Algorithm::Ring);
        assert_eq!(c.algorithm_for(CollectiveKind::Broadcast, None, small, many, None), Algorithm::OneShot);
        let huge = MAX_STASH_BYTES / 4;
        assert_eq!(
            c.algorithm_for(CollectiveKind::AllReduce, Some(Algorithm::Doubling), huge, many, None),
            Algorithm::Ring
        );
        assert_eq!(
            c.algorithm_for(CollectiveKind::AllReduce, Some(Algorithm::Doubling), small, (3, 3), None),
            Algorithm::Doubling
        );
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, Some(Algorithm::Ring), 8, (8, 8), None), Algorithm::Ring);
        assert_eq!(
            c.algorithm_for(CollectiveKind::AllReduce, Some(Algorithm::OneShot), 8, (2, 2), None),
            Algorithm::OneShot
        );
        // Asked for one-shot, a buffer whose copies would not fit runs around the ring.
        assert_eq!(
            c.algorithm_for(CollectiveKind::AllReduce, Some(Algorithm::OneShot), MAX_STASH_BYTES / 4 + 1, (4, 4), None),
            Algorithm::Ring
        );
        assert_eq!(c.algorithm_for(CollectiveKind::Broadcast, None, small + 1, (3, 3), None), Algorithm::Ring);
        // Large buffers across hosts that some members share: hierarchical, all-reduce only.
        let large = c.twoshot_max_bytes + 1;
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, large, (4, 2), None), Algorithm::Hierarchical);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, large, (4, 4), None), Algorithm::Ring);
        assert_eq!(c.algorithm_for(CollectiveKind::Broadcast, None, large, (4, 2), None), Algorithm::Ring);
        c.algorithm = Some(Algorithm::OneShot);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, 1 << 20, (2, 2), None), Algorithm::OneShot);
        // The master's limits from measured links win over the settings, between two members too.
        c.algorithm = None;
        let wan = Some(AlgorithmLimits { oneshot_max: 2 << 20, twoshot_max: 32 << 20, hierarchical: false });
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, 1 << 20, (2, 2), wan), Algorithm::OneShot);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, 4 << 10, (64, 64), wan), Algorithm::OneShot);
        // A large group in sites: two-level where one-shot would run (not a broadcast); the
        // hierarchical all-reduce only where the measured links say grouping pays.
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, 4 << 10, (64, 5), wan), Algorithm::TwoLevel);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, 4 << 10, (8, 2), wan), Algorithm::OneShot);
        assert_eq!(c.algorithm_for(CollectiveKind::Broadcast, None, 4 << 10, (64, 5), wan), Algorithm::OneShot);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, 1 << 20, (64, 5), wan), Algorithm::TwoLevel);
        assert_eq!(c.algorithm_for(CollectiveKind::Broadcast, None, 1 << 20, (64, 5), wan), Algorithm::Ring);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, 64 << 20, (64, 5), wan), Algorithm::Ring);
        let pays = wan.map(|l| AlgorithmLimits { hierarchical: true, ..l });
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, 64 << 20, (64, 5), pays), Algorithm::Hierarchical);
        // Unmeasured, hosts some members share stand in for sites.
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, small, (16, 4), None), Algorithm::TwoLevel);
        assert_eq!(
            c.algorithm_for(CollectiveKind::AllReduce, Some(Algorithm::TwoLevel), huge, (16, 4), None),
            Algorithm::Ring
        );
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, 8 << 20, (4, 4), wan), Algorithm::TwoShot);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, 8 << 20, (2, 2), wan), Algorithm::Ring);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, None, 64 << 20, (4, 4), wan), Algorithm::Ring);
        assert_eq!(c.algorithm_for(CollectiveKind::AllReduce, Some(Algorithm::Ring), 8, (4, 4), wan), Algorithm::Ring);
    }

    #[test]
    fn pools_are_one_stream_on_this_host_unless_configured() {
        let mut c = CommunicatorConfig::from_env("127.0.0.1:1").unwrap();
        c.connections = None;
        let here: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(c.pool_size(Some(here), "127.0.0.1:5000"), 1);
        assert_eq!(c.pool_size(Some(here), "10.1.2.3:5000"), 1);
        assert_eq!(c.pool_size(Some(here), "10.1.2.4:5000"), DEFAULT_CONNECTIONS);
        assert_eq!(c.pool_size(None, "peer.example:5000"), DEFAULT_CONNECTIONS);
        c.connections = Some(3);
        assert_eq!(c.pool_size(Some(here), "127.0.0.1:5000"), 3);
    }

    /// An advertised address too long for a message once crashed the join (an encoder
    /// assertion under the communicator's lock); it is refused up front, naming the setting.
    #[test]
    fn an_over_long_advertised_address_is_refused_before_any_io() {
        let mut c = CommunicatorConfig::from_env("127.0.0.1:1").unwrap();
        c.advertise_addr = Some("a".repeat(300));
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("advertise_addr") && e.contains("300 bytes"), "{e}");
        c.advertise_addr = Some("€".repeat(100));
        assert!(c.validate().is_err(), "multi-byte characters count as bytes, and do not panic");
        c.advertise_addr = Some("peer.example.org".into());
        c.validate().unwrap();
    }
}
