//! Strangers at the master's port: each attack is closed, logged, and changes nothing for a peer
//! that joins properly beside it.

use shoal_master::{MasterOptions, MasterServer, MAX_GREETING_BODY, MAX_PENDING_CONNECTIONS, MAX_PENDING_PER_SOURCE};
use shoal_transport::{connect, read_message, write_message};
use shoal_wire::{encode_frame, GroupId, Message, SessionId, StateDigest};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const GREETING: Duration = Duration::from_millis(500);

fn master() -> MasterServer {
    master_greeting_within(GREETING)
}

fn master_greeting_within(greeting: Duration) -> MasterServer {
    master_keeping(greeting, None)
}

fn master_keeping(greeting: Duration, state_dir: Option<std::path::PathBuf>) -> MasterServer {
    let options = MasterOptions {
        listen: "127.0.0.1:0".into(),
        heartbeat_timeout: Some(greeting),
        secret: None,
        http: None,
        state_dir,
        tls: None,
    };
    MasterServer::start(options).unwrap()
}

/// A connection to `m` from source address `from` (any 127/8 address is local).
fn dial_from(m: &MasterServer, from: &str) -> TcpStream {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.bind(&format!("{from}:0").parse::<std::net::SocketAddr>().unwrap().into()).unwrap();
    socket.connect(&m.local_addr().into()).unwrap();
    TcpStream::from(socket)
}

fn dial(m: &MasterServer) -> TcpStream {
    connect(&m.local_addr().to_string(), Duration::from_secs(2)).unwrap()
}

/// A peer that says Join is registered at once; its connection, which it holds while kept.
fn joins(m: &MasterServer) -> TcpStream {
    let mut s = dial(m);
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    assert!(matches!(read_message(&mut s), Ok((_, Message::Challenge { .. }))));
    let join = Message::Join { group: GroupId(0), data_addr: "127.0.0.1:1".into(), proof: [0; 32], catch_up: false };
    write_message(&mut s, SessionId(0), &join).unwrap();
    assert!(matches!(read_message(&mut s), Ok((_, Message::Registered { .. }))), "a proper peer was refused");
    s
}

/// Waits until the master closes `s`; returns how long that took.
fn closed_within(s: &mut TcpStream, bound: Duration) -> Duration {
    let started = Instant::now();
    s.set_read_timeout(Some(bound)).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) if started.elapsed() < bound => return started.elapsed(),
            Ok(_) => continue,
            _ => panic!("the master kept the connection open for {bound:?}"),
        }
    }
}

#[test]
fn a_stranger_dripping_bytes_is_closed_at_the_greeting_deadline() {
    let m = master();
    let mut s = dial(&m);
    let join = encode_frame(
        SessionId(0),
        &Message::Join { group: GroupId(0), data_addr: "x".into(), proof: [0; 32], catch_up: false },
    )
    .unwrap();
    let mut writer = s.try_clone().unwrap();
    let drip = std::thread::spawn(move || {
        for b in join {
            if writer.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    joins(&m);
    let took = closed_within(&mut s, GREETING * 4);
    assert!(took >= GREETING / 2, "closed before its deadline: {took:?}");
    drip.join().unwrap();
    joins(&m);
}

#[test]
fn a_stranger_announcing_a_large_first_frame_is_closed_at_its_header() {
    let m = master();
    let mut s = dial(&m);
    // A well-formed frame, only far larger than any Join: its header alone is sent, and refused.
    let entry =
        |i: usize| StateDigest { name: format!("{i:064}"), dtype: 1, shape: vec![1], hash: [0; 32], may_differ: false };
    let big = Message::SyncVote {
        revision: 0,
        strategy: 1,
        override_resume: false,
        entries: (0..100).map(entry).collect(),
        collectives: 0,
    };
    let frame = encode_frame(SessionId(0), &big).unwrap();
    assert!(frame.len() > MAX_GREETING_BODY as usize);
    s.write_all(&frame[..32]).unwrap();
    closed_within(&mut s, GREETING / 2);
    joins(&m);
}

#[test]
fn connections_that_never_say_join_cannot_exhaust_the_master() {
    let m = master();
    let idle: Vec<TcpStream> = (0..MAX_PENDING_CONNECTIONS + 8).map(|_| dial(&m)).collect();
    // Over the limit, connections are closed at once; the rest at the greeting deadline.
    std::thread::sleep(GREETING * 2);
    for mut s in idle {
        closed_within(&mut s, GREETING);
    }
    joins(&m);
}

/// One address holding connections open fills only its share of the slots for connections yet
/// to say Join: 300 held from 127.0.0.2 once refused every newcomer until they timed out.
#[test]
fn one_address_holding_connections_open_cannot_keep_others_out() {
    let m = master_greeting_within(Duration::from_secs(30));
    let mut idle: Vec<TcpStream> = (0..MAX_PENDING_PER_SOURCE + 8).map(|_| dial_from(&m, "127.0.0.2")).collect();
    // Past its share, closed at once; a peer from elsewhere joins while the rest are held.
    for s in &mut idle[MAX_PENDING_PER_SOURCE..] {
        closed_within(s, Duration::from_secs(2));
    }
    let started = Instant::now();
    joins(&m);
    assert!(started.elapsed() < Duration::from_secs(2), "joined after {:?}", started.elapsed());
    idle[0].set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    assert!(!matches!(idle[0].read(&mut [0u8; 256]), Ok(0)), "the share was closed, not held");
}

/// Strangers from four addresses holding every slot of a restarted master once kept two of its
/// three members out (removed, then `Kicked` on every call): the addresses its state directory
/// kept members at still get in.
#[test]
fn members_coming_back_to_a_restarted_master_get_past_strangers_holding_every_slot() {
    let dir = std::env::temp_dir().join(format!("shoal-hostile-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut first = master_keeping(Duration::from_secs(30), Some(dir.clone()));
    // Held open across the stop: a connection closed first would remove the member from what the
    // master keeps.
    let _member = joins(&first);
    first.stop();
    let m = master_keeping(Duration::from_secs(30), Some(dir.clone()));
    let sources = MAX_PENDING_CONNECTIONS / MAX_PENDING_PER_SOURCE;
    let _held: Vec<TcpStream> =
        (0..MAX_PENDING_CONNECTIONS).map(|i| dial_from(&m, &format!("127.0.0.{}", 2 + i % sources))).collect();
    let mut stranger = dial_from(&m, "127.0.0.200");
    closed_within(&mut stranger, Duration::from_secs(2));
    // The member (its data address was 127.0.0.1) is challenged, as any connection let in is.
    let mut member = dial_from(&m, "127.0.0.1");
    member.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    assert!(matches!(read_message(&mut member), Ok((_, Message::Challenge { .. }))), "the member was kept out");
    let _ = std::fs::remove_dir_all(&dir);
}
