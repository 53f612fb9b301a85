"""`tandem bench`: plain decoding, Hugging Face's own generate (plain and assisted) and tandem, same models, same run.

Methods are interleaved prompt by prompt so slow drift of the machine hits all of them alike.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import transformers
from tqdm import tqdm

from tandem.core.config import EngineConfig, SamplingParams
from tandem.core.costs import CostModel
from tandem.core.packed_linear import weight_bytes
from tandem.engines.local import build_engine, encode_prompt

METHODS = ("plain", "hf_plain", "hf_assisted", "tandem")
HF_METHODS = ("hf_plain", "hf_assisted")
# Hugging Face's own adaptive draft length (+2 after a fully accepted round, -1 otherwise), restarting at 5 on each
# call. Assisted generation reads it from the assistant's generation_config. transformers 5.23's default, 20 drafts
# a round cut where the assistant's confidence falls under 0.4 (fitted to past rounds only with scikit-learn
# installed), ran at 0.77x of this on the 6 code prompts (bf16, 64 tokens, one CPU thread), and a constant 5 at 1.03x.
HF_ASSISTANT = {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic_transient"}


@dataclass(slots=True)
class MethodTotals:
    tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "seconds": round(self.seconds, 6),
                "tok_s": round(self.tokens / self.seconds, 3) if self.seconds else 0.0}


@contextmanager
def assistant_settings(model, settings: dict) -> Iterator[None]:
    """Set generation_config attributes of an assistant for the block, then put the old values back."""
    config = model.generation_config
    saved = {key: getattr(config, key, None) for key in settings}
    for key, value in settings.items():
        setattr(config, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


def hf_generate(target, draft, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Hugging Face's own greedy generate, assisted by `draft` (with HF_ASSISTANT) unless it is None; the tokens up
    to the first EOS."""
    ids = torch.tensor([prompt_ids], device=target.model.device)
    # temperature/top_p/top_k/repetition_penalty=None drop whatever a generation_config.json sets for sampling,
    # so the call is plain greedy like the other methods (with do_sample=False none of the warpers would run, but
    # a repetition penalty would); HF stops at the generation config's EOS by itself.
    kwargs = {"assistant_model": draft.model} if draft is not None else {}
    with assistant_settings(draft.model, HF_ASSISTANT) if draft is not None else nullcontext():
        out = target.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, temperature=None,
            top_p=None, top_k=None, repetition_penalty=None,
            pad_token_id=target.tokenizer.pad_token_id or target.tokenizer.eos_token_id, **kwargs,
        )
    tokens = out[0, len(prompt_ids) :].tolist()
    eos = set(engine_eos(target))
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i]
    return tokens


def hf_description(target, draft) -> dict:
    """How the hf_* methods loaded and called Hugging Face's models, for the report."""
    model = target.model
    report = {
        "load": (f"tandem's loader with eager=True: AutoModelForCausalLM.from_pretrained(dir, "
                 f"dtype={str(model.dtype)[6:]}, attn_implementation={model.config._attn_implementation!r}), eval: "
                 f"the model as Hugging Face builds it, the same weights tandem runs"),
        "call": ("model.generate(ids, attention_mask=ones, max_new_tokens=max_tokens, do_sample=False, "
                 "temperature=None, top_p=None, top_k=None, repetition_penalty=None, pad_token_id=pad"
                 "[, assistant_model=draft]), otherwise defaults; the assistant's generation_config set as in "
                 "'assistant'; output cut at the first EOS"),
        "transformers": transformers.__version__,
    }
    if draft is not None:
        with assistant_settings(draft.model, HF_ASSISTANT):
            config = draft.model.generation_config
            defaults = config._get_default_generation_params()
            report["assistant"] = {key: defaults[key] if getattr(config, key, None) is None else getattr(config, key)
                                   for key in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                               "assistant_confidence_threshold")}
        # Without scikit-learn, assisted generation keeps the confidence threshold fixed instead of fitting it.
        report["assistant"]["threshold_adapts"] = transformers.utils.is_sklearn_available()
    return report


def engine_eos(loaded) -> frozenset[int]:
    from tandem.models.loader import eos_token_ids

    return eos_token_ids(loaded.model, loaded.tokenizer)


def analytic_bound(stats: dict, plain_seconds_per_token: float) -> dict:
    """S* = tau * T_t / (k * T_d + T_v(k)), every term measured in this run.

    T_t: plain decoding's seconds per token; T_d: the tandem run's draft seconds per drafted token; T_v: its verify
    seconds per round; tau and k: tokens and drafts per round, fallback rounds included (a multi-step round's tokens
    all count: its verify call ran a forward for each). The measured speedup divided by S* is then the share of
    tandem's time spent inside the two models' forwards.
    """
    rounds = stats["rounds"]
    tau = (stats["accepted"] + rounds + stats["block_tokens"]) / rounds
    k = stats["drafted"] / rounds
    t_draft = stats["draft_seconds"] / stats["drafted"] if stats["drafted"] else 0.0
    t_verify = stats["verify_seconds"] / rounds
    bound = tau * plain_seconds_per_token / (k * t_draft + t_verify)
    return {"bound": round(bound, 4), "tau_all_rounds": round(tau, 4), "k_all_rounds": round(k, 4),
            "t_target": round(plain_seconds_per_token, 5), "t_draft_measured": round(t_draft, 5),
            "t_verify_measured": round(t_verify, 5)}


SUMMED_STATS = ("accepted", "drafted", "spec_rounds", "fallback_rounds", "rounds", "block_tokens", "draft_seconds",
                "verify_seconds", "draft_failures")  # the requests' stats (core.stats) that add up across requests


def _merge_stats(all_stats: list[dict]) -> dict:
    merged: dict = {"rounds_by_k": {}} | {key: 0.0 if key.endswith("_seconds") else 0 for key in SUMMED_STATS}
    for stats in all_stats:
        for key in SUMMED_STATS:
            merged[key] += stats[key]
        for k, n in stats["rounds_by_k"].items():
            merged["rounds_by_k"][k] = merged["rounds_by_k"].get(k, 0) + n
    return merged


def run_bench(target, draft, prompts: list[str], max_tokens: int, methods: tuple[str, ...] = METHODS,
              config: EngineConfig | None = None, progress: bool = True, hf_models: tuple | None = None,
              kv_tokens: int = 0) -> dict:
    """`hf_models`: (target, draft) loaded the standard way for the hf_* methods, when tandem's own are prepared
    for its fast path (core.packed_linear); None runs Hugging Face on tandem's models. `kv_tokens`: the KV token
    budget of each of tandem's runners (0: a share of the memory free when it starts). Prefix caching is off: the
    chat prompts share the template's system prompt, which Hugging Face computes for every prompt."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    hf_target, hf_draft = hf_models or (target, draft)
    plain_engine = build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=kv_tokens, prefix_cache=False)
    tandem_engine = build_engine(target, draft, config or EngineConfig(), kv_tokens=kv_tokens, prefix_cache=False)
    encoded = [encode_prompt(target.tokenizer, p, chat=True) for p in prompts]
    runners = {
        "plain": lambda ids: plain_engine.generate([ids], greedy)[0].token_ids,
        "hf_plain": lambda ids: hf_generate(hf_target, None, ids, max_tokens),
        "hf_assisted": lambda ids: hf_generate(hf_target, hf_draft, ids, max_tokens),
        "tandem": lambda ids: tandem_engine.generate([ids], greedy)[0],
    }
    for method in methods:  # warm-up, untimed
        runners[method](encoded[0][:8])
    totals = {m: MethodTotals() for m in methods}
    tandem_stats: list[dict] = []
    for ids in tqdm(encoded, desc="bench", unit="prompt", disable=not progress):
        for method in methods:
            started = time.perf_counter()
            out = runners[method](ids)
            totals[method].seconds += time.perf_counter() - started
            if method == "tandem":
                tandem_stats.append(out.stats)
                out = out.token_ids
            totals[method].tokens += len(out)
            totals[method].outputs.append(out)
    weights = (weight_bytes(target.model), weight_bytes(draft.model) if draft is not None else 0)
    report = _report(totals, tandem_stats, tandem_engine.costs, prompts, max_tokens, weights)
    report["config"]["draft_quantization"] = getattr(draft, "quantization", "none") if draft is not None else None
    if any(m in HF_METHODS for m in methods):
        report["config"]["hf"] = hf_description(hf_target, hf_draft if "hf_assisted" in methods else None)
        report["config"]["hf"]["own_models"] = hf_models is not None
    return report


def weight_gb_s(weights: tuple[int, int], seconds: float, target_forwards: int, draft_forwards: int = 0) -> float:
    """Bytes of weights read per second (GB/s). A decode forward streams every weight once, so this against the
    machine's memory bandwidth says how close a method's forwards run to the limit: plain methods do one target
    forward per token; tandem one per round plus one draft forward per drafted token."""
    # 4 significant figures: a tiny test model's rate is a few MB/s
    return float(f"{(target_forwards * weights[0] + draft_forwards * weights[1]) / seconds / 1e9:.4g}")


def _report(totals: dict[str, MethodTotals], tandem_stats: list[dict], costs: CostModel, prompts: list[str],
            max_tokens: int, weights: tuple[int, int] = (0, 0)) -> dict:
    """`weights`: bytes of the target's and the draft's linear weights (core.packed_linear.weight_bytes)."""
    report: dict = {name: t.to_dict() for name, t in totals.items()}
    report["config"] = {"prompts": len(prompts), "max_tokens": max_tokens, "torch_threads": torch.get_num_threads(),
                        "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                        "torch": torch.__version__, "target_weight_bytes": weights[0], "draft_weight_bytes": weights[1]}
    for method in ("plain", "hf_plain"):
        if method in totals and totals[method].seconds:
            report[method]["weight_gb_s"] = weight_gb_s(weights, totals[method].seconds, totals[method].tokens)
    if "tandem" in totals:
        merged = _merge_stats(tandem_stats)
        if totals["tandem"].seconds:
            report["tandem"]["weight_gb_s"] = weight_gb_s(weights, totals["tandem"].seconds,
                                                          merged["rounds"] + merged["block_tokens"], merged["drafted"])
        spec_rounds = merged["spec_rounds"]
        report["tandem"] |= {
            "alpha": round(merged["accepted"] / merged["drafted"], 4) if merged["drafted"] else 0.0,
            "tau": round((merged["accepted"] + spec_rounds) / spec_rounds, 4) if spec_rounds else 0.0,
            "mean_k": round(merged["drafted"] / spec_rounds, 3) if spec_rounds else 0.0,
            "fallback_round_share": round(merged["fallback_rounds"] / merged["rounds"], 4) if merged["rounds"] else 0.0,
            "draft_failures": merged["draft_failures"],  # rounds decoded plainly because the drafter could not draft
            "rounds_by_k": merged["rounds_by_k"],
            "t_draft": round(costs.draft_step, 5),
            "t_verify": {k: round(costs.verify_time(int(k)), 5) for k in ["0", *merged["rounds_by_k"]]},
        }
        report["costs"] = costs.to_dict()
        if "plain" in totals and totals["plain"].tokens and merged["rounds"]:
            report |= analytic_bound(merged, totals["plain"].seconds / totals["plain"].tokens)
    for other in ("plain", "hf_plain", "hf_assisted"):
        if other in totals and "tandem" in totals and totals[other].tokens:
            report[f"tandem_vs_{other}"] = round(report["tandem"]["tok_s"] / report[other]["tok_s"], 4)
            same = sum(a == b for a, b in zip(totals["tandem"].outputs, totals[other].outputs, strict=True))
            report[f"greedy_identical_to_{other}"] = f"{same}/{len(prompts)}"
    # HF's own speedup, and HF's plain generate against tandem's plain runner.
    for method, base in (("hf_assisted", "hf_plain"), ("hf_plain", "plain")):
        if method in totals and base in totals and totals[method].tokens and totals[base].tokens:
            report[f"{method}_vs_{base}"] = round(report[method]["tok_s"] / report[base]["tok_s"], 4)
    if "tandem_vs_plain" in report and report.get("bound"):
        report["ratio_to_bound"] = round(report["tandem_vs_plain"] / report["bound"], 4)
    return report
