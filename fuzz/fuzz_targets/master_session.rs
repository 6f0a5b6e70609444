//! The master state machine driven by many connections at once: connects, every kind of peer
//! message with small ids and epochs (so that they often fit the state), disconnects and the
//! passing of time, in any order. It must never panic, whatever a connection sends, and its ring
//! only ever holds peers it knows.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use shoal_fuzz::{digests, failure, misuse};
use shoal_proto::auth::{DataKey, RunKey};
use shoal_proto::master::{ConnId, Master, MasterConfig};
use shoal_wire::{Epoch, GroupId, Measured, Message, PeerId, SessionId};
use std::time::{Duration, Instant};

const SESSION: SessionId = SessionId(7);

#[derive(Debug, Arbitrary)]
enum Step {
    Connect(u8),
    Disconnect(u8),
    Wait(u16),
    Send {
        conn: u8,
        wrong_session: bool,
        message: Msg,
    },
    /// A newcomer's probe answers (`reach.rs`): for any peer id, probed or not, at any time.
    Probed {
        peer: u8,
        dialable: bool,
    },
}

#[derive(Debug, Arbitrary)]
enum Msg {
    Join { group: u8, proven: bool, catch_up: bool },
    Heartbeat,
    VoteUpdateTopology(u8),
    VoteOptimizeTopology(u8, Vec<(u8, u16, u16)>),
    VotePeersPending(u8),
    TopologyReady(u8),
    PeerUnreachable(u8, u8),
    OpDone(u8, u8, bool),
    OpFailed(u8, u8, u8, u8),
    SyncVote { revision: u8, strategy: u8, override_resume: bool, tensors: u8, hash: u8, collectives: u8 },
    SyncDone(u8),
    SyncFailed(u8),
    CatchUpStart { tensors: u8, hash: u8 },
    CatchUpProgress(u8, u8),
    CatchUpEnd(bool, u8),
    SnapshotHeld(u8, bool),
    P2pWaits(u8, bool),
    P2pResumed,
    P2pApart(u8),
    Gather { epoch: u8, seq: u8, deadline_ms: u16, min: u8, needs: u8 },
    Leave,
    Other(u8),
}

fn message(m: Msg, key: &RunKey, conn: ConnId) -> Message {
    match m {
        Msg::Join { group, proven, catch_up } => {
            let proof = if proven { key.prove(&nonce(conn)) } else { [0; 32] };
            Message::Join { group: GroupId(group.into()), data_addr: format!("h:{}", conn.0), proof, catch_up }
        }
        Msg::Heartbeat => Message::Heartbeat,
        Msg::VoteUpdateTopology(c) => Message::VoteUpdateTopology { collectives: c.into(), measured: None },
        Msg::VoteOptimizeTopology(c, links) => Message::VoteUpdateTopology {
            collectives: c.into(),
            measured: Some(
                links
                    .into_iter()
                    .map(|(p, rtt, rate)| Measured {
                        peer: PeerId(p.into()),
                        rtt_us: rtt.into(),
                        bytes_per_s: rate.into(),
                    })
                    .collect(),
            ),
        },
        Msg::VotePeersPending(c) => Message::VotePeersPending { collectives: c.into() },
        Msg::TopologyReady(e) => Message::TopologyReady { epoch: Epoch(e.into()) },
        Msg::PeerUnreachable(e, p) => Message::PeerUnreachable { epoch: Epoch(e.into()), peer: PeerId(p.into()) },
        Msg::OpDone(e, seq, decided) => {
            Message::OpDone { derived: 0, members: Vec::new(), epoch: Epoch(e.into()), seq: seq.into(), decided }
        }
        Msg::OpFailed(e, seq, kind, peer) => Message::OpFailed {
            derived: 0,
            members: Vec::new(),
            epoch: Epoch(e.into()),
            seq: seq.into(),
            failure: failure(kind, peer),
        },
        Msg::SyncVote { revision, strategy, override_resume, tensors, hash, collectives } => Message::SyncVote {
            revision: revision.into(),
            strategy: strategy % 4,
            override_resume,
            entries: digests(tensors, hash),
            collectives: collectives.into(),
        },
        Msg::SyncDone(round) => Message::SyncDone { round: round.into() },
        Msg::SyncFailed(round) => Message::SyncFailed { round: round.into(), reason: "fuzz".into() },
        Msg::CatchUpStart { tensors, hash } => Message::CatchUpStart { entries: digests(tensors, hash) },
        Msg::CatchUpProgress(done, total) => {
            Message::CatchUpProgress { done: done.into(), total: total.into(), eta_ms: u64::MAX }
        }
        Msg::CatchUpEnd(fetched, revision) => Message::CatchUpEnd { fetched, revision: revision.into() },
        Msg::SnapshotHeld(round, held) => Message::SnapshotHeld { round: round.into(), held },
        // A peer number of 255: a receive from any member.
        Msg::P2pWaits(p, send) => Message::P2pWaits {
            peer: if p == u8::MAX { PeerId::ANY } else { PeerId(p.into()) },
            any: p == u8::MAX,
            send,
            tag: 3,
            seen: 0,
            epoch: shoal_wire::Epoch(1),
            collectives: 0,
        },
        Msg::P2pResumed => Message::P2pResumed { peer: PeerId(0) },
        Msg::P2pApart(p) => Message::P2pApart { peer: PeerId(p.into()), misuse: misuse(p, p.wrapping_add(1)) },
        Msg::Gather { epoch, seq, deadline_ms, min, needs } => Message::Gather {
            epoch: Epoch(epoch.into()),
            seq: seq.into(),
            deadline_ms: deadline_ms.into(),
            min: min.into(),
            needs: vec![PeerId(needs.into())],
        },
        Msg::Leave => Message::Leave,
        // A master-to-peer message, which a peer never sends.
        Msg::Other(p) => Message::PeerRemoved { peer: PeerId(p.into()) },
    }
}

fn nonce(conn: ConnId) -> [u8; 32] {
    [conn.0 as u8; 32]
}

fuzz_target!(|steps: Vec<Step>| {
    let key = RunKey::from_secret(b"fuzz");
    let t0 = Instant::now();
    let config = MasterConfig {
        session: SESSION,
        heartbeat_timeout: Duration::from_secs(2),
        adaptive: true,
        key: Some(key.clone()),
        data_key: DataKey([1; 32]),
        // A fuzzed run checks the machine, not the ring it plans.
        search_effort: 0.01,
        search_clock: None,
        probe_timeout: Duration::from_millis(500),
    };
    let mut master = Master::new(config, t0);
    let mut now = t0;
    let mut open = std::collections::BTreeSet::new();
    for step in steps.into_iter().take(512) {
        match step {
            Step::Connect(c) => {
                // A driver never opens a connection it has open (the master asserts it).
                let conn = ConnId((c % 16).into());
                if open.insert(conn.0) {
                    master.handle_connect(now, conn, nonce(conn), Some([10, 0, 0, conn.0 as u8].into()));
                }
            }
            Step::Disconnect(c) => {
                let conn = ConnId((c % 16).into());
                open.remove(&conn.0);
                master.handle_disconnect(now, conn, "fuzz");
            }
            Step::Wait(ms) => {
                now += Duration::from_millis(ms.into());
                master.handle_timeout(now);
            }
            Step::Send { conn, wrong_session, message: m } => {
                let conn = ConnId((conn % 16).into());
                let session = if wrong_session { SessionId(8) } else { SESSION };
                master.handle_message(now, conn, session, message(m, &key, conn));
            }
            Step::Probed { peer, dialable } => {
                let result = if dialable { Ok(()) } else { Err("refused".to_string()) };
                master.handle_probe(now, PeerId(peer.into()), result);
            }
        }
        while master.poll_output().is_some() {}
        let known: Vec<PeerId> = master.peers().map(|(p, _)| p).collect();
        assert!(
            master.rings().all(|(_, ring)| ring.iter().all(|p| known.contains(p))),
            "a ring holds a peer the master forgot"
        );
    }
});
