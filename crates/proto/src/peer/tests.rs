//! The peer's state machine, one rule at a time: what it sends, what it asks of its driver, and
//! when its calls end. `crates/sim` runs the same machine through thousands of faulty runs.

use super::*;
use crate::auth::{DataKey, RunKey};
use crate::made;
use shoal_wire::{Call as Made, Member, SessionId};

/// Our send to `member`, which can never complete with its vote: as the master relays it to us.
fn ours_apart_from(member: u32) -> Misuse {
    let send = Made::Transfer { send: true, peer: PeerId(member), tag: 3 };
    Misuse::new(made(&[0], send), made(&[member], Made::api(Api::UpdateTopology)))
}

/// A usage error, where what matters is where it goes, not which calls it names.
fn apart() -> Misuse {
    Misuse::new(made(&[1], Made::api(Api::UpdateTopology)), made(&[2], Made::api(Api::AllReduce)))
}

const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);
const BOUND: Duration = Duration::from_secs(10);

fn member(p: u32) -> Member {
    Member { peer: PeerId(p), group: GroupId(0), addr: format!("h:{p}"), site: None, dialable: true, seen: None }
}

fn members(ids: &[u32]) -> Vec<Member> {
    ids.iter().map(|&p| member(p)).collect()
}

/// Drains the messages for the master.
fn sent(p: &mut Peer) -> Vec<Message> {
    std::iter::from_fn(|| p.poll_output()).collect()
}

/// Drains the actions for the driver, with call ids left out (tests that make several calls at
/// once use [`tagged_actions`]).
fn actions(p: &mut Peer) -> Vec<Action> {
    tagged_actions(p)
        .into_iter()
        .map(|a| match a {
            Action::Done { result, .. } => done(result),
            Action::RunCollective { op, position, deadline, .. } => {
                Action::RunCollective { call: CallId(0), op, position, group: Vec::new(), deadline }
            }
            a => a,
        })
        .collect()
}

fn tagged_actions(p: &mut Peer) -> Vec<Action> {
    std::iter::from_fn(|| p.poll_action()).collect()
}

/// A call's end, as [`actions`] shows it.
fn done(result: Result<Value, CallError>) -> Action {
    Action::Done { call: CallId(0), result }
}

/// Peer 0, joined and accepted in topology 1 of `ring` (peer 0 among them).
fn joined(ring: &[u32]) -> (Peer, Instant) {
    joined_with(ring, false)
}

/// As [`joined`]; `reconnect`: a broken control connection is dialed again.
fn joined_with(ring: &[u32], reconnect: bool) -> (Peer, Instant) {
    let t0 = crate::test_start();
    let mut p =
        Peer::new(PeerConfig { heartbeat_timeout: HEARTBEAT_TIMEOUT, key: None, max_in_flight: 4, reconnect }, t0);
    p.connect(GroupId(0), "h:0".into(), false, BOUND, t0);
    assert!(sent(&mut p).is_empty(), "Join waits for the master's challenge");
    p.handle_message(Message::Challenge { nonce: [3; 32] }, t0).unwrap();
    assert_eq!(
        sent(&mut p),
        vec![Message::Join { group: GroupId(0), data_addr: "h:0".into(), proof: [0; 32], catch_up: false }]
    );
    let registered =
        Message::Registered { peer: PeerId(0), session: SessionId(7), heartbeat_ms: 100, data_key: [5; 32] };
    p.handle_message(registered, t0).unwrap();
    p.handle_message(Message::Topology { epoch: Epoch(1), members: members(ring).into(), world: 8, limits: None }, t0)
        .unwrap();
    let position = match &actions(&mut p)[..] {
        [Action::Registered { me: PeerId(0), session: SessionId(7), data_key }, Action::Establish { position, .. }]
            if *data_key == DataKey([5; 32]) =>
        {
            position.clone()
        }
        other => panic!("expected registration, then establish: {other:?}"),
    };
    assert_eq!(position.ring.len(), ring.len());
    p.handle_established(Epoch(1), Established::Ready, t0);
    assert_eq!(sent(&mut p), vec![Message::TopologyReady { epoch: Epoch(1) }]);
    p.handle_message(Message::TopologyCommitted { epoch: Epoch(1) }, t0).unwrap();
    assert_eq!(actions(&mut p), vec![Action::TakeUp(position), done(Ok(Value::Joined))]);
    assert!(!p.busy());
    (p, t0)
}

/// Starts a collective; returns its name.
fn start_collective(p: &mut Peer, now: Instant) -> OpId {
    p.call(CallKind::Collective(Api::AllReduce, None), BOUND, now);
    match &actions(p)[..] {
        [Action::RunCollective { op, .. }] => *op,
        other => panic!("expected the collective to run: {other:?}"),
    }
}

#[test]
fn a_newcomer_is_done_joining_once_the_topology_it_established_commits() {
    let (p, _) = joined(&[0, 1]);
    assert_eq!(p.position().map(|pos| pos.group_size()), Some(2));
}

/// Heartbeats go out as often as the master asks, which may be more often than the peer's own
/// timeout needs; a master silent for a heartbeat timeout is lost and ends the call in progress.
#[test]
fn heartbeats_follow_the_master_and_a_silent_master_ends_the_call() {
    let (mut p, t0) = joined(&[0]);
    let due = p.poll_timeout().unwrap();
    assert!(due <= t0 + Duration::from_millis(100), "the master asked for a heartbeat every 100 ms");
    p.handle_timeout(due);
    assert_eq!(sent(&mut p), vec![Message::Heartbeat]);
    p.call(CallKind::PeersPending, BOUND, due);
    assert_eq!(sent(&mut p), vec![Message::VotePeersPending { collectives: 0 }]);
    let silent = t0 + HEARTBEAT_TIMEOUT + Duration::from_millis(10);
    p.handle_timeout(silent);
    assert!(matches!(p.gone(), Some(Gone::MasterLost(why)) if why.contains("no message")));
    assert!(matches!(&actions(&mut p)[..], [Action::Done { result: Err(CallError::Gone(Gone::MasterLost(_))), .. }]));
    assert_eq!(p.poll_timeout(), None, "nothing more to time");
}

/// A participant the master removed never closes its streams (frozen, cut off): once the data
/// plane stalls with data still to move with it, the collective stops, the failure is reported,
/// and the verdict ends the call on every participant alike. While bytes still flow it goes on:
/// the removed member's part may all be in flight, and the collective complete without it.
#[test]
fn a_removed_member_stops_the_collective_once_it_stalls_and_the_verdict_ends_it() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    let op = start_collective(&mut p, t0);
    assert_eq!(op, OpId { epoch: Epoch(1), derived: 0, seq: Seq(0) });
    assert!(p.running(op));
    p.handle_message(Message::PeerRemoved { peer: PeerId(2) }, t0).unwrap();
    assert!(p.running(op), "bytes may still be flowing");
    assert!(sent(&mut p).is_empty());
    p.handle_collective(op, OpProgress::Stalled { waits_on: vec![PeerId(2)] }, t0);
    assert!(!p.running(op), "the data plane must stop");
    let failed = sent(&mut p);
    assert!(
        matches!(&failed[..], [Message::OpFailed { derived: 0, epoch: Epoch(1), seq: 0, failure, .. }] if failure.peer == PeerId(2)),
        "{failed:?}"
    );
    // What the data plane says after the decision changes nothing.
    p.handle_collective(op, OpProgress::DataDone, t0);
    assert!(actions(&mut p).is_empty());
    let failure = OpFailure::new(FailureKind::PeerLost, PeerId(2), "gone");
    p.handle_message(Message::OpAborted { derived: 0, epoch: Epoch(1), seq: 0, failure: failure.clone() }, t0).unwrap();
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Aborted { op, failure }))]);
    assert!(!p.busy());
}

/// A removed member whose part of the collective all came (it died once it held the result)
/// stops nothing here for a while when the data still to come is a live member's, which may be
/// slow: that member finishes, and the master commits once every member alive holds the result.
/// Failing at once instead would abort a collective every survivor can complete. Past the grace
/// it stops, as the data may be stuck behind the lost member.
#[test]
fn a_removed_member_it_is_done_with_stops_the_collective_only_a_grace_later() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    let op = start_collective(&mut p, t0);
    p.handle_message(Message::PeerRemoved { peer: PeerId(2) }, t0).unwrap();
    let before = t0 + p.removal_grace() - Duration::from_millis(1);
    p.handle_collective(op, OpProgress::Stalled { waits_on: vec![PeerId(1)] }, before);
    assert!(p.running(op), "the data still to come is a live member's");
    assert!(sent(&mut p).is_empty());
    p.handle_collective(op, OpProgress::Stalled { waits_on: vec![PeerId(1)] }, t0 + p.removal_grace());
    assert!(!p.running(op), "past the grace it stops");
    assert!(matches!(&sent(&mut p)[..], [Message::OpFailed { derived: 0, failure, .. }] if failure.peer == PeerId(2)));

    let (mut p, t0) = joined(&[0, 1, 2]);
    let op = start_collective(&mut p, t0);
    p.handle_message(Message::PeerRemoved { peer: PeerId(2) }, t0).unwrap();
    p.handle_collective(op, OpProgress::Stalled { waits_on: vec![PeerId(1)] }, t0);
    p.handle_collective(op, OpProgress::DataDone, t0);
    p.handle_collective(op, OpProgress::Stalled { waits_on: vec![] }, t0);
    assert_eq!(
        sent(&mut p),
        vec![Message::OpDone { derived: 0, members: Vec::new(), epoch: Epoch(1), seq: 0, decided: false }],
        "the lap cannot finish"
    );
    p.handle_message(Message::OpCommitted { derived: 0, epoch: Epoch(1), seq: 0 }, t0).unwrap();
    assert_eq!(actions(&mut p), vec![done(Ok(Value::Collective(op)))]);
}

/// A lap that came round commits on its own; a query that came before is answered then.
#[test]
fn a_confirmed_lap_commits_on_its_own_and_answers_the_query_it_had() {
    let (mut p, t0) = joined(&[0, 1]);
    let op = start_collective(&mut p, t0);
    p.handle_message(Message::OpQuery { derived: 0, epoch: Epoch(1), seq: 0 }, t0).unwrap();
    assert!(sent(&mut p).is_empty(), "not committed yet: answered when it is");
    p.handle_collective(op, OpProgress::DataDone, t0);
    assert!(p.running(op), "the lap runs");
    p.handle_collective(op, OpProgress::Confirmed, t0);
    assert_eq!(
        sent(&mut p),
        vec![Message::OpDone { derived: 0, members: Vec::new(), epoch: Epoch(1), seq: 0, decided: true }]
    );
    assert_eq!(actions(&mut p), vec![done(Ok(Value::Collective(op)))]);
    assert_eq!(start_collective(&mut p, t0), OpId { epoch: Epoch(1), derived: 0, seq: Seq(1) }, "numbered in order");
}

/// A lap that cannot finish asks the master, which decides for every participant.
#[test]
fn a_broken_lap_asks_the_master_and_takes_its_verdict() {
    let (mut p, t0) = joined(&[0, 1]);
    let op = start_collective(&mut p, t0);
    p.handle_collective(op, OpProgress::DataDone, t0);
    p.handle_collective(op, OpProgress::LapBroken("predecessor closed the stream".into()), t0);
    assert!(!p.running(op));
    assert_eq!(
        sent(&mut p),
        vec![Message::OpDone { derived: 0, members: Vec::new(), epoch: Epoch(1), seq: 0, decided: false }]
    );
    // A lap the data plane finishes after the peer asked does not commit on its own.
    p.handle_collective(op, OpProgress::Confirmed, t0);
    assert!(actions(&mut p).is_empty() && sent(&mut p).is_empty());
    p.handle_message(Message::OpCommitted { derived: 0, epoch: Epoch(1), seq: 0 }, t0).unwrap();
    assert_eq!(actions(&mut p), vec![done(Ok(Value::Collective(op)))]);
}

/// A member that called another collective can show only once our data moved (a broadcast
/// from another root): the mismatch fails the collective, reported to the master, rather than
/// being dropped until the bound (when the master, asked, would commit it).
#[test]
fn a_mismatch_after_the_data_moved_is_reported_and_other_failures_then_ask() {
    let (mut p, t0) = joined(&[0, 1]);
    let op = start_collective(&mut p, t0);
    p.handle_collective(op, OpProgress::DataDone, t0);
    let mismatch = crate::mismatched(1, 0, 0, 1);
    p.handle_collective(op, OpProgress::Failed(mismatch.clone()), t0);
    assert!(!p.running(op));
    assert_eq!(
        sent(&mut p),
        vec![Message::OpFailed { derived: 0, members: Vec::new(), epoch: Epoch(1), seq: 0, failure: mismatch.clone() }]
    );
    p.handle_message(Message::OpAborted { derived: 0, epoch: Epoch(1), seq: 0, failure: mismatch.clone() }, t0)
        .unwrap();
    let ended = actions(&mut p);
    assert!(
        matches!(
            &ended[..],
            [Action::Done { result: Err(CallError::Unconfirmed { .. } | CallError::Aborted { .. }), .. }]
        ),
        "{ended:?}"
    );
}

/// A failure reported without a verdict in a heartbeat timeout (the master is cut off from us)
/// leaves the driver's own error; a question without an answer ends in a timeout.
#[test]
fn without_a_verdict_a_failure_stands_and_a_question_times_out() {
    let (mut p, t0) = joined(&[0, 1]);
    let op = start_collective(&mut p, t0);
    let failure = OpFailure::new(FailureKind::PeerLost, PeerId(1), "closed");
    p.handle_collective(op, OpProgress::Failed(failure.clone()), t0);
    let later = t0 + HEARTBEAT_TIMEOUT / 2;
    p.handle_message(Message::Heartbeat, later).unwrap();
    p.handle_timeout(later);
    assert!(actions(&mut p).is_empty(), "waits for the verdict");
    let after = t0 + HEARTBEAT_TIMEOUT;
    p.handle_timeout(after);
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Unconfirmed { op, failure }))]);

    let op = start_collective(&mut p, after);
    p.handle_collective(op, OpProgress::DataDone, after);
    p.handle_message(Message::PeerRemoved { peer: PeerId(1) }, after).unwrap();
    p.handle_collective(op, OpProgress::Stalled { waits_on: vec![] }, after);
    assert_eq!(
        sent(&mut p).last(),
        Some(&Message::OpDone { derived: 0, members: Vec::new(), epoch: Epoch(1), seq: 1, decided: false })
    );
    // Asked at `after`, within the call's bound: the answer may take that bound and a heartbeat
    // timeout more.
    let end = after + BOUND + HEARTBEAT_TIMEOUT;
    p.handle_message(Message::Heartbeat, end - Duration::from_millis(1)).unwrap();
    p.handle_timeout(end - Duration::from_millis(1));
    assert!(actions(&mut p).is_empty());
    p.handle_message(Message::Heartbeat, end).unwrap();
    p.handle_timeout(end);
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Timeout))]);
}

/// The master refuses a vote while a topology connects: the call joins that topology, then
/// votes again, all within its bound, and the driver only opens connections.
#[test]
fn a_refused_vote_joins_the_issued_topology_and_votes_again() {
    let (mut p, t0) = joined(&[0, 1]);
    p.call(CallKind::UpdateTopology, BOUND, t0);
    assert_eq!(sent(&mut p), vec![Message::VoteUpdateTopology { collectives: 0, measured: None }]);
    p.handle_message(
        Message::Topology { epoch: Epoch(2), members: members(&[0, 1, 2]).into(), world: 8, limits: None },
        t0,
    )
    .unwrap();
    p.handle_message(Message::TopologyVoteAborted { retry: true, reason: Reason::text("a topology connects") }, t0)
        .unwrap();
    let establish = actions(&mut p);
    assert!(matches!(&establish[..], [Action::Establish { position, .. }] if position.epoch == Epoch(2)));
    p.handle_established(Epoch(2), Established::Ready, t0);
    assert_eq!(sent(&mut p), vec![Message::TopologyReady { epoch: Epoch(2) }]);
    p.handle_message(Message::TopologyCommitted { epoch: Epoch(2) }, t0).unwrap();
    assert!(matches!(&actions(&mut p)[..], [Action::TakeUp(pos)] if pos.epoch == Epoch(2)));
    assert_eq!(sent(&mut p), vec![Message::VoteUpdateTopology { collectives: 0, measured: None }], "voted again");
    p.handle_message(Message::TopologyVoteAborted { retry: false, reason: apart().into() }, t0).unwrap();
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Misuse(apart())))]);
}

/// A call made while our vote runs (from another thread) waits behind it; the vote then ends with
/// a usage error, and the queued call begins by joining a topology issued meanwhile. That call is
/// our last call made, so nothing ended apart at our point: this broke the peer's own invariant
/// and panicked its driver before (found by the fuzzer).
#[test]
fn a_vote_ended_apart_with_a_call_queued_behind_it_leaves_that_call_to_run() {
    let (mut p, t0) = joined(&[0, 1]);
    p.call(CallKind::UpdateTopology, BOUND, t0);
    assert_eq!(sent(&mut p), vec![Message::VoteUpdateTopology { collectives: 0, measured: None }]);
    p.call(CallKind::Collective(Api::AllReduce, None), BOUND, t0);
    p.handle_message(
        Message::Topology { epoch: Epoch(2), members: members(&[0, 1]).into(), world: 8, limits: None },
        t0,
    )
    .unwrap();
    assert!(matches!(&actions(&mut p)[..], [Action::Establish { position, .. }] if position.epoch == Epoch(2)));
    p.handle_message(Message::TopologyVoteAborted { retry: false, reason: apart().into() }, t0).unwrap();
    let ended = actions(&mut p);
    assert_eq!(ended[0], done(Err(CallError::Misuse(apart()))));
    assert!(matches!(&ended[1..], [Action::Establish { position, .. }] if position.epoch == Epoch(2)), "{ended:?}");
    assert_eq!(p.apart(), None, "the collective is our last call, and it joins the topology");
}

/// Peer 1 ran a collective while peer 2 voted sync_shared_state: both ended with a usage error,
/// and the ring re-formed. This peer was in no call at that point; its sync_shared_state comes
/// later. It used to join the re-formed ring and wait there for the others, who are in no call,
/// until its bound; it ends at once, since the calls at its point ended apart.
#[test]
fn a_vote_after_the_calls_at_its_point_ended_apart_ends_at_once() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    let open = Message::VoteOpened { vote: Vote::SyncSharedState, epoch: Epoch(1), voter: PeerId(2), collectives: 0 };
    p.handle_message(open, t0).unwrap();
    p.handle_message(
        Message::Topology { epoch: Epoch(2), members: members(&[0, 1, 2]).into(), world: 8, limits: None },
        t0,
    )
    .unwrap();
    let misuse = Misuse::new(made(&[2], Made::api(Api::SyncSharedState)), made(&[1], Made::api(Api::AllReduce)));
    p.handle_message(Message::SyncAborted { round: 1, retryable: false, reason: misuse.into() }, t0).unwrap();
    let ballot = SyncBallot { revision: Revision(0), strategy: 0, override_resume: false, entries: vec![] };
    p.call(CallKind::SyncSharedState(ballot.clone()), BOUND, t0);
    // Ours is a sync too: the error names it against the others' unlike call.
    let want = Misuse::settled(made(&[0], Made::api(Api::SyncSharedState)), made(&[1], Made::api(Api::AllReduce)));
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Misuse(want)))]);
    assert!(sent(&mut p).is_empty(), "nothing was voted");
    // Told once: the same call made again is the caller's own choice, and waits as usual.
    p.call(CallKind::SyncSharedState(ballot), BOUND, t0);
    assert!(matches!(&actions(&mut p)[..], [Action::Establish { .. }]), "it follows the re-formed ring");
}

/// A vote that ended apart at another point of this peer's calls (it had started a collective
/// since the announcement), or one that ended to be cast again, says nothing of its next vote.
#[test]
fn a_vote_ended_elsewhere_or_for_a_retry_leaves_the_next_vote_alone() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    let open =
        |collectives| Message::VoteOpened { vote: Vote::PeersPending, epoch: Epoch(1), voter: PeerId(2), collectives };
    p.handle_message(open(1), t0).unwrap();
    p.handle_message(Message::PeersPendingAborted { retry: false, reason: apart().into() }, t0).unwrap();
    p.handle_message(open(0), t0).unwrap();
    p.handle_message(Message::PeersPendingAborted { retry: true, reason: Reason::text("a topology connects") }, t0)
        .unwrap();
    p.call(CallKind::PeersPending, BOUND, t0);
    assert_eq!(sent(&mut p), vec![Message::VotePeersPending { collectives: 0 }]);
    assert!(actions(&mut p).is_empty(), "it waits in its vote");
}

/// This peer's own vote ended as one of the calls that cannot complete together: what the master
/// says of that mismatch next (the collective it aborted at this point, a ballot of another kind)
/// concerns no later call of ours.
#[test]
fn a_peer_told_of_its_own_mismatch_is_not_held_to_it() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    p.call(CallKind::UpdateTopology, BOUND, t0);
    assert_eq!(sent(&mut p), vec![Message::VoteUpdateTopology { collectives: 0, measured: None }]);
    let open = Message::VoteOpened { vote: Vote::SyncSharedState, epoch: Epoch(1), voter: PeerId(2), collectives: 0 };
    p.handle_message(open, t0).unwrap();
    p.handle_message(Message::TopologyVoteAborted { retry: false, reason: apart().into() }, t0).unwrap();
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Misuse(apart())))]);
    p.handle_message(Message::SyncAborted { round: 1, retryable: false, reason: apart().into() }, t0).unwrap();
    let failure = OpFailure::new(FailureKind::Misuse, PeerId(1), "apart");
    p.handle_message(Message::OpAborted { derived: 0, epoch: Epoch(1), seq: 0, failure }, t0).unwrap();
    p.call(CallKind::PeersPending, BOUND, t0);
    assert_eq!(sent(&mut p), vec![Message::VotePeersPending { collectives: 0 }]);
}

/// This peer's vote blocked the others' collective, which they gave up for misuse: its own call
/// failed already, so its next collective is not failed again for that; it follows the
/// re-formed ring and runs.
#[test]
fn a_voter_told_of_the_misuse_runs_its_next_collective() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    p.call(CallKind::PeersPending, BOUND, t0);
    assert_eq!(sent(&mut p), vec![Message::VotePeersPending { collectives: 0 }]);
    p.handle_message(
        Message::Topology { epoch: Epoch(2), members: members(&[0, 1, 2]).into(), world: 8, limits: None },
        t0,
    )
    .unwrap();
    p.handle_message(Message::PeersPendingAborted { retry: false, reason: apart().into() }, t0).unwrap();
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Misuse(apart())))]);
    let failure = OpFailure::new(FailureKind::Misuse, PeerId(1), "apart");
    p.handle_message(Message::OpAborted { derived: 0, epoch: Epoch(1), seq: 0, failure }, t0).unwrap();
    p.call(CallKind::Collective(Api::AllReduce, None), BOUND, t0);
    assert!(matches!(&actions(&mut p)[..], [Action::Establish { .. }]), "it follows the re-formed ring");
}

/// A collective that the others failed while this peer was between calls fails here too,
/// untouched, before it joins the re-formed ring: every member's k-th call has one outcome, and
/// the others, whose calls ended, may not join that ring before their next call.
#[test]
fn a_collective_the_others_failed_first_fails_here_before_it_runs() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    let failure = OpFailure::new(FailureKind::PeerLost, PeerId(2), "gone");
    p.handle_message(Message::OpAborted { derived: 0, epoch: Epoch(1), seq: 0, failure: failure.clone() }, t0).unwrap();
    p.handle_message(
        Message::Topology { epoch: Epoch(2), members: members(&[0, 1]).into(), world: 8, limits: None },
        t0,
    )
    .unwrap();
    p.call(CallKind::Collective(Api::AllReduce, None), BOUND, t0);
    let op = OpId { epoch: Epoch(1), derived: 0, seq: Seq(0) };
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Aborted { op, failure }))], "before it follows the ring");
    // update_topology after that failure has nothing to vote on: the ring re-formed already.
    p.call(CallKind::UpdateTopology, BOUND, t0);
    assert!(matches!(&actions(&mut p)[..], [Action::Establish { .. }]), "the next call follows the re-formed ring");
    p.handle_established(Epoch(2), Established::Ready, t0);
    p.handle_message(Message::TopologyCommitted { epoch: Epoch(2) }, t0).unwrap();
    let ended = actions(&mut p);
    assert!(matches!(&ended[..], [Action::TakeUp(_), Action::Done { result: Ok(Value::TopologyInForce), .. }]));
    assert!(sent(&mut p).iter().all(|m| !matches!(m, Message::VoteUpdateTopology { .. })));
    assert_eq!(start_collective(&mut p, t0), OpId { epoch: Epoch(2), derived: 0, seq: Seq(0) });
}

/// A vote nobody answers ends at the call's bound; a collective called meanwhile waits behind
/// it, then runs within its own bound.
#[test]
fn a_call_ends_at_its_bound_and_calls_behind_it_wait() {
    let (mut p, t0) = joined(&[0, 1]);
    let vote = p.call(CallKind::PeersPending, BOUND, t0);
    let later = t0 + Duration::from_millis(500);
    let collective = p.call(CallKind::Collective(Api::AllReduce, None), BOUND, later);
    assert!(actions(&mut p).is_empty(), "the collective waits for the vote");
    let mut now = t0;
    while now < t0 + BOUND {
        now += Duration::from_millis(250);
        p.handle_message(Message::Heartbeat, now).unwrap();
        p.handle_timeout(now);
    }
    match &tagged_actions(&mut p)[..] {
        [Action::Done { call, result: Err(CallError::Timeout) }, Action::RunCollective { call: c, deadline, .. }] => {
            assert_eq!((*call, *c), (vote, collective));
            assert_eq!(*deadline, later + BOUND);
        }
        other => panic!("expected the vote to end, then the collective to run: {other:?}"),
    }
}

/// A sync votes, fetches what the plan says, reports, and ends as the master says.
#[test]
fn a_sync_votes_fetches_reports_and_ends_with_the_master() {
    let (mut p, t0) = joined(&[0, 1]);
    let entries = vec![StateDigest { name: "w".into(), dtype: 0, shape: vec![2], hash: [1; 32], may_differ: false }];
    let ballot = SyncBallot { revision: Revision(3), strategy: 0, override_resume: false, entries: entries.clone() };
    p.call(CallKind::SyncSharedState(ballot), BOUND, t0);
    let vote = Message::SyncVote { revision: 3, strategy: 0, override_resume: false, entries, collectives: 0 };
    assert_eq!(sent(&mut p), vec![vote]);
    let plan = vec![PlanEntry { hash: [2; 32], donors: vec![PeerId(1)] }];
    p.handle_message(Message::SyncPlan { round: 9, revision: 4, entries: plan.clone() }, t0).unwrap();
    assert_eq!(actions(&mut p), vec![Action::Fetch { round: 9, revision: Revision(4), entries: plan }]);
    // The master's word waits until the fetch reports.
    p.handle_message(Message::SyncComplete { round: 9 }, t0).unwrap();
    assert!(actions(&mut p).is_empty());
    p.handle_fetched(9, Ok::<(), &str>(()), t0);
    assert_eq!(sent(&mut p), vec![Message::SyncDone { round: 9 }]);
    assert_eq!(actions(&mut p), vec![done(Ok(Value::Synced(Revision(4))))]);
}

/// Expulsion is the news, whatever else failed.
#[test]
fn an_expelled_peer_says_so_and_refuses_further_calls() {
    let (mut p, t0) = joined(&[0, 1]);
    let op = start_collective(&mut p, t0);
    p.handle_message(Message::Kicked { reason: "no message for 2.0 s".into() }, t0).unwrap();
    p.handle_disconnect("connection reset".into(), t0);
    assert!(!p.running(op));
    let gone = Gone::Kicked("no message for 2.0 s".into());
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Gone(gone.clone())))]);
    p.call(CallKind::PeersPending, BOUND, t0);
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Gone(gone)))]);
    assert!(sent(&mut p).is_empty(), "nothing more to the master");
}

/// A sync vote that crossed a topology issued meanwhile is refused without being counted: the
/// call joins that topology and votes again, as the other votes do. Failing it instead sent one
/// peer back to the top of its loop while the others synced (a usage error in PCCL's loop).
#[test]
fn a_sync_that_crossed_a_topology_joins_it_and_votes_again() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    let ballot = SyncBallot { revision: Revision(3), strategy: 1, override_resume: false, entries: vec![] };
    p.call(CallKind::SyncSharedState(ballot), BOUND, t0);
    assert!(matches!(&sent(&mut p)[..], [Message::SyncVote { .. }]));
    p.handle_message(
        Message::Topology { epoch: Epoch(2), members: members(&[0, 1]).into(), world: 8, limits: None },
        t0,
    )
    .unwrap();
    let refused =
        Message::SyncAborted { round: 0, retryable: true, reason: Reason::text("topology 2 was being connected") };
    p.handle_message(refused, t0).unwrap();
    assert!(matches!(&actions(&mut p)[..], [Action::Establish { position, .. }] if position.epoch == Epoch(2)));
    p.handle_established(Epoch(2), Established::Ready, t0);
    p.handle_message(Message::TopologyCommitted { epoch: Epoch(2) }, t0).unwrap();
    assert!(matches!(&sent(&mut p)[..], [Message::TopologyReady { .. }, Message::SyncVote { revision: 3, .. }]));
    assert!(matches!(&actions(&mut p)[..], [Action::TakeUp(_)]), "the call goes on");
    // Refused without a topology to join (a newcomer sent back to the others): the call fails,
    // retryably, and the application's loop meets the others.
    let refused = Message::SyncAborted { round: 0, retryable: true, reason: Reason::text("go back") };
    p.handle_message(refused, t0).unwrap();
    let failed = CallError::SyncFailed { retryable: true, reason: "go back".into() };
    assert_eq!(actions(&mut p), vec![done(Err(failed))]);
}

/// A peer with the run's secret proves it on the master's nonce; a refusal ends `connect` with
/// the reason, and nothing more goes to the master.
#[test]
fn a_join_proves_the_secret_on_the_nonce_and_a_refusal_ends_connect() {
    let t0 = crate::test_start();
    let key = RunKey::from_secret(b"s3cret");
    let mut p = Peer::new(
        PeerConfig { heartbeat_timeout: HEARTBEAT_TIMEOUT, key: Some(key.clone()), max_in_flight: 4, reconnect: false },
        t0,
    );
    p.handle_message(Message::Challenge { nonce: [9; 32] }, t0).unwrap();
    p.connect(GroupId(0), "h:0".into(), false, BOUND, t0);
    let join = sent(&mut p);
    assert!(
        matches!(&join[..], [Message::Join { proof, .. }] if key.verify(&[9; 32], proof)),
        "the challenge that came first is answered: {join:?}"
    );
    p.handle_message(Message::AuthFailed { reason: "authentication failed".into() }, t0).unwrap();
    let refused = Gone::AuthFailed("authentication failed".into());
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Gone(refused)))]);
    assert!(sent(&mut p).is_empty());
}

/// Starts `n` collectives at once; returns (call, collective) of each, in call order.
fn start_many(p: &mut Peer, n: usize, now: Instant) -> Vec<(CallId, OpId)> {
    let calls: Vec<CallId> = (0..n).map(|_| p.call(CallKind::Collective(Api::AllReduce, None), BOUND, now)).collect();
    let started: Vec<(CallId, OpId)> = tagged_actions(p)
        .into_iter()
        .map(|a| match a {
            Action::RunCollective { call, op, .. } => (call, op),
            other => panic!("expected collectives to run: {other:?}"),
        })
        .collect();
    assert_eq!(started.iter().map(|(c, _)| *c).collect::<Vec<_>>(), calls);
    started
}

fn confirm(p: &mut Peer, op: OpId, now: Instant) {
    p.handle_collective(op, OpProgress::DataDone, now);
    p.handle_collective(op, OpProgress::Confirmed, now);
}

/// Collectives run several at once, numbered in call order, and each ends on its own, in any
/// order; one past the limit waits for a slot; a vote waits until every collective before it
/// ended, and counts them all.
#[test]
fn collectives_overlap_up_to_the_limit_and_a_vote_waits_for_them() {
    let (mut p, t0) = joined(&[0, 1]);
    let running = start_many(&mut p, 4, t0);
    let seqs: Vec<u64> = running.iter().map(|(_, op)| op.seq.0).collect();
    assert_eq!(seqs, vec![0, 1, 2, 3]);
    let fifth = p.call(CallKind::Collective(Api::AllReduce, None), BOUND, t0);
    assert!(actions(&mut p).is_empty(), "four are in flight already");
    let vote = p.call(CallKind::PeersPending, BOUND, t0);
    confirm(&mut p, running[2].1, t0);
    let ended = tagged_actions(&mut p);
    assert!(
        matches!(&ended[..], [Action::Done { call, result: Ok(Value::Collective(op)) }, Action::RunCollective { call: c, op: fifth_op, .. }]
            if *call == running[2].0 && *op == running[2].1 && *c == fifth && fifth_op.seq == Seq(4)),
        "{ended:?}"
    );
    for (_, op) in [running[3], running[0], running[1]] {
        confirm(&mut p, op, t0);
    }
    assert!(sent(&mut p).is_empty(), "the vote waits for the last collective");
    confirm(&mut p, OpId { epoch: Epoch(1), derived: 0, seq: Seq(4) }, t0);
    assert_eq!(sent(&mut p), vec![Message::VotePeersPending { collectives: 5 }]);
    p.handle_message(Message::PeersPendingResult { pending: false }, t0).unwrap();
    let ended = tagged_actions(&mut p);
    assert_eq!(ended.last(), Some(&Action::Done { call: vote, result: Ok(Value::Pending(false)) }));
    assert!(!p.busy());
}

/// A collective committed while an earlier one still runs says nothing of the earlier one: the
/// master's query about it is answered only once it commits here.
#[test]
fn a_query_about_a_collective_still_running_waits_though_a_later_one_committed() {
    let (mut p, t0) = joined(&[0, 1]);
    let running = start_many(&mut p, 2, t0);
    confirm(&mut p, running[1].1, t0);
    p.handle_message(Message::OpQuery { derived: 0, epoch: Epoch(1), seq: 0 }, t0).unwrap();
    assert!(sent(&mut p).is_empty(), "collective 0 has not committed here");
    confirm(&mut p, running[0].1, t0);
    assert_eq!(
        sent(&mut p),
        vec![Message::OpDone { derived: 0, members: Vec::new(), epoch: Epoch(1), seq: 0, decided: true }]
    );
}

/// A member lost with several collectives in flight: each is reported and aborted on its own;
/// a collective the others had started without us fails here too, before any runs, as theirs
/// did, and the next call joins the re-formed ring.
#[test]
fn a_lost_member_aborts_every_collective_in_flight_and_the_missed_ones_fail_alike() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    let running = start_many(&mut p, 2, t0);
    let lost = OpFailure::new(FailureKind::PeerLost, PeerId(2), "gone");
    // The others had started collectives 2 and 3 too: the master aborted all four.
    for seq in 0..4 {
        let abort = Message::OpAborted { derived: 0, epoch: Epoch(1), seq, failure: lost.clone() };
        p.handle_message(abort, t0).unwrap();
    }
    let ended = tagged_actions(&mut p);
    assert_eq!(ended.len(), 2, "{ended:?}");
    for (a, (call, op)) in ended.iter().zip(&running) {
        assert_eq!(
            *a,
            Action::Done { call: *call, result: Err(CallError::Aborted { op: *op, failure: lost.clone() }) }
        );
    }
    p.handle_message(
        Message::Topology { epoch: Epoch(2), members: members(&[0, 1]).into(), world: 8, limits: None },
        t0,
    )
    .unwrap();
    for seq in [2, 3] {
        let retry = p.call(CallKind::Collective(Api::AllReduce, None), BOUND, t0);
        let missed = OpId { epoch: Epoch(1), derived: 0, seq: Seq(seq) };
        assert_eq!(
            tagged_actions(&mut p),
            vec![Action::Done { call: retry, result: Err(CallError::Aborted { op: missed, failure: lost.clone() }) }]
        );
    }
    p.call(CallKind::Collective(Api::AllReduce, None), BOUND, t0);
    assert!(matches!(&actions(&mut p)[..], [Action::Establish { .. }]), "the next call follows the re-formed ring");
    p.handle_established(Epoch(2), Established::Ready, t0);
    p.handle_message(Message::TopologyCommitted { epoch: Epoch(2) }, t0).unwrap();
    match &actions(&mut p)[..] {
        [Action::TakeUp(_), Action::RunCollective { op, .. }] => {
            assert_eq!(*op, OpId { epoch: Epoch(2), derived: 0, seq: Seq(0) })
        }
        other => panic!("{other:?}"),
    }
}

/// A broken control connection is dialed again: the vote in progress ends with a retryable error
/// (the master's count of it is lost), nothing goes out until the new connection is challenged,
/// then `Rejoin` goes first; once the master took us back, calls work as before.
#[test]
fn a_broken_connection_interrupts_the_vote_and_the_peer_rejoins() {
    let (mut p, t0) = joined_with(&[0, 1], true);
    p.call(CallKind::PeersPending, BOUND, t0);
    assert_eq!(sent(&mut p), vec![Message::VotePeersPending { collectives: 0 }]);
    let t1 = t0 + Duration::from_millis(100);
    p.handle_disconnect("reset by peer".into(), t1);
    match &actions(&mut p)[..] {
        [Action::Done { result: Err(CallError::Interrupted(why)), .. }] => {
            assert!(why.contains("peers_pending"), "{why}")
        }
        other => panic!("expected the vote to be interrupted: {other:?}"),
    }
    assert_eq!(p.reconnecting(), Some(t1 + HEARTBEAT_TIMEOUT));
    assert_eq!(p.gone(), None);
    // Calls made meanwhile wait for the connection; no heartbeat goes out on none.
    p.call(CallKind::PeersPending, BOUND, t1);
    p.handle_timeout(t1 + Duration::from_secs(1));
    assert!(sent(&mut p).is_empty());
    let t2 = t1 + Duration::from_millis(1500);
    p.handle_reconnected([9; 32], t2);
    assert_eq!(p.reconnecting(), None, "dialed: the driver stops");
    assert_eq!(
        sent(&mut p),
        vec![
            Message::Rejoin { peer: PeerId(0), session: SessionId(7), proof: [0; 32] },
            Message::VotePeersPending { collectives: 0 }
        ]
    );
    let back = Message::Registered { peer: PeerId(0), session: SessionId(7), heartbeat_ms: 100, data_key: [5; 32] };
    assert_eq!(p.handle_message(back, t2), Ok(PeerEvent::Rejoined));
    p.handle_message(Message::PeersPendingResult { pending: false }, t2).unwrap();
    assert_eq!(actions(&mut p), vec![done(Ok(Value::Pending(false)))]);
    // The bound of the old connection no longer applies.
    p.handle_timeout(t1 + HEARTBEAT_TIMEOUT + Duration::from_millis(10));
    assert_eq!(p.gone(), None);
}

/// A newcomer waiting for its catch-up's plan asks the master that took it back again (a
/// restarted one knows nothing of it); once the plan came, it does not; once it ended, it says
/// so again.
#[test]
fn a_catch_up_without_its_plan_asks_again_after_a_rejoin() {
    let (mut p, t0) = joined_with(&[0, 1], true);
    let entries =
        vec![shoal_wire::StateDigest { name: "w".into(), dtype: 11, shape: vec![4], hash: [1; 32], may_differ: false }];
    p.catch_up_start(entries.clone());
    assert_eq!(sent(&mut p), vec![Message::CatchUpStart { entries: entries.clone() }]);
    let rejoin = |p: &mut Peer, t: Instant| {
        p.handle_disconnect("the master restarted".into(), t);
        p.handle_reconnected([9; 32], t);
        let back = Message::Registered { peer: PeerId(0), session: SessionId(7), heartbeat_ms: 100, data_key: [5; 32] };
        assert_eq!(p.handle_message(back, t), Ok(PeerEvent::Rejoined));
        sent(p).into_iter().filter(|m| !matches!(m, Message::Rejoin { .. })).collect::<Vec<_>>()
    };
    let t1 = t0 + Duration::from_millis(100);
    assert_eq!(rejoin(&mut p, t1), vec![Message::CatchUpStart { entries }]);
    let plan =
        Message::CatchUpPlan { round: 0, revision: 0, entries: Vec::new(), donors: Vec::new(), reason: String::new() };
    p.handle_message(plan, t1).unwrap();
    assert!(p.take_catch_up_plan().is_some());
    assert_eq!(rejoin(&mut p, t1 + Duration::from_millis(100)), Vec::<Message>::new(), "planned: nothing to ask");
    p.catch_up_end(true, 5);
    assert_eq!(sent(&mut p), vec![Message::CatchUpEnd { fetched: true, revision: 5 }]);
    assert_eq!(
        rejoin(&mut p, t1 + Duration::from_millis(200)),
        vec![Message::CatchUpEnd { fetched: true, revision: 5 }]
    );
}

/// A collective that finished here and asked the master for its verdict asks the restarted master
/// again once rejoined; a master not back within a heartbeat timeout is lost, and every call
/// ends.
#[test]
fn a_collective_asks_again_after_a_rejoin_and_a_master_not_back_is_lost() {
    let (mut p, t0) = joined_with(&[0, 1], true);
    let op = start_collective(&mut p, t0);
    p.handle_collective(op, OpProgress::DataDone, t0);
    p.handle_collective(op, OpProgress::LapBroken("stream closed".into()), t0);
    let asking = Message::OpDone { derived: 0, members: Vec::new(), epoch: op.epoch, seq: op.seq.0, decided: false };
    assert_eq!(sent(&mut p), vec![asking.clone()]);
    p.handle_disconnect("reset by peer".into(), t0);
    p.handle_reconnected([9; 32], t0 + Duration::from_millis(300));
    let back = Message::Registered { peer: PeerId(0), session: SessionId(7), heartbeat_ms: 100, data_key: [5; 32] };
    p.handle_message(back, t0 + Duration::from_millis(300)).unwrap();
    let out = sent(&mut p);
    assert_eq!(out.last(), Some(&asking), "asked again: {out:?}");
    assert!(matches!(out[0], Message::Rejoin { .. }));

    p.handle_disconnect("reset again".into(), t0 + Duration::from_secs(1));
    let until = p.reconnecting().expect("dialing");
    p.handle_timeout(until);
    assert!(matches!(p.gone(), Some(Gone::MasterLost(why)) if why.contains("not back within")));
    assert!(matches!(&actions(&mut p)[..], [Action::Done { result: Err(CallError::Gone(Gone::MasterLost(_))), .. }]));
}

/// Without `reconnect` (the simulation's peers), a broken connection loses the master at once.
#[test]
fn without_reconnect_a_broken_connection_loses_the_master() {
    let (mut p, t0) = joined(&[0]);
    p.handle_disconnect("reset by peer".into(), t0);
    assert_eq!(p.reconnecting(), None);
    assert!(matches!(p.gone(), Some(Gone::MasterLost(_))));
}

/// A lost master and a closed peer are for good: no broken connection, silence or protocol
/// error brings either back to dialing, and closing a peer whose master is lost says closed.
#[test]
fn a_lost_master_and_a_closed_peer_stay_so() {
    let (mut p, t0) = joined_with(&[0, 1], true);
    p.handle_timeout(t0 + HEARTBEAT_TIMEOUT * 2);
    assert!(matches!(p.gone(), Some(Gone::MasterLost(why)) if why.contains("no message")));
    p.handle_disconnect("reset by peer".into(), t0 + HEARTBEAT_TIMEOUT * 2);
    assert_eq!(p.reconnecting(), None, "a silent master is not dialed again");
    p.close(t0 + HEARTBEAT_TIMEOUT * 3);
    assert_eq!(p.gone(), Some(Gone::Closed));

    let (mut p, t0) = joined_with(&[0, 1], true);
    p.close(t0);
    p.handle_disconnect("closed by us".into(), t0);
    let _ = p.handle_message(Message::Challenge { nonce: [1; 32] }, t0);
    p.handle_timeout(t0 + HEARTBEAT_TIMEOUT * 2);
    assert_eq!((p.gone(), p.reconnecting(), p.poll_timeout()), (Some(Gone::Closed), None, None));
}

fn waits(peer: u32, collectives: u64) -> Message {
    Message::P2pWaits { peer: PeerId(peer), any: false, send: false, tag: 3, seen: 0, epoch: Epoch(1), collectives }
}

/// What [`waits`] tells us.
fn waits_note(collectives: u64) -> WaitNote {
    WaitNote { any: false, send: false, tag: 3, seen: 0, point: (Epoch(1), collectives) }
}

/// A member's transfer waits on us while we vote: the driver is asked to judge it, by what its
/// engine holds; the verdict goes to the master, which ends the wait and our vote. A transfer of
/// ours the master says can never complete ends our p2p call (the driver's), and we are told, as
/// after a vote ended so.
#[test]
fn a_transfer_waiting_on_us_is_judged_by_the_driver_and_its_verdict_goes_to_the_master() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    p.call(CallKind::UpdateTopology, BOUND, t0);
    let call = CallId(2);
    assert_eq!(p.voting(call), Some(Api::UpdateTopology));
    assert_eq!(p.voting(CallId(1)), None, "another call");
    sent(&mut p);
    p.handle_message(waits(2, 0), t0).unwrap();
    assert_eq!(actions(&mut p), vec![Action::MemberWaits(PeerId(2))]);
    // Not for another call of ours, nor while our engine holds what the transfer waits for.
    p.judge_waiters(CallId(1), None, |_, _| true, t0);
    p.judge_waiters(call, None, |_, _| false, t0);
    assert!(sent(&mut p).is_empty());
    p.judge_waiters(call, None, |waiter, note| waiter == PeerId(2) && note.tag == 3, t0);
    let [Message::P2pApart { peer: PeerId(2), misuse }] = &sent(&mut p)[..] else { panic!("judged apart") };
    let recv = Made::Transfer { send: false, peer: PeerId(0), tag: 3 };
    assert_eq!(misuse, &Misuse::new(made(&[2], recv), made(&[0], Made::api(Api::UpdateTopology))));
    assert_eq!(p.waiters().count(), 0);
    // Our own wait, announced at our point, and the master's answer to it.
    p.p2p_waits(PeerId(1), true, 9, 0);
    let ours =
        Message::P2pWaits { peer: PeerId(1), any: false, send: true, tag: 9, seen: 0, epoch: Epoch(1), collectives: 0 };
    assert_eq!(sent(&mut p), vec![ours]);
    p.handle_message(Message::P2pApart { peer: PeerId(1), misuse: ours_apart_from(1) }, t0).unwrap();
    assert_eq!(actions(&mut p), vec![Action::P2pApart { peer: PeerId(1), misuse: ours_apart_from(1) }]);
    assert!(p.view.told);
}

/// Found by the chaos round in CI: a member's transfer waited on us while we were in the vote
/// that ends `optimize_topology` (a call that starts with a collective), and a debug assertion
/// took that vote for a collective and panicked.
#[test]
fn a_transfer_waiting_on_us_in_optimize_topologys_vote_is_judged_too() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    p.call(CallKind::OptimizeTopology(Vec::new()), BOUND, t0);
    let call = CallId(2);
    assert_eq!(p.voting(call), Some(Api::OptimizeTopology));
    sent(&mut p);
    p.handle_message(waits(2, 0), t0).unwrap();
    assert_eq!(actions(&mut p), vec![Action::MemberWaits(PeerId(2))]);
    p.judge_waiters(call, None, |_, _| true, t0);
    let [Message::P2pApart { peer: PeerId(2), misuse }] = &sent(&mut p)[..] else { panic!("judged apart") };
    let recv = Made::Transfer { send: false, peer: PeerId(0), tag: 3 };
    assert_eq!(misuse, &Misuse::new(made(&[2], recv), made(&[0], Made::api(Api::OptimizeTopology))));
}

/// The vote our transfer waited on ends for another member's transfer a moment before the master
/// tells us that ours ends too: that vote's end concerns the call it ends, ours, and not the next
/// one, which is cast (it once failed with the other member's reason).
#[test]
fn a_waiter_told_after_the_vote_it_waited_on_ended_makes_its_next_call() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    let open = Message::VoteOpened { vote: Vote::UpdateTopology, epoch: Epoch(1), voter: PeerId(1), collectives: 0 };
    p.handle_message(open, t0).unwrap();
    p.p2p_waits(PeerId(1), true, 3, 0);
    sent(&mut p);
    let other = Misuse::new(made(&[2], Made::api(Api::AllReduce)), made(&[1], Made::api(Api::UpdateTopology)));
    p.handle_message(Message::TopologyVoteAborted { retry: false, reason: other.into() }, t0).unwrap();
    p.handle_message(Message::P2pApart { peer: PeerId(1), misuse: ours_apart_from(1) }, t0).unwrap();
    assert_eq!(actions(&mut p), vec![Action::P2pApart { peer: PeerId(1), misuse: ours_apart_from(1) }]);
    p.call(CallKind::PeersPending, BOUND, t0);
    assert_eq!(sent(&mut p), vec![Message::VotePeersPending { collectives: 0 }], "our next call is our own");
    assert_eq!(actions(&mut p), vec![]);
}

/// Out of calls, with our last call ended as one of calls that cannot complete together: a member
/// waiting on us at that very point can never meet it, and ends at once without the driver; one
/// at another point is the driver's to judge.
#[test]
fn a_wait_at_the_point_where_our_call_ended_apart_ends_at_once() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    p.call(CallKind::UpdateTopology, BOUND, t0);
    sent(&mut p);
    // A wait that came while we voted, which the driver had no time to judge: settled as the
    // vote ends.
    p.handle_message(waits(3, 0), t0).unwrap();
    p.handle_message(Message::TopologyVoteAborted { retry: false, reason: apart().into() }, t0).unwrap();
    assert_eq!(actions(&mut p), vec![Action::MemberWaits(PeerId(3)), done(Err(CallError::Misuse(apart())))]);
    assert!(matches!(&sent(&mut p)[..], [Message::P2pApart { peer: PeerId(3), .. }]));
    assert_eq!(p.apart(), Some((Epoch(1), 0, Made::api(Api::UpdateTopology))));
    p.handle_message(waits(1, 5), t0).unwrap();
    assert_eq!(actions(&mut p), vec![Action::MemberWaits(PeerId(1))], "another point: the driver judges");
    p.handle_message(waits(2, 0), t0).unwrap();
    assert!(actions(&mut p).is_empty());
    let [Message::P2pApart { peer: PeerId(2), misuse }] = &sent(&mut p)[..] else { panic!("answered at once") };
    let recv = Made::Transfer { send: false, peer: PeerId(0), tag: 3 };
    assert_eq!(misuse, &Misuse::settled(made(&[2], recv), made(&[0], Made::api(Api::UpdateTopology))));
    // A new call: the point of the old one says nothing any more, and the driver judges the
    // member still waiting against it; a collective likewise, once it runs.
    p.call(CallKind::UpdateTopology, BOUND, t0);
    assert_eq!(p.apart(), None);
    assert_eq!(actions(&mut p), vec![Action::MemberWaits(PeerId(1))]);
    p.handle_message(Message::TopologyVoteAborted { retry: false, reason: apart().into() }, t0).unwrap();
    actions(&mut p);
    p.call(CallKind::Collective(Api::AllReduce, None), BOUND, t0);
    assert!(matches!(&actions(&mut p)[..], [Action::RunCollective { .. }, Action::MemberWaits(PeerId(1))]));
}

/// A member waits on a transfer with us while we run a collective it has not started: the
/// collective fails before the waiter hears why, so that the master re-forms the ring before the
/// waiter's call ends, and the waiter's next call finds the new topology (it once ran the failed
/// collective's number again in the old one, and failed with the same usage error).
#[test]
fn a_collective_a_waiter_never_joins_fails_before_the_waiter_hears_of_it() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    p.call(CallKind::Collective(Api::Barrier, None), BOUND, t0);
    let [Action::RunCollective { op, .. }] = actions(&mut p)[..] else { panic!("runs") };
    p.handle_message(waits(1, 0), t0).unwrap();
    p.handle_message(waits(2, 1), t0).unwrap();
    assert_eq!(actions(&mut p), vec![Action::MemberWaits(PeerId(1)), Action::MemberWaits(PeerId(2))]);
    // Peer 2 started our collective already: it moves without its call.
    p.judge_waiters(CallId(2), Some((op, Api::Barrier)), |_, _| true, t0);
    let barrier =
        Made::Api { api: Api::Barrier, at: Some(shoal_wire::Point { epoch: op.epoch, collectives: op.seq.0 }) };
    let misuse = p2p_misuse(PeerId(1), &waits_note(0), PeerId(0), barrier, false);
    assert_eq!(misuse.ours, made(&[1], Made::Transfer { send: false, peer: PeerId(0), tag: 3 }));
    let failure = OpFailure::misuse(PeerId(0), misuse.clone());
    let failed = Message::OpFailed { derived: 0, members: Vec::new(), epoch: op.epoch, seq: op.seq.0, failure };
    assert_eq!(sent(&mut p), vec![failed, Message::P2pApart { peer: PeerId(1), misuse }]);
    assert_eq!(p.waiters().map(|(w, _)| w).collect::<Vec<_>>(), vec![PeerId(2)]);
}

/// A member's receive from any member waits on our collective: our verdict goes to the master,
/// but our collective goes on (another member may still send to it), and runs with the waiter
/// once its receive ends. The waiter, told every member's verdict, ends only a receive that
/// still found nothing to take.
#[test]
fn a_receive_from_any_member_judged_apart_leaves_our_collective_running() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    p.call(CallKind::Collective(Api::Barrier, None), BOUND, t0);
    let [Action::RunCollective { op, .. }] = actions(&mut p)[..] else { panic!("runs") };
    let any = Message::P2pWaits {
        peer: PeerId(1),
        any: true,
        send: false,
        tag: 3,
        seen: u64::MAX,
        epoch: Epoch(1),
        collectives: 0,
    };
    p.handle_message(any, t0).unwrap();
    assert_eq!(actions(&mut p), vec![Action::MemberWaits(PeerId(1))]);
    p.judge_waiters(CallId(2), Some((op, Api::Barrier)), |_, note| note.any, t0);
    let [Message::P2pApart { peer: PeerId(1), .. }] = &sent(&mut p)[..] else { panic!("only the verdict") };
    assert!(actions(&mut p).is_empty() && p.waiters().count() == 0, "our barrier still runs");
    // The waiter's end: the master's answer for a receive from any member.
    let mut transfers: Transfers<(), &str> = Transfers::default();
    let recv = Transfer::new(PeerId::ANY, None, false, 3, Epoch(1), t0 + BOUND, ());
    transfers.start(CallId(9), recv);
    assert_eq!(transfers.get(CallId(9)).unwrap().call().to_string(), "recv from any member (p2p, tag 3)");
    let (mut waiter, _) = joined(&[0, 1, 2]);
    assert!(transfers.handle_waiting(CallId(9), P2P_PATIENCE, || Some(u64::MAX), &mut waiter));
    let [Message::P2pWaits { peer: PeerId::ANY, any: true, .. }] = &sent(&mut waiter)[..] else { panic!("announced") };
    let ours = made(&[0], Made::Transfer { send: false, peer: PeerId::ANY, tag: 3 });
    let misuse = Misuse::new(ours, made(&[1, 2], Made::api(Api::Barrier)));
    assert!(!transfers.handle_apart(PeerId::ANY, misuse.clone(), |_| false), "it took a send meanwhile");
    assert!(transfers.poll_ended().is_none() && !transfers.announced(CallId(9)));
    assert!(transfers.handle_waiting(CallId(9), P2P_PATIENCE, || Some(u64::MAX), &mut waiter));
    assert!(transfers.handle_apart(PeerId::ANY, misuse.clone(), |_| true));
    let ended = transfers.poll_ended().expect("ended");
    assert_eq!(ended.result, Err(Stop::Apart(misuse)));
}

/// What the engine says of a transfer that ended before it matched.
const UNMATCHED: EngineEnd = EngineEnd { matched: None, uncertain: false };

/// A send whose every part was written fails with its links (here a third member's loss) before
/// the receiver's `Received` came: only the receiver knows whether every part arrived. The sender
/// asks it through the master, asks again after [`ASK_AGAIN`] (the master may have restarted),
/// waits through a new topology, and ends as the receiver's end did; the receiver answers from
/// what ended there, or once its transfer still in flight ends, and "failed" for one it never had.
#[test]
fn a_transfer_whose_links_failed_at_the_other_ends_word_ends_as_it_did_there() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    let (mut transfers, call) = transfer(t0);
    let uncertain = EngineEnd { matched: Some((5, PeerId(1))), uncertain: true };
    transfers.handle_engine(call, Err("connection closed"), true, uncertain, &mut p, t0);
    let ask = Message::P2pOutcome { peer: PeerId(1), epoch: Epoch(1), number: 5, send: true };
    assert_eq!(sent(&mut p), vec![ask.clone()]);
    assert!(transfers.asking() && ended(&mut transfers).is_empty(), "it asks, not fails");
    transfers.handle_taken_up(Epoch(2), &mut p, t0);
    transfers.handle_stalled(&mut p, t0 + APART_GRACE);
    assert!(ended(&mut transfers).is_empty(), "neither a new topology nor the grace ends it");
    assert_eq!(transfers.poll_timeout(), Some(t0 + ASK_AGAIN));
    transfers.handle_stalled(&mut p, t0 + ASK_AGAIN);
    assert_eq!(sent(&mut p), vec![ask], "asked again");
    let told = |peer, number| TransferName { peer: PeerId(peer), epoch: Epoch(1), number, send: true };
    transfers.handle_decided(told(2, 5), false);
    transfers.handle_decided(told(1, 4), false);
    assert!(ended(&mut transfers).is_empty(), "answers to other questions");
    transfers.handle_decided(told(1, 5), true);
    assert_eq!(ended(&mut transfers), vec![(call, Ok(()))]);
    // Told "failed", it fails with its own error; the other end removed, or we (expelled while
    // frozen: a soak's finding, whose transfer asked until its bound), too; its bound holds.
    for how in ["failed", "removed", "expelled", "bound"] {
        let (mut p, t0) = joined(&[0, 1, 2]);
        let (mut transfers, call) = transfer(t0);
        transfers.handle_engine(call, Err("connection closed"), true, uncertain, &mut p, t0);
        let at = match how {
            "failed" => {
                transfers.handle_decided(told(1, 5), false);
                t0
            }
            "removed" => {
                p.handle_message(Message::PeerRemoved { peer: PeerId(1) }, t0).unwrap();
                t0
            }
            "expelled" => {
                p.handle_message(Message::Kicked { reason: "no message for 1.5 s".into() }, t0).unwrap();
                t0
            }
            _ => t0 + BOUND,
        };
        transfers.handle_stalled(&mut p, at);
        let stop = if how == "bound" { Stop::Timeout } else { Stop::Failed("connection closed") };
        assert_eq!(ended(&mut transfers), vec![(call, Err(stop))], "{how}");
    }

    // The receiver's side: peer 1 asks about its send #5 to us, and #6, and #7 we never had.
    let (mut p, t0) = joined(&[0, 1, 2]);
    let mut transfers: Transfers<(), &'static str> = Transfers::default();
    for (c, n) in [(1, 5), (2, 6)] {
        transfers.start(CallId(c), Transfer::new(PeerId(1), Some(1), false, 3, Epoch(1), t0 + BOUND, ()));
        let matched = EngineEnd { matched: Some((n, PeerId(1))), uncertain: false };
        if n == 5 {
            transfers.handle_engine(CallId(c), Ok(()), false, matched, &mut p, t0);
        }
    }
    ended(&mut transfers);
    let in_flight = |call: CallId| (call == CallId(2)).then_some((6, PeerId(1)));
    for n in [5, 6, 7] {
        transfers.handle_outcome_asked(told(1, n), in_flight, &mut p);
    }
    let answer = |number, done| Message::P2pDecided { peer: PeerId(1), epoch: Epoch(1), number, send: true, done };
    assert_eq!(sent(&mut p), vec![answer(5, true), answer(7, false)], "#6 is answered as it ends");
    transfers.handle_stalled(&mut p, t0 + BOUND);
    assert_eq!(ended(&mut transfers), vec![(CallId(2), Err(Stop::Timeout))]);
    transfers.handle_stalled(&mut p, t0 + BOUND);
    assert_eq!(sent(&mut p), vec![answer(6, false)]);
}

/// A transfer of ours with peer 1, in topology 1, bound at [`BOUND`].
fn transfer(t0: Instant) -> (Transfers<(), &'static str>, CallId) {
    let mut transfers = Transfers::default();
    transfers.start(CallId(9), Transfer::new(PeerId(1), Some(1), true, 3, Epoch(1), t0 + BOUND, ()));
    (transfers, CallId(9))
}

fn ended(transfers: &mut Transfers<(), &'static str>) -> Vec<(CallId, Result<(), Stop<&'static str>>)> {
    std::iter::from_fn(|| transfers.poll_ended()).map(|e| (e.call, e.result)).collect()
}

/// Lost streams may be a third member's call ending apart from ours at our point (its new
/// topology closes them): the loss waits [`APART_GRACE`] for the verdict that settles the point,
/// and ends the transfer as a usage error with it; without news, the loss stands.
#[test]
fn a_lost_transfer_waits_a_grace_for_the_news_that_settles_its_point() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    let (mut transfers, call) = transfer(t0);
    transfers.handle_engine(call, Err("connection closed"), true, UNMATCHED, &mut p, t0);
    transfers.handle_stalled(&mut p, t0 + APART_GRACE / 2);
    assert!(ended(&mut transfers).is_empty(), "held");
    let recv = Made::Transfer { send: false, peer: PeerId(0), tag: 3 };
    let failure = OpFailure::misuse(PeerId(2), Misuse::new(made(&[2], Made::api(Api::Barrier)), made(&[1], recv)));
    p.handle_message(Message::OpAborted { derived: 0, epoch: Epoch(1), seq: 0, failure }, t0).unwrap();
    transfers.handle_stalled(&mut p, t0 + APART_GRACE / 2);
    // Our send to peer 1 is one of the calls there, unlike peer 2's barrier.
    let send = made(&[0], Made::Transfer { send: true, peer: PeerId(1), tag: 3 });
    let apart = Stop::Apart(Misuse::settled(send, made(&[2], Made::api(Api::Barrier))));
    assert_eq!(ended(&mut transfers), vec![(call, Err(apart))]);

    let (mut p, t0) = joined(&[0, 1, 2]);
    let (mut transfers, call) = transfer(t0);
    transfers.handle_engine(call, Err("connection closed"), true, UNMATCHED, &mut p, t0);
    assert_eq!(transfers.poll_timeout(), Some(t0 + APART_GRACE));
    transfers.handle_stalled(&mut p, t0 + APART_GRACE);
    assert_eq!(ended(&mut transfers), vec![(call, Err(Stop::Failed("connection closed")))]);
    // Any other failure ends it at once.
    let (mut transfers, call) = transfer(t0);
    transfers.handle_engine(call, Err("count differs"), false, UNMATCHED, &mut p, t0);
    assert_eq!(ended(&mut transfers), vec![(call, Err(Stop::Failed("count differs")))]);
}

/// The caller's wait is announced once it passed [`P2P_PATIENCE`] with nothing matched, once; the
/// master's answer ends the transfer; a wait that ends otherwise is resumed.
#[test]
fn a_long_wait_is_announced_once_and_ends_by_the_answer_or_a_resume() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    let (mut transfers, call) = transfer(t0);
    assert!(!transfers.handle_waiting(call, P2P_PATIENCE / 2, || Some(0), &mut p));
    assert!(!transfers.handle_waiting(call, P2P_PATIENCE, || None, &mut p), "matched: nothing to ask");
    assert!(transfers.handle_waiting(call, P2P_PATIENCE, || Some(4), &mut p));
    let waits =
        Message::P2pWaits { peer: PeerId(1), any: false, send: true, tag: 3, seen: 4, epoch: Epoch(1), collectives: 0 };
    assert_eq!(sent(&mut p), vec![waits]);
    assert!(!transfers.handle_waiting(call, P2P_PATIENCE * 2, || Some(4), &mut p), "announced already");
    let waits_on_1 = Misuse::new(made(&[0], Made::api(Api::AllReduce)), made(&[1], Made::api(Api::PeersPending)));
    assert!(!transfers.handle_apart(PeerId(2), apart(), |_| true), "not the member it waits on");
    assert!(transfers.handle_apart(PeerId(1), waits_on_1.clone(), |_| true));
    assert_eq!(ended(&mut transfers), vec![(call, Err(Stop::Apart(waits_on_1)))]);
    transfers.handle_resumed(call, &mut p);
    assert!(sent(&mut p).is_empty(), "the master ended the wait itself");

    let (mut transfers, call) = transfer(t0);
    transfers.handle_waiting(call, P2P_PATIENCE, || Some(0), &mut p);
    sent(&mut p);
    transfers.handle_engine(call, Ok(()), false, UNMATCHED, &mut p, t0);
    assert_eq!(ended(&mut transfers), vec![(call, Ok(()))]);
    transfers.handle_resumed(call, &mut p);
    assert_eq!(sent(&mut p), vec![Message::P2pResumed { peer: PeerId(1) }]);
}

/// A transfer ends at its bound, when a topology taken up replaces its own, or when the master
/// issues one (a grace later, as a loss).
#[test]
fn a_transfer_ends_at_its_bound_or_when_its_topology_is_replaced() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    let (mut transfers, call) = transfer(t0);
    transfers.handle_stalled(&mut p, t0 + BOUND);
    assert_eq!(ended(&mut transfers), vec![(call, Err(Stop::Timeout))]);
    let (mut transfers, call) = transfer(t0);
    transfers.handle_taken_up(Epoch(2), &mut p, t0);
    assert_eq!(ended(&mut transfers), vec![(call, Err(Stop::Superseded(Epoch(2))))]);
    let (mut transfers, call) = transfer(t0);
    p.handle_message(
        Message::Topology { epoch: Epoch(2), members: members(&[0, 1]).into(), world: 8, limits: None },
        t0,
    )
    .unwrap();
    actions(&mut p);
    transfers.handle_stalled(&mut p, t0);
    assert!(ended(&mut transfers).is_empty(), "held for the news");
    transfers.handle_stalled(&mut p, t0 + APART_GRACE);
    assert_eq!(ended(&mut transfers), vec![(call, Err(Stop::Replaced))]);
}

/// A collective with a deadline asks the master whom it runs among, and waits for the answer
/// before moving anything: it runs among the members named (its group's ranks in the ring), or,
/// named out, ends at once as left out, counted as the collective it was; a decision heard before
/// the call ends it without asking.
#[test]
fn a_collective_with_a_deadline_runs_among_the_members_the_master_names() {
    let (mut p, t0) = joined(&[0, 1, 2]);
    let cutoff = Cutoff { deadline: Duration::from_millis(250), min: 2 };
    let call = p.call(CallKind::Gathered(Api::AllReduce, cutoff, None), BOUND, t0);
    assert_eq!(
        sent(&mut p),
        vec![Message::Gather { epoch: Epoch(1), seq: 0, deadline_ms: 250, min: 2, needs: vec![] }]
    );
    assert!(tagged_actions(&mut p).is_empty(), "nothing moves before the master names the members");
    let op = OpId { epoch: Epoch(1), derived: 0, seq: Seq(0) };
    let included = vec![PeerId(0), PeerId(2)];
    p.handle_message(Message::Gathered { epoch: Epoch(1), seq: 0, included, pending: true }, t0).unwrap();
    match &tagged_actions(&mut p)[..] {
        [Action::RunCollective { call: c, op: o, group, .. }] => {
            assert_eq!((*c, *o, &group[..]), (call, op, &[0, 2][..]));
        }
        other => panic!("expected the collective to run among two: {other:?}"),
    }
    assert!(p.running(op));
    p.handle_collective(op, OpProgress::DataDone, t0);
    p.handle_collective(op, OpProgress::Confirmed, t0);
    assert_eq!(actions(&mut p), vec![done(Ok(Value::Collective(op)))]);
    assert_eq!(p.pending_at(op), Some(true), "the decision's word on newcomers outlives the call");
    // Since it runs among those, the master hears that it committed here.
    assert_eq!(
        sent(&mut p),
        vec![Message::OpDone { epoch: Epoch(1), derived: 0, seq: 0, members: vec![], decided: true }]
    );
    // Named out of the next one: nothing runs, and the call ends as the collective did among
    // the others: left out once it committed.
    p.call(CallKind::Gathered(Api::AllReduce, cutoff, None), BOUND, t0);
    sent(&mut p);
    let included = vec![PeerId(1), PeerId(2)];
    p.handle_message(Message::Gathered { epoch: Epoch(1), seq: 1, included: included.clone(), pending: false }, t0)
        .unwrap();
    assert!(tagged_actions(&mut p).is_empty(), "waits to hear how it ended");
    p.handle_message(Message::OpCommitted { epoch: Epoch(1), derived: 0, seq: 1 }, t0).unwrap();
    let op = OpId { epoch: Epoch(1), derived: 0, seq: Seq(1) };
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Excluded { op, included: included.clone(), ahead: 0 }))]);
    // The decision and the fate of the one after came before our call: no question, and it
    // fails as it did among the others.
    p.handle_message(Message::Gathered { epoch: Epoch(1), seq: 2, included: included.clone(), pending: false }, t0)
        .unwrap();
    let failure = OpFailure::new(FailureKind::PeerLost, PeerId(1), "lost");
    p.handle_message(Message::OpAborted { epoch: Epoch(1), derived: 0, seq: 2, failure: failure.clone() }, t0).unwrap();
    p.call(CallKind::Gathered(Api::AllReduce, cutoff, None), BOUND, t0);
    assert!(sent(&mut p).is_empty(), "decided already");
    let op = OpId { epoch: Epoch(1), derived: 0, seq: Seq(2) };
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Aborted { op, failure }))]);
    // Far behind: the others ran two more without us before our call of the first. It ends
    // left out and says how many more it heard decided, so the caller can skip ahead.
    for seq in [3, 4] {
        p.handle_message(Message::Gathered { epoch: Epoch(1), seq, included: included.clone(), pending: seq == 4 }, t0)
            .unwrap();
        p.handle_message(Message::OpCommitted { epoch: Epoch(1), derived: 0, seq }, t0).unwrap();
    }
    for (seq, ahead) in [(3, 1), (4, 0)] {
        p.call(CallKind::Gathered(Api::AllReduce, cutoff, None), BOUND, t0);
        let op = OpId { epoch: Epoch(1), derived: 0, seq: Seq(seq) };
        assert_eq!(actions(&mut p), vec![done(Err(CallError::Excluded { op, included: included.clone(), ahead }))]);
    }
    assert_eq!(p.pending_at(OpId { epoch: Epoch(1), derived: 0, seq: Seq(4) }), Some(true));
    assert_eq!(p.pending_at(OpId { epoch: Epoch(1), derived: 0, seq: Seq(3) }), Some(false));
    // And the next collective is number 5 for us as for them.
    assert_eq!(start_collective(&mut p, t0), OpId { epoch: Epoch(1), derived: 0, seq: Seq(5) });
}

/// A collective with a deadline waiting for the master's decision ends on an abort, and ends at
/// its bound if no decision comes.
#[test]
fn a_collective_with_a_deadline_ends_on_an_abort_or_at_its_bound() {
    let (mut p, t0) = joined(&[0, 1]);
    let cutoff = Cutoff { deadline: Duration::from_millis(10), min: 0 };
    p.call(CallKind::Gathered(Api::AllReduce, cutoff, None), BOUND, t0);
    sent(&mut p);
    let failure = OpFailure::new(FailureKind::PeerLost, PeerId(1), "lost");
    p.handle_message(Message::OpAborted { epoch: Epoch(1), derived: 0, seq: 0, failure: failure.clone() }, t0).unwrap();
    let op = OpId { epoch: Epoch(1), derived: 0, seq: Seq(0) };
    assert_eq!(actions(&mut p), vec![done(Err(CallError::Aborted { op, failure }))]);
    let bound = Duration::from_millis(500);
    p.call(CallKind::Gathered(Api::AllReduce, cutoff, None), bound, t0);
    sent(&mut p);
    let late = t0 + bound;
    assert!(p.poll_timeout().is_some_and(|t| t <= late));
    p.handle_timeout(late);
    assert!(matches!(&sent(&mut p)[..], [.., Message::OpFailed { seq: 1, .. }]), "reported");
}
