//! What the master knows of the run, for its metrics, its status page and `shoal status`: its own
//! counters, and what every peer reported of its work (`Message::Report`). The master never sees
//! a collective that went well, so the data plane's counters are the peers'; those of peers that
//! left are kept, so that the run's totals never go down.

use super::{Master, Phase, Plan, Status};
use shoal_topology::Link;
use shoal_wire::{Epoch, GroupId, OpCounters, PeerId, PeerReport, SessionId};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The master's own counters since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Peers registered.
    pub joins: u64,
    /// `Join`s refused for a wrong or missing proof of the run's secret.
    pub auth_failures: u64,
    /// `Join`s refused because the run was full.
    pub refused_full: u64,
    /// Connections whose TLS handshake failed (no certificate of the run's CA, or no TLS).
    pub tls_failures: u64,
    /// Peers that left on purpose.
    pub left: u64,
    /// Peers whose control connection was lost.
    pub lost: u64,
    /// Peers expelled: silent, unreachable, late or misbehaving.
    pub expelled: u64,
    /// Topologies issued.
    pub topologies: u64,
    /// `update_topology` / `optimize_topology` votes that passed.
    pub topology_votes: u64,
    /// `peers_pending` votes that passed.
    pub pending_votes: u64,
    /// Shared-state syncs that completed.
    pub syncs_completed: u64,
    /// Shared-state syncs that were aborted.
    pub syncs_aborted: u64,
    /// Collectives the master aborted (a participant reported a failure).
    pub collectives_aborted: u64,
}

/// What peers reported, summed over the run: those in it now and those that left.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Totals {
    /// Counters per kind of operation.
    pub ops: BTreeMap<String, OpCounters>,
    /// Failed operations by cause.
    pub failures: BTreeMap<String, u64>,
}

impl Totals {
    /// Adds `report`'s counters.
    pub fn add(&mut self, report: &PeerReport) {
        for o in &report.ops {
            self.ops
                .entry(o.kind.clone())
                .or_insert_with(|| OpCounters { kind: o.kind.clone(), ..Default::default() })
                .add(o);
        }
        for (cause, n) in &report.failures {
            let count = self.failures.entry(cause.clone()).or_default();
            *count = count.saturating_add(*n);
        }
        debug_assert!(report.ops.iter().all(|o| self.ops.contains_key(&o.kind)), "a kind reported is not counted");
        debug_assert!(
            report.failures.iter().all(|(c, _)| self.failures.contains_key(c)),
            "a cause reported is not counted"
        );
    }
}

/// One peer, as the master sees it.
#[derive(Debug, Clone)]
pub struct PeerStatus {
    /// Its id.
    pub peer: PeerId,
    /// Its group.
    pub group: GroupId,
    /// The address it advertises for data connections.
    pub addr: String,
    /// Registered or accepted.
    pub status: Status,
    /// Whether its data address can be dialed; `None` while the master's probe is under way
    /// (`reach.rs`).
    pub dialable: Option<bool>,
    /// Where its control connection came from, if known: behind a NAT, the NAT's address.
    pub seen: Option<std::net::IpAddr>,
    /// Its site, where `optimize_topology` found sites worth scheduling by.
    pub site: Option<u16>,
    /// Its rank in the committed ring.
    pub rank: Option<usize>,
    /// Since its last message.
    pub silent: Duration,
    /// How long it may be silent before it is expelled: its heartbeats' bound where those set
    /// it (`MasterConfig::adaptive`).
    pub silence_bound: Duration,
    /// Its last report, if it sent one.
    pub report: Option<PeerReport>,
    /// While it catches up: bytes fetched, bytes in all, and the milliseconds it expects to take
    /// still, as it last reported.
    pub catch_up: Option<(u64, u64, u64)>,
}

/// One group.
#[derive(Debug, Clone)]
pub struct GroupStatus {
    /// The group.
    pub group: GroupId,
    /// Its committed topology.
    pub ring_epoch: Epoch,
    /// `"idle"`, `"voting"` (an `update_topology` vote is open) or `"connecting"` (a topology
    /// was issued and its members connect).
    pub phase: &'static str,
    /// Its members in the committed ring, in ring order.
    pub ring: Vec<PeerId>,
    /// The links its members measured, once its `optimize_topology` passed.
    pub matrix: Option<Matrix>,
    /// The revision of its last completed shared-state sync.
    pub revision: Option<u64>,
    /// The elected hash of every tensor at that sync, by name.
    pub hashes: BTreeMap<String, [u8; 32]>,
    /// The round of a sync in progress.
    pub syncing: Option<u64>,
    /// The copy of the state its members keep for newcomers: (sync round, revision, members
    /// holding it).
    pub snapshot: Option<(u64, u64, Vec<PeerId>)>,
}

/// What the last `optimize_topology` measured.
#[derive(Debug, Clone)]
pub struct Matrix {
    /// The measured members.
    pub members: Vec<PeerId>,
    /// `links[i][j]`: what `members[i]` measured towards `members[j]`.
    pub links: Vec<Vec<Option<Link>>>,
}

/// The whole run at one instant.
#[derive(Debug, Clone)]
pub struct RunStatus {
    /// The run's session.
    pub session: SessionId,
    /// The last topology issued, to any group.
    pub epoch: Epoch,
    /// Every group's committed ring, group by group: the run's accepted peers.
    pub ring: Vec<PeerId>,
    /// Every peer, registered or accepted, by id.
    pub peers: Vec<PeerStatus>,
    /// Every group with a member, by id.
    pub groups: Vec<GroupStatus>,
    /// Collectives that some participant reported trouble with, not yet settled.
    pub open_collectives: usize,
    /// The master's counters.
    pub counters: Counters,
    /// What peers reported, summed over the run.
    pub totals: Totals,
}

impl Master {
    /// The master's counters.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// The whole run as it stands at `now`.
    pub fn status(&self, now: Instant) -> RunStatus {
        let mut sites: BTreeMap<PeerId, u16> = BTreeMap::new();
        let mut ranks: BTreeMap<PeerId, usize> = BTreeMap::new();
        let mut groups = Vec::new();
        for (id, g) in self.each_group() {
            sites.extend(g.plan.as_ref().map(Plan::sites).unwrap_or_default());
            ranks.extend(g.ring.iter().enumerate().map(|(rank, p)| (*p, rank)));
            let state = self.group_states.get(&id);
            groups.push(GroupStatus {
                group: id,
                ring_epoch: g.ring_epoch,
                phase: match g.phase {
                    Phase::Idle => "idle",
                    Phase::AwaitingTopologyVotes { .. } => "voting",
                    Phase::AwaitingConnections { .. } => "connecting",
                },
                ring: g.ring.clone(),
                matrix: g.plan.as_ref().map(|plan| {
                    let members = plan.members().to_vec();
                    let links = members.iter().map(|a| members.iter().map(|b| plan.link(*a, *b)).collect()).collect();
                    Matrix { members, links }
                }),
                revision: state.map(|s| s.revision()),
                hashes: state.map(|s| s.hashes().clone()).unwrap_or_default(),
                syncing: self.syncs.get(&id).map(|s| s.round()),
                snapshot: self.snapshots.get(&id).map(|s| (s.round, s.revision, s.held.iter().copied().collect())),
            });
        }
        let ring: Vec<PeerId> = groups.iter().flat_map(|g| g.ring.iter().copied()).collect();
        debug_assert_eq!(ranks.len(), ring.len(), "a ring member twice");
        debug_assert!(self.reports.keys().all(|p| self.peers.contains_key(p)), "a report of a peer gone");
        let peers = self
            .peers
            .iter()
            .map(|(id, e)| PeerStatus {
                peer: *id,
                group: e.group,
                addr: e.addr.clone(),
                status: e.status,
                dialable: e.reach.known(),
                seen: e.seen,
                site: sites.get(id).copied(),
                rank: ranks.get(id).copied(),
                silent: now.saturating_duration_since(e.last_heard),
                silence_bound: self.silence_bound(e),
                report: self.reports.get(id).cloned(),
                catch_up: self.catching_up.get(id).and_then(|n| n.progress),
            })
            .collect();
        let mut totals = self.retired.clone();
        for report in self.reports.values() {
            totals.add(report);
        }
        RunStatus {
            session: self.config.session,
            epoch: self.epoch,
            ring,
            peers,
            groups,
            open_collectives: self.ops.len(),
            counters: self.counters,
            totals,
        }
    }
}
