"""tandem.bench.forward_split: a decode forward against its products alone, on the tiny models."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.bench import forward_split
from tandem.core.packed_linear import MIN_PACKED_WEIGHTS, prepack
from tandem.models.loader import load_model


def test_the_product_layers_are_the_packed_fused_ones_and_the_head(tiny_dirs, monkeypatch) -> None:
    monkeypatch.setitem(MIN_PACKED_WEIGHTS, torch.float32, 0)
    loaded = load_model(str(tiny_dirs.target), device=torch.device("cpu"), dtype=torch.float32, progress=False,
                        eager=True)
    layers = loaded.model.config.num_hidden_layers
    plain = forward_split.product_layers(loaded.model)
    assert len(plain) == 7 * layers + 1  # q, k, v, o, gate, up, down a layer, and the head
    prepack(loaded.model)
    packed = forward_split.product_layers(loaded.model)
    assert len(packed) == 4 * layers + 1  # q/k/v and gate/up fused
    assert loaded.model.get_output_embeddings() in packed


def test_the_split_reports_each_forward_against_its_products(tiny_dirs, monkeypatch, tmp_path) -> None:
    """Eager runners only: a compiled runner is timed the same way (`--compile`), and compiling the tiny models
    here would add a minute to CI for no other check; forward_ab's and test_compiled_forward's tests compile."""
    monkeypatch.setitem(MIN_PACKED_WEIGHTS, torch.float32, 0)
    out = tmp_path / "split.json"
    assert forward_split.main(["--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft), "--dtype",
                               "float32", "--rows", "1", "3", "--steps", "3", "--context", "6",
                               "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for role in ("target", "draft"):
        assert report[role]["product_layers"] > 0 and report[role]["weight_bytes"] > 0
        for rows in ("1", "3"):
            row = report[role][rows]
            assert row["products_s"] > 0 and set(row["first_s"]) == {"eager", "products"}
            assert row["eager_s"] > 0 and row["eager_over_products"] > 0 and "compiled" not in row
    assert report["config"]["rows"] == [1, 3] and report["config"]["compile"] is False


def test_bad_arguments_are_usage_errors() -> None:
    for bad in (["--rows", "0"], ["--steps", "0"], ["--context", "0"], ["--models", "both"]):
        with pytest.raises(SystemExit):
            forward_split.main(bad)
