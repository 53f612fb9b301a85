"""core.cpu_attention's decode-attention kernel: sdpa's results within bf16's rounding over decode and verification
shapes (stacked query heads, padded rows, causal widths, strided cache views); a query's result the same bit for bit
whatever its row's width or batch mates; keys past the last one seen never read; and the runner's eager and compiled
forwards using it in bf16 with the logits sdpa gives; one build for every checkout of the same source.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tandem.core import cpu_attention
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.engine import SpeculativeEngine
from tandem.core.local import LocalDrafter, LocalVerifier
from tandem.core.runner import ModelRunner

pytestmark = pytest.mark.skipif(not cpu_attention.ready(), reason="no AVX-512 CPU or no C++ compiler here")
SHAPES = {"target": (12, 2, 128), "draft": (14, 2, 64), "tiny": (4, 2, 16)}  # query heads, key/value heads, dim


def stacked(rows: int, heads: int, kv_heads: int, dim: int, width: int, length: int, capacity: int = 96, seed: int = 0):
    """A query as core.attention stacks it, keys and values as views of a larger cache, and each row's length."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, kv_heads, heads // kv_heads * width, dim, generator=generator).bfloat16()
    cache = torch.randn(2, rows, kv_heads, capacity, dim, generator=generator).bfloat16()
    lengths = [length - 3 * row for row in range(rows)]
    return query, cache[0, :, :, :length], cache[1, :, :, :length], lengths


def causal_mask(lengths: list[int], width: int, groups: int, length: int) -> torch.Tensor:
    """[rows, 1, groups * width, length]: token j of a row's last `width` sees the keys up to its own position,
    repeated for the query heads stacked per key/value head (core.attention's order: head r, token j at r*width+j)."""
    mask = torch.zeros(len(lengths), 1, width, length, dtype=torch.bool)
    for row, n in enumerate(lengths):
        for j in range(width):
            mask[row, 0, j, : n - width + 1 + j] = True
    return mask.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(len(lengths), 1, groups * width, length)


def reference(query, key, value, mask, scale) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask,
                                                            scale=scale)


DOTS = [True, False] if cpu_attention.BF16_DOT else [False]  # the AVX512-BF16 path, or the float32 one


@pytest.mark.parametrize("bf16_dot", DOTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("rows", "width", "masked"), [(1, 1, False), (3, 1, True), (3, 3, True), (8, 2, True),
                                                       (2, 5, True)])
def test_the_kernel_gives_sdpas_attention_within_bf16_rounding(shape, rows, width, masked, bf16_dot) -> None:
    heads, kv_heads, dim = SHAPES[shape]
    query, key, value, lengths = stacked(rows, heads, kv_heads, dim, width, length=61)
    mask = causal_mask(lengths, width, heads // kv_heads, 61) if masked else None
    if masked and width == 1:
        mask = mask[:, :, :1]  # one row of the mask for every stacked head, as a decode step's
    scale = 1 / math.sqrt(dim)
    want = reference(query, key, value, mask, scale)
    sdpa_error = (torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
                  .float() - want).abs().max().item()
    got = cpu_attention.decode_attention(query, key, value, mask, scale, bf16_dot=bf16_dot)
    kernel_error = (got.float() - want).abs().max().item()
    assert kernel_error <= max(2 * sdpa_error, 4e-3), (kernel_error, sdpa_error)
    if masked:  # a mask whose keys are not adjacent in memory reads the same
        strided = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
        assert torch.equal(cpu_attention.decode_attention(query, key, value, strided, scale, bf16_dot), got)


@pytest.mark.parametrize("bf16_dot", DOTS)
@pytest.mark.parametrize("length", [16, 31, 32, 33, 64])
def test_keys_filling_whole_blocks_or_one_past_them(length, bf16_dot) -> None:
    """Rows whose last key ends a block of 16 scores or 32 values, or one short of or past it."""
    heads, kv_heads, dim = SHAPES["target"]
    query, key, value, _ = stacked(1, heads, kv_heads, dim, width=2, length=length)
    mask = causal_mask([length], 2, heads // kv_heads, length)
    scale = 1 / math.sqrt(dim)
    want = reference(query, key, value, mask, scale)
    sdpa_error = (torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
                  .float() - want).abs().max().item()
    got = cpu_attention.decode_attention(query, key, value, mask, scale, bf16_dot).float()
    assert (got - want).abs().max().item() <= max(2 * sdpa_error, 4e-3)


@pytest.mark.parametrize("bf16_dot", DOTS)
def test_a_querys_result_does_not_depend_on_its_rows_width_or_batch_mates(bf16_dot) -> None:
    """The last token of a 3-token verification gets, bit for bit, what a 1-token step at that position gets; a row
    alone what it gets among others: the keys a query does not see add exact zeros."""
    heads, kv_heads, dim = SHAPES["target"]
    groups, scale = heads // kv_heads, 1 / math.sqrt(dim)
    query, key, value, lengths = stacked(4, heads, kv_heads, dim, width=3, length=50)
    mask = causal_mask(lengths, 3, groups, 50)
    wide = cpu_attention.decode_attention(query, key, value, mask, scale, bf16_dot)
    last = query.reshape(4, kv_heads, groups, 3, dim)[:, :, :, 2].contiguous()
    narrow = cpu_attention.decode_attention(last, key, value, mask.reshape(4, 1, groups, 3, 50)[:, :, :1, 2], scale,
                                            bf16_dot)
    assert torch.equal(wide.reshape(4, kv_heads, groups, 3, dim)[:, :, :, 2], narrow)
    alone = cpu_attention.decode_attention(last[1:2], key[1:2], value[1:2], mask.reshape(4, 1, groups, 3, 50)[1:2, :,
                                           :1, 2], scale, bf16_dot)
    assert torch.equal(alone, narrow[1:2])


@pytest.mark.parametrize("bf16_dot", DOTS)
def test_keys_past_the_last_seen_are_never_read_and_a_query_that_sees_none_gets_zeros(bf16_dot) -> None:
    heads, kv_heads, dim = SHAPES["draft"]
    query, key, value, lengths = stacked(3, heads, kv_heads, dim, width=1, length=40)
    mask = causal_mask(lengths, 1, 1, 40)
    mask[2] = False
    scale = 1 / math.sqrt(dim)
    clean = cpu_attention.decode_attention(query, key, value, mask, scale, bf16_dot)
    for tensor in (key, value):  # NaN where no query looks: any read of it would show
        for row, n in enumerate(lengths):
            tensor[row, :, n:] = float("nan")
        tensor[2] = float("nan")
    poisoned = cpu_attention.decode_attention(query, key, value, mask, scale, bf16_dot)
    assert torch.equal(poisoned, clean) and not poisoned[2].any()


def test_the_runner_attends_with_the_kernel_in_bf16_eager_and_compiled(tiny_dirs, monkeypatch) -> None:
    """A bf16 runner on this CPU calls the kernel in every layer of its decode and verification forwards, eager and
    compiled, and its logits are sdpa's within bf16's rounding; a speculative engine over it runs."""
    from tandem.models.loader import load_model

    target = load_model(str(tiny_dirs.target), device=torch.device("cpu"), dtype=torch.bfloat16, progress=False)
    layers = target.model.config.num_hidden_layers
    monkeypatch.setattr(cpu_attention, "ENABLED", [True])

    prompts = [list(range(3, 3 + n)) for n in (9, 17)]
    for compile in (False, True):
        logits = {}
        for enabled in (True, False):
            cpu_attention.ENABLED[0] = enabled
            runner = ModelRunner(target.model, kv_tokens=1024, compile=compile)
            states = [runner.state(f"s{i}") for i in range(len(prompts))]
            for state, prompt in zip(states, prompts, strict=True):
                state.sync(0, prompt)
            runner.forward(states, [1, 1])  # the prompts
            for state in states:
                state.sync(len(state.tokens), [5, 6, 7])  # a verification of width 3
            runner.forward(states, [3, 3])  # compiles its graph (tracing calls the op too)
            for state in states:
                state.sync(len(state.tokens) - 3, [8, 9, 10])  # rolled back: the same shapes again
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
                logits[enabled] = torch.cat(runner.forward(states, [3, 3])).float()
            calls = sum(event.count for event in profiled.key_averages() if event.key == "tandem::decode_attention")
            assert calls == (layers if enabled else 0), (compile, enabled, calls)
            if compile:  # the verification ran as a compiled static forward
                assert runner.graphs.compiled and runner.graphs.replays == 2 and runner.graphs.compile_error is None
        assert (logits[True] - logits[False]).abs().max().item() <= 0.05 * logits[False].abs().max().item()
    cpu_attention.ENABLED[0] = True
    runners = [ModelRunner(target.model, kv_tokens=1024, compile=True) for _ in range(2)]
    engine = SpeculativeEngine(LocalVerifier(runners[0]), LocalDrafter(runners[1]),
                               EngineConfig(spec=SpecConfig(k_max=3, k_init=3, adaptive=False), calibrate=False))
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [len(r.token_ids) for r in results] == [12, 12]


BUILD_FROM = """
import sys
from pathlib import Path
from tandem.core import cpu_attention
cpu_attention.SOURCE = Path(sys.argv[1])
assert cpu_attention.ready()
print(cpu_attention._build_source().parent)
"""


def test_every_checkout_of_the_same_source_reuses_one_build(tmp_path) -> None:
    """torch's extension builder rebuilds whenever the source's path changes: two checkouts of the same code (a
    worktree, a CI clone, another install) load one build, untouched by the second; another source builds elsewhere."""
    import subprocess
    import sys

    code = cpu_attention.SOURCE.read_bytes()
    built = []
    for checkout in ("a", "b"):
        source = tmp_path / checkout / cpu_attention.SOURCE.name
        source.parent.mkdir()
        source.write_bytes(code)
        done = subprocess.run([sys.executable, "-c", BUILD_FROM, str(source)], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        directory = Path(done.stdout.strip())
        library = next(directory.glob("*.so"))
        built.append((directory, library, library.stat().st_mtime_ns))
    assert built[0] == built[1]  # the same folder and library, not rebuilt for the second checkout
    assert (built[0][0] / cpu_attention.SOURCE.name).read_bytes() == code
    other = tmp_path / "c" / cpu_attention.SOURCE.name
    other.parent.mkdir()
    other.write_bytes(code + b"// another version\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_attention, "SOURCE", other)
        patch.setenv("TANDEM_HOME", str(tmp_path / "home"))  # a copy, not built: left in the test's folder
        assert cpu_attention._build_source().parent.name != built[0][0].name
