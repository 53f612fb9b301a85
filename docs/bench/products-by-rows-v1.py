"""What a wider step costs in products alone: every product layer of the packed bf16 target (oneDNN) called once on
random activations of N rows, the output head on one row, for each N in turn, the order rotated every round; prints
and writes each N's median seconds and the median of its per-round ratio to the first N's time.

    PYTHONPATH=services python docs/bench/products-by-rows-v1.py 8,16,24,32,1 12 products-by-rows-v1.json   # 2 min
"""
import json
import statistics
import sys
import time

import torch

from tandem.bench.forward_split import _products, product_layers
from tandem.models.loader import load_model

torch.set_num_threads(2)
rows_list = [int(rows) for rows in sys.argv[1].split(",")]
rounds = int(sys.argv[2])
model = load_model("qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"), dtype=torch.bfloat16,
                   progress=False).model
layers = product_layers(model)
jobs = {rows: _products(layers, model.get_output_embeddings(), rows, torch.bfloat16) for rows in rows_list}
times: dict[int, list[float]] = {rows: [] for rows in rows_list}
with torch.inference_mode():
    for job in jobs.values():  # untimed: first calls
        job()
    for step in range(rounds):
        for rows in rows_list[step % len(rows_list):] + rows_list[:step % len(rows_list)]:
            started = time.perf_counter()
            jobs[rows]()
            times[rows].append(time.perf_counter() - started)
first = times[rows_list[0]]
report = {str(rows): {"median_s": round(statistics.median(t), 5),
                      "over_first": round(statistics.median(a / b for a, b in zip(t, first, strict=True)), 3)}
          for rows, t in times.items()}
print(json.dumps(report, indent=1))
if len(sys.argv) > 3:
    with open(sys.argv[3], "w") as out:
        json.dump({"rows_first": rows_list[0], "rounds": rounds, "by_rows": report}, out, indent=1)
