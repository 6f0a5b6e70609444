"""The user-facing :class:`Communicator`: tensor checks and conversion around the native one."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import numpy as np

from . import _native
from ._tensors import _byte_view, _copy
from .errors import UsageError

if TYPE_CHECKING:
    from ._state import CatchUpInfo, CatchUpProgress, SharedState, SyncInfo



class Communicator:
    """One peer's membership in a run.

    ``connect()`` registers with the master and returns once this peer is accepted: at once if
    it is the first, otherwise when the accepted peers call ``update_topology()``. Collectives
    work in place on numpy arrays and torch CPU tensors, release the GIL, and raise
    ``TypeError``/``ValueError`` before any traffic when a tensor cannot be used as it is (shoal
    never copies a tensor silently).

    Options are keyword-only; timeouts are float seconds. ``None`` means: the ``SHOAL_*``
    environment variable, else the built-in default. ``timeout`` given (or ``SHOAL_TIMEOUT``) pins
    every call's bound; by default a collective's follows how long those of its kind and size
    took, from 60 s to 600 s (``docs/protocol.md``, "Adaptive bounds"). ``connections`` is the number of TCP
    streams per peer pair; by default one to a peer on the same host and four to a peer
    elsewhere. ``tls_cert``, ``tls_key`` and ``tls_ca`` (or ``SHOAL_TLS_CERT``, ``SHOAL_TLS_KEY``,
    ``SHOAL_TLS_CA``; ``shoal certs`` makes them) put every connection, to the master and to other
    peers, under mutual TLS; a peer without a certificate of the run's CA gets
    :class:`AuthenticationError` at ``connect()``.
    """

    def __init__(
        self,
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
    ) -> None:
        self._native = _native.Communicator(
            master_addr,
            peer_group=peer_group,
            secret=secret,
            connections=connections,
            listen_addr=listen_addr,
            advertise_addr=advertise_addr,
            chunk_bytes=chunk_bytes,
            heartbeat_timeout=heartbeat_timeout,
            timeout=timeout,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_ca=tls_ca,
        )

    def connect(
        self,
        timeout: Optional[float] = None,
        *,
        min_world_size: int = 1,
        catch_up: "Optional[SharedState]" = None,
        progress: "Union[bool, Callable[[CatchUpProgress], object], None]" = None,
    ) -> "Optional[CatchUpInfo]":
        """Register with the master and wait until accepted.

        With ``min_world_size``, then wait until this peer's group has that many accepted members,
        admitting newcomers as they register; every accepted member must be in this call
        (admission is their vote; other groups neither count nor vote). Raises
        :class:`TooFewPeersError` when ``timeout`` passes first, and leaves the run.

        With ``catch_up`` (an addition to the API of ``DESIGN.md``), fetch the group's shared state
        into it between registering and being admitted, while the accepted peers go on training
        (``docs/state.md``, "Catching up"): the sync that admits this peer then moves only what
        changed since. Returns a :class:`CatchUpInfo`; ``state.revision`` is the revision fetched.
        ``progress`` is called with a :class:`CatchUpProgress` about four times a second, or
        ``True`` draws a progress bar on stderr. ``timeout`` covers the catch-up, which waits for
        the group's next ``sync_shared_state``. Raises :class:`UsageError` if the state's tensors
        are not the group's.
        """
        if isinstance(min_world_size, bool) or not isinstance(min_world_size, int) or min_world_size < 1:
            raise ValueError(f"min_world_size must be a positive int, got {min_world_size!r}")
        if catch_up is None:
            if progress is not None:
                raise ValueError("progress reports a catch-up: pass catch_up=state too")
            self._native.connect(timeout, min_world_size)
            return None
        from ._state import CatchUpInfo, CatchUpProgress, ProgressBar, SharedState

        if not isinstance(catch_up, SharedState):
            raise TypeError(f"catch_up must be a shoal.SharedState, got {type(catch_up).__name__}")
        report = ProgressBar() if progress is True else progress or None
        if report is not None and not callable(report):
            raise TypeError(f"progress must be callable or True, got {progress!r}")

        def native_progress(done: int, total: int, elapsed: float, eta: Optional[float]) -> None:
            assert report is not None
            report(CatchUpProgress(done=done, total=total, elapsed=elapsed, eta=eta))

        try:
            revision, fetched, donors, skipped, elapsed = self._native.connect_catching_up(
                timeout, min_world_size, catch_up._native_entries(), native_progress if report else None
            )
        finally:
            if isinstance(report, ProgressBar):
                report.close()
        if revision is not None:
            catch_up.revision = revision
        return CatchUpInfo(revision=revision, fetched_bytes=fetched, donors=donors, skipped=skipped, elapsed=elapsed)

    def update_topology(self) -> None:
        """Vote with every accepted peer to admit the pending ones; return once in force."""
        self._native.update_topology()

    def optimize_topology(self) -> None:
        """Measure the links between the group's members and re-order the ring by them; a major
        operation every accepted peer must call (pending peers stay pending). The master solves
        the asymmetric travelling-salesman problem over the measured costs, so the ring crosses
        slow links as few times as possible, places members in sites (short mutual round trips)
        where the hierarchical all-reduce pays, and, across a WAN, sets where one-shot and two-shot
        stop paying; pools of TCP streams that a window held back grow (``SHOAL_CONNECTIONS_MAX``),
        and the measurement repeats over them. Raises ``PeerLostError`` (retryable) if a member is
        lost meanwhile (see ``docs/topology.md``)."""
        self._native.optimize_topology()

    def bandwidth_matrix(self) -> "list[list[dict[str, float] | None]]":
        """What the last ``optimize_topology()`` measured, by rank in the topology in force:
        ``m[a][b]`` is ``{"bytes_per_s", "rtt_s"}`` of the link from rank ``a`` to rank ``b``, or
        ``None`` on the diagonal and for members not measured together (admitted since)."""
        return [
            [None if e is None else {"bytes_per_s": float(e[1]), "rtt_s": e[0] / 1e6} for e in row]
            for row in self._native.bandwidth_matrix()
        ]

    def peers_pending(self) -> bool:
        """Whether :meth:`update_topology` has something to apply: peers wait for admission, or
        the master re-planned the ring around a link that slowed down (``docs/topology.md``,
        "Drift"). A vote every accepted peer must call; all get the same answer."""
        return self._native.peers_pending()

    def peers_pending_async(self) -> "Vote":
        """Casts the :meth:`peers_pending` vote and returns at once: ``vote.wait()`` gives the
        answer, the same on every peer. The vote takes its place among this peer's calls now (it
        begins once the collectives started before it ended, and collectives started after it
        wait for it), so peers that cast it at the same point of their calls agree, and its round
        trip to the master overlaps the caller's compute. Wait for every vote cast."""
        return Vote(self._native.peers_pending_async())

    def all_reduce(
        self,
        tensor: Any,
        *,
        op: str = "avg",
        tag: int = 0,
        quantization: Optional[str] = None,
        algorithm: Optional[str] = None,
        quantization_block: Optional[int] = None,
        deadline: Optional[float] = None,
        min_participants: Optional[int] = None,
    ) -> _native.ReduceInfo:
        """Reduce ``tensor`` in place with every peer of the group (ops: sum, avg, prod, min, max).

        On success every peer holds bit-identical values. On :class:`PeerLostError` the call did
        not happen (the tensor is as it was) and the ring re-forms by itself: retry it as is.
        ``algorithm`` forces ``"ring"``, ``"oneshot"``, ``"twoshot"``, ``"hierarchical"``,
        ``"doubling"`` or ``"twolevel"`` (every peer must pass the same); by default
        (``SHOAL_ALGO``, else ``"auto"``) buffers up to ``SHOAL_ONESHOT_MAX_BYTES`` (between two
        peers of one host, 8 KiB) run one-shot (in a group of more than 8 on one host, by
        doubling: ``log2 n`` rounds; in one of more than 8 across hosts or sites some of which
        hold several members, two-level: one-shot to each site's leader, among the leaders, and
        back), up to ``SHOAL_TWOSHOT_MAX_BYTES`` two-shot where the group spans hosts; larger ones
        run hierarchical where the group spans hosts and some share one (within each host, then
        one leader per host across), else around the ring. After ``optimize_topology()`` across a
        WAN, the limits the master derives from the measured round trips replace the two
        settings, the master's sites (members whose round trips are short) replace hosts, and
        the hierarchical all-reduce runs only where the measured links say grouping pays.
        ``ReduceInfo.algorithm`` says which ran.

        ``quantization`` (op sum or avg, float tensors) sends every chunk in fewer bytes:
        ``"fp16"``, ``"bf16"`` (each element cast), ``"int8"``, ``"int4"`` (block-wise min-max,
        round to nearest; ``quantization_block`` elements a block, default 128 and 256). Each chunk
        is encoded once by the peer that sends it first, which keeps the decoded values itself, and
        is passed on as it came: every peer still ends bit-identical. Partial sums are quantized at
        each hop; accumulation runs in float32 (float64 for float64 tensors). Every peer must pass
        the same quantization; combinations that make no sense (an integer tensor, prod/min/max)
        raise ``ValueError`` before any traffic. ``ReduceInfo.tx_bytes`` counts what was sent.
        See :class:`ErrorFeedback` to carry the error into the next step.

        ``deadline`` (seconds) waits for no straggler longer: the members that have not called this
        all-reduce ``deadline`` seconds after ``min_participants`` had (by default more than half
        the group) are left out by agreement, and it runs among the others. Each of those ends
        with the same bit-identical result over exactly them (``avg`` divides by their number),
        and ``ReduceInfo.included`` names them; a member left out raises :class:`ExcludedError`
        at its call, its tensor untouched, and stays a member. Deciding who is in costs a round
        trip to the master. Every member must pass a deadline (the first
        caller's figures stand); a group from ``split`` or ``new_group`` takes none.
        """
        _check_tag(tag)
        quant = _quant(quantization, quantization_block)
        cutoff = _cutoff(deadline, min_participants)
        if type(tensor) is np.ndarray and cutoff is None:
            # Checked natively, without a view: None for an array it does not take as is.
            info = self._native.all_reduce_array(tensor, op, tag, algorithm, quant)
            if info is not None:
                return info
        view, dtype = _byte_view(tensor)
        return self._native.all_reduce_bytes(view, dtype, op, tag, algorithm, quant, cutoff)

    def all_reduce_async(
        self,
        tensor: Any,
        *,
        op: str = "avg",
        tag: int = 0,
        algorithm: Optional[str] = None,
        quantization: Optional[str] = None,
        quantization_block: Optional[int] = None,
        deadline: Optional[float] = None,
        min_participants: Optional[int] = None,
    ) -> "Work":
        """Start reducing ``tensor`` in place like :meth:`all_reduce` and return at once.

        The collective moves while the caller computes (the GIL is released), alongside up to
        ``SHOAL_MAX_IN_FLIGHT`` others (default 64; more wait for a slot). Every collective in
        flight needs its own ``tag``: one reused while in flight raises :class:`UsageError` at
        once. Do not touch ``tensor`` until :meth:`Work.wait` returns. A failure aborts exactly
        the collectives that involved the lost peer; each restores its tensor.
        """
        _check_tag(tag)
        quant = _quant(quantization, quantization_block)
        cutoff = _cutoff(deadline, min_participants)
        if type(tensor) is np.ndarray and cutoff is None:
            native = self._native.all_reduce_array_async(tensor, op, tag, algorithm, quant)
            if native is not None:
                return Work(native)
        view, dtype = _byte_view(tensor)
        return Work(self._native.all_reduce_bytes_async(view, dtype, op, tag, algorithm, quant, cutoff))

    def all_reduce_many(
        self,
        tensors: "list[Any]",
        *,
        op: str = "avg",
        max_in_flight: int = 8,
        tag: int = 0,
        quantization: Optional[str] = None,
        quantization_block: Optional[int] = None,
    ) -> "list[_native.ReduceInfo]":
        """Reduce every tensor of ``tensors`` in place, ``max_in_flight`` at a time.

        Retries internally after a peer loss: when it returns, every tensor was reduced exactly
        once in the final world (the inputs are copied first, so that a batch interrupted by a
        loss starts over from them). Tags ``tag .. tag + len(tensors) - 1`` are used. Other
        errors propagate as from :meth:`all_reduce`, with every tensor as it was.
        """
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
        views = [_byte_view(t) for t in tensors]
        _check_tag(tag, max(len(views), 1))
        quant = _quant(quantization, quantization_block)
        return self._native.all_reduce_many_bytes(views, op, max_in_flight, tag, quant)

    def all_gather(
        self,
        out: Any,
        inp: Any,
        *,
        tag: int = 0,
        quantization: Optional[str] = None,
        quantization_block: Optional[int] = None,
        deadline: Optional[float] = None,
        min_participants: Optional[int] = None,
    ) -> _native.ReduceInfo:
        """Gather every peer's ``inp`` into ``out`` in rank order: ``out`` holds world times
        ``inp``'s elements, of the same dtype. On :class:`PeerLostError` ``out`` is as it was;
        retry it with ``out`` sized for the new world (a misfit raises :class:`UsageError` on
        every peer). With ``quantization`` (as :meth:`all_reduce`) each block travels encoded
        by its owner, and every peer (the owner too) holds its decoded values. With
        ``deadline`` (as :meth:`all_reduce`) only the included members' blocks of ``out`` fill
        (``ReduceInfo.included``); the others' stay as they were."""
        out_view, inp_view, dtype, quant = _out_and_in(out, inp, tag, quantization, quantization_block)
        cutoff = _cutoff(deadline, min_participants)
        return self._native.all_gather_bytes(out_view, inp_view, dtype, tag, quant, cutoff)

    def reduce_scatter(
        self,
        out: Any,
        inp: Any,
        *,
        op: str = "sum",
        tag: int = 0,
        quantization: Optional[str] = None,
        quantization_block: Optional[int] = None,
        deadline: Optional[float] = None,
        min_participants: Optional[int] = None,
    ) -> _native.ReduceInfo:
        """Reduce every peer's ``inp`` block by block and leave block ``rank`` in ``out``:
        ``inp`` holds world times ``out``'s elements, of the same dtype, and is left as it was.
        Failures as :meth:`all_gather`; ``quantization`` and ``deadline`` as :meth:`all_reduce`
        (with a deadline, each block is reduced over the included members' alone)."""
        out_view, inp_view, dtype, quant = _out_and_in(out, inp, tag, quantization, quantization_block)
        cutoff = _cutoff(deadline, min_participants)
        return self._native.reduce_scatter_bytes(out_view, inp_view, dtype, op, tag, quant, cutoff)

    def broadcast(
        self,
        tensor: Any,
        *,
        root: int = 0,
        tag: int = 0,
        algorithm: Optional[str] = None,
        deadline: Optional[float] = None,
        min_participants: Optional[int] = None,
    ) -> _native.ReduceInfo:
        """Copy rank ``root``'s ``tensor`` into every other peer's, in place. Small tensors go
        straight from the root to every peer (``algorithm="oneshot"``),
        larger ones around the ring. On :class:`PeerLostError` every tensor is as it was.
        ``deadline`` as :meth:`all_reduce`: the root is waited for, the other members late
        past it are left out (:class:`ExcludedError`, their tensor untouched)."""
        _check_tag(tag)
        _check_root(root)
        view, dtype = _byte_view(tensor)
        cutoff = _cutoff(deadline, min_participants)
        return self._native.broadcast_bytes(view, dtype, root, tag, algorithm, cutoff)

    def barrier(self, *, tag: int = 0) -> _native.ReduceInfo:
        """Return once every peer of the group called it: one hop of tokens among them."""
        _check_tag(tag)
        return self._native.barrier(tag)

    def all_gather_async(
        self,
        out: Any,
        inp: Any,
        *,
        tag: int = 0,
        quantization: Optional[str] = None,
        quantization_block: Optional[int] = None,
        deadline: Optional[float] = None,
        min_participants: Optional[int] = None,
    ) -> "Work":
        """Start :meth:`all_gather` and return at once (``inp`` is copied first); see
        :meth:`all_reduce_async` for tags and what not to touch until :meth:`Work.wait`."""
        out_view, inp_view, dtype, quant = _out_and_in(out, inp, tag, quantization, quantization_block)
        cutoff = _cutoff(deadline, min_participants)
        return Work(self._native.all_gather_bytes_async(out_view, inp_view, dtype, tag, quant, cutoff))

    def reduce_scatter_async(
        self,
        out: Any,
        inp: Any,
        *,
        op: str = "sum",
        tag: int = 0,
        quantization: Optional[str] = None,
        quantization_block: Optional[int] = None,
        deadline: Optional[float] = None,
        min_participants: Optional[int] = None,
    ) -> "Work":
        """Start :meth:`reduce_scatter` and return at once (``inp`` is copied first)."""
        out_view, inp_view, dtype, quant = _out_and_in(out, inp, tag, quantization, quantization_block)
        cutoff = _cutoff(deadline, min_participants)
        return Work(self._native.reduce_scatter_bytes_async(out_view, inp_view, dtype, op, tag, quant, cutoff))

    def broadcast_async(
        self,
        tensor: Any,
        *,
        root: int = 0,
        tag: int = 0,
        algorithm: Optional[str] = None,
        deadline: Optional[float] = None,
        min_participants: Optional[int] = None,
    ) -> "Work":
        """Start :meth:`broadcast` and return at once."""
        _check_tag(tag)
        _check_root(root)
        view, dtype = _byte_view(tensor)
        cutoff = _cutoff(deadline, min_participants)
        return Work(self._native.broadcast_bytes_async(view, dtype, root, tag, algorithm, cutoff))

    def barrier_async(self, *, tag: int = 0) -> "Work":
        """Start :meth:`barrier` and return at once."""
        _check_tag(tag)
        return Work(self._native.barrier_async(tag))

    def send(self, tensor: Any, *, peer: int, tag: int = 0) -> _native.ReduceInfo:
        """Send ``tensor`` to rank ``peer`` of the group, matched there by a :meth:`recv` from us
        with the same ``tag``, in any order with other sends, receives and collectives. Returns
        once the receiver holds every byte; the two ends end alike (both succeed or both fail),
        unless one of them is removed from the run. Several sends with one tag match the receives
        for it in the order each side made them. A receive of another size or dtype fails both
        ends with :class:`CollectiveMismatchError`; a lost peer (or a new topology) raises
        :class:`PeerLostError`, and a rank the group in force does not have, or our own,
        :class:`UsageError` (after a change of the group: choose the peer again)."""
        _check_tag(tag)
        _check_rank("peer", peer)
        view, dtype = _byte_view(tensor, writable=False)
        return self._native.send_bytes(view, dtype, peer, tag)

    def recv(self, tensor: Any, *, peer: Optional[int], tag: int = 0) -> _native.ReduceInfo:
        """Receive into ``tensor`` what rank ``peer`` sends us with ``tag`` (same size and dtype),
        straight into its memory. On an error the tensor may be partly written.

        ``peer=None`` receives from any member: the first send with ``tag`` to arrive, each
        member's in the order it made them; the result's ``peer`` names the sender. Once every
        other member says its call can never send to us, it raises :class:`UsageError`."""
        _check_tag(tag)
        _check_source(peer)
        view, dtype = _byte_view(tensor)
        return self._native.recv_bytes(view, dtype, peer, tag)

    def isend(self, tensor: Any, *, peer: int, tag: int = 0) -> "Work":
        """Start :meth:`send` and return at once; do not change ``tensor`` until
        :meth:`Work.wait` returned."""
        _check_tag(tag)
        _check_rank("peer", peer)
        view, dtype = _byte_view(tensor, writable=False)
        return Work(self._native.isend_bytes(view, dtype, peer, tag))

    def irecv(self, tensor: Any, *, peer: Optional[int], tag: int = 0) -> "Work":
        """Start :meth:`recv` (``peer=None``: from any member) and return at once; ``tensor``
        holds the data once :meth:`Work.wait` returned."""
        _check_tag(tag)
        _check_source(peer)
        view, dtype = _byte_view(tensor)
        return Work(self._native.irecv_bytes(view, dtype, peer, tag))

    def stats(self) -> "dict[str, Any]":
        """This communicator's counters since it was created; the master receives the same with
        every heartbeat, for its ``/metrics`` and status page.

        ``{"operations": {kind: {"started", "succeeded", "failed", "tx_bytes", "rx_bytes",
        "seconds"}}, "failures": {cause: count}, "running": [{"kind", "bytes", "elapsed_s"}],
        "links": [{"peer", "tx_bytes", "rx_bytes", "tx_bytes_per_s", "transport"}]}``. Kinds are
        ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ``"broadcast"``, ``"barrier"``,
        ``"send"``, ``"recv"``, and ``"probe"`` for what ``optimize_topology()`` runs to measure
        the links; causes ``"peer_lost"``, ``"timeout"``, ``"mismatch"``,
        ``"misuse"``, ... Bytes count calls that succeeded; ``seconds`` sums every call that
        ended. A link's rate is what it carried while operations ran in the topology in force.
        """
        result: dict[str, Any] = json.loads(self._native.stats_json())
        return result

    def links(self) -> "list[dict[str, int | float | str | bool]]":
        """Our links in the topology in force: one per member we exchanged data with, opened
        when a collective first needed it and reused by the later ones.

        Each is ``{"peer", "rank", "streams_out", "streams_in", "tx_bytes", "rx_bytes",
        "saturated_s", "saturated_bytes", "transport"}``: the member's id and rank, the streams
        we send and receive on, the bytes moved over them in this topology, how long some frame
        of ours to it waited for room in its stream (the link was saturated) and the bytes written
        meanwhile (their ratio is what the link carries; the master re-plans the ring when it
        drifts, ``docs/topology.md``), and what carries the streams (``"shm"``: shared memory to
        a member on this host; ``"tcp"``; ``"tls"``: TCP under TLS). ``"path"`` says how its
        streams were opened: ``"direct"`` (each side dialed the other's listener) or
        ``"reverse"`` (a member that cannot be dialed, behind a NAT, opened them for both
        directions, ``docs/nat.md``), and ``"dialable"`` whether the member can be dialed, as the
        master found when it joined.
        """
        keys = ("peer", "rank", "streams_out", "streams_in", "tx_bytes", "rx_bytes", "saturated_s", "saturated_bytes",
                "transport", "path", "dialable")
        return [dict(zip(keys, link)) for link in self._native.links()]

    def sync_shared_state(
        self, state: "SharedState", strategy: str = "enforce_popular", *, override_resume: bool = False
    ) -> "SyncInfo":
        """Make ``state`` the one the group elects, in place; every accepted peer of the group
        calls it together (``docs/state.md``).

        ``strategy``: ``enforce_popular`` (the most popular state at the run's next revision wins;
        an outvoted or lagging peer is repaired), ``send_only`` (this peer's state is
        authoritative; it never receives), ``receive_only`` (never votes or sends; takes the
        elected state). Only differing tensors travel, peer to peer, striped across every peer
        that holds the elected one, and are verified by hash before they replace anything.
        ``override_resume`` accepts a state other than the one the run last agreed on after
        every peer had left. Raises :class:`PeerLostError` (retryable) if a participant was lost
        and the sync could not complete, :class:`UsageError` if the calls do not fit together.
        """
        from ._state import SyncInfo

        if strategy not in ("enforce_popular", "send_only", "receive_only"):
            raise ValueError(f"unknown strategy {strategy!r}: expected enforce_popular, send_only or receive_only")
        _check_u64("state.revision", state.revision)
        revision, received, sent_to, sent_bytes, elapsed = self._native.sync_shared_state(
            state._native_entries(), state.revision, strategy, override_resume
        )
        state.revision = revision
        return SyncInfo(
            revision=revision,
            received={name: donors for name, donors, _ in received},
            received_bytes=sum(n for _, _, n in received),
            sent_to=sent_to,
            sent_bytes=sent_bytes,
            elapsed=elapsed,
        )

    def split(self, color: Optional[int], key: int = 0) -> Optional["Communicator"]:
        """A derived group of this group's members, like ``MPI_Comm_split``; no new admission.

        Every member calls it (it is a collective of this group). Those that give the same
        ``color`` form one group, ranked by ``key`` and then by their rank here; ``color=None``
        leaves this member out and returns ``None``. The group runs collectives and ``send``/
        ``recv`` by its own ranks over this communicator's connections: its first collective
        opens nothing that this group's collectives opened already. Admission, votes and
        shared-state syncs stay calls of the whole group (``ValueError`` on a derived one). After
        a member is lost, a derived group is its members still in the run, in their order; it
        leaves with the communicator it came from (its ``close()`` does nothing).
        """
        return _derived(self._native.split(color, key))

    def new_group(self, ranks: "list[int]") -> Optional["Communicator"]:
        """The derived group of the members at ``ranks``, like ``torch.distributed.new_group``.

        Every member of this group calls it with the same ranks (a collective of the group);
        those at ``ranks`` get the group, ranked as ``ranks`` sorted, the others ``None``.
        Different ranks on different members raise ``ValueError`` on every one. See ``split``.
        """
        return _derived(self._native.new_group(list(ranks)))

    def subgroup(self, ranks: "list[int]", name: "str | bytes") -> Optional["Communicator"]:
        """The derived group of the members at ``ranks`` (in that order: the member at
        ``ranks[i]`` is the group's rank ``i``), formed without a collective.

        Unlike ``new_group``, only those members call it, each with the same ``ranks`` and a
        ``name`` that no other subgroup of this group was given (``torch.distributed`` names its
        groups alike on every member); the others get ``None`` and need not call it. Members that
        give different ranks or names form different groups, whose collectives never meet. An
        addition to the API of ``DESIGN.md``: what ``shoal.torch`` builds torch's subgroups on.
        """
        return _derived(self._native.subgroup(list(ranks), _name(name)))

    def subgroup_of_peers(self, peers: "list[int]", name: "str | bytes") -> Optional["Communicator"]:
        """``subgroup`` of the members with ids ``peers`` (their ``peer_id``), in that order: for
        members that know each other by id (a rendezvous outside shoal told them, as torch's
        store does), not by a rank that a new topology may change meanwhile."""
        return _derived(self._native.subgroup_of_peers(list(peers), _name(name)))

    @property
    def world_size(self) -> int:
        """Accepted peers in the whole run, every group's, when this group's topology was issued."""
        return _accepted(self._native.world_size)

    @property
    def group_world_size(self) -> int:
        """Accepted peers in this peer's group."""
        return _accepted(self._native.group_world_size)

    @property
    def rank(self) -> int:
        """This peer's position in its group's ring."""
        return _accepted(self._native.rank)

    @property
    def peer_id(self) -> int:
        """This peer's id in the run, assigned by the master."""
        return _accepted(self._native.peer_id)

    def close(self) -> None:
        """Leave the run and close every connection. Idempotent."""
        self._native.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _derived(native: Optional[_native.Communicator]) -> Optional[Communicator]:
    """The user-facing communicator around a derived group's native one."""
    if native is None:
        return None
    comm = Communicator.__new__(Communicator)
    comm._native = native
    return comm


def _name(name: "str | bytes") -> bytes:
    if isinstance(name, str):
        return name.encode()
    if not isinstance(name, bytes):
        raise TypeError(f"name must be str or bytes, got {type(name).__name__}")
    return name


def _accepted(value: Optional[int]) -> int:
    if value is None:
        raise UsageError("the communicator is not connected: call connect() first")
    return value


def _out_and_in(out: Any, inp: Any, tag: int, quantization: Optional[str], block: Optional[int]) -> tuple:
    """The checked arguments of an all-gather or reduce-scatter: byte views of ``out`` and
    ``inp`` (of one dtype), the dtype, and the native quantization."""
    _check_tag(tag)
    (out_view, dtype), (inp_view, inp_dtype) = _byte_view(out), _byte_view(inp, writable=False)
    _same_dtype(dtype, inp_dtype)
    return out_view, inp_view, dtype, _quant(quantization, block)


def _cutoff(deadline: Optional[float], min_participants: Optional[int]) -> "Optional[tuple[float, int]]":
    """The native form of ``deadline=``, ``min_participants=`` (0: more than half the group)."""
    if deadline is None:
        if min_participants is not None:
            raise ValueError(f"min_participants={min_participants!r} without a deadline")
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 <= deadline < float("inf"):
        raise ValueError(f"deadline must be a finite number of seconds >= 0, got {deadline!r}")
    if min_participants is None:
        return (float(deadline), 0)
    if isinstance(min_participants, bool) or not isinstance(min_participants, int) or min_participants < 1:
        raise ValueError(f"min_participants must be a positive integer, got {min_participants!r}")
    return (float(deadline), min(min_participants, 2**32 - 1))


def _quant(quantization: Optional[str], block: Optional[int]) -> "Optional[tuple[str, Optional[int]]]":
    """The native form of ``quantization=``, ``quantization_block=`` (checked natively)."""
    if quantization is None:
        if block is not None:
            raise ValueError(f"quantization_block={block!r} without a quantization")
        return None
    if not isinstance(quantization, str):
        raise TypeError(f"quantization must be a string or None, got {quantization!r}")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"quantization_block must be a positive integer, got {block!r}")
    return (quantization, block)


class ErrorFeedback:
    """Carries each tensor's quantization error into its next all-reduce (error feedback), so
    that the error of a quantized average does not accumulate over steps (outer gradients in
    DiLoCo, say).

    ``ef.all_reduce(comm, tensor, key="w")`` adds the residual kept for ``key`` to ``tensor``,
    all-reduces it with this quantization, and keeps as the new residual what the tensor's own
    encoding lost (its input minus the decoded values it sends; the error of partial sums further
    along the ring belongs to no one peer). A call that raises keeps the old residual and leaves
    ``tensor`` as it was, so a retry is the same call. Residuals live as long as this object:
    one per key, of the tensor's shape and dtype.
    """

    def __init__(self, quantization: str = "int8", *, quantization_block: Optional[int] = None) -> None:
        self._quant = _quant(quantization, quantization_block)
        assert self._quant is not None
        self.quantization, self.quantization_block = quantization, quantization_block
        self._residuals: dict[str, Any] = {}

    def residual(self, key: str) -> Any:
        """The residual kept for ``key`` (None before its first all-reduce)."""
        return self._residuals.get(key)

    def all_reduce(self, comm: "Communicator", tensor: Any, *, key: str, op: str = "avg", tag: int = 0,
                   algorithm: Optional[str] = None) -> _native.ReduceInfo:
        """All-reduce ``tensor`` in place like :meth:`Communicator.all_reduce` with this
        quantization, its residual for ``key`` added first and the new one kept."""
        original = _copy(tensor)
        residual = self._residuals.get(key)
        if residual is not None:
            if residual.shape != tensor.shape or residual.dtype != tensor.dtype:
                raise ValueError(f"key {key!r} was a tensor of {residual.dtype} {tuple(residual.shape)}, now "
                                 f"{tensor.dtype} {tuple(tensor.shape)}")
            tensor += residual
        compensated, decoded = _copy(tensor), _copy(tensor)
        view, dtype = _byte_view(decoded)
        _native.quantize_bytes(view, dtype, self._quant)
        try:
            info = comm.all_reduce(tensor, op=op, tag=tag, algorithm=algorithm, quantization=self._quant[0],
                                   quantization_block=self._quant[1])
        except BaseException:
            tensor[...] = original
            raise
        compensated -= decoded
        self._residuals[key] = compensated
        return info


class Vote:
    """A :meth:`Communicator.peers_pending` vote cast with :meth:`Communicator.peers_pending_async`."""

    def __init__(self, native: _native.NativeVote) -> None:
        self._native = native

    def wait(self) -> bool:
        """The vote's answer (within ``SHOAL_TIMEOUT``), or its error, as ``peers_pending``'s."""
        return self._native.wait()

    def done(self) -> bool:
        """Whether the answer is in (then :meth:`wait` returns at once)."""
        return self._native.done()


class Work:
    """A collective started with :meth:`Communicator.all_reduce_async`."""

    def __init__(self, native: _native.NativeWork) -> None:
        self._native = native

    def wait(self, timeout: Optional[float] = None) -> _native.ReduceInfo:
        """Wait until it ended, at most ``timeout`` seconds (None: its bound); what it did, or
        its error. :class:`ShoalTimeoutError` if ``timeout`` passed first: it goes on, wait
        again."""
        return self._native.wait(timeout)

    def done(self) -> bool:
        """Whether it ended (then :meth:`wait` returns at once)."""
        return self._native.done()


def _same_dtype(out: str, inp: str) -> None:
    if out != inp:
        raise TypeError(f"out holds {out} and inp {inp}: both must be of one dtype")


def _check_root(root: Any) -> None:
    _check_rank("root", root)


_U64_MAX = 2**64 - 1


def _check_rank(name: str, rank: Any) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= _U64_MAX:
        raise ValueError(f"{name} must be a rank, got {rank!r}")


def _check_source(peer: Any) -> None:
    if peer is not None:
        _check_rank("peer", peer)


def _check_u64(name: str, value: Any, count: int = 1) -> None:
    """``value`` (and the ``count - 1`` numbers after it) must fit the 64 bits the wire carries:
    a bare ``OverflowError`` from the native layer would not say which argument."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U64_MAX - (count - 1):
        top = "2**64 - 1" if count == 1 else f"2**64 - {count}"
        raise ValueError(f"{name} must be an integer from 0 to {top}, got {value!r}")


def _check_tag(tag: Any, count: int = 1) -> None:
    _check_u64("tag", tag, count)
