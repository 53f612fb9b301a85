"""Per-token ITL of one session decoding alone, for several speculation settings, on the real pair in this process.

Each prompt runs through one engine per setting (plain, AUTO with draft confidence stops off, AUTO at 0.5 and 0.8),
the settings' order reversed on every other prompt; all engines share the cost model calibrated once. A step's
gap is divided over the tokens it committed, as loadtest does with streamed chunks.

    python -m tandem.bench.lone_itl --json docs/bench/lone-itl-v1.json     # about 12 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

import torch

from tandem.bench.prompts import load_prompts
from tandem.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, wants_text, write_json
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_model

SETTINGS = {
    "off": SpecConfig(k_max=0, k_init=0),
    "confidence-0": SpecConfig(draft_confidence=0.0),
    "confidence-0.5": SpecConfig(draft_confidence=0.5),
    "confidence-0.8": SpecConfig(draft_confidence=0.8),
}


def prompts() -> list[str]:
    """The bench's shipped set, then four of loadtest's chat prompts (their last message), for longer requests."""
    chat = resources.files("loadtest").joinpath("prompts", "chat.jsonl").read_text().splitlines()
    return load_prompts() + [json.loads(line)["messages"][-1]["content"] for line in chat[3:7]]


def lone_itls(engine, ids: list[int], params: SamplingParams) -> tuple[list[float], int, float]:
    request_id = engine.add_request(ids, params)
    itls, tokens, last, started = [], 0, None, time.perf_counter()
    while request_id in engine.sequences:
        for out in engine.step():
            now = time.perf_counter()
            count = len(out.new_token_ids)
            if last is not None and count:
                itls += [(now - last) / count] * count
            last, tokens = (now if count else last), tokens + count
    return itls, tokens, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * q), len(ordered) - 1)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    add_json_option(parser, "the ITL percentiles and tok/s per setting")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = (load_model(name, device=torch.device("cpu"), dtype=torch.bfloat16, progress=False)
                     for name in (DEFAULT_TARGET, DEFAULT_DRAFT))
    costs = build_engine(target, draft, EngineConfig()).costs
    engines = {}
    for name, spec in SETTINGS.items():
        engines[name] = build_engine(target, draft, EngineConfig(spec=spec, calibrate=False), costs=costs)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    itls = {name: [] for name in SETTINGS}
    totals = {name: [0, 0.0] for name in SETTINGS}
    for index, prompt in enumerate(prompts()):
        ids = encode_prompt(target.tokenizer, prompt, chat=True)
        for name in list(SETTINGS)[:: 1 if index % 2 == 0 else -1]:
            gaps, tokens, seconds = lone_itls(engines[name], ids, params)
            itls[name] += gaps
            totals[name][0] += tokens
            totals[name][1] += seconds
    report = {name: {"itl_p50": percentile(itls[name], 0.5), "itl_p90": percentile(itls[name], 0.9),
                     "itl_p99": percentile(itls[name], 0.99), "tok_s": totals[name][0] / totals[name][1],
                     "itls": len(itls[name])} for name in SETTINGS}
    if wants_text(args):
        print(json.dumps(report, indent=2))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
