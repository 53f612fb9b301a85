"""tandem.bench.gpu_probe runs only where CUDA is; its measuring functions run here on tiny shapes, so a GPU session
does not spend its machine time on a probe that breaks. It also runs by path from a checkout with only torch and
transformers (the GPU machine has no tandem installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from tandem.bench import gpu_ab, gpu_runs
from tandem.bench import gpu_probe as probe
from tandem.core.kv_cache import kv_bytes_per_token

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)


def test_probe_measures_tandem_and_hugging_face_on_the_same_weights() -> None:
    cpu = torch.device("cpu")
    target = gpu_runs.build("target", cpu, torch.float32, **TINY)
    draft = gpu_runs.build("draft", cpu, torch.float32, **TINY)
    work = probe.prompts(3, vocab=500)
    # "graphs" is the uncompiled mode: on a CPU that runs eagerly, so no test time goes to compiling here.
    plain = gpu_runs.run_tandem(target, draft, None, 1, work, 8, mode="graphs")
    spec = gpu_runs.run_tandem(target, draft, 2, 2, work, 8, mode="graphs")
    assert plain["tokens"] == spec["tokens"] == 24 and spec["drafted"] > 0 and not any(spec["compiled"])
    assert gpu_runs.hf_generate(target, work[:2], 2, 8)["tokens"] == 16
    logged = {}
    sides = {name: partial(gpu_runs.run_tandem, target, draft, mode="graphs") for name in ("a", "b")}
    gpu_ab.side_pairs(sides, work, 4, lambda key, value: logged.update({key: value}), cases=("plain_b1", "spec_k4_b1"))
    assert set(logged) == {"a_vs_b_plain_b1", "a_vs_b_spec_k4_b1"}
    assert all(row["a_tok_s"] > 0 and row["b_tok_s"] > 0 and not row["compile_errors"] for row in logged.values())
    logged.clear()
    gpu_ab.plain_pairs(list(sides.items()), work, 4, 0.0, lambda key, value: logged.update({key: value}), pairs=2)
    assert set(logged) == {"a_vs_b_plain_b1", "a_vs_b_plain_b8", "b_vs_a_plain_b1_pair2", "b_vs_a_plain_b8_pair2"}
    costs = gpu_ab.attention_costs(torch.device("cpu"), {name: gpu_ab.ATTENTION_BACKENDS[name]
                                                         for name in ("default", "math", "flex")},
                                   caps=(32,), rows=(1, 2), widths=(1, 3), reps=10)
    assert all(len(by_shape) == 4 and all(seconds > 0 for seconds in by_shape.values()) for by_shape in costs.values())
    for name in ("math", "flex"):
        run = gpu_ab.run_with_backends(gpu_ab.ATTENTION_BACKENDS[name], target, None, None, 1, work[:1], 4,
                                       mode="graphs")
        assert run["tokens"] == 4 and gpu_ab.attention.BACKENDS[0] is None and not gpu_ab.attention.FLEX[0]  # restored
    share = probe.kernel_share(lambda: gpu_runs.hf_generate(target, work[:1], 1, 2))
    assert share["wall_s"] > 0 and isinstance(share["top_kernels"], list)  # no GPU kernels on a CPU
    costs = probe.forward_costs(probe.ModelRunner(target), [1, 3], context=64, reps=2)
    assert set(costs) == {1, 3} and all(seconds > 0 for seconds in costs.values())
    logged.clear()
    probe.forward_costs_only(target, draft, lambda key, value: logged.update({key: value}), context=32,
                             compile=False)  # a CPU would spend a minute compiling
    assert set(logged["forward_seconds"]["target"]) == {1, 5} and logged["forward_seconds"]["draft_step"] > 0
    assert list(logged["projected_spec_b1_from_forward_costs"]) == ["0.6", "0.7", "0.8", "0.9"]
    # A free draft and a verify as cheap as a plain step: every acceptance pays, the more the better.
    projected = probe.projected_speedups({1: 1.0, 2: 1.0, 3: 1.0, 5: 1.0, 9: 1.0}, 0.0)
    assert list(projected) == ["0.6", "0.7", "0.8", "0.9"]
    assert 1 < projected["0.6"]["speedup_vs_plain"] < projected["0.9"]["speedup_vs_plain"] < 10
    head_dim = 64 // 4
    assert kv_bytes_per_token(target) == 2 * 2 * 2 * head_dim * 4  # layers x (k, v) x kv heads x dim x fp32


def test_probe_runs_by_path_and_shows_every_default(tmp_path) -> None:
    """By path from another folder, as on a GPU machine with a checkout and no install: tandem resolves from the
    checkout's services/ and --help shows the defaults; where there is no GPU, it stops at once, saying so."""
    script = str(Path(probe.__file__))
    shown = subprocess.run([sys.executable, script, "--help"], cwd=tmp_path, capture_output=True, text=True,
                           env=os.environ | {"COLUMNS": "240"})  # wide: argparse breaks long words at the width
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert "--num-prompts NUM_PROMPTS random prompts (64 to 256 tokens) (default: 8)" in text
    assert "(default: gpu-probe.json)" in text
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA is not available"):
            probe.main(["--json", str(tmp_path / "probe.json")])
        assert not (tmp_path / "probe.json").exists()


def test_the_row_products_report_gives_its_best_tiles_per_shape(tmp_path) -> None:
    """What tandem.bench.row_products writes, and the GPU sitting's A/B reads back (--tiles) into
    core.triton_gemv.TUNED: the best tile per (N, K), none where launch_settings' own pick won or no tile ran. The
    shapes are the layers' own (the sitting times both models)."""
    from tandem.bench.row_products import best_tiles, products

    shapes = {f"{role}_{name}": shape for role in ("target", "draft") for name, shape in products(role).items()}
    assert shapes["target_gate_up"][:2] == (17920, 1536) and shapes["draft_down"][:2] == (896, 4864)
    report = {"results": {
        "target_o": {"n": 1536, "k": 1536, "best": {"tile": "8x256x4", "folded_us": 2.1}},
        "target_down": {"n": 1536, "k": 8960, "best": {"tile": "default", "folded_us": 7.9}},
        "target_gate_up": {"n": 17920, "k": 1536, "kernel_folded": {"default": {"error": "..."}}, "best": None},
    }}
    path = tmp_path / "row-products.json"
    path.write_text(json.dumps(report))
    assert best_tiles(path) == {(1536, 1536): (8, 256, 4)}


def test_the_row_products_report_prints_as_a_table(tmp_path) -> None:
    from tandem.bench import row_products

    def rate(us: float) -> dict:
        return {"us": us, "tb_s": 4.7e6 / us / 1e6}

    report = {"results": {
        "target_o": {"n": 1536, "k": 1536, "cublas": rate(6.0), "kernel_alone": rate(3.0),
                     "kernel_folded": {"8x256x4": rate(3.5)}, "best": {"tile": "8x256x4"}},
        "target_qkv": {"n": 2048, "k": 1536, "cublas": rate(5.4), "best": None},
    }}
    path = tmp_path / "row-products.json"
    path.write_text(json.dumps(report))
    table = row_products.summary(path).splitlines()
    assert table[2] == ("| target_o (1536 x 1536) | 6.00 µs, 0.78 TB/s | 3.00 µs, 1.57 TB/s | 3.50 µs, 1.34 TB/s "
                        "| 8x256x4 |")
    assert table[3] == "| target_qkv (2048 x 1536) | 5.40 µs | no tile ran | | |"
