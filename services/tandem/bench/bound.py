"""The analytic bound beside a sweep: what speculation can give at best, priced with the server's own costs.

Inputs per load level, from its AUTO run: the cost model the server reported (GetModelInfo.costs, kept in
results["server"]["costs"]: seconds per draft step and per target forward over n tokens, measured on that
deployment, remote calls included) and the measured per-token acceptance alpha (accepted / drafted tokens).

One sequence at a time (low load): a round drafting k tokens yields E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)
tokens in g(k) = k * T_draft + T_target(k + 1) seconds; plain decoding yields one token per T_target(1). The bound is
the best k's tokens per second over plain's. Per-token ITL (loadtest.metrics): a round that accepts a of its k drafts
streams one chunk of a + 1 tokens g(k) after the previous one, so each of those tokens counts g(k) / (a + 1); a has
probability alpha^a (1 - alpha) for a < k and alpha^k for a = k. The ITL percentiles are those of that token-weighted
distribution; OFF's ITL is T_target(1) for every token. Its tail is the rounds that accept nothing: one token after
a whole round, g(k) > T_target(1), and they carry (1 - alpha) / E(alpha, k) of all tokens.

A full batch of `rows` sequences (saturation): one round costs the draft steps over the rows still drafting plus
one target forward over rows x (k + 1) tokens (core.batch_plan.predicted_rate); the bound takes the best common k.

    python -m tandem.bench.bound runs/sweep/sweep.json --json bound.json      # a finished `python -m loadtest sweep`
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.cli.options import DefaultsHelpFormatter, add_json_option, wants_text, write_json
from tandem.core.batch_plan import predicted_rate
from tandem.core.costs import CostModel
from tandem.core.policy import best_k, expected_tokens, tokens_per_second

K_MAX = 8


def cost_model(server: dict) -> CostModel | None:
    """The CostModel from GetModelInfo as loadtest records it (MessageToDict; zero fields are left out)."""
    costs = server.get("costs") or {}
    forward = {int(n): float(s) for n, s in (costs.get("forward_seconds") or {}).items()}
    model = CostModel(draft_step=float(costs.get("draft_step_seconds", 0.0)), verify=forward,
                      draft_rows={int(n): float(s) for n, s in (costs.get("draft_rows_seconds") or {}).items()},
                      batched={(int(b["rows"]), int(b["width"])): float(b["seconds"])
                               for b in costs.get("batched") or []},
                      draft_forward={int(n): float(s) for n, s in (costs.get("draft_forward_seconds") or {}).items()},
                      frozen=True)
    return model if model.calibrated else None


def itl_distribution(alpha: float, k: int, costs: CostModel) -> list[tuple[float, float]]:
    """(per-token ITL, share of tokens) for one sequence drafting k tokens every round."""
    if k == 0:
        return [(costs.verify_time(0), 1.0)]
    seconds = costs.round_time(k)
    chances = [alpha**a * (1.0 - alpha) for a in range(k)] + [alpha**k]
    weights = [(a + 1) * p for a, p in enumerate(chances)]
    total = sum(weights)
    return [(seconds / (a + 1), w / total) for a, w in enumerate(weights) if w > 0]


def weighted_percentile(distribution: list[tuple[float, float]], percent: float) -> float:
    """The smallest value whose cumulative share reaches percent / 100."""
    cumulative = 0.0
    ordered = sorted(distribution)
    for value, share in ordered:
        cumulative += share
        if cumulative >= percent / 100.0 - 1e-12:
            return value
    return ordered[-1][0]


def single_stream(alpha: float, costs: CostModel, k_max: int = K_MAX) -> dict:
    plain = 1.0 / costs.verify_time(0)
    k, rate = best_k(alpha, costs, k_max)
    if rate <= plain:
        rate, k = plain, 0
    itl = itl_distribution(alpha, k, costs)
    off_itl = costs.verify_time(0)
    return {"k": k, "tokens_per_second": rate, "plain_tokens_per_second": plain, "speedup": rate / plain,
            "itl_p50": weighted_percentile(itl, 50), "itl_p99": weighted_percentile(itl, 99), "off_itl": off_itl,
            "itl_p50_ratio": weighted_percentile(itl, 50) / off_itl,
            "itl_p99_ratio": weighted_percentile(itl, 99) / off_itl,
            "unaccepted_token_share": (1.0 - alpha) / expected_tokens(alpha, k) if k else 0.0}


def acceptance_needed_for_itl(costs: CostModel, percent: float = 99, limit: float = 1.02,
                               k_max: int = K_MAX) -> float | None:
    """The least acceptance (to 0.001) at which some k >= 1 keeps the ITL `percent`-ile within `limit` x OFF's
    while beating plain decoding; None if no acceptance below 1 does."""
    off = costs.verify_time(0)
    for step in range(1, 1000):
        alpha = step / 1000
        for k in range(1, k_max + 1):
            faster = tokens_per_second(alpha, k, costs) > 1.0 / off
            if faster and weighted_percentile(itl_distribution(alpha, k, costs), percent) <= limit * off:
                return alpha
    return None


def full_batch(alpha: float, rows: int, costs: CostModel, k_max: int = K_MAX) -> dict:
    plain = predicted_rate([0] * rows, [alpha] * rows, costs)
    rate, k = max((predicted_rate([k] * rows, [alpha] * rows, costs), k) for k in range(0, k_max + 1))
    return {"rows": rows, "k": k, "tokens_per_second": rate, "plain_tokens_per_second": plain,
            "speedup": rate / plain}


def sweep_bound(sweep: dict, rows: int = 8) -> list[dict]:
    """Per level with an AUTO run that measured acceptance and recorded the server's costs: both bounds."""
    levels = []
    for run in sweep["runs"]:
        results = run["results"]
        alpha = results.get("acceptance_rate")
        costs = cost_model(results.get("server") or {})
        if run["speculation"] != "auto" or alpha is None or costs is None:
            continue
        levels.append({"load": run["load"], "level": run["level"], "acceptance": alpha,
                       "single_stream": single_stream(alpha, costs), "full_batch": full_batch(alpha, rows, costs),
                       "acceptance_for_itl_p99": acceptance_needed_for_itl(costs)})
    return levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("sweep", type=Path, help="a sweep's sweep.json (python -m loadtest sweep)")
    parser.add_argument("--rows", type=int, default=8, help="sequences in the full batch")
    add_json_option(parser, "the bound per level")
    args = parser.parse_args(argv)
    levels = sweep_bound(json.loads(args.sweep.read_text()), args.rows)
    if wants_text(args):
        print(json.dumps(levels, indent=2))
    write_json(args.json, levels)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
