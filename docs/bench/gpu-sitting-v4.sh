#!/usr/bin/env bash
# The next GPU sitting, prepared: two device calls on one machine, the second straight after the first while it is
# warm (the tool allows 10 minutes a call and 15 a session, the machine's start included):
#   bash docs/bench/gpu-sitting-v4.sh 1     # timeout_s 570
#   bash docs/bench/gpu-sitting-v4.sh 2     # timeout_s 250, if time is left
# Outputs go to $OUT (the device tool brings them back); copy them into docs/bench/ and the figures into
# docs/performance.md, "On a GPU". In order, so that a cut leaves the first ones run:
# call 1:
# 1. one-row products alone (tandem.bench.row_products): each product of both models' layers under cuBLAS against
#    core.triton_gemv's kernel, folded as core.folded_layers folds it (norm, activation, residual, q and k's
#    rotation) at each tile size, and alone at the best one (1-2 minutes, mostly Triton's compiles);
# 2. the forward and plain batch 1 end to end with folded layers on (`rows`: TANDEM_GPU_ROW_PRODUCTS) against the
#    default, a token a call and blocks of 8 (--decode-steps 8), with profiles, at the tiles step 1 found best
#    (--tiles): one forward is the goal's figure (>= 50% of the weight-bandwidth limit; 28% on 2026-12-04);
# 3. the GPU tests never yet run: the kernel's and the folded layers' own (tests/test_triton_gemv.py,
#    tests/test_folded_layers.py), the compiled graphs with them (float32 tokens, also with q/k/v's kernel writing
#    the cache; bf16 accuracy; every GPU test now runs folded layers, the kernel off), multi-step decoding in CUDA
#    graphs, one wait per plain step, on_device's copies, and the Triton attention in the compiled graphs with its
#    merge now a kernel of its own ([None-TRITON], [4-TRITON]) and over each row's keys in one kernel
#    ([4-TRITON_WHOLE]);
# call 2: attention alone per kernel and split (split 0: a row's keys in one block, one kernel, no merge), then
#    the folded layers (rows) A/B'd with the Triton attention over each row's keys in one kernel (rows_whole) and,
#    if time is left, that with q/k/v's kernel writing the cache as well (rows_kv: KV_WRITES).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=services PYTHONUNBUFFERED=1
out="${OUT:-/tmp/gpu-sitting}"
mkdir -p "$out"
started=$(date +%s)
note() { echo "[$(($(date +%s) - started)) s] $*" | tee -a "$out/sitting.log"; }
left() { echo $(("$1" - ($(date +%s) - started))); }

note "call ${1:-1}: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
note "$(python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers",
    transformers.__version__, "triton", triton.__version__)' 2>&1)"
if [ "${1:-1}" = 1 ]; then
    timeout 120 python3 -m tandem.bench.row_products --json "$out/gpu-row-products-v1.json" \
        > "$out/gpu-row-products-v1.log" 2>&1
    note "row products: exit $?"
    python3 -m tandem.bench.row_products --summarize "$out/gpu-row-products-v1.json" > "$out/gpu-row-products-v1.md" 2>&1
    timeout 230 python3 docs/bench/gpu-inductor-ab-v1.py --variants cublas,rows --decode-steps 8 --rounds 6 \
        --tiles "$out/gpu-row-products-v1.json" --deadline-s 210 --json "$out/gpu-rows-ab-v1.json" \
        > "$out/gpu-rows-ab-v1.log" 2>&1
    note "rows A/B: exit $?"
    graphs=tests/test_cuda_graphs.py::test_graphs_attending_with_flex_or_triton_give_the_hf_greedy_tokens_in_float32
    timeout "$(left 550)" python3 -m pytest -o addopts="" -q -rA -p no:cacheprovider \
        tests/test_triton_gemv.py tests/test_folded_layers.py \
        tests/test_cuda_graphs.py::test_graphs_with_one_row_products_give_the_hf_greedy_tokens_in_float32 \
        tests/test_cuda_graphs.py::test_bf16_graphs_with_one_row_products_are_as_accurate_as_eager \
        tests/test_cuda_graphs.py::test_multi_step_decoding_gives_the_hf_greedy_tokens_and_waits_for_the_gpu_once_a_block \
        tests/test_cuda_graphs.py::test_a_plain_decode_step_waits_for_the_gpu_once \
        tests/test_device.py::test_on_device_copies_to_a_gpu_without_waiting_for_it_and_to_the_host_with \
        "$graphs[None-TRITON]" "$graphs[4-TRITON]" "$graphs[4-TRITON_WHOLE]" > "$out/gpu-tests-v4.log" 2>&1
    note "tests: exit $? ($(tail -1 "$out/gpu-tests-v4.log"))"
else
    # the Triton attention at 64, 128, 256 and 1024 keys a thread block beside cuDNN's
    timeout 80 python3 -m tandem.bench.gpu_probe --only-attention triton --warm-seconds 5 \
        --json "$out/gpu-attention-triton-v2.json" > "$out/gpu-attention-triton-v2.log" 2>&1
    note "attention probe (cut once attention_seconds is in): exit $?"
    if [ "$(left 230)" -gt 100 ]; then
        timeout "$(left 230)" python3 docs/bench/gpu-inductor-ab-v1.py --variants rows,rows_whole,rows_kv --rounds 4 \
            --tiles "$out/gpu-row-products-v1.json" \
            --deadline-s "$(($(left 230) - 20))" --json "$out/gpu-triton-ab-v3.json" > "$out/gpu-triton-ab-v3.log" 2>&1
        note "Triton attention A/B: exit $?"
    fi
fi
