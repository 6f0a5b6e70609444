//! The master's HTTP endpoints and the peers' counters, against a live run of real peers.

mod common;
use shoal_master::{MasterOptions, MasterServer};
use shoal_peer::{CommunicatorConfig, DType, ReduceOp};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

const HEARTBEAT: Duration = Duration::from_millis(800);

/// GETs `path` and returns the status code and body.
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("a header");
    (head.split(' ').nth(1).unwrap().parse().unwrap(), body.to_string())
}

/// The value of the metric line that starts with `name{labels}` (or `name ` without labels).
fn metric(text: &str, series: &str) -> f64 {
    let line = text.lines().find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '));
    let line = line.unwrap_or_else(|| panic!("no {series} in\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Three peers all-reduce, then two of them make a call that does not fit the third's: every
/// count shows on each peer (`stats`) and, once reported with a heartbeat, in the master's
/// `/status`, `/metrics` and page.
#[test]
fn the_master_serves_what_peers_did() {
    let options = MasterOptions {
        listen: "127.0.0.1:0".into(),
        heartbeat_timeout: Some(HEARTBEAT),
        secret: None,
        http: Some("127.0.0.1:0".into()),
        state_dir: None,
        tls: None,
    };
    let m = MasterServer::start(options).unwrap();
    let http = m.http_addr().expect("HTTP served");
    let (world, rounds) = (3, 20);
    let joined = Arc::new(Barrier::new(world));
    let done = Arc::new(Barrier::new(world + 1));
    let peers: Vec<_> = (0..world)
        .map(|i| {
            let mut cfg = CommunicatorConfig::from_env(&m.local_addr().to_string()).unwrap();
            cfg.listen_addr = "127.0.0.1:0".into();
            cfg.heartbeat_timeout = HEARTBEAT;
            cfg.timeout = Duration::from_secs(10);
            let (joined, done) = (joined.clone(), done.clone());
            thread::spawn(move || {
                let comm = common::join(cfg, i, world);
                joined.wait();
                let mut buf = vec![0u8; 64 << 10];
                for _ in 0..rounds {
                    comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, 0, None, None).unwrap();
                }
                // A mismatch: a different count on one peer.
                let mut odd = vec![0u8; if comm.rank() == Some(0) { 8 } else { 16 }];
                let e = comm.all_reduce(&mut odd, DType::F32, ReduceOp::Sum, 1, None, None).unwrap_err();
                let stats = comm.stats();
                done.wait(); // The master reads while every peer is still in.
                done.wait();
                (stats, e.cause())
            })
        })
        .collect();
    done.wait();
    // Every peer reports with its next heartbeat.
    let deadline = Instant::now() + 5 * HEARTBEAT;
    let status = loop {
        let s = m.status().unwrap();
        let reported: u64 = s.totals.ops.get("all_reduce").map_or(0, |o| o.succeeded + o.failed);
        if reported == (world * (rounds + 1)) as u64 || Instant::now() > deadline {
            break s;
        }
        thread::sleep(Duration::from_millis(50));
    };
    let ops = &status.totals.ops["all_reduce"];
    assert_eq!((ops.started, ops.succeeded, ops.failed), (63, 60, 3), "{ops:?}");
    assert!(ops.tx_bytes >= 60 * (64 << 10) as u64, "{ops:?}");
    assert_eq!(status.ring.len(), world);

    let (code, json) = get(http, "/status");
    assert_eq!(code, 200);
    assert!(json.contains(r#""state":"accepted""#) && json.contains(r#""ring":[0,1,2]"#), "{json}");
    assert!(json.contains(r#""all_reduce":{"#), "{json}");
    // A heartbeat timeout given pins every peer's.
    let pinned = format!(r#""silence_bound_s":{:?}"#, HEARTBEAT.as_secs_f64());
    assert_eq!(json.matches(&pinned).count(), world, "{json}");

    let (code, text) = get(http, "/metrics");
    assert_eq!(code, 200);
    assert_eq!(metric(&text, r#"shoal_peers{state="accepted"}"#), 3.0);
    assert_eq!(metric(&text, r#"shoal_operations_succeeded_total{kind="all_reduce"}"#), 60.0);
    assert_eq!(metric(&text, r#"shoal_operations_failed_total{kind="all_reduce"}"#), 3.0);
    // The peers that see the other count fail with a mismatch; one that only hears of it may see
    // its stream closed first, or (a loaded machine, this test's short heartbeat timeout) wait
    // past its bound for the verdict. Every failure has one cause.
    let causes: f64 = text
        .lines()
        .filter(|l| l.starts_with("shoal_operation_failures_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(causes, 3.0, "{text}");
    assert!(metric(&text, r#"shoal_operation_failures_total{cause="mismatch"}"#) >= 1.0);
    assert_eq!(metric(&text, r#"shoal_operation_duration_seconds_count{kind="all_reduce"}"#), 63.0);
    assert_eq!(metric(&text, r#"shoal_operation_duration_seconds_bucket{le="+Inf",kind="all_reduce"}"#), 63.0);
    assert!(metric(&text, r#"shoal_operation_bytes_total{kind="all_reduce",direction="tx"}"#) > 0.0);
    assert_eq!(metric(&text, "shoal_peers_joined_total"), 3.0);
    assert!(metric(&text, "shoal_topology_epoch") >= 3.0);

    let (code, page) = get(http, "/");
    assert_eq!(code, 200);
    assert!(page.contains("<svg id=\"ring\"") && page.contains("fetch(\"status\""));
    assert_eq!(get(http, "/nothing").0, 404);

    done.wait();
    for p in peers {
        let (stats, cause) = p.join().unwrap();
        // Joined: its communicator was dropped, and left the run.
        let ops = stats.ops.iter().find(|o| o.kind == "all_reduce").unwrap();
        assert_eq!((ops.started, ops.succeeded, ops.failed), (21, 20, 1));
        assert_eq!(stats.failures, vec![(cause.to_string(), 1)]);
        assert_eq!(stats.links.len(), 2, "{:?}", stats.links);
        assert!(stats.links.iter().any(|l| l.tx_bytes > 0 && l.tx_rate > 0), "{:?}", stats.links);
        assert!(stats.running.is_empty());
    }
    // A peer that leaves sends its last counts first: the totals keep them.
    let deadline = Instant::now() + 5 * HEARTBEAT;
    while !m.status().unwrap().peers.is_empty() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    let status = m.status().unwrap();
    assert!(status.peers.is_empty());
    let ops = &status.totals.ops["all_reduce"];
    assert_eq!((ops.started, ops.succeeded, ops.failed), (63, 60, 3), "{ops:?}");
    assert_eq!(status.counters.left, 3);
}
