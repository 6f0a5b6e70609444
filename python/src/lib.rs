//! `shoal._native`: the Python face of the peer library and the master.
//!
//! This crate converts and nothing else: Python values to Rust settings, numpy byte views to
//! `&mut [u8]`, Rust errors to the exception classes of `shoal.errors`. Every blocking call
//! releases the GIL. The `shoal` package wraps these classes with tensor handling (numpy and
//! torch) and the documented signatures.
#![deny(unsafe_code)]

use numpy::{
    PyArray1, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray1, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBool;
use shoal_master::{MasterOptions, MasterServer};
use shoal_peer::{
    Algorithm, Communicator as Core, CommunicatorConfig, Cutoff, DType, Error, Info, Quantization, ReduceOp,
    StateTensor, Strategy, Usage, Vote, Work,
};
use shoal_transport::TlsFiles;
use std::os::raw::c_char;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Outcome of a completed collective.
#[pyclass(frozen, get_all, module = "shoal._native")]
#[derive(Clone)]
struct ReduceInfo {
    /// Peers that took part.
    world_size: usize,
    /// Bytes this peer sent.
    tx_bytes: u64,
    /// Bytes this peer received.
    rx_bytes: u64,
    /// Wall time of the call in seconds.
    elapsed: f64,
    /// The topology (epoch) the collective ran in.
    topology: u64,
    /// The collective's number within its topology: with `topology`, the same on every
    /// participant.
    sequence: u64,
    /// How it moved its data: "ring", "oneshot", "twoshot", "hierarchical", "doubling", "twolevel",
    /// "direct" (a transfer) or "single_copy" (a transfer read straight out of the sender's memory,
    /// on one host).
    algorithm: &'static str,
    /// A transfer: the rank of the member at the other end (for a receive from any member, the
    /// one whose send it took); `None` for a collective.
    peer: Option<usize>,
    /// Our rank in the group the call ran in.
    rank: usize,
    /// How much later than the earliest member each member called, seconds, by rank (0.0 for
    /// the earliest); the same on every participant. Empty where not measured: a transfer, a
    /// broadcast, a group of one, a collective the master decided.
    lateness: Vec<f64>,
    /// The rank that held the others up: the latest to call, by at least a millisecond and a
    /// tenth of the earliest member's call; `None` if nobody did (or not measured).
    last: Option<usize>,
    /// The ranks that took part: all, but for a collective with a deadline that left some out.
    included: Vec<usize>,
    /// For a collective with a deadline: whether peers waited to join when the master decided
    /// it (the same on every member); `None` for any other call.
    peers_pending: Option<bool>,
}

#[pymethods]
impl ReduceInfo {
    fn __repr__(&self) -> String {
        format!(
            "ReduceInfo(world_size={}, tx_bytes={}, rx_bytes={}, elapsed={:.6}, topology={}, sequence={}, \
             algorithm={:?}, peer={}, rank={}, lateness={:?}, last={}, included={:?}, peers_pending={})",
            self.world_size,
            self.tx_bytes,
            self.rx_bytes,
            self.elapsed,
            self.topology,
            self.sequence,
            self.algorithm,
            self.peer.map_or("None".to_string(), |p| p.to_string()),
            self.rank,
            self.lateness,
            self.last.map_or("None".to_string(), |p| p.to_string()),
            self.included,
            self.peers_pending.map_or("None", |p| if p { "True" } else { "False" })
        )
    }
}

impl From<Info> for ReduceInfo {
    fn from(info: Info) -> Self {
        ReduceInfo {
            world_size: info.world_size,
            tx_bytes: info.tx_bytes,
            rx_bytes: info.rx_bytes,
            elapsed: info.elapsed.as_secs_f64(),
            topology: info.topology,
            sequence: info.sequence,
            algorithm: info.algorithm.name(),
            peer: info.peer,
            rank: info.rank,
            last: info.last(),
            lateness: info.lateness.iter().map(Duration::as_secs_f64).collect(),
            included: info.included,
            peers_pending: info.peers_pending,
        }
    }
}

/// A collective's deadline (seconds) and fewest members, as Python passes them.
fn cutoff_of(cutoff: Option<(f64, u32)>) -> PyResult<Option<Cutoff>> {
    let Some((deadline, min)) = cutoff else { return Ok(None) };
    let deadline = Duration::try_from_secs_f64(deadline).map_err(|_| {
        PyValueError::new_err(format!("deadline must be a finite number of seconds >= 0, got {deadline}"))
    })?;
    Ok(Some(Cutoff { deadline, min }))
}

/// The dtype, operator and algorithm named `dtype`, `op` and `algorithm` (`None`: chosen).
fn reduction(dtype: &str, op: &str, algorithm: Option<&str>) -> PyResult<(DType, ReduceOp, Option<Algorithm>)> {
    Ok((element_type(dtype)?, reduce_op(op)?, algorithm_named(algorithm)?))
}

/// The algorithm named `algorithm` (None: the automatic choice).
fn algorithm_named(algorithm: Option<&str>) -> PyResult<Option<Algorithm>> {
    match algorithm {
        None | Some("auto") => Ok(None),
        Some(name) => Algorithm::from_name(name).map(Some).ok_or_else(|| {
            PyValueError::new_err(format!(
                "unknown algorithm {name:?}: expected auto, ring, oneshot, twoshot, hierarchical, doubling or twolevel"
            ))
        }),
    }
}

/// The element type named `dtype`.
fn element_type(dtype: &str) -> PyResult<DType> {
    DType::from_name(dtype).ok_or_else(|| PyTypeError::new_err(format!("unsupported dtype {dtype:?}")))
}

/// The quantization named by the API's `(quantization, quantization_block)`.
type QuantArg = Option<(String, Option<usize>)>;

fn quantization(q: QuantArg) -> PyResult<Option<Quantization>> {
    q.map(|(name, block)| Quantization::parse(&name, block).map_err(|e| PyValueError::new_err(e.to_string())))
        .transpose()
}

/// The operator named `op`.
fn reduce_op(op: &str) -> PyResult<ReduceOp> {
    ReduceOp::from_name(op)
        .ok_or_else(|| PyValueError::new_err(format!("unknown op {op:?}: expected one of sum, avg, prod, min, max")))
}

/// The memory (address, bytes) and element type of `arr` if it is a C-contiguous, writable,
/// aligned array of a dtype shoal reduces, in the machine's byte order; else None.
#[allow(unsafe_code)]
fn plain_array(arr: &Bound<'_, PyUntypedArray>) -> Option<(*mut u8, usize, DType)> {
    use numpy::npyffi::{NPY_ARRAY_ALIGNED, NPY_ARRAY_WRITEABLE};
    let descr = arr.dtype();
    let dtype = match (descr.kind(), descr.itemsize()) {
        (b'u', 1) => DType::U8,
        (b'i', 1) => DType::I8,
        (b'i', 2) => DType::I16,
        (b'u', 2) => DType::U16,
        (b'i', 4) => DType::I32,
        (b'u', 4) => DType::U32,
        (b'i', 8) => DType::I64,
        (b'u', 8) => DType::U64,
        (b'f', 2) => DType::F16,
        (b'f', 4) => DType::F32,
        (b'f', 8) => DType::F64,
        _ => return None,
    };
    let behaved = NPY_ARRAY_ALIGNED | NPY_ARRAY_WRITEABLE;
    // SAFETY: `arr` is a live numpy array: its object's fields may be read while we hold it.
    let fields = unsafe { &(*arr.as_array_ptr()).fields };
    let (flags, data) = (fields.flags, fields.data);
    let plain = descr.is_native_byteorder() != Some(false) && arr.is_c_contiguous() && flags & behaved == behaved;
    plain.then(|| (data.cast::<u8>(), arr.len() * descr.itemsize(), dtype))
}

/// `buf`, borrowed for writing.
fn writable<'py>(buf: &Bound<'py, PyArray1<u8>>, name: &str) -> PyResult<PyReadwriteArray1<'py, u8>> {
    buf.try_readwrite().map_err(|e| PyValueError::new_err(format!("{name} is not writable: {e}")))
}

/// `buf`, borrowed for reading: not while it is borrowed for writing (the output, say).
fn readable<'py>(buf: &Bound<'py, PyArray1<u8>>, name: &str) -> PyResult<PyReadonlyArray1<'py, u8>> {
    buf.try_readonly().map_err(|e| PyValueError::new_err(format!("{name} overlaps the output: {e}")))
}

/// The bytes of `view`, which must be contiguous.
fn contiguous_mut<'a>(view: &'a mut PyReadwriteArray1<'_, u8>, name: &str) -> PyResult<&'a mut [u8]> {
    view.as_slice_mut().map_err(|_| not_contiguous(name))
}

fn not_contiguous(name: &str) -> PyErr {
    PyValueError::new_err(format!("{name} is not contiguous"))
}

/// `buf`'s memory, to lend to a collective in flight (the `NativeWork` keeps `buf` alive).
fn lend(buf: &Bound<'_, PyArray1<u8>>, name: &str) -> PyResult<Lent> {
    let mut view = writable(buf, name)?;
    let bytes = contiguous_mut(&mut view, name)?;
    Ok(Lent { ptr: bytes.as_mut_ptr(), len: bytes.len() })
}

/// `buf`'s memory, to lend to a send in flight, which only reads it (the `NativeWork` keeps
/// `buf` alive).
fn lend_shared(buf: &Bound<'_, PyArray1<u8>>, name: &str) -> PyResult<Lent> {
    let view = readable(buf, name)?;
    let bytes = view.as_slice().map_err(|_| not_contiguous(name))?;
    Ok(Lent { ptr: bytes.as_ptr().cast_mut(), len: bytes.len() })
}

/// A numpy array's memory lent to a collective in flight. The `NativeWork` holding it also holds
/// the array (a blocking call's caller does), so the memory outlives the collective.
struct Lent {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the memory is a numpy array's, kept alive by the `NativeWork` that owns this value;
// only the engine touches it while the collective is in flight.
#[allow(unsafe_code)]
unsafe impl Send for Lent {}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: see `Lent`: the array is alive, and `len` bytes long.
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts(self.ptr, self.len)
        }
    }
}

impl AsMut<[u8]> for Lent {
    fn as_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: see `Lent`: the array is alive, and `len` bytes long.
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr, self.len)
        }
    }
}

/// A collective in flight (native part; use `shoal.Work`).
#[pyclass(frozen, module = "shoal._native")]
struct NativeWork {
    comm: Arc<Core>,
    work: Mutex<Box<dyn Pending>>,
    /// The array (or its uint8 view) whose memory the collective uses, if it uses one.
    _buf: Option<Py<PyAny>>,
}

/// A collective in flight, whatever buffer it holds.
trait Pending: Send {
    fn wait(&mut self, comm: &Core, timeout: Option<Duration>) -> Result<Info, Error>;
    fn done(&self, comm: &Core) -> bool;
}

impl<B: Send + 'static> Pending for Work<B> {
    fn wait(&mut self, comm: &Core, timeout: Option<Duration>) -> Result<Info, Error> {
        comm.wait(self, timeout)
    }

    fn done(&self, comm: &Core) -> bool {
        comm.done(self)
    }
}

impl NativeWork {
    fn new(comm: &Arc<Core>, work: impl Pending + 'static, buf: Option<&Bound<'_, PyAny>>) -> Self {
        let buf = buf.map(|b| b.clone().unbind());
        NativeWork { comm: Arc::clone(comm), work: Mutex::new(Box::new(work)), _buf: buf }
    }
}

#[pymethods]
impl NativeWork {
    /// Waits until the collective ended, at most `timeout` seconds (None: its bound).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<Bound<'_, PyAny>>) -> PyResult<ReduceInfo> {
        let timeout = timeout.map(|t| seconds("timeout", &t)).transpose()?;
        py.detach(|| {
            let mut work = self.work.lock().unwrap_or_else(PoisonError::into_inner);
            work.wait(&self.comm, timeout)
        })
        .map(ReduceInfo::from)
        .map_err(to_py)
    }

    /// Whether the collective ended.
    fn done(&self, py: Python<'_>) -> bool {
        py.detach(|| {
            let work = self.work.lock().unwrap_or_else(PoisonError::into_inner);
            work.done(&self.comm)
        })
    }
}

/// A `peers_pending` vote cast ahead (`Communicator.peers_pending_async`).
#[pyclass(module = "shoal._native")]
struct NativeVote {
    comm: Arc<Core>,
    /// Until waited for; then its answer.
    state: Mutex<VoteState>,
}

enum VoteState {
    Cast(Option<Vote>),
    Answered(Result<bool, String>),
}

#[pymethods]
impl NativeVote {
    /// Waits for the vote's answer (within the communicator's bound).
    fn wait(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match &mut *state {
                VoteState::Cast(vote) => {
                    let vote = vote.take().expect("a vote cast is waited for once");
                    let answer = self.comm.wait_vote(vote);
                    *state = VoteState::Answered(answer.as_ref().map(|p| *p).map_err(ToString::to_string));
                    answer
                }
                VoteState::Answered(Ok(pending)) => Ok(*pending),
                VoteState::Answered(Err(e)) => Err(Usage::WaitedAgain { what: "vote", failed: e.clone() }.into()),
            }
        })
        .map_err(to_py)
    }

    /// Whether the vote has its answer.
    fn done(&self, py: Python<'_>) -> bool {
        py.detach(|| match &*self.state.lock().unwrap_or_else(PoisonError::into_inner) {
            VoteState::Cast(Some(vote)) => self.comm.vote_done(vote),
            _ => true,
        })
    }
}

impl Drop for NativeVote {
    /// Its answer is kept until it is waited for.
    fn drop(&mut self) {
        if let VoteState::Cast(vote) = &mut *self.state.get_mut().unwrap_or_else(PoisonError::into_inner) {
            if let Some(vote) = vote.take() {
                let _ = self.comm.wait_vote(vote);
            }
        }
    }
}

impl Drop for NativeWork {
    /// A collective dropped in flight still writes into the array: it is waited for first.
    fn drop(&mut self) {
        let work = self.work.get_mut().unwrap_or_else(PoisonError::into_inner);
        if !work.done(&self.comm) {
            let _ = work.wait(&self.comm, None);
        }
    }
}

/// A peer's communicator (native part; use `shoal.Communicator`).
#[pyclass(frozen, module = "shoal._native")]
struct Communicator {
    inner: Arc<Core>,
}

#[pymethods]
impl Communicator {
    #[new]
    #[pyo3(signature = (master_addr, *, peer_group=0, secret=None, connections=None, listen_addr=None,
        advertise_addr=None, chunk_bytes=None, heartbeat_timeout=None, timeout=None, tls_cert=None, tls_key=None,
        tls_ca=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        master_addr: &str,
        peer_group: u32,
        secret: Option<String>,
        connections: Option<usize>,
        listen_addr: Option<String>,
        advertise_addr: Option<String>,
        chunk_bytes: Option<usize>,
        heartbeat_timeout: Option<Bound<'_, PyAny>>,
        timeout: Option<Bound<'_, PyAny>>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        tls_ca: Option<PathBuf>,
    ) -> PyResult<Self> {
        let mut c = CommunicatorConfig::from_env(master_addr).map_err(to_py)?;
        c.tls = tls_files([tls_cert, tls_key, tls_ca], c.tls)?;
        c.group = peer_group;
        if let Some(s) = secret {
            c.secret = Some(s.into_bytes());
        }
        if connections.is_some() {
            c.connections = connections;
        }
        if let Some(a) = listen_addr {
            c.listen_addr = a;
        }
        if advertise_addr.is_some() {
            c.advertise_addr = advertise_addr;
        }
        if chunk_bytes.is_some() {
            c.chunk_bytes = chunk_bytes;
        }
        if let Some(s) = heartbeat_timeout {
            c.heartbeat_timeout = seconds("heartbeat_timeout", &s)?;
        }
        if let Some(s) = timeout {
            // A bound given pins every call's.
            (c.timeout, c.timeout_floor) = (seconds("timeout", &s)?, None);
        }
        Ok(Communicator { inner: Arc::new(Core::new(c).map_err(to_py)?) })
    }

    #[pyo3(signature = (timeout=None, min_world_size=1))]
    fn connect(&self, py: Python<'_>, timeout: Option<Bound<'_, PyAny>>, min_world_size: usize) -> PyResult<()> {
        let timeout = timeout.map(|s| seconds("timeout", &s)).transpose()?;
        py.detach(|| self.inner.connect_until(timeout, min_world_size)).map_err(to_py)
    }

    fn update_topology(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.update_topology()).map_err(to_py)
    }

    fn optimize_topology(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.optimize_topology()).map_err(to_py)
    }

    /// `[from][to]`: `(round trip µs, bytes per second)` or `None`.
    fn bandwidth_matrix(&self) -> Vec<Vec<Option<(u32, u64)>>> {
        let matrix = self.inner.bandwidth_matrix();
        matrix.into_iter().map(|row| row.into_iter().map(|l| l.map(|l| (l.rtt_us, l.bytes_per_s))).collect()).collect()
    }

    fn peers_pending(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| self.inner.peers_pending()).map_err(to_py)
    }

    fn peers_pending_async(&self, py: Python<'_>) -> PyResult<NativeVote> {
        let vote = py.detach(|| self.inner.peers_pending_async()).map_err(to_py)?;
        Ok(NativeVote { comm: Arc::clone(&self.inner), state: Mutex::new(VoteState::Cast(Some(vote))) })
    }

    /// All-reduces `buf`, a writable contiguous uint8 view of the tensor, as elements of
    /// `dtype`. The caller (shoal.Communicator) has checked the tensor.
    /// `cutoff`: (deadline in seconds, fewest members; 0: more than half) for a collective with
    /// a deadline.
    #[pyo3(signature = (buf, dtype, op, tag, algorithm=None, quant=None, cutoff=None))]
    #[allow(clippy::too_many_arguments)] // The Python call's arguments, one for one.
    fn all_reduce_bytes(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        op: &str,
        tag: u64,
        algorithm: Option<&str>,
        quant: QuantArg,
        cutoff: Option<(f64, u32)>,
    ) -> PyResult<ReduceInfo> {
        let (dtype, op, algorithm) = reduction(dtype, op, algorithm)?;
        let (q, cutoff) = (quantization(quant)?, cutoff_of(cutoff)?);
        let mut view = writable(buf, "tensor")?;
        let bytes = contiguous_mut(&mut view, "tensor")?;
        let info = py.detach(|| match cutoff {
            Some(c) => self.inner.all_reduce_with_deadline(bytes, dtype, op, tag, algorithm, q, c),
            None => self.inner.all_reduce(bytes, dtype, op, tag, algorithm, q),
        });
        Ok(info.map_err(to_py)?.into())
    }

    /// All-reduces numpy array `arr` in place like `all_reduce_bytes`, checking it here: the
    /// path of the common call, without the uint8 view (a microsecond or two per call, felt by
    /// small collectives). None, having done nothing, for any array it does not take as is
    /// (another dtype or byte order, not C-contiguous, read-only, unaligned): the caller's
    /// checks then say what is wrong.
    #[pyo3(signature = (arr, op, tag, algorithm=None, quant=None))]
    fn all_reduce_array(
        &self,
        py: Python<'_>,
        arr: &Bound<'_, PyUntypedArray>,
        op: &str,
        tag: u64,
        algorithm: Option<&str>,
        quant: QuantArg,
    ) -> PyResult<Option<ReduceInfo>> {
        let Some((ptr, len, dtype)) = plain_array(arr) else { return Ok(None) };
        let (op, algorithm, q) = (reduce_op(op)?, algorithm_named(algorithm)?, quantization(quant)?);
        // `arr`, held by the caller, outlives the call.
        let mut lent = Lent { ptr, len };
        let info = py.detach(|| self.inner.all_reduce(lent.as_mut(), dtype, op, tag, algorithm, q)).map_err(to_py)?;
        Ok(Some(info.into()))
    }

    /// All-gathers `inp` into `out` (views of tensors of `dtype`, checked by the caller).
    #[pyo3(signature = (out, inp, dtype, tag, quant=None, cutoff=None))]
    #[allow(clippy::too_many_arguments)] // The Python call's arguments, one for one.
    fn all_gather_bytes(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyArray1<u8>>,
        inp: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        tag: u64,
        quant: QuantArg,
        cutoff: Option<(f64, u32)>,
    ) -> PyResult<ReduceInfo> {
        let (dtype, q, cutoff) = (element_type(dtype)?, quantization(quant)?, cutoff_of(cutoff)?);
        let (mut out, inp) = (writable(out, "out")?, readable(inp, "inp")?);
        let (out, inp) = (contiguous_mut(&mut out, "out")?, inp.as_slice().map_err(|_| not_contiguous("inp"))?);
        let info = py.detach(|| match cutoff {
            Some(c) => self.inner.all_gather_with_deadline(out, inp, dtype, tag, q, c),
            None => self.inner.all_gather(out, inp, dtype, tag, q),
        });
        Ok(info.map_err(to_py)?.into())
    }

    /// Reduce-scatters `inp` into `out` (views of tensors of `dtype`, checked by the caller).
    #[pyo3(signature = (out, inp, dtype, op, tag, quant=None, cutoff=None))]
    #[allow(clippy::too_many_arguments)] // The Python call's arguments, one for one.
    fn reduce_scatter_bytes(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyArray1<u8>>,
        inp: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        op: &str,
        tag: u64,
        quant: QuantArg,
        cutoff: Option<(f64, u32)>,
    ) -> PyResult<ReduceInfo> {
        let (dtype, op, q) = (element_type(dtype)?, reduce_op(op)?, quantization(quant)?);
        let cutoff = cutoff_of(cutoff)?;
        let (mut out, inp) = (writable(out, "out")?, readable(inp, "inp")?);
        let (out, inp) = (contiguous_mut(&mut out, "out")?, inp.as_slice().map_err(|_| not_contiguous("inp"))?);
        let info = py.detach(|| match cutoff {
            Some(c) => self.inner.reduce_scatter_with_deadline(out, inp, dtype, op, tag, q, c),
            None => self.inner.reduce_scatter(out, inp, dtype, op, tag, q),
        });
        Ok(info.map_err(to_py)?.into())
    }

    /// Broadcasts `buf` (a view of a tensor of `dtype`) from rank `root`.
    #[pyo3(signature = (buf, dtype, root, tag, algorithm=None, cutoff=None))]
    #[allow(clippy::too_many_arguments)] // The Python call's arguments, one for one.
    fn broadcast_bytes(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        root: usize,
        tag: u64,
        algorithm: Option<&str>,
        cutoff: Option<(f64, u32)>,
    ) -> PyResult<ReduceInfo> {
        let ((dtype, _, algorithm), cutoff) = (reduction(dtype, "sum", algorithm)?, cutoff_of(cutoff)?);
        let mut view = writable(buf, "tensor")?;
        let bytes = contiguous_mut(&mut view, "tensor")?;
        let info = py.detach(|| match cutoff {
            Some(c) => self.inner.broadcast_with_deadline(bytes, dtype, root, tag, algorithm, c),
            None => self.inner.broadcast(bytes, dtype, root, tag, algorithm),
        });
        Ok(info.map_err(to_py)?.into())
    }

    /// Returns once every member of the group called it.
    fn barrier(&self, py: Python<'_>, tag: u64) -> PyResult<ReduceInfo> {
        Ok(py.detach(|| self.inner.barrier(tag)).map_err(to_py)?.into())
    }

    /// Starts all-reducing `buf` like `all_reduce_bytes` and returns at once; the returned work
    /// keeps `buf` (and so the tensor it views) alive until the collective ended.
    #[pyo3(signature = (buf, dtype, op, tag, algorithm=None, quant=None, cutoff=None))]
    #[allow(clippy::too_many_arguments)] // The Python call's arguments, one for one.
    fn all_reduce_bytes_async(
        &self,
        buf: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        op: &str,
        tag: u64,
        algorithm: Option<&str>,
        quant: QuantArg,
        cutoff: Option<(f64, u32)>,
    ) -> PyResult<NativeWork> {
        let (dtype, op, algorithm) = reduction(dtype, op, algorithm)?;
        let (q, cutoff, lent) = (quantization(quant)?, cutoff_of(cutoff)?, lend(buf, "tensor")?);
        let work = match cutoff {
            Some(c) => self.inner.all_reduce_async_with_deadline(lent, dtype, op, tag, algorithm, q, c),
            None => self.inner.all_reduce_async(lent, dtype, op, tag, algorithm, q),
        };
        Ok(NativeWork::new(&self.inner, work.map_err(to_py)?, Some(buf)))
    }

    /// Starts all-reducing numpy array `arr` like `all_reduce_array`; None, having done nothing,
    /// for an array it does not take as is. The returned work keeps `arr` alive.
    #[pyo3(signature = (arr, op, tag, algorithm=None, quant=None))]
    fn all_reduce_array_async(
        &self,
        arr: &Bound<'_, PyUntypedArray>,
        op: &str,
        tag: u64,
        algorithm: Option<&str>,
        quant: QuantArg,
    ) -> PyResult<Option<NativeWork>> {
        let Some((ptr, len, dtype)) = plain_array(arr) else { return Ok(None) };
        let (op, algorithm, q) = (reduce_op(op)?, algorithm_named(algorithm)?, quantization(quant)?);
        let work = self.inner.all_reduce_async(Lent { ptr, len }, dtype, op, tag, algorithm, q).map_err(to_py)?;
        Ok(Some(NativeWork::new(&self.inner, work, Some(arr))))
    }

    /// Starts `all_gather_bytes` and returns at once; `inp` is copied first.
    #[pyo3(signature = (out, inp, dtype, tag, quant=None, cutoff=None))]
    fn all_gather_bytes_async(
        &self,
        out: &Bound<'_, PyArray1<u8>>,
        inp: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        tag: u64,
        quant: QuantArg,
        cutoff: Option<(f64, u32)>,
    ) -> PyResult<NativeWork> {
        let (dtype, q, cutoff) = (element_type(dtype)?, quantization(quant)?, cutoff_of(cutoff)?);
        let lent = lend(out, "out")?;
        let inp = readable(inp, "inp")?;
        let inp = inp.as_slice().map_err(|_| not_contiguous("inp"))?;
        let work = match cutoff {
            Some(c) => self.inner.all_gather_async_with_deadline(lent, inp, dtype, tag, q, c),
            None => self.inner.all_gather_async(lent, inp, dtype, tag, q),
        };
        let work = work.map_err(to_py)?;
        Ok(NativeWork::new(&self.inner, work, Some(out)))
    }

    /// Starts `reduce_scatter_bytes` and returns at once; `inp` is copied first.
    #[pyo3(signature = (out, inp, dtype, op, tag, quant=None, cutoff=None))]
    #[allow(clippy::too_many_arguments)] // The Python call's arguments, one for one.
    fn reduce_scatter_bytes_async(
        &self,
        out: &Bound<'_, PyArray1<u8>>,
        inp: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        op: &str,
        tag: u64,
        quant: QuantArg,
        cutoff: Option<(f64, u32)>,
    ) -> PyResult<NativeWork> {
        let (dtype, op, q) = (element_type(dtype)?, reduce_op(op)?, quantization(quant)?);
        let (cutoff, lent) = (cutoff_of(cutoff)?, lend(out, "out")?);
        let inp = readable(inp, "inp")?;
        let inp = inp.as_slice().map_err(|_| not_contiguous("inp"))?;
        let work = match cutoff {
            Some(c) => self.inner.reduce_scatter_async_with_deadline(lent, inp, dtype, op, tag, q, c),
            None => self.inner.reduce_scatter_async(lent, inp, dtype, op, tag, q),
        };
        let work = work.map_err(to_py)?;
        Ok(NativeWork::new(&self.inner, work, Some(out)))
    }

    /// Starts `broadcast_bytes` and returns at once.
    #[pyo3(signature = (buf, dtype, root, tag, algorithm=None, cutoff=None))]
    fn broadcast_bytes_async(
        &self,
        buf: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        root: usize,
        tag: u64,
        algorithm: Option<&str>,
        cutoff: Option<(f64, u32)>,
    ) -> PyResult<NativeWork> {
        let ((dtype, _, algorithm), cutoff) = (reduction(dtype, "sum", algorithm)?, cutoff_of(cutoff)?);
        let lent = lend(buf, "tensor")?;
        let work = match cutoff {
            Some(c) => self.inner.broadcast_async_with_deadline(lent, dtype, root, tag, algorithm, c),
            None => self.inner.broadcast_async(lent, dtype, root, tag, algorithm),
        };
        let work = work.map_err(to_py)?;
        Ok(NativeWork::new(&self.inner, work, Some(buf)))
    }

    /// Sends `buf` (a view of a tensor of `dtype`) to rank `peer`, matched there by tag.
    fn send_bytes(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        peer: usize,
        tag: u64,
    ) -> PyResult<ReduceInfo> {
        let dtype = element_type(dtype)?;
        let view = readable(buf, "tensor")?;
        let bytes = view.as_slice().map_err(|_| not_contiguous("tensor"))?;
        Ok(py.detach(|| self.inner.send(bytes, dtype, peer, tag)).map_err(to_py)?.into())
    }

    /// Receives into `buf` what rank `peer` sends with `tag`.
    fn recv_bytes(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        peer: Option<usize>,
        tag: u64,
    ) -> PyResult<ReduceInfo> {
        let dtype = element_type(dtype)?;
        let mut view = writable(buf, "tensor")?;
        let bytes = contiguous_mut(&mut view, "tensor")?;
        let info = py.detach(|| match peer {
            Some(peer) => self.inner.recv(bytes, dtype, peer, tag),
            None => self.inner.recv_any(bytes, dtype, tag),
        });
        Ok(info.map_err(to_py)?.into())
    }

    /// Starts `send_bytes` and returns at once; the work keeps `buf` alive until it ended.
    fn isend_bytes(&self, buf: &Bound<'_, PyArray1<u8>>, dtype: &str, peer: usize, tag: u64) -> PyResult<NativeWork> {
        let dtype = element_type(dtype)?;
        let work = self.inner.isend(lend_shared(buf, "tensor")?, dtype, peer, tag).map_err(to_py)?;
        Ok(NativeWork::new(&self.inner, work, Some(buf)))
    }

    /// Starts `recv_bytes` and returns at once; the work keeps `buf` alive until it ended.
    fn irecv_bytes(
        &self,
        buf: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        peer: Option<usize>,
        tag: u64,
    ) -> PyResult<NativeWork> {
        let (dtype, lent) = (element_type(dtype)?, lend(buf, "tensor")?);
        let work = match peer {
            Some(peer) => self.inner.irecv(lent, dtype, peer, tag),
            None => self.inner.irecv_any(lent, dtype, tag),
        };
        let work = work.map_err(to_py)?;
        Ok(NativeWork::new(&self.inner, work, Some(buf)))
    }

    /// Starts `barrier` and returns at once.
    fn barrier_async(&self, tag: u64) -> PyResult<NativeWork> {
        let work = self.inner.barrier_async(tag).map_err(to_py)?;
        Ok(NativeWork::new(&self.inner, work, None))
    }

    /// All-reduces every `(buf, dtype)` of `bufs` like `all_reduce_bytes`, `max_in_flight` at a
    /// time, retrying after a peer loss (`Communicator::all_reduce_many`).
    #[pyo3(signature = (bufs, op, max_in_flight, tag, quant=None))]
    fn all_reduce_many_bytes(
        &self,
        py: Python<'_>,
        bufs: Vec<(Bound<'_, PyArray1<u8>>, String)>,
        op: &str,
        max_in_flight: usize,
        tag: u64,
        quant: QuantArg,
    ) -> PyResult<Vec<ReduceInfo>> {
        let q = quantization(quant)?;
        let mut views = Vec::with_capacity(bufs.len());
        let mut dtypes = Vec::with_capacity(bufs.len());
        for (i, (buf, dtype)) in bufs.iter().enumerate() {
            dtypes.push(element_type(dtype)?);
            views.push(
                buf.try_readwrite()
                    .map_err(|e| PyValueError::new_err(format!("tensor {i} is not writable (or given twice): {e}")))?,
            );
        }
        let op = reduce_op(op)?;
        let mut lent: Vec<(&mut [u8], DType)> = Vec::with_capacity(views.len());
        for (i, (view, dtype)) in views.iter_mut().zip(dtypes).enumerate() {
            let bytes =
                view.as_slice_mut().map_err(|_| PyValueError::new_err(format!("tensor {i} is not contiguous")))?;
            lent.push((bytes, dtype));
        }
        let infos = py.detach(|| self.inner.all_reduce_many(&mut lent, op, max_in_flight, tag, q)).map_err(to_py)?;
        Ok(infos.into_iter().map(ReduceInfo::from).collect())
    }

    /// Syncs a shared state. `tensors` are (name, writable uint8 view, dtype, shape, may_differ);
    /// returns (revision, [(name, [donor ids], bytes)], [peer ids sent to], bytes sent, seconds).
    #[allow(clippy::type_complexity)]
    fn sync_shared_state(
        &self,
        py: Python<'_>,
        tensors: StateEntries<'_>,
        revision: u64,
        strategy: &str,
        override_resume: bool,
    ) -> PyResult<(u64, Vec<(String, Vec<u32>, u64)>, Vec<u32>, u64, f64)> {
        let strategy = match strategy {
            "enforce_popular" => Strategy::EnforcePopular,
            "send_only" => Strategy::SendOnly,
            "receive_only" => Strategy::ReceiveOnly,
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown strategy {other:?}: expected enforce_popular, send_only or receive_only"
                )))
            }
        };
        let (mut views, meta) = state_views(&tensors)?;
        let mut state = state_tensors(&mut views, meta)?;
        let info = py
            .detach(|| self.inner.sync_shared_state(&mut state, revision, strategy, override_resume))
            .map_err(to_py)?;
        let received =
            info.received.into_iter().map(|(n, d, b)| (n, d.into_iter().map(|p| p.0).collect(), b)).collect();
        let sent_to = info.sent_to.into_iter().map(|p| p.0).collect();
        Ok((info.revision, received, sent_to, info.sent_bytes, info.elapsed.as_secs_f64()))
    }

    /// Connects, catching up with the group's shared state first (`tensors` as for
    /// `sync_shared_state`), calling `progress(done, total, elapsed_s, eta_s or None)` as the
    /// fetch goes; returns (revision or None, bytes, [donor ids], why nothing was fetched or None,
    /// seconds).
    #[allow(clippy::type_complexity)]
    fn connect_catching_up(
        &self,
        py: Python<'_>,
        timeout: Option<Bound<'_, PyAny>>,
        min_world_size: usize,
        tensors: StateEntries<'_>,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<(Option<u64>, u64, Vec<u32>, Option<String>, f64)> {
        let timeout = timeout.map(|s| seconds("timeout", &s)).transpose()?;
        let (mut views, meta) = state_views(&tensors)?;
        let mut state = state_tensors(&mut views, meta)?;
        // A callback that raises stops nothing: the catch-up goes on, and the error is shown.
        let mut report = |p: &shoal_peer::CatchUpProgress| {
            if let Some(cb) = &progress {
                Python::attach(|py| {
                    let eta = p.eta.map(|e| e.as_secs_f64());
                    if let Err(e) = cb.call1(py, (p.done, p.total, p.elapsed.as_secs_f64(), eta)) {
                        e.print(py);
                    }
                });
            }
        };
        let info = py
            .detach(|| self.inner.connect_catching_up(timeout, min_world_size, &mut state, &mut report))
            .map_err(to_py)?;
        let donors = info.donors.into_iter().map(|p| p.0).collect();
        Ok((info.revision, info.bytes, donors, info.skipped, info.elapsed.as_secs_f64()))
    }

    /// This communicator's counters as JSON (`shoal_master::report_json`).
    fn stats_json(&self) -> String {
        shoal_master::report_json(&self.inner.stats()).to_string()
    }

    /// Our links in the topology in force: (peer id, rank, streams out, streams in, bytes sent,
    /// bytes received, seconds saturated, bytes sent saturated, transport, path, whether the
    /// member can be dialed) for every member we exchanged data with.
    #[allow(clippy::type_complexity)]
    fn links(&self) -> Vec<(u32, usize, usize, usize, u64, u64, f64, u64, &'static str, &'static str, bool)> {
        let links = self.inner.links().into_iter();
        links
            .map(|l| {
                let saturated = l.saturated.as_secs_f64();
                (
                    l.peer.0,
                    l.rank,
                    l.streams_out,
                    l.streams_in,
                    l.tx_bytes,
                    l.rx_bytes,
                    saturated,
                    l.saturated_bytes,
                    l.transport,
                    l.path,
                    l.dialable,
                )
            })
            .collect()
    }

    /// The derived group of the members that gave `color` (None: in none), ranked by `key`.
    #[pyo3(signature = (color, key=0))]
    fn split(&self, py: Python<'_>, color: Option<u32>, key: i64) -> PyResult<Option<Communicator>> {
        let derived = py.detach(|| self.inner.split(color, key)).map_err(to_py)?;
        Ok(derived.map(|c| Communicator { inner: Arc::new(c) }))
    }

    /// The derived group of the members at `ranks`, if we are one of them.
    fn new_group(&self, py: Python<'_>, ranks: Vec<usize>) -> PyResult<Option<Communicator>> {
        let derived = py.detach(|| self.inner.new_group(&ranks)).map_err(to_py)?;
        Ok(derived.map(|c| Communicator { inner: Arc::new(c) }))
    }

    /// The derived group of the members at `ranks` named `name`, formed by those members alone.
    fn subgroup(&self, py: Python<'_>, ranks: Vec<usize>, name: Vec<u8>) -> PyResult<Option<Communicator>> {
        let derived = py.detach(|| self.inner.subgroup(&ranks, &name)).map_err(to_py)?;
        Ok(derived.map(|c| Communicator { inner: Arc::new(c) }))
    }

    /// The derived group of the members with ids `peers` named `name`, formed by those alone.
    fn subgroup_of_peers(&self, py: Python<'_>, peers: Vec<u32>, name: Vec<u8>) -> PyResult<Option<Communicator>> {
        let peers: Vec<shoal_peer::PeerId> = peers.into_iter().map(shoal_peer::PeerId).collect();
        let derived = py.detach(|| self.inner.subgroup_of(&peers, &name)).map_err(to_py)?;
        Ok(derived.map(|c| Communicator { inner: Arc::new(c) }))
    }

    #[getter]
    fn world_size(&self) -> Option<usize> {
        self.inner.world_size()
    }

    #[getter]
    fn group_world_size(&self) -> Option<usize> {
        self.inner.group_world_size()
    }

    #[getter]
    fn rank(&self) -> Option<usize> {
        self.inner.rank()
    }

    #[getter]
    fn peer_id(&self) -> Option<u32> {
        self.inner.peer_id().map(|p| p.0)
    }

    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close())
    }

    /// This group's blocking all-reduce for the torch backend's compiled part, which calls it
    /// without Python in between: a capsule named `shoal._native.TorchApi` holding a
    /// [`TorchApi`] (the capsule keeps the group alive).
    fn torch_api<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyCapsule>> {
        let api = TorchApi { version: TorchApi::VERSION, group: Arc::into_raw(Arc::clone(&self.inner)), all_reduce };
        pyo3::types::PyCapsule::new_with_value_and_destructor(py, api, TorchApi::NAME, |api, _| {
            // SAFETY: `group` came from `Arc::into_raw` above and is released once, here.
            #[allow(unsafe_code)]
            drop(unsafe { Arc::from_raw(api.group) });
        })
    }
}

/// What `torch_api` hands to `python/shoal/_torch_backend.cpp` (its `Api` mirrors this layout).
#[repr(C)]
struct TorchApi {
    /// The layout's version, checked by the compiled part.
    version: u32,
    group: *const Core,
    /// `all_reduce(group, data, bytes, dtype, op, tag)`: 0 once `data` holds the result; -1 with
    /// the Python error set (the GIL is taken for it) otherwise, `data` as it was.
    all_reduce: extern "C" fn(*const Core, *mut u8, usize, *const c_char, *const c_char, u64) -> i32,
}

impl TorchApi {
    const VERSION: u32 = 1;
    const NAME: &'static std::ffi::CStr = c"shoal._native.TorchApi";
}

// SAFETY: `group` is an `Arc<Core>`'s (Core is Send + Sync); the capsule owns that reference.
#[allow(unsafe_code)]
unsafe impl Send for TorchApi {}

/// [`TorchApi::all_reduce`]: a blocking all-reduce of `bytes` bytes at `data` (a CPU tensor's,
/// which the caller keeps alive and does not touch meanwhile), with the GIL not held.
#[allow(unsafe_code)]
extern "C" fn all_reduce(
    group: *const Core,
    data: *mut u8,
    bytes: usize,
    dtype: *const c_char,
    op: *const c_char,
    tag: u64,
) -> i32 {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> PyResult<()> {
        // SAFETY: the capsule that holds `group` outlives the call; `dtype` and `op` are the
        // compiled part's static names; `data` is `bytes` long and lent for the call (above).
        let (group, dtype, op) = unsafe { (&*group, std::ffi::CStr::from_ptr(dtype), std::ffi::CStr::from_ptr(op)) };
        let buf: &mut [u8] = if bytes == 0 { &mut [] } else { unsafe { std::slice::from_raw_parts_mut(data, bytes) } };
        let (dtype, op, _) = reduction(dtype.to_str().unwrap_or("?"), op.to_str().unwrap_or("?"), None)?;
        group.all_reduce(buf, dtype, op, tag, None, None).map(drop).map_err(to_py)
    }));
    let error = match outcome {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => e,
        Err(_) => PyRuntimeError::new_err("shoal's all-reduce panicked (a bug: please report it)"),
    };
    Python::attach(|py| error.restore(py));
    -1
}

/// The master (native part; `shoal.Master` is this class).
#[pyclass(frozen, module = "shoal._native")]
struct Master {
    options: MasterOptions,
    server: Mutex<Option<MasterServer>>,
}

#[pymethods]
impl Master {
    #[new]
    #[pyo3(signature = (listen="0.0.0.0:48148", *, secret=None, heartbeat_timeout=None, http_addr=None, state_dir=None,
        tls_cert=None, tls_key=None, tls_ca=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        listen: &str,
        secret: Option<String>,
        heartbeat_timeout: Option<Bound<'_, PyAny>>,
        http_addr: Option<String>,
        state_dir: Option<PathBuf>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        tls_ca: Option<PathBuf>,
    ) -> PyResult<Self> {
        let mut options = MasterOptions::from_env(listen).map_err(|e| PyValueError::new_err(e.to_string()))?;
        options.tls = tls_files([tls_cert, tls_key, tls_ca], options.tls)?;
        if http_addr.is_some() {
            options.http = http_addr;
        }
        options.state_dir = state_dir;
        if let Some(s) = heartbeat_timeout {
            options.heartbeat_timeout = Some(seconds("heartbeat_timeout", &s)?);
        }
        if let Some(s) = secret {
            if s.is_empty() {
                return Err(PyValueError::new_err("secret must not be empty"));
            }
            options.secret = Some(s.into_bytes());
        }
        Ok(Master { options, server: Mutex::new(None) })
    }

    /// Binds the listen address and starts serving in background threads.
    fn start(&self) -> PyResult<()> {
        let mut server = self.server.lock().unwrap_or_else(PoisonError::into_inner);
        if server.is_some() {
            return Err(usage_error("the master is already running"));
        }
        let started = MasterServer::start(self.options.clone()).map_err(|e| {
            pyo3::exceptions::PyOSError::new_err(format!("cannot start the master on {}: {e}", self.options.listen))
        })?;
        *server = Some(started);
        Ok(())
    }

    /// Stops serving and closes every connection. Idempotent.
    fn stop(&self, py: Python<'_>) {
        let server = self.server.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(mut s) = server {
            py.detach(|| s.stop());
        }
    }

    /// `host:port` the master listens on (the real port when started with port 0).
    #[getter]
    fn address(&self) -> String {
        match &*self.server.lock().unwrap_or_else(PoisonError::into_inner) {
            Some(s) => s.local_addr().to_string(),
            None => self.options.listen.clone(),
        }
    }

    #[getter]
    fn running(&self) -> bool {
        self.server.lock().unwrap_or_else(PoisonError::into_inner).is_some()
    }

    /// `host:port` of `/metrics`, `/status` and the status page, once started with `http_addr`.
    #[getter]
    fn http_address(&self) -> Option<String> {
        let server = self.server.lock().unwrap_or_else(PoisonError::into_inner);
        server.as_ref().and_then(MasterServer::http_addr).map(|a| a.to_string())
    }

    /// The run as `/status` serves it, parsed; `None` unless running.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let json = {
            let server = self.server.lock().unwrap_or_else(PoisonError::into_inner);
            match server.as_ref() {
                Some(server) => py.detach(|| server.status_json()),
                None => None,
            }
        };
        json.map(|j| py.import("json")?.call_method1("loads", (j,))).transpose()
    }

    fn __enter__(slf: Bound<'_, Self>) -> PyResult<Bound<'_, Self>> {
        if !slf.get().running() {
            slf.get().start()?;
        }
        Ok(slf)
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<Bound<'_, PyAny>>,
        _exc: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) {
        self.stop(py)
    }

    fn __repr__(&self) -> String {
        format!("Master(address={:?}, running={})", self.address(), self.running())
    }
}

/// A duration argument: a positive int or float of seconds. `True` is an int to Python, but never
/// a duration anyone meant: refused.
fn seconds(name: &str, value: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let not_a_number = || PyTypeError::new_err(format!("{name} must be a number of seconds, got {value}"));
    if value.is_instance_of::<PyBool>() {
        return Err(not_a_number());
    }
    let s: f64 = value.extract().map_err(|_| not_a_number())?;
    if s.is_finite() && s > 0.0 && s < 1e9 {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(PyValueError::new_err(format!("{name} must be a positive number of seconds, got {s}")))
    }
}

/// Raises the `shoal.errors` class that matches `e`.
fn to_py(e: Error) -> PyErr {
    if let Error::Misuse(misuse) = &e {
        // The calls, typed, beside the message: `UsageError.calls`.
        let calls: Vec<(Vec<u32>, &'static str)> = misuse
            .calls()
            .into_iter()
            .map(|c| {
                let name = match c.call {
                    shoal_peer::Call::Api { api, .. } => api.name(),
                    shoal_peer::Call::Transfer { send: true, .. } => "send",
                    shoal_peer::Call::Transfer { send: false, .. } => "recv",
                };
                (c.peers.iter().map(|p| p.0).collect(), name)
            })
            .collect();
        let error = raise("UsageError", e.to_string());
        // Only a broken package refuses the attribute: the class's empty default stands then.
        Python::attach(|py| error.value(py).setattr("calls", calls).is_ok());
        return error;
    }
    let class = match &e {
        Error::NotConnected | Error::AlreadyConnected | Error::Closed | Error::Misuse(_) | Error::Usage(_) => {
            "UsageError"
        }
        Error::InvalidArgument(_) => return PyValueError::new_err(e.to_string()),
        Error::MasterUnreachable { .. } => "MasterUnreachableError",
        Error::Kicked { .. } => "KickedError",
        Error::Authentication { .. } => "AuthenticationError",
        Error::PeerLost { .. } => "PeerLostError",
        Error::MasterInterrupted { .. } => "MasterInterruptedError",
        Error::Timeout { .. } => "ShoalTimeoutError",
        Error::Excluded { topology, sequence, included, ahead, peers_pending, .. } => {
            let error = raise("ExcludedError", e.to_string());
            // As for UsageError.calls: only a broken package refuses the attributes.
            Python::attach(|py| {
                let value = error.value(py);
                value.setattr("included", included.clone()).is_ok()
                    && value.setattr("topology", *topology).is_ok()
                    && value.setattr("sequence", *sequence).is_ok()
                    && value.setattr("ahead", *ahead).is_ok()
                    && value.setattr("peers_pending", *peers_pending).is_ok()
            });
            return error;
        }
        Error::TooFewPeers { .. } => "TooFewPeersError",
        Error::SyncFailed { retryable: true, .. } => "PeerLostError",
        Error::SyncFailed { retryable: false, .. } => "UsageError",
        Error::CollectiveMismatch { .. } => "CollectiveMismatchError",
        Error::Protocol(_) => "ProtocolError",
        Error::Config(_) => return PyValueError::new_err(e.to_string()),
        _ => "ShoalError",
    };
    raise(class, e.to_string())
}

/// A shared state as `shoal.SharedState` hands it over: (name, writable uint8 view, dtype, shape,
/// may differ) per tensor.
type StateEntries<'py> = Vec<(String, Bound<'py, PyArray1<u8>>, String, Vec<u64>, bool)>;

/// Writable views of a shared state's tensors, and what else describes each.
#[allow(clippy::type_complexity)]
fn state_views<'py>(
    tensors: &StateEntries<'py>,
) -> PyResult<(Vec<PyReadwriteArray1<'py, u8>>, Vec<(String, DType, Vec<u64>, bool)>)> {
    let mut views = Vec::with_capacity(tensors.len());
    let mut meta = Vec::with_capacity(tensors.len());
    for (name, buf, dtype, shape, may_differ) in tensors {
        let dtype =
            DType::from_name(dtype).ok_or_else(|| PyTypeError::new_err(format!("unsupported dtype {dtype:?}")))?;
        views.push(
            buf.try_readwrite().map_err(|e| PyValueError::new_err(format!("tensor {name:?} is not writable: {e}")))?,
        );
        meta.push((name.clone(), dtype, shape.clone(), *may_differ));
    }
    Ok((views, meta))
}

/// The state's tensors over `views`.
fn state_tensors<'a>(
    views: &'a mut [PyReadwriteArray1<'_, u8>],
    meta: Vec<(String, DType, Vec<u64>, bool)>,
) -> PyResult<Vec<StateTensor<'a>>> {
    let mut state = Vec::with_capacity(views.len());
    for (view, (name, dtype, shape, may_differ)) in views.iter_mut().zip(meta) {
        let bytes =
            view.as_slice_mut().map_err(|_| PyValueError::new_err(format!("tensor {name:?} is not contiguous")))?;
        state.push(StateTensor { name, dtype, shape, bytes, may_differ });
    }
    Ok(state)
}

fn usage_error(message: &str) -> PyErr {
    raise("UsageError", message.to_string())
}

fn raise(class: &str, message: String) -> PyErr {
    Python::attach(|py| {
        let error = py.import("shoal.errors").and_then(|m| m.getattr(class)?.call1((message.clone(),)));
        match error {
            Ok(e) => PyErr::from_value(e),
            // Only if the package is broken: keep the message.
            Err(_) => PyRuntimeError::new_err(format!("{class}: {message}")),
        }
    })
}

/// The TLS files: those given (`[cert, key, ca]`) over those of the environment (`env`); all
/// three, or none.
fn tls_files(given: [Option<PathBuf>; 3], env: Option<TlsFiles>) -> PyResult<Option<TlsFiles>> {
    let [cert, key, ca] = given;
    if cert.is_none() && key.is_none() && ca.is_none() {
        return Ok(env);
    }
    let (env_cert, env_key, env_ca) = env.map_or((None, None, None), |f| (Some(f.cert), Some(f.key), Some(f.ca)));
    TlsFiles::from_parts(cert.or(env_cert), key.or(env_key), ca.or(env_ca))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A host's certificate, as `make_certs` made it: (host, certificate file, key file).
type HostCert = (String, PathBuf, PathBuf);

/// Makes a run's TLS certificates in `out_dir` (see `shoal certs`): returns the CA's path, whether
/// it was made now, and each host's (host, certificate, key).
#[pyfunction]
fn make_certs(out_dir: PathBuf, hosts: Vec<String>) -> PyResult<(PathBuf, bool, Vec<HostCert>)> {
    let made = shoal_transport::tls::make_certs(&out_dir, &hosts).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok((made.ca, made.new_ca, made.hosts))
}

/// BLAKE3 content hash of a tensor given as its bytes, dtype name and shape; 64 hex digits.
#[pyfunction]
fn hash_tensor_bytes(py: Python<'_>, buf: PyReadonlyArray1<'_, u8>, dtype: &str, shape: Vec<u64>) -> PyResult<String> {
    let dtype = DType::from_name(dtype).ok_or_else(|| PyTypeError::new_err(format!("unsupported dtype {dtype:?}")))?;
    let bytes = buf.as_slice().map_err(|_| PyValueError::new_err("tensor is not contiguous"))?;
    let hash = py.detach(|| shoal_state::hash_tensor(dtype, &shape, bytes));
    hash.map(|h| h.to_string()).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Replaces `buf` (a writable view of a tensor of `dtype`) by what it decodes to once encoded
/// with quantization `quant` (blocks counted from its first element), as a collective's peers
/// would hold it; returns the encoded size in bytes. For `shoal.ErrorFeedback`.
#[pyfunction]
fn quantize_bytes(
    py: Python<'_>,
    buf: &Bound<'_, PyArray1<u8>>,
    dtype: &str,
    quant: (String, Option<usize>),
) -> PyResult<usize> {
    let dtype = element_type(dtype)?;
    let q = quantization(Some(quant))?.expect("given");
    let codec = q.codec(dtype, None).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let mut view = writable(buf, "tensor")?;
    let bytes = contiguous_mut(&mut view, "tensor")?;
    let Some(codec) = codec else { return Ok(bytes.len()) };
    let mut encoded = vec![0u8; codec.encoded_len(bytes.len() / dtype.size())];
    py.detach(|| codec.round_trip(bytes, &mut encoded)).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(encoded.len())
}

/// The WAN lab's delay program: holds the packets of each netfilter queue `(namespace, number,
/// delay in seconds)` for its delay, for `ttl` seconds; returns (packets held, most held at
/// once). A namespace is a name under `/run/netns`, or `None` for this process's own. Linux only.
#[pyfunction]
fn lab_delay(
    py: Python<'_>,
    queues: Vec<(Option<String>, u16, f64)>,
    ttl: f64,
    max_len: u32,
) -> PyResult<(u64, usize)> {
    let seconds = |s: f64, what: &str| {
        Duration::try_from_secs_f64(s)
            .map_err(|_| PyValueError::new_err(format!("{what} must be a non-negative number of seconds, not {s}")))
    };
    let queues = queues
        .into_iter()
        .map(|(namespace, queue, delay)| {
            Ok(shoal_lab::QueueDelay { namespace, queue, delay: seconds(delay, "a delay")? })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let ttl = seconds(ttl, "ttl")?;
    #[cfg(target_os = "linux")]
    {
        let stats =
            py.detach(|| shoal_lab::run(&queues, ttl, max_len)).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok((stats.packets, stats.max_held))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (py, queues, ttl, max_len);
        Err(PyRuntimeError::new_err("the lab's delay program needs Linux netfilter queues"))
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Communicator>()?;
    m.add_class::<Master>()?;
    m.add_class::<ReduceInfo>()?;
    m.add_class::<NativeWork>()?;
    m.add_class::<NativeVote>()?;
    m.add_function(wrap_pyfunction!(hash_tensor_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(lab_delay, m)?)?;
    m.add_function(wrap_pyfunction!(make_certs, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DTYPES", DType::ALL.map(DType::name).to_vec())?;
    m.add("OPS", ReduceOp::ALL.map(ReduceOp::name).to_vec())?;
    Ok(())
}
