#!/usr/bin/env bash
# The next GPU sitting, prepared: core.triton_decode in one device call (timeout_s 570; the tool allows 10 minutes a
# call and 15 a session, the machine's start included). Outputs go to $OUT (the device tool brings them back); copy
# them into docs/bench/ and the figures into docs/performance.md, "On a GPU".
#   bash docs/bench/gpu-sitting-triton-v2.sh
# What the 2026-12-04 sitting (gpu-sitting-triton-v1.sh all, then a short second call) left open, in order:
# 1. the Triton kernel's equality tests inside compiled CUDA graphs: only [None-TRITON] passed there, after the
#    float64-scale fix; [4-TRITON] (speculative widths) never ran;
# 2. the forward and end-to-end A/B of the runner's default against the Triton kernel in one run (that sitting
#    timed them in two calls on two machines: 2.285 against 2.313 ms a forward, not comparable), with a profile of
#    plain decoding per token: how much of the end-to-end time (2.6 ms a token on 2026-11-30 against a 2.27 ms
#    forward) is GPU kernels, and what runs outside the forward's graph;
# 3. attention alone per kernel, the Triton kernel at 64, 128, 256 and 1024 keys per thread block beside cuDNN's
#    (the probe's first figure; the rest of the probe is cut by the timeout).
# The tests also run two written after that sitting, never yet on a GPU: a plain decode step waits for the GPU
# once (tests/test_cuda_graphs.py, torch's sync debug mode), and core.device.on_device's copies to a GPU do not wait
# (tests/test_device.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=services PYTHONUNBUFFERED=1
out="${OUT:-/tmp/gpu-sitting}"
mkdir -p "$out"
started=$(date +%s)
note() { echo "[$(($(date +%s) - started)) s] $*" | tee -a "$out/sitting.log"; }

note "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
note "$(python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers",
    transformers.__version__, "triton", triton.__version__)' 2>&1)"
graphs=tests/test_cuda_graphs.py::test_graphs_attending_with_flex_or_triton_give_the_hf_greedy_tokens_in_float32
# The graph tests first, so that a cut leaves them run; the probe's own test is left to the probe below.
timeout 170 python3 -m pytest -o addopts="" -q -rA -p no:cacheprovider "$graphs[4-TRITON]" "$graphs[None-TRITON]" \
    tests/test_cuda_graphs.py::test_a_plain_decode_step_waits_for_the_gpu_once \
    tests/test_device.py::test_on_device_copies_to_a_gpu_without_waiting_for_it_and_to_the_host_with \
    tests/test_triton_decode.py --deselect \
    tests/test_triton_decode.py::test_the_probe_times_each_split_against_pytorchs_pick \
    > "$out/gpu-tests-triton-v3.log" 2>&1
note "tests: exit $? ($(tail -1 "$out/gpu-tests-triton-v3.log"))"
timeout 250 python3 docs/bench/gpu-inductor-ab-v1.py --variants cublas,cublas_triton --rounds 8 --deadline-s 225 \
    --json "$out/gpu-triton-ab-v3.json" > "$out/gpu-triton-ab-v3.log" 2>&1
note "A/B: exit $?"
left=$((540 - ($(date +%s) - started)))
if [ "$left" -gt 60 ]; then
    timeout "$left" python3 -m tandem.bench.gpu_probe --only-attention triton --warm-seconds 5 \
        --json "$out/gpu-attention-triton-v2.json" > "$out/gpu-attention-triton-v2.log" 2>&1
    note "attention probe (${left} s allowed, cut once attention_seconds is in): exit $?"
fi
