"""tandem.bench.vllm_compare's report: runs merged and pooled, the ratios against the issue's targets, each
system's speculation over its own plain decoding, and how alike the two systems' greedy outputs are."""

from __future__ import annotations


def merge(results: list[dict]) -> dict:
    """One mode's runs within a repeat (batch 1: one per prompt) as one: tokens over seconds, the outputs in order,
    the speculation counters summed (tandem's; vLLM's `spec_counters`, as drafted and accepted tokens)."""
    tokens, seconds = sum(r["tokens"] for r in results), sum(r["seconds"] for r in results)
    out = {"tokens": tokens, "seconds": round(seconds, 4), "tok_s": round(tokens / seconds, 3) if seconds else 0.0,
           "requests": sum(r["requests"] for r in results), "outputs": [o for r in results for o in r["outputs"]],
           "loadavg_1m_max": max(r["loadavg_1m"] for r in results)}
    counted = [k for k in ("rounds", "spec_rounds", "drafted", "accepted") if all(k in r for r in results)]
    out |= {k: sum(r[k] for r in results) for k in counted}
    if results and all(r.get("spec_counters") for r in results):
        out["drafted"] = int(sum(r["spec_counters"].get("spec_decode_num_draft_tokens", 0) for r in results))
        out["accepted"] = int(sum(r["spec_counters"].get("spec_decode_num_accepted_tokens", 0) for r in results))
    if out.get("drafted"):
        out["alpha"] = round(out["accepted"] / out["drafted"], 4)
    return out


def pool(runs: list[dict]) -> dict:
    """A mode's repeats pooled: tokens over seconds, plus each repeat's tok/s and their mean."""
    tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    each = [r["tok_s"] for r in runs]
    return {"tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 3) if seconds else 0.0,
            "tok_s_each": each, "tok_s_mean": round(sum(each) / len(each), 3),
            "tokens_each": [r["tokens"] for r in runs]}


def targets(batch: int) -> list[tuple[str, list[str], list[str], float | None]]:
    """(name, tandem modes, vLLM modes, target): the ratio is tandem's best mode over vLLM's best; None: not judged.
    At N (best_bN) tandem's modes are those timed in the phase of vLLM's best (`same_phase`)."""
    n = f"b{batch}"
    return [("plain_b1", ["plain_b1"], ["plain_b1"], 0.9), ("spec_b1", ["auto_b1"], ["spec_b1"], 1.2),
            (f"best_{n}", [], [f"plain_{n}", f"spec_{n}"], 1.0),
            (f"served_best_{n}", [f"served_off_{n}", f"served_auto_{n}"], [f"plain_{n}", f"spec_{n}"], None)]


def guest(phase: str, batch: int) -> str:
    """tandem's other mode at N at once, timed in `phase` (plain or spec) as well, so that tandem's best at N meets
    vLLM's engine in the same phase: AUTO in the plain phase, plain in the speculative one."""
    return f"auto_b{batch}@plain" if phase == "plain" else f"plain_b{batch}@spec"


def same_phase(vllm_mode: str) -> list[str]:
    """tandem's modes at N timed in the phase of vLLM's `vllm_mode` (plain_bN or spec_bN; vllm_compare.schedule)."""
    batch = int(vllm_mode.split("_b")[1])
    if vllm_mode.startswith("plain"):
        return [f"plain_b{batch}", guest("plain", batch)]
    return [f"auto_b{batch}", guest("spec", batch)]


def ratios(summary: dict[str, dict[str, dict]], batch: int) -> dict[str, dict]:
    out = {}
    for name, ours, theirs, target in targets(batch):
        v = max((m for m in theirs if m in summary.get("vllm", {})), key=lambda m: summary["vllm"][m]["tok_s"],
                default=None)
        ours = ours or ([] if v is None else same_phase(v))
        t = max((m for m in ours if m in summary.get("tandem", {})), key=lambda m: summary["tandem"][m]["tok_s"],
                default=None)
        if t is None or v is None or not summary["vllm"][v]["tok_s"]:
            out[name] = {"tandem_mode": t, "vllm_mode": v, "ratio": None, "target": target, "met": None}
            continue
        a, b = summary["tandem"][t], summary["vllm"][v]
        ratio = a["tok_s"] / b["tok_s"]
        out[name] = {"tandem_mode": t, "tandem_tok_s": a["tok_s"], "vllm_mode": v, "vllm_tok_s": b["tok_s"],
                     "ratio": round(ratio, 4), "target": target, "met": None if target is None else ratio >= target,
                     "ratio_each": [round(x / y, 4) for x, y in zip(a["tok_s_each"], b["tok_s_each"], strict=False)]}
    return out


def within(summary: dict[str, dict[str, dict]], batch: int) -> dict[str, dict[str, float]]:
    """Each system's speculation over its own plain decoding, at batch 1 and at N: the sitting cancels here, except
    where the two ran in different phases (vLLM's, and tandem's at batch 1); tandem's at N is given in each phase."""
    n = f"b{batch}"
    pairs = {"tandem": [("auto_b1", "plain_b1"), (guest("plain", batch), f"plain_{n}"),
                        (f"auto_{n}", guest("spec", batch))],
             "vllm": [("spec_b1", "plain_b1"), (f"spec_{n}", f"plain_{n}")]}
    out: dict[str, dict[str, float]] = {}
    for system, wanted in pairs.items():
        modes = summary.get(system, {})
        out[system] = {f"{a}/{b}": round(modes[a]["tok_s"] / modes[b]["tok_s"], 4)
                       for a, b in wanted if a in modes and modes.get(b, {}).get("tok_s")}
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How alike two systems' greedy outputs are (bf16 kernels differ, so some drift is expected)."""
    prefix = [next((i for i, (x, y) in enumerate(zip(p, q, strict=False)) if x != y), min(len(p), len(q)))
              for p, q in zip(a, b, strict=True)]
    return {"identical": f"{sum(p == q for p, q in zip(a, b, strict=True))}/{len(a)}",
            "mean_common_prefix": round(sum(prefix) / len(prefix), 1)}
