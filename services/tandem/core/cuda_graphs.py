"""CUDA graphs of the runner's decode forwards: one kernel launch per step instead of hundreds.

A decode step of a 1.5B model launches ~400 small kernels; on a GPU their launch overhead, not the GPU, sets the
pace (measured on an H100: 35% of a batch-1 step's wall time inside kernels). A CUDA graph records the kernels of
one forward once and replays them with a single launch. Replays are only valid for the same shapes and the same
memory, so a graph is captured per bucket (rows, width) and reads fixed tensors:

- the rows are the cache's slots [0, rows), rows rounded up to a bucket; slots of sequences not in the forward, and
  empty slots, run as padding rows;
- every row is `width` tokens; each token's keys and values are written at its row's own position (cached length +
  column), padding included: past a row's length, so masked now and overwritten before they are ever read. The
  cache keeps `MAX_WIDTH` spare positions past its capacity (SlotCache.margin) so these writes stay in bounds;
- attention reads every position of the buffers under a mask built inside the graph from each row's cached length
  and count of new tokens, the same mask the eager path builds.

Without CUDA graphs (`capture` False: the compiled forwards on a CPU) nothing is replayed, so attention reads only
the positions the rows reach, rounded up to `WINDOW_ALIGN` (Step.window), rather than every position of the buffers:
a cache's capacity is set by the longest sequence it has held (a prompt of a thousand tokens, calibration), and 8
rows reading 1040 positions where they hold about 350 read 150 MB more keys and values a step of the 1.5B target
than they need. Keys past a row's length get zero weight either way, so the result is the same.

Only ids, cached lengths and counts are copied in before a replay; the graph's output is the last hidden state, from
which the runner computes the logits it needs. Graphs are captured on a bucket's first use and dropped when the cache
reallocates its buffers. Prefill (wide forwards) and tensor-parallel ranks run eagerly.

Inside a graph each kernel still costs its few microseconds, and a Hugging Face decoder layer runs ~40 of them
(RMSNorm alone is six), so with `compile` the forward is first compiled by torch.compile (inductor fuses the
elementwise work around the matrix products) and the compiled kernels are what the graph records. The forward reads
only tensors whose shapes carry the bucket (ids, positions, mask, Step.window and the buffers), so with dynamic shapes
one compiled graph serves every bucket past size 1: six compiles per model (ModelRunner.warm_up), none per bucket,
window or cache growth; after a class's first forward its graph runs without dynamo's guard check (core.guardless,
keyed by `shape_class`). A forward that fails to compile runs uncompiled from then on. Without CUDA (`capture` False)
the same compiled static forwards run directly, which is how the CPU tests check them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.fx.experimental import _config as fx_config

from tandem.core import packed_linear, w8a8_linear
from tandem.core.attention import traced_settings
from tandem.core.device import on_device
from tandem.core.gc_pause import collector_paused
from tandem.core.guardless import GuardlessForward, GuardMismatch
from tandem.core.kv_cache import SlotCache, Step

log = logging.getLogger(__name__)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_WIDTH = 16
WINDOW_ALIGN = 64  # positions: a window grows in steps of this, so most steps of a sequence read the same one
WARMUP_RUNS = 2
# Compiled graphs per code object before dynamo gives up on it: each model (draft, target) needs six (slots, rows
# and width each 1 or more), and every runner shares ModelRunner._hidden's code.
RECOMPILE_LIMIT = 64
# Inductor checks the size and stride of every input and every extern kernel's output on each call of a compiled
# graph: about 580 checks a forward of the 0.5B draft, at about 0.4 us each. The graphs a runner calls are chosen by
# shape class (core.guardless; the tests check that against dynamo's guards), so the checks can only fail where the
# guards would have; vLLM's CPU platform turns them off too.
INDUCTOR_OPTIONS = {"size_asserts": False}


class _Graph:
    """One captured forward over `rows` x `width` and the fixed tensors it reads and writes."""

    def __init__(self, rows: int, width: int, length: int, device: torch.device, capture: bool = True) -> None:
        self.rows, self.width, self.length = rows, width, length
        self.ids = torch.zeros((rows, width), dtype=torch.long, device=device)
        self.starts = torch.zeros(rows, dtype=torch.long, device=device)
        self.counts = torch.zeros(rows, dtype=torch.long, device=device)
        self.graph = torch.cuda.CUDAGraph() if capture else None
        self.hidden: torch.Tensor | None = None

    def step_and_inputs(self, length: int) -> tuple[Step, torch.Tensor, torch.Tensor]:
        """Device-side positions, KV write index and mask for the fixed inputs (recorded into the graph), attention
        reading the buffers' first `length` positions."""
        device = self.ids.device
        columns = torch.arange(self.width, device=device)
        positions = self.starts[:, None] + columns
        rows = torch.arange(self.rows, device=device).repeat_interleave(self.width)
        index = (rows, positions.reshape(-1), rows, columns.repeat(self.rows))
        last = (self.counts - 1)[:, None]
        limits = (self.starts[:, None] + torch.minimum(columns[None], last)).clamp(min=0)
        window = torch.arange(length, device=device)
        mask = window <= limits[:, None, :, None]
        step = Step(0, [0] * self.rows, [self.width] * self.rows, length, index, window=window)
        return step, positions, mask


def with_trace_settings(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`compiled` called with the two settings its traces need. Dynamo reads them when it traces, inside a call (the
    first of each shape class; later ones skip dynamo), so they are set around the call, not once: PyTorch keeps its
    settings per thread, and a runner built on one thread may trace on another (the gateway's loader and engine
    loops). Other compiles in the process keep PyTorch's defaults.
    - Duck sizing off: sizes that happen to be equal when a graph compiles (2 rows over 2 slots, say) get symbols of
      their own, so the graph neither recompiles when they differ nor, called without its guards (core.guardless),
      runs where they do. Inductor's CPU template for flex attention needs it on (tests/test_flex_decode.py).
    - Dynamo's recompile limit at least RECOMPILE_LIMIT: past PyTorch's 8 it runs further classes eagerly.
    - Floats specialised: the model's are constants (norm epsilons, attention scales, the embedding's norm type).
      Left symbolic, as dynamic shapes have them, each is an input of the graph, and one that AOT autograd cannot
      turn into a tensor (F.embedding's norm type) restarts the analysis: dynamo and AOT autograd trace the whole
      forward a second time before inductor compiles it (five of the tiny target's six classes), and a warm-up from
      a kept cache pays that too (docs/performance.md, "Start-up: a kept compile cache")."""

    from torch._dynamo import config as dynamo_config  # here: importing dynamo costs an eager start about 1.4 s

    recompiles = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"  # older torch

    def call(*args: torch.Tensor) -> torch.Tensor:
        duck, limit, floats = (fx_config.use_duck_shape, getattr(dynamo_config, recompiles),
                               dynamo_config.specialize_float)
        fx_config.use_duck_shape = False
        setattr(dynamo_config, recompiles, max(limit, RECOMPILE_LIMIT))
        dynamo_config.specialize_float = True
        try:
            return compiled(*args)
        finally:
            fx_config.use_duck_shape = duck
            setattr(dynamo_config, recompiles, limit)
            dynamo_config.specialize_float = floats
    return call


class GraphedForward:
    """Replays captured decode forwards for a runner's model and cache; `run` returns None where it does not apply
    (too wide, too many rows, cache not allocated yet), and the runner runs that forward eagerly."""

    def __init__(self, cache: SlotCache, forward: Callable[..., torch.Tensor], compile: bool = False,
                 capture: bool = True) -> None:
        """`forward(ids, positions, mask)` runs the model under the cache's current step and returns the last
        hidden state; the runner supplies it so that attention and cache handling are its own. `compile`: record
        torch.compile's kernels rather than the eager ones. `capture` False: no CUDA graphs, the static forwards
        run as they are (compiled, on a CPU)."""
        self.cache, self.plain_forward, self.capture = cache, forward, capture
        self.forward = forward
        self.compile_error: str | None = None
        if compile:
            packed_linear.lower_to_onednn()
            w8a8_linear.lower_to_onednn()
            self.forward = torch.compile(forward, dynamic=True, fullgraph=True, options=INDUCTOR_OPTIONS)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.buffers_seen: tuple | None = None
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.failed: set[tuple[int, int]] = set()
        self.captures = 0
        self.replays = 0

    @property
    def forward(self) -> Callable[..., torch.Tensor]:
        """The forward the static steps run: torch.compile's, or the plain one where nothing compiles."""
        return self._forward

    @forward.setter
    def forward(self, forward: Callable[..., torch.Tensor]) -> None:
        # A new compiled forward (a benchmark's other inductor options) brings its own guard-free calls.
        self._forward = forward
        self.guardless = GuardlessForward(self.plain_forward, with_trace_settings(forward))

    @property
    def compiled(self) -> bool:
        """Whether the forwards run compiled (asked for, and nothing failed to compile)."""
        return self.forward is not self.plain_forward

    def bucket(self, hi: int, width: int) -> int | None:
        """The rows of the graph that covers slots [0, hi) at this width, or None to run eagerly."""
        if width > MAX_WIDTH or not self.cache.layers[0].is_initialized:
            return None
        rows = next((r for r in ROW_BUCKETS if r >= hi), None)
        if rows is None:
            return None
        return min(rows, self.cache.slots) if hi <= self.cache.slots else None

    def run(self, hi: int, starts: list[int], fed: dict[int, list[int]], width: int, pad_token_id: int,
            on_slots: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Hidden states [rows, width, hidden] of slots [0, rows) with `fed` tokens (by slot) written after each
        slot's `starts` (cached length; 0 for empty slots); None to run eagerly. `on_slots`: (slots, tokens on the
        device) that are those slots' first tokens instead, copied in on the device (no wait for the host)."""
        rows = self.bucket(hi, width)
        if rows is None:
            return None
        buffers = tuple(t.data_ptr() for t in (self.cache.layers[0].keys, self.cache.layers[0].values))
        if buffers != self.buffers_seen:  # reallocated: every graph reads the old buffers
            self.graphs.clear()
            self.buffers_seen = buffers
            if self.capture:
                # The allocator deletes a private pool once no graph uses it, and a capture into a deleted pool's
                # handle fails an internal assert (seen on an H100 when a cache grew): so a new pool per cache.
                self.pool = torch.cuda.graph_pool_handle()
        if (rows, width) in self.failed:
            return None
        graph = self.graphs.get((rows, width))
        fresh = graph is None
        if fresh:
            graph = _Graph(rows, width, self.cache.capacity + self.cache.margin, self.cache.layers[0].keys.device,
                           self.capture)
        ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
        counts = torch.zeros(rows, dtype=torch.long)
        for slot, new in fed.items():
            ids[slot, : len(new)] = torch.tensor(new, dtype=torch.long)
            counts[slot] = len(new)
        graph.ids.copy_(ids, non_blocking=True)
        graph.starts.copy_(torch.tensor((starts + [0] * rows)[:rows], dtype=torch.long), non_blocking=True)
        graph.counts.copy_(counts, non_blocking=True)
        if on_slots is not None:
            slots, tokens = on_slots
            graph.ids.select(1, 0).index_copy_(0, on_device(slots, graph.ids.device), tokens)
        if not self.capture:
            if fresh:
                self.graphs[rows, width] = graph  # its fixed inputs serve the bucket's next steps
            self.replays += 1
            reach = max((start + len(fed[slot]) for slot, start in enumerate(starts) if slot in fed), default=1)
            return self._body(graph, min(graph.length, -(-reach // WINDOW_ALIGN) * WINDOW_ALIGN))
        if fresh:
            try:
                self._capture(graph)
            except Exception as exc:  # CUDA errors come in several types; this bucket runs eagerly from now on
                log.warning("CUDA graph capture of %d rows x %d failed, running it eagerly: %s", rows, width, exc)
                self.failed.add((rows, width))
                return None
            self.graphs[rows, width] = graph
        graph.graph.replay()
        self.replays += 1
        return graph.hidden

    def _body(self, graph: _Graph, length: int) -> torch.Tensor:
        """One static forward of `graph`'s bucket, attention reading the buffers' first `length` positions; a compile
        failure leaves the forwards uncompiled and runs it so."""
        step, positions, mask = graph.step_and_inputs(length)
        self.cache.step = step
        try:
            try:
                if self.compiled:
                    return self.guardless(self.shape_class(graph), graph.ids, positions, mask)
                return self.forward(graph.ids, positions, mask)
            except Exception as exc:  # dynamo and inductor raise many types; the uncompiled forward still works
                if not self.compiled or isinstance(exc, GuardMismatch):
                    raise
                log.warning("torch.compile of the decode forward failed, running it uncompiled: %s", exc)
                self.compile_error = f"{type(exc).__name__}: {exc}"[:500]
                self.forward = self.plain_forward
                return self.forward(graph.ids, positions, mask)
        finally:
            self.cache.step = None

    def shape_class(self, graph: _Graph) -> tuple:
        """What tells the compiled graphs of a model apart: with dynamic shapes, sizes of 1 are specialised; and the
        attention settings a graph was traced under (a benchmark switches them between runs)."""
        return self.cache.slots == 1, graph.rows == 1, graph.width == 1, traced_settings()

    def _capture(self, graph: _Graph) -> None:
        """Warm up on a side stream (the writes are this step's own, so repeating them is harmless; the first run
        compiles), then record."""
        def body() -> torch.Tensor:
            return self._body(graph, graph.length)  # a replay cannot change its shapes: every position

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                body()
        torch.cuda.current_stream().wait_stream(stream)
        # No garbage collection while recording: a collection could free another pool's CUDA tensors mid-capture,
        # and the allocator's event queries on such frees are illegal in a capturing stream.
        with collector_paused(), torch.cuda.graph(graph.graph, pool=self.pool, capture_error_mode="thread_local"):
            graph.hidden = body()
        self.captures += 1
