//! End to end over loopback: a real master and real communicators in threads.

mod common;

use common::{f32_bytes, master};
use shoal_master::MasterServer;
use shoal_peer::{Communicator, CommunicatorConfig, DType, ReduceOp};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

fn config(master: &MasterServer, connections: usize) -> CommunicatorConfig {
    let mut c = common::config(master);
    c.connections = Some(connections);
    c.chunk_bytes = Some(4096);
    c
}

/// Starts one communicator per config in its own thread, 100 ms apart; the peers already in
/// admit each newcomer; once all are in, each runs `body(index, &comm)`. Returns the results
/// in config order.
fn with_peers<T: Send + 'static>(
    configs: Vec<CommunicatorConfig>,
    body: impl Fn(usize, &Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let world = configs.len();
    let body = Arc::new(body);
    let handles: Vec<_> = configs
        .into_iter()
        .enumerate()
        .map(|(i, cfg)| {
            let body = body.clone();
            thread::spawn(move || {
                let comm = common::join(cfg, i, world);
                body(i, &comm)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Peers join one at a time, each admitted by the vote of those already in, and every world
/// size from 1 to 4 all-reduces to the exact integer sum on every peer.
#[test]
fn peers_join_one_by_one_and_all_reduce() {
    let m = master();
    let world = 4;
    let joined = Arc::new(Barrier::new(world));
    let handles: Vec<_> = (0..world)
        .map(|i| {
            let cfg = config(&m, 1 + i % 3);
            let joined = joined.clone();
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(150 * i as u64));
                let comm = Communicator::new(cfg).unwrap();
                comm.connect(None).unwrap();
                let mut sizes = Vec::new();
                // Admit newcomers until everyone is in, all-reducing at every size on the way.
                loop {
                    let n = comm.group_world_size().unwrap();
                    let len = 1001;
                    let mut buf = f32_bytes(&vec![1.0f32; len]);
                    let info = comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, 0, None, None).unwrap();
                    assert_eq!(info.world_size, n);
                    assert!(buf == f32_bytes(&vec![n as f32; len]), "wrong sum at world {n}");
                    sizes.push(n);
                    if n == world {
                        break;
                    }
                    if comm.peers_pending().unwrap() {
                        comm.update_topology().unwrap();
                    } else {
                        thread::sleep(Duration::from_millis(20));
                    }
                }
                joined.wait();
                (comm.rank().unwrap(), sizes)
            })
        })
        .collect();
    let mut ranks: Vec<usize> = Vec::new();
    for h in handles {
        let (rank, sizes) = h.join().unwrap();
        assert_eq!(*sizes.last().unwrap(), world);
        ranks.push(rank);
    }
    ranks.sort();
    assert_eq!(ranks, vec![0, 1, 2, 3]);
}

#[test]
fn unreachable_master_is_named() {
    let mut cfg = CommunicatorConfig::from_env("127.0.0.1:1").unwrap();
    cfg.listen_addr = "127.0.0.1:0".into();
    let comm = Communicator::new(cfg).unwrap();
    let err = comm.connect(Some(Duration::from_secs(2))).unwrap_err();
    assert!(matches!(err, shoal_peer::Error::MasterUnreachable { .. }), "{err}");
    assert!(matches!(
        comm.all_reduce(&mut [0u8; 4], DType::F32, ReduceOp::Sum, 0, None, None),
        Err(shoal_peer::Error::NotConnected)
    ));
}

/// Defaults (1 MiB chunks, several streams) on a buffer of one chunk per segment.
#[test]
fn two_peers_with_default_settings() {
    let m = master();
    let configs = (0..2)
        .map(|_| {
            let mut cfg = config(&m, shoal_peer::DEFAULT_CONNECTIONS);
            cfg.chunk_bytes = Some(shoal_peer::DEFAULT_CHUNK_BYTES);
            cfg
        })
        .collect();
    with_peers(configs, |_, comm| {
        let mut buf = f32_bytes(&vec![1.5f32; 1 << 18]);
        comm.all_reduce(&mut buf, DType::F32, ReduceOp::Avg, 0, None, None).unwrap();
        assert!(buf == f32_bytes(&vec![1.5f32; 1 << 18]));
    });
}

/// Many collectives back to back, with the sizes changing, as the benchmark runs them.
#[test]
fn back_to_back_collectives_of_changing_sizes() {
    let m = master();
    let configs = (0..2)
        .map(|_| {
            let mut cfg = config(&m, shoal_peer::DEFAULT_CONNECTIONS);
            cfg.chunk_bytes = Some(shoal_peer::DEFAULT_CHUNK_BYTES);
            cfg.timeout = Duration::from_secs(5);
            cfg
        })
        .collect();
    with_peers(configs, |_, comm| {
        for (bytes, iters) in [(4096, 3100), (65536, 300), (1 << 20, 300), (16 << 20, 3)] {
            let mut buf = vec![0u8; bytes];
            for it in 0..iters {
                comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, 0, None, None)
                    .unwrap_or_else(|e| panic!("size {bytes} iteration {it}: {e}"));
            }
        }
    });
}

/// Buffers large enough to stripe over several streams of the pool, with pools of different
/// sizes on different peers (each peer's pool to its successor is its own choice), reduce to
/// exact values on every peer.
#[test]
fn large_buffers_striped_over_pools_of_different_sizes() {
    let m = master();
    let configs = [2, 4, 3]
        .into_iter()
        .map(|pool| {
            let mut cfg = config(&m, pool);
            cfg.chunk_bytes = Some(64 << 10);
            cfg
        })
        .collect();
    with_peers(configs, |i, comm| {
        let len = (3 << 20) / 4 + 7;
        let mine: Vec<f32> = (0..len).map(|k| (k % 1000) as f32 * (i + 1) as f32).collect();
        let mut buf = f32_bytes(&mine);
        let info = comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, 3, None, None).unwrap();
        let want: Vec<f32> = (0..len).map(|k| (k % 1000) as f32 * 6.0).collect();
        assert!(buf == f32_bytes(&want), "peer {i}: wrong sum");
        // Each peer sends 2 (n - 1) / n of the buffer, give or take a segment's rounding.
        assert!(info.tx_bytes.abs_diff((len * 4) as u64 * 4 / 3) <= 8, "tx {}", info.tx_bytes);
    });
}

/// Peers on one host link over shared memory, or over TCP where told to (`SHOAL_TRANSPORT=tcp`),
/// and a pair mixing both (each dialer chooses for the streams it sends on) reduces alike.
#[test]
fn peers_on_one_host_link_over_shared_memory_unless_told_tcp() {
    let cases: [(&[bool], &str); 3] = [(&[true; 3], "shm"), (&[false; 3], "tcp"), (&[true, false], "mixed")];
    for (shared, transport) in cases {
        let m = master();
        let configs = shared
            .iter()
            .map(|&on| {
                let mut cfg = config(&m, 2);
                cfg.chunk_bytes = Some(64 << 10);
                cfg.shared_memory = on;
                cfg
            })
            .collect();
        let world = shared.len();
        let links = with_peers(configs, move |i, comm| {
            let len = (1 << 20) + 3;
            let mut buf = f32_bytes(&(0..len).map(|k| (k % 977) as f32 * (i + 1) as f32).collect::<Vec<_>>());
            comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, 1, None, None).unwrap();
            let total = (1..=world).sum::<usize>() as f32;
            let want: Vec<f32> = (0..len).map(|k| (k % 977) as f32 * total).collect();
            assert!(buf == f32_bytes(&want), "peer {i}: wrong sum");
            comm.links().iter().map(|l| l.transport).collect::<Vec<_>>()
        });
        let links: Vec<_> = links.into_iter().flatten().collect();
        // A ring of three: a link to each neighbour; of two: one link, both ways.
        assert_eq!(links.len(), if world == 3 { 6 } else { 2 }, "{links:?}");
        assert!(links.iter().all(|&t| t == transport), "{links:?}, expected {transport}");
    }
}

/// `all_reduce_many` over buffers of mixed types and sizes, two at a time: every one reduced,
/// each by the algorithm its size calls for, with consecutive tags; zero in flight is refused.
#[test]
fn all_reduce_many_reduces_every_buffer() {
    let m = master();
    let world = 3;
    let out = with_peers((0..world).map(|_| config(&m, 2)).collect(), move |i, comm| {
        let mut a = f32_bytes(&[i as f32 + 1.0; 1000]);
        let mut b: Vec<u8> = (0..5u64).flat_map(|k| (k * 10 + i as u64).to_le_bytes()).collect();
        let mut c = f32_bytes(&vec![1.0f32; 1 << 16]);
        let mut bufs = [(&mut a[..], DType::F32), (&mut b[..], DType::U64), (&mut c[..], DType::F32)];
        assert!(comm.all_reduce_many(&mut bufs, ReduceOp::Sum, 0, 0, None).is_err());
        let infos = comm.all_reduce_many(&mut bufs, ReduceOp::Sum, 2, 10, None).unwrap();
        let algorithms: Vec<&str> = infos.iter().map(|i| i.algorithm.name()).collect();
        (a, b, c, algorithms)
    });
    for (a, b, c, algorithms) in out {
        assert!(a == f32_bytes(&[6.0; 1000]));
        let want: Vec<u8> = (0..5u64).flat_map(|k| (3 * k * 10 + 3).to_le_bytes()).collect();
        assert_eq!(b, want);
        assert!(c == f32_bytes(&vec![3.0; 1 << 16]));
        assert_eq!(algorithms, ["oneshot", "oneshot", "ring"]);
    }
}

/// Every verb among three peers: all-gather in rank order, reduce-scatter's block per rank
/// (its input left as it was), broadcast from a root around the ring and straight from it, and
/// a barrier; buffers shaped for another group size fail on every peer, naming the shapes.
#[test]
fn all_gather_reduce_scatter_broadcast_and_barrier() {
    use shoal_peer::Algorithm;
    let m = master();
    let world = 3;
    let out = with_peers((0..world).map(|_| config(&m, 1)).collect(), move |_, comm| {
        let rank = comm.rank().unwrap() as u64;
        let words = |v: &[u64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let inp = words(&[rank * 10, rank * 10 + 1]);
        let mut gathered = vec![0u8; inp.len() * world];
        comm.all_gather(&mut gathered, &inp, DType::U64, 1, None).unwrap();
        let scatter_in = words(&(0..6).map(|k| k + rank).collect::<Vec<_>>());
        let mut scattered = vec![0u8; 16];
        comm.reduce_scatter(&mut scattered, &scatter_in, DType::U64, ReduceOp::Sum, 2, None).unwrap();
        assert_eq!(scatter_in, words(&(0..6).map(|k| k + rank).collect::<Vec<_>>()), "input untouched");
        let mut casts = Vec::new();
        for algorithm in [Algorithm::Ring, Algorithm::OneShot] {
            let mut b = words(&[rank + 100; 700]);
            let info = comm.broadcast(&mut b, DType::U64, 1, 3, Some(algorithm)).unwrap();
            assert_eq!(info.algorithm, algorithm);
            casts.push(b);
        }
        comm.barrier(4).unwrap();
        let mut wrong = vec![0u8; inp.len() * (world + 1)];
        let misfit = comm.all_gather(&mut wrong, &inp, DType::U64, 5, None).unwrap_err().to_string();
        // Nobody leaves before everyone saw the misfit in the group of three. A collective
        // called before the ring re-formed after the failure fails alike: retried.
        assert!((0..100).any(|_| comm.barrier(6).is_ok()), "the barrier never went through");
        (rank, gathered, scattered, casts, misfit)
    });
    let words = |v: &[u64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    for (rank, gathered, scattered, casts, misfit) in out {
        assert_eq!(gathered, words(&[0, 1, 10, 11, 20, 21]));
        // Block r of every input, summed: (2r + k) + (2r + k + 1) + (2r + k + 2) for k = 0, 1.
        let r = rank;
        assert_eq!(scattered, words(&[3 * (2 * r) + 3, 3 * (2 * r + 1) + 3]));
        for b in casts {
            assert_eq!(b, words(&[101; 700]));
        }
        assert!(misfit.contains("all_gather") && misfit.contains("3 members"), "{misfit}");
    }
}

/// Alone, a peer's all-gather and reduce-scatter are copies, and shapes are checked all the same.
#[test]
fn a_group_of_one_gathers_and_scatters_its_own_input() {
    let m = master();
    let comm = Communicator::new(config(&m, 1)).unwrap();
    comm.connect(None).unwrap();
    let inp = f32_bytes(&[1.5, 2.5, 3.5]);
    let mut out = vec![0u8; inp.len()];
    comm.all_gather(&mut out, &inp, DType::F32, 1, None).unwrap();
    assert_eq!(out, inp);
    let mut block = vec![0u8; inp.len()];
    comm.reduce_scatter(&mut block, &inp, DType::F32, ReduceOp::Avg, 2, None).unwrap();
    assert_eq!(block, inp);
    let mut wrong = vec![0u8; 2 * inp.len()];
    let e = comm.all_gather(&mut wrong, &inp, DType::F32, 3, None).unwrap_err().to_string();
    assert!(e.contains("has 1 member"), "{e}");
    assert!(wrong.iter().all(|&b| b == 0), "a misfit changes nothing");
}

/// Peers that name different roots for one broadcast are told so, with both calls, and their
/// buffers are as before; the next broadcast with one root goes through.
#[test]
fn a_broadcast_with_different_roots_is_a_mismatch() {
    let m = master();
    let out = with_peers((0..2).map(|_| config(&m, 1)).collect(), move |_, comm| {
        let rank = comm.rank().unwrap();
        let mut buf = f32_bytes(&[rank as f32; 100]);
        let before = buf.clone();
        let e = comm.broadcast(&mut buf, DType::F32, rank, 1, None).unwrap_err();
        assert_eq!(buf, before, "restored");
        let mut ok = false;
        for _ in 0..100 {
            if comm.broadcast(&mut buf, DType::F32, 1, 1, None).is_ok() {
                ok = true;
                break;
            }
        }
        assert!(ok, "the matching broadcast never went through");
        (e.to_string(), buf)
    });
    for (e, buf) in out {
        assert!(e.contains("root=0") && e.contains("root=1"), "{e}");
        assert_eq!(buf, f32_bytes(&[1.0; 100]));
    }
}

/// A vote cast ahead takes its place among the caller's calls at once: collectives started right
/// after it (and one in flight before it) never cross it at the master, every peer gets the same
/// answer, and a newcomer registered meanwhile is seen by all and admitted.
#[test]
fn a_vote_cast_ahead_keeps_its_place_among_collectives() {
    let m = master();
    let configs: Vec<_> = (0..2).map(|_| config(&m, 2)).collect();
    let newcomer_cfg = config(&m, 2);
    let answers = with_peers(configs, move |_, comm| {
        let mut answers = Vec::new();
        for _ in 0..20 {
            let before = f32_bytes(&[1.0; 4096]);
            let mut work = comm.all_reduce_async(before, DType::F32, ReduceOp::Sum, 1, None, None).unwrap();
            let vote = comm.peers_pending_async().unwrap();
            let mut after = f32_bytes(&[2.0; 1000]);
            comm.all_reduce(&mut after, DType::F32, ReduceOp::Sum, 2, None, None).unwrap();
            assert!(after == f32_bytes(&[4.0; 1000]));
            comm.wait(&mut work, None).unwrap();
            assert!(work.into_buffer().unwrap() == f32_bytes(&[2.0; 4096]));
            answers.push(comm.wait_vote(vote).unwrap());
        }
        assert!(answers.iter().all(|pending| !pending), "nobody was pending: {answers:?}");
        // Now a newcomer registers; votes cast ahead from then on see it.
        if comm.rank() == Some(0) {
            let cfg = newcomer_cfg.clone();
            thread::spawn(move || {
                let comm = Communicator::new(cfg).unwrap();
                comm.connect(None).unwrap();
                comm.group_world_size()
            });
        }
        loop {
            let vote = comm.peers_pending_async().unwrap();
            let mut buf = f32_bytes(&[1.0; 16]);
            comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, 3, None, None).unwrap();
            if comm.wait_vote(vote).unwrap() {
                comm.update_topology().unwrap();
                return comm.group_world_size();
            }
        }
    });
    assert_eq!(answers, vec![Some(3), Some(3)]);
}

/// A collective's bound follows how long those of its kind and size took: once a few were quick,
/// one a member never joins ends at the floor, long before `timeout`, retryably; a pinned bound
/// (`timeout_floor: None`, as `SHOAL_TIMEOUT` makes it) stays `timeout`.
#[test]
fn a_collectives_bound_follows_how_long_its_kind_took() {
    let m = master();
    let configs = (0..2)
        .map(|_| {
            let mut c = config(&m, 1);
            c.timeout_floor = Some(Duration::from_millis(300));
            c
        })
        .collect();
    let done = Arc::new(Barrier::new(2));
    let out = with_peers(configs, move |i, comm| {
        let mut buf = f32_bytes(&[1.0; 4]);
        for tag in 0..10 {
            comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, tag, None, None).unwrap();
        }
        // Peer 1 stays away for 3 s: peer 0's call ends at its bound, the floor, and so does
        // peer 1's late call of that collective.
        if i == 1 {
            thread::sleep(Duration::from_secs(3));
        }
        let started = std::time::Instant::now();
        let e = comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, 10, None, None).unwrap_err();
        let took = started.elapsed();
        // Retried as is, it goes through.
        let retried = (0..50).any(|_| comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, 11, None, None).is_ok());
        assert!(retried, "the retried collective never went through");
        // Neither leaves (which would fail the other's retry) before both are through.
        done.wait();
        (e, took)
    });
    let (e, took) = &out[0];
    assert!(
        matches!(e, shoal_peer::Error::Timeout { after, .. } if *after == Duration::from_millis(300)),
        "the floor: {e}"
    );
    assert!(*took < Duration::from_secs(2), "{took:?}: not the 20 s timeout");
    // The other member's call of it fails alike, retryably: the member whose bound passed.
    assert!(matches!(out[1].0, shoal_peer::Error::PeerLost { .. }), "{}", out[1].0);
}
