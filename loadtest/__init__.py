"""loadtest: an asyncio load generator for tandem, over gRPC (tandem.v1.GenerationService) or OpenAI's HTTP API
(python -m loadtest --help).

arrivals.py   Poisson / gamma arrival schedules          prompts.py + prompts/*.jsonl  the shipped prompt sets
config.py     one load level's settings                   client_run.py  the asyncio driver, records a RunTrace
backends.py   gRPC and OpenAI HTTP (SSE) streams -> events  (timed alike by client_run.py)
trace.py      per-request records (trace.jsonl)           metrics.py     vLLM `bench serve` metrics over a trace
run.py        one level -> results.json                   sweep.py       levels × AUTO/OFF -> sweep.json + plots
target.py     the loopback-only address check             report/plots.py  PNG plots of a sweep
"""
