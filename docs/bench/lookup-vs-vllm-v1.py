"""tandem's prompt lookup against vLLM for CPU's n-gram speculation, one sitting, the systems alternated prompt by
prompt: the real pair in bf16, 2 threads each, greedy, batch 1, prefix caching off, both with tcmalloc and Intel's
OpenMP runtime preloaded (tandem.bench.vllm_compare's workers and environment; tandem eager, not compiled).

Two phases, one vLLM engine resident in each beside tandem's (both of vLLM's do not fit in 24 GiB with tandem):
  lookup  vLLM `speculative_config={"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
          "prompt_lookup_min": 2}` (8: tandem's k_max, the most a looked-up block drafts there too); tandem the target
          alone with --prompt-lookup (`lookup`), the pair with it (`hybrid`) and without (`auto`)
  plain   vLLM plain decoding; tandem plain decoding
Workloads: the 4 code edits of predicted-outputs-v1.py (no prediction sent, up to 320 tokens) and the 8 shipped
prompts (128 tokens). Per repeat each prompt runs on every mode of the phase back to back, the order reversed from
one prompt to the next. Reports tok/s per mode and workload (tokens without EOS / wall seconds), the ratios, vLLM's
n-gram acceptance counters, and each output against the same system's plain output.

    PYTHONPATH=services python docs/bench/lookup-vs-vllm-v1.py --vllm-python /tmp/vllm-venv/bin/python \
        --json lookup-vllm.json      # about 40 min on CPU-A
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import time
from types import SimpleNamespace

from tandem.bench.prompts import load_prompts
from tandem.bench.resident import Resident
from tandem.bench.vllm_compare_workers import TANDEM_SIDE, VLLM_SIDE, say, tandem_env, vllm_env, vllm_job

HERE = pathlib.Path(__file__).parent
PHASES = {"lookup": (("vllm", "ngram"), ("tandem", "lookup"), ("tandem", "hybrid"), ("tandem", "auto")),
          "plain": (("vllm", "plain"), ("tandem", "plain"))}
SETTLE_SECONDS = 1.5  # vLLM's worker busy-polls its queue for a second after each step (tandem.bench.vllm_compare)


def _edits() -> list[str]:
    """prompt-lookup-v1.py's code edits, the same text."""
    spec = importlib.util.spec_from_file_location("prompt_lookup_bench", HERE / "prompt-lookup-v1.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.edit_asks()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", required=True)
    cli = parser.parse_args()
    edits, fresh = _edits(), load_prompts()
    texts = edits + fresh
    workloads = {"edits": (range(len(edits)), 320), "fresh": (range(len(edits), len(texts)), 128)}
    args = SimpleNamespace(target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", k=8,
                           max_tokens=320, max_model_len=2048, dtype="bfloat16", threads=2, kv_space=2,
                           vllm_python=cli.vllm_python, tandem_no_preload=False)
    log = pathlib.Path(cli.json).with_suffix(".log")
    log.write_text("")
    say("loading tandem")
    tandem = Resident("tandem", TANDEM_SIDE, {
        "target": args.target, "draft": args.draft, "texts": texts, "max_tokens": args.max_tokens, "threads": 2,
        "dtype": "bfloat16", "compile": "none", "draft_quantization": "none", "draft_vocab": 0, "lookup": True},
        log, tandem_env(args), echo=("tandem ", "vllm "), say=say)
    loaded = {"tandem": tandem.loaded}
    runs: dict[str, dict[str, list[dict]]] = {w: {} for w in workloads}
    vjob = vllm_job(args, texts)
    try:
        for phase, modes in PHASES.items():
            say(f"loading vLLM for the {phase} phase")
            vllm = Resident(f"vllm_{phase}", [args.vllm_python, str(VLLM_SIDE)],
                            vjob | {"method": "ngram" if phase == "lookup" else ""}, log, vllm_env(args),
                            echo=("tandem ", "vllm "), say=say)
            loaded[f"vllm_{phase}"] = vllm.loaded
            workers = {"tandem": tandem, "vllm": vllm}
            try:
                for repeat in range(cli.repeats):
                    say(f"{phase} phase, repeat {repeat + 1}/{cli.repeats}")
                    for workload, (indices, max_tokens) in workloads.items():
                        for n, index in enumerate(indices):
                            order = modes if (n + repeat) % 2 == 0 else modes[::-1]
                            for system, mode in order:
                                time.sleep(SETTLE_SECONDS)
                                result = workers[system].ask({"mode": f"{mode}_b1", "prompts": [index],
                                                              "max_tokens": max_tokens})
                                runs[workload].setdefault(f"{system}_{mode}", []).append(
                                    {"prompt": index, "repeat": repeat, **result})
            finally:
                vllm.close()
    finally:
        tandem.close()
    summary, ratios = {}, {}
    for workload, by_mode in runs.items():
        summary[workload] = {}
        for name, items in by_mode.items():
            plain = {r["prompt"]: r["outputs"][0] for r in by_mode[f"{name.split('_')[0]}_plain"]}
            entry = {"tok_s": round(sum(r["tokens"] for r in items) / sum(r["seconds"] for r in items), 3),
                     "tok_s_each_repeat": [round(sum(r["tokens"] for r in items if r["repeat"] == k) / sum(
                         r["seconds"] for r in items if r["repeat"] == k), 3) for k in range(cli.repeats)],
                     "tokens": sum(r["tokens"] for r in items), "runs": len(items),
                     "same_as_own_plain": sum(r["outputs"][0] == plain[r["prompt"]] for r in items)}
            for key in ("accepted_lookup_tokens", "rejected_lookup_tokens", "lookup_rounds", "drafted", "accepted"):
                if key in items[0]:
                    entry[key] = sum(r[key] for r in items)
            if "spec_counters" in items[0]:
                entry["spec_counters"] = {key: sum(r["spec_counters"].get(key, 0) for r in items)
                                          for key in items[0]["spec_counters"]}
            summary[workload][name] = entry
        rate = {name: entry["tok_s"] for name, entry in summary[workload].items()}
        pairs = [("tandem_lookup", "vllm_ngram"), ("tandem_hybrid", "vllm_ngram"), ("tandem_plain", "vllm_plain"),
                 ("vllm_ngram", "vllm_plain"), ("tandem_lookup", "tandem_plain"), ("tandem_hybrid", "tandem_plain"),
                 ("tandem_hybrid", "tandem_auto"), ("tandem_auto", "tandem_plain")]
        ratios[workload] = {f"{a} / {b}": round(rate[a] / rate[b], 3) for a, b in pairs}
    report = {"summary": summary, "ratios": ratios, "systems": loaded, "log": str(log),
              "runs": {w: {m: [{k: v for k, v in r.items() if k != "outputs"} for r in items]
                           for m, items in by_mode.items()} for w, by_mode in runs.items()}}
    pathlib.Path(cli.json).write_text(json.dumps(report, indent=1))
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
