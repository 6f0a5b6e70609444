//! Catching up over loopback: a newcomer fetches the group's shared state while two accepted
//! peers go on stepping, then the sync that admits it moves only what changed since.

mod common;

use common::master;
use shoal_master::MasterServer;
use shoal_peer::{Communicator, CommunicatorConfig, DType, ReduceOp, StateTensor, Strategy};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

const W_BYTES: usize = 8 << 20;

fn config(master: &MasterServer) -> CommunicatorConfig {
    let mut c = common::config(master);
    // 8 MiB at 16 MB/s: half a second of fetching, many steps of the others.
    c.catchup_rate = Some(16_000_000);
    c
}

/// A training state: `w` (changed at step 3 only), the step count, and an RNG state that may differ.
struct State {
    w: Vec<u8>,
    step: Vec<u8>,
    rng: Vec<u8>,
}

impl State {
    fn new(fill: u8, rng: u8) -> Self {
        State { w: vec![fill; W_BYTES], step: vec![0; 8], rng: vec![rng; 16] }
    }
    fn tensors(&mut self) -> Vec<StateTensor<'_>> {
        let t = |name: &str, dtype, shape: u64, bytes, may_differ| StateTensor {
            name: name.into(),
            dtype,
            shape: vec![shape],
            bytes,
            may_differ,
        };
        vec![
            t("w", DType::U8, W_BYTES as u64, &mut self.w[..], false),
            t("step", DType::U64, 1, &mut self.step[..], false),
            t("rng", DType::U8, 16, &mut self.rng[..], true),
        ]
    }
    fn step(&self) -> u64 {
        u64::from_le_bytes(self.step[..].try_into().unwrap())
    }
    /// One training step after a sync at revision `step`.
    fn advance(&mut self) {
        let step = self.step() + 1;
        self.step.copy_from_slice(&step.to_le_bytes());
        if step == 3 {
            self.w.iter_mut().for_each(|b| *b = b.wrapping_add(1));
        }
    }
    /// Sync, a small all-reduce, a step; returns the bytes this peer received in the sync.
    fn iteration(&mut self, comm: &Communicator) -> u64 {
        let revision = self.step();
        let info = comm.sync_shared_state(&mut self.tensors(), revision, Strategy::EnforcePopular, false).unwrap();
        let mut grad = vec![1u8; 64];
        comm.all_reduce(&mut grad, DType::U8, ReduceOp::Sum, 0, None, None).unwrap();
        self.advance();
        info.received.iter().map(|(_, _, n)| n).sum()
    }
}

#[test]
fn a_newcomer_catches_up_while_the_others_step_and_is_admitted_in_sync() {
    let m = master();
    let steps = Arc::new(AtomicU64::new(0));
    let finals = Arc::new(Mutex::new(Vec::new()));
    let accepted: Vec<_> = (0..2)
        .map(|i| {
            let (cfg, steps, finals) = (config(&m), steps.clone(), finals.clone());
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(100 * i));
                let comm = Communicator::new(cfg).unwrap();
                comm.connect_until(None, 2).unwrap();
                let mut state = State::new(7, i as u8);
                let mut in_three = 0;
                while in_three < 5 {
                    if comm.peers_pending().unwrap() {
                        comm.update_topology().unwrap();
                    }
                    in_three += u32::from(comm.group_world_size() == Some(3));
                    state.iteration(&comm);
                    steps.fetch_add(1, Ordering::Relaxed);
                    thread::sleep(Duration::from_millis(5));
                }
                finals.lock().unwrap().push((state.w, state.step));
            })
        })
        .collect();
    while steps.load(Ordering::Relaxed) < 2 * 6 {
        thread::sleep(Duration::from_millis(10));
    }
    let comm = Communicator::new(config(&m)).unwrap();
    let mut state = State::new(0, 99);
    let (mut first_progress, mut last) = (None, None);
    let info = comm
        .connect_catching_up(None, 1, &mut state.tensors(), &mut |p| {
            first_progress.get_or_insert(steps.load(Ordering::Relaxed));
            last = Some(*p);
        })
        .unwrap();
    let after = steps.load(Ordering::Relaxed);
    let revision = info.revision.expect("the state was fetched");
    assert!(revision >= 6, "the copy of a sync after the first steps: {info:?}");
    assert_eq!(info.bytes, W_BYTES as u64 + 8, "w and the step; rng, allowed to differ, is left to the sync");
    assert_eq!(info.donors.len(), 2);
    let last = last.unwrap();
    assert_eq!((last.done, last.total), (info.bytes, info.bytes));
    // The others went on meanwhile: the fetch did not hold them up.
    assert!(after >= first_progress.unwrap() + 4, "{} steps during the catch-up", after - first_progress.unwrap());
    assert_eq!(u64::from_le_bytes(state.step[..].try_into().unwrap()), revision);
    assert!(state.w.iter().all(|b| *b == 8), "w as it is since step 3");
    // Admitted: the sync that admits it moves only what changed since the copy (the step count
    // and the RNG state a newcomer takes), not w.
    let received = state.iteration(&comm);
    assert!(received <= 8 + 16, "the admitting sync moved {received} bytes");
    for _ in 0..4 {
        assert!(!comm.peers_pending().unwrap());
        state.iteration(&comm);
    }
    for h in accepted {
        h.join().unwrap();
    }
    for (w, step) in finals.lock().unwrap().iter() {
        assert!(*w == state.w && *step == state.step, "every peer ends with the same state");
    }
}

/// A fetch slower than `connect`'s bound ends at the bound, even inside a piece, with nothing
/// written, and the members go on without the newcomer.
#[test]
fn a_catch_up_slower_than_connects_bound_times_out_and_writes_nothing() {
    let m = master();
    let stop = Arc::new(AtomicU64::new(0));
    let members: Vec<_> = (0..2)
        .map(|i| {
            let (mut cfg, stop) = (config(&m), stop.clone());
            cfg.catchup_rate = Some(1_000_000); // 8 MiB from two donors: about 4 s
            thread::spawn(move || {
                let comm = Communicator::new(cfg).unwrap();
                comm.connect_until(None, 2).unwrap();
                let mut state = State::new(7, i);
                while stop.load(Ordering::Relaxed) == 0 {
                    assert!(!comm.peers_pending().unwrap());
                    state.iteration(&comm);
                    thread::sleep(Duration::from_millis(20));
                }
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(500));
    let comm = Communicator::new(config(&m)).unwrap();
    let mut state = State::new(0, 99);
    let started = std::time::Instant::now();
    let err = comm.connect_catching_up(Some(Duration::from_secs(1)), 1, &mut state.tensors(), &mut |_| {}).unwrap_err();
    assert!(matches!(err, shoal_peer::Error::Timeout { .. }), "{err}");
    // One piece alone takes about 4 s from either donor.
    assert!(started.elapsed() < Duration::from_millis(2500), "{:?}", started.elapsed());
    assert!(state.w.iter().all(|b| *b == 0), "nothing written");
    stop.store(1, Ordering::Relaxed);
    for h in members {
        h.join().unwrap();
    }
}
