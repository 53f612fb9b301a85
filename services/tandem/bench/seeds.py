"""Seeds on the real pair: identical token ids with speculation on and off, and what each acceptance rule accepts.

For every dtype asked for: N seeded sampled requests (--prompts as chat messages, seeds 0..N-1) decoded plainly, then
with a fixed k of 2 and 6; counts the requests whose token ids equal plain decoding's. Then the acceptance rate of
drafted tokens (k fixed at 4) under the two rules on the same prompts: clients' seeds (drafter-invariant Gumbel-max:
a draft is kept when it equals the target's seeded choice) and engine seeds (min(1, p/q)). One JSON out.

    python -m tandem.bench.seeds --requests 100 --tokens 64 --dtypes float32 bfloat16 --json seeds.json
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem.bench.prompts import DEFAULT_PROMPTS, PROMPT_SETS, load_prompts
from tandem.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET
from tandem.cli.options import (
    STDOUT,
    DefaultsHelpFormatter,
    add_json_option,
    add_prompts_option,
    wants_text,
    write_json,
)
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_model

TARGET, DRAFT = DEFAULT_TARGET, DEFAULT_DRAFT


def _params(seed: int | None, tokens: int, engine_seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, engine_seed=engine_seed, max_tokens=tokens,
                          ignore_eos=True)


def _config(k: int | None, batch: int) -> EngineConfig:
    if k is None:
        return EngineConfig(max_batch=batch, calibrate=False)
    return EngineConfig(spec=SpecConfig(adaptive=False, k_max=k, k_init=k), max_batch=batch, calibrate=False)


def check(dtype: torch.dtype, requests: int, tokens: int, batch: int, parts: list[str], log,
          texts: list[str]) -> dict:
    target = load_model(TARGET, device=torch.device("cpu"), dtype=dtype, progress=False)
    draft = load_model(DRAFT, device=torch.device("cpu"), dtype=dtype, progress=False)
    prompts = [encode_prompt(target.tokenizer, texts[i % len(texts)], chat=True) for i in range(requests)]
    seeded = [_params(seed, tokens) for seed in range(requests)]
    out: dict = {}
    if "identity" in parts:
        out |= _identity(target, draft, prompts, seeded, batch, log)
    if "acceptance" in parts:
        out["acceptance_k4"] = _acceptance(target, draft, prompts, seeded, tokens, batch, log)
    return out


def _identity(target, draft, prompts, seeded, batch: int, log) -> dict:
    """Per k, how many seeded requests give exactly plain decoding's token ids."""
    requests, out = len(prompts), {}
    plain = [r.token_ids for r in build_engine(target, None, _config(None, batch)).generate(prompts, seeded)]
    log("plain done")
    for k in (2, 6):
        results = build_engine(target, draft, _config(k, batch)).generate(prompts, seeded)
        same = sum(r.token_ids == p for r, p in zip(results, plain, strict=True))
        first_diff = [next((i for i, (a, b) in enumerate(zip(r.token_ids, p, strict=False)) if a != b), None)
                      for r, p in zip(results, plain, strict=True)]
        out[f"k{k}"] = {"identical": same, "requests": requests,
                        "acceptance": sum(r.stats["accepted"] for r in results)
                        / max(1, sum(r.stats["drafted"] for r in results)),
                        "first_differing_token": [d for d in first_diff if d is not None]}
        log(f"k{k}: {same}/{requests} identical")
    return out


def _acceptance(target, draft, prompts, seeded, tokens: int, batch: int, log) -> dict:
    """Share of drafted tokens accepted (k fixed at 4) under each rule, same prompts."""
    requests, rates = len(prompts), {}
    for rule, params in (("seeded_gumbel", seeded),
                         ("unseeded_min_p_over_q", [_params(None, tokens, engine_seed=s) for s in range(requests)])):
        results = build_engine(target, draft, _config(4, batch)).generate(prompts, params)
        rates[rule] = sum(r.stats["accepted"] for r in results) / max(1, sum(r.stats["drafted"] for r in results))
        log(f"acceptance {rule}: {rates[rule]:.3f}")
    return rates


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--requests", type=int, default=100, help="seeded requests per dtype")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--batch", type=int, default=16, help="requests per engine step")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="model dtypes to check")
    parser.add_argument("--parts", nargs="+", default=["identity", "acceptance"], choices=["identity", "acceptance"],
                        help="what to measure")
    add_prompts_option(parser, PROMPT_SETS, DEFAULT_PROMPTS)
    add_json_option(parser, "the report (a file is rewritten after each dtype)")
    parser.set_defaults(json="seed-check.json")
    args = parser.parse_args(argv)
    texts = load_prompts(args.prompts)
    started = time.perf_counter()

    def log(message: str) -> None:
        if wants_text(args):
            print(f"[{time.perf_counter() - started:7.1f}s] {message}", flush=True)

    report = {"target": TARGET, "draft": DRAFT, "requests": args.requests, "tokens": args.tokens,
              "sampling": {"temperature": 0.8, "top_p": 0.95}, "torch_threads": torch.get_num_threads()}
    for name in args.dtypes:
        report[name] = check(getattr(torch, name), args.requests, args.tokens, args.batch, args.parts, log, texts)
        if args.json != STDOUT:  # a run cut short still leaves the dtypes it finished
            write_json(args.json, report)
    report["wall_seconds"] = time.perf_counter() - started
    write_json(args.json, report)
    log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
