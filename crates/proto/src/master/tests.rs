//! Scenario tests of the master state machine: inputs in, outputs checked, no IO.

use super::*;

const SESSION: SessionId = SessionId(77);

struct Harness {
    master: Master,
    now: Instant,
}

impl Harness {
    fn new() -> Self {
        let now = Instant::now();
        let config = MasterConfig { session: SESSION, heartbeat_timeout: Duration::from_secs(2) };
        Harness { master: Master::new(config, now), now }
    }
    fn send(&mut self, conn: u64, m: Message) -> Vec<Output> {
        let session = if matches!(m, Message::Join { .. }) { SessionId(0) } else { SESSION };
        self.master.handle_message(self.now, ConnId(conn), session, m);
        self.drain()
    }
    fn join(&mut self, conn: u64) -> Vec<Output> {
        self.send(conn, Message::Join { group: GroupId(0), data_addr: format!("127.0.0.1:{conn}") })
    }
    fn drain(&mut self) -> Vec<Output> {
        std::iter::from_fn(|| self.master.poll_output()).collect()
    }
}

fn sent_to(outputs: &[Output], conn: u64) -> Vec<&Message> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Send { conn: c, message } if *c == ConnId(conn) => Some(message),
            _ => None,
        })
        .collect()
}

fn issued_epoch(outputs: &[Output], conn: u64) -> Option<Epoch> {
    sent_to(outputs, conn).into_iter().find_map(|m| match m {
        Message::Topology { epoch, .. } => Some(*epoch),
        _ => None,
    })
}

/// Brings up peers on conns 1..=n, each admitted by the vote of those before it.
fn run_with(n: u64) -> (Harness, Epoch) {
    let mut h = Harness::new();
    let out = h.join(1);
    let mut epoch = issued_epoch(&out, 1).expect("the first peer is admitted without a vote");
    h.send(1, Message::TopologyReady { epoch });
    for c in 2..=n {
        h.join(c);
        let mut out = Vec::new();
        for voter in 1..c {
            out = h.send(voter, Message::VoteUpdateTopology);
        }
        epoch = issued_epoch(&out, c).expect("the vote issues a topology");
        for member in 1..=c {
            out = h.send(member, Message::TopologyReady { epoch });
        }
        assert!(sent_to(&out, c).contains(&&Message::TopologyCommitted { epoch }));
    }
    assert_eq!(h.master.ring().len(), n as usize);
    (h, epoch)
}

#[test]
fn first_peer_is_admitted_without_a_vote() {
    let mut h = Harness::new();
    let out = h.join(1);
    assert_eq!(sent_to(&out, 1)[0], &Message::Registered { peer: PeerId(0), session: SESSION, heartbeat_ms: 500 });
    let epoch = issued_epoch(&out, 1).unwrap();
    let out = h.send(1, Message::TopologyReady { epoch });
    assert_eq!(sent_to(&out, 1), vec![&Message::TopologyCommitted { epoch }]);
    assert_eq!(h.master.phase(), &Phase::Idle);
}

#[test]
fn newcomer_waits_until_every_accepted_peer_votes() {
    let (mut h, _) = run_with(2);
    let out = h.join(3);
    assert_eq!(issued_epoch(&out, 3), None, "a newcomer is only registered");
    // peers_pending is a vote too: the answer comes once both accepted peers asked.
    assert!(sent_to(&h.send(1, Message::VotePeersPending), 1).is_empty());
    let out = h.send(2, Message::VotePeersPending);
    for c in [1, 2] {
        assert_eq!(sent_to(&out, c), vec![&Message::PeersPendingResult { pending: true }]);
    }
    assert_eq!(issued_epoch(&h.send(1, Message::VoteUpdateTopology), 3), None);
    let out = h.send(2, Message::VoteUpdateTopology);
    let epoch = issued_epoch(&out, 3).unwrap();
    assert_eq!(issued_epoch(&out, 1), Some(epoch));
    h.send(1, Message::TopologyReady { epoch });
    h.send(3, Message::TopologyReady { epoch });
    assert!(matches!(h.master.phase(), Phase::AwaitingConnections { .. }));
    h.send(2, Message::TopologyReady { epoch });
    assert_eq!(h.master.ring(), &[PeerId(0), PeerId(1), PeerId(2)]);
}

#[test]
fn peer_lost_during_vote_lets_the_others_finish() {
    let (mut h, _) = run_with(3);
    h.join(4);
    h.send(1, Message::VoteUpdateTopology);
    h.send(2, Message::VoteUpdateTopology);
    h.master.handle_disconnect(h.now, ConnId(3), "reset");
    let out = h.drain();
    let epoch = issued_epoch(&out, 4).expect("the tally ran again without the lost voter");
    let Output::Send { message: Message::Topology { members, .. }, .. } =
        out.iter().find(|o| matches!(o, Output::Send { message: Message::Topology { .. }, .. })).unwrap()
    else {
        unreachable!()
    };
    let ids: Vec<u32> = members.iter().map(|m| m.peer.0).collect();
    assert_eq!(ids, vec![0, 1, 3]);
    assert!(epoch > Epoch(3));
}

#[test]
fn member_lost_while_connecting_reissues_the_topology() {
    let (mut h, _) = run_with(2);
    h.join(3);
    h.send(1, Message::VoteUpdateTopology);
    let out = h.send(2, Message::VoteUpdateTopology);
    let first = issued_epoch(&out, 3).unwrap();
    h.send(1, Message::TopologyReady { epoch: first });
    h.master.handle_disconnect(h.now, ConnId(3), "eof");
    let out = h.drain();
    let second = issued_epoch(&out, 1).expect("re-issued");
    assert!(second > first);
    h.send(1, Message::TopologyReady { epoch: first }); // stale: ignored
    h.send(1, Message::TopologyReady { epoch: second });
    let out = h.send(2, Message::TopologyReady { epoch: second });
    assert!(sent_to(&out, 2).contains(&&Message::TopologyCommitted { epoch: second }));
    assert_eq!(h.master.ring(), &[PeerId(0), PeerId(1)]);
}

#[test]
fn silent_peer_is_removed_after_the_heartbeat_timeout() {
    let (mut h, _) = run_with(2);
    let deadline = h.master.poll_timeout().unwrap();
    assert!(deadline <= h.now + Duration::from_secs(2));
    // Peer 1 keeps talking, peer 2 falls silent.
    for _ in 0..5 {
        h.now += Duration::from_millis(500);
        h.send(1, Message::Heartbeat);
        h.master.handle_timeout(h.now);
    }
    let out = h.drain();
    assert!(out.iter().any(|o| matches!(o, Output::Close { conn: ConnId(2), .. })));
    assert_eq!(h.master.ring(), &[PeerId(0)]);
    // The survivor is told, so that a collective it runs with the silent peer ends now, and
    // the silent peer finds out why if it wakes up.
    assert!(sent_to(&out, 1).contains(&&Message::PeerRemoved { peer: PeerId(1) }));
    assert!(sent_to(&out, 2).iter().any(|m| matches!(m, Message::Kicked { .. })));
}

#[test]
fn protocol_violations_expel_only_the_offender() {
    let (mut h, _) = run_with(2);
    h.join(3);
    // A registered peer may not vote.
    let out = h.send(3, Message::VoteUpdateTopology);
    assert!(matches!(sent_to(&out, 3)[0], Message::Kicked { .. }));
    assert!(out.iter().any(|o| matches!(o, Output::Close { conn: ConnId(3), .. })));
    // A frame of another session is refused.
    h.master.handle_message(h.now, ConnId(2), SessionId(5), Message::Heartbeat);
    assert!(h.drain().iter().any(|o| matches!(o, Output::Close { conn: ConnId(2), .. })));
    // Anything but Join on a new connection closes it.
    let out = h.send(9, Message::Heartbeat);
    assert!(matches!(out[0], Output::Close { conn: ConnId(9), .. }));
    assert_eq!(h.master.ring(), &[PeerId(0)]);
}

#[test]
fn when_every_accepted_peer_is_gone_the_next_registered_one_is_admitted() {
    let (mut h, _) = run_with(1);
    h.join(2);
    h.master.handle_disconnect(h.now, ConnId(1), "eof");
    let out = h.drain();
    assert!(issued_epoch(&out, 2).is_some());
}

#[test]
fn a_peer_that_leaves_is_not_reported_to_the_others() {
    // It closed its streams itself and may have finished its part of a collective the others
    // are still completing; a PeerRemoved would abort them needlessly.
    let (mut h, _) = run_with(3);
    let out = h.send(1, Message::Leave);
    assert!(!out.iter().any(|o| matches!(o, Output::Send { message: Message::PeerRemoved { .. }, .. })));
    h.master.handle_disconnect(h.now, ConnId(2), "reset");
    let out = h.drain();
    assert!(!out.iter().any(|o| matches!(o, Output::Send { message: Message::PeerRemoved { .. }, .. })));
    assert_eq!(h.master.ring(), &[PeerId(2)]);
}
