"""The API's edges in one process: bad arguments fail before any traffic with the right error,
blocking calls release the GIL, errors form the documented tree."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import run_peers

import shoal


@pytest.fixture
def solo(master):
    """A connected communicator alone in its run (world size 1)."""
    with shoal.Communicator(master.address) as comm:
        comm.connect(timeout=10)
        yield comm


def test_a_single_peer_is_accepted_at_once_and_reduces_alone(solo):
    assert (solo.world_size, solo.group_world_size, solo.rank) == (1, 1, 0)
    x = np.arange(5, dtype=np.float32)
    info = solo.all_reduce(x, op="avg")
    assert x.tolist() == [0, 1, 2, 3, 4] and info.world_size == 1 and info.tx_bytes == 0
    assert solo.peers_pending() is False
    vote = solo.peers_pending_async()  # cast ahead of a collective, answered after it
    solo.all_reduce(x)
    assert vote.wait() is False and vote.done() and vote.wait() is False
    solo.update_topology()  # a vote of one, admitting nobody


@pytest.mark.parametrize(
    "tensor, error, words",
    [
        (np.zeros((4, 4), np.float32)[:, 1], ValueError, "contiguous"),
        (np.zeros(4, np.complex64), TypeError, "unsupported dtype"),
        (np.zeros(4, bool), TypeError, "unsupported dtype"),
        (np.zeros(4, ">f4"), TypeError, "unsupported dtype"),
        ([1.0, 2.0], TypeError, "numpy array or a torch tensor"),
    ],
)
def test_bad_tensors_are_refused_before_any_traffic(solo, tensor, error, words):
    with pytest.raises(error, match=words):
        solo.all_reduce(tensor)


def test_read_only_and_misaligned_arrays_are_refused(solo):
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        solo.all_reduce(ro)
    raw = np.zeros(4 * 8 + 1, np.uint8)
    misaligned = raw[1:].view(np.float32)
    if not misaligned.flags.aligned:
        with pytest.raises(ValueError, match="aligned"):
            solo.all_reduce(misaligned)


def test_bad_options_name_the_problem(solo, master):
    with pytest.raises(ValueError, match="unknown op"):
        solo.all_reduce(np.zeros(2, np.float32), op="mean")
    with pytest.raises(ValueError, match="tag"):
        solo.all_reduce(np.zeros(2, np.float32), tag=-1)
    with pytest.raises(ValueError, match='unknown quantization "int9"'):
        solo.all_reduce(np.zeros(2, np.float32), quantization="int9")
    with pytest.raises(ValueError, match="quantization_block=4: expected 8 to 32768"):
        solo.all_reduce(np.zeros(2, np.float32), quantization="int8", quantization_block=4)
    with pytest.raises(ValueError, match="without a quantization"):
        solo.all_reduce(np.zeros(2, np.float32), quantization_block=64)
    with pytest.raises(ValueError, match="casts every element"):
        solo.all_reduce(np.zeros(2, np.float32), quantization="fp16", quantization_block=64)
    with pytest.raises(ValueError, match="applies to float tensors"):
        solo.all_reduce(np.zeros(2, np.int64), op="sum", quantization="int8")
    with pytest.raises(ValueError, match="connections"):
        shoal.Communicator(master.address, connections=0)
    with pytest.raises(ValueError, match="timeout"):
        shoal.Communicator(master.address, timeout=-1)


def test_integers_past_64_bits_name_their_argument(solo):
    """A tag, rank or revision of 2**64 once raised a bare OverflowError from the native layer,
    naming nothing; each is a ValueError naming the argument, raised before any traffic."""
    t = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match=r"tag must be an integer from 0 to 2\*\*64 - 1, got 18446744073709551616"):
        solo.all_reduce(t, tag=2**64)
    with pytest.raises(ValueError, match=r"tag must be an integer from 0 to 2\*\*64 - 2"):
        solo.all_reduce_many([t, t.copy()], tag=2**64 - 1)
    with pytest.raises(ValueError, match="tag"):
        solo.send(t, peer=0, tag=2**70)
    with pytest.raises(ValueError, match="root must be a rank"):
        solo.broadcast(t, root=2**64)
    with pytest.raises(ValueError, match=r"revision must be an integer from 0 to 2\*\*64 - 1"):
        shoal.SharedState({"w": np.zeros(2, np.float32)}, revision=2**64)
    state = shoal.SharedState({"w": np.zeros(2, np.float32)}, revision=0)
    state.revision = 2**64
    with pytest.raises(ValueError, match=r"state.revision must be an integer from 0 to 2\*\*64 - 1"):
        solo.sync_shared_state(state)
    assert solo.all_reduce(t, tag=2**64 - 1).world_size == 1, "the largest tag is a tag"


def test_an_empty_tensor_reduces_like_any_other(solo):
    """A zero-element collective is a collective (as in torch.distributed): it works, rather than
    failing for a misaligned address numpy gave an empty array."""
    for dtype in (np.float32, np.float64, np.int16):
        info = solo.all_reduce(np.zeros(0, dtype), op="sum")
        assert info.world_size == 1


def test_tensors_of_every_shape_reduce_across_peers_and_the_unfit_are_refused(master, tmp_path):
    grid = (np.arange(15).reshape(3, 5) * 3).tolist()
    for r in run_peers(master, tmp_path, "shapes", 2):
        assert r == {"world": 2, "after": 2.0, "grid": grid, "scalar": 1.5, "block": [[2.0] * 3] * 2,
                     "refused": ["ValueError", "TypeError"]}, r


def test_bools_are_not_numbers_here(solo, master):
    """``True`` is an int to Python; as a tag or a duration it is a mistake, refused by name."""
    with pytest.raises(ValueError, match="tag"):
        solo.all_reduce(np.zeros(2, np.float32), tag=True)
    with pytest.raises(TypeError, match="timeout"):
        shoal.Communicator(master.address, timeout=True)
    with pytest.raises(TypeError, match="heartbeat_timeout"):
        shoal.Master("127.0.0.1:0", heartbeat_timeout=True)
    with pytest.raises(TypeError, match="timeout"):
        shoal.Communicator(master.address).connect(timeout=True)


def test_over_long_and_non_ascii_strings_are_refused_and_nothing_breaks(solo, master):
    """A name over the limit in multi-byte characters once panicked (a byte slice inside a
    character), poisoned a lock, and made every later call, close() too, raise PanicException;
    an over-long advertised address did the same through the encoder."""
    t = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="tensor name"):
        solo.sync_shared_state(shoal.SharedState({"€" * 100: t}, revision=0))
    # The communicator still works, and a proper name syncs.
    solo.all_reduce(t)
    solo.sync_shared_state(shoal.SharedState({"poids €": t}, revision=0))
    with pytest.raises(ValueError, match="advertise_addr"):
        shoal.Communicator(master.address, advertise_addr="a" * 300)
    with pytest.raises(ValueError, match="advertise_addr"):
        shoal.Communicator(master.address, advertise_addr="é" * 200)


def test_calls_before_connect_are_usage_errors(master):
    comm = shoal.Communicator(master.address)
    for call in (lambda: comm.all_reduce(np.zeros(2)), comm.peers_pending, comm.update_topology, lambda: comm.rank):
        with pytest.raises(shoal.UsageError, match="connect"):
            call()
    comm.connect(timeout=10)
    with pytest.raises(shoal.UsageError, match="already connected"):
        comm.connect(timeout=10)
    comm.close()
    comm.close()  # idempotent
    with pytest.raises(shoal.UsageError):
        comm.all_reduce(np.zeros(2, np.float32))


def test_unreachable_master_raises_within_the_timeout():
    comm = shoal.Communicator("127.0.0.1:1")
    with pytest.raises(shoal.MasterUnreachableError) as info:
        comm.connect(timeout=3)
    assert isinstance(info.value, ConnectionError) and isinstance(info.value, shoal.ShoalError)


def test_errors_form_a_tree_under_shoal_error():
    for name in ["PeerLostError", "MasterUnreachableError", "ShoalTimeoutError", "CollectiveMismatchError",
                 "TooFewPeersError", "AuthenticationError", "ProtocolError", "UsageError", "KickedError"]:
        assert issubclass(getattr(shoal, name), shoal.ShoalError), name
    assert issubclass(shoal.PeerLostError, ConnectionError)
    assert issubclass(shoal.ShoalTimeoutError, TimeoutError)


def test_blocking_calls_release_the_gil(master):
    # Two communicators in two threads of one process: the second can only reach all_reduce
    # while the first is blocked in it if the first released the GIL.
    results = {}

    def peer(i):
        with shoal.Communicator(master.address) as comm:
            comm.connect(timeout=20)
            while comm.group_world_size < 2:
                if comm.peers_pending():
                    comm.update_topology()
            x = np.full(1 << 20, i + 1.0, np.float32)
            comm.all_reduce(x, op="sum")
            results[i] = float(x[0])

    first = threading.Thread(target=peer, args=(0,))
    first.start()
    second = threading.Thread(target=peer, args=(1,))
    second.start()
    first.join(30)
    second.join(30)
    assert results == {0: 3.0, 1: 3.0}


def test_master_context_manager_and_address(master):
    assert master.running and master.address.startswith("127.0.0.1:")
    m = shoal.Master("127.0.0.1:0")
    m.start()
    with pytest.raises(shoal.UsageError, match="already running"):
        m.start()
    m.stop()
    m.stop()
    assert not m.running


def test_malformed_environment_is_named(master, monkeypatch):
    monkeypatch.setenv("SHOAL_CONNECTIONS", "many")
    with pytest.raises(ValueError, match="SHOAL_CONNECTIONS"):
        shoal.Communicator(master.address)
    monkeypatch.setenv("SHOAL_CONNECTIONS", "2")
    monkeypatch.setenv("SHOAL_ALGO", "tree")
    with pytest.raises(ValueError, match="SHOAL_ALGO"):
        shoal.Communicator(master.address)


def test_connect_waits_for_the_minimum_world_size(master, tmp_path):
    results = run_peers(master, tmp_path, "min_world", 3, delay=0.3)
    assert all((r["world"], r["sum"]) == (3, 3.0) for r in results), results


def test_too_few_peers_ends_connect_at_its_timeout_and_leaves_the_run(master):
    comm = shoal.Communicator(master.address)
    started = time.monotonic()
    with pytest.raises(shoal.TooFewPeersError, match="only 1 of the 2 peers"):
        comm.connect(timeout=1.0, min_world_size=2)
    assert time.monotonic() - started < 5
    with pytest.raises(shoal.UsageError):
        comm.all_reduce(np.ones(4, np.float32))
    # It left: a newcomer is the run's first peer again, admitted without a vote.
    with shoal.Communicator(master.address) as other:
        other.connect(timeout=10)
        assert other.world_size == 1
    with pytest.raises(ValueError, match="min_world_size"):
        shoal.Communicator(master.address).connect(min_world_size=0)
