"""One trace across processes: client span -> gateway SERVER span -> round spans -> draft and target worker spans
(Ray actors in their own processes), all in the test's in-memory exporter; and the workers' own /metrics."""

from __future__ import annotations

import os

import pytest
from opentelemetry import trace

ray = pytest.importorskip("ray")

from gateway_harness import ServerThread  # noqa: E402
from tandem.client import TandemClient  # noqa: E402
from tandem.core.config import EngineConfig, SpecConfig  # noqa: E402
from tandem.engines import Arm, BuildOptions, ClusterOptions, build  # noqa: E402
from telemetry_helpers import by_trace, in_memory_tracing, scrape, value  # noqa: E402

PROMPT = [72, 101, 108, 108, 111, 32, 119]
TOKENS = 16
KV_TOKENS = 4096


@pytest.fixture(scope="module")
def cluster(tiny_dirs, ray_session):
    config = EngineConfig(spec=SpecConfig(adaptive=False, k_init=3), calibrate=False)
    options = ClusterOptions(draft_workers=1, target_replicas=1, threads=1, dtype="float32", kv_tokens=KV_TOKENS)
    backend = build(BuildOptions(str(tiny_dirs.target), (Arm("", str(tiny_dirs.draft), config),), options))[""]
    server = ServerThread(lambda: backend, metrics_port=0)
    yield server, backend
    server.stop()
    for worker in backend.engine.drafter.workers + backend.engine.verifier.workers:
        ray.kill(worker)


def test_one_trace_spans_gateway_draft_and_target_processes(cluster) -> None:
    server, backend = cluster
    with in_memory_tracing() as (exporter, tests_tracer), TandemClient(server.address, timeout=120) as client:
        with tests_tracer.start_as_current_span("client") as client_span:
            _, complete = client.generate_text(token_ids=PROMPT, session_id="traced", temperature=0.0,
                                               max_tokens=TOKENS, ignore_eos=True)
        spans = by_trace(exporter.get_finished_spans(), client_span.get_span_context().trace_id)
    by_id = {s.context.span_id: s for s in spans}
    server_span = next(s for s in spans if s.kind == trace.SpanKind.SERVER and s.name.startswith("text_completion"))
    assert server_span.parent.span_id == client_span.get_span_context().span_id
    assert server_span.attributes["gen_ai.conversation.id"] == "traced"
    rounds = [s for s in spans if s.name in ("tandem.prefill", "tandem.spec.round")]
    assert len(rounds) == complete.speculation.rounds
    assert all(by_id[s.parent.span_id] is server_span for s in rounds)

    drafts = [s for s in spans if s.name == "tandem.draft.propose"]
    targets = [s for s in spans if s.name == "tandem.target.verify"]
    assert len(targets) == len(rounds) and 0 < len(drafts) <= len(rounds)
    for span, service in [(s, "tandem-draft-worker") for s in drafts] + [(s, "tandem-target-worker") for s in targets]:
        assert span.resource.attributes["service.name"] == service
        assert span.resource.attributes["process.pid"] != os.getpid()  # recorded in another process
        assert by_id[span.parent.span_id] in rounds
        assert span.kind == trace.SpanKind.SERVER
    assert sum(s.attributes["tandem.spec.drafted"] for s in drafts) == complete.speculation.drafted_tokens
    assert sum(s.attributes["tandem.spec.accepted"] for s in targets) == complete.speculation.accepted_tokens
    prefill_target = next(s for s in targets if by_id[s.parent.span_id].name == "tandem.prefill")
    assert prefill_target.attributes["tandem.tokens.appended"] == len(PROMPT)
    worker_pids = {s.resource.attributes["process.pid"] for s in drafts + targets}
    infos = ray.get([w.info.remote() for w in backend.engine.drafter.workers + backend.engine.verifier.workers])
    assert worker_pids == {info["pid"] for info in infos}


def test_gateway_and_worker_metrics_endpoints(cluster) -> None:
    server, backend = cluster
    workers = backend.engine.drafter.workers + backend.engine.verifier.workers
    urls = ray.get([w.serve_metrics.remote(0, "127.0.0.1") for w in workers])
    assert ray.get([w.info.remote() for w in workers])[0]["metrics"] == urls[0]
    with TandemClient(server.address, timeout=120) as client:
        _, complete = client.generate_text(token_ids=PROMPT, temperature=0.0, max_tokens=TOKENS, ignore_eos=True,
                                           session_id="kept")  # a session's caches stay on its workers
    draft, target = (scrape(url) for url in urls)
    assert value(draft, "tandem_worker_calls_total", tandem_worker_role="draft", tandem_worker_method="propose") >= 1
    assert value(target, "tandem_worker_calls_total", tandem_worker_method="verify") == complete.speculation.rounds
    assert value(target, "tandem_worker_appended_tokens_total") >= len(PROMPT)
    assert value(target, "tandem_worker_call_duration_seconds_count") == complete.speculation.rounds
    infos = ray.get([w.info.remote() for w in workers])
    for families, role, info in zip((draft, target), ("draft", "target"), infos, strict=True):
        kv = {state: value(families, "tandem_worker_kv_tokens", tandem_worker_role=role, tandem_kv_state=state,
                           tandem_worker_name=info["name"]) for state in ("used", "reserved", "capacity")}
        assert kv == {"used": info["kv_tokens_used"], "reserved": info["kv_tokens_reserved"],
                      "capacity": KV_TOKENS}, role
        assert 0 < kv["used"] <= kv["reserved"] <= KV_TOKENS
        assert value(families, "tandem_kv_shared_tokens_total", tandem_worker_role=role,
                     tandem_worker_name=info["name"]) == info["shared_tokens"], role
        assert value(families, "process_resident_memory_bytes") > 0, role  # each process's own families
        assert "tandem_process_gc_pause_seconds" in families, role  # a frozen heap's full collections are rare
    gateway = scrape(server.gateway.metrics_url)
    assert value(gateway, "tandem_worker_healthy", tandem_worker_role="draft", tandem_worker_index=0) == 1
    assert value(gateway, "tandem_worker_healthy", tandem_worker_role="target", tandem_worker_index=0) == 1
    assert value(gateway, "gen_ai_server_request_duration_seconds_count") >= 1
    assert "tandem_kv_tokens" not in gateway  # Ray pools' KV tokens are on their workers' endpoints only
