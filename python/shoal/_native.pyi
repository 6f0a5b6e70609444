"""Type stubs of the native extension. Users import these names from ``shoal``."""

import os
import pathlib
from typing import Any, Callable, Optional, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self

__all__ = [
    "Communicator", "DTYPES", "Master", "NativeVote", "NativeWork", "OPS", "ReduceInfo", "__version__",
    "hash_tensor_bytes", "lab_delay", "make_certs", "quantize_bytes",
]
_Quant = Optional[tuple[str, Optional[int]]]
__version__: str
DTYPES: list[str]
OPS: list[str]

@final
class ReduceInfo:
    """Outcome of a completed collective."""

    @property
    def world_size(self) -> int:
        """Peers that took part."""
    @property
    def tx_bytes(self) -> int:
        """Bytes this peer sent."""
    @property
    def rx_bytes(self) -> int:
        """Bytes this peer received."""
    @property
    def elapsed(self) -> float:
        """Wall time of the call in seconds."""
    @property
    def topology(self) -> int:
        """The topology (epoch) the collective ran in."""
    @property
    def sequence(self) -> int:
        """The collective's number within its topology; with ``topology``, the same on every participant."""
    @property
    def algorithm(self) -> str:
        """How it moved its data: "ring", "oneshot", "twoshot", "hierarchical", "doubling", "twolevel",
        "direct" (a transfer) or "single_copy" (a transfer read straight out of the sender's memory,
        on one host)."""
    @property
    def peer(self) -> Optional[int]:
        """A transfer: the rank of the member at the other end (for a receive from any member, the
        one whose send it took); ``None`` for a collective."""
    @property
    def rank(self) -> int:
        """Our rank in the group the call ran in."""
    @property
    def lateness(self) -> list[float]:
        """How much later than the earliest member each member called, in seconds, by rank (0.0 for
        the earliest); the same figures on every participant, to about one hop's latency. Empty where
        not measured: a transfer, a broadcast, a group of one, or a collective the master decided."""
    @property
    def last(self) -> Optional[int]:
        """The rank that held the others up: the latest to call, by at least a millisecond and a
        tenth of the earliest member's call; ``None`` if nobody did, or where not measured."""
    @property
    def included(self) -> list[int]:
        """The ranks that took part: all of them, but for an ``all_reduce`` with a ``deadline`` that
        left some out (``world_size`` counts these). Empty for a transfer."""
    @property
    def peers_pending(self) -> Optional[bool]:
        """For an ``all_reduce`` with a ``deadline``: whether peers waited to join when the master
        decided who takes part, what ``peers_pending()`` would have answered then; every member
        hears the same (one left out too: ``ExcludedError.peers_pending``), so a loop can admit
        them at its next step without that vote, which waits for the whole group. ``None`` for
        any other call."""

@final
class NativeWork:
    """A collective in flight; use ``shoal.Work``."""

    def wait(self, timeout: Optional[float] = None) -> ReduceInfo: ...
    def done(self) -> bool: ...

@final
class NativeVote:
    """A peers_pending vote cast ahead; use ``shoal.Communicator.peers_pending_async``."""

    def wait(self) -> bool: ...
    def done(self) -> bool: ...

@final
class Communicator:
    """Native communicator; use ``shoal.Communicator``, which checks and converts tensors."""

    def __new__(
        cls,
        master_addr: str,
        *,
        peer_group: int = 0,
        secret: Optional[str] = None,
        connections: Optional[int] = None,
        listen_addr: Optional[str] = None,
        advertise_addr: Optional[str] = None,
        chunk_bytes: Optional[int] = None,
        heartbeat_timeout: Optional[float] = None,
        timeout: Optional[float] = None,
        tls_cert: Optional[str | os.PathLike[str]] = None,
        tls_key: Optional[str | os.PathLike[str]] = None,
        tls_ca: Optional[str | os.PathLike[str]] = None,
    ) -> Self: ...
    def connect(self, timeout: Optional[float] = None, min_world_size: int = 1) -> None: ...
    def connect_catching_up(
        self,
        timeout: Optional[float],
        min_world_size: int,
        tensors: list[tuple[str, npt.NDArray[np.uint8], str, list[int], bool]],
        progress: Optional[Callable[[int, int, float, Optional[float]], object]],
    ) -> tuple[Optional[int], int, list[int], Optional[str], float]: ...
    def update_topology(self) -> None: ...
    def optimize_topology(self) -> None: ...
    def bandwidth_matrix(self) -> list[list[Optional[tuple[int, int]]]]: ...
    def peers_pending(self) -> bool: ...
    def peers_pending_async(self) -> NativeVote: ...
    def all_reduce_bytes(
        self, buf: npt.NDArray[np.uint8], dtype: str, op: str, tag: int, algorithm: Optional[str] = None,
        quant: _Quant = None, cutoff: Optional[tuple[float, int]] = None,
    ) -> ReduceInfo: ...
    def all_reduce_array(
        self, arr: npt.NDArray[Any], op: str, tag: int, algorithm: Optional[str] = None, quant: _Quant = None,
    ) -> Optional[ReduceInfo]: ...
    def all_reduce_array_async(
        self, arr: npt.NDArray[Any], op: str, tag: int, algorithm: Optional[str] = None, quant: _Quant = None,
    ) -> Optional[NativeWork]: ...
    def all_reduce_bytes_async(
        self, buf: npt.NDArray[np.uint8], dtype: str, op: str, tag: int, algorithm: Optional[str] = None,
        quant: _Quant = None, cutoff: Optional[tuple[float, int]] = None,
    ) -> NativeWork: ...
    def all_reduce_many_bytes(
        self, bufs: list[tuple[npt.NDArray[np.uint8], str]], op: str, max_in_flight: int, tag: int,
        quant: _Quant = None,
    ) -> list[ReduceInfo]: ...
    def all_gather_bytes(
        self, out: npt.NDArray[np.uint8], inp: npt.NDArray[np.uint8], dtype: str, tag: int, quant: _Quant = None,
        cutoff: Optional[tuple[float, int]] = None,
    ) -> ReduceInfo: ...
    def reduce_scatter_bytes(
        self, out: npt.NDArray[np.uint8], inp: npt.NDArray[np.uint8], dtype: str, op: str, tag: int,
        quant: _Quant = None, cutoff: Optional[tuple[float, int]] = None,
    ) -> ReduceInfo: ...
    def broadcast_bytes(
        self, buf: npt.NDArray[np.uint8], dtype: str, root: int, tag: int, algorithm: Optional[str] = None,
        cutoff: Optional[tuple[float, int]] = None,
    ) -> ReduceInfo: ...
    def barrier(self, tag: int) -> ReduceInfo: ...
    def all_gather_bytes_async(
        self, out: npt.NDArray[np.uint8], inp: npt.NDArray[np.uint8], dtype: str, tag: int, quant: _Quant = None,
        cutoff: Optional[tuple[float, int]] = None,
    ) -> NativeWork: ...
    def reduce_scatter_bytes_async(
        self, out: npt.NDArray[np.uint8], inp: npt.NDArray[np.uint8], dtype: str, op: str, tag: int,
        quant: _Quant = None, cutoff: Optional[tuple[float, int]] = None,
    ) -> NativeWork: ...
    def broadcast_bytes_async(
        self, buf: npt.NDArray[np.uint8], dtype: str, root: int, tag: int, algorithm: Optional[str] = None,
        cutoff: Optional[tuple[float, int]] = None,
    ) -> NativeWork: ...
    def barrier_async(self, tag: int) -> NativeWork: ...
    def send_bytes(self, buf: npt.NDArray[np.uint8], dtype: str, peer: int, tag: int) -> ReduceInfo: ...
    def recv_bytes(self, buf: npt.NDArray[np.uint8], dtype: str, peer: Optional[int], tag: int) -> ReduceInfo: ...
    def isend_bytes(self, buf: npt.NDArray[np.uint8], dtype: str, peer: int, tag: int) -> NativeWork: ...
    def irecv_bytes(self, buf: npt.NDArray[np.uint8], dtype: str, peer: Optional[int], tag: int) -> NativeWork: ...
    def links(self) -> list[tuple[int, int, int, int, int, int, float, int, str, str, bool]]: ...
    def stats_json(self) -> str: ...
    def sync_shared_state(
        self,
        tensors: list[tuple[str, npt.NDArray[np.uint8], str, list[int], bool]],
        revision: int,
        strategy: str,
        override_resume: bool,
    ) -> tuple[int, list[tuple[str, list[int], int]], list[int], int, float]: ...
    @property
    def world_size(self) -> Optional[int]: ...
    @property
    def group_world_size(self) -> Optional[int]: ...
    @property
    def rank(self) -> Optional[int]: ...
    @property
    def peer_id(self) -> Optional[int]: ...
    def split(self, color: Optional[int], key: int = 0) -> Optional[Communicator]: ...
    def new_group(self, ranks: list[int]) -> Optional[Communicator]: ...
    def subgroup(self, ranks: list[int], name: bytes) -> Optional[Communicator]: ...
    def subgroup_of_peers(self, peers: list[int], name: bytes) -> Optional[Communicator]: ...
    def close(self) -> None: ...
    def torch_api(self) -> Any: ...

@final
class Master:
    """The coordinator: admits peers and runs votes; never carries tensor data.

    ``Master("0.0.0.0:48148")`` then ``start()``/``stop()``, or use it as a context manager.
    Port 0 picks a free port; ``address`` gives the real one once started. With ``secret`` (or
    ``SHOAL_SECRET``) a peer joins only if it proves the same secret; a wrong or missing one gets
    ``AuthenticationError`` at ``connect()``. ``heartbeat_timeout`` (or
    ``SHOAL_HEARTBEAT_TIMEOUT``) pins how long a silent peer is tolerated; by default each peer's
    bound follows the gaps between its heartbeats, from 7.5 s to 60 s (``docs/protocol.md``,
    "Adaptive bounds").

    With ``http_addr`` (or ``SHOAL_HTTP_ADDR``) it serves ``/metrics`` (Prometheus), ``/status``
    (the run as JSON) and ``/`` (a status page) there. With ``state_dir`` it keeps what a restarted
    master needs there; a master started on a directory that holds a run carries it on, and the
    peers rejoin it if it is back on the same address within their heartbeat timeout. With
    ``tls_cert``, ``tls_key`` and ``tls_ca`` (or ``SHOAL_TLS_*``) every connection is under mutual
    TLS: a peer must present a certificate of the run's CA.
    """

    def __new__(
        cls,
        listen: str = "0.0.0.0:48148",
        *,
        secret: Optional[str] = None,
        heartbeat_timeout: Optional[float] = None,
        http_addr: Optional[str] = None,
        state_dir: Optional[str | os.PathLike[str]] = None,
        tls_cert: Optional[str | os.PathLike[str]] = None,
        tls_key: Optional[str | os.PathLike[str]] = None,
        tls_ca: Optional[str | os.PathLike[str]] = None,
    ) -> Self: ...
    def start(self) -> None:
        """Bind the listen address and serve in background threads."""
    def stop(self) -> None:
        """Stop serving and close every connection. Idempotent."""
    @property
    def address(self) -> str:
        """``host:port`` the master listens on."""
    @property
    def running(self) -> bool: ...
    @property
    def http_address(self) -> Optional[str]:
        """``host:port`` of ``/metrics``, ``/status`` and the status page, once started with ``http_addr``."""
    def status(self) -> Optional[dict[str, Any]]:
        """The run as ``/status`` serves it (peers, groups, ring, link matrix, running operations,
        counters); ``None`` unless running."""
    def __enter__(self) -> Self: ...
    def __exit__(self, exc_type: object, exc: object, tb: object) -> None: ...

def hash_tensor_bytes(buf: npt.NDArray[np.uint8], dtype: str, shape: list[int]) -> str: ...
def quantize_bytes(buf: npt.NDArray[np.uint8], dtype: str, quant: tuple[str, Optional[int]]) -> int: ...
def lab_delay(queues: list[tuple[Optional[str], int, float]], ttl: float, max_len: int) -> tuple[int, int]: ...
def make_certs(
    out_dir: str | os.PathLike[str], hosts: list[str]
) -> tuple[pathlib.Path, bool, list[tuple[str, pathlib.Path, pathlib.Path]]]:
    """Make a run's TLS certificates in ``out_dir`` (``shoal certs``): the CA's file, whether it was made
    now (else the CA there signed them), and each host's (host, certificate file, key file)."""
