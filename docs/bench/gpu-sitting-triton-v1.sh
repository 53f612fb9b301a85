#!/usr/bin/env bash
# The next GPU sitting, prepared: core.triton_decode's first run on a GPU, in two device calls of under 9 minutes
# each (the device tool's limit is 10 a call, 15 a session). Outputs go to $OUT (the device tool brings them back);
# copy them into docs/bench/ and the figures into docs/performance.md, "On a GPU".
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
case "${1:-1}" in
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
    echo "usage: $0 1|2|2-sdpa" >&2
    exit 2
    ;;
esac
