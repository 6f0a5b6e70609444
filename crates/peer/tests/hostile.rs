//! A stranger at a member's data port while the run all-reduces (issue 44, attack 4): forged fetch
//! requests and hellos are refused at their first frame without a byte of state, beside 32
//! connections holding half a request open, and the members' all-reduces keep their pace.
//! (Requests after a valid first one are checked too, and a silent fetcher is hung up on:
//! `links.rs`'s unit tests.)

mod common;

use common::master;
use shoal_peer::{DType, ReduceOp};
use shoal_transport::write_message;
use shoal_wire::{Epoch, Message, PeerId, SessionId};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

/// All-reduces timed per phase, each of 64 KiB.
const ROUNDS: usize = 1000;

/// A connection to `to` from source address 127.0.0.2 (a stranger's own address).
fn dial_from_elsewhere(to: SocketAddr) -> TcpStream {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.bind(&"127.0.0.2:0".parse::<SocketAddr>().unwrap().into()).unwrap();
    socket.connect(&to.into()).unwrap();
    let s = TcpStream::from(socket);
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    s
}

/// What a stranger sends first: fetch requests under no key, in another session, from a peer that
/// does not exist, and a hello posing as a member.
fn forgeries(session: SessionId, to: PeerId) -> Vec<(SessionId, Message)> {
    let fetch = |from: u32, mac: u8| Message::FetchRequest {
        from: PeerId(from),
        to,
        round: 1,
        index: 0,
        offset: 0,
        len: 65536,
        mac: [mac; 32],
    };
    let hello = Message::PeerHello {
        from: PeerId(0),
        to,
        epoch: Epoch(1),
        stream: 0,
        streams: 1,
        reverse: false,
        mac: [3; 32],
    };
    vec![(session, fetch(0, 1)), (SessionId(0), fetch(0, 0)), (session, fetch(999, 2)), (session, hello)]
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

#[test]
fn forged_fetch_requests_get_nothing_and_slow_no_all_reduce() {
    let m = master();
    let world = 2;
    let barrier = || Arc::new(Barrier::new(world + 1));
    let (quiet_done, attack_on, attack_done, attack_over) = (barrier(), barrier(), barrier(), barrier());
    let members: Vec<_> = (0..world)
        .map(|i| {
            let cfg = common::config(&m);
            let (quiet_done, attack_on) = (quiet_done.clone(), attack_on.clone());
            let (attack_done, attack_over) = (attack_done.clone(), attack_over.clone());
            thread::spawn(move || {
                let comm = common::join(cfg, i, world);
                let phase = || -> Vec<Duration> {
                    (0..ROUNDS)
                        .map(|_| {
                            let mut buf = vec![1u8; 64 << 10];
                            let started = Instant::now();
                            comm.all_reduce(&mut buf, DType::U8, ReduceOp::Sum, 0, None, None).unwrap();
                            assert!(buf.iter().all(|&b| b == 2), "the sum changed");
                            started.elapsed()
                        })
                        .collect()
                };
                let quiet = phase();
                quiet_done.wait();
                attack_on.wait();
                let attacked = phase();
                attack_done.wait();
                // Listening until the stranger stopped.
                attack_over.wait();
                (median(quiet), median(attacked))
            })
        })
        .collect();
    quiet_done.wait();
    let status = m.status().unwrap();
    let victim = status.peers.iter().find(|p| p.rank == Some(0)).unwrap();
    let (to, addr) = (victim.peer, victim.addr.parse::<SocketAddr>().unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let (refused, read) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let attacker = {
        let (stop, refused, read, session) = (stop.clone(), refused.clone(), read.clone(), status.session);
        let attack_on = attack_on.clone();
        thread::spawn(move || {
            // Half a request on each of 32 connections, held open.
            let frame = shoal_wire::encode_frame(session, &forgeries(session, to)[0].1).unwrap();
            let held: Vec<TcpStream> = (0..32)
                .map(|_| {
                    let mut s = dial_from_elsewhere(addr);
                    s.write_all(&frame[..frame.len() / 2]).unwrap();
                    s
                })
                .collect();
            let mut rounds = 0;
            while !stop.load(Ordering::Relaxed) {
                if rounds == 1 {
                    attack_on.wait();
                }
                rounds += 1;
                for (sent, forged) in forgeries(session, to) {
                    let mut s = dial_from_elsewhere(addr);
                    let _ = write_message(&mut s, sent, &forged);
                    let mut answer = Vec::new();
                    let _ = s.read_to_end(&mut answer);
                    read.fetch_add(answer.len() as u64, Ordering::Relaxed);
                    refused.fetch_add(1, Ordering::Relaxed);
                }
                // A thousand connections a second: a flood that costs the victim's CPU as much as
                // its own (on this host) is a test of the machine, not of the listener.
                thread::sleep(Duration::from_millis(4));
            }
            drop(held);
        })
    };
    attack_done.wait();
    stop.store(true, Ordering::Relaxed);
    attacker.join().unwrap();
    attack_over.wait();
    let (refused, read) = (refused.load(Ordering::Relaxed), read.load(Ordering::Relaxed));
    assert!(refused >= 8, "only {refused} forged requests were sent");
    assert_eq!(read, 0, "a stranger read {read} bytes");
    for member in members {
        let (quiet, attacked) = member.join().unwrap();
        assert!(
            attacked <= 3 * quiet + Duration::from_millis(2),
            "all-reduce median {attacked:?} under attack, {quiet:?} without"
        );
    }
}
