"""Packed rows (core.row_layout) against padded rows, one process, the real target in bf16, alternated per repeat:
- prompts: the 8 shipped prompts (chat-templated) arriving together, each scored for its first token in one forward
  (the verifier's time to first token for 8 at once);
- verify: 8 rows over ~300 cached tokens feeding uneven widths (a batched verification of drafts of different k);
- newcomer: 7 rows decoding one token each and a new 40-token prompt: packed, one forward scores all 8; padded, the
  prompt is prefilled alone first (the verifier's choice where packing is off), then the 8 score one token each.
Run: PYTHONPATH=services python docs/bench/packed-rows-v1.py REPEATS OUT.json"""
import json
import statistics
import sys
import time

import torch

torch.set_num_threads(2)
from tandem.bench.prompts import load_prompts  # noqa: E402
from tandem.core import runner as R  # noqa: E402
from tandem.engines.local import encode_prompt  # noqa: E402
from tandem.models.loader import load_model  # noqa: E402

target = load_model("qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"), dtype=torch.bfloat16, progress=False)
ids = [encode_prompt(target.tokenizer, t, chat=True) for t in load_prompts()[:8]]
runner = R.ModelRunner(target.model, kv_tokens=32768)
real = runner.layout
WIDTHS = {"verify_uneven": [5, 3, 1, 6, 2, 4, 1, 5], "verify_one_longer": [2, 1, 1, 1, 1, 1, 1, 1]}

def prompts(pack):
    states = [runner.state(f"p{i}") for i in range(8)]
    for state, p in zip(states, ids, strict=False):
        state.sync(0, p)
    t = time.perf_counter()
    logits = runner.forward_on_device(states, [1] * 8)
    s = time.perf_counter() - t
    for i in range(8):
        runner.release(f"p{i}")
    return s, logits.argmax(-1).tolist()

rows = [runner.state(f"r{i}") for i in range(8)]
for i, state in enumerate(rows):
    state.sync(0, [(7 + 13 * j + i) % runner.vocab_size for j in range(250 + 9 * i)])
runner.prefill_many(rows, [len(s.tokens) for s in rows])

def verify(widths):
    keep = [s.cached for s in rows]
    for state, w in zip(rows, widths, strict=False):
        state.sync(state.cached, [5] * w)
    t = time.perf_counter()
    logits = runner.forward_on_device(rows, widths)
    s = time.perf_counter() - t
    for state, k in zip(rows, keep, strict=False):
        state.sync(k, [])
    return s, logits.argmax(-1).tolist()

def newcomer(pack):
    keep = [s.cached for s in rows[:7]]
    new = runner.state("new")
    new.sync(0, ids[0][:40])
    for state in rows[:7]:
        state.sync(state.cached, [5])
    t = time.perf_counter()
    if not pack:
        runner.prefill(new, 39)
    logits = runner.forward_on_device([*rows[:7], new], [1] * 8)
    s = time.perf_counter() - t
    runner.release("new")
    for state, k in zip(rows[:7], keep, strict=False):
        state.sync(k, [])
    return s, logits.argmax(-1).tolist()

cases = {"prompts_8_at_once": prompts, "newcomer_beside_7_decoding": newcomer,
         **{name: (lambda pack, w=w: verify(w)) for name, w in WIDTHS.items()}}
seconds = {case: {"padded": [], "packed": []} for case in cases}
tokens = {}
for rep in range(-1, int(sys.argv[1]) if len(sys.argv) > 1 else 4):  # repeat -1 warms up, untimed
    for mode in (("packed", "padded") if rep % 2 == 0 else ("padded", "packed")):
        runner.layout = real if mode == "packed" else R.RowLayout(real.device_type, can_pack=False)
        for case, run in cases.items():
            s, first = run(mode == "packed")
            if rep >= 0:
                seconds[case][mode].append(s)
                tokens[(case, mode)] = first
        print(rep, mode, {c: round(v[mode][-1], 3) for c, v in seconds.items() if v[mode]}, flush=True)
runner.layout = real
report = {"what": __doc__, "machine": "CPU-A (2 vCPU AMD EPYC, AVX512-BF16, no AMX)", "torch_threads": 2,
          "prompt_lengths": [len(p) for p in ids], "widths": WIDTHS, "seconds": seconds,
          "median_seconds": {c: {m: statistics.median(v) for m, v in d.items()} for c, d in seconds.items()},
          "padded_over_packed_median_of_pairs": {c: statistics.median(a / b for a, b in
                                                                      zip(d["padded"], d["packed"], strict=False))
                                                 for c, d in seconds.items()},
          "greedy_tokens_equal": {c: tokens[(c, "packed")] == tokens[(c, "padded")] for c in cases}}
print(json.dumps({k: report[k] for k in ("median_seconds", "padded_over_packed_median_of_pairs",
                                         "greedy_tokens_equal")}, indent=1))
with open(sys.argv[2] if len(sys.argv) > 2 else "packed-rows.json", "w") as fh:
    json.dump(report, fh, indent=1)
