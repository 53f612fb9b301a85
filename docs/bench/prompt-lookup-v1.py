"""Prompt lookup on the real pair: drafts copied from each request's own context, against the same engines without
it and against Hugging Face's prompt lookup decoding. One process on CPU, bf16, 2 threads, greedy, prefix cache
off. Two workloads: code edits (the predicted-outputs bench's four renames, the whole code asked back, no prediction
sent: the copy is found in the prompt) and the 8 shipped prompts (code and chat written afresh, 128 tokens), where
there is little to copy. Engines: the target alone and the pair under AUTO (calibrated), each with and without
--prompt-lookup; Hugging Face's `generate` on a standard copy of the target, plain and with
`prompt_lookup_num_tokens=10` (its default n-gram size 2), on the edits only. Per repeat the order of the methods
rotates and runs forwards then backwards, prompt by prompt. Reports tok/s per method and workload, the ratios, the
looked-up tokens accepted and refused, and whether each output equals the target alone's (bf16: a verify forward and
a one-token forward round differently, so near-ties may part them; the float32 exactness is
tests/test_prompt_lookup.py's).

    PYTHONPATH=services python docs/bench/prompt-lookup-v1.py REPEATS OUT.json   # about 28 min for 1 on CPU-A
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import sys
import time

import torch

from tandem.bench.core import engine_eos
from tandem.bench.prompts import load_prompts
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_model, load_pair

HERE = pathlib.Path(__file__).parent
HF_LOOKUP_TOKENS = 10  # transformers' documented example value; its n-gram size stays at the default 2


def edit_asks() -> list[str]:
    """The code edits as asked: the predicted-outputs bench's four renames, the whole code asked back (also the
    edits lookup-vs-vllm-v1.py sends vLLM and tandem)."""
    spec = importlib.util.spec_from_file_location("predicted_outputs", HERE / "predicted-outputs-v1.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [f"Rename `{old}` to `{new}` in this code. Reply with the whole code in one python code block and nothing "
            f"else.\n\n```python\n{code}```" for old, new, code in module.EDITS]


def main(repeats: int, out: str) -> None:
    torch.set_num_threads(2)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    draft, target = load_pair("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", device=cpu, dtype=bf16,
                              progress=False)
    standard = load_model("qwen2.5-coder-1.5b-instruct", device=cpu, dtype=bf16, progress=False, eager=True)
    tokenizer = target.tokenizer
    asks = edit_asks()
    workloads = {"edits": ([encode_prompt(tokenizer, ask, chat=True) for ask in asks], 320),
                 "fresh": ([encode_prompt(tokenizer, p, chat=True) for p in load_prompts()], 128)}
    base = EngineConfig(max_batch=1)  # one stream at a time: calibration times single sequences alone
    lookup = dataclasses.replace(base, spec=SpecConfig(prompt_lookup=True))
    kv = {"kv_tokens": 8192, "prefix_cache": False}
    engines = {"plain": build_engine(target, None, dataclasses.replace(base, calibrate=False), **kv),
               "plain+lookup": build_engine(target, None, dataclasses.replace(lookup, calibrate=False), **kv),
               "auto": build_engine(target, draft, base, **kv)}
    # The same measured costs for both pairs (one calibration, shared as a served deployment's lanes share it).
    engines["auto+lookup"] = build_engine(target, draft, dataclasses.replace(lookup, calibrate=False),
                                          costs=engines["auto"].costs, **kv)
    eos = set(engine_eos(target))

    def tandem_run(name: str, prompt: list[int], max_tokens: int) -> dict:
        engine = engines[name]
        started = time.perf_counter()
        request_id = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        seq = engine.sequence(request_id)
        while engine.has_unfinished():
            engine.step()
        seconds = time.perf_counter() - started
        result = engine.result(seq)
        return {"s": round(seconds, 3), "tokens": len(result.token_ids), "ids": result.token_ids,
                **{key: result.stats[key] for key in ("rounds", "drafted", "accepted", "lookup_rounds",
                                                      "accepted_lookup_tokens", "rejected_lookup_tokens")}}

    def hf_run(name: str, prompt: list[int], max_tokens: int) -> dict:
        ids = torch.tensor([prompt])
        extra = {"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS} if name == "hf+lookup" else {}
        started = time.perf_counter()
        with torch.inference_mode():
            generated = standard.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                                do_sample=False, temperature=None, top_p=None, top_k=None,
                                                repetition_penalty=None, pad_token_id=tokenizer.eos_token_id, **extra)
        seconds = time.perf_counter() - started
        tokens = generated[0, len(prompt):].tolist()
        cut = next((i for i, token in enumerate(tokens) if token in eos), len(tokens))
        return {"s": round(seconds, 3), "tokens": cut, "ids": tokens[:cut]}

    methods = {"edits": [*engines, "hf", "hf+lookup"], "fresh": list(engines)}

    def run(workload: str, name: str, index: int) -> dict:
        prompts, max_tokens = workloads[workload]
        call = hf_run if name.startswith("hf") else tandem_run
        return {"prompt": index, **call(name, prompts[index], max_tokens)}

    for workload, names in methods.items():  # untimed: first calls
        for name in names:
            run(workload, name, 0)
    runs = {workload: {name: [] for name in names} for workload, names in methods.items()}
    for repeat in range(repeats):
        for workload, names in methods.items():
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            for index in range(len(workloads[workload][0])):
                for name in order + order[::-1]:
                    runs[workload][name].append(run(workload, name, index))
                    print(workload, name, {k: v for k, v in runs[workload][name][-1].items() if k != "ids"},
                          flush=True)
    summary, ratios = {}, {}
    for workload, by_name in runs.items():
        reference = {r["prompt"]: r["ids"] for r in by_name["plain"]}
        summary[workload] = {name: {
            "tok_s": round(sum(r["tokens"] for r in items) / sum(r["s"] for r in items), 3),
            "tokens": sum(r["tokens"] for r in items), "runs": len(items),
            "same_as_plain": sum(r["ids"] == reference[r["prompt"]] for r in items),
            **({key: sum(r[key] for r in items) for key in ("lookup_rounds", "accepted_lookup_tokens",
                                                              "rejected_lookup_tokens", "drafted", "accepted")}
               if not name.startswith("hf") else {}),
        } for name, items in by_name.items()}
        rate = {name: s["tok_s"] for name, s in summary[workload].items()}
        pairs = [("plain+lookup", "plain"), ("auto+lookup", "auto"), ("auto+lookup", "plain"), ("auto", "plain"),
                 ("auto+lookup", "plain+lookup"), ("hf+lookup", "hf"), ("plain+lookup", "hf+lookup"),
                 ("auto+lookup", "hf+lookup")]
        ratios[workload] = {f"{a} / {b}": round(rate[a] / rate[b], 3) for a, b in pairs if a in rate and b in rate}
    result = {"summary": summary, "ratios": ratios, "hf_lookup_tokens": HF_LOOKUP_TOKENS,
              "outputs": {workload: {str(r["prompt"]): tokenizer.decode(r["ids"]) for r in by_name["plain"][:8]}
                          for workload, by_name in runs.items()},
              "runs": {workload: {name: [{k: v for k, v in r.items() if k != "ids"} for r in items]
                                  for name, items in by_name.items()} for workload, by_name in runs.items()}}
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=1))
    with open(out, "w") as sink:
        json.dump(result, sink, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
