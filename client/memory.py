"""Describing the calling process's KV memory for Register.

A KV tensor is any array whose first dimension is the block: block ``b`` starts at
``base + b * stride`` and its ``page_bytes`` are contiguous. torch tensors and numpy
arrays are both accepted (torch is imported only if the caller passes one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvd_proto.messages import HostRegion


def host_region(t: Any) -> HostRegion:
    """HostRegion of one tensor/array of shape (num_blocks, ...), rows contiguous."""
    if hasattr(t, "data_ptr"):  # torch.Tensor
        if t.device.type != "cpu":
            raise ValueError(f"tensor on {t.device}: use the CUDA registration")
        num_blocks = t.shape[0]
        item = t.element_size()
        stride = t.stride(0) * item
        page = (t[0].numel() * item) if num_blocks else 0
        contiguous_rows = t[0].is_contiguous() if num_blocks else True
        base = t.data_ptr()
    else:  # numpy
        num_blocks = t.shape[0]
        stride = t.strides[0]
        page = t[0].nbytes if num_blocks else 0
        contiguous_rows = t[0].flags.c_contiguous if num_blocks else True
        base = t.ctypes.data
    if not contiguous_rows:
        raise ValueError("each block's bytes must be contiguous in memory")
    if num_blocks == 0 or page == 0:
        raise ValueError("empty KV tensor")
    return HostRegion(base=base, num_blocks=num_blocks, stride=stride, page_bytes=page)


def host_regions(tensors: Sequence[Any]) -> list[HostRegion]:
    return [host_region(t) for t in tensors]
