"""Two checkouts of tandem served side by side: fresh `tandem serve --in-process` servers from each, alternated
(A B B A), OFF and AUTO at N in flight through each; with the CPU each of the server's busiest threads used.

    git worktree add /tmp/before <commit>
    python -m tandem.bench.served_ab --before /tmp/before --json docs/bench/served-ab.json      # ~10 min on CPU-C

The real pair in bf16 on the CPU, the shipped prompts, greedy. Each server runs both modes (tandem.bench.serving's
run_level, every request a new session) after one warm-up request; the per-thread figures are taken over a few
seconds in the middle of each level from /proc, so a server whose torch threads sleep between ops shows it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from tandem.bench.prompts import load_prompts
from tandem.bench.vllm_compare_tandem import run_served
from tandem.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, wants_text, write_json

TARGET, DRAFT = DEFAULT_TARGET, DEFAULT_DRAFT


def thread_cpu(pid: int, seconds: float) -> list[float]:
    """CPU cores each thread of `pid` used over `seconds`, busiest first (threads above 5% only)."""
    def ticks() -> dict[str, int]:
        out = {}
        for task in Path(f"/proc/{pid}/task").iterdir():
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[task.name] = int(fields[11]) + int(fields[12])  # utime + stime
        return out

    before = ticks()
    time.sleep(seconds)
    after = ticks()
    hz = os.sysconf("SC_CLK_TCK")
    used = sorted(((after[t] - before.get(t, 0)) / hz / seconds for t in after), reverse=True)
    return [round(u, 2) for u in used if u > 0.05]


def served(checkout: Path, args: argparse.Namespace, repeat: int, log: Path, say) -> dict:
    """One fresh server from `checkout` (its services/ first on PYTHONPATH), both modes; thread CPU per level."""
    samples: list[list[float]] = []

    def sample(pid: int) -> None:  # every 20 s while the server lives
        def loop() -> None:
            while True:
                time.sleep(20)
                try:
                    samples.append(thread_cpu(pid, 5))
                except (FileNotFoundError, ProcessLookupError):
                    return

        threading.Thread(target=loop, daemon=True).start()

    path = os.environ.get("PYTHONPATH")
    env = os.environ | {"PYTHONPATH": str(checkout / "services") + (os.pathsep + path if path else "")}
    modes = run_served(args, load_prompts(), repeat, log, say, started=sample, env=env)
    return {"modes": modes, "thread_cpu_samples": samples}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout (a git worktree)")
    parser.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[3], help="this checkout")
    parser.add_argument("--batch", type=int, default=8, help="requests in flight")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log", type=Path, default=Path("served-ab.log"), help="the servers' output")
    add_json_option(parser, "the runs and pooled tok/s")
    args = parser.parse_args(argv)
    args.target, args.draft, args.dtype = TARGET, DRAFT, "bfloat16"
    say = print if wants_text(args) else (lambda _: None)
    runs = []
    for repeat, side in enumerate(("before", "after", "after", "before")):
        say(f"{side} (repeat {repeat}):")
        runs.append({"side": side} | served(getattr(args, side), args, repeat, args.log, say))
    pooled: dict[str, float] = {}
    for side in ("before", "after"):
        for mode in ("off", "auto"):
            done = [r["modes"][f"served_{mode}_b{args.batch}"] for r in runs if r["side"] == side]
            pooled[f"{side}_{mode}"] = round(sum(d["tokens"] for d in done) / sum(d["seconds"] for d in done), 2)
    report = {"before": str(args.before), "after": str(args.after), "batch": args.batch,
              "max_tokens": args.max_tokens, "python": sys.version.split()[0], "runs": runs, "pooled_tok_s": pooled,
              "after_over_before": {mode: round(pooled[f"after_{mode}"] / pooled[f"before_{mode}"], 3)
                                    for mode in ("off", "auto")},
              "auto_over_off": {side: round(pooled[f"{side}_auto"] / pooled[f"{side}_off"], 3)
                                for side in ("before", "after")}}
    say(f"pooled tok/s: {pooled}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
