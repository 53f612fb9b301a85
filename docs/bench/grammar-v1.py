"""A client's grammar on the real pair: 8 chat prompts asking for a Python function's signature with type hints, greedy,
decoded with and without a GBNF grammar of such signatures (llama.cpp's syntax, which llguidance converts to its Lark),
plainly and with speculation (AUTO, and k fixed at 4). Reports how many outputs are such a signature (checked by
Python's own parser, not by the grammar), whether speculation gives plain decoding's token ids under the grammar, the
acceptance rate with and without it, tokens per second, and the time spent computing and applying the masks.

    PYTHONPATH=services python docs/bench/grammar-v1.py float32 grammar.json   # ~10 min on 2 cores

One pass, configurations in the order plain, AUTO, AUTO, plain (free, then with the grammar); k 4 last.
"""
import ast
import json
import sys
import time

import torch

from tandem.core.config import EngineConfig, OutputFormat, SamplingParams, SpecConfig
from tandem.engines.local import build_engine, encode_prompt
from tandem.models.loader import load_pair

GRAMMAR = r"""root ::= "def " name "(" params? ") -> " type ":"
params ::= param (", " param)*
param ::= name ": " type (" = " default)?
name ::= [a-z_] [a-z0-9_]{0,23}
type ::= simple | ("list[" type "]") | ("dict[" type ", " type "]") | ("tuple[" type ", ...]")
simple ::= "int" | "float" | "str" | "bool" | "bytes" | "None" | "object"
default ::= [0-9]{1,4} | "None" | "True" | "False" | "\"\""
"""
SNIPPETS = [
    "def add(a: int, b: int) -> int:\n    return a + b",
    "def read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() for line in f]",
    "def fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "def shout(text: str, times: int = 1) -> None:\n    print(text.upper() * times)",
    "def mean(xs: list[float]) -> float:\n    return sum(xs) / len(xs)",
    "def merge(a: dict, b: dict) -> dict:\n    out = dict(a)\n    out.update(b)\n    return out",
    "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
    "def save(items, path):\n    with open(path, 'w') as f:\n        json.dump(items, f)",
]
PROMPT = ("Write only the signature line of the Python function below, with type hints on every parameter and "
          "on the return value, and nothing else.\n\n```python\n{}\n```")
TOKENS = 64


def signature(text: str) -> bool:
    """Whether `text` is one `def` line with every parameter and the return annotated (Python's parser decides)."""
    try:
        tree = ast.parse(text.strip() + "\n    pass\n")
    except SyntaxError:
        return False
    if len(tree.body) != 1 or not isinstance(function := tree.body[0], ast.FunctionDef):
        return False
    return function.returns is not None and all(arg.annotation is not None for arg in function.args.args)


def timed(masks, sink: list[float]):
    """Wrap a side's FormatMasks.apply to add each call's seconds to `sink`."""
    apply = masks.apply

    def run(*args):
        started = time.perf_counter()
        out = apply(*args)
        sink.append(time.perf_counter() - started)
        return out
    masks.apply = run


dtype, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(2)
draft, target = load_pair("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", device=torch.device("cpu"),
                          dtype=getattr(torch, dtype), progress=False)
ids = [encode_prompt(target.tokenizer, PROMPT.format(code), chat=True) for code in SNIPPETS]
engines = {"plain": build_engine(target, None, EngineConfig(calibrate=False), kv_tokens=4096),
           "auto": build_engine(target, draft, EngineConfig(), kv_tokens=4096),
           "k4": build_engine(target, draft, EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False),
                              kv_tokens=4096)}
mask_seconds: dict[str, dict[str, list[float]]] = {}
for mode, engine in engines.items():
    mask_seconds[mode] = {"verify": [], "draft": []}
    timed(engine.verifier.formats, mask_seconds[mode]["verify"])
    if engine.drafter is not None:
        timed(engine.drafter.formats, mask_seconds[mode]["draft"])
fmt = OutputFormat("grammar", GRAMMAR)
engines["plain"].generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=4, output_format=fmt))  # warm
report: dict = {"dtype": dtype, "prompts": len(ids), "max_tokens": TOKENS, "grammar": GRAMMAR, "runs": {}}
outputs: dict[str, list[list[int]]] = {}
for mode, formatted in (("plain", False), ("auto", False), ("auto", True), ("plain", True), ("k4", True)):
    name = f"{mode}-{'grammar' if formatted else 'free'}"
    for sink in mask_seconds[mode].values():
        sink.clear()
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, output_format=fmt if formatted else None)
    started = time.perf_counter()
    results = engines[mode].generate(ids, params)
    seconds = time.perf_counter() - started
    outputs[name] = [r.token_ids for r in results]
    tokens = sum(len(r.token_ids) for r in results)
    drafted, accepted = sum(r.stats["drafted"] for r in results), sum(r.stats["accepted"] for r in results)
    texts = [target.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]
    report["runs"][name] = {
        "tokens": tokens, "seconds": round(seconds, 2), "tok_s": round(tokens / seconds, 3),
        "signatures": sum(signature(t) for t in texts), "finish": [r.finish_reason for r in results],
        "drafted": drafted, "accepted": accepted, "acceptance": round(accepted / drafted, 4) if drafted else None,
        "mask_ms_per_call": {side: round(1e3 * sum(s) / len(s), 3) for side, s in mask_seconds[mode].items() if s},
        "mask_ms_per_token": round(1e3 * sum(map(sum, mask_seconds[mode].values())) / tokens, 3),
        "texts": texts}
    print(name, {k: v for k, v in report["runs"][name].items() if k not in ("texts", "finish")}, flush=True)
report["identical_to_plain"] = {name: sum(a == b for a, b in zip(outputs[name], outputs[base], strict=True))
                                for name, base in (("auto-free", "plain-free"), ("auto-grammar", "plain-grammar"),
                                                   ("k4-grammar", "plain-grammar"))}
print(report["identical_to_plain"])
with open(out, "w") as sink:
    json.dump(report, sink, indent=1)
