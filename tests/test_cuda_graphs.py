"""CUDA graphs of decode forwards (core.cuda_graphs), compiled by torch.compile (the default) or not: the same tokens
as the eager runner and Hugging Face's generate.

Needs a GPU (skipped elsewhere); run on a lent one with `python -m pytest tests/test_cuda_graphs.py`.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.engine import SpeculativeEngine
from tandem.core.local import LocalDrafter, LocalVerifier
from tandem.core.runner import ModelRunner
from tandem.models.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def cuda_models(tiny_dirs):
    def load(path, dtype):
        return load_model(str(path), device=CUDA, dtype=dtype, progress=False)

    return {dtype: (load(tiny_dirs.target, dtype), load(tiny_dirs.draft, dtype))
            for dtype in (torch.float32, torch.bfloat16)}


def run(target, draft, graphs: bool, prompts: list[list[int]], k: int | None, max_tokens: int = 40,
        kv_tokens: int = 4096, compile: bool = True) -> tuple[list[list[int]], list[ModelRunner]]:
    verifier_runner = ModelRunner(target.model, kv_tokens=kv_tokens, cuda_graphs=graphs, compile=compile and graphs)
    runners = [verifier_runner]
    drafter = None
    spec = SpecConfig(enabled=False) if k is None else SpecConfig(k_max=k, k_init=k, adaptive=False)
    if k is not None:
        runners.append(ModelRunner(draft.model, kv_tokens=kv_tokens, cuda_graphs=graphs, compile=compile and graphs))
        drafter = LocalDrafter(runners[1])
    engine = SpeculativeEngine(LocalVerifier(verifier_runner), drafter,
                               EngineConfig(spec=spec, calibrate=False, max_batch=len(prompts)))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, params)], runners


def hf_greedy(target, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=CUDA)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [list(range(3, 3 + n)) for n in (5, 19, 33, 11)]


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "uncompiled"])
@pytest.mark.parametrize("k", [None, 1, 4])
def test_graphs_give_the_eager_and_hf_greedy_tokens_in_float32(cuda_models, k, compile) -> None:
    target, draft = cuda_models[torch.float32]
    for prompts in (PROMPTS, PROMPTS[1:2]):  # batched rows of different lengths, and a lone row
        graphed, runners = run(target, draft, True, prompts, k, compile=compile)
        eager, _ = run(target, draft, False, prompts, k)
        assert graphed == eager
        assert graphed == [hf_greedy(target, p, 40) for p in prompts]
        assert all(r.graphs is not None and r.graphs.replays > 0 and not r.graphs.failed for r in runners)
        assert all(r.graphs.compiled == compile and r.graphs.compile_error is None for r in runners)


def test_graphs_survive_cache_growth_and_single_rows(cuda_models) -> None:
    target, draft = cuda_models[torch.float32]
    # A small budget start: the cache reallocates as sequences grow past 256 tokens, and graphs are recaptured.
    graphed, runners = run(target, draft, True, [PROMPTS[0]], 4, max_tokens=300)
    assert graphed == [hf_greedy(target, PROMPTS[0], 300)]
    assert runners[0].graphs.captures >= 2
    assert not any(r.graphs.failed for r in runners)  # recaptures after growth succeed rather than run eagerly


def forced_logits(model, graphs: bool, compile: bool, prompts: list[list[int]],
                  forced: list[list[int]]) -> torch.Tensor:
    """Logits [steps, rows, V] in float32 of a runner fed the same tokens whatever it predicts (teacher forcing):
    each row's prompt, then `forced[row]` one token a step, all rows in one batched forward per step."""
    runner = ModelRunner(model, kv_tokens=4096, cuda_graphs=graphs, compile=compile)
    states = [runner.state(f"row-{row}") for row in range(len(prompts))]
    for state, prompt in zip(states, prompts, strict=True):
        state.sync(0, prompt)
        runner.prefill(state, len(prompt) - 1)
    steps = []
    for step in range(len(forced[0]) + 1):
        steps.append(torch.stack(runner.forward(states, [1] * len(states)))[:, 0])
        if step < len(forced[0]):
            for state, tokens in zip(states, forced, strict=True):
                state.sync(len(state.tokens), [tokens[step]])
    assert not graphs or (runner.graphs.replays > 0 and not runner.graphs.failed)
    return torch.stack(steps)


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "uncompiled"])
def test_bf16_graphs_are_as_accurate_as_eager(cuda_models, compile) -> None:
    """In bf16, graphs read the whole buffer under a mask where eager reads a view, and compiled kernels fuse and
    round differently, so a near-tie can part two greedy runs and every later token with it: counting equal tokens
    measures where the first tie fell, not the error. So both are fed the same tokens (float32's greedy ones), and
    the graphed logits must be about as close to float32's as the eager bf16 logits are."""
    target32, _ = cuda_models[torch.float32]
    target16, _ = cuda_models[torch.bfloat16]
    forced, _ = run(target32, None, False, PROMPTS, None, max_tokens=40)
    reference = forced_logits(target32.model, False, False, PROMPTS, forced)
    eager = forced_logits(target16.model, False, False, PROMPTS, forced) - reference
    graphed = forced_logits(target16.model, True, compile, PROMPTS, forced) - reference
    assert graphed.abs().max() <= 2 * eager.abs().max(), (graphed.abs().max(), eager.abs().max())
    assert graphed.abs().mean() <= 2 * eager.abs().mean(), (graphed.abs().mean(), eager.abs().mean())


def test_sampling_on_the_gpu_keeps_seeded_tokens_whatever_k(cuda_models) -> None:
    """Sampling and acceptance run on the GPU (one transfer per step): a client's seed gives the same tokens with
    speculation off and at k 1 and 4; unseeded sampled requests (min(1, p/q) on the device) complete."""
    target, draft = cuda_models[torch.float32]
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=24, ignore_eos=True) for s in range(4)]
    outputs = []
    for k in (None, 1, 4):
        spec = SpecConfig(enabled=False) if k is None else SpecConfig(k_max=k, k_init=k, adaptive=False)
        engine = SpeculativeEngine(LocalVerifier(ModelRunner(target.model)),
                                   None if k is None else LocalDrafter(ModelRunner(draft.model)),
                                   EngineConfig(spec=spec, calibrate=False, max_batch=4))
        outputs.append([r.token_ids for r in engine.generate(PROMPTS, seeded)])
    assert outputs[0] == outputs[1] == outputs[2]
    unseeded = [SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True) for _ in PROMPTS]
    engine = SpeculativeEngine(LocalVerifier(ModelRunner(target.model)), LocalDrafter(ModelRunner(draft.model)),
                               EngineConfig(spec=SpecConfig(k_max=4, k_init=4, adaptive=False), calibrate=False))
    results = engine.generate(PROMPTS, unseeded)
    assert all(len(r.token_ids) == 24 for r in results) and sum(r.stats["drafted"] for r in results) > 0


def _waits_for_the_gpu(call):
    """`call()`'s result, and the warnings torch's sync debug mode gave for each wait for the GPU inside it."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return result, [str(w.message) for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=16, ignore_eos=True),
], ids=["greedy", "seeded", "sampled"])
def test_a_plain_decode_step_waits_for_the_gpu_once(cuda_models, params) -> None:
    """One device-to-host transfer per step, and nothing else that waits for the GPU: torch's sync debug mode warns
    on every call that does (a blocking copy either way, .item(), .tolist(), ...). Once the step's graph is captured,
    a decode step waits once, for its outcome, so the head and the choice are queued while the forward still runs."""
    target, _ = cuda_models[torch.bfloat16]
    engine = SpeculativeEngine(LocalVerifier(ModelRunner(target.model, cuda_graphs=True, compile=False)), None,
                               EngineConfig(spec=SpecConfig(enabled=False), calibrate=False, max_batch=1))
    engine.add_request(PROMPTS[1], params)
    for _ in range(4):  # the prefill, then steps that capture the decode graph
        engine.step()
    _, waits = _waits_for_the_gpu(engine.step)
    assert len(waits) == 1, waits


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "uncompiled"])
def test_multi_step_decoding_gives_the_hf_greedy_tokens_and_waits_for_the_gpu_once_a_block(cuda_models,
                                                                                          compile) -> None:
    """core.decode_steps in CUDA graphs: each step's choices copied into the graph's ids on the GPU, so a block of 8
    tokens waits for the GPU once, for all of them, as one token did (test above)."""
    target, _ = cuda_models[torch.float32]
    runner = ModelRunner(target.model, cuda_graphs=True, compile=compile)
    engine = SpeculativeEngine(LocalVerifier(runner), None,
                               EngineConfig(spec=SpecConfig(enabled=False), calibrate=False, decode_steps=8))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == [hf_greedy(target, p, 40) for p in PROMPTS]
    assert runner.graphs.replays > 0 and not runner.graphs.failed
    engine.add_request(PROMPTS[1], params)
    for _ in range(3):  # the prefill, then blocks that capture the lone row's graph
        engine.step()
    emitted, waits = _waits_for_the_gpu(engine.step)
    assert len(emitted[0].new_token_ids) == 8 and len(waits) == 1, waits


@pytest.mark.parametrize("kernel", ["FLEX", "TRITON", "TRITON_WHOLE"])
@pytest.mark.parametrize("k", [None, 4])
def test_graphs_attending_with_flex_or_triton_give_the_hf_greedy_tokens_in_float32(cuda_models, k, kernel,
                                                                                   monkeypatch) -> None:
    """core.flex_decode (core.attention.FLEX) or core.triton_decode (TRITON) in the compiled graphs, after a long
    sequence left the cache a capacity far past the rows' lengths, so each row reads only its own live keys;
    TRITON_WHOLE: the Triton kernel at split 0, each row's keys walked by one block, in one kernel."""
    from tandem.core import attention

    target, draft = cuda_models[torch.float32]
    monkeypatch.setattr(attention, kernel.removesuffix("_WHOLE"), [True])
    if kernel == "TRITON_WHOLE":
        monkeypatch.setattr(attention, "TRITON_SPLIT", [0])
    long = [3 + i % 40 for i in range(700)]
    grown, runners = run(target, draft, True, [long, *PROMPTS[:2]], k, max_tokens=8)
    assert all(r.cache.capacity >= 700 for r in runners)
    assert grown == [hf_greedy(target, p, 8) for p in (long, *PROMPTS[:2])]
    assert all(r.graphs.compiled and r.graphs.compile_error is None and not r.graphs.failed for r in runners)


@pytest.mark.parametrize(("k", "kv_writes"), [(None, False), (4, False), (None, True)])
def test_graphs_with_one_row_products_give_the_hf_greedy_tokens_in_float32(cuda_models, k, kv_writes,
                                                                            monkeypatch) -> None:
    """core.triton_gemv's kernel (core.fused_linear.ROW_PRODUCTS) for every one-row product in the compiled graphs,
    the norms and q and k's rotation folded into it (with KV_WRITES, the cache's write too): lone rows (plain steps
    and draft steps, where it runs) and four rows at once (where cuBLAS does) give Hugging Face's tokens, computed
    before the kernel was turned on."""
    from tandem.core import fused_linear

    target, draft = cuda_models[torch.float32]
    expected = [hf_greedy(target, p, 24) for p in PROMPTS]
    monkeypatch.setattr(fused_linear, "ROW_PRODUCTS", [True])
    monkeypatch.setattr(fused_linear, "KV_WRITES", [kv_writes])
    lone = [run(target, draft, True, [p], k, max_tokens=24)[0][0] for p in PROMPTS[:2]]
    together, runners = run(target, draft, True, PROMPTS, k, max_tokens=24)
    assert lone == expected[:2] and together == expected
    assert all(r.graphs.compiled and r.graphs.compile_error is None and not r.graphs.failed for r in runners)


def test_bf16_graphs_with_one_row_products_are_as_accurate_as_eager(cuda_models, monkeypatch) -> None:
    """As test_bf16_graphs_are_as_accurate_as_eager, for one row (so every product of a step runs the kernel): the
    kernel's float32 sums and its folded norm's roundings keep the logits as close to float32's as eager bf16's."""
    from tandem.core import fused_linear

    target32, _ = cuda_models[torch.float32]
    target16, _ = cuda_models[torch.bfloat16]
    prompts = PROMPTS[1:2]
    forced, _ = run(target32, None, False, prompts, None, max_tokens=40)
    reference = forced_logits(target32.model, False, False, prompts, forced)
    eager = forced_logits(target16.model, False, False, prompts, forced) - reference
    monkeypatch.setattr(fused_linear, "ROW_PRODUCTS", [True])
    graphed = forced_logits(target16.model, True, True, prompts, forced) - reference
    assert graphed.abs().max() <= 2 * eager.abs().max(), (graphed.abs().max(), eager.abs().max())
    assert graphed.abs().mean() <= 2 * eager.abs().mean(), (graphed.abs().mean(), eager.abs().mean())
