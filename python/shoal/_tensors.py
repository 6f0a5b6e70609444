"""Tensors at the boundary: which dtypes shoal takes, the zero-copy byte view every call passes to
the native module (checked for dtype, device, contiguity and alignment first), and the content
hash shared state is built on. Imports nothing else of shoal's but the native module."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _native

_NUMPY_DTYPES = {
    np.dtype(np.uint8): "u8",
    np.dtype(np.int8): "i8",
    np.dtype(np.int16): "i16",
    np.dtype(np.uint16): "u16",
    np.dtype(np.int32): "i32",
    np.dtype(np.uint32): "u32",
    np.dtype(np.int64): "i64",
    np.dtype(np.uint64): "u64",
    np.dtype(np.float16): "f16",
    np.dtype(np.float32): "f32",
    np.dtype(np.float64): "f64",
}
_TORCH_DTYPES = {
    "torch.uint8": "u8",
    "torch.int8": "i8",
    "torch.int16": "i16",
    "torch.uint16": "u16",
    "torch.int32": "i32",
    "torch.uint32": "u32",
    "torch.int64": "i64",
    "torch.uint64": "u64",
    "torch.float16": "f16",
    "torch.bfloat16": "bf16",
    "torch.float32": "f32",
    "torch.float64": "f64",
}
_SUPPORTED = "u8, i8, i16, u16, i32, u32, i64, u64, f16, bf16, f32, f64"


def _copy(tensor: Any) -> Any:
    """A contiguous copy of a numpy array or torch tensor."""
    return tensor.clone() if hasattr(tensor, "clone") else tensor.copy()


def hash_tensor(tensor: Any) -> str:
    """The content hash of a numpy array or torch CPU tensor, as 64 hex digits: BLAKE3 over its
    dtype, shape and bytes (``docs/state.md``). Equal on every peer that holds the same tensor,
    whatever the tensor's address or the number of threads; large tensors are hashed in parallel.
    The tensor must be contiguous (shoal never copies silently)."""
    view, dtype = _byte_view(tensor, writable=False)
    return _native.hash_tensor_bytes(view, dtype, [int(d) for d in tensor.shape])


def _byte_view(tensor: Any, writable: bool = True) -> tuple[np.ndarray, str]:
    """A uint8 view of ``tensor``'s memory and its dtype name, or TypeError/ValueError."""
    if isinstance(tensor, np.ndarray):
        arr = tensor
        name = _NUMPY_DTYPES.get(arr.dtype)
        if name is None and arr.dtype.name == "bfloat16":  # ml_dtypes' bfloat16
            name = "bf16"
        if name is None:
            raise TypeError(f"unsupported dtype {arr.dtype}: shoal reduces {_SUPPORTED}")
    elif type(tensor).__module__.startswith("torch"):
        name = _TORCH_DTYPES.get(str(tensor.dtype))
        if name is None:
            raise TypeError(f"unsupported dtype {tensor.dtype}: shoal reduces {_SUPPORTED}")
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor is on {tensor.device}: only CPU tensors are supported so far")
        if not tensor.is_contiguous():
            raise ValueError("tensor is not contiguous: shoal works in place and never copies silently")
        t = tensor.detach()
        if name == "bf16":
            import torch

            t = t.view(torch.int16)
        arr = t.numpy()
    else:
        raise TypeError(f"expected a numpy array or a torch tensor, got {type(tensor).__name__}")
    if not arr.flags.c_contiguous:
        raise ValueError("tensor is not contiguous: shoal works in place and never copies silently")
    if writable and not arr.flags.writeable:
        raise ValueError("tensor is read-only: all_reduce writes its result in place")
    if not arr.flags.aligned:
        raise ValueError(f"tensor is not aligned to its {arr.dtype.itemsize}-byte elements")
    # A 1-D array needs no reshaping: one view fewer on every call (small calls feel it).
    return (arr if arr.ndim == 1 else arr.reshape(-1)).view(np.uint8), name
