"""What the GPU probe (tandem.bench.gpu_probe) measures besides tok/s: forward costs by width, the share of wall time
in GPU kernels, bytes allocated per decode step against the live KV cache, one attention call's cost per sdpa
kernel, and the speculative speedup those costs project at a given acceptance; with the random prompt ids and the
synchronised timer they share.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from torch.autograd import DeviceType
from torch.nn.attention import sdpa_kernel

from tandem.core.config import SamplingParams
from tandem.core.flex_decode import flex_decode
from tandem.core.kv_cache import kv_bytes_per_token
from tandem.core.runner import ModelRunner


def prompts(count: int, seed: int = 0, vocab: int = 150000) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 257, (count,), generator=generator)
    return [torch.randint(10, vocab, (int(n),), generator=generator).tolist() for n in lengths]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(call) -> float:
    sync()
    started = time.perf_counter()
    call()
    sync()
    return time.perf_counter() - started


def projected_speedups(verify: dict[int, float], draft_step: float) -> dict[str, dict]:
    """Speculative over plain at batch 1 from forward costs, at the best k for each acceptance (labelled a
    projection: random weights cannot measure acceptance)."""
    def round_s(k: int) -> float:
        return k * draft_step + verify[min((w for w in verify if w >= k + 1), default=max(verify))]

    out = {}
    for alpha in (0.6, 0.7, 0.8, 0.9):
        best = max(range(1, 9), key=lambda k: (1 - alpha ** (k + 1)) / (1 - alpha) / round_s(k))
        out[str(alpha)] = {"k": best, "speedup_vs_plain": (1 - alpha ** (best + 1)) / (1 - alpha) / round_s(best)
                           * verify[1]}
    return out


def forward_costs(runner: ModelRunner, widths: list[int], context: int, reps: int = 20) -> dict[int, float]:
    """Median seconds of one forward over `width` new tokens on a `context`-token cache, batch 1."""
    ids = prompts(1, seed=7, vocab=min(150000, runner.vocab_size))[0] * 8
    state = runner.state("probe")
    state.sync(0, ids[:context])
    runner.prefill(state, context)
    costs = {}
    for width in widths:
        samples = []
        for _ in range(reps):
            state.truncate_cache(context)
            state.sync(context, ids[context : context + width])
            samples.append(timed(lambda width=width: runner.forward([state], [width])))
        costs[width] = sorted(samples)[len(samples) // 2]
    runner.release("probe")
    return costs


def kernel_share(call, top: int = 12) -> dict:
    """GPU kernel time over wall time for `call` (kernel time from the profiler, wall time from an unprofiled run),
    the kernels launched, and the `top` kernels by time: name, launches, seconds (where a step's time goes, kernel by
    kernel)."""
    wall = timed(call)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        sync()
    # The device's own events (kernels, copies, memsets) only: a host op run eagerly (the head's aten::mm outside the
    # graphs) also reports the time of the kernels it launched as its "self" device time, which counted them twice.
    events = [e for e in prof.key_averages() if e.device_type != DeviceType.CPU and e.self_device_time_total > 0]
    device_us = sum(e.self_device_time_total for e in events)
    kernels = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    return {"wall_s": wall, "kernel_s": device_us / 1e6, "share": device_us / 1e6 / wall,
            "launches": sum(e.count for e in events),
            "top_kernels": [{"name": e.key[:120], "launches": e.count, "seconds": e.self_device_time_total / 1e6}
                            for e in kernels]}


def allocated_per_step(eng_factory, work: list[list[int]], contexts: tuple[int, int], steps: int = 8) -> dict:
    """Bytes the allocator hands out per decode step at two context lengths, and the live KV bytes at each.
    The growth with context, over the growth of the live KV, is how many copies of the KV cache a step makes."""
    out = {}
    for context in contexts:
        eng = eng_factory()
        params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)  # still live when read
        ids = [(p * 32)[:context] for p in work]
        for prompt in ids:
            eng.add_request(prompt, params)
        eng.step()  # prefill and first token
        sync()
        before = torch.cuda.memory_stats()["allocated_bytes.all.allocated"]
        for _ in range(steps):
            eng.step()
        sync()
        allocated = torch.cuda.memory_stats()["allocated_bytes.all.allocated"] - before
        live = eng.verifier.runner.kv_tokens_used * kv_bytes_per_token(eng.verifier.runner.model)
        while eng.has_unfinished():
            eng.step()
        out[context] = {"allocated_per_step": allocated / steps, "live_kv_bytes": live}
    lo, hi = contexts
    growth = out[hi]["allocated_per_step"] - out[lo]["allocated_per_step"]
    kv_growth = out[hi]["live_kv_bytes"] - out[lo]["live_kv_bytes"]
    return {"by_context": out, "kv_copies_per_step": growth / kv_growth if kv_growth else None}


FLEX = "flex"  # attention_costs' name for core.flex_decode among sets of sdpa kernels
TRITON = "triton"  # and for core.triton_decode (imported only when asked for: Triton is there on a GPU machine)
# keys per thread block timed beside core.triton_decode.SPLIT, as triton_split<n> (0: a row's keys in one block)
TRITON_SPLITS = (0, 64, 256, 1024)
TOLERANCE = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def attention_costs(device: torch.device, backends: dict[str, tuple | str | None],
                    caps: tuple[int, ...] = (256, 1024, 4096), rows: tuple[int, ...] = (1, 8),
                    widths: tuple[int, ...] = (1, 5), reps: int = 100, kv_heads: int = 2, groups: int = 6,
                    dim: int = 128) -> dict[str, dict]:
    """Median seconds of one attention call as the runner's static forwards make it (core.attention: query heads
    stacked per key/value head, the whole `cap`-key buffer under a boolean mask, 60% of it live), per named set of
    sdpa kernels (None: PyTorch's pick; FLEX: core.flex_decode compiled, TRITON: core.triton_decode's split_decode
    compiled, both over the heads unstacked), bf16 on a GPU; a set that cannot run a shape, or gives another result
    than PyTorch's pick, records the error instead."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict[str, dict] = {name: {} for name in backends}
    # Compiled on a GPU, as the runner's forwards run it; uncompiled elsewhere (inductor's CPU template for it is not
    # reliable: core.attention.FLEX_DEVICES), which checks the call, not the kernel.
    kernels = {FLEX: flex_decode}
    if TRITON in backends.values():
        from tandem.core.triton_decode import split_decode

        kernels[TRITON] = split_decode
        for split in TRITON_SPLITS:
            name = f"{TRITON}_split{split}"
            kernels[name] = partial(split_decode, split=split)
            backends = backends | {name: name}
            out[name] = {}
    kernels = {name: torch.compile(fn, dynamic=True) if device.type == "cuda" else fn for name, fn in kernels.items()}
    for cap in caps:
        for row in rows:
            for width in widths:
                q = torch.randn(row, kv_heads, groups * width, dim, device=device, dtype=dtype)
                k, v = (torch.randn(row, kv_heads, cap, dim, device=device, dtype=dtype) for _ in range(2))
                # Query j of a row sees the live keys and its own block's first j (one mask row per query when wider).
                limit = int(cap * 0.6) + torch.arange(groups * width if width > 1 else 1, device=device) % width
                mask = (torch.arange(cap, device=device) <= limit[:, None])[None, None].expand(row, 1, -1, -1)
                expected = _attend(None, q, k, v, mask)
                for name, chosen in backends.items():
                    try:
                        if chosen in kernels:  # the same keys and mask, the query heads unstacked
                            heads = q.reshape(row, kv_heads, groups, width, dim).flatten(1, 2)
                            call = partial(_stacked, kernels[chosen], heads, k, v, mask[:, :, :width])
                        else:
                            call = partial(_attend, chosen, q, k, v, mask)
                        torch.testing.assert_close(call(), expected, **TOLERANCE[dtype])
                        run = _ten_calls(call, device)
                        samples = [timed(run) / 10 for _ in range(max(1, reps // 10))]
                        out[name][f"cap{cap}_rows{row}_width{width}"] = sorted(samples)[len(samples) // 2]
                    except (RuntimeError, AssertionError) as exc:  # no kernel of the set takes it, or it errs
                        out[name][f"cap{cap}_rows{row}_width{width}"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return out


def _attend(chosen: tuple | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
    if chosen is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with sdpa_kernel(list(chosen)):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _stacked(kernel, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
    """`kernel`'s [rows, heads, width, dim] as the stacked call's [rows, kv_heads, groups * width, dim]."""
    out = kernel(query, key, value, mask)
    rows, heads, width, dim = out.shape
    return out.reshape(rows, key.shape[1], heads // key.shape[1] * width, dim)


def _ten_calls(call, device: torch.device):
    """`call` ten times over; on a GPU recorded in a CUDA graph, so that its replay times the kernels, not their
    launches."""
    if device.type != "cuda":
        return lambda: [call() for _ in range(10)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture stream, as capture requires
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            call()
    return graph.replay
