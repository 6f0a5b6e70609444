//! The peer state machine driven by a master that says anything, in any order: every kind of
//! master message with small ids, epochs and rounds (so that they often fit the state), the
//! application's calls, the data plane's answers to what the peer asked of it, a broken control
//! connection and the passing of time. It must never panic, and it ends every call at most once.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use shoal_fuzz::{apart, digests, failure, misuse, vote_abort};
use shoal_proto::auth::RunKey;
use shoal_proto::peer::{
    Action, CallId, CallKind, Cutoff, Established, OpId, OpProgress, Peer, PeerConfig, Revision, SyncBallot,
};
use shoal_wire::{AlgorithmLimits, Epoch, GroupId, Measured, Member, Message, PeerId, PlanEntry, SessionId, Vote};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

#[derive(Debug, Arbitrary)]
struct Session {
    reconnect: bool,
    secret: bool,
    steps: Vec<Step>,
}

#[derive(Debug, Arbitrary)]
enum Step {
    Connect(u8),
    Call(CallMsg),
    Master(Msg),
    Wait(u16),
    Disconnect,
    Reconnected(u8),
    Established(u8, u8),
    Progress(u8, u8),
    Fetched(bool),
    /// The caller's transfer with this member waits (true: a send) or stops waiting.
    Waits(u8, bool),
    Resumed(u8),
    /// The driver judges the first member waiting on us apart from our call.
    Apart,
    Close,
}

#[derive(Debug, Arbitrary)]
enum CallMsg {
    UpdateTopology,
    OptimizeTopology(Vec<(u8, u16, u16)>),
    PeersPending,
    Sync { revision: u8, strategy: u8, tensors: u8, hash: u8 },
    Collective,
    Gathered(u8, u8, Option<u8>),
}

#[derive(Debug, Arbitrary)]
enum Msg {
    Challenge(u8),
    Registered { peer: u8, session: u8, heartbeat_ms: u16 },
    AuthFailed,
    Heartbeat,
    Topology { epoch: u8, members: Vec<(u8, u8, Option<u16>)>, world: u8, limits: Option<(u16, u16, bool)> },
    TopologyCommitted(u8),
    PeersPendingResult(bool),
    PeerRemoved(u8),
    Kicked,
    OpCommitted(u8, u8),
    OpAborted(u8, u8, u8, u8),
    OpQuery(u8, u8),
    VoteOpened { vote: u8, epoch: u8, voter: u8, collectives: u8 },
    PeersPendingAborted(bool, u8),
    TopologyVoteAborted(bool, u8),
    SyncPlan { round: u8, revision: u8, entries: Vec<(u8, Vec<u8>)> },
    SyncComplete(u8),
    SyncAborted(u8, bool),
    Snapshot(u8),
    CatchUpPlan { round: u8, revision: u8, entries: Vec<(u8, Vec<u8>)> },
    P2pWaits { peer: u8, any: bool, send: bool, epoch: u8, collectives: u8 },
    P2pResumed(u8),
    P2pApart(u8),
    Gathered { epoch: u8, seq: u8, included: Vec<u8>, pending: bool },
    // A peer-to-master message, which a master never sends.
    Other(u8),
}

fn call(c: CallMsg) -> CallKind {
    match c {
        CallMsg::UpdateTopology => CallKind::UpdateTopology,
        CallMsg::OptimizeTopology(links) => CallKind::OptimizeTopology(
            links
                .into_iter()
                .map(|(p, rtt, rate)| Measured { peer: PeerId(p.into()), rtt_us: rtt.into(), bytes_per_s: rate.into() })
                .collect(),
        ),
        CallMsg::PeersPending => CallKind::PeersPending,
        CallMsg::Sync { revision, strategy, tensors, hash } => CallKind::SyncSharedState(SyncBallot {
            revision: Revision(revision.into()),
            strategy: strategy % 4,
            override_resume: hash % 2 == 0,
            entries: digests(tensors, hash),
        }),
        CallMsg::Collective => CallKind::Collective(shoal_wire::Api::AllReduce, None),
        // A root: a broadcast's, of any rank (one past the ring's names nobody).
        CallMsg::Gathered(deadline_ms, min, root) => CallKind::Gathered(
            if root.is_some() { shoal_wire::Api::Broadcast } else { shoal_wire::Api::AllReduce },
            Cutoff { deadline: Duration::from_millis(deadline_ms.into()), min: min.into() },
            root.map(usize::from),
        ),
    }
}

fn message(m: Msg) -> Message {
    match m {
        Msg::Challenge(n) => Message::Challenge { nonce: [n; 32] },
        Msg::Registered { peer, session, heartbeat_ms } => Message::Registered {
            peer: PeerId(peer.into()),
            session: SessionId(session.into()),
            heartbeat_ms: heartbeat_ms.into(),
            data_key: [session; 32],
        },
        Msg::AuthFailed => Message::AuthFailed { reason: "fuzz".into() },
        Msg::Heartbeat => Message::Heartbeat,
        Msg::Topology { epoch, members, world, limits } => Message::Topology {
            epoch: Epoch(epoch.into()),
            members: members
                .into_iter()
                .take(8)
                .map(|(p, g, site)| Member {
                    peer: PeerId(p.into()),
                    // Now and then a member of another group: a topology the peer refuses.
                    group: GroupId(u32::from(g == u8::MAX)),
                    addr: format!("h:{p}"),
                    site,
                    // Behind a NAT now and then, seen at one of two addresses.
                    dialable: p % 3 != 0,
                    seen: Some([10, 0, 0, p % 2].into()),
                })
                .collect(),
            world: world.into(),
            limits: limits.map(|(one, two, hierarchical)| AlgorithmLimits {
                oneshot_max: one.into(),
                twoshot_max: two.into(),
                hierarchical,
            }),
        },
        Msg::TopologyCommitted(e) => Message::TopologyCommitted { epoch: Epoch(e.into()) },
        Msg::PeersPendingResult(pending) => Message::PeersPendingResult { pending },
        Msg::PeerRemoved(p) => Message::PeerRemoved { peer: PeerId(p.into()) },
        Msg::Kicked => Message::Kicked { reason: "fuzz".into() },
        Msg::OpCommitted(e, seq) => Message::OpCommitted { derived: 0, epoch: Epoch(e.into()), seq: seq.into() },
        Msg::OpAborted(e, seq, kind, peer) => {
            Message::OpAborted { derived: 0, epoch: Epoch(e.into()), seq: seq.into(), failure: failure(kind, peer) }
        }
        Msg::OpQuery(e, seq) => Message::OpQuery { derived: 0, epoch: Epoch(e.into()), seq: seq.into() },
        Msg::P2pWaits { peer, any, send, epoch, collectives } => Message::P2pWaits {
            peer: PeerId(peer.into()),
            any,
            send,
            tag: 3,
            seen: 0,
            epoch: Epoch(epoch.into()),
            collectives: collectives.into(),
        },
        Msg::P2pResumed(p) => Message::P2pResumed { peer: PeerId(p.into()) },
        Msg::P2pApart(p) => Message::P2pApart { peer: PeerId(p.into()), misuse: misuse(0, p) },
        Msg::Gathered { epoch, seq, included, pending } => Message::Gathered {
            epoch: Epoch(epoch.into()),
            seq: seq.into(),
            included: included.into_iter().take(8).map(|p| PeerId(p.into())).collect(),
            pending,
        },
        Msg::VoteOpened { vote, epoch, voter, collectives } => Message::VoteOpened {
            vote: [Vote::UpdateTopology, Vote::PeersPending, Vote::SyncSharedState][usize::from(vote) % 3],
            epoch: Epoch(epoch.into()),
            voter: PeerId(voter.into()),
            collectives: collectives.into(),
        },
        Msg::PeersPendingAborted(retry, code) => Message::PeersPendingAborted { retry, reason: vote_abort(code) },
        Msg::TopologyVoteAborted(retry, code) => Message::TopologyVoteAborted { retry, reason: vote_abort(code) },
        Msg::SyncPlan { round, revision, entries } => {
            Message::SyncPlan { round: round.into(), revision: revision.into(), entries: plan(entries) }
        }
        Msg::SyncComplete(round) => Message::SyncComplete { round: round.into() },
        Msg::SyncAborted(round, retryable) => {
            Message::SyncAborted { round: round.into(), retryable, reason: vote_abort(round) }
        }
        Msg::Snapshot(round) => Message::Snapshot { round: round.into() },
        Msg::CatchUpPlan { round, revision, entries } => Message::CatchUpPlan {
            round: round.into(),
            revision: revision.into(),
            entries: plan(entries),
            donors: Vec::new(),
            reason: String::new(),
        },
        Msg::Other(p) => Message::PeerUnreachable { epoch: Epoch(0), peer: PeerId(p.into()) },
    }
}

fn plan(entries: Vec<(u8, Vec<u8>)>) -> Vec<PlanEntry> {
    let entry = |(hash, donors): (u8, Vec<u8>)| PlanEntry {
        hash: [hash; 32],
        donors: donors.into_iter().take(4).map(|d| PeerId(d.into())).collect(),
    };
    entries.into_iter().take(4).map(entry).collect()
}

fuzz_target!(|session: Session| {
    let t0 = Instant::now();
    let config = PeerConfig {
        heartbeat_timeout: Duration::from_secs(2),
        key: session.secret.then(|| RunKey::from_secret(b"fuzz")),
        max_in_flight: 4,
        reconnect: session.reconnect,
    };
    let mut peer = Peer::new(config, t0);
    let mut now = t0;
    let bound = Duration::from_secs(5);
    // What the peer asked of its data plane, for the data plane's answers.
    let mut establishing: Option<Epoch> = None;
    let mut running: Vec<OpId> = Vec::new();
    let mut fetching: Option<u64> = None;
    let mut ended: BTreeSet<CallId> = BTreeSet::new();
    for step in session.steps.into_iter().take(512) {
        match step {
            Step::Connect(g) => {
                peer.connect(GroupId((g % 2).into()), "h:me".into(), g >= 128, bound, now);
            }
            Step::Call(c) => {
                peer.call(call(c), bound, now);
            }
            // Nothing comes from the master while its connection is down and dialed again: the
            // driver reads the new connection only once it was challenged (`Reconnected`).
            Step::Master(m) if peer.reconnecting().is_none() => {
                let _ = peer.handle_message(message(m), now);
            }
            Step::Master(_) => {}
            Step::Wait(ms) => {
                now += Duration::from_millis(ms.into());
                peer.handle_timeout(now);
            }
            Step::Disconnect => peer.handle_disconnect("fuzz".into(), now),
            Step::Reconnected(n) => {
                if peer.reconnecting().is_some() {
                    peer.handle_reconnected([n; 32], now);
                }
            }
            Step::Established(outcome, p) => {
                if let Some(epoch) = establishing.take() {
                    let outcome = match outcome % 3 {
                        0 => Established::Ready,
                        1 => Established::Unreachable(PeerId(p.into())),
                        _ => Established::Superseded,
                    };
                    peer.handle_established(epoch, outcome, now);
                }
            }
            Step::Progress(i, what) => {
                if !running.is_empty() {
                    let op = running[usize::from(i) % running.len()];
                    let progress = match what % 5 {
                        0 => OpProgress::DataDone,
                        1 => OpProgress::Confirmed,
                        2 => OpProgress::LapBroken("fuzz".into()),
                        3 => OpProgress::Failed(failure(what, i)),
                        // Waiting on no member, on one, or on all of them.
                        _ => OpProgress::Stalled {
                            waits_on: (0..u32::from(i % 4)).map(|p| PeerId(p.wrapping_add(u32::from(what)))).collect(),
                        },
                    };
                    peer.handle_collective(op, progress, now);
                }
            }
            Step::Fetched(ok) => {
                if let Some(round) = fetching.take() {
                    peer.handle_fetched(round, if ok { Ok(()) } else { Err("fuzz") }, now);
                }
            }
            // A driver announces waits on transfers with other members only.
            Step::Waits(other, send) if peer.registered().is_none_or(|(me, _)| me != PeerId(other.into())) => {
                peer.p2p_waits(PeerId(other.into()), send, 3, 0)
            }
            Step::Waits(..) => {}
            // ... and says so of those only.
            Step::Resumed(other) if peer.registered().is_some_and(|(me, _)| me != PeerId(other.into())) => {
                peer.p2p_resumed(PeerId(other.into()))
            }
            Step::Resumed(_) => {}
            Step::Apart => {
                let first = peer.waiters().next().map(|(waiter, _)| waiter);
                if let (Some(waiter), Some((me, _))) = (first, peer.registered()) {
                    peer.p2p_apart(waiter, apart(waiter, me));
                }
            }
            Step::Close => peer.close(now),
        }
        while peer.poll_output().is_some() {}
        while let Some(action) = peer.poll_action() {
            match action {
                Action::Establish { position, .. } => establishing = Some(position.epoch),
                Action::RunCollective { op, .. } => running.push(op),
                Action::Fetch { round, .. } => fetching = Some(round),
                Action::Done { call, .. } => assert!(ended.insert(call), "call {call:?} ended twice"),
                // A driver answers a question about a transfer's outcome, or ends the transfer by
                // the answer: the state machine only relays them.
                Action::P2pOutcome(asked) => peer.p2p_decided(asked, false),
                Action::Registered { .. }
                | Action::TakeUp(_)
                | Action::MemberWaits(_)
                | Action::P2pApart { .. }
                | Action::P2pDecided(..) => {}
            }
        }
        running.retain(|&op| peer.running(op));
    }
});
