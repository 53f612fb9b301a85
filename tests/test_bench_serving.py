"""The serving benchmark against a real gateway: every mode serves the same greedy tokens, and the in-process
baseline is interleaved with the served runs at concurrency 1."""

from __future__ import annotations

import asyncio

from gateway_harness import ServerThread, tiny_backend
from tandem.bench import serving


def test_levels_modes_and_the_in_process_baseline(tiny_models) -> None:
    target, draft, _ = tiny_models
    server = ServerThread(tiny_backend(target, draft))
    try:
        prompts = ["def add(a, b):", "Write a loop", "Sort a list"]
        report = asyncio.run(serving.run(server.address, prompts, [1, 2], max_tokens=12, repeat=2,
                                         in_process=serving.InProcess(target, draft)))
    finally:
        server.stop()
    rows = {(row["concurrency"], row["speculation"]): row for row in report["levels"]}
    assert set(rows) == {(1, "auto"), (1, "off"), (1, "in-process"), (2, "auto"), (2, "off")}
    # Greedy everywhere: each mode produced the same tokens, twice over.
    assert len({row["tokens"] for row in rows.values()}) == 1
    assert all(len(row["tok_s_each"]) == 2 and row["rounds"] >= row["tokens"] / 13 for row in rows.values())
    assert rows[1, "off"]["rounds"] == rows[1, "off"]["tokens"] and rows[1, "off"]["alpha"] is None
    assert len(report["served_vs_in_process_each"]) == 2 and report["served_vs_in_process_at_1"] > 0
    assert report["auto_2_vs_auto_1"] > 0 and report["auto_vs_off_at_2"] > 0
