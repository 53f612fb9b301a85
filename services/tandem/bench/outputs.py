"""Token ids the engine emits over a fixed matrix of runs, to check that a change left behaviour as it was.

Every speculation setting (plain, k fixed at 1, 3 and 6, adaptive) at batch 1 and batch N, greedy and seeded sampling
(temperature 0.8, top-p 0.95, one seed per prompt), on the shipped prompts. Lossless speculation and keyed seeds make
every run of a mode equal to plain decoding's; a JSON taken before a change must equal one taken after (`--compare`).

    tandem models make-tiny /tmp/tiny
    python -m tandem.bench.outputs --target /tmp/tiny/target --draft /tmp/tiny/draft --json before.json
    python -m tandem.bench.outputs --target /tmp/tiny/target --draft /tmp/tiny/draft --compare before.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tandem.bench.prompts import DEFAULT_PROMPTS, PROMPT_SETS, load_prompts
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, add_prompts_option, write_json

SETTINGS = ("plain", "k1", "k3", "k6", "auto")


def spec_for(setting: str):
    from tandem.core.config import SpecConfig

    if setting == "plain":
        return SpecConfig(enabled=False)
    if setting == "auto":
        return SpecConfig()
    return SpecConfig(adaptive=False, k_init=int(setting[1:]))


def run_matrix(target, draft, prompts: list[list[int]], max_tokens: int, batch: int) -> dict[str, list[list[int]]]:
    """{"SETTING/bBATCH/MODE": token ids per prompt} for every setting, batch 1 and `batch`, greedy and seeded."""
    from tandem.core.config import EngineConfig, SamplingParams
    from tandem.engines.local import build_engine

    modes = {
        "greedy": [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * len(prompts),
        "seeded": [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=max_tokens, ignore_eos=True)
                   for i in range(len(prompts))],
    }
    out: dict[str, list[list[int]]] = {}
    for setting in SETTINGS:
        for rows in sorted({1, batch}):
            engine = build_engine(target, draft, EngineConfig(spec=spec_for(setting), max_batch=rows))
            for mode, params in modes.items():
                out[f"{setting}/b{rows}/{mode}"] = [r.token_ids for r in engine.generate(prompts, params)]
    return out


def agreement(runs: dict[str, list[list[int]]]) -> dict[str, bool]:
    """Per run: whether it equals plain decoding at batch 1 in the same mode (lossless, seeds that reproduce)."""
    return {key: ids == runs[f"plain/b1/{key.rsplit('/', 1)[1]}"] for key, ids in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--target", required=True, help="target model (registry name, directory, GGUF or hub id)")
    parser.add_argument("--draft", required=True, help="draft model, same forms")
    parser.add_argument("--dtype", default="float32", help="float32 keeps greedy exact (bf16 rounds verify and decode "
                        "forwards differently)")
    add_prompts_option(parser, PROMPT_SETS, DEFAULT_PROMPTS)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--batch", type=int, default=8, help="the batched runs' rows")
    parser.add_argument("--compare", default=None, metavar="PATH", help="a JSON of an earlier run: exit 1 unless equal")
    add_json_option(parser, "the token ids of every run")
    args = parser.parse_args(argv)

    import torch

    from tandem.models.loader import load_model

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    target = load_model(args.target, device=torch.device("cpu"), dtype=dtype, progress=False)
    draft = load_model(args.draft, device=torch.device("cpu"), dtype=dtype, progress=False)
    prompts = [target.tokenizer(text)["input_ids"] for text in load_prompts(args.prompts)]
    runs = run_matrix(target, draft, prompts, args.max_tokens, args.batch)
    report = {"target": args.target, "draft": args.draft, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "agrees_with_plain": agreement(runs), "runs": runs}
    write_json(args.json, report)
    same = sum(agreement(runs).values())
    print(f"{same}/{len(runs)} runs equal plain decoding in their mode", file=sys.stderr)
    if args.compare is None:
        return 0
    before = json.loads(Path(args.compare).read_text())["runs"]
    changed = sorted(key for key in runs.keys() | before.keys() if runs.get(key) != before.get(key))
    print(f"against {args.compare}: {'identical' if not changed else 'changed: ' + ', '.join(changed)}",
          file=sys.stderr)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
