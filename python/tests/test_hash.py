"""shoal.hash_tensor: the content hash shared state is built on."""

from __future__ import annotations

import numpy as np
import pytest

import shoal


def test_equal_tensors_hash_equal_wherever_they_live():
    a = np.arange(1 << 20, dtype=np.float32)
    b = a.copy()
    # The same values at a misaligned address (a view into a byte buffer offset by 4).
    raw = np.zeros(a.nbytes + 4, np.uint8)
    c = raw[4:].view(np.float32)
    c[:] = a
    assert shoal.hash_tensor(a) == shoal.hash_tensor(b) == shoal.hash_tensor(c)
    assert len(shoal.hash_tensor(a)) == 64


def test_dtype_shape_and_every_byte_count():
    a = np.zeros((4, 6), np.float32)
    h = shoal.hash_tensor(a)
    assert h != shoal.hash_tensor(a.reshape(6, 4))
    assert h != shoal.hash_tensor(a.view(np.int32))
    big = np.zeros(3 << 20, np.uint8)  # hashed on several threads
    base = shoal.hash_tensor(big)
    big[-1] = 1
    assert shoal.hash_tensor(big) != base
    assert shoal.hash_tensor(np.array(3.0)) != shoal.hash_tensor(np.array([3.0]))


def test_every_dtype_and_torch_tensors_hash_like_numpy():
    torch = pytest.importorskip("torch")
    for dtype in ["uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
                  "float64"]:
        a = (np.arange(1000) % 7).astype(dtype)
        assert shoal.hash_tensor(a) == shoal.hash_tensor(torch.from_numpy(a.copy())), dtype
    bf = torch.arange(10, dtype=torch.bfloat16)
    assert shoal.hash_tensor(bf) == shoal.hash_tensor(bf.clone())
    assert shoal.hash_tensor(bf) != shoal.hash_tensor(bf.float())
    # Read-only arrays can be hashed: nothing is written.
    ro = np.ones(5, np.float32)
    ro.flags.writeable = False
    assert shoal.hash_tensor(ro) == shoal.hash_tensor(np.ones(5, np.float32))


def test_the_hash_is_blake3_over_the_documented_header_and_bytes():
    import blake3  # an independent implementation (requirements-dev.txt)

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    header = b"shoal tensor hash v1\0" + bytes([11]) + (2).to_bytes(4, "little")
    header += (3).to_bytes(8, "little") + (4).to_bytes(8, "little")
    assert shoal.hash_tensor(a) == blake3.blake3(header + a.tobytes()).hexdigest()


def test_unusable_tensors_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="not contiguous"):
        shoal.hash_tensor(np.zeros((4, 4), np.float32)[:, 1])
    with pytest.raises(TypeError, match="unsupported dtype"):
        shoal.hash_tensor(np.zeros(3, np.complex64))
