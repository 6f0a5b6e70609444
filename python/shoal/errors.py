"""The exceptions shoal raises, as one tree under :class:`ShoalError`.

Each subclasses the builtin that fits, so ``except ConnectionError`` or ``except TimeoutError``
keep working for code that does not know shoal.
"""

from __future__ import annotations

__all__ = [
    "ShoalError",
    "UsageError",
    "PeerLostError",
    "MasterInterruptedError",
    "TooFewPeersError",
    "MasterUnreachableError",
    "KickedError",
    "CollectiveMismatchError",
    "ShoalTimeoutError",
    "ExcludedError",
    "AuthenticationError",
    "ProtocolError",
]


class ShoalError(Exception):
    """Base class of every shoal error."""


class UsageError(ShoalError, RuntimeError):
    """The API was used out of order, e.g. ``all_reduce`` before ``connect``. Deterministic.

    Where the peers made calls that can never complete together, ``calls`` names them: ours
    first, then the one it can never meet, each as ``([peer ids], name)`` (a tagged transfer's
    name is ``"send"`` or ``"recv"``). Empty for a usage error of this peer alone."""

    calls: list = []


class PeerLostError(ShoalError, ConnectionError):
    """A peer taking part in the operation was lost. Retryable: retry with the smaller world."""


class MasterInterruptedError(PeerLostError):
    """The connection to the master broke during a call that needs it (a vote, a sync); the peer
    dials the master again, which a master restarted with ``state_dir`` on the same address lets
    it rejoin. Retryable: call again."""


class TooFewPeersError(ShoalError):
    """Fewer peers than required were accepted before the deadline."""


class MasterUnreachableError(ShoalError, ConnectionError):
    """The master cannot be reached, or stopped answering."""


class KickedError(ShoalError):
    """The master expelled this peer (it was declared dead, or broke the protocol)."""


class CollectiveMismatchError(ShoalError):
    """Peers called different collectives: count, dtype, op, tag or kind differ."""


class ShoalTimeoutError(ShoalError, TimeoutError):
    """A blocking call did not finish within its bound."""


class ExcludedError(ShoalError):
    """A collective with a ``deadline`` ran without this peer: it had not called it by the
    deadline, and the others went on without it, by agreement. Nothing was done here (the tensor
    is as it was), and the peer is a member still: its next call meets the others' next. Not a
    failure to retry: the collective happened, among the ranks in ``included``. ``topology`` and
    ``sequence`` name it, as ``ReduceInfo`` does. ``ahead`` counts the later collectives this
    peer already heard the others run with a deadline: its next calls of that many are left out
    at once, so a late peer can skip ahead through them to meet the others where they are (as
    ``DiLoCo`` does). ``peers_pending`` is the collective's word on newcomers, as
    ``ReduceInfo.peers_pending`` gives it to the members that took part."""

    included: list = []
    topology: int = 0
    sequence: int = 0
    ahead: int = 0
    peers_pending: bool = False


class AuthenticationError(ShoalError):
    """The run's credentials were refused."""


class ProtocolError(ShoalError):
    """Another party sent bytes that break the protocol."""
