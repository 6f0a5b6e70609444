"""shoal as a ``torch.distributed`` backend: ``import shoal.torch``, then
``dist.init_process_group("shoal")`` (``docs/training.md``, section 7).

The backend is a c10d ``Backend`` written in Python over shoal's communicator, so everything
that reaches a process group through c10d's dispatcher reaches it: ``dist.*`` calls, DDP's
reducer, functional collectives, ``DeviceMesh``. Its world is a subgroup of the run's members
that torch's store names, ranked by torch's ranks (``Communicator.subgroup_of_peers``);
``dist.new_group`` forms its subgroups from their members alone (``Communicator.subgroup``).

Its base class is compiled where it can be (``_torch_backend.cpp``, built once per machine with
``torch.utils.cpp_extension``): that part runs the blocking all-reduce of one tensor, c10d's
hottest call, without Python; every other call reaches the Python methods below.
``SHOAL_TORCH_COMPILED=0``, or a machine without a C++ compiler, keeps the backend in Python
alone: the same results, slower on small tensors.

An operation torch waits for at once runs shoal's blocking call; the others start shoal's
asynchronous call and return a :class:`Work` whose ``wait`` waits for it. Results that torch
wants somewhere other than where shoal put them (a list of tensors, a non-contiguous tensor, the
root of a ``reduce``) are copied there once the call ended. An error is raised as the same
shoal error, which is also a ``torch.distributed.DistBackendError``: ``PeerLostError`` stays
retryable.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import ipaddress
import itertools
import os
import queue
import secrets
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _Backend

from . import errors
from ._communicator import Communicator
from ._communicator import Work as _ShoalWork
from ._native import Master

__all__ = ["Options", "ShoalBackend", "NAME"]

NAME = "shoal"

_OPS: "dict[Any, str]" = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
}

# Tags. Collectives are numbered per group from 0; collectives built on tagged transfers
# (gather, scatter, all-to-all) take theirs above _COMPOSED; torch's send/recv above _P2P, with
# the user's tag (shoal, as torch, matches several transfers with one tag in the order each side
# made them). Tags from 2**63 up are shoal's own.
_COMPOSED = 1 << 61
_P2P = 1 << 62
_USER_TAGS = _P2P
# The barrier of the world's members leaving (above every collective's numbered tag).
_LEAVING = _COMPOSED - 1


def _torch_error_classes() -> "dict[type, type]":
    """For each shoal error, a subclass of it and of ``DistBackendError``, named alike."""
    classes: "dict[type, type]" = {}
    for name in errors.__all__:
        shoal_class = getattr(errors, name)
        classes[shoal_class] = type(name, (shoal_class, dist.DistBackendError), {
            "__module__": "shoal.torch",
            "__doc__": f"{shoal_class.__doc__}\n\nRaised by the ``shoal`` torch backend: also a "
                       "``torch.distributed.DistBackendError``.",
        })
    return classes


ERRORS = _torch_error_classes()


def _as_torch_error(e: BaseException) -> BaseException:
    """``e`` as the torch backend raises it (the same error, also a ``DistBackendError``)."""
    cls = ERRORS.get(type(e))
    if cls is None:
        return e
    out = cls(*e.args)
    out.__dict__.update(e.__dict__)
    out.__cause__ = e.__cause__
    return out


@dataclass
class Options:
    """The ``shoal`` backend's options: ``init_process_group("shoal", pg_options=Options(...))``.

    ``master`` is the address of a running ``shoal master`` (default ``SHOAL_MASTER``; without
    either, rank 0 starts one in its process and tells the others through torch's store).
    ``min_world_size`` (default ``SHOAL_MIN_WORLD_SIZE``, else torch's world size) is how many
    members the run must have before ``init_process_group`` returns: several ``torchrun``s
    that start one run together (one per replica, as a run that survives churn is launched)
    each give the run's size. ``communicator`` holds keyword arguments of
    :class:`shoal.Communicator` (``connections``, ``secret``, TLS, timeouts...); unset ones
    come from the ``SHOAL_*`` settings as usual.
    """

    master: Optional[str] = None
    min_world_size: Optional[int] = None
    communicator: "Optional[dict[str, Any]]" = None


class _Run:
    """This process's membership behind the default group: the master it may host, the run's
    communicator (:func:`run_communicator`), and torch's world, a group of the run's members
    that torch's store names, ranked by torch's ranks. Forming it takes no call of the run's
    other members: a ``torchrun`` started later joins the run as newcomers do, admitted by the
    members' next ``update_topology()``."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, options: Options) -> None:
        self.master: Optional[Master] = None
        self.closed = False
        self.backends: "list[ShoalBackend]" = []
        address = options.master or os.environ.get("SHOAL_MASTER")
        if address is None:
            if rank == 0:
                host = _store_host(store)
                self.master = Master(f"{_bind_host(host)}:0")
                self.master.start()
                address = f"{host}:{self.master.address.rsplit(':', 1)[1]}"
                store.set("shoal/master", address)
            else:
                address = store.get("shoal/master").decode()
        min_world = options.min_world_size or _env_count("SHOAL_MIN_WORLD_SIZE") or size
        self.comm = Communicator(address, **(options.communicator or {}))
        try:
            self.comm.connect(timeout.total_seconds(), min_world_size=max(min_world, size))
            if rank == 0:
                store.set("shoal/world", secrets.token_hex(8))
            store.set(f"shoal/peer/{rank}", str(self.comm.peer_id))
            name = store.get("shoal/world")
            peers = [int(store.get(f"shoal/peer/{r}")) for r in range(size)]
            world = self.comm.subgroup_of_peers(peers, b"torch world " + name)
        except BaseException:
            self.close()
            raise
        assert world is not None and world.rank == rank, "the world is ranked by torch's ranks"
        self.world = world
        atexit.register(self.close)

    def keep(self, backend: "ShoalBackend") -> "ShoalBackend":
        """Keeps ``backend``'s Python object while the run lasts: torch holds the C++ object of
        a compiled one, whose Python methods must outlive the Python references."""
        self.backends.append(backend)
        return backend

    def close(self) -> None:
        """Leaves the run, then stops the master this process hosts once the other members left
        too (at most ``MASTER_LINGER`` seconds: the ranks of one torch program end about
        together, and a master gone under a member still running fails its calls). Idempotent."""
        atexit.unregister(self.close)
        if self.closed:
            return
        self.closed = True
        # Leaving re-forms the run, failing what the others still run in it (retryably): wait
        # for torch's world to end too, as far as LEAVE_WAIT allows (a member lost meanwhile
        # ends the wait).
        world = getattr(self, "world", None)  # none where joining failed
        parting = None
        try:
            if world is not None:
                parting = world.barrier_async(tag=_LEAVING)
                parting.wait(LEAVE_WAIT)
        except errors.ShoalError:
            pass
        self.comm.close()
        del parting  # still in flight past the wait: dropped once closed, which ends it
        if self.master is not None:
            until = time.monotonic() + MASTER_LINGER
            while time.monotonic() < until and (self.master.status() or {}).get("peers"):
                time.sleep(0.05)
            self.master.stop()


def _env_count(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r}: expected a positive count of members")
    return int(value)


def _store_host(store: Any) -> str:
    """The host other ranks reach this one at: the TCP store's, else ``MASTER_ADDR``, else
    loopback (a file or hash store: one host)."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host = getattr(store, "host", None) or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    return "127.0.0.1" if host == "localhost" else host


def _bind_host(host: str) -> str:
    """Where the master listens: loopback for a run on one host, every interface otherwise."""
    try:
        return "127.0.0.1" if ipaddress.ip_address(host).is_loopback else "0.0.0.0"
    except ValueError:
        return "0.0.0.0"


# Most seconds rank 0's process keeps the master it hosts for the members still in the run.
MASTER_LINGER = 10.0
# Most seconds a process leaving waits for the other members of torch's world to leave too.
LEAVE_WAIT = 10.0

_run: Optional[_Run] = None
_run_lock = threading.Lock()


def _create(opts: Any, options: Optional[Options]) -> "ShoalBackend":
    """c10d's constructor of the backend (``register_backend(..., extended_api=True)``)."""
    global _run
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"pg_options of the shoal backend must be shoal.torch.Options, got {type(options).__name__}")
    ranks = list(opts.global_ranks_in_group)
    with _run_lock:
        if not ranks:  # the default group
            if _run is not None and not _run.closed:
                _run.close()
            _run = _Run(opts.store, opts.group_rank, opts.group_size, opts.timeout, options or Options())
            return _run.keep(ShoalBackend(_run.world, opts.group_rank, opts.group_size, run=_run))
        if _run is None or _run.closed:
            raise errors.UsageError("a shoal subgroup needs the default group on shoal: init_process_group('shoal')")
        run, group = _run, _run.world.subgroup(ranks, str(opts.group_id))
    if group is None or group.rank != opts.group_rank:
        raise errors.UsageError(f"subgroup {ranks}: this process is not its rank {opts.group_rank}")
    return run.keep(ShoalBackend(group, opts.group_rank, opts.group_size))


def run_communicator() -> Communicator:
    """The run's communicator behind the default ``shoal`` process group: the whole group, with
    its admission, votes and shared-state syncs (what :class:`shoal.torch.Elastic` uses)."""
    if _run is None or _run.closed:
        raise errors.UsageError("no shoal process group: call init_process_group('shoal') first")
    return _run.comm


def register() -> None:
    """Registers the backend under the name ``shoal`` (``import shoal.torch`` does)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
    _patch_work()


# Completes the futures of operations that torch asks for one (DDP does, for every bucket): each
# waits on a thread of a pool that grows to this many threads (a receive that waits long holds
# one; the calls move meanwhile, whoever waits).
COMPLETERS = 64


class _Completers:
    """Threads that wait for operations and complete their futures, started as needed."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Work]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def submit(self, work: "Work") -> None:
        with self._lock:
            grow = self._idle == 0 and self._threads < COMPLETERS
            if grow:
                self._threads += 1
            elif self._idle:
                self._idle -= 1
        self._queue.put(work)
        if grow:
            threading.Thread(target=self._serve, name="shoal-c10d", daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._queue.get()._settle()
            with self._lock:
                self._idle += 1


_completers = _Completers()


class Work(dist._Work):  # type: ignore[misc]
    """One torch operation in flight: the shoal calls it started, and what runs once they all
    ended (copying results where torch wants them). ``wait`` waits for them in the caller's
    thread; ``get_future`` has a completer thread wait (DDP asks for the future of every bucket).

    torch hands a Python backend's works to users through a holder that forwards ``wait`` and
    ``get_future`` only; ``shoal.torch`` teaches torch's ``Work.is_completed`` and ``exception``
    to ask the future (:func:`_patch_work`), so ``get_future`` never waits for the calls: only
    ``_end`` holds ``_ending`` across them."""

    def __init__(self, works: "list[_ShoalWork]", result: "list[torch.Tensor]",
                 finish: Optional[Callable[[], None]] = None, error: Optional[BaseException] = None) -> None:
        super().__init__()
        self._works, self._result, self._finish = works, result, finish
        self._ending = threading.Lock()
        self._futures = threading.Lock()
        self._ended = False
        self._infos: "list[Any]" = []
        self._error = error
        self._future: "Optional[torch.futures.Future[list[torch.Tensor]]]" = None

    def _end(self, timeout: Optional[float] = None) -> None:
        """Waits for every call (each restores its buffer on failure and frees its tag), then
        finishes and completes the future if one was asked for; raises the first error. Past
        ``timeout`` the calls go on: wait again."""
        with self._ending:
            if not self._ended:
                while self._works:
                    try:
                        self._infos.append(self._works[0].wait(timeout))
                    except errors.ShoalTimeoutError as e:
                        if timeout is not None:
                            raise _as_torch_error(e) from None
                        self._error = self._error or _as_torch_error(e)
                    except errors.ShoalError as e:
                        self._error = self._error or _as_torch_error(e)
                    self._works.pop(0)
                if self._error is None and self._finish is not None:
                    try:
                        self._finish()
                    except BaseException as e:  # noqa: BLE001 - the waiter's error
                        self._error = e
                self._ended = True
        self._settle_future()
        if self._error is not None:
            raise self._error

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        seconds = timeout.total_seconds() if timeout else 0.0
        self._end(seconds if seconds > 0 else None)
        return True

    def _source_rank(self) -> int:
        """A receive's: the rank whose send it took (torch asks after ``recv`` without ``src``)."""
        self._end()
        (info,) = self._infos
        return int(info.peer)

    def get_future(self) -> "torch.futures.Future[list[torch.Tensor]]":
        with self._futures:
            made = self._future is None
            if made:
                # Completed through a callback that raises the error: a Python future's own
                # set_exception is a value with an unwrapper that C++ (DDP's reducer, torch's
                # Work) never sees, so the error would read as a result there.
                self._source: "torch.futures.Future[Any]" = torch.futures.Future()
                self._future = self._source.then(_raise_error)
            future = self._future
        if made:
            if self._ended:
                self._settle_future()
            else:
                _completers.submit(self)
        return future

    def _settle(self) -> None:
        try:
            self._end()
        except BaseException:  # noqa: BLE001 - the future's error
            pass

    def _settle_future(self) -> None:
        """Completes the future of the ended work, if one was asked for and is not complete."""
        with self._futures:
            if self._future is not None and not self._source.done():
                self._source.set_result(self._error if self._error is not None else self._result)


def _raise_error(source: "torch.futures.Future[Any]") -> Any:
    """The result of an operation's future, or its error raised."""
    value = source.value()
    if isinstance(value, BaseException):
        raise value
    return value


def _patch_work() -> None:
    """torch's ``Work.is_completed`` and ``exception``, for the works of Python backends too:
    torch's holder of such a work forwards only ``wait`` and ``get_future``, so its own answers
    stay "not completed" and "no error". A work that says it is not completed is asked its
    future, which every backend's work completes when it ends; the error of an ended work is
    what its ``wait`` raises (its future's error is torch's ``RuntimeError`` naming it)."""
    cls = dist.Work
    if getattr(cls, "_shoal_patched", False):
        return
    is_completed, exception = cls.is_completed, cls.exception

    def future_of(work: Any) -> "Optional[torch.futures.Future[Any]]":
        try:
            return work.get_future()
        except RuntimeError:  # a backend without futures
            return None

    def patched_is_completed(self: Any) -> bool:
        if is_completed(self):
            return True
        future = future_of(self)
        return future is not None and future.done()

    def patched_exception(self: Any) -> Any:
        error = exception(self)
        if error is not None or not patched_is_completed(self):
            return error
        try:
            self.wait()  # ended: returns at once, or raises the work's own error (its type kept)
        except Exception as e:  # noqa: BLE001 - the answer
            return e
        return None

    cls.is_completed, cls.exception = patched_is_completed, patched_exception  # type: ignore[method-assign]
    cls._shoal_patched = True  # type: ignore[attr-defined]


def _op(opts: Any) -> str:
    op = _OPS.get(opts.reduceOp.op)
    if op is None:
        raise ValueError(f"the shoal backend reduces with SUM, AVG, PRODUCT, MIN and MAX, not {opts.reduceOp.op}")
    return op


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _copy_back(pairs: "Sequence[tuple[torch.Tensor, torch.Tensor]]") -> Optional[Callable[[], None]]:
    """Copies each work buffer into the tensor torch gave where they differ."""
    pairs = [(dst, src) for dst, src in pairs if dst is not src]
    if not pairs:
        return None

    def finish() -> None:
        for dst, src in pairs:
            dst.copy_(src)

    return finish


def _then(*steps: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
    todo = [s for s in steps if s is not None]
    if not todo:
        return None
    if len(todo) == 1:
        return todo[0]

    def finish() -> None:
        for step in todo:
            step()

    return finish


class _PythonBase(_Backend):  # type: ignore[misc]
    """The base class where the compiled one cannot be built: the same calls, in Python."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._seqs = itertools.count(1)

    def _attach(self, api: Any, as_torch_error: Callable[[BaseException], BaseException]) -> None:
        pass  # no compiled all-reduce to hand the group to

    def _next_seq(self) -> int:
        return next(self._seqs)  # atomic under the GIL


def _compiled_base() -> Optional[type]:
    """``FastBackend`` of ``_torch_backend.cpp``, built on first use into shoal's cache (one
    build per source, torch and Python version; the processes of one machine share it), or None
    where it cannot be (no compiler, ``SHOAL_TORCH_COMPILED=0``)."""
    if os.environ.get("SHOAL_TORCH_COMPILED", "1") == "0":
        return None
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torch_backend.cpp")
    try:
        from torch.utils import cpp_extension

        with open(source, "rb") as f:
            key = hashlib.blake2b(f.read(), digest_size=8)
        key.update(f"{torch.__version__} {sys.version}".encode())
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        build = os.path.join(cache, "shoal", f"torch-backend-{key.hexdigest()}")
        os.makedirs(build, exist_ok=True)
        # One process of the machine builds at a time, under a lock the kernel drops with its
        # holder: torch's own lock file, left behind by a builder killed, would block the next
        # one for ever, so whoever holds this lock removes it.
        with open(os.path.join(build, "shoal.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(build, "lock"))
            module = cpp_extension.load(name="shoal_torch_backend", sources=[source], build_directory=build,
                                        extra_cflags=["-O2"], verbose=False)
        _prune_builds(build)
        return module.FastBackend  # type: ignore[no-any-return]
    except Exception as e:  # noqa: BLE001 - any failure to build leaves the Python backend
        warnings.warn(f"shoal: the torch backend runs in Python alone (slower on small tensors): its compiled "
                      f"part did not build: {e}", RuntimeWarning, stacklevel=2)
        return None


# Builds of the compiled part kept in the cache: one per source, torch and Python version, so
# older ones (of a shoal or torch since upgraded) go, the most recently used kept for the other
# environments of the machine.
KEPT_BUILDS = 3


def _prune_builds(ours: str) -> None:
    """Marks build directory ``ours`` used now, and removes the other builds beside it but the
    ``KEPT_BUILDS - 1`` most recently used, skipping any a process is building (its lock held)."""
    def used(build: str) -> float:
        try:
            return os.stat(build).st_mtime
        except OSError:
            return 0.0  # removed meanwhile by another process pruning: first to go

    os.utime(ours)
    root = os.path.dirname(ours)
    others = [os.path.join(root, d) for d in os.listdir(root)
              if d.startswith("torch-backend-") and os.path.join(root, d) != ours]
    others.sort(key=used, reverse=True)
    for old in others[KEPT_BUILDS - 1:]:
        try:
            with open(os.path.join(old, "shoal.lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(old)
        except OSError:
            continue  # in use, or gone meanwhile


_Base: type = _compiled_base() or _PythonBase


class ShoalBackend(_Base):  # type: ignore[misc, valid-type]
    """c10d's view of one shoal group; made by ``init_process_group("shoal")`` and
    ``dist.new_group``, not by hand. ``compiled`` says whether its base class is the compiled one."""

    compiled = _Base is not _PythonBase

    def __init__(self, group: Communicator, rank: int, size: int, run: Optional[_Run] = None) -> None:
        super().__init__(rank, size)
        self.group = group
        self._owned_run = run  # the default group's: destroy_process_group leaves the run
        self._lock = threading.Lock()
        self._attach(group._native.torch_api(), _as_torch_error)

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return NAME

    # Asked by batch_isend_irecv; the base class's answer asks this class again, without end.
    supports_coalescing = False

    def shutdown(self) -> None:
        """``destroy_process_group()``: the default group's backend leaves the run (and stops
        the master it hosts); a subgroup's has nothing of its own to close."""
        if self._owned_run is not None:
            self._owned_run.close()

    @property
    def communicator(self) -> Communicator:
        """The shoal group behind this process group, ranked as torch ranks it."""
        return self.group

    def _tag(self, base: int = 0) -> int:
        # One count with the compiled all-reduce's: every member numbers the same call alike.
        return base | (self._next_seq() % _COMPOSED)

    @staticmethod
    def _p2p_tag(tag: int) -> int:
        if not 0 <= tag < _USER_TAGS:
            raise ValueError(f"the shoal backend's send/recv tags run from 0 to 2**62 - 1, got {tag}")
        return _P2P | tag

    def _run(self, opts: Any, calls: "list[tuple[Callable[..., Any], Callable[..., Any], tuple, dict]]",
             result: "list[torch.Tensor]", finish: Optional[Callable[[], None]] = None) -> Work:
        """Runs shoal's ``calls``, each ``(blocking, asynchronous, args, kwargs)``, a tag added.
        A call torch waits for at once (``opts.asyncOp`` false: ``async_op=False``) runs each to
        its end in this thread, shoal's fastest way; the others start each and return."""
        if getattr(opts, "asyncOp", True):
            return Work([start(*args, tag=self._tag(), **kw) for _, start, args, kw in calls], result, finish)
        for call, _, args, kw in calls:
            try:
                call(*args, tag=self._tag(), **kw)
            except errors.ShoalError as e:  # every member stops at the same call: its outcome is agreed
                return Work([], result, finish, _as_torch_error(e))
        return Work([], result, finish)

    # -- all-reduce, broadcast, barrier -----------------------------------------------------

    def allreduce(self, tensors: "list[torch.Tensor]", opts: Any = None) -> Work:
        g, op = self.group, _op(opts)
        # Several at once (coalesced) reduce copies, put back only if every one succeeded: a
        # retry after a lost peer must not reduce again the tensors that were reduced before it.
        bufs = [_contiguous(t) for t in tensors] if len(tensors) == 1 else \
            [t.clone(memory_format=torch.contiguous_format) for t in tensors]
        calls = [(g.all_reduce, g.all_reduce_async, (b,), {"op": op}) for b in bufs]
        return self._run(opts, calls, tensors, _copy_back(list(zip(tensors, bufs))))

    def allreduce_coalesced(self, tensors: "list[torch.Tensor]", opts: Any = None) -> Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: "list[torch.Tensor]", opts: Any = None) -> Work:
        g, bufs = self.group, [_contiguous(t) for t in tensors]
        calls = [(g.broadcast, g.broadcast_async, (b,), {"root": opts.rootRank}) for b in bufs]
        return self._run(opts, calls, tensors, _copy_back(list(zip(tensors, bufs))))

    def barrier(self, opts: Any = None) -> Work:
        return self._run(opts, [(self.group.barrier, self.group.barrier_async, (), {})], [])

    def reduce(self, tensors: "list[torch.Tensor]", opts: Any = None) -> Work:
        """An all-reduce whose result only the root keeps: the others reduce a copy and keep
        their tensors as they were. (A reduce-scatter and a gather to the root would move half
        the bytes, but shoal's reduce-scatter is slower than its all-reduce: 66 against 19 ms at
        64 MiB between 2 processes, `docs/benchmarks.md`.)"""
        g, op, root = self.group, _op(opts), opts.rootRank
        bufs = [_contiguous(t) if self.rank() == root else t.clone(memory_format=torch.contiguous_format)
                for t in tensors]
        calls = [(g.all_reduce, g.all_reduce_async, (b,), {"op": op}) for b in bufs]
        return self._run(opts, calls, tensors, _copy_back(list(zip(tensors, bufs))) if self.rank() == root else None)

    # -- all-gather, reduce-scatter ---------------------------------------------------------

    def allgather(self, outputs: "list[list[torch.Tensor]]", inputs: "list[torch.Tensor]", opts: Any = None) -> Work:
        g, calls, finishes = self.group, [], []
        for outs, inp in zip(outputs, inputs):
            _same_shapes("allgather", outs, inp, self.size())
            flat = torch.empty((self.size(), *inp.shape), dtype=inp.dtype)
            calls.append((g.all_gather, g.all_gather_async, (flat, _contiguous(inp)), {}))
            finishes.append(_copy_back(list(zip(outs, flat.unbind(0)))))
        return self._run(opts, calls, [t for outs in outputs for t in outs], _then(*finishes))

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Work:
        return self.all_gather_single_coalesced([output], [inp], opts)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, outputs: "list[list[torch.Tensor]]", inputs: "list[torch.Tensor]",
                            opts: Any = None) -> Work:
        return self.allgather(outputs, inputs, opts)

    def all_gather_single_coalesced(self, outputs: "list[torch.Tensor]", inputs: "list[torch.Tensor]",
                                    opts: Any = None) -> Work:
        g, out = self.group, [_contiguous(o) for o in outputs]
        calls = [(g.all_gather, g.all_gather_async, (o, _contiguous(i)), {}) for o, i in zip(out, inputs)]
        return self._run(opts, calls, outputs, _copy_back(list(zip(outputs, out))))

    def reduce_scatter(self, outputs: "list[torch.Tensor]", inputs: "list[list[torch.Tensor]]",
                       opts: Any = None) -> Work:
        g, op, calls, finishes = self.group, _op(opts), [], []
        for out, ins in zip(outputs, inputs):
            _same_shapes("reduce_scatter", ins, out, self.size())
            buf = _contiguous(out)
            calls.append((g.reduce_scatter, g.reduce_scatter_async, (buf, torch.stack(ins)), {"op": op}))
            finishes.append(_copy_back([(out, buf)]))
        return self._run(opts, calls, outputs, _then(*finishes))

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Work:
        return self.reduce_scatter_single_coalesced([output], [inp], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: "list[torch.Tensor]", inputs: "list[torch.Tensor]",
                                        opts: Any = None) -> Work:
        g, op, out = self.group, _op(opts), [_contiguous(o) for o in outputs]
        calls = [(g.reduce_scatter, g.reduce_scatter_async, (o, _contiguous(i)), {"op": op})
                 for o, i in zip(out, inputs)]
        return self._run(opts, calls, outputs, _copy_back(list(zip(outputs, out))))

    # -- gather, scatter, all-to-all: tagged transfers --------------------------------------

    def gather(self, outputs: "list[list[torch.Tensor]]", inputs: "list[torch.Tensor]", opts: Any = None) -> Work:
        root, (inp,) = opts.rootRank, inputs
        if self.rank() != root:
            return Work([self.group.isend(_contiguous(inp), peer=root, tag=self._tag(_COMPOSED))], [])
        (outs,) = outputs
        _same_shapes("gather", outs, inp, self.size())
        tag, bufs = self._tag(_COMPOSED), [_contiguous(t) for t in outs]
        bufs[root].copy_(inp)
        works = [self.group.irecv(b, peer=r, tag=tag) for r, b in enumerate(bufs) if r != root]
        return Work(works, outs, _copy_back(list(zip(outs, bufs))))

    def scatter(self, outputs: "list[torch.Tensor]", inputs: "list[list[torch.Tensor]]", opts: Any = None) -> Work:
        root, (out,) = opts.rootRank, outputs
        buf = _contiguous(out)
        if self.rank() != root:
            return Work([self.group.irecv(buf, peer=root, tag=self._tag(_COMPOSED))], [out], _copy_back([(out, buf)]))
        (ins,) = inputs
        _same_shapes("scatter", ins, out, self.size())
        tag = self._tag(_COMPOSED)
        works = [self.group.isend(_contiguous(t), peer=r, tag=tag) for r, t in enumerate(ins) if r != root]
        buf.copy_(ins[root])
        return Work(works, [out], _copy_back([(out, buf)]))

    def alltoall(self, outputs: "list[torch.Tensor]", inputs: "list[torch.Tensor]", opts: Any = None) -> Work:
        bufs = [_contiguous(t) for t in outputs]
        works = self._exchange(bufs, [_contiguous(t) for t in inputs])
        return Work(works, outputs, _copy_back(list(zip(outputs, bufs))))

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, output_splits: "list[int]",
                          input_splits: "list[int]", opts: Any = None) -> Work:
        out = _contiguous(output)
        outs = _split(out, output_splits, self.size())
        ins = _split(_contiguous(inp), input_splits, self.size())
        return Work(self._exchange(outs, ins), [output], _copy_back([(output, out)]))

    alltoall_base = all_to_all_single

    def _exchange(self, outs: "list[torch.Tensor]", ins: "list[torch.Tensor]") -> "list[_ShoalWork]":
        """Rank ``r`` gets ``ins[r]`` into its ``outs[self]``: one send and one receive per
        other rank, all in flight at once."""
        if len(outs) != self.size() or len(ins) != self.size():
            raise ValueError(f"all_to_all over {self.size()} ranks needs {self.size()} inputs and outputs")
        me, tag, works = self.rank(), self._tag(_COMPOSED), []
        for r in range(self.size()):
            if r == me:
                outs[r].copy_(ins[r])
                continue
            if ins[r].numel():
                works.append(self.group.isend(ins[r], peer=r, tag=tag))
            if outs[r].numel():
                works.append(self.group.irecv(outs[r], peer=r, tag=tag))
        return works

    # -- send, recv -------------------------------------------------------------------------

    def send(self, tensors: "list[torch.Tensor]", dst: int, tag: int) -> Work:
        (t,) = tensors
        return Work([self.group.isend(_contiguous(t), peer=dst, tag=self._p2p_tag(tag))], [])

    def recv(self, tensors: "list[torch.Tensor]", src: int, tag: int) -> Work:
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: "list[torch.Tensor]", tag: int) -> Work:
        """``dist.recv`` without ``src``: the first rank to send with ``tag``, which the work's
        ``_source_rank()`` names (torch asks it through the compiled part's holder of the work:
        torch's own holder, all a backend in Python alone has, cannot answer)."""
        if not self.compiled:
            raise errors.UsageError("recv without src (from any rank) needs the shoal backend's compiled part, "
                                    "which could not be built here (a C++ compiler and ninja): name the rank")
        return self._recv(tensors, None, tag)

    def _recv(self, tensors: "list[torch.Tensor]", src: Optional[int], tag: int) -> Work:
        (t,) = tensors
        buf = _contiguous(t)
        work = self.group.irecv(buf, peer=src, tag=self._p2p_tag(tag))
        return Work([work], tensors, _copy_back([(t, buf)]))


def _same_shapes(verb: str, tensors: "list[torch.Tensor]", like: torch.Tensor, size: int) -> None:
    if len(tensors) != size:
        raise ValueError(f"{verb} over {size} ranks needs a list of {size} tensors, got {len(tensors)}")
    for t in tensors:
        if t.shape != like.shape or t.dtype != like.dtype:
            raise ValueError(f"{verb}: every tensor must be {like.dtype} of shape {tuple(like.shape)}, "
                             f"got {t.dtype} of {tuple(t.shape)}")


def _split(t: torch.Tensor, splits: "list[int]", size: int) -> "list[torch.Tensor]":
    """``t`` cut along its first dimension into ``size`` parts (even ones without ``splits``)."""
    if not splits:
        if t.shape[0] % size:
            raise ValueError(f"all_to_all_single: {t.shape[0]} rows do not split evenly over {size} ranks")
        splits = [t.shape[0] // size] * size
    if len(splits) != size or sum(splits) != t.shape[0]:
        raise ValueError(f"all_to_all_single: splits {splits} do not cut {t.shape[0]} rows into {size} parts")
    return list(torch.split(t, splits))
