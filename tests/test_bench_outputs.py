"""tandem.bench.outputs on the tiny models: every run equals plain decoding, and --compare tells equal from changed."""

from __future__ import annotations

import json

from tandem.bench import outputs


def test_every_run_equals_plain_and_compare_finds_a_change(tiny_dirs, tmp_path) -> None:
    common = ["--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft), "--max-tokens", "6", "--batch", "3"]
    first = tmp_path / "first.json"
    assert outputs.main([*common, "--json", str(first)]) == 0
    report = json.loads(first.read_text())
    assert len(report["runs"]) == len(outputs.SETTINGS) * 2 * 2
    assert all(report["agrees_with_plain"].values())
    assert outputs.main([*common, "--compare", str(first)]) == 0

    report["runs"]["k3/b3/seeded"][0][-1] += 1  # one token of one run changed
    first.write_text(json.dumps(report))
    assert outputs.main([*common, "--compare", str(first)]) == 1
