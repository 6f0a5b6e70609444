//! `sync_shared_state`: hash, vote, fetch what the election says we lack from its donors
//! (striped across all of them, verified by hash), serve what others lack, and end together
//! (`docs/state.md`).
//!
//! Threads, all scoped to the call: one accepts fetch connections and hands each to a server
//! thread that answers requests from our tensors (read-only); one fetch thread per donor pulls
//! pieces from a shared queue, so faster donors take more, and a donor that fails puts its piece
//! back for the others. Fetched bytes land in buffers of their own and replace our tensors only
//! once the master says every participant holds the elected state.

use crate::catchup::RateLimit;
use crate::communicator::Communicator;
use crate::error::{Error, Result};
use crate::failpoint::failpoint;
use shoal_collective::DType;
use shoal_proto::auth::DataKey;
use shoal_proto::master::Strategy;
use shoal_proto::peer::{Action, CallKind, Revision, SyncBallot, Value};
use shoal_transport::{read_message_until, write_message, Conn, PollFd, TlsConfig};
use shoal_wire::{
    truncate, Message, PeerId, PlanEntry, SessionId, StateDigest, MAX_BODY_BYTES, MAX_DIMS, MAX_STATE_ENTRIES,
    MAX_STRING_BYTES,
};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Bytes asked of a donor at a time: small enough to spread a tensor over every donor and to
/// lose little when one dies, large enough that the request costs nothing.
const PIECE_BYTES: u64 = 4 << 20;
/// Tensors at least this large log their progress.
const PROGRESS_BYTES: u64 = 64 << 20;

/// One tensor of a shared state, borrowed for the call.
pub struct StateTensor<'a> {
    /// Its name; unique within the state.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Dimensions.
    pub shape: Vec<u64>,
    /// Its elements in memory order; replaced if the election says so.
    pub bytes: &'a mut [u8],
    /// May differ between accepted peers (per-peer RNG or data-loader state): never repaired
    /// among them, but a newcomer receives it.
    pub may_differ: bool,
}

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

/// A fetcher's request, as the listener hands it over.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FetchReq {
    pub from: PeerId,
    pub round: u64,
    pub index: u32,
    pub offset: u64,
    pub len: u64,
}

/// A tensor to fetch.
pub(crate) struct Wanted {
    /// Its position in the state, sorted by name: the index a `FetchRequest` names.
    pub index: usize,
    pub len: u64,
    pub donors: Vec<PeerId>,
    pub hash: [u8; 32],
}

/// Who fetches, as every `FetchRequest` it sends says, and how.
pub(crate) struct Fetcher<'a> {
    pub me: PeerId,
    pub session: SessionId,
    pub data_key: &'a DataKey,
    pub tls: Option<&'a TlsConfig>,
    /// How long a donor may stay silent.
    pub io_timeout: Duration,
    /// Bytes arrived so far, for whoever reports progress.
    pub arrived: &'a AtomicU64,
    /// When to stop asking for pieces (the call's bound), if the caller has one of its own.
    pub until: Option<Instant>,
}

/// The fetch work of one sync: pieces per wanted tensor, shared by the donor threads.
struct Work {
    queues: Vec<VecDeque<(u64, u64)>>,
    /// Pieces not yet in place, per wanted tensor.
    outstanding: Vec<usize>,
    done_bytes: Vec<u64>,
    /// The donors that delivered a piece, per wanted tensor.
    served: Vec<BTreeSet<PeerId>>,
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
                .then(|| format!("a plan of {} tensors for a state of {}", entries.len(), tensors.len()));
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
                        let Some((stream, first)) = c.listener.take_fetch(Duration::from_millis(20)) else {
                            continue;
                        };
                        let (views, sent_bytes, sent_to, stop) = (&views, &sent_bytes, &sent_to, &stop);
                        scope.spawn(move || {
                            let served = Served { bytes: sent_bytes, to: Some(sent_to) };
                            if let Err(e) = serve(stream, first, round, views, &served, stop, None, io_timeout) {
                                log::debug!("serving {}: {e}", first.from);
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
                let ended = match c.control.next_action() {
                    Action::Done { call: ended, result } if ended == call => result,
                    action => unreachable!("sync_shared_state asked for {action:?} after its plan"),
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
                return Err(crate::communicator::call_error(&c.control, e, "sync_shared_state", bound));
            }
        };
        // The master says every participant holds the elected state: ours too.
        let fetched = fetched.expect("a sync completes once fetched").map_err(|reason| {
            answer(false);
            Error::SyncFailed { retryable: true, reason }
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

/// (dtype, shape, name) of each tensor, for hashing what arrives.
pub(crate) fn tensors_meta(tensors: &[StateTensor<'_>]) -> Vec<(DType, Vec<u64>, String)> {
    tensors.iter().map(|t| (t.dtype, t.shape.clone(), t.name.clone())).collect()
}

/// Checks and hashes the state, in name order (with `hash` false, every hash is left zero).
pub(crate) fn digest(tensors: &[StateTensor<'_>], hash: bool) -> Result<Vec<StateDigest>> {
    if tensors.len() > MAX_STATE_ENTRIES {
        return Err(Error::InvalidArgument(format!(
            "{} tensors; a shared state holds at most {MAX_STATE_ENTRIES}",
            tensors.len()
        )));
    }
    let mut out = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if i > 0 && tensors[i - 1].name == t.name {
            return Err(Error::InvalidArgument(format!("tensor name {:?} appears twice", t.name)));
        }
        if t.name.len() > MAX_STRING_BYTES {
            return Err(Error::InvalidArgument(format!(
                "tensor name {:?}... is {} bytes, over {MAX_STRING_BYTES}",
                truncate(t.name.clone(), 32),
                t.name.len()
            )));
        }
        if t.shape.len() > MAX_DIMS {
            return Err(Error::InvalidArgument(format!(
                "tensor {:?} has {} dimensions, at most {MAX_DIMS}",
                t.name,
                t.shape.len()
            )));
        }
        let hash = match hash {
            true => shoal_state::hash_tensor(t.dtype, &t.shape, t.bytes)
                .map_err(|e| Error::InvalidArgument(format!("tensor {:?}: {e}", t.name)))?,
            false => {
                shoal_state::check_layout(t.dtype, &t.shape, t.bytes.len())
                    .map_err(|e| Error::InvalidArgument(format!("tensor {:?}: {e}", t.name)))?;
                shoal_state::TensorHash([0; 32])
            }
        };
        out.push(StateDigest {
            name: t.name.clone(),
            dtype: t.dtype.code(),
            shape: t.shape.clone(),
            hash: hash.0,
            may_differ: t.may_differ,
        });
    }
    Ok(out)
}

/// What a server counts of what it sent.
pub(crate) struct Served<'a> {
    pub bytes: &'a AtomicU64,
    pub to: Option<&'a Mutex<BTreeSet<PeerId>>>,
}

/// Answers one fetcher's requests for tensors of `round` from `views` until it hangs up or
/// `stop` is set, at most at `rate`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn serve<T: AsRef<[u8]>>(
    mut stream: Conn,
    first: FetchReq,
    round: u64,
    views: &[T],
    served: &Served<'_>,
    stop: &AtomicBool,
    rate: Option<&RateLimit>,
    io_timeout: Duration,
) -> std::result::Result<(), String> {
    stream.set_write_timeout(Some(io_timeout)).map_err(|e| e.to_string())?;
    let mut request = first;
    loop {
        let tensor = views.get(request.index as usize).ok_or("no such tensor")?.as_ref();
        let (start, end) = (request.offset, request.offset.saturating_add(request.len));
        if request.round != round || end > tensor.len() as u64 {
            return Err(format!("request {request:?} does not fit sync {round}"));
        }
        let bytes = &tensor[start as usize..end as usize];
        match rate {
            None => stream.write_all(bytes).map_err(|e| e.to_string())?,
            Some(rate) => {
                for part in bytes.chunks(RateLimit::GRAIN) {
                    rate.take(part.len());
                    stream.write_all(part).map_err(|e| e.to_string())?;
                }
            }
        }
        served.bytes.fetch_add(request.len, Ordering::Relaxed);
        if let Some(to) = served.to {
            to.lock().unwrap_or_else(PoisonError::into_inner).insert(request.from);
        }
        failpoint("sync.serve");
        // The next request, or the end: the fetcher hangs up, or the sync ends here.
        loop {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            // A request may wait in the TLS session already, where no poll sees it.
            if !stream.has_buffered_input() {
                let mut fd = PollFd::new(&stream);
                fd.want_read = true;
                if shoal_transport::poll(&mut [fd], Duration::from_millis(50)).map_err(|e| e.to_string())? == 0 {
                    continue;
                }
            }
            match read_message_until(&mut stream, Instant::now() + io_timeout, MAX_BODY_BYTES) {
                Ok((_, Message::FetchRequest { from, round, index, offset, len, .. })) => {
                    request = FetchReq { from, round, index, offset, len };
                    break;
                }
                Ok((_, other)) => return Err(format!("expected FetchRequest, got {}", other.name())),
                Err(_) => return Ok(()), // hung up
            }
        }
    }
}

/// A wanted tensor's bytes, verified, and the donors that delivered them.
pub(crate) type Fetched = (Vec<u8>, Vec<PeerId>);

/// Fetches every wanted tensor of `round` from its donors, one thread per donor; returns their
/// bytes, verified, in the order of `wanted`, each with the donors that delivered it, or why that
/// is impossible.
pub(crate) fn fetch(
    f: &Fetcher<'_>,
    round: u64,
    wanted: &[Wanted],
    meta: &[(DType, Vec<u64>, String)],
    addrs: &BTreeMap<PeerId, String>,
) -> std::result::Result<Vec<Fetched>, String> {
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let pieces = |len: u64| -> VecDeque<(u64, u64)> {
        (0..len.div_ceil(PIECE_BYTES).max(1))
            .map(|k| (k * PIECE_BYTES, PIECE_BYTES.min(len - k * PIECE_BYTES)))
            .collect()
    };
    let queues: Vec<VecDeque<(u64, u64)>> = wanted.iter().map(|w| pieces(w.len)).collect();
    let outstanding = queues.iter().map(VecDeque::len).collect();
    let (done_bytes, served) = (vec![0; wanted.len()], vec![BTreeSet::new(); wanted.len()]);
    let work = Mutex::new(Work { queues, outstanding, done_bytes, served });
    let changed = Condvar::new();
    let mut buffers: Vec<Vec<u8>> = wanted.iter().map(|w| vec![0; w.len as usize]).collect();
    // One slot per piece, so that donors read straight into place without contending.
    let results: Vec<Vec<Mutex<&mut [u8]>>> =
        buffers.iter_mut().map(|b| b.chunks_mut(PIECE_BYTES as usize).map(Mutex::new).collect()).collect();
    let donors: BTreeSet<PeerId> = wanted.iter().flat_map(|w| w.donors.iter().copied()).collect();
    std::thread::scope(|scope| {
        for donor in donors {
            let mine: Vec<usize> = (0..wanted.len()).filter(|&i| wanted[i].donors.contains(&donor)).collect();
            let (work, changed, results) = (&work, &changed, &results);
            let addr = addrs.get(&donor).cloned();
            scope.spawn(move || {
                let outcome = fetch_from(f, round, donor, addr, &mine, wanted, work, changed, results);
                if let Err(e) = outcome {
                    log::warn!("{}: fetching from {donor}: {e}; the other donors take over", f.me);
                }
                changed.notify_all();
            });
        }
    });
    drop(results);
    let Work { outstanding, served, .. } = work.into_inner().unwrap_or_else(PoisonError::into_inner);
    if let Some(i) = outstanding.iter().position(|n| *n > 0) {
        let name = &meta[wanted[i].index].2;
        return Err(format!("every donor of tensor {name:?} failed before it arrived"));
    }
    let mut out = Vec::with_capacity(wanted.len());
    for ((w, data), served) in wanted.iter().zip(buffers).zip(served) {
        let (dtype, shape, name) = &meta[w.index];
        let hash = shoal_state::hash_tensor(*dtype, shape, &data).map_err(|e| e.to_string())?;
        if hash.0 != w.hash {
            return Err(format!("tensor {name:?} arrived with hash {hash}, not the one elected"));
        }
        out.push((data, served.into_iter().collect()));
    }
    Ok(out)
}

/// One donor's share: pieces of the tensors it holds, until none is left or it fails.
#[allow(clippy::too_many_arguments)]
fn fetch_from(
    f: &Fetcher<'_>,
    round: u64,
    donor: PeerId,
    addr: Option<String>,
    mine: &[usize],
    wanted: &[Wanted],
    work: &Mutex<Work>,
    changed: &Condvar,
    results: &[Vec<Mutex<&mut [u8]>>],
) -> std::result::Result<(), String> {
    let addr = addr.ok_or("not in our topology")?;
    // Connected before it takes a piece: the donor that answers first, the nearest, takes the
    // first pieces, and a tensor of one piece comes from it alone (the lab's admitting sync
    // fetched 8 bytes across the WAN, 2 round trips of 40 ms, with a donor in the next rack).
    let left = |w: &Work| mine.iter().any(|&i| !w.queues[i].is_empty());
    if !left(&work.lock().unwrap_or_else(PoisonError::into_inner)) {
        return Ok(());
    }
    let mut stream = Conn::dial(&addr, f.io_timeout, f.tls).map_err(|e| format!("dialing {addr}: {e}"))?;
    loop {
        // Take a piece of one of our tensors; wait while others' pieces are in flight (a donor
        // that fails puts its piece back); stop when all of ours are in place.
        let (i, (offset, len)) = {
            let mut w = work.lock().unwrap_or_else(PoisonError::into_inner);
            loop {
                if f.until.is_some_and(|u| Instant::now() >= u) {
                    return Err("the call's bound passed".into());
                }
                if let Some(&i) = mine.iter().find(|&&i| !w.queues[i].is_empty()) {
                    break (i, w.queues[i].pop_front().expect("not empty"));
                }
                if mine.iter().all(|&i| w.outstanding[i] == 0) {
                    return Ok(());
                }
                w = changed.wait_timeout(w, Duration::from_millis(50)).unwrap_or_else(PoisonError::into_inner).0;
            }
        };
        let fetched = (|| -> std::result::Result<(), String> {
            let s = &mut stream;
            let index = wanted[i].index as u32;
            let mac = f.data_key.fetch(f.session, f.me, donor, round, index, offset, len);
            let request = Message::FetchRequest { from: f.me, to: donor, round, index, offset, len, mac };
            write_message(s, f.session, &request).map_err(|e| e.to_string())?;
            let mut slot = results[i][(offset / PIECE_BYTES) as usize].lock().unwrap_or_else(PoisonError::into_inner);
            debug_assert_eq!(slot.len() as u64, len);
            // Every read waits at most the silence bound, and never past the call's bound: a
            // piece from a slow donor must not carry the fetch past it.
            let mut filled = 0;
            while filled < slot.len() {
                let wait =
                    f.until.map_or(f.io_timeout, |u| u.saturating_duration_since(Instant::now()).min(f.io_timeout));
                if wait.is_zero() {
                    return Err("the call's bound passed".into());
                }
                s.set_read_timeout(Some(wait)).map_err(|e| e.to_string())?;
                match s.read(&mut slot[filled..]) {
                    Ok(0) => return Err("the donor closed the connection".into()),
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                        if wait < f.io_timeout {
                            return Err("the call's bound passed".into());
                        }
                        return Err(format!("silent for {:?}", f.io_timeout));
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
            Ok(())
        })();
        let mut w = work.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = fetched {
            w.queues[i].push_front((offset, len));
            drop(w);
            changed.notify_all();
            return Err(e);
        }
        w.outstanding[i] -= 1;
        w.served[i].insert(donor);
        f.arrived.fetch_add(len, Ordering::Relaxed);
        let total = wanted[i].len;
        let before = w.done_bytes[i];
        w.done_bytes[i] += len;
        if total >= PROGRESS_BYTES && before * 10 / total != w.done_bytes[i] * 10 / total {
            log::info!(
                "{}: tensor {} of the shared state: {} of {} MiB",
                f.me,
                wanted[i].index,
                w.done_bytes[i] >> 20,
                total >> 20
            );
        }
        drop(w);
        changed.notify_all();
    }
}
