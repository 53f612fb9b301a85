"""Compiled static forwards on a CPU: the forward that CUDA graphs record on a GPU (core.cuda_graphs: fixed buckets,
the buffers under a mask, compiled by torch.compile with dynamic shapes), run here without the capture. The
same greedy tokens as the eager runner and Hugging Face's generate in float32, for batched rows of different lengths
and a lone row, plain and speculative; a seed gives the same tokens; cache growth compiles nothing new.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental import _config as fx_config

from tandem.core import packed_linear
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.cuda_graphs import WINDOW_ALIGN, GraphedForward
from tandem.core.engine import SpeculativeEngine
from tandem.core.fused_linear import FusedPart
from tandem.core.guardless import GuardMismatch
from tandem.core.local import LocalDrafter, LocalVerifier
from tandem.core.packed_linear import MIN_PACKED_WEIGHTS, supported
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model

# One worker for the module: its compiles are in-process, so later tests reuse the earlier tests' graphs.
pytestmark = pytest.mark.xdist_group("compiled_forward")
PROMPTS = [list(range(3, 3 + n)) for n in (5, 19, 33, 11)]


def run(tiny_models, compile: bool, prompts: list[list[int]], k: int | None, params: SamplingParams | None = None,
        kv_tokens: int = 4096, decode_steps: int = 1) -> tuple[list[list[int]], list[ModelRunner]]:
    target, draft, _ = tiny_models
    runners = [ModelRunner(target.model, kv_tokens=kv_tokens, compile=compile)]
    spec = SpecConfig(enabled=False) if k is None else SpecConfig(k_max=k, k_init=k, adaptive=False)
    if k is not None:
        runners.append(ModelRunner(draft.model, kv_tokens=kv_tokens, compile=compile))
    engine = SpeculativeEngine(LocalVerifier(runners[0]), LocalDrafter(runners[1]) if k is not None else None,
                               EngineConfig(spec=spec, calibrate=False, max_batch=len(prompts),
                                            decode_steps=decode_steps))
    params = params or SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, params)], runners


def hf_greedy(tiny_models, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = tiny_models[0].model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                        min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def count_kernel_calls(monkeypatch, module, name: str) -> list[int]:
    """Counts of `module.name`'s calls (a custom op's Python kernel) inside each compiled forward that runs from now
    on, one entry per forward: 0 where the generated code calls oneDNN itself."""
    compiled_forward, kernel, calls, inside = GraphedForward._body, getattr(module, name), [], [False]

    def marked(graphs: GraphedForward, graph, length: int) -> torch.Tensor:
        calls.append(0)
        inside[0] = True
        try:
            return compiled_forward(graphs, graph, length)
        finally:
            inside[0] = False

    def counted(*args) -> torch.Tensor:
        if inside[0]:
            calls[-1] += 1
        return kernel(*args)

    monkeypatch.setattr(GraphedForward, "_body", marked)
    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_compiled_runner_pads_rows_of_different_widths_as_its_layout_prices_them(tiny_models) -> None:
    """Rows of widths 3, 1, 1, 1 run as one static forward padded to 3 (one graph per bucket and width), not packed
    as the eager runner runs them; the layout the batch plan prices rounds with says so (core.row_layout)."""
    target, _, _ = tiny_models
    compiled, eager = (ModelRunner(target.model, kv_tokens=4096, compile=flag) for flag in (True, False))
    widths = [3, 1, 1, 1]
    for runner in (compiled, eager):
        states = [runner.state(f"widths-{row}") for row in range(len(widths))]
        for row, state in enumerate(states):
            state.sync(0, list(range(3 + row, 40 + row)))
            runner.prefill(state, len(state.tokens))
            state.sync(len(state.tokens), list(range(50, 50 + widths[row])))
        replays = compiled.graphs.replays
        runner.forward_on_device(states, [1] * len(states))
        assert compiled.graphs.replays == replays + (runner is compiled)  # the compiled one ran its static forward
    assert compiled.layout.priced_width(widths) == 3.0
    assert compiled.layout.priced_rows(3, 3) == 4 and compiled.layout.priced_rows(3, 17) == 3  # its bucket; eager
    assert eager.layout.priced_rows(3, 3) == 3
    assert eager.layout.padded_up_to == 0 and eager.layout.priced_width(widths) == 1.5  # packed: its tokens alone
    assert eager.layout.packs(len(widths), len(widths) * 3, sum(widths))


@pytest.mark.slow
@pytest.mark.parametrize("k", [None, 1, 4])
def test_compiled_forwards_give_the_eager_and_hf_greedy_tokens(tiny_models, k) -> None:
    for prompts in (PROMPTS, PROMPTS[1:2]):  # rows of different lengths, then a lone row
        compiled, runners = run(tiny_models, True, prompts, k)
        eager, plain_runners = run(tiny_models, False, prompts, k)
        assert compiled == eager == [hf_greedy(tiny_models, p, 40) for p in prompts]
        assert all(r.graphs is not None and r.graphs.compiled and r.graphs.replays > 0 for r in runners)
        assert all(r.graphs.compile_error is None and r.graphs.captures == 0 for r in runners)  # no CUDA here
        assert all(r.graphs is None for r in plain_runners)


@pytest.mark.slow
def test_compiled_forwards_skip_the_guards_once_their_class_has_run(tiny_models, monkeypatch) -> None:
    """After a shape class's first forward, its compiled code runs without dynamo's guard check (core.guardless).
    The guards, checked anyway in the tests (tests/conftest.py), pick that same graph on every later forward: here
    batched rows, the target's drafted width and the draft's widths of 1 and 2. Planted: a class key that leaves out
    the width fails."""
    compiled, runners = run(tiny_models, True, PROMPTS, 4)
    assert compiled == run(tiny_models, False, PROMPTS, 4)[0]
    for runner in runners:
        guardless = runner.graphs.guardless
        assert guardless.direct  # every class's first call found its graph
        assert guardless.direct_calls == runner.graphs.replays - len(guardless.direct) > 0
        for direct in guardless.direct.values():  # the sizes it reads, it reads without dynamo's wrapper
            helpers = direct.__globals__["__import_torch_dot__dynamo_dot_utils"]
            assert helpers.call_size is not torch._dynamo.utils.call_size
            assert helpers.call_size(torch.zeros(2, 3), 1) == 3
    monkeypatch.setattr(GraphedForward, "shape_class", lambda graphs, graph: (graph.rows == 1,))
    with pytest.raises(GuardMismatch, match="another compiled graph"):
        run(tiny_models, True, PROMPTS, 4)


def symbolic_inputs(layer: torch.nn.Module, x: torch.Tensor) -> int:
    """How many symbolic sizes dynamo passes to the graph it compiles for `layer(x)` under dynamic shapes."""
    found = []

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        found.extend(node for node in graph_module.graph.nodes
                     if node.op == "placeholder" and isinstance(node.meta.get("example_value"), torch.SymInt))
        return graph_module.forward

    torch.compile(layer, backend=backend, dynamic=True, fullgraph=True)(x)  # a new layer: compiled anew
    return len(found)


@pytest.mark.parametrize("kind", ["packed", "w8a8"])
def test_a_layers_held_weights_take_no_symbolic_sizes(kind, monkeypatch) -> None:
    """Packed and w8a8 layers hold their weights, scales and biases as plain attributes, which dynamic shapes
    would give symbolic sizes of their own: read and passed to the graph on every forward, hundreds a model. Marked
    fixed, only the input's sizes are symbolic. Planted: without the marks, the weights' sizes are symbolic too.
    (Int8Linear's weights need no marks: the kernel's own shape checks specialise their sizes.)"""
    from tandem.core import w8a8_linear

    if kind == "w8a8" and not w8a8_linear.supported():
        pytest.skip("oneDNN's int8 GEMM does not run here")
    if kind == "packed" and not supported(torch.float32):
        pytest.skip("oneDNN cannot pack float32 here")
    linear = torch.nn.Linear(64, 48)
    build = {"packed": packed_linear.PackedLinear.from_linear, "w8a8": w8a8_linear.W8A8Linear.from_linear}[kind]
    x = torch.randn(3, 64)
    assert 0 < symbolic_inputs(build(linear), x) <= x.dim()  # the input's rows at least: a graph was compiled
    monkeypatch.setattr(torch._dynamo, "mark_static", lambda tensor: None)
    assert symbolic_inputs(build(linear), x) > x.dim()


@pytest.mark.slow
def test_a_pytorch_without_dynamos_cache_entries_keeps_the_guarded_calls(tiny_models, monkeypatch) -> None:
    """Where dynamo's cache entries cannot be read (another PyTorch), the compiled forwards still run, guarded."""
    monkeypatch.delattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list")
    compiled, runners = run(tiny_models, True, PROMPTS[1:2], 4)
    assert compiled == [hf_greedy(tiny_models, PROMPTS[1], 40)]
    assert all(r.graphs.compiled and r.graphs.replays > 0 and r.graphs.guardless.direct_calls == 0 for r in runners)


@pytest.mark.slow
@pytest.mark.parametrize("thread", ["built_on", "another"])
def test_sizes_equal_when_a_graph_compiles_stay_apart_and_duck_sizing_stays_on(tiny_models, monkeypatch,
                                                                              thread) -> None:
    """2 rows of 2 tokens compile the class of several rows and tokens; 4 rows of 2 and 2 rows of 3 then run the
    same graph, with the tokens of an uncompiled runner. With duck sizing, PyTorch's default, that graph would take
    its rows and its width for one size, and the guards (checked on every call in the tests) would pick another
    graph for the later calls. The runner turns it off only while its forwards trace (cuda_graphs.with_trace_settings),
    on whichever thread they run: PyTorch keeps the setting per thread (the gateway builds runners on its loader
    thread and serves on its engine loops'). The process keeps PyTorch's default."""
    monkeypatch.setattr(fx_config, "use_duck_shape", True)
    torch._dynamo.reset()
    model = tiny_models[0].model
    runners = {"compiled": ModelRunner(model, kv_tokens=4096, compile=True),
               "eager": ModelRunner(model, kv_tokens=4096)}
    graphs = counters["stats"]["unique_graphs"]
    if thread == "another":
        with ThreadPoolExecutor(1) as pool:
            pool.submit(_forwards_of_three_shapes, runners).result()
    else:
        _forwards_of_three_shapes(runners)
    assert runners["compiled"].graphs.replays == 3
    assert counters["stats"]["unique_graphs"] == graphs + 1
    assert fx_config.use_duck_shape


def _forwards_of_three_shapes(runners: dict[str, ModelRunner]) -> None:
    for rows, width in ((2, 2), (4, 2), (2, 3)):
        logits = {}
        for name, runner in runners.items():
            states = [runner.state(f"duck-{row}") for row in range(rows)]
            for row, state in enumerate(states):
                state.sync(0, [3 + (5 * row + i) % 50 for i in range(20 + 3 * row + width)])
                runner.prefill(state, 20 + 3 * row)
            logits[name] = runner.forward(states, [width] * rows)
            for row in range(rows):
                runner.release(f"duck-{row}")
        assert [row.argmax(-1).tolist() for row in logits["compiled"]] == [row.argmax(-1).tolist()
                                                                          for row in logits["eager"]]


@pytest.mark.slow
def test_attention_reads_only_the_positions_the_rows_reach(tiny_models, monkeypatch) -> None:
    """Without CUDA graphs a compiled forward's attention reads the buffers up to the furthest position its rows
    reach, rounded up to WINDOW_ALIGN, not the capacity a long sequence holds (a retained session's, so the cache
    keeps it); the tokens stay greedy's."""
    target = tiny_models[0]
    runner = ModelRunner(target.model, kv_tokens=4096, compile=True)
    long = runner.state("long", session="chat")
    long.sync(0, [3 + i % 40 for i in range(700)])
    runner.prefill(long, 700)
    runner.release("long", retain=True)
    assert runner.cache.capacity >= 700
    windows: list[int] = []
    body = runner.graphs._body
    monkeypatch.setattr(runner.graphs, "_body", lambda graph, length: windows.append(length) or body(graph, length))
    state = runner.state("short")
    prompt = PROMPTS[1]  # 19 tokens
    state.sync(0, prompt)
    runner.prefill(state, len(prompt) - 1)
    tokens = []
    for _ in range(50):  # past 64 positions: the window grows once
        logits = runner.forward_on_device([state], [1])
        tokens.append(int(logits[-1].argmax()))
        state.sync(len(state.tokens), [tokens[-1]])
    assert tokens == hf_greedy(tiny_models, prompt, 50)
    assert set(windows) == {WINDOW_ALIGN, 2 * WINDOW_ALIGN} and windows == sorted(windows)
    assert runner.graphs.compiled and runner.graphs.compile_error is None and runner.cache.capacity >= 700


@pytest.mark.slow
def test_compiled_multi_step_decoding_feeds_each_choice_into_the_static_forward(tiny_models) -> None:
    """core.decode_steps through the static forwards: each step's choices copied into the bucket's fixed ids on
    the device (GraphedForward.run's `on_slots`), rows of different lengths, then a lone row."""
    for prompts in (PROMPTS, PROMPTS[1:2]):
        blocks, runners = run(tiny_models, True, prompts, None, decode_steps=6)
        assert blocks == [hf_greedy(tiny_models, p, 40) for p in prompts]
        assert runners[0].graphs.compiled and runners[0].graphs.replays > 0


@pytest.mark.slow
def test_a_seed_gives_the_same_tokens_compiled_or_not(tiny_models) -> None:
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=24, ignore_eos=True) for s in range(4)]
    outputs = [run(tiny_models, compile, PROMPTS, k, params=params)[0] for compile in (True, False) for k in (None, 4)]
    assert outputs[0] == outputs[1] == outputs[2] == outputs[3]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_and_fused_models_compile(tiny_dirs, monkeypatch, dtype) -> None:
    """Prepacked linears reach inductor as one opaque op (its own lowering of oneDNN's packed product failed in bf16,
    and every compiled forward of a packed model then ran uncompiled). Float32: the eager tokens, plain and k 4; bf16
    (not held to exactness): compiled, no fallback, the same shape of output. In bf16 the compiled code calls
    oneDNN's product itself, never the op's Python kernel; float32 keeps the kernel (its one-row case)."""
    if not supported(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    monkeypatch.setitem(MIN_PACKED_WEIGHTS, torch.float32, 0)  # the tiny layers are below the float32 limit
    calls = count_kernel_calls(monkeypatch, packed_linear, "_product")
    models = tuple(load_model(str(path), device=torch.device("cpu"), dtype=dtype, progress=False)
                   for path in (tiny_dirs.target, tiny_dirs.draft)) + (None,)
    assert any(isinstance(m, FusedPart) for m in models[0].model.modules())
    for k in (None, 4):
        compiled, runners = run(models, True, PROMPTS, k)
        assert all(r.graphs.compiled and r.graphs.compile_error is None and r.graphs.replays > 0 for r in runners)
        eager, _ = run(models, False, PROMPTS, k)
        if dtype == torch.float32:
            assert compiled == eager
        else:
            assert [len(tokens) for tokens in compiled] == [len(tokens) for tokens in eager]
    assert calls and (all(count > 0 for count in calls) if dtype == torch.float32 else not any(calls))


@pytest.mark.slow
def test_warm_up_compiles_every_class_of_bucket_before_the_first_request(tiny_models, monkeypatch, capsys) -> None:
    """Last in the module: it clears dynamo's caches, so the warm-up must compile. It warms both models on another
    thread than the one that serves, as the gateway's loader does: twelve graphs of the runners' shared forward
    (six classes each), past PyTorch's recompile limit of 8, which the runner raises around its own forwards on
    whichever thread they trace (core.cuda_graphs.with_trace_settings). Serving afterwards (lone and batched rows,
    plain and speculative) compiles nothing more, nor do new runners whose cache reallocates. PyTorch's duck sizing
    and recompile limit stay as they were on both threads. Eager runners have nothing to warm. Asked to, a runner
    counts the classes on a progress bar."""
    from torch._dynamo import config as dynamo_config

    target, draft, _ = tiny_models
    monkeypatch.setattr(fx_config, "use_duck_shape", True)  # PyTorch's default
    monkeypatch.setattr(dynamo_config, "recompile_limit", 8)  # PyTorch's default
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    runners = [ModelRunner(model.model, kv_tokens=4096, compile=True) for model in (target, draft)]

    def warm_up() -> tuple[list[int], bool, int]:
        counts = [runner.warm_up(progress=runner is runners[0]) for runner in runners]  # one bar, as on a terminal
        return counts, fx_config.use_duck_shape, dynamo_config.recompile_limit

    with ThreadPoolExecutor(1) as loader:
        assert loader.submit(warm_up).result() == ([6, 6], True, 8)
    bars = capsys.readouterr().err
    assert re.search(rf"compiling {type(target.model).__name__}: .*[1-6]/6 \[", bars)  # counted as classes compile
    assert counters["stats"]["unique_graphs"] == graphs + 12
    assert not any(runner.states for runner in runners) and runners[0].kv_tokens_used == 0
    graphs = counters["stats"]["unique_graphs"]
    engine = SpeculativeEngine(LocalVerifier(runners[0]), LocalDrafter(runners[1]),
                               EngineConfig(spec=SpecConfig(k_max=4, k_init=4, adaptive=False), calibrate=False))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert len(engine.generate(PROMPTS, greedy)) == len(engine.generate(PROMPTS[:1], greedy)) + 3
    assert counters["stats"]["unique_graphs"] == graphs
    # New runners whose cache reallocates twice (so its buffers change shape) reuse the same graphs.
    params = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
    compiled, grown = run(tiny_models, True, [PROMPTS[0]], 4, params=params, kv_tokens=2048)
    assert grown[0].cache.capacity >= 600 > 256  # grew from the first allocation
    assert counters["stats"]["unique_graphs"] == graphs
    assert compiled == [hf_greedy(tiny_models, PROMPTS[0], 600)]
    assert fx_config.use_duck_shape and dynamo_config.recompile_limit == 8
    assert ModelRunner(target.model, compile=False).warm_up() == 0


@pytest.mark.slow
def test_a_w8a8_draft_compiles(tiny_models, tiny_dirs, monkeypatch) -> None:
    """The int8 product reaches inductor as one opaque op, as the packed one does: the draft's forwards compile with
    no fallback, the tokens stay the target's, and the compiled code calls oneDNN's int8 GEMM itself, never the op's
    Python kernel."""
    from tandem.core import w8a8_linear

    if not w8a8_linear.supported():
        pytest.skip("oneDNN's int8 GEMM does not run here")
    calls = count_kernel_calls(monkeypatch, w8a8_linear, "_gemm")
    draft = load_model(str(tiny_dirs.draft), device=torch.device("cpu"), dtype=torch.float32, progress=False,
                       quantization="w8a8")
    models = (tiny_models[0], draft, None)
    compiled, runners = run(models, True, PROMPTS, 4)
    assert all(r.graphs.compiled and r.graphs.compile_error is None and r.graphs.replays > 0 for r in runners)
    assert compiled == run(models, False, PROMPTS, None)[0]
    assert calls and not any(calls)
