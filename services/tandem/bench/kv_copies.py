"""KV copies per decode step: the previous runner (per-sequence DynamicCache) against the preallocated one, one JSON.

The previous runner is imported from a worktree of the commit before the KV cache change:

    git worktree add /tmp/old-runner b031b91
    python -m tandem.bench.kv_copies --json kv-copies.json                  # tiny target, float32
    python -m tandem.bench.kv_copies --model qwen-shape --dtype bfloat16 --contexts 256 1024

Per runner, batch and context: greedy decode steps (rows of slightly different lengths; --width tokens per row
and step, 1 for plain decoding, k + 1 for a verification), every allocation counted by tandem.bench.allocations.
`kv_copies_per_step` is the growth of bytes allocated per step between the two contexts over the growth of the live
KV: how many times a step copies the whole cache (0: only the new tokens' keys and values are written). The
attention kernel's own workspace (scores over the context) is left out of it and reported as
`attention_workspace_per_step`. `step_peak_kv_over_live` is 1 + the growth of a step's peak memory (above where the
step started) over the growth of the live KV: the KV memory a step needs, relative to the KV it holds; the raw
`step_peak_over_live` also counts activations and logits. `resident_over_live` is the KV storage held between
steps (the preallocated runner reserves capacity ahead, within its token budget) over the live KV.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch
import transformers

from tandem.bench.allocations import AllocationMeter
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, wants_text, write_json
from tandem.core.runner import ModelRunner

# sdpa, and core.cpu_attention's kernel (bf16 on an AVX-512 CPU), whose workspace lives outside torch's allocator
ATTENTION_OPS = ("aten::scaled_dot_product_attention", "tandem::decode_attention")
QWEN_SHAPE = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                  num_key_value_heads=2, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def old_runner_module(worktree: Path):
    path = worktree / "services" / "tandem" / "core" / "runner.py"
    if not path.exists():
        sys.exit(f"kv_copies: {path} is missing; run `git worktree add {worktree} b031b91` first")
    spec = importlib.util.spec_from_file_location("old_runner", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_runner"] = module
    spec.loader.exec_module(module)
    return module


def build_model(name: str, dtype: torch.dtype, layers: int, device: torch.device):
    if name == "tiny":
        import tempfile

        from tandem.models.loader import load_model
        from tandem.models.tiny import make_tiny

        pair = make_tiny(Path(tempfile.mkdtemp(prefix="kv-copies-")), seed=0)
        return load_model(str(pair.target), device=device, dtype=dtype, progress=False).model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with device:
        return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **QWEN_SHAPE)).to(dtype).eval()


def kv_bytes(runner) -> tuple[int, int]:
    """(live KV bytes, KV storage held) of either runner."""
    if hasattr(runner, "cache"):  # the preallocated runner
        per_token = runner.cache.reserved_bytes // max(runner.kv_tokens_reserved, 1)
        return runner.kv_tokens_used * per_token, runner.cache.reserved_bytes
    held = sum(t.numel() * t.element_size() for state in runner.states.values() for layer in state.cache.layers
               if getattr(layer, "is_initialized", False) for t in (layer.keys, layer.values))
    return held, held


def decode(runner, states, steps: int, width: int) -> None:
    for _ in range(steps):
        logits = runner.forward(states, [1] * len(states))
        for state, row in zip(states, logits, strict=True):
            state.tokens.extend([int(row[-1].argmax())] * width)


def measure(make_runner, batch: int, context: int, steps: int, vocab: int, width: int) -> dict:
    runner = make_runner()
    generator = torch.Generator().manual_seed(context)
    states = []
    for i in range(batch):
        state = runner.state(f"s{i}")
        state.sync(0, torch.randint(10, vocab, (context + 2 * i,), generator=generator).tolist())
        states.append(state)
    decode(runner, states, 2, width)  # prefill, then a first decode step (any capacity growth happens here)
    started = time.perf_counter()
    decode(runner, states, steps, width)
    seconds = (time.perf_counter() - started) / steps
    live, held = kv_bytes(runner)
    allocated, attention, peak, steady, growth = 0, 0, 0, 0, []
    for _ in range(steps):
        shape = _shape(runner)
        meter = AllocationMeter()
        with meter:
            decode(runner, states, 1, width)
        if _shape(runner) != shape:  # the cache grew: one copy of it, once per doubling, reported on its own
            growth.append(meter.allocated)
            continue
        steady += 1
        in_attention = sum(meter.by_op[op] for op in ATTENTION_OPS)
        attention += in_attention
        allocated += meter.allocated - in_attention
        peak = max(peak, meter.peak)
        top = dict(meter.by_op.most_common(4))
    return {"live_kv_bytes": live, "resident_kv_bytes": held, "allocated_per_step": allocated / steady,
            "attention_workspace_per_step": attention / steady, "step_peak_bytes": peak,
            "step_peak_over_live": (live + peak) / live, "resident_over_live": held / live, "step_seconds": seconds,
            "growth_steps_bytes": growth, "top_allocations_last_step": top}


def _shape(runner) -> tuple[int, int] | None:
    return (runner.cache.slots, runner.cache.capacity) if hasattr(runner, "cache") else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    add_json_option(parser, "the report")
    parser.set_defaults(json="kv-copies.json")
    parser.add_argument("--old", type=Path, default=Path("/tmp/old-runner"), help="worktree of the previous commit")
    parser.add_argument("--model", choices=["tiny", "qwen-shape"], default="tiny",
                        help="qwen-shape: random weights, Qwen2.5-Coder-1.5B layer shapes, --layers layers")
    parser.add_argument("--layers", type=int, default=2, help="layers of the qwen-shape model")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the model's dtype")
    parser.add_argument("--contexts", type=int, nargs=2, default=[128, 1024], help="the two context lengths compared")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes")
    parser.add_argument("--steps", type=int, default=8, help="decode steps measured per batch and context")
    parser.add_argument("--width", type=int, default=1, help="new tokens per row and step (k + 1 to verify)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--device", default="cpu", help="torch device")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    old = old_runner_module(args.old)
    device = torch.device(args.device)
    model = build_model(args.model, getattr(torch, args.dtype), args.layers, device)
    vocab = int(model.config.vocab_size)
    runners = {"previous": lambda: old.ModelRunner(model),
               "preallocated": lambda: ModelRunner(model, kv_tokens=max(args.batches) * (4 * max(args.contexts)))}
    report: dict = {"model": args.model, "dtype": args.dtype, "device": str(device), "torch": torch.__version__,
                    "transformers": transformers.__version__, "steps": args.steps, "width": args.width,
                    "contexts": args.contexts, "results": {}}
    lo, hi = args.contexts
    with torch.inference_mode():
        for name, make_runner in runners.items():
            for batch in args.batches:
                by_context = {c: measure(make_runner, batch, c, args.steps, vocab, args.width) for c in (lo, hi)}
                kv_growth = by_context[hi]["live_kv_bytes"] - by_context[lo]["live_kv_bytes"]

                def growth(key: str, by_context=by_context, kv_growth=kv_growth) -> float:
                    return (by_context[hi][key] - by_context[lo][key]) / kv_growth

                copies = growth("allocated_per_step")
                result = {"kv_copies_per_step": copies,
                          "kv_bytes_copied_per_step": {c: copies * by_context[c]["live_kv_bytes"] for c in (lo, hi)},
                          "step_peak_kv_over_live": 1 + growth("step_peak_bytes"),
                          "attention_workspace_per_step_over_live_kv": growth("attention_workspace_per_step"),
                          "resident_over_live": {c: by_context[c]["resident_over_live"] for c in (lo, hi)},
                          "by_context": by_context}
                report["results"][f"{name}_b{batch}"] = result
                if wants_text(args):
                    print(f"{name} batch {batch}: {copies:.3f} KV copies per step, step peak KV / live KV "
                          f"{result['step_peak_kv_over_live']:.2f}, resident / live "
                          + ", ".join(f"{by_context[c]['resident_over_live']:.2f} at {c}" for c in (lo, hi)),
                          flush=True)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
