"""The first formatted request after a server starts, with llguidance's tokenizer built as the server starts
(core.formats.build_in_background) against built by that request: `tandem serve` with the real pair, in-process and
over Ray pools, on two checkouts given as their `services` directories (before, after), run in the order
before, after, after, before. Each server is asked, 5 s after it is ready (a client arriving soon after a rollout),
for a JSON-schema request, then another schema, then an unformatted one, each greedy, 8 tokens, through the client;
the first formatted request's extra seconds are its latency less the second's.

    PYTHONPATH=services python docs/bench/format-tokenizer-ahead-v1.py OLD/services NEW/services out.json
"""
import json
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.local_cluster import serve_process
from tandem.client import TandemClient

SCHEMAS = [{"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}}, "required": ["name"]},
           {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["n", "ok"]}]
CHAT = [("user", "Describe a colour as JSON.")]
MODES = {"in-process": ["--in-process"], "ray-pools": []}  # Ray: one draft worker, one target replica
PAIR = ["--target", "qwen2.5-coder-1.5b-instruct", "--draft", "qwen2.5-coder-0.5b-instruct", "--dtype", "auto"]


def timed(client: TandemClient, **format_args) -> float:
    started = time.perf_counter()
    client.generate_result(chat=CHAT, temperature=0, max_tokens=8, **format_args)
    return round(time.perf_counter() - started, 3)


def sitting(services: str, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as scratch, \
            serve_process(PAIR + MODES[mode], Path(scratch) / "serve.log", pythonpath=services) as (address, ready):
        time.sleep(5)
        with TandemClient(address, timeout=600) as client:
            first, second = (timed(client, response_format={"type": "json_schema", "json_schema": {
                "name": f"s{i}", "schema": schema}}) for i, schema in enumerate(SCHEMAS))
            free = timed(client)
    return {"services": services, "mode": mode, "ready_s": ready, "first_formatted_s": first,
            "second_formatted_s": second, "unformatted_s": free, "first_extra_s": round(first - second, 3)}


before, after, out = sys.argv[1:4]
runs = []
for mode in MODES:
    for label, services in (("before", before), ("after", after), ("after", after), ("before", before)):
        runs.append({"label": label} | sitting(services, mode))
        print(json.dumps(runs[-1]), flush=True)
summary = {f"{mode}/{label}": sorted(r["first_extra_s"] for r in runs if r["mode"] == mode and r["label"] == label)
           for mode in MODES for label in ("before", "after")}
Path(out).write_text(json.dumps({"runs": runs, "first_extra_s": summary}, indent=1) + "\n")
print(json.dumps(summary))
