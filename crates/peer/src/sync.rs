//! `sync_shared_state`: hash, vote, fetch what the election says we lack from its donors
//! (striped across all of them, verified by hash), serve what others lack, and end together
//! (`docs/state.md`).
//!
//! Threads, all scoped to the call: one accepts fetch connections and hands each to a server
//! thread that answers requests from our tensors (read-only); one fetch thread per donor pulls
//! pieces from a shared queue, so faster donors take more, and a donor that fails puts its piece
//! back for the others. Fetched bytes land in buffers of their own and replace our tensors only
//! once the master says every participant holds the elected state.

use crate::communicator::Communicator;
use crate::error::{Error, Result};
use crate::fetch::{digest, fetch, serve, tensors_meta, FetchFailed, Fetcher, Served, StateTensor, Wanted};
use shoal_proto::master::Strategy;
use shoal_proto::peer::{Action, CallKind, Revision, SyncBallot, Value};
use shoal_wire::{PeerId, PlanEntry};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// What a sync did.
#[derive(Debug, Clone, Default)]
pub struct SyncInfo {
    /// The revision every participant is at now.
    pub revision: u64,
    /// Tensors this peer received: name, the donors it fetched from, bytes.
    pub received: Vec<(String, Vec<PeerId>, u64)>,
    /// Peers this peer sent tensor bytes to.
    pub sent_to: BTreeSet<PeerId>,
    /// Bytes this peer sent.
    pub sent_bytes: u64,
    /// Wall time of the call.
    pub elapsed: Duration,
}

impl Communicator {
    /// Makes this peer's shared state the one the group elects, with every accepted peer of the
    /// group calling it together: see `docs/state.md` for the election, the revision rules and
    /// the strategies.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for duplicate names, over-long names or shapes that do not
    /// match the bytes (nothing sent); [`Error::SyncFailed`] if the sync ended without effect
    /// (retryable when a participant was lost, a usage error when the calls do not fit
    /// together); [`Error::MasterUnreachable`], [`Error::Timeout`].
    pub fn sync_shared_state(
        &self,
        tensors: &mut [StateTensor<'_>],
        revision: u64,
        strategy: Strategy,
        override_resume: bool,
    ) -> Result<SyncInfo> {
        self.whole_group("sync_shared_state")?;
        let started = Instant::now();
        let c = self.connected()?;
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let entries = digest(tensors, true)?;
        let bound = self.config.timeout;
        let mut data = self.lock_data();
        let ballot = SyncBallot { revision: Revision(revision), strategy: strategy as u8, override_resume, entries };
        let call = c.control.own_input(|p, now| p.call(CallKind::SyncSharedState(ballot), bound, now));
        let (sent_bytes, sent_to) = (AtomicU64::new(0), Mutex::new(BTreeSet::new()));
        let mut fetched = None;
        let mut wanted = Vec::new();
        let mut sync_round = None;
        let ended = self.run_call(&c.control, &c.listener, &mut data, call, "sync_shared_state", |_, action| {
            let Action::Fetch { round, entries, .. } = action else {
                unreachable!("sync_shared_state asked for {action:?}")
            };
            sync_round = Some(round);
            let misfit = (entries.len() != tensors.len())
                .then_some(FetchFailed::PlanMisfit { plan: entries.len(), state: tensors.len() });
            if misfit.is_none() {
                wanted = entries
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| !e.donors.is_empty())
                    .map(|(index, PlanEntry { hash, donors })| Wanted {
                        index,
                        len: tensors[index].bytes.len() as u64,
                        donors: donors.clone(),
                        hash: *hash,
                    })
                    .collect();
            }
            let position = c.control.lock().position().expect("a sync runs in a topology");
            let addrs: BTreeMap<PeerId, String> = position.ring.iter().map(|m| (m.peer, m.addr.clone())).collect();
            let meta = tensors_meta(tensors);
            let views: Vec<&[u8]> = tensors.iter().map(|t| &*t.bytes).collect();
            let stop = AtomicBool::new(false);
            let io_timeout = self.config.heartbeat_timeout;
            // Serve whatever the others fetch from us until the sync ends: until the master says
            // every participant holds the elected state, or that the sync failed.
            Some(std::thread::scope(|scope| {
                scope.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        let Some(fetch) = c.listener.take_fetch(Duration::from_millis(20)) else {
                            continue;
                        };
                        let (views, sent_bytes, sent_to, stop) = (&views, &sent_bytes, &sent_to, &stop);
                        scope.spawn(move || {
                            let served = Served { bytes: sent_bytes, to: Some(sent_to) };
                            let from = fetch.first.from;
                            if let Err(e) = serve(fetch, round, views, &served, stop, None, io_timeout) {
                                log::debug!("serving {from}: {e}");
                            }
                        });
                    }
                });
                let arrived = AtomicU64::new(0);
                let fetcher = Fetcher {
                    me: c.me,
                    session: c.session,
                    data_key: &c.data_key,
                    tls: c.listener.tls.as_ref(),
                    io_timeout,
                    arrived: &arrived,
                    until: None,
                };
                let result = match misfit {
                    Some(reason) => Err(reason),
                    None => fetch(&fetcher, round, &wanted, &meta, &addrs),
                };
                let report = result.as_ref().map(drop).map_err(Clone::clone);
                fetched = Some(result);
                c.control.own_input(|p, now| p.handle_fetched(round, report, now));
                let ended = loop {
                    match c.control.next_action() {
                        Action::Done { call: ended, result } if ended == call => break result,
                        // A transfer waiting on us: past its ballot, the sync ends on its own.
                        Action::MemberWaits(_) => {}
                        action => unreachable!("sync_shared_state asked for {action:?} after its plan"),
                    }
                };
                stop.store(true, Ordering::Relaxed);
                ended
            }))
        });
        // The master may have asked us to keep the state this sync ends with for newcomers (it
        // asks just before `SyncComplete`): answered however the call ended here, so that no
        // newcomer waits for us.
        let order = c.control.own_input(|p, _| p.take_snapshot_order());
        if let Some(stale) = order.filter(|o| Some(*o) != sync_round) {
            // Asked at a sync whose call had ended here already (its bound passed): not kept.
            c.control.own_input(|p, _| p.snapshot_held(stale, false));
        }
        let snapshot = order.filter(|o| Some(*o) == sync_round);
        let answer = |held| {
            if let Some(round) = snapshot {
                c.control.own_input(|p, _| p.snapshot_held(round, held));
            }
        };
        let revision = match ended {
            Ok(Value::Synced(revision)) => revision.0,
            Ok(other) => unreachable!("sync_shared_state returned {other:?}"),
            Err(e) => {
                answer(false);
                return Err(crate::driver::call_error(&c.control, e, "sync_shared_state", bound));
            }
        };
        // The master says every participant holds the elected state: ours too.
        let fetched = fetched.expect("a sync completes once fetched").map_err(|reason| {
            answer(false);
            Error::SyncFailed { retryable: true, reason: reason.to_string() }
        })?;
        let mut received = Vec::new();
        for (w, (data, donors)) in wanted.iter().zip(fetched) {
            tensors[w.index].bytes.copy_from_slice(&data);
            received.push((tensors[w.index].name.clone(), donors, w.len));
        }
        if let Some(round) = snapshot {
            answer(self.keep_snapshot(&c.listener, round, tensors));
        }
        Ok(SyncInfo {
            revision,
            received,
            sent_to: sent_to.into_inner().unwrap_or_else(PoisonError::into_inner),
            sent_bytes: sent_bytes.into_inner(),
            elapsed: started.elapsed(),
        })
    }
}
