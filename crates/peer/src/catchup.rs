//! Catching up (`docs/state.md`, "Catching up"): a newcomer fetches its group's shared state
//! while the accepted peers go on training, and only then awaits admission, so the sync that
//! admits it moves at most what changed since.
//!
//! Donors: at the end of the sync the master names (`Message::Snapshot`, before
//! `SyncComplete`), each accepted peer copies its state into a [`Snapshot`], if it fits
//! `SHOAL_CATCHUP_MEMORY`, and serves it from the threads that greet data connections, paced to
//! `SHOAL_CATCHUP_RATE`: its own calls never wait for it. It drops the copy when the master says no
//! newcomer needs it.
//!
//! Newcomer: [`Communicator::connect_catching_up`] registers, asks the master for a plan, fetches
//! the copy striped over every donor (a donor that fails hands its pieces to the others; the
//! bytes are verified by hash), reports progress, writes the tensors, and only then awaits its
//! admission like any newcomer.

use crate::communicator::Communicator;
use crate::control::Control;
use crate::error::{Error, Protocol, Result, Usage};
use crate::fetch::{digest, fetch, tensors_meta, Fetcher, Snapshot, StateTensor, Wanted};
use crate::links::Listener;
use crate::Deadline;
use shoal_proto::auth::DataKey;
use shoal_proto::peer::CatchUpPlan;
use shoal_wire::{PeerId, SessionId};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often a catching-up newcomer tells the master (and its caller) how far it is.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// How far a catch-up is, as [`Communicator::connect_catching_up`] reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CatchUpProgress {
    /// Bytes fetched so far.
    pub done: u64,
    /// Bytes to fetch.
    pub total: u64,
    /// Time since the fetch began.
    pub elapsed: Duration,
    /// Expected time left at the rate so far (`None` before any byte arrived).
    pub eta: Option<Duration>,
}

/// What a catch-up did.
#[derive(Debug, Clone, Default)]
pub struct CatchUpInfo {
    /// The revision of the state fetched, now in the tensors; `None` if nothing was fetched
    /// (then the sync after the admission repairs this peer, as without a catch-up).
    pub revision: Option<u64>,
    /// Bytes fetched.
    pub bytes: u64,
    /// Peers fetched from: those that delivered a piece, or (nothing fetched) those asked.
    pub donors: Vec<PeerId>,
    /// Why nothing was fetched, if nothing was.
    pub skipped: Option<String>,
    /// From the plan's arrival to the end of the fetch.
    pub elapsed: Duration,
}

impl Communicator {
    /// [`Communicator::connect_until`], fetching the group's shared state into `tensors` (sorted
    /// here by name) between registering and being admitted, while the accepted peers go on: see
    /// `docs/state.md`, "Catching up". `progress` hears how far the fetch is, about four times a
    /// second. The bound covers the catch-up (the fetch stops asking for pieces once it passes,
    /// and nothing is written); the master's plan waits for the group's next `sync_shared_state`.
    ///
    /// Nothing is fetched, and the sync after the admission repairs this peer as usual, if the
    /// group has no state yet or every donor fails (the result says why); `tensors` are written
    /// only with the whole state, verified.
    ///
    /// # Errors
    /// As [`Communicator::connect_until`]; [`Error::InvalidArgument`] for a malformed state;
    /// [`Error::Misuse`] if the tensors are not the group's (names), with nothing fetched.
    pub fn connect_catching_up(
        &self,
        timeout: Option<Duration>,
        min_world_size: usize,
        tensors: &mut [StateTensor<'_>],
        progress: &mut (dyn FnMut(&CatchUpProgress) + Send),
    ) -> Result<CatchUpInfo> {
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let layout = digest(tensors, false)?;
        let mut info = None;
        let mut catch_up = |control: &Control,
                            listener: &Listener,
                            me: PeerId,
                            session: SessionId,
                            key: &DataKey,
                            deadline: Deadline| {
            let newcomer = Newcomer { control, listener, me, session, data_key: key };
            let result = newcomer.catch_up(self, layout.clone(), tensors, progress, deadline);
            let ok = result.is_ok();
            info = Some(result);
            ok
        };
        let connected = self.connect_with(timeout, min_world_size, Some(&mut catch_up));
        match (info, connected) {
            (Some(Err(e)), _) | (_, Err(e)) => Err(e),
            (Some(Ok(info)), Ok(())) => Ok(info),
            (None, Ok(())) => unreachable!("a catch-up runs once registered"),
        }
    }

    /// Keeps a copy of `tensors`, the state sync `round` ended with, for newcomers; false if it
    /// would exceed `SHOAL_CATCHUP_MEMORY`.
    pub(crate) fn keep_snapshot(&self, listener: &Listener, round: u64, tensors: &[StateTensor<'_>]) -> bool {
        let bytes: usize = tensors.iter().map(|t| t.bytes.len()).sum();
        if bytes > self.config.catchup_memory {
            log::warn!(
                "not keeping a copy of the shared state for newcomers: {} MiB exceed SHOAL_CATCHUP_MEMORY ({} MiB); \
                 they are repaired by the sync that admits them instead",
                bytes >> 20,
                self.config.catchup_memory >> 20
            );
            return false;
        }
        let started = Instant::now();
        let copy = tensors.iter().map(|t| t.bytes.to_vec()).collect();
        listener.snapshots().keep(Snapshot::new(round, copy));
        log::info!(
            "keeping a copy of the shared state of sync {round} for newcomers: {} MiB, copied in {:.1} ms",
            bytes >> 20,
            started.elapsed().as_secs_f64() * 1e3
        );
        true
    }
}

/// A registered peer catching up.
struct Newcomer<'a> {
    control: &'a Control,
    listener: &'a Listener,
    me: PeerId,
    session: SessionId,
    data_key: &'a DataKey,
}

impl Newcomer<'_> {
    fn catch_up(
        &self,
        comm: &Communicator,
        layout: Vec<shoal_wire::StateDigest>,
        tensors: &mut [StateTensor<'_>],
        progress: &mut (dyn FnMut(&CatchUpProgress) + Send),
        deadline: Deadline,
    ) -> Result<CatchUpInfo> {
        self.control.own_input(|p, _| p.catch_up_start(layout));
        log::info!("{}: catching up with the group's shared state before admission", self.me);
        let until = Instant::now() + deadline.left("connect")?;
        let plan = match self.control.wait_for(until, |p| p.take_catch_up_plan()) {
            Ok(Some(plan)) => plan,
            Ok(None) => {
                self.end(None);
                let after = deadline.bound();
                return Err(Error::Timeout {
                    operation: "connect (waiting for the group's next sync to catch up)",
                    after,
                });
            }
            Err(gone) => return Err(gone),
        };
        if !plan.reason.is_empty() {
            self.end(None);
            return Err(Usage::CatchUpRefused(plan.reason).into());
        }
        let nothing = |why: &str| {
            self.end(None);
            log::info!("{}: nothing to catch up with: {why}", self.me);
            Ok(CatchUpInfo { skipped: Some(why.to_string()), ..CatchUpInfo::default() })
        };
        if plan.round == 0 {
            return nothing("the group holds no shared state to fetch from a member yet");
        }
        if plan.entries.len() != tensors.len() {
            self.end(None);
            return Err(Protocol::PlanMisfit { plan: plan.entries.len(), state: tensors.len() }.into());
        }
        let wanted: Vec<Wanted> = (plan.entries.iter().zip(tensors.iter()).enumerate())
            .filter(|(_, (e, _))| !e.donors.is_empty())
            .map(|(index, (e, t))| Wanted { index, len: t.bytes.len() as u64, donors: e.donors.clone(), hash: e.hash })
            .collect();
        if wanted.is_empty() {
            return nothing("every tensor of the state may differ: the sync that admits us hands them over");
        }
        let started = Instant::now();
        let fetched = self.fetch(comm, &plan, &wanted, tensors, progress, until);
        let elapsed = started.elapsed();
        if Instant::now() >= until {
            // Nothing written: the call ends at its bound, as every call does.
            self.end(None);
            let after = deadline.bound();
            return Err(Error::Timeout { operation: "connect (fetching the group's state to catch up)", after });
        }
        match fetched {
            Ok(data) => {
                let (mut bytes, mut donors) = (0, BTreeSet::new());
                for (w, (data, served)) in wanted.iter().zip(data) {
                    tensors[w.index].bytes.copy_from_slice(&data);
                    bytes += w.len;
                    donors.extend(served);
                }
                let donors = donors.into_iter().collect();
                self.end(Some(plan.revision));
                log::info!(
                    "{}: caught up with revision {} ({} MiB in {:.2} s, {:.0} MB/s); awaiting admission",
                    self.me,
                    plan.revision,
                    bytes >> 20,
                    elapsed.as_secs_f64(),
                    bytes as f64 / elapsed.as_secs_f64().max(1e-9) / 1e6
                );
                Ok(CatchUpInfo { revision: Some(plan.revision), bytes, donors, skipped: None, elapsed })
            }
            Err(why) => {
                self.end(None);
                log::warn!("{}: catch-up failed ({why}); the sync that admits us repairs the state", self.me);
                let donors = plan.donors.iter().map(|d| d.peer).collect();
                Ok(CatchUpInfo { skipped: Some(why.to_string()), donors, elapsed, ..CatchUpInfo::default() })
            }
        }
    }

    /// Fetches the plan's tensors, reporting progress meanwhile; their bytes, verified, each with
    /// the donors that delivered it.
    fn fetch(
        &self,
        comm: &Communicator,
        plan: &CatchUpPlan,
        wanted: &[Wanted],
        tensors: &[StateTensor<'_>],
        progress: &mut (dyn FnMut(&CatchUpProgress) + Send),
        until: Instant,
    ) -> std::result::Result<Vec<crate::fetch::Fetched>, crate::fetch::FetchFailed> {
        let total: u64 = wanted.iter().map(|w| w.len).sum();
        let addrs: BTreeMap<PeerId, String> = plan.donors.iter().map(|m| (m.peer, m.addr.clone())).collect();
        let meta = tensors_meta(tensors);
        let arrived = AtomicU64::new(0);
        let fetcher = Fetcher {
            me: self.me,
            session: self.session,
            data_key: self.data_key,
            tls: self.listener.tls.as_ref(),
            io_timeout: comm.config.heartbeat_timeout,
            arrived: &arrived,
            until: Some(until),
        };
        log::info!(
            "{}: fetching {} MiB of revision {} from {} donors",
            self.me,
            total >> 20,
            plan.revision,
            addrs.len()
        );
        let started = Instant::now();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let _ = tx.send(fetch(&fetcher, plan.round, wanted, &meta, &addrs));
            });
            let (mut logged, mut result) = (0, None);
            loop {
                // Reported at once (nothing arrived yet), then four times a second, and at the end.
                let done = arrived.load(Ordering::Relaxed);
                let elapsed = started.elapsed();
                let eta = (done > 0).then(|| elapsed.mul_f64(total.saturating_sub(done) as f64 / done as f64));
                progress(&CatchUpProgress { done, total, elapsed, eta });
                let eta_ms = eta.map_or(u64::MAX, |e| e.as_millis() as u64);
                self.control.own_input(|p, _| p.catch_up_progress(done, total, eta_ms));
                let tenths = done * 10 / total.max(1);
                if tenths > logged {
                    logged = tenths;
                    log::info!(
                        "{}: catching up: {}% ({} of {} MiB), {:.1} s left",
                        self.me,
                        tenths * 10,
                        done >> 20,
                        total >> 20,
                        eta.unwrap_or_default().as_secs_f64()
                    );
                }
                if let Some(result) = result {
                    return result;
                }
                result = rx.recv_timeout(PROGRESS_EVERY).ok();
            }
        })
    }

    /// Tells the master the catch-up ended: with the state of `revision`, or without any.
    fn end(&self, revision: Option<u64>) {
        self.control.own_input(|p, _| p.catch_up_end(revision.is_some(), revision.unwrap_or(0)));
    }
}
