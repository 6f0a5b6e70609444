"""shoal: fault-tolerant collective communications for training across the internet.

A :class:`Master` coordinates membership; each training process opens a
:class:`Communicator`, is admitted by the accepted peers' vote, and all-reduces numpy arrays
and torch CPU tensors in place with the other peers of its group.
"""

from __future__ import annotations

from . import _native, errors
from ._communicator import Communicator, ErrorFeedback, Vote, Work
from ._native import Master, ReduceInfo
from ._state import CatchUpInfo, CatchUpProgress, SharedState, SyncInfo
from ._tensors import hash_tensor
from .errors import *  # noqa: F403 - the exception tree, listed in errors.__all__

__version__: str = _native.__version__
DTYPES: tuple[str, ...] = tuple(_native.DTYPES)
OPS: tuple[str, ...] = tuple(_native.OPS)

__all__ = ["Master", "Communicator", "ErrorFeedback", "Vote", "Work", "ReduceInfo", "SharedState", "SyncInfo",
           "CatchUpInfo", "CatchUpProgress", "hash_tensor", "DTYPES", "OPS", *errors.__all__]
