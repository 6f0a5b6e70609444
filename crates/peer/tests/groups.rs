//! Derived groups end to end over loopback: a real master, communicators in threads, groups
//! split off them that run collectives and transfers over their links.

mod common;

use common::{f32_bytes, master};
use shoal_peer::{Communicator, DType, Error, ReduceOp};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

/// Runs `body(index, &comm)` on `world` communicators that joined one run, each in its thread;
/// returns the results in order.
fn with_peers<T: Send + 'static>(
    world: usize,
    body: impl Fn(usize, &Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let m = Arc::new(master());
    let body = Arc::new(body);
    let handles: Vec<_> = (0..world)
        .map(|i| {
            let (m, body) = (Arc::clone(&m), Arc::clone(&body));
            thread::spawn(move || {
                let comm = common::join(common::config(&m), i, world);
                body(i, &comm)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Four peers split by the parity of their rank, ranked in reverse: each group all-reduces
/// (beside an all-reduce of the whole group in flight with the same tag), broadcasts from its
/// rank 1 and passes a tensor from its rank 0 to its rank 1; `new_group` picks two members and
/// leaves the others out; the whole group's calls are refused on a derived group, and
/// `new_group` with different ranks on different members fails on every one of them.
#[test]
fn derived_groups_run_collectives_and_transfers_over_the_whole_groups_links() {
    let results = with_peers(4, |_, comm| {
        let rank = comm.rank().unwrap();
        let half = comm.split(Some((rank % 2) as u32), -(rank as i64)).unwrap().expect("every member has a color");
        assert_eq!(half.group_world_size(), Some(2));
        // Reverse order of keys: the higher rank here is rank 0 there.
        assert_eq!(half.rank(), Some(usize::from(rank < 2)), "rank {rank}");
        let whole = comm.all_reduce_async(f32_bytes(&[1.0; 300]), DType::F32, ReduceOp::Sum, 7, None, None).unwrap();
        let mut mine = f32_bytes(&vec![rank as f32 + 1.0; 1000]);
        let info = half.all_reduce(&mut mine, DType::F32, ReduceOp::Sum, 7, None, None).unwrap();
        assert_eq!(info.world_size, 2);
        let want = if rank % 2 == 0 { 1.0 + 3.0 } else { 2.0 + 4.0 };
        assert!(f32s(&mine).iter().all(|&x| x == want), "rank {rank}: {:?}", &f32s(&mine)[..4]);
        let mut whole = whole;
        assert_eq!(comm.wait(&mut whole, None).unwrap().world_size, 4);
        assert!(f32s(&whole.into_buffer().unwrap()).iter().all(|&x| x == 4.0));

        let mut root = f32_bytes(&[rank as f32; 64]);
        half.broadcast(&mut root, DType::F32, 1, 0, None).unwrap();
        let from = if rank % 2 == 0 { 0.0 } else { 1.0 };
        assert!(f32s(&root).iter().all(|&x| x == from), "the broadcast came from the group's rank 1");
        let mut passed = f32_bytes(&[rank as f32; 16]);
        match half.rank().unwrap() {
            0 => drop(half.send(&passed, DType::F32, 1, 3).unwrap()),
            _ => drop(half.recv(&mut passed, DType::F32, 0, 3).unwrap()),
        }
        let sender = (rank + 2) % 4;
        let sent = if rank < 2 { sender as f32 } else { rank as f32 };
        assert!(f32s(&passed).iter().all(|&x| x == sent), "rank {rank} got {:?}", &f32s(&passed)[..2]);
        assert!(matches!(half.update_topology(), Err(Error::InvalidArgument(_))), "a call of the whole group");
        assert!(matches!(half.peers_pending(), Err(Error::InvalidArgument(_))));

        let pair = comm.new_group(&[3, 0]).unwrap();
        assert_eq!(pair.is_some(), rank == 0 || rank == 3);
        if let Some(pair) = &pair {
            assert_eq!(pair.rank(), Some(usize::from(rank == 3)), "ranked as the ranks sorted");
            let mut ones = f32_bytes(&[1.0; 10]);
            assert_eq!(pair.all_reduce(&mut ones, DType::F32, ReduceOp::Sum, 0, None, None).unwrap().world_size, 2);
            assert!(f32s(&ones).iter().all(|&x| x == 2.0));
        }
        let differ = if rank == 1 { vec![0, 1] } else { vec![0, 2] };
        let refused = comm.new_group(&differ).err();
        assert!(matches!(refused, Some(Error::InvalidArgument(ref why)) if why.contains("different")), "{refused:?}");
        assert!(matches!(comm.new_group(&[0, 0]), Err(Error::InvalidArgument(_))), "a rank twice");
        rank
    });
    assert_eq!(results, vec![0, 1, 2, 3]);
}

/// A member of a derived group leaves: the others' collective in the group fails as retryable,
/// and the retry runs in the group of the members left, in their order.
#[test]
fn a_derived_group_carries_on_with_the_members_left_after_one_leaves() {
    let left = Arc::new(Barrier::new(3));
    let results = with_peers(3, move |i, comm| {
        let group = comm.split(Some(0), 0).unwrap().expect("in the group");
        let mut ones = f32_bytes(&[1.0; 100]);
        group.all_reduce(&mut ones, DType::F32, ReduceOp::Sum, 0, None, None).unwrap();
        left.wait();
        if i == 1 {
            // Leaves while the others wait for it in the group's next collective.
            thread::sleep(Duration::from_millis(300));
            comm.close();
            return (usize::MAX, 0, 0.0, 0);
        }
        let mut tries = 0;
        loop {
            tries += 1;
            let mut ones = f32_bytes(&[1.0; 100]);
            match group.all_reduce(&mut ones, DType::F32, ReduceOp::Sum, 0, None, None) {
                Ok(info) => return (group.rank().unwrap(), info.world_size, f32s(&ones)[0], tries),
                Err(Error::PeerLost { .. }) if tries < 5 => {}
                Err(e) => panic!("peer {i}: {e}"),
            }
        }
    });
    assert_eq!(results[0], (0, 2, 2.0, 2), "failed once, as retryable, then ran without the member");
    assert_eq!(results[2], (1, 2, 2.0, 2), "the third member is the group's rank 1 now");
}

/// The members of the whole group outside a derived group leave while one member of the derived
/// group waits in its collective and the other has not called it yet: the topology re-forms
/// around them, the waiting one's call fails as retryable instead of waiting out its bound, the
/// late one's call fails alike, and both retries run in the new topology.
#[test]
fn a_derived_group_follows_a_re_form_that_members_outside_it_caused() {
    let results = with_peers(4, |i, comm| {
        let rank = comm.rank().unwrap();
        let pair = comm.new_group(&[0, 3]).unwrap();
        let Some(pair) = pair else {
            comm.close();
            return None;
        };
        if rank == 3 {
            thread::sleep(Duration::from_millis(500));
        }
        let started = std::time::Instant::now();
        let mut outcomes = Vec::new();
        loop {
            let mut ones = f32_bytes(&[1.0; 100]);
            match pair.all_reduce(&mut ones, DType::F32, ReduceOp::Sum, 0, None, None) {
                Ok(info) => {
                    outcomes.push(format!("ok {} {}", info.world_size, f32s(&ones)[0]));
                    break;
                }
                Err(Error::PeerLost { .. }) if outcomes.len() < 3 => outcomes.push("lost".into()),
                Err(e) => panic!("peer {i}: {e}"),
            }
        }
        assert!(started.elapsed() < Duration::from_secs(5), "peer {i} waited {:?}", started.elapsed());
        Some(outcomes)
    });
    let outcomes: Vec<Vec<String>> = results.into_iter().flatten().collect();
    assert_eq!(outcomes.len(), 2);
    for o in outcomes {
        assert_eq!(o.last().map(String::as_str), Some("ok 2 2"), "{o:?}");
    }
}

/// `subgroup` forms a group from its members alone, ranked in the order given: two pairs run
/// all-reduces side by side, a third group of a split group (its ranks, not the whole group's)
/// passes a tensor; ranks out of the group or named twice are refused.
#[test]
fn subgroups_are_formed_by_their_members_alone_in_the_order_given() {
    with_peers(4, |_, comm| {
        let rank = comm.rank().unwrap();
        let ranks = if rank % 2 == 0 { [2, 0] } else { [1, 3] };
        let name = if rank % 2 == 0 { b"even".as_slice() } else { b"odd" };
        let pair = comm.subgroup(&ranks, name).unwrap().expect("a member");
        assert_eq!(pair.rank(), Some(ranks.iter().position(|&r| r == rank).unwrap()), "ranked as given");
        let mut mine = f32_bytes(&[rank as f32; 100]);
        pair.all_reduce(&mut mine, DType::F32, ReduceOp::Sum, 0, None, None).unwrap();
        let want = (ranks[0] + ranks[1]) as f32;
        assert!(f32s(&mine).iter().all(|&x| x == want), "rank {rank}: {:?}", &f32s(&mine)[..2]);
        assert!(matches!(comm.subgroup(&[0, 4], b"x"), Err(Error::InvalidArgument(_))));
        assert!(matches!(comm.subgroup(&[1, 1], b"x"), Err(Error::InvalidArgument(_))));
        assert!(comm.subgroup(&[(rank + 1) % 4], b"not me").unwrap().is_none());

        // Ranked backwards: the split's rank 0 is the whole group's rank 3.
        let all = comm.split(Some(0), -(rank as i64)).unwrap().unwrap();
        if let Some(inner) = all.subgroup(&[0, 3], b"ends").unwrap() {
            let mut passed = f32_bytes(&[rank as f32; 8]);
            match inner.rank().unwrap() {
                0 => drop(inner.send(&passed, DType::F32, 1, 0).unwrap()),
                _ => drop(inner.recv(&mut passed, DType::F32, 0, 0).unwrap()),
            }
            assert!(f32s(&passed).iter().all(|&x| x == 3.0), "rank {rank}: from the whole group's rank 3");
            assert!(rank == 0 || rank == 3);
        }
        // Nobody leaves (which re-forms the run) while the ends still pass their tensor.
        comm.barrier(1).unwrap();
    });
}
