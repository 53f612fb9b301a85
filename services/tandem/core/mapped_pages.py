"""Unmap a checkpoint file's pages as soon as the layer that read them has its own copy of its weight.

from_pretrained keeps a CPU weight whose dtype the file already holds as a view of the file's mapping
(models.file_views). Packing or quantizing a linear layer (core.packed_linear, core.fused_linear, the int8 and int4
layers) copies its weight into a layout of its own and drops the view, but the pages that the copy read stay mapped,
and count in the process's resident memory, until the whole mapping goes after the last layer: 3.7 GB of the real
pair's 8.7 GB peak (docs/performance.md, "Start-up: weights that view the checkpoint file"). `MappedWeights`
unmaps a dropped layer's weights' own pages (those wholly inside their bytes, so no other tensor's bytes) at once.

madvise(MADV_DONTNEED) on a page of a file mapping only unmaps it: touched again, it is read from the file, so a
stale reference to the dropped weight still reads its values. On anonymous memory the same call would zero the
pages, so only mappings of a file (/proc/self/maps names one) are released; nothing is released off Linux.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections import Counter
from collections.abc import Iterable

import torch

_DONTNEED = getattr(mmap, "MADV_DONTNEED", None) if sys.platform.startswith("linux") else None
_PAGE = mmap.PAGESIZE


def viewing_a_file(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a view of memory torch did not allocate (a file mapping, a buffer): such storage cannot be
    resized, which any storage of torch's own allocator can."""
    data = tensor.data
    return type(data) is torch.Tensor and data.device.type == "cpu" and not data.untyped_storage().resizable()


class MappedWeights:
    """The weights of `model` that view a mapped file, as it stands now; `dropped(module)`, called once `module`
    has left the model (its layer replaced by one holding copies), unmaps the pages of its weights that no module
    still in the model holds (a head tied to the input embedding gives up its weight, which the embedding keeps:
    left alone). The file mappings are read once here: a view keeps its mapping alive, so while one of these weights
    lives its address stays the file's."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.holders = Counter(tensor.data_ptr() for tensor in _own_tensors(model.modules()))
        self.files = _file_mappings() if self.holders and _DONTNEED is not None else []

    def dropped(self, module: torch.nn.Module) -> int:
        """Count `module`'s own weights and buffers out of the model; unmap those no other module holds; the bytes
        unmapped."""
        released = 0
        for tensor in _own_tensors([module]):
            pointer = tensor.data_ptr()
            self.holders[pointer] -= 1
            if self.holders[pointer] > 0 or (span := _own_pages(tensor)) is None:
                continue
            start, end = span
            if any(low <= start and end <= high for low, high in self.files) and _libc().madvise(
                    ctypes.c_void_p(start), ctypes.c_size_t(end - start), _DONTNEED) == 0:
                released += end - start
        return released


def _own_tensors(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """The parameters and buffers registered on `modules` themselves (not their children's) that view a file."""
    return [tensor for module in modules for tensor in (*module._parameters.values(), *module._buffers.values())
            if tensor is not None and viewing_a_file(tensor)]


def _own_pages(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(first, end) of the whole pages inside `tensor`'s bytes, None when there are none."""
    pointer = tensor.data_ptr()
    start = -(-pointer // _PAGE) * _PAGE
    end = (pointer + tensor.numel() * tensor.element_size()) // _PAGE * _PAGE
    return (start, end) if end > start else None


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of files (/proc/self/maps lines that name a path)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/") and fields[4] != "0":  # inode 0: not a file
                low, high = fields[0].split("-")
                ranges.append((int(low, 16), int(high, 16)))
    return ranges


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc
