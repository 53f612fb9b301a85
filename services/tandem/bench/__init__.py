"""tandem's benchmarks, each `python -m tandem.bench.NAME --help` (a JSON report with `--json [PATH]`).

core.py          `tandem bench`: plain, Hugging Face generate (plain, assisted) and tandem on the same loaded models
serving.py       tok/s of 1 and N concurrent sessions against a running server, AUTO against OFF
turns.py         a chat's follow-up turn with its session's cached prefix against a fresh session
pools.py         shared pools: one gateway with N sessions against two gateways with N/2
overlap.py       drafting overlapped with verifying: two engine lanes against one, on shared pools
pool_overhead.py a pool worker as a detached actor against a Ray Serve deployment, per call
pools_chaos.py   the draft pool scaled, and a gateway SIGKILLed, under load
overhead.py      the telemetry's per-call cost
bound.py         the analytic bound beside a loadtest sweep (loadtest's report and sweep use it)
lone_itl.py      per-token ITL of one session alone, per speculation setting
detok.py         the CPU cost of streaming text: stop checks and the incremental detokenizer
kv_copies.py     KV-cache bytes a decode step copies (allocations.py counts them)
seeds.py         seeded sampling: identical output with speculation on and off, acceptance per rule
vllm_compare.py  tandem against vLLM on this machine (vllm_compare_tandem.py and, run by path in vLLM's own
                 environment, vllm_compare_vllm.py)
at_once.py       N requests at once in one process, plain against AUTO, with what the batch plan drafted
decode_steps.py  multi-step plain decoding (--decode-steps) against a token a call, in process or over Ray
outputs.py       the token ids of a fixed matrix of runs, to show a change kept behaviour (`--compare`)
gpu_probe.py     tandem's runner against Hugging Face on a GPU; runs by path from a checkout (torch + transformers)

prompts.py + prompts.jsonl  the shipped prompt set (`--prompts`); local_cluster.py  the Ray head, CLI and gateway
processes the pool benchmarks start. Load tests (arrival rates, sweeps, the HTTP API) are the loadtest package's.
"""
