//! A run with TLS over loopback: a real master and real communicators, every connection (control,
//! data, shared-state fetches) under TLS with certificates `make_certs` made; and the ends that
//! lack the run's certificates, refused with errors that say why.

mod common;

use common::f32_bytes;
use shoal_master::MasterServer;
use shoal_peer::{Communicator, CommunicatorConfig, DType, Error, ReduceOp, StateTensor, Strategy};
use shoal_transport::tls::make_certs;
use shoal_transport::TlsFiles;
use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

/// A run's certificates for 127.0.0.1 in a fresh directory named after `test`.
fn certs(test: &str) -> TlsFiles {
    let dir: PathBuf = std::env::temp_dir().join(format!("shoal-tls-test-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let made = make_certs(&dir, &["127.0.0.1".into()]).unwrap();
    let (_, cert, key) = made.hosts[0].clone();
    TlsFiles { cert, key, ca: made.ca }
}

fn master(tls: Option<TlsFiles>) -> MasterServer {
    common::master_with(Duration::from_secs(2), tls)
}

fn config(master: &MasterServer, tls: Option<TlsFiles>) -> CommunicatorConfig {
    let mut c = common::config(master);
    c.connections = Some(2);
    // Every stream over TCP, so that TLS carries the data (same-host peers would share memory).
    c.shared_memory = false;
    c.chunk_bytes = Some(64 << 10);
    c.tls = tls;
    c
}

/// Three peers join a run with TLS, all-reduce 4 MiB to the exact sum over TLS streams, and
/// repair a peer whose shared state differs by fetching it over TLS.
#[test]
fn a_run_with_tls_all_reduces_and_repairs_state_over_tls() {
    let files = certs("run");
    let m = master(Some(files.clone()));
    let world = 3;
    let joined = Arc::new(Barrier::new(world));
    let handles: Vec<_> = (0..world)
        .map(|i| {
            let cfg = config(&m, Some(files.clone()));
            let joined = joined.clone();
            thread::spawn(move || {
                let comm = common::join(cfg, i, world);
                joined.wait();
                let len = 1 << 20;
                let rank = comm.rank().unwrap();
                let mut buf = f32_bytes(&vec![rank as f32 + 1.0; len]);
                comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, 0, None, None).unwrap();
                assert!(buf == f32_bytes(&vec![6.0; len]), "wrong sum over TLS");
                let links = comm.links();
                assert!(!links.is_empty() && links.iter().all(|l| l.transport == "tls"), "{links:?}");
                // The last peer's state differs; the two others outvote it and it fetches theirs.
                let mut state = f32_bytes(&vec![if rank == 2 { 9.0 } else { 1.0 }; 1 << 18]);
                let info = {
                    let mut tensors = [StateTensor {
                        name: "w".into(),
                        dtype: DType::F32,
                        shape: vec![1 << 18],
                        bytes: &mut state,
                        may_differ: false,
                    }];
                    comm.sync_shared_state(&mut tensors, 1, Strategy::EnforcePopular, false).unwrap()
                };
                assert!(state == f32_bytes(&vec![1.0; 1 << 18]), "rank {rank} not repaired");
                (rank, info.received.len())
            })
        })
        .collect();
    for h in handles {
        let (rank, received) = h.join().unwrap();
        assert_eq!(received, usize::from(rank == 2), "rank {rank} received {received} tensors");
    }
}

/// A peer whose certificate comes from another run's CA is refused at `connect()` with an
/// authentication error that says TLS, and the master counts it; so is a TLS peer that reaches a
/// master without TLS. A plaintext peer cannot join a master with TLS either.
#[test]
fn peers_without_the_runs_certificates_are_refused() {
    let files = certs("refused");
    let m = master(Some(files.clone()));
    let stranger = certs("refused-stranger");
    let started = Instant::now();
    let comm = Communicator::new(config(&m, Some(stranger.clone()))).unwrap();
    match comm.connect(Some(Duration::from_secs(10))) {
        Err(Error::Authentication { reason }) => assert!(reason.contains("TLS"), "{reason}"),
        other => panic!("expected an authentication error, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5), "the refusal took {:?}", started.elapsed());
    let deadline = Instant::now() + Duration::from_secs(5);
    while m.status().unwrap().counters.tls_failures == 0 {
        assert!(Instant::now() < deadline, "the master did not count the refusal");
        thread::sleep(Duration::from_millis(10));
    }
    // A plaintext peer: the master waits for a handshake that never comes, then closes.
    let plain = Communicator::new(config(&m, None)).unwrap();
    assert!(plain.connect(Some(Duration::from_secs(10))).is_err());
    assert_eq!(m.status().unwrap().counters.joins, 0, "nobody joined");
    // A TLS peer and a plaintext master.
    let plain_master = master(None);
    let comm = Communicator::new(config(&plain_master, Some(files))).unwrap();
    match comm.connect(Some(Duration::from_secs(10))) {
        Err(Error::Authentication { reason }) => assert!(reason.contains("TLS"), "{reason}"),
        other => panic!("expected an authentication error, got {other:?}"),
    }
}

/// Files that do not make a TLS setting are refused when the communicator is made, naming the
/// file, before anything is dialed.
#[test]
fn unusable_tls_files_are_named_at_construction() {
    let m = master(None);
    let mut files = certs("unusable");
    files.key = files.cert.clone();
    match Communicator::new(config(&m, Some(files.clone()))) {
        Err(Error::InvalidArgument(reason)) => assert!(reason.contains(&*files.key.to_string_lossy()), "{reason}"),
        other => panic!("expected InvalidArgument, got {:?}", other.err()),
    }
}
