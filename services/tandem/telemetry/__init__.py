"""Observability: OpenTelemetry tracing (GenAI conventions, W3C context across gRPC and Ray) and Prometheus metrics.

- `tracing`: the tracer provider from the standard OTEL_* variables and the worker-span relay.
- `propagation`: W3C trace context in gRPC metadata (client, gateway) and in Ray call arguments (API only).
- `rounds`: per-request child spans for the engine's rounds (prefill, speculation rounds), on the engine thread.
- `gateway`: what the servicer records per Generate call (the SERVER span and the gen_ai.server.* histograms).
- `metrics`: the gateway's instruments and its Prometheus endpoint.
- `worker`: worker-side spans and the worker's Prometheus endpoint.
- `overhead`: `python -m tandem.bench.overhead` times the instrumentation's per-call cost.
"""
