"""shoal for PyTorch: importing this module registers the ``torch.distributed`` backend
``shoal`` (``dist.init_process_group("shoal")``; ``_c10d.py``), and it holds the recipes over a
:class:`shoal.Communicator`: ``Elastic``, a DDP step that survives churn; a DDP communication
hook; DiLoCo, synchronous and asynchronous.

``DDPHook`` averages a ``DistributedDataParallel`` model's gradient buckets across the peers
through shoal, each bucket's all-reduce starting as soon as backward fills it, so it overlaps the
rest of the backward pass; ``Elastic`` uses it over the run's live members. DDP on the ``shoal``
backend needs no hook: the hook is for a communicator of your own.

DiLoCo (Douillard et al., 2023): every peer takes ``inner_steps`` steps of its own optimizer on its
own data, then the peers average their *pseudo-gradients* (how far each moved from the shared
anchor) and an outer optimizer (SGD with Nesterov momentum) moves the anchor by the average. Only
the outer step communicates: one all-reduce of the model's size every ``inner_steps`` steps.

The anchor, the outer momentum and the outer step count are a :class:`shoal.SharedState`, synced
when peers join: the outer step that admits them syncs it with them, so a newcomer starts from the
run's anchor. Peers stay bit-identical whoever dies: an outer step interrupted by a lost peer
raises :class:`shoal.PeerLostError` having changed nothing, and is simply called again.

``AsyncDiLoCo`` overlaps the outer all-reduce with the next inner steps: the average of outer step
``k`` is applied at outer step ``k + 1`` (one step late), which hides the communication behind
compute over slow links.
"""

from __future__ import annotations

import atexit
import queue
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from ._c10d import ERRORS, Options, ShoalBackend, register, run_communicator
from ._state import SharedState
from .errors import ExcludedError, PeerLostError, ShoalError, UsageError

__all__ = ["ERRORS", "Options", "ShoalBackend", "run_communicator", "Elastic", "DDPHook", "DiLoCo", "AsyncDiLoCo"]

if TYPE_CHECKING:
    import torch

    from ._communicator import Communicator, ErrorFeedback, Vote, Work


def _flatten(params: "list[torch.Tensor]") -> "torch.Tensor":
    """One contiguous buffer holding ``params``, which become views into it: the model reads and
    writes it where it is, so taking its pseudo-gradient or setting it to the anchor is one pass
    over one buffer, not a gather and a scatter."""
    import torch

    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset:offset + n].view_as(p)
        offset += n
    return flat


class DDPHook:
    """A DDP communication hook that averages every gradient bucket across ``comm``'s group:
    ``hook = DDPHook(comm); hook.register(ddp)``.

    A bucket's average that fails (a peer was lost) cannot fail DDP's backward in a way a loop can
    retry, so the hook hands DDP the bucket as it is and remembers the error: call :meth:`check`
    after ``backward()`` and before ``optimizer.step()``. It raises that error (a
    :class:`shoal.PeerLostError`: the gradients then mix averaged and local values), and the loop
    redoes the step: ``zero_grad()``, forward, backward, ``check()`` again.
    """

    def __init__(self, comm: "Communicator", *, tag: int = 1 << 41) -> None:
        self.comm, self.tag = comm, tag
        self._failed: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._works: "queue.Queue[Optional[tuple[Work, Any, torch.Tensor]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._complete, name="shoal-ddp-hook", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def close(self) -> None:
        """Stops the thread that completes the buckets, once the averages handed to it ended.
        Runs at exit too: a thread still inside torch while the interpreter tears torch down
        aborts the process ("terminate called without an active exception")."""
        atexit.unregister(self.close)
        if self._thread.is_alive():
            self._works.put(None)
            self._thread.join()

    def register(self, ddp: Any) -> None:
        """Makes this the communication hook of ``ddp``, a ``DistributedDataParallel`` model."""
        ddp.register_comm_hook(None, self._hook)

    # Unannotated: DDP checks a hook's annotations, and this module's are strings.
    def _hook(self, state, bucket):  # type: ignore[no-untyped-def]
        import torch

        buffer = bucket.buffer()
        future: "torch.futures.Future[torch.Tensor]" = torch.futures.Future()
        try:
            work = self.comm.all_reduce_async(buffer, op="avg", tag=self.tag + bucket.index())
        except ShoalError as e:
            self._fail(e)
            future.set_result(buffer)
            return future
        self._works.put((work, future, buffer))
        return future

    def _complete(self) -> None:
        while (item := self._works.get()) is not None:
            work, future, buffer = item
            try:
                work.wait()
            except ShoalError as e:
                self._fail(e)
            future.set_result(buffer)

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self._failed is None:
                self._failed = e

    def check(self) -> None:
        """Raises the error of a bucket whose average failed since the last call, if one did."""
        with self._lock:
            failed, self._failed = self._failed, None
        if failed is not None:
            raise failed


class Elastic:
    """Turns a DDP training step into one that survives lost peers and admits newcomers:
    ``elastic = Elastic(ddp, optimizer)``, then ``loss = elastic.step(lambda: train(batch))``
    where ``train`` runs forward, backward and ``optimizer.step()`` once.

    The run is the one behind the default ``shoal`` process group (:func:`run_communicator`),
    which may span several ``torchrun``s and processes started later. DDP's gradient buckets are
    averaged over the run's live members (a :class:`DDPHook`, so no rank counts that is gone).
    A step during which a member was lost raises :class:`shoal.PeerLostError` from
    ``optimizer.step()`` before it changes anything (a step pre-hook): :meth:`step` zeroes the
    gradients and runs it again in the re-formed run, where every member agreed the same
    buckets failed. Every ``admit_every`` steps the members vote on the peers waiting to join,
    admit them and sync the model's parameters and buffers, the optimizer's state and the step
    count with them (a :class:`shoal.SharedState`): a newcomer's ``Elastic`` (made the same way
    after ``init_process_group``) takes that state up and trains on from the run's step.

    The optimizer's state is made at once (one step of zero gradients whose parameter change
    is undone), so that newcomers receive it. Learning-rate schedules should follow
    :attr:`steps`, which every member shares.
    """

    def __init__(self, ddp: Any, optimizer: "torch.optim.Optimizer", *, admit_every: int = 10,
                 comm: "Optional[Communicator]" = None, tag: int = 1 << 41) -> None:
        import torch

        if admit_every < 1:
            raise ValueError(f"admit_every must be at least 1, got {admit_every}")
        self.comm = comm if comm is not None else run_communicator()
        self.ddp, self.optimizer, self.admit_every = ddp, optimizer, admit_every
        _prime(optimizer)
        # DDP lays its buckets out in reverse order, then after the first backward in the order
        # the gradients came: a newcomer's first buckets would not be the members' (the same
        # bytes, other parameters). Every member lays them out by the parameters' order at once.
        reducer = getattr(ddp, "reducer", None)
        if reducer is not None:
            reducer._push_all_rebuilt_params()
        self.hook = DDPHook(self.comm, tag=tag)
        self.hook.register(ddp)
        optimizer.register_step_pre_hook(lambda *_: self.hook.check())
        self._steps = torch.zeros(1, dtype=torch.int64)
        module = getattr(ddp, "module", ddp)
        tensors: "dict[str, torch.Tensor]" = {"steps": self._steps}
        tensors.update({f"param.{n}": p.data for n, p in module.named_parameters()})
        tensors.update({f"buffer.{n}": b for n, b in module.named_buffers()})
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for i, p in enumerate(params):
            for key, value in optimizer.state[p].items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer.{i}.{key}"] = value
        self.state = SharedState(tensors)
        self._admitting = False
        # The step whose admission vote ran (or that the sync a newcomer joined by ended at).
        self._voted: Optional[int] = None
        self.join()

    @property
    def steps(self) -> int:
        """Steps the run has taken (a newcomer receives the count)."""
        return int(self._steps[0])

    def join(self) -> None:
        """Takes up the run's state: every founder, and each newcomer (the other half of the
        sync of the step that admitted it). Retries a lost peer itself."""
        _until_done(lambda: self.comm.sync_shared_state(self.state))
        self._voted = self.steps

    def step(self, train: "Callable[[], Any]") -> Any:
        """Runs ``train()`` (forward, backward, ``optimizer.step()``) until a try ends without a
        lost peer, admitting the waiting peers first every ``admit_every`` steps; returns what
        the try that counted returned."""
        while True:
            try:
                if self.steps % self.admit_every == 0 and self._voted != self.steps:
                    self._admit()
                result = train()
            except PeerLostError:
                self.optimizer.zero_grad(set_to_none=True)
                continue
            self._steps += 1
            return result

    def _admit(self) -> None:
        """Admits the peers waiting to join, if any, and syncs the state with them. A lost peer
        raises having changed nothing but its progress: the retry goes on where it stopped."""
        if not self._admitting:
            if not self.comm.peers_pending():
                self._voted = self.steps
                return
            self.comm.update_topology()
            self._admitting = True
            self.state.revision += 1
        self.comm.sync_shared_state(self.state)
        self._admitting = False
        self._voted = self.steps


def _prime(optimizer: "torch.optim.Optimizer") -> None:
    """Makes ``optimizer``'s state (momentum buffers, moments, step counts) by one step of zero
    gradients, then puts the parameters back as they were."""
    import torch

    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if all(optimizer.state.get(p) for p in params):
        return
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    with torch.no_grad():
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for p, s, g in zip(params, saved, grads):
            p.copy_(s)
            p.grad = g


def _until_done(call: "Callable[[], Any]") -> Any:
    """Calls ``call`` until it does not raise :class:`shoal.PeerLostError`."""
    while True:
        try:
            return call()
        except PeerLostError:
            continue


class DiLoCo:
    """DiLoCo over ``comm`` for ``params`` (a model's parameters, CPU tensors of one float dtype).

    Call :meth:`step` after every inner optimizer step; every ``inner_steps`` calls it runs the
    outer step (an all-reduce of the pseudo-gradients, the outer update) and returns True.
    ``quantization`` ("fp16", "bf16", "int8", "int4") compresses the all-reduce, with error
    feedback carrying each peer's quantization error into its next outer step.

    The parameters become views into one flat buffer (``p.data`` is replaced, the parameter
    objects stay, so an optimizer made before keeps working; a view of a parameter's old storage
    taken before does not follow).

    **Admission.** An outer step first takes the answer of the ``peers_pending`` vote the last
    one cast ahead (``peers_pending_async``: one answer everywhere, its round trip overlapping
    the inner steps). If peers wait to join, it admits them (``update_topology()``) and syncs
    the anchor, the outer momentum and the outer step count with them instead of averaging:
    the newcomers' :meth:`join` is the other half of that sync, and everyone then takes
    ``inner_steps`` inner steps (the accepted peers keep theirs, averaged at the next outer
    step) before averaging together. Outer steps without newcomers move only the all-reduce's
    bytes: the anchor is identical everywhere by construction (every peer applies the same
    bit-identical average), so it is not hashed again.

    **Stragglers.** With ``deadline`` (seconds), the outer all-reduce waits for no peer longer
    (``Communicator.all_reduce(deadline=..., min_participants=...)``): the peers that reach the
    outer step in time average among themselves, and a late peer's work is not lost. The first
    of them sends the average to each peer left out (and goes on without waiting for it to
    arrive), which applies it to its anchor (so every anchor stays identical) and keeps its own
    pseudo-gradient: the model moves with the anchor but stays that far from it. It then skips
    ahead through the outer steps the others ran meanwhile (``ExcludedError.ahead``), applying
    each average, and meets them at their next one with that pseudo-gradient, where it is
    averaged in (AsyncDiLoCo starts it there and goes on computing). No admission vote holds the
    others for it either: each outer all-reduce's decision says whether peers wait to join
    (``ReduceInfo.peers_pending``), the same word to every peer, and they admit them at the next
    outer step. :meth:`finish` takes one more outer step, waiting for every peer, so a late
    peer's last work counts and one waiting at an outer step the others will not take meets
    them there: loop on :attr:`outer_steps` (the run's count), not on a count of your own.
    ``last_included`` names the ranks the last outer all-reduce ran among.
    """

    def __init__(
        self,
        comm: "Communicator",
        params: "Iterable[torch.Tensor]",
        *,
        inner_steps: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        quantization: Optional[str] = None,
        tag: int = 1 << 40,
        deadline: Optional[float] = None,
        min_participants: Optional[int] = None,
    ) -> None:
        import torch

        self.params = [p for p in params]
        if not self.params:
            raise ValueError("DiLoCo needs at least one parameter")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise TypeError(f"DiLoCo needs parameters of one float dtype, got {sorted(map(str, dtypes))}")
        if any(p.device.type != "cpu" for p in self.params):
            raise ValueError("DiLoCo keeps CPU parameters so far: move the model to the CPU")
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be at least 1, got {inner_steps}")
        if deadline is not None and quantization is not None:
            raise ValueError("DiLoCo does not quantize an outer step with a deadline yet: pass one of the two")
        self.comm, self.inner_steps, self.tag = comm, inner_steps, tag
        self.deadline, self.min_participants = deadline, min_participants
        self.last_included: list = []
        # Averages sent to peers left out of an outer all-reduce, in flight: (work, the copy it
        # sends). Waited for only at finish(): a peer left out takes one once it reaches that
        # outer step, and the others go on meanwhile.
        self._sends: list = []
        # With a deadline: whether the last outer all-reduce's decision said peers wait to join.
        self._pending_said = False
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.flat = _flatten(self.params)
        self.anchor = self.flat.clone()
        self.momentum = torch.zeros_like(self.anchor)
        self._outer = torch.zeros(1, dtype=torch.int64)
        # Where the inner steps since the last outer step began: the anchor itself here;
        # AsyncDiLoCo's is the model as it was when the all-reduce in flight started.
        self.origin = self.anchor
        # What the outer all-reduce moves: the pseudo-gradient, and with a deadline one more
        # element, 1 where a peer's finish() sent it (every peer then knows the run ended).
        n = self.anchor.numel()
        self._wire = torch.zeros(n + (deadline is not None), dtype=self.anchor.dtype)
        self._delta = self._wire[:n]
        self._finished = False
        # Its revision counts the syncs (joins and admissions), not the outer steps.
        self.state = SharedState({"anchor": self.anchor, "momentum": self.momentum, "outer": self._outer})
        self.inner = 0
        self._admitting = False
        # The next outer step's peers_pending vote, cast ahead (_vote_ahead).
        self._vote: "Optional[Vote]" = None
        self._feedback: "Optional[ErrorFeedback]" = None
        if quantization is not None:
            from ._communicator import ErrorFeedback

            self._feedback = ErrorFeedback(quantization)

    @property
    def outer_steps(self) -> int:
        """Outer steps the run has taken (a newcomer receives the count)."""
        return int(self._outer[0])

    def join(self) -> None:
        """Takes up the run's anchor and sets the model to it: call once after ``connect()``,
        every peer, founders and newcomers alike (a newcomer's is the other half of the sync in
        the accepted peers' outer step that admitted it). Raises :class:`shoal.PeerLostError`
        having changed nothing: call it again."""
        self.comm.sync_shared_state(self.state)
        self.flat.copy_(self.anchor)
        if self.origin is not self.anchor:
            self.origin.copy_(self.anchor)
        self.inner = 0
        self._vote_ahead()

    def step(self) -> bool:
        """Counts an inner step; every ``inner_steps``-th runs the outer step: True if it
        averaged, False if it admitted newcomers instead."""
        self.inner += 1
        if self.inner < self.inner_steps:
            return False
        return self.outer_step()

    def finish(self) -> None:
        """Ends training: the model takes up the anchor. With a deadline, first one more outer
        step, which waits for every peer: a late peer's work since it last took part is averaged
        in (the average alone moves the anchor, without momentum), and a peer waiting in an outer
        step the others will not take meets it there (it ends theirs too: loop on
        :attr:`outer_steps`, the run's count, not on your own). Raises
        :class:`shoal.PeerLostError`: call it again."""
        import torch

        self._vote_done()
        if self.deadline is not None and not self._finished:
            torch.sub(self.anchor, self.flat, out=self._delta)
            self._average(ending=True)
        self._settle()
        self.flat.copy_(self.anchor)

    def _settle(self) -> None:
        """Waits for the averages sent to peers left out; with a deadline, then for every peer
        to finish: one that left at once would replace the topology under the transfers of the
        averages a late peer has yet to take."""
        self._sends_done()
        if self.deadline is not None:
            self.comm.barrier(tag=self.tag + 2)

    def _admit(self) -> bool:
        """Admits the peers waiting to join, if any, and syncs the state with them (True).
        Raises :class:`shoal.PeerLostError` having changed nothing but its own progress: the
        retry goes on where it stopped, as every accepted peer's does (the vote is agreed)."""
        if not self._admitting:
            if not self._peers_pending():
                return False
            self.comm.update_topology()
            self._admitting = True
            self.state.revision += 1
        self.comm.sync_shared_state(self.state)
        self._admitting = False
        self._pending_said = False
        self.inner = 0
        self._vote_ahead()
        return True

    def _vote_ahead(self) -> None:
        """Casts the next outer step's peers_pending vote now (every peer at the same point of
        its calls: after the same sync or outer step), so that its round trip to the master
        overlaps the inner steps. With a deadline none: the outer all-reduce's decision said."""
        if self.deadline is None:
            self._vote = self.comm.peers_pending_async()

    def _peers_pending(self) -> bool:
        """The answer of the vote cast ahead, or of one cast now where none was; with a
        deadline, what the last outer all-reduce's decision said."""
        if self.deadline is not None:
            return self._pending_said
        vote, self._vote = self._vote, None
        return vote.wait() if vote is not None else self.comm.peers_pending()

    def _vote_done(self) -> None:
        """Waits for the vote cast ahead, whose answer nobody needs any more."""
        vote, self._vote = self._vote, None
        if vote is not None:
            vote.wait()

    def _reduce(self, delta: "torch.Tensor", everyone: bool = False) -> None:
        """All-reduces the pseudo-gradients (with a deadline, for ``everyone``: waiting for every
        peer). Raises :class:`shoal.ExcludedError` (``delta`` untouched) where this peer reached
        the outer step past the deadline."""
        self._sends_landed()
        if self._feedback is not None:
            info = self._feedback.all_reduce(self.comm, delta, key="diloco", op="avg", tag=self.tag)
        else:
            info = self.comm.all_reduce(delta, op="avg", tag=self.tag, **self._cutoff(everyone))
        self._send_average(info, delta)

    def _cutoff(self, everyone: bool = False) -> dict:
        """The outer all-reduce's deadline arguments, if it has one (waiting for ``everyone``)."""
        if self.deadline is None:
            return {}
        least = self.comm.group_world_size if everyone else self.min_participants
        return {"deadline": self.deadline, "min_participants": least}

    def _send_average(self, info: Any, average: "torch.Tensor") -> None:
        """After an outer all-reduce that left peers out: the first peer it ran among sends each
        of them the average (a copy, in flight until the peer takes it)."""
        if self.deadline is None:
            return  # nobody is left out
        self.last_included = list(info.included)
        self._pending_said = bool(info.peers_pending)
        left_out = [r for r in range(self.comm.group_world_size) if r not in info.included]
        if left_out and self.comm.rank == info.included[0]:
            copy = average.clone()
            for rank in left_out:
                self._sends.append((self.comm.isend(copy, peer=rank, tag=self.tag + 1), copy))

    def _sends_done(self) -> None:
        """Waits for the averages sent to peers left out. One lost meanwhile needs none."""
        self._forget(self._sends)
        self._sends = []

    def _sends_landed(self) -> None:
        """Forgets the averages sent that arrived (or whose peer was lost), waiting for none."""
        still: list = []
        landed: list = []
        for send in self._sends:
            (landed if send[0].done() else still).append(send)
        self._sends = still
        self._forget(landed)

    @staticmethod
    def _forget(sends: list) -> None:
        for work, _ in sends:
            try:
                work.wait()
            except PeerLostError:
                pass

    def _average_missed(self, e: ExcludedError, into: "torch.Tensor") -> None:
        """This peer was left out of an outer all-reduce: receives the average the others
        applied into ``into``, from the first of them."""
        if not e.included:
            raise PeerLostError(f"the peers outer step {self.outer_steps} ran among left the topology before this "
                                "peer took their average")
        self.last_included = list(e.included)
        self._pending_said = e.peers_pending
        self.comm.recv(into, peer=e.included[0], tag=self.tag + 1)

    def _skip_ahead(self, e: ExcludedError, kept: "torch.Tensor") -> Any:
        """This peer was left out (``e``) of an outer all-reduce of ``kept`` (its pseudo-gradient,
        untouched, perhaps with DiLoCo's end flag; the model's distance from ``origin`` leaves it
        out). Applies the average the others did, then skips ahead through the outer steps they
        ran since (``e.ahead``, which leave this peer out at once), applying theirs too, and
        stops where peers wait to join (the others admit them next) or the run ended. Then the
        model takes ``kept`` up as its distance from the anchor, and it returns None. Or returns
        the ``ReduceInfo`` of an outer all-reduce of ``kept`` that ran with this peer after all
        (its topology replaced meanwhile): ``kept`` then holds that average, for the caller to
        apply. Raises as ``outer_step`` does, the model holding ``kept`` as above (the retry
        averages it in)."""
        import torch

        n = self.anchor.numel()
        average, progress = torch.empty_like(kept), torch.empty_like(self.anchor)
        while True:
            try:
                self._average_missed(e, average)
            except BaseException:
                self.flat.sub_(kept[:n])
                raise
            torch.sub(self.origin, self.flat, out=progress)
            ends = self._ends(average)
            self._apply(average[:n], ends)
            torch.sub(self.anchor, progress, out=self.flat)
            if self.origin is not self.anchor:
                self.origin.copy_(self.anchor)
            self._finished |= ends
            if not e.ahead or e.peers_pending or self._finished:
                self.flat.sub_(kept[:n])
                return None
            try:
                info = self.comm.all_reduce(kept, op="avg", tag=self.tag, **self._cutoff())
            except ExcludedError as later:
                e = later
                self._outer += 1
                continue
            except BaseException:
                self.flat.sub_(kept[:n])
                raise
            self._outer += 1
            return info

    def _apply(self, delta: "torch.Tensor", ends: bool = False) -> None:
        """The outer optimizer on the anchor: SGD with (Nesterov) momentum. The end's outer step
        (``ends``: a finish()'s, which averages in the late peers' work since they last took part,
        and mostly zeros) moves it by the average alone: a momentum step there would repeat what
        the earlier steps did once more, with nothing new behind it (on the digits run, a loss
        0.05 higher at the end)."""
        import torch

        if ends:
            self.anchor.add_(delta, alpha=-self.outer_lr)
            return
        torch.add(delta, self.momentum, alpha=self.outer_momentum, out=self.momentum)
        if self.nesterov:
            self.anchor.add_(delta, alpha=-self.outer_lr)
            self.anchor.add_(self.momentum, alpha=-self.outer_lr * self.outer_momentum)
        else:
            self.anchor.add_(self.momentum, alpha=-self.outer_lr)

    def outer_step(self) -> bool:
        """Admits newcomers (False), or averages the pseudo-gradients, moves the anchor and
        restarts the inner steps from it (True). Raises :class:`shoal.PeerLostError` having
        changed nothing but the averages of outer steps this peer was left out of, applied (the
        model keeps its inner progress): call it again."""
        import torch

        if self._finished:
            raise UsageError("the run finished (a peer called finish()): loop on outer_steps, the run's count")
        torch.sub(self.anchor, self.flat, out=self._delta)
        if self._admit():
            return False
        self._average(ending=False)
        self.inner = 0
        self._vote_ahead()
        return True

    def _average(self, ending: bool) -> None:
        """One outer step of the pseudo-gradient in ``_delta``: all-reduces it and applies the
        average. Left out (the others averaged without us, past the deadline), it applies theirs
        and skips ahead through those they ran since, then meets them at their next outer step
        with the same pseudo-gradient, where it is averaged in: they are computing it meanwhile.
        It stops short of that where peers wait to join (the others admit them first) or the run
        ended; the pseudo-gradient then stays the model's distance from the anchor, for the next
        outer step (or the end's). ``ending``: finish()'s, which waits for every peer."""
        wire = self._wire
        while True:
            if self.deadline is not None:
                wire[-1] = float(ending)
            try:
                self._reduce(wire, everyone=ending)
                self._outer += 1
            except ExcludedError as e:
                self._outer += 1
                self.flat.copy_(self.anchor)
                info = self._skip_ahead(e, wire)
                if info is None:
                    if self._pending_said or self._finished:
                        return
                    continue
                self._send_average(info, wire)
            break
        ends = self._ends(wire)
        self._finished |= ends
        self._apply(self._delta, ends)
        self.flat.copy_(self.anchor)

    def _ends(self, average: "torch.Tensor") -> bool:
        """Whether an outer all-reduce's ``average`` came from a peer's finish()."""
        return self.deadline is not None and average.numel() > self.anchor.numel() and float(average[-1]) > 0


class AsyncDiLoCo(DiLoCo):
    """DiLoCo whose outer all-reduce overlaps the next ``inner_steps`` inner steps: outer step
    ``k`` starts the all-reduce of its pseudo-gradients and applies the average that outer step
    ``k - 1`` started (one step late). The anchor stays identical on every peer. With the delay,
    a lower outer momentum converges where DiLoCo's usual 0.9 oscillates: on the tests'
    regression (3 peers, 5 inner steps) 0.5 reaches a loss of 0.01 in 12 outer steps, 0.9 is
    still at 31. Call :meth:`finish` after the last step to apply the all-reduce in flight."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        import torch

        super().__init__(*args, **kwargs)
        if self._feedback is not None:
            raise ValueError("AsyncDiLoCo does not quantize yet: error feedback needs the result at once")
        self._pending: "Optional[tuple[Work, torch.Tensor]]" = None
        self.origin = self.anchor.clone()
        # The all-reduce in flight holds _delta; landing it takes the progress since in _spare.
        self._spare = torch.empty_like(self._delta)

    def _land(self) -> None:
        """Waits for the all-reduce in flight, if any, and applies its average; the model keeps
        the progress made since it started (averaged next). Raises the error of the all-reduce
        (:class:`shoal.PeerLostError`, :class:`shoal.ShoalTimeoutError`, ...) if it failed,
        having started it again (its buffer is as before): the caller's retry waits for that
        one, not for the failed one, whose error would only come back as a usage error."""
        import torch

        if self._pending is None:
            return
        work, previous = self._pending
        try:
            info = work.wait()
        except ExcludedError as e:
            # Late: the others averaged without us. ``previous`` (our pseudo-gradient,
            # untouched) joins the model's distance from the anchor, to be averaged in at the
            # next outer step.
            self._pending = None
            ran = self._skip_ahead(e, previous)
            if ran is None:
                return
            info = ran
        except ShoalError:
            try:
                self._pending = (self._reduce_async(previous), previous)
            except ShoalError:
                self._pending = None  # out of the run: nothing left to wait for
            raise
        self._pending = None
        self._send_average(info, previous)
        ends = self._ends(previous)
        self._finished |= ends
        progress = torch.sub(self.origin, self.flat, out=self._spare)
        self._apply(previous[: self.anchor.numel()], ends)
        torch.sub(self.anchor, progress, out=self.flat)
        self.origin.copy_(self.anchor)

    def outer_step(self) -> bool:
        import torch

        self._land()
        if self._finished:
            raise UsageError("the run finished (a peer called finish()): loop on outer_steps, the run's count")
        # After the late update: newcomers receive the anchor every peer holds now.
        if self._admit():
            return False
        torch.sub(self.origin, self.flat, out=self._delta)
        if self.deadline is not None:
            self._wire[-1] = 0.0
        self._pending = (self._reduce_async(self._wire), self._wire)
        self._vote_ahead()
        # That progress is being averaged: the next pseudo-gradient counts from here.
        self.origin.copy_(self.flat)
        self._outer += 1
        self.inner = 0
        return True

    def _reduce_async(self, delta: "torch.Tensor") -> "Work":
        """Starts the outer all-reduce of ``delta``."""
        self._sends_landed()
        return self.comm.all_reduce_async(delta, op="avg", tag=self.tag, **self._cutoff())

    def finish(self) -> None:
        """Ends training: waits for the all-reduce in flight, applies it, and the model takes up
        the anchor; with a deadline, after one more outer step as :meth:`DiLoCo.finish` runs.
        Raises :class:`shoal.PeerLostError` as :meth:`outer_step` does: call it again."""
        import torch

        self._land()
        self._vote_done()
        if self.deadline is not None and not self._finished:
            torch.sub(self.origin, self.flat, out=self._delta)
            self._average(ending=True)
        self._settle()
        self.flat.copy_(self.anchor)



register()
