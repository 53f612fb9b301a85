"""Predicted outputs on the real pair: code edits (rename an identifier, whole code back) with the original code as
the prediction, against the same requests without one. Four engines in one process on CPU, bf16, eager, 2 threads:
the target alone and the pair under AUTO (calibrated), each with and without the prediction; greedy, up to 320
tokens. Per repeat the order of the four rotates and runs forwards then backwards. Reports tok/s per engine over all
runs, each pairing's speedup, the accepted and refused predicted tokens, and whether each output equals the target
alone's without a prediction (bf16: a verify forward and a one-token forward round differently, so near-ties may
part them; the float32 exactness is tests/test_prediction.py's).

    PYTHONPATH=services python docs/bench/predicted-outputs-v1.py REPEATS OUT.json   # about 12 min for 2 on CPU-A
"""

from __future__ import annotations

import json
import sys
import time

import torch

from tandem.core.config import EngineConfig, SamplingParams
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair

EDITS = [
    ("total", "amount", '''def order_total(items, discount):
    total = 0.0
    for item in items:
        total += item.price * item.quantity
    if discount:
        total -= total * discount
    return round(total, 2)
'''),
    ("node", "current", '''def find_path(graph, start, goal):
    queue = [[start]]
    seen = {start}
    while queue:
        path = queue.pop(0)
        node = path[-1]
        if node == goal:
            return path
        for neighbour in graph.get(node, []):
            if neighbour not in seen:
                seen.add(neighbour)
                queue.append(path + [neighbour])
    return None
'''),
    ("line", "row", '''def parse_csv(text, separator=","):
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = [field.strip() for field in line.split(separator)]
        rows.append(fields)
    return rows
'''),
    ("count", "hits", '''class RateLimiter:
    def __init__(self, limit, window):
        self.limit = limit
        self.window = window
        self.count = 0
        self.started = 0.0

    def allow(self, now):
        if now - self.started >= self.window:
            self.started = now
            self.count = 0
        if self.count < self.limit:
            self.count += 1
            return True
        return False
'''),
]


def main(repeats: int, out: str) -> None:
    torch.set_num_threads(2)
    draft, target = load_pair("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct",
                              device=torch.device("cpu"), dtype=torch.bfloat16, progress=False)
    tokenizer = target.tokenizer
    prompts, predictions = [], []
    for old, new, code in EDITS:
        ask = (f"Rename `{old}` to `{new}` in this code. Reply with the whole code in one python code block and "
               f"nothing else.\n\n```python\n{code}```")
        prompts.append(encode_prompt(tokenizer, ask, chat=True))
        predictions.append(tokenizer.encode(f"```python\n{code}```", add_special_tokens=False))
    target_only = build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=8192)
    pair = build_engine(target, draft, EngineConfig(), kv_tokens=8192)
    engines = {"plain": (target_only, False), "plain+prediction": (target_only, True),
               "auto": (pair, False), "auto+prediction": (pair, True)}
    params = SamplingParams(temperature=0.0, max_tokens=320)

    def run(name: str, index: int) -> dict:
        engine, predicted = engines[name]
        started = time.perf_counter()
        request_id = engine.add_request(prompts[index], params, prediction=predictions[index] if predicted else None)
        seq = engine.sequence(request_id)
        while engine.has_unfinished():
            engine.step()
        seconds = time.perf_counter() - started
        result = engine.result(seq)
        return {"prompt": index, "s": round(seconds, 3), "tokens": len(result.token_ids), "ids": result.token_ids,
                **{key: result.stats[key] for key in ("rounds", "drafted", "accepted", "predicted_rounds",
                                                      "accepted_prediction_tokens", "rejected_prediction_tokens")}}

    for name in engines:  # untimed: first calls
        run(name, 0)
    names = list(engines)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        for name in order + order[::-1]:
            for index in range(len(prompts)):
                runs[name].append(run(name, index))
                print(name, {k: v for k, v in runs[name][-1].items() if k != "ids"}, flush=True)
    reference = {r["prompt"]: r["ids"] for r in runs["plain"]}
    summary = {}
    for name, items in runs.items():
        summary[name] = {
            "tok_s": round(sum(r["tokens"] for r in items) / sum(r["s"] for r in items), 3),
            "accepted_prediction_tokens": sum(r["accepted_prediction_tokens"] for r in items),
            "rejected_prediction_tokens": sum(r["rejected_prediction_tokens"] for r in items),
            "same_as_plain": sum(r["ids"] == reference[r["prompt"]] for r in items), "runs": len(items),
        }
    speedups = {"plain+prediction / plain": summary["plain+prediction"]["tok_s"] / summary["plain"]["tok_s"],
                "auto+prediction / plain": summary["auto+prediction"]["tok_s"] / summary["plain"]["tok_s"],
                "auto / plain": summary["auto"]["tok_s"] / summary["plain"]["tok_s"],
                "auto+prediction / auto": summary["auto+prediction"]["tok_s"] / summary["auto"]["tok_s"]}
    result = {"summary": summary, "speedups": {k: round(v, 3) for k, v in speedups.items()},
              "outputs": {str(i): tokenizer.decode(ids) for i, ids in reference.items()},
              "runs": {name: [{k: v for k, v in r.items() if k != "ids"} for r in items]
                       for name, items in runs.items()}}
    print(json.dumps({"summary": summary, "speedups": result["speedups"]}, indent=1))
    with open(out, "w") as sink:
        json.dump(result, sink, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
