"""The GPU probe's models and timed runs (tandem.bench.gpu_probe): the real pair's shapes with random weights, tandem's
engine in each forward mode (MODES) and Hugging Face generate on the same weights, each run timed over a list of
prompts; and the datasheet bandwidths the probe and tandem.bench.row_products measure against.
"""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tandem.bench.gpu_measures import timed
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.engine import SpeculativeEngine
from tandem.core.local import LocalDrafter, LocalVerifier
from tandem.core.runner import ModelRunner

COMMON = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=True, hidden_act="silu", eos_token_id=None, pad_token_id=0)
CONFIGS = {  # the published Qwen2.5-Coder-*-Instruct config.json shapes
    "target": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                   num_key_value_heads=2),
    "draft": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2),
}
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}  # datasheet peaks (SXM)
MODES = {"compiled": dict(graphs=True, compile=True), "graphs": dict(graphs=True, compile=False),
         "eager": dict(graphs=False, compile=False)}


def build(role: str, device: torch.device, dtype: torch.dtype, **shape) -> Qwen2ForCausalLM:
    """The real pair's shapes with random weights; `shape` overrides fields (tests shrink the model)."""
    config = Qwen2Config(**(COMMON | CONFIGS[role] | shape))
    torch.manual_seed({"target": 1, "draft": 2}[role])
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def engine(target, draft, k: int | None, batch: int, mode: str = "compiled") -> SpeculativeEngine:
    """k None: plain; k 0: adaptive (AUTO, calibrated); k > 0: fixed k. `mode`: a key of MODES."""
    verifier = LocalVerifier(ModelRunner(target, cuda_graphs=MODES[mode]["graphs"], compile=MODES[mode]["compile"]))
    if k is None:
        return SpeculativeEngine(verifier, None, EngineConfig(max_batch=batch, calibrate=False))
    spec = SpecConfig(k_max=8 if k == 0 else k, k_init=4 if k == 0 else k, adaptive=k == 0)
    drafter = LocalDrafter(ModelRunner(draft, cuda_graphs=MODES[mode]["graphs"], compile=MODES[mode]["compile"]),
                           top_m=spec.draft_top_m,
                           confidence=spec.stop_confidence)
    return SpeculativeEngine(verifier, drafter, EngineConfig(spec=spec, max_batch=batch, calibrate=k == 0))


def run_tandem(target, draft, k, batch: int, work: list[list[int]], tokens: int, mode: str = "compiled") -> dict:
    eng = engine(target, draft, k, batch, mode)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    eng.generate([work[0][:32]], params)  # warm-up
    results = []
    seconds = 0.0
    for start in range(0, len(work), batch):
        group = work[start : start + batch]
        seconds += timed(lambda group=group: results.extend(eng.generate(group, params)))
    drafted = sum(r.stats.get("drafted", 0) for r in results)
    accepted = sum(r.stats.get("accepted", 0) for r in results)
    out = sum(len(r.token_ids) for r in results)
    graphs = [g for g in (eng.verifier.runner.graphs, eng.drafter and eng.drafter.runner.graphs) if g]
    return {"tok_s": out / seconds, "tokens": out, "seconds": seconds, "drafted": drafted, "accepted": accepted,
            "graph_captures": sum(g.captures for g in graphs), "graph_failures": sum(len(g.failed) for g in graphs),
            "compiled": [g.compiled for g in graphs], "compile_errors": [g.compile_error for g in graphs
                                                                         if g.compile_error]}


def hf_generate(model, work: list[list[int]], batch: int, tokens: int, assistant=None, **kwargs) -> dict:
    device = next(model.parameters()).device
    out = 0
    seconds = 0.0
    for start in range(0, len(work), batch):
        group = work[start : start + batch]
        width = max(map(len, group))
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(group):  # left padding, as generate expects for decoder-only models
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)

        def call(ids=ids, mask=mask):
            return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                                  do_sample=False, assistant_model=assistant, **kwargs)

        seconds += timed(call)
        out += len(group) * tokens
    return {"tok_s": out / seconds, "tokens": out, "seconds": seconds}

