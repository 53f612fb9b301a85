"""One load level end to end: drive it, compute the metrics, write DIR/results.json and DIR/trace.jsonl."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from loadtest import metrics, trace
from loadtest.client_run import Driver
from loadtest.config import RunConfig
from loadtest.prompts import Prompt


def results_of(run: trace.RunTrace, slos: dict[str, float]) -> dict:
    """results.json: the metrics, then the run's config and what the server said about itself."""
    config = dict(run.config)
    server = config.pop("server", {})
    return metrics.compute(run, slos) | {"config": config, "server": server}


def write_json(path: Path, body: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2, allow_nan=False) + "\n")


def make_out_dir(out: Path) -> None:
    """Create `out` (and its parents), or raise ValueError("out: ...") when no run could write there: checked before
    a run, so that a mistyped --out does not cost the whole run."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = "it is a file, not a directory" if out.is_file() else exc.strerror or str(exc)
        raise ValueError(f"out: cannot write into {out}: {why}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"out: cannot write into {out}: permission denied")


def run_to_dir(config: RunConfig, out: Path, prompts: list[Prompt] | None = None) -> dict:
    """Run one level into `out`. Interrupted (KeyboardInterrupt) while measuring, it still writes what was recorded
    so far, marked `"interrupted": true` in the config, before the interrupt goes on."""
    make_out_dir(out)
    driver = Driver(config, prompts)
    running = driver.run()
    try:
        with asyncio.Runner(loop_factory=_loop_built_whole) as runner:
            run = runner.run(running)
    except KeyboardInterrupt:
        running.close()  # a Ctrl-C before the loop first ran it left it never awaited (a RuntimeWarning at exit)
        if driver.partial is not None:
            _write_run(driver.partial, config, out)
        raise
    return _write_run(run, config, out)


def _loop_built_whole() -> asyncio.AbstractEventLoop:
    """A new event loop, built with Ctrl-C held off: a SIGINT that lands inside the loop's constructor (a sweep starts
    one loop a run) leaves a half-built loop whose finalizer prints an AttributeError at exit; held, the interrupt is
    raised once the loop is whole."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return asyncio.new_event_loop()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _write_run(run: trace.RunTrace, config: RunConfig, out: Path) -> dict:
    trace.save(run, out / "trace.jsonl")
    results = results_of(run, config.goodput)
    write_json(out / "results.json", results)
    return results


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.2f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary(results: dict) -> str:
    """A short text report in the shape of vLLM's 'Serving Benchmark Result'."""
    config = results["config"]
    lines = [f"load {config.get('load', '')} speculation {config.get('speculation', '')}: "
             f"{results['completed']} completed, {results['failed']} failed "
             f"({results['cancelled']} cancelled), {results['not_sent']} not sent in {results['duration']:.2f} s",
             f"request throughput {_num(results['request_throughput'])} req/s, "
             f"output throughput {_num(results['output_throughput'])} tok/s, "
             f"goodput {_num(results['goodput'])} req/s"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = results[name]
        lines.append(f"{name:>5} ms: mean {_ms(s['mean'])}  p50 {_ms(s['p50'])}  p90 {_ms(s['p90'])}  "
                     f"p99 {_ms(s['p99'])}")
    lines.append(f"acceptance {_num(results['acceptance_rate'], 3)}, fallback share "
                 f"{_num(results['fallback_share'], 3)}")
    return "\n".join(lines)
