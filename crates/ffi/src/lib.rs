//! shoal's C ABI (`include/shoal.h`): a master and communicators for C and C++ programs.
//!
//! Every function returns a [`ShoalStatus`]: `SHOAL_STATUS_OK`, or the kind of error, whose
//! message [`shoal_last_error`] returns on the same thread. The codes are stable: new ones are
//! only ever added. [`shoal_status_retryable`] says which errors a training loop retries as they
//! are (a lost peer, an interrupted master). No panic crosses the boundary: one becomes
//! `SHOAL_STATUS_PANIC` (a bug) with its message. Handles are opaque; each is freed by its `_free`
//! function, which also closes it. Buffers are the caller's and must stay valid for the call.
#![warn(missing_docs)]
// The boundary: raw pointers from C, checked for null before use.
#![allow(unsafe_code, clippy::missing_safety_doc)]

use shoal_master::{MasterOptions, MasterServer};
use shoal_peer::{Communicator, CommunicatorConfig, DType, Error, ReduceOp};
use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

/// What a call of the C ABI returned. The values never change.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShoalStatus {
    /// Success.
    Ok = 0,
    /// An argument is unusable (null, a bad size, an unknown code); nothing was done.
    InvalidArgument = 1,
    /// The API was used out of order (a collective before connecting, say), or peers made calls
    /// that cannot complete together.
    Usage = 2,
    /// A peer taking part was lost; the operation did not happen and buffers are as before.
    /// Retryable.
    PeerLost = 3,
    /// The connection to the master broke during a vote or sync; the peer rejoins a restarted
    /// master. Retryable.
    MasterInterrupted = 4,
    /// The master cannot be reached, or stopped answering.
    MasterUnreachable = 5,
    /// The call did not finish within its bound.
    Timeout = 6,
    /// Peers called different collectives (count, dtype, op, tag or kind differ).
    Mismatch = 7,
    /// The master expelled this peer.
    Kicked = 8,
    /// The run's credentials were refused.
    Authentication = 9,
    /// Fewer peers than required were accepted in time.
    TooFewPeers = 10,
    /// Another party broke the protocol.
    Protocol = 11,
    /// A local socket or file operation failed.
    Io = 12,
    /// A `SHOAL_*` variable is invalid.
    Config = 13,
    /// A shared-state sync could not complete and calling again will not help.
    SyncFailed = 14,
    /// A bug in shoal: a panic, caught at the boundary.
    Panic = 99,
}

/// Element types, by code: what the `dtype` arguments take.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShoalDtype {
    /// Unsigned 8-bit integer.
    U8 = 0,
    /// Signed 8-bit integer.
    I8 = 1,
    /// Signed 16-bit integer.
    I16 = 2,
    /// Unsigned 16-bit integer.
    U16 = 3,
    /// Signed 32-bit integer.
    I32 = 4,
    /// Unsigned 32-bit integer.
    U32 = 5,
    /// Signed 64-bit integer.
    I64 = 6,
    /// Unsigned 64-bit integer.
    U64 = 7,
    /// IEEE 754 half precision.
    F16 = 8,
    /// bfloat16.
    Bf16 = 9,
    /// IEEE 754 single precision.
    F32 = 10,
    /// IEEE 754 double precision.
    F64 = 11,
}

/// Reductions, by code: what the `op` arguments take.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShoalOp {
    /// Sum.
    Sum = 0,
    /// Sum divided by the number of participants.
    Avg = 1,
    /// Product.
    Prod = 2,
    /// Minimum.
    Min = 3,
    /// Maximum.
    Max = 4,
}

/// A running master (opaque).
pub struct ShoalMaster(MasterServer);

/// A communicator (opaque).
pub struct ShoalComm(Communicator);

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(message: &str) {
    let message = CString::new(message.replace('\0', " ")).expect("no NUL left");
    LAST_ERROR.with(|e| *e.borrow_mut() = message);
}

/// The status of `e`, with its message kept for [`shoal_last_error`].
fn status_of(e: &Error) -> ShoalStatus {
    set_error(&e.to_string());
    match e {
        Error::NotConnected | Error::AlreadyConnected | Error::Closed | Error::Misuse(_) | Error::Usage(_) => {
            ShoalStatus::Usage
        }
        Error::InvalidArgument(_) => ShoalStatus::InvalidArgument,
        Error::MasterUnreachable { .. } => ShoalStatus::MasterUnreachable,
        Error::MasterInterrupted { .. } => ShoalStatus::MasterInterrupted,
        Error::Authentication { .. } => ShoalStatus::Authentication,
        Error::Kicked { .. } => ShoalStatus::Kicked,
        Error::PeerLost { .. } | Error::SyncFailed { retryable: true, .. } => ShoalStatus::PeerLost,
        Error::SyncFailed { retryable: false, .. } => ShoalStatus::SyncFailed,
        Error::TooFewPeers { .. } => ShoalStatus::TooFewPeers,
        Error::Timeout { .. } => ShoalStatus::Timeout,
        Error::CollectiveMismatch { .. } => ShoalStatus::Mismatch,
        Error::Protocol(_) => ShoalStatus::Protocol,
        Error::Config(_) => ShoalStatus::Config,
        Error::Io { .. } => ShoalStatus::Io,
        _ => ShoalStatus::Protocol,
    }
}

fn invalid(message: &str) -> ShoalStatus {
    set_error(message);
    ShoalStatus::InvalidArgument
}

/// Runs `f`, turning a panic into [`ShoalStatus::Panic`] and success into a cleared message.
fn guard(f: impl FnOnce() -> ShoalStatus) -> ShoalStatus {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(status) => {
            if status == ShoalStatus::Ok {
                set_error("");
            }
            status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            set_error(&format!("a bug in shoal: {what}"));
            ShoalStatus::Panic
        }
    }
}

fn result<T>(r: Result<T, Error>) -> ShoalStatus {
    match r {
        Ok(_) => ShoalStatus::Ok,
        Err(e) => status_of(&e),
    }
}

unsafe fn string(p: *const c_char, what: &str) -> Result<String, ShoalStatus> {
    if p.is_null() {
        return Err(invalid(&format!("{what} is NULL")));
    }
    CStr::from_ptr(p).to_str().map(str::to_string).map_err(|_| invalid(&format!("{what} is not UTF-8")))
}

/// The element type of a [`ShoalDtype`] code: C may pass any integer.
fn dtype(code: u32) -> Result<DType, ShoalStatus> {
    DType::ALL.get(code as usize).copied().ok_or_else(|| invalid(&format!("dtype {code} is not a ShoalDtype")))
}

/// The reduction of a [`ShoalOp`] code.
fn op(code: u32) -> Result<ReduceOp, ShoalStatus> {
    let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max];
    ops.get(code as usize).copied().ok_or_else(|| invalid(&format!("op {code} is not a ShoalOp")))
}

/// `count` elements of `d` at `p`, as bytes; `NULL` only with a count of zero.
unsafe fn bytes<'a>(p: *const c_void, count: usize, d: DType, what: &str) -> Result<&'a [u8], ShoalStatus> {
    let len = count.checked_mul(d.size()).ok_or_else(|| invalid(&format!("{what}: count overflows")))?;
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(invalid(&format!("{what} is NULL")));
    }
    Ok(std::slice::from_raw_parts(p.cast::<u8>(), len))
}

unsafe fn bytes_mut<'a>(p: *mut c_void, count: usize, d: DType, what: &str) -> Result<&'a mut [u8], ShoalStatus> {
    let len = count.checked_mul(d.size()).ok_or_else(|| invalid(&format!("{what}: count overflows")))?;
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(invalid(&format!("{what} is NULL")));
    }
    Ok(std::slice::from_raw_parts_mut(p.cast::<u8>(), len))
}

unsafe fn communicator<'a>(c: *const ShoalComm) -> Result<&'a Communicator, ShoalStatus> {
    c.as_ref().map(|c| &c.0).ok_or_else(|| invalid("the communicator is NULL"))
}

/// Seconds as a bound: `<= 0` (or not finite) means the default.
fn seconds(s: f64) -> Option<Duration> {
    (s.is_finite() && s > 0.0).then(|| Duration::from_secs_f64(s.min(1e9)))
}

macro_rules! try_ffi {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(status) => return status,
        }
    };
}

/// The message of the last error on this thread (empty after a success). Valid until the next
/// call on this thread.
#[no_mangle]
pub extern "C" fn shoal_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Whether a loop retries a call that returned `status` as it is: a lost peer or an interrupted
/// master (the call did not happen; buffers are as before).
#[no_mangle]
pub extern "C" fn shoal_status_retryable(status: ShoalStatus) -> bool {
    matches!(status, ShoalStatus::PeerLost | ShoalStatus::MasterInterrupted)
}

/// The library's version, `"MAJOR.MINOR.PATCH"`.
#[no_mangle]
pub extern "C" fn shoal_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// Starts a master listening on `listen` (`"host:port"`, port 0: ephemeral) in background
/// threads. `heartbeat_timeout_s <= 0`: `SHOAL_HEARTBEAT_TIMEOUT` or the default. `secret` may be
/// NULL (`SHOAL_SECRET` or none).
#[no_mangle]
pub unsafe extern "C" fn shoal_master_start(
    listen: *const c_char,
    heartbeat_timeout_s: f64,
    secret: *const c_char,
    out: *mut *mut ShoalMaster,
) -> ShoalStatus {
    guard(|| {
        if out.is_null() {
            return invalid("out is NULL");
        }
        let listen = try_ffi!(string(listen, "listen"));
        let mut options = try_ffi!(MasterOptions::from_env(&listen).map_err(|e| status_of(&e.into())));
        if let Some(t) = seconds(heartbeat_timeout_s) {
            options.heartbeat_timeout = Some(t);
        }
        if !secret.is_null() {
            options.secret = Some(try_ffi!(string(secret, "secret")).into_bytes());
        }
        match MasterServer::start(options) {
            Ok(m) => {
                *out = Box::into_raw(Box::new(ShoalMaster(m)));
                ShoalStatus::Ok
            }
            Err(e) => status_of(&Error::Io { context: format!("starting a master on {listen}"), source: e }),
        }
    })
}

/// Writes the master's `"host:port"` (the real port) into `buf` of `len` bytes, NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn shoal_master_address(master: *const ShoalMaster, buf: *mut c_char, len: usize) -> ShoalStatus {
    guard(|| {
        let Some(m) = master.as_ref() else { return invalid("the master is NULL") };
        let addr = m.0.local_addr().to_string();
        if buf.is_null() || len <= addr.len() {
            return invalid(&format!("the buffer needs {} bytes", addr.len() + 1));
        }
        std::ptr::copy_nonoverlapping(addr.as_ptr(), buf.cast::<u8>(), addr.len());
        *buf.add(addr.len()) = 0;
        ShoalStatus::Ok
    })
}

/// Stops the master, closes every connection and frees it. NULL is ignored.
#[no_mangle]
pub unsafe extern "C" fn shoal_master_free(master: *mut ShoalMaster) {
    if !master.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| drop(Box::from_raw(master))));
    }
}

/// A communicator for the master at `master_addr`, in peer group `group`, configured from the
/// `SHOAL_*` environment. Does no IO: [`shoal_comm_connect`] joins.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_new(
    master_addr: *const c_char,
    group: u32,
    out: *mut *mut ShoalComm,
) -> ShoalStatus {
    guard(|| {
        if out.is_null() {
            return invalid("out is NULL");
        }
        let addr = try_ffi!(string(master_addr, "master_addr"));
        let mut config = try_ffi!(CommunicatorConfig::from_env(&addr).map_err(|e| status_of(&e)));
        config.group = group;
        match Communicator::new(config) {
            Ok(c) => {
                *out = Box::into_raw(Box::new(ShoalComm(c)));
                ShoalStatus::Ok
            }
            Err(e) => status_of(&e),
        }
    })
}

/// Leaves the run, closes every connection and frees the communicator. NULL is ignored.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_free(comm: *mut ShoalComm) {
    if !comm.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| drop(Box::from_raw(comm))));
    }
}

/// Joins the run; returns once accepted, with at least `min_world_size` members in this peer's
/// group (0 or 1: at once when accepted). `timeout_s <= 0`: the configured bound.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_connect(
    comm: *const ShoalComm,
    timeout_s: f64,
    min_world_size: usize,
) -> ShoalStatus {
    guard(|| result(try_ffi!(communicator(comm)).connect_until(seconds(timeout_s), min_world_size.max(1))))
}

/// The admission vote: every accepted peer calls it; returns once newcomers are in.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_update_topology(comm: *const ShoalComm) -> ShoalStatus {
    guard(|| result(try_ffi!(communicator(comm)).update_topology()))
}

/// Whether `shoal_update_topology` has something to apply (peers wait for admission, or the ring
/// was re-planned around a link that slowed down; a vote every accepted peer calls), into `out`.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_peers_pending(comm: *const ShoalComm, out: *mut bool) -> ShoalStatus {
    guard(|| {
        if out.is_null() {
            return invalid("out is NULL");
        }
        match try_ffi!(communicator(comm)).peers_pending() {
            Ok(p) => {
                *out = p;
                ShoalStatus::Ok
            }
            Err(e) => status_of(&e),
        }
    })
}

/// Our group's size and our rank in it, in the topology in force.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_rank(
    comm: *const ShoalComm,
    rank: *mut usize,
    world_size: *mut usize,
) -> ShoalStatus {
    guard(|| {
        let c = try_ffi!(communicator(comm));
        let (Some(r), Some(w)) = (c.rank(), c.group_world_size()) else {
            set_error("the communicator is not connected: call shoal_comm_connect first");
            return ShoalStatus::Usage;
        };
        if rank.is_null() || world_size.is_null() {
            return invalid("rank or world_size is NULL");
        }
        (*rank, *world_size) = (r, w);
        ShoalStatus::Ok
    })
}

/// Splits the group of `comm` like `MPI_Comm_split`: every member calls it (a collective of the
/// group); those that give the same `color` (0 to 2^32 - 1) form one group, ranked by `key` and
/// then by their rank in `comm`; a member that gives a negative color is in none and gets NULL
/// in `*out`. The new communicator shares `comm`'s connections and is freed with
/// [`shoal_comm_free`], before or after `comm`.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_split(
    comm: *const ShoalComm,
    color: i64,
    key: i64,
    out: *mut *mut ShoalComm,
) -> ShoalStatus {
    guard(|| {
        let c = try_ffi!(communicator(comm));
        let Ok(color) = (color >= 0).then(|| u32::try_from(color)).transpose() else {
            return invalid(&format!("color {color} is above 2^32 - 1"));
        };
        put(out, || c.split(color, key))
    })
}

/// The group of the members of `comm` at the `n` ranks `ranks`, like `torch.distributed.new_group`:
/// every member of `comm`'s group calls it with the same ranks (a collective of the group); those
/// at `ranks` get a communicator ranked as `ranks` sorted, the others NULL in `*out`. Freed as
/// [`shoal_comm_split`]'s.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_new_group(
    comm: *const ShoalComm,
    ranks: *const usize,
    n: usize,
    out: *mut *mut ShoalComm,
) -> ShoalStatus {
    guard(|| {
        let c = try_ffi!(communicator(comm));
        if ranks.is_null() && n > 0 {
            return invalid("ranks is NULL");
        }
        let ranks = if n == 0 { &[][..] } else { std::slice::from_raw_parts(ranks, n) };
        put(out, || c.new_group(ranks))
    })
}

/// Writes the derived group `make` gives to `*out` (NULL for none).
unsafe fn put(out: *mut *mut ShoalComm, make: impl FnOnce() -> Result<Option<Communicator>, Error>) -> ShoalStatus {
    if out.is_null() {
        return invalid("out is NULL");
    }
    match make() {
        Ok(group) => {
            *out = group.map_or(std::ptr::null_mut(), |g| Box::into_raw(Box::new(ShoalComm(g))));
            ShoalStatus::Ok
        }
        Err(e) => status_of(&e),
    }
}

/// All-reduces `count` elements of `dtype` at `buf` in place with `op`. Peers' calls must match
/// (count, dtype, op, tag).
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_all_reduce(
    comm: *const ShoalComm,
    buf: *mut c_void,
    count: usize,
    dtype: u32,
    op: u32,
    tag: u64,
) -> ShoalStatus {
    guard(|| {
        let (c, dtype, op) = (try_ffi!(communicator(comm)), try_ffi!(self::dtype(dtype)), try_ffi!(self::op(op)));
        let buf = try_ffi!(bytes_mut(buf, count, dtype, "buf"));
        result(c.all_reduce(buf, dtype, op, tag, None, None))
    })
}

/// Gathers every member's `in_count` elements at `inp` into `out`, in rank order: `out_count`
/// must be the group's size times `in_count`.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_all_gather(
    comm: *const ShoalComm,
    out: *mut c_void,
    out_count: usize,
    inp: *const c_void,
    in_count: usize,
    dtype: u32,
    tag: u64,
) -> ShoalStatus {
    guard(|| {
        let (c, dtype) = (try_ffi!(communicator(comm)), try_ffi!(self::dtype(dtype)));
        let out = try_ffi!(bytes_mut(out, out_count, dtype, "out"));
        let inp = try_ffi!(bytes(inp, in_count, dtype, "inp"));
        result(c.all_gather(out, inp, dtype, tag, None))
    })
}

/// Reduces every member's `inp` block by block with `op`, leaving block `rank` in `out`:
/// `in_count` must be the group's size times `out_count`.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_reduce_scatter(
    comm: *const ShoalComm,
    out: *mut c_void,
    out_count: usize,
    inp: *const c_void,
    in_count: usize,
    dtype: u32,
    op: u32,
    tag: u64,
) -> ShoalStatus {
    guard(|| {
        let (c, dtype, op) = (try_ffi!(communicator(comm)), try_ffi!(self::dtype(dtype)), try_ffi!(self::op(op)));
        let out = try_ffi!(bytes_mut(out, out_count, dtype, "out"));
        let inp = try_ffi!(bytes(inp, in_count, dtype, "inp"));
        result(c.reduce_scatter(out, inp, dtype, op, tag, None))
    })
}

/// Copies member `root`'s `count` elements at `buf` into every other member's `buf`.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_broadcast(
    comm: *const ShoalComm,
    buf: *mut c_void,
    count: usize,
    dtype: u32,
    root: usize,
    tag: u64,
) -> ShoalStatus {
    guard(|| {
        let (c, dtype) = (try_ffi!(communicator(comm)), try_ffi!(self::dtype(dtype)));
        let buf = try_ffi!(bytes_mut(buf, count, dtype, "buf"));
        result(c.broadcast(buf, dtype, root, tag, None))
    })
}

/// Returns once every member of the group called it.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_barrier(comm: *const ShoalComm, tag: u64) -> ShoalStatus {
    guard(|| result(try_ffi!(communicator(comm)).barrier(tag)))
}

/// Sends `count` elements at `buf` to the member of rank `peer`, matched by its
/// [`shoal_comm_recv`] from us with `tag`.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_send(
    comm: *const ShoalComm,
    buf: *const c_void,
    count: usize,
    dtype: u32,
    peer: usize,
    tag: u64,
) -> ShoalStatus {
    guard(|| {
        let (c, dtype) = (try_ffi!(communicator(comm)), try_ffi!(self::dtype(dtype)));
        let buf = try_ffi!(bytes(buf, count, dtype, "buf"));
        result(c.send(buf, dtype, peer, tag))
    })
}

/// Receives into `count` elements at `buf` what the first member to send us with `tag` sends
/// (any member, as `MPI_ANY_SOURCE`), and writes its rank to `*source`.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_recv_any(
    comm: *const ShoalComm,
    buf: *mut c_void,
    count: usize,
    dtype: u32,
    tag: u64,
    source: *mut usize,
) -> ShoalStatus {
    guard(|| {
        if source.is_null() {
            return invalid("source is NULL");
        }
        let (c, dtype) = (try_ffi!(communicator(comm)), try_ffi!(self::dtype(dtype)));
        let buf = try_ffi!(bytes_mut(buf, count, dtype, "buf"));
        match c.recv_any(buf, dtype, tag) {
            Ok(info) => {
                *source = info.peer.expect("a receive names its sender");
                ShoalStatus::Ok
            }
            Err(e) => status_of(&e),
        }
    })
}

/// Receives into `count` elements at `buf` what the member of rank `peer` sends us with `tag`.
#[no_mangle]
pub unsafe extern "C" fn shoal_comm_recv(
    comm: *const ShoalComm,
    buf: *mut c_void,
    count: usize,
    dtype: u32,
    peer: usize,
    tag: u64,
) -> ShoalStatus {
    guard(|| {
        let (c, dtype) = (try_ffi!(communicator(comm)), try_ffi!(self::dtype(dtype)));
        let buf = try_ffi!(bytes_mut(buf, count, dtype, "buf"));
        result(c.recv(buf, dtype, peer, tag))
    })
}
