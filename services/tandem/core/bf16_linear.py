"""bf16 linear layers on an x86 CPU with AVX-512 or AVX2, without AMX: a kernel of tandem's own
(csrc/bf16_linear.cpp) for the few rows a decode or verification step multiplies by every weight.

Why not oneDNN's (core.packed_linear): a step of a few rows should cost what one row costs, the time the weights take
to stream from memory, while the arithmetic keeps up. oneDNN computes bf16 products by AVX512-BF16 dot products,
which a CPU may run at a quarter of the rate of float32 multiply-adds (a 2-vCPU Xeon: 0.5 against 2 a cycle), and
then its products fall behind the stream from 2 rows on: over 28 products of the 1.5B target's MLP shape, weights
streamed from memory, 8 rows took 1.8x one row's time, where this kernel's 8 rows take 1.4x its one row's and 12
rows the same (docs/performance.md, "A bf16 product of tandem's own"). The kernel widens each weight to float32 as it
streams, streams each panel of 32 output columns once for every row of the step, up to 12 rows at a time in float32
multiply-adds, and rounds each output once.

On an AVX2 CPU oneDNN does not pack bf16 at all and PyTorch's bf16 product converts the weights and re-reads them
for every row, so bf16 models ran slower there than float32 ones; the kernel's AVX2 path (8 float32 a register, 12
accumulators in 16 registers) streams them as the AVX-512 path does, and `--dtype auto` picks bf16 where it runs
(core.device.select_dtype): a one-token forward of the 1.5B target 2.1x float32's speed with torch and oneDNN held
to AVX2 on an AVX-512 Xeon (docs/performance.md, "On an AVX2-only CPU").

Other CPUs run AVX512-BF16 dot products at the rate of their float32 multiply-adds, twice the arithmetic a cycle: on
a Zen 4 EPYC the multiply-add path fell behind oneDNN from 12 rows on (0.56-0.70x its speed; a prompt's prefill 2x
slower). There the kernel takes a third path (DOT), the same packing multiplied by dot products, two inputs at a
time: faster than oneDNN at every row count timed (1.11-1.56x) and than the multiply-add path from 2 rows on. Which of
the two AVX-512 paths a process takes is probed as the kernel loads (`_dot_wins`, a few milliseconds) unless
TANDEM_CPU_LINEAR names one (kernel-fma, kernel-dot).

A row's outputs do not depend on the other rows of its call, so a token verified among drafts gets the logits a
one-row step gives it, in bf16 too; the two multiply-add paths give the same bits, the dot products their own (the
instruction sums each pair of products in its own order and flushes denormals), so one path serves a process. AMX
CPUs (where oneDNN's tiles were not measured
against it), float32 models and layers whose outputs are not a multiple of 32 keep oneDNN's product (on an AVX2 CPU,
bf16 layers the kernel does not take stay nn.Linear); so does every model with `TANDEM_CPU_LINEAR=onednn`
(`ENABLED`), which is read as the layers are built, at a model's load.

`bf16_linear` is the op `tandem::bf16_linear` (its schema and shape function here, its CPU kernel registered by the
built library, core.cpu_kernels), so compiled forwards call it as they are traced.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tandem.core import cpu_kernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "bf16_linear.cpp"
# kernel: the kernel, on the path the probe picks where it has two; kernel-fma, kernel-dot: on that path; onednn.
SETTINGS = ("kernel", "kernel-fma", "kernel-dot", "onednn")
_SETTING = os.environ.get("TANDEM_CPU_LINEAR", "kernel")
if _SETTING not in SETTINGS:
    raise ValueError(f"TANDEM_CPU_LINEAR: one of {', '.join(SETTINGS)}, got {_SETTING!r}")
ENABLED: list[bool] = [_SETTING != "onednn"]  # a cell: tests and benchmarks build layers of both kinds in one process
PANEL = 32  # output columns per packed panel: a layer's outputs must be a multiple of it
_built: list[bool] = []  # once asked: whether the kernel was built and registered

torch.library.define("tandem::bf16_linear", "(Tensor x, Tensor packed, Tensor? bias) -> Tensor")


@torch.library.register_fake("tandem::bf16_linear")
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0] * PANEL))


# torch's CPU capability -> the kernel's path: AVX-512 (16 float32 a register) or AVX2 with FMA (8). AMX CPUs keep
# oneDNN's bf16 products, which run on its tiles there (not measured against this kernel).
ISA_BITS = {"AVX512": 512, "AVX512_BF16": 512, "AVX2": 256}
DOT = 16  # the path of AVX512-BF16 dot products, which an AVX-512 CPU with them may take instead of 512
PATH_NAMES = {512: "AVX-512 multiply-add", 256: "AVX2 multiply-add", DOT: "AVX512-BF16 dot-product"}
# The probe between the two AVX-512 paths: a step of 24 rows (8 sequences verifying 2 drafts) over a weight that
# stays in cache, where the arithmetic's rate decides; the dot products must win by the margin, so a CPU where the
# two are close keeps the multiply-adds (the path CPU-D measured) rather than flip with the noise.
PROBE_ROWS, PROBE_SHAPE, PROBE_CALLS, DOT_MARGIN = 24, (2048, 1536), 5, 1.15
_probed: dict[str, float] = {}  # the probe's best seconds a call, by path (empty where it did not run)


def ready() -> bool:
    """Whether the kernel runs in this process, building it on first use: an x86 CPU whose torch dispatches to AVX2 or
    AVX-512 (the kernel takes the same path: ATEN_CPU_CAPABILITY=avx2 runs its AVX2 path on an AVX-512 CPU) but not
    AMX, and a C++ compiler. On an AVX-512 CPU with AVX512-BF16 the path is the faster of 512 and DOT as probed here
    (or as TANDEM_CPU_LINEAR names it)."""
    if not _built:
        bits = ISA_BITS.get(torch.backends.cpu.get_cpu_capability())
        built = bits is not None and cpu_kernels.build(SOURCE, "CPU bf16 linear kernel", isa=())
        if built:
            torch.ops.tandem.bf16_linear_isa(bits)
            if bits == 512 and _SETTING != "kernel-fma" and runs_dot():
                torch.ops.tandem.bf16_linear_isa(DOT if _SETTING == "kernel-dot" or _dot_wins() else 512)
            elif _SETTING == "kernel-dot":
                log.warning("TANDEM_CPU_LINEAR=kernel-dot: this CPU (or torch's capability here) has no AVX512-BF16 "
                            "dot products; the kernel multiplies by float32 multiply-adds")
            log.info("CPU bf16 linear kernel: the %s path%s", PATH_NAMES[isa_bits()],
                     f" (probed, seconds a call: {_probed})" if _probed else "")
        _built.append(built)
    return _built[0]


def runs_dot() -> bool:
    """Whether this CPU runs the DOT path (the kernel built)."""
    try:
        with isa(DOT):
            return True
    except RuntimeError:
        return False


def _dot_wins() -> bool:
    """Whether DOT ran PROBE_SHAPE's product over PROBE_ROWS rows DOT_MARGIN times as fast as 512 here (the paths
    alternated, each's best call kept): a Zen 4 EPYC ran DOT 2.2x as fast. On the Xeon whose dot products run at a
    quarter of its multiply-adds' rate (CPU-D), oneDNN's dot products took 1.84x the multiply-add path's time at 24
    rows, so it should keep 512; the probe has not run there (docs/performance.md, "A bf16 product of tandem's
    own")."""
    generator = torch.Generator().manual_seed(0)
    packed = pack(torch.randn(PROBE_SHAPE, generator=generator).bfloat16())
    x = torch.randn(PROBE_ROWS, PROBE_SHAPE[1], generator=generator).bfloat16()
    best = {512: float("inf"), DOT: float("inf")}
    for _ in range(PROBE_CALLS):
        for path in best:
            with isa(path):
                started = time.perf_counter()
                torch.ops.tandem.bf16_linear(x, packed, None)
                best[path] = min(best[path], time.perf_counter() - started)
    _probed.update({"fma": best[512], "dot": best[DOT]})
    return best[512] >= DOT_MARGIN * best[DOT]


def path_name() -> str | None:
    """The path this process's products take (PATH_NAMES), None where the kernel was not asked for or not built."""
    return PATH_NAMES[isa_bits()] if _built and _built[0] else None


def probed() -> dict[str, float]:
    """The probe's best seconds a call by path ("fma", "dot"), where it ran."""
    return dict(_probed)


def isa_bits() -> int:
    """The path the kernel takes (512: AVX-512 multiply-adds, DOT: AVX512-BF16 dot products, 256: AVX2); the kernel
    must be ready()."""
    return torch.ops.tandem.bf16_linear_isa(0)


@contextmanager
def isa(bits: int) -> Iterator[None]:
    """Products inside take the kernel's `bits` path (512, DOT or 256, one this CPU runs): a benchmark or test that
    runs several paths in one process; the kernel must be built."""
    was = isa_bits()
    torch.ops.tandem.bf16_linear_isa(bits)
    try:
        yield
    finally:
        torch.ops.tandem.bf16_linear_isa(was)


@contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Layers built inside take the kernel where it fits (`on`) or oneDNN's product, whatever `ENABLED` says outside:
    a benchmark or test that builds both kinds in one process."""
    ENABLED[0], was = on, ENABLED[0]
    try:
        yield
    finally:
        ENABLED[0] = was


def fits(weight: torch.Tensor) -> bool:
    """Whether a layer of this [out, in] weight runs on the kernel (fits_layer)."""
    return fits_layer(weight.shape[0], weight.dtype, weight.device)


def fits_layer(out_features: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a layer of `out_features` outputs runs on the kernel: bf16 on the CPU, outputs a multiple of PANEL, the
    kernel on (`ENABLED`) and built here."""
    return (ENABLED[0] and device.type == "cpu" and dtype == torch.bfloat16 and out_features % PANEL == 0
            and ready())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out / 32, in, 32]: panels of 32 outputs, input-major, and within an input's 32 weights output i
    beside output 16 + i (the kernel widens the two halves of each 32-bit lane apart)."""
    out_features, in_features = weight.shape
    panels = weight.detach().reshape(out_features // PANEL, 2, PANEL // 2, in_features)
    # Two transposed halves stacked: 1.5-1.7x the speed of one four-axis permute's copy (a load packs GBs).
    return torch.stack([panels[:, 0].transpose(1, 2), panels[:, 1].transpose(1, 2)], dim=-1).reshape(
        out_features // PANEL, in_features, PANEL)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The [out, in] weight `pack` was given."""
    panels, in_features, _ = packed.shape
    return packed.reshape(panels, in_features, PANEL // 2, 2).permute(0, 3, 2, 1).reshape(panels * PANEL, in_features)


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for the weight `pack` packed, x [..., in] bf16."""
    return torch.ops.tandem.bf16_linear(x, packed, bias)
