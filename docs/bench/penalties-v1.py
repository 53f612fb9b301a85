"""What penalties and a logit bias cost: the real pair (float32, as `tandem generate` loads it on an AVX2 CPU), the
8 shipped chat prompts x 64 tokens, greedy, one request at a time, plain decoding and AUTO (calibrated), each
setting's order reversed on every other prompt; tok/s and (AUTO) acceptance per setting. Then the reshaping alone:
milliseconds per call of core.penalties on the target's full vocabulary for a verification of k + 1 = 5 positions
and for one draft step, at a context of 300 tokens.

- none: no penalty.
- repetition: repetition_penalty 1.1 (Qwen2.5's published generation config).
- openai: presence_penalty 0.5, frequency_penalty 0.5.

A penalized greedy output is another text than the unpenalized one, so the end-to-end ratios carry that too (other
acceptance, other stops); the per-call times are the reshaping's own cost.

    PYTHONPATH=services python docs/bench/penalties-v1.py penalties.json     # about 15 min on CPU-B
"""
import json
import sys
import time

import torch

from tandem.bench.prompts import load_prompts
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.penalties import draft_step_logits, verification_logits
from tandem.core.protocol import DraftRequest, VerifyRequest
from tandem.core.sequence import SequenceState
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair

SETTINGS = {"none": {}, "repetition": {"repetition_penalty": 1.1},
            "openai": {"presence_penalty": 0.5, "frequency_penalty": 0.5}}
TOKENS = 64


def reshaping_ms(vocab: int, fields: dict, calls: int = 50) -> dict:
    """Median milliseconds of one verification's (5 positions) and one draft step's reshaping."""
    params = SamplingParams(temperature=0.0, **fields)
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (300,), generator=generator).tolist()
    state = SequenceState(tokens=context + [11, 12, 13, 14])
    verify = [VerifyRequest("s", 0, [], None, params, output_start=200)]
    draft = [DraftRequest("s", 0, [], 4, params, output_start=200)]
    logits = {5: torch.randn(5, vocab, generator=generator), 1: torch.randn(1, vocab, generator=generator)}
    timings = {"verification_5": [], "draft_step": []}
    for _ in range(calls):
        started = time.perf_counter()
        verification_logits(logits[5], [5], verify, [state], [len(context)], [[11, 12, 13, 14]])
        timings["verification_5"].append(time.perf_counter() - started)
        started = time.perf_counter()
        draft_step_logits(logits[1], draft, [state])
        timings["draft_step"].append(time.perf_counter() - started)
    return {name: round(sorted(values)[len(values) // 2] * 1e3, 3) for name, values in timings.items()}


out = sys.argv[1]
torch.set_num_threads(2)
draft, target = load_pair("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"),
                          dtype=torch.float32, progress=False)
engines = {"plain": build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=4096),
           "auto": build_engine(target, draft, EngineConfig(spec=SpecConfig()), kv_tokens=4096)}
ids = [encode_prompt(target.tokenizer, text, chat=True) for text in load_prompts()]
for engine in engines.values():  # untimed: first calls of every shape
    engine.generate([ids[0]], SamplingParams(temperature=0.0, max_tokens=8))
totals = {(mode, name): [0, 0.0, 0, 0] for mode in engines for name in SETTINGS}  # tokens, seconds, drafted, accepted
for index, prompt in enumerate(ids):
    order = [(mode, name) for mode in engines for name in SETTINGS]
    for mode, name in order[:: 1 if index % 2 == 0 else -1]:
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, **SETTINGS[name])
        started = time.perf_counter()
        result = engines[mode].generate([prompt], params)[0]
        total = totals[(mode, name)]
        total[0] += len(result.token_ids)
        total[1] += time.perf_counter() - started
        total[2] += result.stats["drafted"]
        total[3] += result.stats["accepted"]
    print("prompt", index, flush=True)
report = {"prompts": len(ids), "max_tokens": TOKENS, "dtype": "float32", "threads": 2, "settings": {}}
for (mode, name), (tokens, seconds, drafted, accepted) in totals.items():
    none = totals[(mode, "none")]
    report["settings"][f"{mode}/{name}"] = {
        "tokens": tokens, "seconds": round(seconds, 2), "tok_s": round(tokens / seconds, 3),
        "vs_none": round((tokens / seconds) / (none[0] / none[1]), 4),
        "acceptance": round(accepted / drafted, 4) if drafted else None}
report["reshaping_ms"] = {name: reshaping_ms(target.model.config.vocab_size, fields)
                          for name, fields in SETTINGS.items() if fields}
print(json.dumps(report, indent=1))
with open(out, "w") as sink:
    json.dump(report, sink, indent=1)
