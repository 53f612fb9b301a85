"""Prepacked linears (core.packed_linear) against the models as Hugging Face builds them (`--eager`), one sitting.

The real pair loaded twice in one dtype, once packed and once eager, and per layout: plain decoding and AUTO at batch
1 (the prompts one by one, the four engines in a rotating order per prompt), then N requests at once through plain
decoding (one generate call; the layouts alternated A B B A over two turns). Greedy, chat-templated prompts; tok/s =
generated tokens / wall seconds, prefill included. Also whether every packed run's token ids equal the eager run's.

    python -m tandem.bench.packing --dtype float32 --num-prompts 4 --max-tokens 32 --json packing.json
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from tandem.bench.prompts import DEFAULT_PROMPTS, PROMPT_SETS, load_prompts
from tandem.cli.common import add_bench_model_options
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, add_prompts_option, write_json
from tandem.core import bf16_linear
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.packed_linear import holds, supported, weight_bytes
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_model

LAYOUTS = ("packed", "eager")


def _timed(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float, list[list[int]]]:
    started = time.perf_counter()
    results = engine.generate(prompts, params)
    return sum(len(r.token_ids) for r in results), time.perf_counter() - started, [r.token_ids for r in results]


def packable_dtype(parser: argparse.ArgumentParser, args: argparse.Namespace, onednn: bool = True) -> torch.dtype:
    """Sets torch's threads and returns the asked dtype; a usage error where oneDNN cannot pack it on this CPU (with
    `onednn` False: where neither oneDNN nor tandem's bf16 kernel holds it, core.packed_linear.holds)."""
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not (supported(dtype) if onednn else holds(bf16_linear.PANEL, dtype, torch.device("cpu"))):
        parser.error(f"{'oneDNN' if onednn else 'neither oneDNN nor tandem'} cannot pack {args.dtype} weights on "
                     f"this CPU: nothing to compare")
    return dtype


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    add_bench_model_options(parser, "float32", "both models' dtype (one oneDNN packs here)")
    add_prompts_option(parser, PROMPT_SETS, DEFAULT_PROMPTS)
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts at batch 1")
    parser.add_argument("--batch", type=int, default=8, help="requests at once (the first N prompts)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)

    dtype = packable_dtype(parser, args)
    cpu = torch.device("cpu")
    models = {layout: tuple(load_model(name, device=cpu, dtype=dtype, progress=False, eager=layout == "eager")
                            for name in (args.target, args.draft)) for layout in LAYOUTS}
    texts = load_prompts(args.prompts)
    tokenizer = models["packed"][0].tokenizer
    prompts = [encode_prompt(tokenizer, text, chat=True) for text in texts[: args.num_prompts]]
    batch = [encode_prompt(tokenizer, texts[i % len(texts)], chat=True) for i in range(args.batch)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engines = {}
    for layout, (target, draft) in models.items():
        engines[f"plain_b1_{layout}"] = build_engine(target, None, EngineConfig(spec=SpecConfig(enabled=False),
                                                                                max_batch=1))
        engines[f"auto_b1_{layout}"] = build_engine(target, draft, EngineConfig(max_batch=1))
    runs: dict = {name: {"tokens": 0, "seconds": 0.0, "outputs": []} for name in engines}
    for engine in engines.values():  # warm-up, untimed
        engine.generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=4))
    names = list(engines)
    for i, ids in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            tokens, seconds, outputs = _timed(engines[name], [ids], greedy)
            runs[name]["tokens"] += tokens
            runs[name]["seconds"] += seconds
            runs[name]["outputs"] += outputs
    del engines
    for layout in LAYOUTS + LAYOUTS[::-1]:
        target = models[layout][0]
        engine = build_engine(target, None, EngineConfig(spec=SpecConfig(enabled=False), max_batch=args.batch,
                                                         calibrate=False))
        tokens, seconds, outputs = _timed(engine, batch, greedy)
        run = runs.setdefault(f"plain_b{args.batch}_{layout}", {"tokens": 0, "seconds": 0.0, "outputs": outputs})
        run["tokens"] += tokens
        run["seconds"] += seconds
    for run in runs.values():
        run["tok_s"] = round(run["tokens"] / run["seconds"], 3)
        run["seconds"] = round(run["seconds"], 2)
    report: dict = {"config": {"target": args.target, "draft": args.draft, "dtype": args.dtype, "threads": args.threads,
                               "max_tokens": args.max_tokens, "prompts": len(prompts), "batch": args.batch,
                               "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                               "target_weight_bytes": weight_bytes(models["packed"][0].model)}}
    report |= runs
    report["packed_vs_eager"] = {mode: round(runs[f"{mode}_packed"]["tok_s"] / runs[f"{mode}_eager"]["tok_s"], 3)
                                 for mode in ("plain_b1", "auto_b1", f"plain_b{args.batch}")}
    report["same_outputs"] = {mode: runs[f"{mode}_packed"]["outputs"] == runs[f"{mode}_eager"]["outputs"]
                              for mode in ("plain_b1", "auto_b1", f"plain_b{args.batch}")}
    write_json(args.json, report)
    for mode, ratio in report["packed_vs_eager"].items():
        print(f"{mode:10s} packed {runs[mode + '_packed']['tok_s']:7.2f} tok/s, eager "
              f"{runs[mode + '_eager']['tok_s']:7.2f} tok/s: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
