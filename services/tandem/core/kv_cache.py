"""A preallocated KV cache for many sequences: one slot per sequence, written in place, read as a view.

Why slots rather than paged blocks: Hugging Face attention (sdpa, eager) takes each layer's keys and values as one
dense [batch, heads, length, head_dim] tensor. With equal-capacity slots in one buffer per layer, the rows of a
forward that sit in neighbouring slots are a view of that buffer, so attention reads the cache where it lies. Paged
blocks would need a paged attention kernel, or a gather of every row's keys and values each step (the copy this
cache exists to remove). What slots cost is memory: every slot reserves the capacity of the longest sequence held,
and capacity grows geometrically (one copy of the cache per growth); the runner's token budget counts slots x
capacity, and core.slots arranges which sequence holds which slot.

A forward runs under a Step: the slots [lo, lo + rows) it reads, each row's cached length (`starts`) and number of
new tokens (`counts`, 0 for a row in that range that is not part of the forward), and the view's length. Only the
new tokens are written; a row's padding within the step and the rows not in the forward are computed but write
nothing, and the mask hides every key past a row's own length. A `packed` step feeds its rows' new tokens one after
another in a single row instead, with no padding; its attention runs per row (core.attention, `segments`).

Buffers are allocated at the first update of each layer from the key and value states it sees (heads, head_dim,
dtype, device), so a tensor-parallel rank allocates its own shard of the heads. They start zeroed: masked keys get
zero attention weight, and zero times a non-finite leftover would still poison a row.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import psutil
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tandem.core.device import on_device


@dataclass(slots=True)
class Step:
    lo: int
    starts: list[int]
    counts: list[int]
    length: int  # keys in the view: the furthest position any row of the forward reaches
    index: tuple[torch.Tensor, ...] | None = None  # (slots, positions, rows, columns) of the new tokens
    # A static forward's step (core.cuda_graphs): it reads slots [0, rows) over the buffers' first window.shape[0]
    # positions (window: those positions, 0 .. n-1), sized by tensors rather than by these Python numbers, so one
    # torch.compile graph serves every bucket and window.
    window: torch.Tensor | None = None
    packed: bool = False  # the new tokens of every row lie one after another in one row, in slot order

    @classmethod
    def build(cls, lo: int, starts: list[int], counts: list[int], device: torch.device, packed: bool = False
              ) -> Step:
        length = max(start + count for start, count in zip(starts, counts, strict=True) if count)
        step = cls(lo, starts, counts, length, packed=packed)
        if len(starts) > 1 or packed:
            counts_ = torch.tensor(counts)
            rows = torch.repeat_interleave(torch.arange(len(counts)), counts_)
            columns = torch.arange(len(rows)) - torch.repeat_interleave(counts_.cumsum(0) - counts_, counts_)
            source = (torch.zeros_like(rows), torch.arange(len(rows))) if packed else (rows, columns)
            index = torch.stack([rows + lo, torch.tensor(starts)[rows] + columns, *source])
            step.index = tuple(on_device(index, device))
        return step

    def segments(self, device: torch.device) -> list[tuple[int, int, int, int, torch.Tensor | None]]:
        """A packed step's rows as (row in the view, offset in the packed row, cached length, new tokens, mask): the
        mask [1, 1, count, start + count] lets new token j see keys up to start + j; None for an uncached row, whose
        attention is plain causal."""
        found, offset = [], 0
        for row, (start, count) in enumerate(zip(self.starts, self.counts, strict=True)):
            if count:
                mask = None
                if start:
                    mask = (torch.arange(start + count, device=device)
                            <= torch.arange(start, start + count, device=device)[:, None])[None, None]
                found.append((row, offset, start, count, mask))
                offset += count
        return found

    @property
    def rows(self) -> int:
        return len(self.starts)

    def write(self, buffer: torch.Tensor, states: torch.Tensor) -> None:
        """Put the new tokens' states [rows, heads, width, dim] at their rows' own positions."""
        if self.index is None:
            start, count = self.starts[0], self.counts[0]
            buffer[self.lo, :, start : start + count].copy_(states[0, :, :count])
        else:
            slots, positions, rows, columns = self.index
            buffer[slots, :, positions] = states[rows, :, columns]

    def mask(self, width: int, dtype: torch.dtype, device: torch.device, causal_kernel: bool) -> torch.Tensor | None:
        """[rows, 1, width, length]: query j of row r sees keys up to starts[r] + j (its own new tokens included);
        its padding sees what its last token sees. None when the attention needs no mask: one new token per row, each
        seeing the whole view; or, with `causal_kernel` (sdpa's is_causal), uncached rows of one length."""
        full = all(count == width and start + count == self.length
                   for start, count in zip(self.starts, self.counts, strict=True))
        if full and (width == 1 or (causal_kernel and self.length == width)):
            return None
        # A row that is only padding (count 0) sees its cached keys, or key 0 if it has none: never an empty row.
        last = torch.tensor(self.counts)[:, None] - 1
        limits = (torch.tensor(self.starts)[:, None] + torch.minimum(torch.arange(width)[None], last)).clamp_(min=0)
        allowed = torch.arange(self.length, device=device) <= on_device(limits, device)[:, None, :, None]
        if dtype == torch.bool:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values, [slots, heads, capacity, head_dim] each."""

    is_sliding = False

    def __init__(self, cache: SlotCache) -> None:
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        slots, capacity = self.cache.slots, self.cache.capacity + self.cache.margin
        self.keys = key_states.new_zeros((slots, key_states.shape[1], capacity, key_states.shape[-1]))
        self.values = value_states.new_zeros((slots, value_states.shape[1], capacity, value_states.shape[-1]))
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        step = self.cache.step
        step.write(self.keys, key_states)
        step.write(self.values, value_states)
        return self.view(key_states.shape[0])

    def view(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the step's `rows` rows attend over, as `update` returns them (after its write)."""
        step = self.cache.step
        if step.window is not None:
            length = step.window.shape[0]
            return self.keys[:rows, :, :length], self.values[:rows, :, :length]
        held = slice(step.lo, step.lo + step.rows)
        return self.keys[held, :, : step.length], self.values[held, :, : step.length]

    def write_target(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where a kernel may write this layer's new key and value itself (a folded attention's q/k/v: core.
        folded_layers): (keys, values, slot, position), the last two one-element tensors on the device, for a static
        forward's lone row of one token once the buffers exist; None elsewhere, where `update` writes."""
        step = self.cache.step
        if (not self.is_initialized or step is None or step.window is None or step.index is None
                or step.counts != [1]):
            return None
        slots, positions = step.index[:2]
        return self.keys, self.values, slots, positions

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        step = self.cache.step
        return (step.length if step else query_length), 0

    def get_seq_length(self) -> int:
        step = self.cache.step
        return min(step.starts) if step else 0

    def get_max_length(self) -> int:
        return self.cache.capacity


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword the model's forward takes its cache by: transformers 5.24 renamed `past_key_values` to `cache`
    and drops the old name in 5.40, so callers ask the forward they call rather than assume one release."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class SlotCache(Cache):
    """The buffers of every layer and the Step the current forward runs under; the model's cache argument."""

    def __init__(self, num_layers: int, margin: int = 0) -> None:
        """`margin`: positions allocated past the capacity, for writes that are never read (core.cuda_graphs)."""
        self.slots, self.capacity = 0, 0  # the shape buffers have, or will have when first allocated
        self.margin = margin
        self.step: Step | None = None
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])

    def _allocated(self) -> list[SlotLayer]:
        return [layer for layer in self.layers if layer.is_initialized]

    @property
    def reserved_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self._allocated() for t in (layer.keys, layer.values))

    @torch.inference_mode()
    def reshape(self, slots: int, capacity: int) -> None:
        """Reallocate to [slots, capacity], keeping what lies in both shapes; the caller has moved every sequence
        below `slots` and made `capacity` hold each of them. One layer at a time: the peak is one layer over."""
        keep_slots, keep_len = min(slots, self.slots), min(capacity, self.capacity)
        for layer in self._allocated():
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros((slots, old.shape[1], capacity + self.margin, old.shape[-1]))
                new[:keep_slots, :, :keep_len].copy_(old[:keep_slots, :, :keep_len])
                setattr(layer, name, new)
                del old
        self.slots, self.capacity = slots, capacity

    @torch.inference_mode()
    def swap(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Exchange the first `length_a` tokens of slot a with the first `length_b` of slot b (0: not kept)."""
        for layer in self._allocated():
            for buffer in (layer.keys, layer.values):
                saved = buffer[a, :, :length_a].clone() if length_a else None
                if length_b:
                    buffer[a, :, :length_b].copy_(buffer[b, :, :length_b])
                if saved is not None:
                    buffer[b, :, :length_a].copy_(saved)

    @torch.inference_mode()
    def copy(self, source: int, target: int, length: int) -> None:
        """Copy the first `length` tokens of slot `source` into slot `target` (a shared prefix: core.slots)."""
        for layer in self._allocated():
            for buffer in (layer.keys, layer.values):
                buffer[target, :, :length].copy_(buffer[source, :, :length])


CUDA_SHARE = 0.4  # of the device memory free when a runner starts: a drafter may share the GPU, activations need room
CPU_SHARE = 0.25  # of the host memory available (free plus what the kernel can reclaim, such as the page cache)
# How many tandem model processes share this host's memory (`tandem serve` sets it for the workers of a Ray of its
# own): past two (a draft and a target), each takes a smaller share, so together they take what two would. Each took
# CPU_SHARE on its own: four workers promised the whole host, and admission could not keep it from running out.
HOST_WORKERS_ENV = "TANDEM_HOST_WORKERS"


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Keys and values of one token over every layer, for this process's share of the heads."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    itemsize = next(model.parameters()).dtype.itemsize
    return 2 * config.num_hidden_layers * max(heads // world, 1) * head_dim * itemsize


def default_kv_tokens(model: torch.nn.Module) -> int:
    """A token budget from the memory free now (a GPU's free memory, or the host's available memory); the ranks of
    a tensor-parallel group agree on the smallest, so they admit and refuse the same sequences."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        spare = torch.cuda.mem_get_info(device)[0] * CUDA_SHARE
    else:
        # Available, not free: once a host has read its model files the page cache holds much of its memory, which
        # the kernel hands back on demand; free pages alone (sysconf's AVPHYS_PAGES) counted 16 of 23 GiB on CPU-A.
        spare = psutil.virtual_memory().available * CPU_SHARE * 2 / max(2, _host_workers())
    tokens = int(spare // kv_bytes_per_token(model))
    if torch.distributed.is_initialized():
        on = device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
        agreed = torch.tensor([tokens], dtype=torch.long, device=on)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        tokens = int(agreed.item())
    return tokens


def _host_workers() -> int:
    try:
        return max(1, int(os.environ.get(HOST_WORKERS_ENV, "") or 1))
    except ValueError:
        return 1
