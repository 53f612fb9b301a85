#!/usr/bin/env bash
# A GPU sitting, prepared: core.triton_decode's first run on a GPU. Outputs go to $OUT (the device tool brings them
# back); copy them into docs/bench/ and the figures into docs/performance.md, "On a GPU". The device tool allows 10
# minutes a call and 15 a session, the machine's start included, so one call runs it all:
#   bash docs/bench/gpu-sitting-triton-v1.sh all       (timeout_s 590: tests, the A/B, the attention probe last,
#                                                        cut to the time left)
# or, on a longer lease, two calls:
#   device call 1:  bash docs/bench/gpu-sitting-triton-v1.sh 1     (timeout_s 560)
#   device call 2:  bash docs/bench/gpu-sitting-triton-v1.sh 2     (timeout_s 560; 2-sdpa if stage 1's tests failed)
# Stage 1: the equality tests of the Triton and flex kernels, alone and inside compiled CUDA graphs (greedy tokens
# equal to Hugging Face's in float32), then attention alone per kernel and plain decoding with each, against
# PyTorch's pick. Stage 2: the forward and end-to-end A/B of the runner's default (cuBLAS products, sdpa), the
# Triton kernel and flex (gpu-inductor-ab-v1.py); 2-sdpa leaves the Triton variant out.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=services
out="${OUT:-/tmp/gpu-sitting}"
mkdir -p "$out"
started=$(date +%s)
note() { echo "[$(($(date +%s) - started)) s] $*" | tee -a "$out/sitting.log"; }

note "stage ${1:-1}: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
note "$(python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers",
    transformers.__version__, "triton", triton.__version__)' 2>&1)"
export PYTHONUNBUFFERED=1
case "${1:-1}" in
all)
    timeout 190 python3 -m pytest -o addopts="" -q -rA -p no:cacheprovider tests/test_triton_decode.py \
        tests/test_cuda_graphs.py -k "triton or flex" > "$out/gpu-tests-triton-v1.log" 2>&1
    tests=$?
    note "tests: exit $tests ($(tail -1 "$out/gpu-tests-triton-v1.log"))"
    variants=cublas,cublas_triton,cublas_flex
    [ "$tests" = 0 ] || variants=cublas,cublas_triton
    timeout 230 python3 docs/bench/gpu-inductor-ab-v1.py --variants "$variants" --rounds 8 --deadline-s 190 \
        --json "$out/gpu-triton-ab-v1.json" > "$out/gpu-triton-ab-v1.log" 2>&1
    note "A/B ($variants): exit $?"
    left=$((555 - ($(date +%s) - started)))
    if [ "$left" -gt 60 ]; then
        timeout "$left" python3 -m tandem.bench.gpu_probe --only-attention triton --warm-seconds 5 \
            --json "$out/gpu-attention-triton-v1.json" > "$out/gpu-attention-triton-v1.log" 2>&1
        note "attention probe (${left} s allowed): exit $?"
    fi
    ;;
1)
    timeout 250 python3 -m pytest -o addopts="" -q -rA -p no:cacheprovider tests/test_triton_decode.py \
        tests/test_cuda_graphs.py -k "triton or flex" > "$out/gpu-tests-triton-v1.log" 2>&1
    note "tests: exit $? ($(tail -1 "$out/gpu-tests-triton-v1.log"))"
    timeout 270 python3 -m tandem.bench.gpu_probe --only-attention triton --warm-seconds 10 \
        --json "$out/gpu-attention-triton-v1.json" > "$out/gpu-attention-triton-v1.log" 2>&1
    note "attention probe: exit $?"
    ;;
2 | 2-sdpa)
    variants=cublas,cublas_triton,cublas_flex
    [ "$1" = 2-sdpa ] && variants=cublas,cublas_flex
    timeout 530 python3 docs/bench/gpu-inductor-ab-v1.py --variants "$variants" --rounds 8 --deadline-s 420 \
        --json "$out/gpu-triton-ab-v1.json" > "$out/gpu-triton-ab-v1.log" 2>&1
    note "A/B ($variants): exit $?"
    ;;
*)
    echo "usage: $0 all|1|2|2-sdpa" >&2
    exit 2
    ;;
esac
