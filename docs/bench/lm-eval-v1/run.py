"""lm-evaluation-harness (its own client, `local-completions`: token-id prompts, echo, logprobs 1, max_tokens 1)
scoring a small local multiple-choice task through `tandem serve --in-process` (the real pair, float32, speculation
AUTO) against the same harness running the target itself through transformers (`hf`, float32) on the same files:
accuracy of each, and per choice how far tandem's summed log-likelihood is from transformers'.

    python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm-eval[api,hf]" torch
    PYTHONPATH=services python docs/bench/lm-eval-v1/run.py /tmp/lmeval/bin/lm_eval docs/bench/lm-eval-v1.json
"""
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tandem.models.loader import resolve

HERE = Path(__file__).resolve().parent
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
lm_eval, out = sys.argv[1], sys.argv[2]
hf_dir = resolve(TARGET, progress=False).path
env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
common = ["--include_path", str(HERE), "--tasks", "pyexpr", "--log_samples", "--batch_size", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def harness(model: str, model_args: str, where: Path) -> tuple[dict, float]:
    started = time.monotonic()
    subprocess.run([lm_eval, "--model", model, "--model_args", model_args, *common, "--output_path", str(where)],
                   env={k: v for k, v in env.items() if k != "PYTHONPATH"}, check=True, cwd=HERE.parent.parent.parent)
    seconds = time.monotonic() - started
    samples = [json.loads(line) for f in glob.glob(str(where / "**" / "samples_pyexpr_*.jsonl"), recursive=True)
               for line in Path(f).read_text().splitlines()]
    return {s["doc_id"]: s for s in samples}, seconds


with tempfile.TemporaryDirectory() as scratch, open(Path(scratch) / "serve.log", "w") as log:
    scratch = Path(scratch)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tandem", "serve", "--target", TARGET, "--draft", DRAFT,
                               "--in-process", "--dtype", "float32", "--port", "0", "--http-port", str(port),
                               "--metrics-port", "-1"], env=env, stderr=log)
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (scratch / "serve.log").read_text()[-3000:]
            time.sleep(2)
        tandem, tandem_s = harness("local-completions", f"model={TARGET},base_url=http://127.0.0.1:{port}/v1/completions,"
                                   f"tokenizer_backend=huggingface,tokenizer={hf_dir},num_concurrent=1,max_retries=1",
                                   scratch / "tandem")
    finally:
        server.terminate()
        server.wait(timeout=120)
    hf, hf_s = harness("hf", f"pretrained={hf_dir},dtype=float32", scratch / "hf")

def loglikelihoods(sample: dict) -> list[float]:
    """Each choice's summed log-likelihood: filtered_resps holds [log-likelihood, is greedy] per choice."""
    return [float(r[0] if isinstance(r, list | tuple) else r) for r in sample["filtered_resps"]]


rows, diffs = [], []
for doc_id in sorted(tandem):
    ours, theirs = (loglikelihoods(samples[doc_id]) for samples in (tandem, hf))
    diffs += [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    rows.append({"doc_id": doc_id, "target": tandem[doc_id]["target"], "tandem": ours, "hf": theirs,
                 "same_pick": max(range(len(ours)), key=ours.__getitem__) == max(range(len(theirs)),
                                                                                  key=theirs.__getitem__)})
report = {"items": len(rows), "acc_tandem": sum(tandem[d]["acc"] for d in tandem) / len(tandem),
          "acc_hf": sum(hf[d]["acc"] for d in hf) / len(hf), "same_pick": sum(r["same_pick"] for r in rows),
          "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs),
          "harness_seconds": {"tandem": round(tandem_s, 1), "hf": round(hf_s, 1)}, "rows": rows}
Path(out).write_text(json.dumps(report, indent=1) + "\n")
print(json.dumps({k: v for k, v in report.items() if k != "rows"}))
