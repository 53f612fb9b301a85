"""loadtest: an asyncio gRPC load generator for tandem's tandem.v1.GenerationService API (python -m loadtest --help).

arrivals.py   Poisson / gamma arrival schedules          prompts.py + prompts/*.jsonl  the shipped prompt sets
config.py     one load level's settings                   client_run.py  the grpc.aio driver, records a RunTrace
trace.py      per-request records (trace.jsonl)           metrics.py     vLLM `bench serve` metrics over a trace
run.py        one level -> results.json                   sweep.py       levels × AUTO/OFF -> sweep.json + plots
target.py     the loopback-only address check             report/plots.py  PNG plots of a sweep
"""
