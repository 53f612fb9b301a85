#!/usr/bin/env bash
# The next GPU sitting, prepared: one device call (timeout_s 570; the tool allows 10 minutes a call and 15 a session,
# the machine's start included). Outputs go to $OUT (the device tool brings them back); copy them into docs/bench/
# and the figures into docs/performance.md, "On a GPU".
#   bash docs/bench/gpu-sitting-v3.sh
# In order, so that a cut leaves the first ones run:
# 1. the GPU tests never yet run: multi-step decoding in CUDA graphs (core.decode_steps: the HF greedy tokens, one
#    wait for the GPU per block of 8), a plain decode step waits for the GPU once, core.device.on_device's copies do
#    not wait, and the Triton kernel's speculative widths in the graphs ([4-TRITON]);
# 2. plain decoding at batch 1 end to end, a token a verifier call against blocks of 8 (--decode-steps 8), with a
#    decode profile of each (GPU kernel time against wall time per token): on 2026-11-30 a token took 2.6 ms against
#    a 2.27 ms forward; the same run times one forward (the goal's figure, >= 50% of the weight-bandwidth limit);
# 3. where time is left, attention alone per kernel and split (the Triton kernel at 64-1024 keys a thread block),
#    then the A/B for the Triton kernel (cublas_triton) against the default.
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
timeout 200 python3 -m pytest -o addopts="" -q -rA -p no:cacheprovider \
    tests/test_cuda_graphs.py::test_multi_step_decoding_gives_the_hf_greedy_tokens_and_waits_for_the_gpu_once_a_block \
    tests/test_cuda_graphs.py::test_a_plain_decode_step_waits_for_the_gpu_once \
    tests/test_device.py::test_on_device_copies_to_a_gpu_without_waiting_for_it_and_to_the_host_with \
    "$graphs[4-TRITON]" > "$out/gpu-tests-v4.log" 2>&1
note "tests: exit $? ($(tail -1 "$out/gpu-tests-v4.log"))"
timeout 200 python3 docs/bench/gpu-inductor-ab-v1.py --variants cublas --decode-steps 8 --rounds 6 \
    --deadline-s 180 --json "$out/gpu-decode-steps-ab-v1.json" > "$out/gpu-decode-steps-ab-v1.log" 2>&1
note "decode-steps A/B: exit $?"
left=$((540 - ($(date +%s) - started)))
if [ "$left" -gt 60 ]; then  # the Triton kernel at 64, 128, 256 and 1024 keys a thread block beside cuDNN's
    allowed=$((left > 130 ? 120 : left - 10))
    timeout "$allowed" python3 -m tandem.bench.gpu_probe --only-attention triton --warm-seconds 5 \
        --json "$out/gpu-attention-triton-v2.json" > "$out/gpu-attention-triton-v2.log" 2>&1
    note "attention probe (${allowed} s allowed, cut once attention_seconds is in): exit $?"
fi
left=$((540 - ($(date +%s) - started)))
if [ "$left" -gt 150 ]; then
    timeout "$((left - 10))" python3 docs/bench/gpu-inductor-ab-v1.py --variants cublas,cublas_triton --rounds 4 \
        --decode-steps 8 --deadline-s "$((left - 40))" --json "$out/gpu-triton-ab-v3.json" \
        > "$out/gpu-triton-ab-v3.log" 2>&1
    note "Triton A/B: exit $?"
fi
