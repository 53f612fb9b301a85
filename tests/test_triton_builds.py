"""tandem's Triton kernels build for a Hopper GPU (sm_90, the H100 and H200) with the argument types inductor launches
them with, at the real pair's shapes: core.triton_decode's attention and its merge, core.triton_gemv's one-row
products. Triton's
frontend and NVIDIA backend, ptxas included, run on a CPU, so a kernel that only the interpreter accepts (as when a
float64 `scale` changed a loop variable's type, found on an H200 on 2026-12-04) fails here rather than on the next
GPU machine.

The builds run in a child process: the tests' conftest turns Triton's interpreter on, under which Triton's own
library functions are Python ones that no real build can call; and with a cache of their own, so that an earlier
build of the same source cannot answer for this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.bench.row_products import products

HOPPER = ("cuda", 90, 32)
# name: (key/value heads, query heads per key/value head, width, head dim, dtype, scale's type[, split or "whole"])
ATTENTION = {
    "target-1": (2, 6, 1, 128, "bfloat16", "fp64"),  # Qwen2.5-1.5B: 12 query heads over 2 key/value heads of 128
    "target-5": (2, 6, 5, 128, "bfloat16", "fp64"),  # a verify forward of 4 drafts
    "draft-1": (2, 7, 1, 64, "bfloat16", "fp64"),  # Qwen2.5-0.5B: 14 over 2, of 64
    "draft-5": (2, 7, 5, 64, "bfloat16", "fp64"),
    "target-5-float32": (2, 6, 5, 128, "float32", "fp32"),  # as tests/test_cuda_graphs.py runs it on a GPU
    "target-1-split64": (2, 6, 1, 128, "bfloat16", "fp64", 64),  # the splits the GPU probe times beside SPLIT
    "target-1-split256": (2, 6, 1, 128, "bfloat16", "fp64", 256),
    "target-1-whole": (2, 6, 1, 128, "bfloat16", "fp64", "whole"),  # one split of every key, written unmerged
    "draft-5-whole": (2, 7, 5, 64, "bfloat16", "fp64", "whole"),
}
# name: (N, K, bias, norm, gated, residual, rotated columns, head dim, dtype[, tile, q's columns]): each decoder
# layer's four products at batch 1, folded as core.folded_layers folds them (bench.row_products' shapes, which the
# GPU sitting times), q/k/v also at a wide tile and writing the cache; and the float32 builds
# tests/test_cuda_graphs.py runs on a GPU
PRODUCTS = {f"{role}-{name}": (*shape, "bfloat16") for role in ("target", "draft")
            for name, shape in products(role).items()} | {
    "target-qkv-tile16": (*products("target")["qkv"], "bfloat16", (16, 512, 8)),
    "target-qkv-to-cache": (*products("target")["qkv"], "bfloat16", None, 1536),  # k and v into the cache too
    "draft-qkv-to-cache": (*products("draft")["qkv"], "bfloat16", None, 896),
    "tiny-qkv-float32": (128, 64, True, True, False, False, 96, 16, "float32"),
    "tiny-down-float32": (64, 128, False, False, True, True, 0, 0, "float32")}
MERGES = {  # name: (key/value heads, query heads per key/value head, head dim, output dtype): the splits' merge
    "target-merge": (2, 6, 128, "bfloat16"),
    "draft-merge": (2, 7, 64, "bfloat16"),
    "target-merge-float32": (2, 6, 128, "float32"),
}
ELEMENTS = {"bfloat16": "*bf16", "float32": "*fp32"}
pytestmark = pytest.mark.xdist_group("triton-build")  # one worker builds them all, once
POINTERS = {"LIMITS": "*i32", "REACH": "*i32", "ACC": "*fp32", "MAX": "*fp32", "SUM": "*fp32"}


def build(kernel, types: dict[str, str], settings: dict, aligned: tuple[str, ...] = ()) -> None:
    """Compile `kernel` for HOPPER with the arguments `types` names (the rest int32) and `settings` (its
    compile-time arguments and num_warps), `aligned` ones marked divisible by 16 as a launch marks aligned pointers
    and strides (which is what lets the loads vectorise); raises where Triton cannot."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    settings = dict(settings)
    num_warps = settings.pop("num_warps")
    signature = {name: types.get(name, "i32") for name in kernel.arg_names} | {name: "constexpr" for name in settings}
    constants = {(kernel.arg_names.index(name),): value for name, value in settings.items()}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget(*HOPPER), options={"num_warps": num_warps})
    assert compiled.asm["cubin"] and compiled.metadata.num_warps == num_warps


def build_attention(kv_heads: int, groups: int, width: int, dim: int, dtype_name: str, scale: str,
                    split: int | str | None = None) -> None:
    """core.triton_decode's kernel as split_attention launches it (whole_attention's, with "whole")."""
    import torch

    from tandem.core import triton_decode

    element = ELEMENTS[dtype_name]
    settings = triton_decode.launch_settings(kv_heads, groups, width, dim, getattr(torch, dtype_name),
                                             *([split] if isinstance(split, int) else []))
    out = {"OUT": element, "ACC": element, "MAX": element, "SUM": element} if split == "whole" else {"OUT": "*fp32"}
    build(triton_decode._split_attention, {"Q": element, "K": element, "V": element, "scale": scale} | POINTERS
          | out, settings | {"WHOLE": split == "whole"})


def build_merge(kv_heads: int, groups: int, dim: int, dtype_name: str) -> None:
    """core.triton_decode's merge of the splits as merge_splits launches it."""
    from tandem.core import triton_decode

    build(triton_decode._merge, {"ACC": "*fp32", "MAX": "*fp32", "SUM": "*fp32", "OUT": ELEMENTS[dtype_name]},
          {"KV_HEADS": kv_heads, "GROUPS": groups, "D": dim, "num_warps": 1})


def build_product(n: int, k: int, bias: bool, norm: bool, gated: bool, residual: bool, rope: int, head: int,
                  dtype_name: str, tile: tuple[int, int, int] | None = None, query: int = 0) -> None:
    """core.triton_gemv's kernel as gemv launches it (the Qwen pair's norm epsilon), at `tile` where given; with
    `query` (q's columns) as gemv_to_cache launches it, writing k and v into a cache."""
    from tandem.core import triton_gemv

    if tile:
        triton_gemv.TUNED[(n, k)] = tile
    tensors = ("X", "W", "BIAS", "NORM", "RES", "COS", "SIN", "Y", "KC", "VC")
    settings = triton_gemv.launch_settings(n, k, 1e-6, bias, norm, gated, residual, rope, head)
    build(triton_gemv._gemv, {name: ELEMENTS[dtype_name] for name in tensors} | {"SLOT": "*i64", "POS": "*i64"},
          settings | {"TO_CACHE": bool(query), "QUERY": query}, aligned=(*tensors, "sw"))
    triton_gemv.TUNED.pop((n, k), None)


def main() -> None:
    """In the child: build every case, print {case: null or the error}."""
    results = {}
    cases = [(name, build_attention, case) for name, case in ATTENTION.items()]
    cases += [(name, build_merge, case) for name, case in MERGES.items()]
    cases += [(name, build_product, case) for name, case in PRODUCTS.items()]
    for name, builder, case in cases:
        try:
            builder(*case)
            results[name] = None
        except Exception as exc:  # reported per case, the others still built
            results[name] = f"{type(exc).__name__}: {exc}"[-600:]
    print(json.dumps(results))


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, str | None]:
    pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "services"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", list(ATTENTION))
def test_the_attention_kernel_builds_for_hopper_as_inductor_launches_it(builds, case) -> None:
    """Inside compiled forwards inductor passes the Python float `scale` as fp64; the one-token and verify shapes of
    both models in bf16, and the float32 build the GPU equality tests use."""
    assert builds[case] is None, builds[case]


@pytest.mark.parametrize("case", list(MERGES))
def test_the_merge_of_the_splits_builds_for_hopper(builds, case) -> None:
    """Its loop over the splits runs to a count known only at the launch (the cache's capacity is a symbolic size
    in the compiled forwards), with loop-carried statistics that must keep their float32 type."""
    assert builds[case] is None, builds[case]


@pytest.mark.parametrize("case", list(PRODUCTS))
def test_the_one_row_product_kernel_builds_for_hopper(builds, case) -> None:
    """Both models' four products a layer in bf16 as folded (a bias, a norm, the activation, a residual add where
    the layer has them; the launch settings' tiles and the unrolled loops over K), and the float32 builds the GPU
    equality tests use."""
    assert builds[case] is None, builds[case]


if __name__ == "__main__":
    main()
