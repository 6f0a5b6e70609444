//! Moving shared state between peers: the tensors of a state, their hashes, the pieces a fetcher
//! asks each donor for and verifies by hash, how a donor serves them (paced, from the copy it
//! keeps for newcomers or from its live tensors), and that copy. What `sync_shared_state`
//! (`sync.rs`) and a newcomer's catch-up (`catchup.rs`) share; it knows nothing of the calls
//! (`docs/state.md`).

use crate::error::{Error, Result};
use shoal_collective::DType;
use shoal_config::failpoint;
use shoal_proto::auth::DataKey;
use shoal_transport::{read_message_until, write_message, Conn, PollFd, TlsConfig};
use shoal_wire::{
    truncate, Message, PeerId, SessionId, StateDigest, MAX_BODY_BYTES, MAX_DIMS, MAX_STATE_ENTRIES, MAX_STRING_BYTES,
};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
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

/// A fetcher's request, as the listener hands it over.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FetchReq {
    pub from: PeerId,
    pub round: u64,
    pub index: u32,
    pub offset: u64,
    pub len: u64,
}

/// A fetch connection, as the listener hands it over: its first request checked already.
pub(crate) struct FetchConn {
    pub stream: Conn,
    pub asker: Asker,
    pub first: FetchReq,
    /// Counts it among the fetch connections the listener holds, until it is dropped.
    pub held: Held,
}

/// One of at most a number of things held at once, counted until it is dropped.
pub(crate) struct Held(Arc<AtomicUsize>);

impl Held {
    /// One more of what `count` counts, if fewer than `cap` are held.
    pub fn take(count: &Arc<AtomicUsize>, cap: usize) -> Option<Held> {
        let taken = count.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < cap).then_some(n + 1)).is_ok();
        taken.then(|| Held(Arc::clone(count)))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why a message on a fetch connection is not served.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchRefused {
    #[error("expected FetchRequest, got {0}")]
    NotARequest(&'static str),
    #[error("a fetch for {to} in session {session:016x}, we are {me} in {ours:016x}")]
    Elsewhere { to: PeerId, session: u64, me: PeerId, ours: u64 },
    #[error("a FetchRequest posing as {0} without the run's data key")]
    Forged(PeerId),
    #[error("a request from {now} on a connection {first} opened")]
    OtherFetcher { first: PeerId, now: PeerId },
}

/// Who may ask on a fetch connection: the fetcher its first request named. Every request carries
/// its own tag under the run's data key and is checked before anything is served, not only the
/// first (later ones were once served whatever their tag, session or sender).
#[derive(Clone)]
pub(crate) struct Asker {
    me: PeerId,
    session: SessionId,
    key: DataKey,
    from: PeerId,
}

impl Asker {
    /// The fetcher behind `message`, the first on a connection to `me`, received in `got`, and
    /// its request.
    pub fn first(
        me: PeerId,
        session: SessionId,
        key: &DataKey,
        got: SessionId,
        message: &Message,
    ) -> std::result::Result<(Asker, FetchReq), FetchRefused> {
        let &Message::FetchRequest { from, .. } = message else {
            return Err(FetchRefused::NotARequest(message.name()));
        };
        let asker = Asker { me, session, key: key.clone(), from };
        let request = asker.next(got, message)?;
        Ok((asker, request))
    }

    /// `message`, received in `got`, as a request of this connection's fetcher.
    pub fn next(&self, got: SessionId, message: &Message) -> std::result::Result<FetchReq, FetchRefused> {
        let &Message::FetchRequest { from, to, round, index, offset, len, mac } = message else {
            return Err(FetchRefused::NotARequest(message.name()));
        };
        let (me, ours) = (self.me, self.session);
        if got != ours || to != me {
            return Err(FetchRefused::Elsewhere { to, session: got.0, me, ours: ours.0 });
        }
        if !DataKey::matches(self.key.fetch(got, from, to, round, index, offset, len), &mac) {
            return Err(FetchRefused::Forged(from));
        }
        if from != self.from {
            return Err(FetchRefused::OtherFetcher { first: self.from, now: from });
        }
        Ok(FetchReq { from, round, index, offset, len })
    }
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

/// A copy of the shared state a sync ended with, kept for newcomers.
pub(crate) struct Snapshot {
    round: u64,
    /// The tensors, sorted by name, as the sync ended.
    tensors: Vec<Vec<u8>>,
    /// Set when the copy is dropped: its servers stop.
    dropped: AtomicBool,
}

impl Snapshot {
    /// The copy of a state's `tensors` (sorted by name) as sync `round` ended.
    pub fn new(round: u64, tensors: Vec<Vec<u8>>) -> Self {
        Snapshot { round, tensors, dropped: AtomicBool::new(false) }
    }
}

/// The copy this peer keeps, if any, and how it serves it.
pub(crate) struct Snapshots {
    current: Mutex<Option<Arc<Snapshot>>>,
    rate: Option<RateLimit>,
    io_timeout: Duration,
    sent: AtomicU64,
}

impl Snapshots {
    /// Serves copies at `rate` bytes per second at most (all fetchers together), waiting up to
    /// `io_timeout` on a fetcher.
    pub fn new(rate: Option<u64>, io_timeout: Duration) -> Arc<Self> {
        let rate = rate.map(|bytes_per_s| RateLimit { bytes_per_s, next: Mutex::new(Instant::now()) });
        Arc::new(Snapshots { current: Mutex::new(None), rate, io_timeout, sent: AtomicU64::new(0) })
    }

    pub fn keep(&self, snapshot: Snapshot) {
        let old = self.current.lock().unwrap_or_else(PoisonError::into_inner).replace(Arc::new(snapshot));
        if let Some(old) = old {
            old.dropped.store(true, Ordering::Relaxed);
        }
    }

    /// Drops the copy kept: its servers stop, and its memory goes once they have.
    pub fn drop_kept(&self) {
        if let Some(old) = self.current.lock().unwrap_or_else(PoisonError::into_inner).take() {
            let served = self.sent.load(Ordering::Relaxed) >> 20;
            log::info!(
                "dropping the copy of the shared state of sync {} ({served} MiB served to newcomers)",
                old.round
            );
            old.dropped.store(true, Ordering::Relaxed);
        }
    }

    /// Serves `fetch` if it asks for the copy kept; otherwise hands it back (a fetch of a sync in
    /// progress).
    pub fn serve(&self, fetch: FetchConn) -> Option<FetchConn> {
        let kept = self.current.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let Some(snapshot) = kept.filter(|s| s.round == fetch.first.round) else { return Some(fetch) };
        let served = Served { bytes: &self.sent, to: None };
        let (round, views, from) = (snapshot.round, &snapshot.tensors, fetch.first.from);
        if let Err(e) = serve(fetch, round, views, &served, &snapshot.dropped, self.rate.as_ref(), self.io_timeout) {
            log::debug!("serving the copy of sync {round} to {from}: {e}");
        }
        None
    }
}

/// Paces bytes to a rate shared by every thread that takes from it.
pub(crate) struct RateLimit {
    bytes_per_s: u64,
    /// When the bytes taken so far have left at the rate.
    next: Mutex<Instant>,
}

impl RateLimit {
    /// Bytes taken at a time: small enough that the pace is even at a few MB/s.
    pub const GRAIN: usize = 256 << 10;

    /// Waits until `bytes` more may go.
    pub fn take(&self, bytes: usize) {
        let wait = {
            let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            // Idle time is not saved up: a burst after a pause goes at the rate too.
            let start = (*next).max(now);
            *next = start + Duration::from_secs_f64(bytes as f64 / self.bytes_per_s as f64);
            start - now
        };
        std::thread::sleep(wait);
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

/// Why a server stopped answering a fetcher before it hung up.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ServeFailed {
    /// The connection failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A request that is not this fetcher's, or not a request.
    #[error(transparent)]
    Refused(#[from] FetchRefused),
    /// A request for bytes the sync served does not hold.
    #[error("request {request:?} does not fit sync {round}")]
    Misfit { request: FetchReq, round: u64 },
}

/// Answers one fetcher's requests for tensors of `round` from `views` until it hangs up, stays
/// silent for `io_timeout`, sends anything but its own tagged request, or `stop` is set; at most
/// at `rate`.
pub(crate) fn serve<T: AsRef<[u8]>>(
    FetchConn { mut stream, asker, first, held: _held }: FetchConn,
    round: u64,
    views: &[T],
    served: &Served<'_>,
    stop: &AtomicBool,
    rate: Option<&RateLimit>,
    io_timeout: Duration,
) -> std::result::Result<(), ServeFailed> {
    stream.set_write_timeout(Some(io_timeout))?;
    let mut request = first;
    loop {
        let (start, end) = (request.offset, request.offset.saturating_add(request.len));
        let tensor = views.get(request.index as usize).map(AsRef::as_ref);
        let Some(tensor) = tensor.filter(|t| request.round == round && end <= t.len() as u64) else {
            return Err(ServeFailed::Misfit { request, round });
        };
        let bytes = &tensor[start as usize..end as usize];
        match rate {
            None => stream.write_all(bytes)?,
            Some(rate) => {
                for part in bytes.chunks(RateLimit::GRAIN) {
                    rate.take(part.len());
                    stream.write_all(part)?;
                }
            }
        }
        served.bytes.fetch_add(request.len, Ordering::Relaxed);
        if let Some(to) = served.to {
            to.lock().unwrap_or_else(PoisonError::into_inner).insert(request.from);
        }
        failpoint("sync.serve");
        // The next request, or the end: the fetcher hangs up or idles, or the sync ends here.
        let idle_until = Instant::now() + io_timeout;
        loop {
            if stop.load(Ordering::Relaxed) || Instant::now() >= idle_until {
                return Ok(());
            }
            // A request may wait in the TLS session already, where no poll sees it.
            if !stream.has_buffered_input() {
                let mut fd = PollFd::new(&stream);
                fd.want_read = true;
                if shoal_transport::poll(&mut [fd], Duration::from_millis(50))? == 0 {
                    continue;
                }
            }
            match read_message_until(&mut stream, idle_until, MAX_BODY_BYTES) {
                Ok((session, message)) => {
                    request = asker.next(session, &message)?;
                    break;
                }
                Err(_) => return Ok(()), // hung up
            }
        }
    }
}

/// A wanted tensor's bytes, verified, and the donors that delivered them.
pub(crate) type Fetched = (Vec<u8>, Vec<PeerId>);

/// Why a fetch of shared state ended without it: what a sync reports to the master.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum FetchFailed {
    /// The master's plan names another number of tensors than the state has.
    #[error("a plan of {plan} tensors for a state of {state}")]
    PlanMisfit { plan: usize, state: usize },
    /// Every donor of a tensor failed before all of it arrived.
    #[error("every donor of tensor {0:?} failed before it arrived")]
    NoDonorLeft(String),
    /// A tensor arrived whole but cannot be hashed as its layout says.
    #[error("tensor {name:?}: {reason}")]
    Unhashable { name: String, reason: shoal_state::HashError },
    /// A tensor arrived whole with another hash than the elected one.
    #[error("tensor {name:?} arrived with hash {got}, not the one elected")]
    WrongHash { name: String, got: shoal_state::TensorHash },
}

/// Fetches every wanted tensor of `round` from its donors, one thread per donor; returns their
/// bytes, verified, in the order of `wanted`, each with the donors that delivered it, or why that
/// is impossible.
pub(crate) fn fetch(
    f: &Fetcher<'_>,
    round: u64,
    wanted: &[Wanted],
    meta: &[(DType, Vec<u64>, String)],
    addrs: &BTreeMap<PeerId, String>,
) -> std::result::Result<Vec<Fetched>, FetchFailed> {
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
        return Err(FetchFailed::NoDonorLeft(name.clone()));
    }
    let mut out = Vec::with_capacity(wanted.len());
    for ((w, data), served) in wanted.iter().zip(buffers).zip(served) {
        let (dtype, shape, name) = &meta[w.index];
        let hash = shoal_state::hash_tensor(*dtype, shape, &data)
            .map_err(|reason| FetchFailed::Unhashable { name: name.clone(), reason })?;
        if hash.0 != w.hash {
            return Err(FetchFailed::WrongHash { name: name.clone(), got: hash });
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
