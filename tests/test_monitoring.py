"""The Helm chart's monitoring: its alerting rules (templates/prometheusrule.yaml) and Grafana dashboard
(files/grafana-dashboard.json), each rendered only when asked. Prometheus' own promtool checks every expression and
unit-tests the alerts (each fires on the series it is about, stays quiet on healthy ones and on another release's);
every metric and label either reads is one a real gateway or pool worker exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from gateway_harness import ServerThread, tiny_backend
from helm_harness import CHART, RELEASE, find, helm, one, render
from tandem.client import TandemClient
from tandem.core.protocol import KVUsage
from tandem.telemetry.worker import WorkerMetrics
from telemetry_helpers import scrape

ENABLED = ("metrics.serviceMonitor.enabled=true", "metrics.prometheusRule.enabled=true")
NAMESPACE, JOB = "default", f"{RELEASE}-tandem-metrics"  # helm template's namespace; the ServiceMonitor's job
SCRAPE_LABELS = {"namespace", "job", "pod", "le"}  # added by Prometheus or the histogram, not by tandem


def rule_object(*sets: str) -> dict:
    rule = one(render(None, *ENABLED, *sets), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    return rule


def alerts_of(rule: dict) -> dict[str, dict]:
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def test_rules_render_when_asked_with_the_values_thresholds() -> None:
    assert not find(render(None, ENABLED[0]), "PrometheusRule")
    refused = helm("template", RELEASE, str(CHART), "--set", ENABLED[1])
    assert refused.returncode != 0 and "needs metrics.serviceMonitor.enabled" in refused.stderr
    rule = rule_object("metrics.prometheusRule.queueDepth=40", "metrics.prometheusRule.labels.release=kps")
    alerts = alerts_of(rule)
    assert set(alerts) == {"TandemRequestErrors", "TandemRequestsRefused", "TandemSlowFirstToken",
                           "TandemQueueBacklog", "TandemWorkerDown", "TandemKVPreemptions",
                           "TandemSpeculationFallback"}
    assert alerts["TandemQueueBacklog"]["expr"].endswith("> 40")
    assert rule["metadata"]["labels"]["release"] == "kps"
    for alert in alerts.values():
        assert f'namespace="{NAMESPACE}"' in alert["expr"] and alert["labels"]["severity"] in {"critical", "warning",
                                                                                                "info"}


def _series(name: str, values: str, namespace: str = NAMESPACE, **labels: str) -> dict:
    labels = {"namespace": namespace, "job": JOB, "pod": f"{RELEASE}-tandem-gateway-0"} | labels
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


REQUESTS = "gen_ai_server_request_duration_seconds_count"
TTFT = "gen_ai_server_time_to_first_token_seconds_bucket"
# (input series, evaluation minute, alert, the label sets it fires with: none means it stays quiet)
CASES = [
    ([_series(REQUESTS, "0+60x30"), _series(REQUESTS, "0+6x30", error_type="INTERNAL"),
      _series(REQUESTS, "0+60x30", "other"), _series(REQUESTS, "0+60x30", "other", error_type="INTERNAL")],
     10, "TandemRequestErrors", [{"namespace": NAMESPACE}]),
    ([_series(REQUESTS, "0+60x30"), _series(REQUESTS, "0+6x30", error_type="INTERNAL")],
     4, "TandemRequestErrors", []),  # pending: not yet 5 minutes
    ([_series(REQUESTS, "0+60x30"), _series(REQUESTS, "0+1x30", error_type="UNAVAILABLE")],
     20, "TandemRequestErrors", []),
    ([_series(REQUESTS, "0+60x30"), _series(REQUESTS, "0+10x30", error_type="RESOURCE_EXHAUSTED")],
     20, "TandemRequestsRefused", [{"namespace": NAMESPACE}]),
    ([_series(REQUESTS, "0+60x30"), _series(REQUESTS, "0+1x30", error_type="RESOURCE_EXHAUSTED")],
     20, "TandemRequestsRefused", []),
    ([_series(TTFT, "0+1x40", le="1"), _series(TTFT, "0+10x40", le="20"), _series(TTFT, "0+10x40", le="+Inf")],
     25, "TandemSlowFirstToken", [{"namespace": NAMESPACE}]),
    ([_series(TTFT, "0+10x40", le="1"), _series(TTFT, "0+10x40", le="20"), _series(TTFT, "0+10x40", le="+Inf")],
     25, "TandemSlowFirstToken", []),
    ([_series("tandem_gateway_queue_depth", "20x30"),
      _series("tandem_gateway_queue_depth", "3x30", pod=f"{RELEASE}-tandem-gateway-1")],
     15, "TandemQueueBacklog", [{"namespace": NAMESPACE, "pod": f"{RELEASE}-tandem-gateway-0"}]),
    ([_series("tandem_worker_healthy", "1 1 0x20", tandem_worker_role="draft", tandem_worker_index="0"),
      _series("tandem_worker_healthy", "1 1 0x20", pod=f"{RELEASE}-tandem-gateway-1", tandem_worker_role="draft",
              tandem_worker_index="0"),
      _series("tandem_worker_healthy", "0x20", tandem_worker_role="draft", tandem_worker_index="1"),
      _series("tandem_worker_healthy", "1x20", pod=f"{RELEASE}-tandem-gateway-1", tandem_worker_role="draft",
              tandem_worker_index="1")],
     10, "TandemWorkerDown", [{"namespace": NAMESPACE, "tandem_worker_role": "draft", "tandem_worker_index": "0"}]),
    ([_series("tandem_engine_preemptions_total", "0+2x40", kind="kv")],
     20, "TandemKVPreemptions", [{"namespace": NAMESPACE}]),
    ([_series("tandem_engine_preemptions_total", "0x40", kind="kv"),
      _series("tandem_engine_preemptions_total", "0+50x40", kind="priority")],
     20, "TandemKVPreemptions", []),
    ([_series("tandem_engine_preemptions_total", "0x40", kind="kv"),  # a shared worker freeing others' caches
      _series("tandem_worker_kv_evictions_total", "0+1x40", job=f"{NAMESPACE}/{RELEASE}-tandem-workers",
              pod="tandem-pools-target-0", tandem_worker_role="target")],
     20, "TandemKVPreemptions", [{"namespace": NAMESPACE}]),
    ([_series("tandem_worker_kv_evictions_total", "0+1x40", "other", job=f"{NAMESPACE}/{RELEASE}-tandem-workers")],
     20, "TandemKVPreemptions", []),  # another namespace's workers
    ([_series("tandem_spec_sessions_in_fallback", "6x40"), _series("tandem_gateway_active_requests", "8x40")],
     35, "TandemSpeculationFallback", [{"namespace": NAMESPACE}]),
    ([_series("tandem_spec_sessions_in_fallback", "2x40"), _series("tandem_gateway_active_requests", "8x40")],
     35, "TandemSpeculationFallback", []),
]


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("no promtool: install Debian's prometheus package (.ci/run does)")
    return found


def test_promtool_checks_the_rules_and_each_alert_fires_only_where_it_should(promtool, tmp_path: Path) -> None:
    rule = rule_object()
    alerts = alerts_of(rule)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    checked = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert {case[2] for case in CASES} == set(alerts)
    tests = [{"interval": "1m", "input_series": series,
              "alert_rule_test": [{"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": [
                  {"exp_labels": labels | alerts[alert]["labels"], "exp_annotations": alerts[alert]["annotations"]}
                  for labels in firing]}]}
             for series, minute, alert, firing in CASES]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                         "tests": tests}))
    tested = subprocess.run([promtool, "test", "rules", str(tmp_path / "tests.yaml")], capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def _read(expr: str) -> tuple[set[str], set[str]]:
    """The metric names an expression selects and the label names it matches or groups by."""
    metrics = set(re.findall(r"\b([a-z_]+)\{", expr))
    labels = set(re.findall(r"([a-z_]+)=~?\"", expr))
    for group in re.findall(r"by \(([^)]*)\)", expr):
        labels |= {name.strip() for name in group.split(",")}
    return metrics, labels - SCRAPE_LABELS


@pytest.fixture(scope="module")
def exported(tiny_models) -> dict[str, set[str]]:
    """Sample name -> the label names it carries, from a real gateway with prompt lookup on (after a request, one with
    a prediction, one whose prompt repeats itself and a failed one, so the error_type and both draft sources' outcome
    labels exist) and a pool worker's own endpoint (after a call)."""
    target, draft, _ = tiny_models
    server = ServerThread(tiny_backend(target, draft, prompt_lookup=True), http_port=0,
                          metrics_port=0)  # HTTP: background, batches
    try:
        with TandemClient(server.address, timeout=60) as client:
            client.generate_text(token_ids=[5, 17, 99], max_tokens=8, temperature=0.0)
            client.generate_text(token_ids=[5, 17, 99], max_tokens=8, temperature=0.0, prediction="abcdefgh")
            client.generate_text(token_ids=[5, 17, 99, 5, 17], max_tokens=8, temperature=0.0)
            with pytest.raises(Exception, match="temperature"):
                client.generate_text(token_ids=[1], temperature=-1.0)
        assert server.wait_for(lambda: server.gateway.loop.active == 0)
        families = [scrape(server.gateway.metrics_url)]
    finally:
        server.stop()
    worker = WorkerMetrics("draft", "draft-0", "127.0.0.1", 0, lambda: KVUsage(8, 64, 256, 0))
    try:
        worker.record("propose", [SimpleNamespace(append=[1, 2])], 0.01, lost=False)
        worker.evicted.add(1, worker.base)
        families.append(scrape(worker.endpoint.url))
    finally:
        worker.endpoint.close()
    names: dict[str, set[str]] = {}
    for scraped in families:
        for family in scraped.values():
            for name, labels, _ in family:
                names.setdefault(name, set()).update(labels)
    return names


def _check_exported(exported: dict[str, set[str]], where: str, expr: str) -> None:
    metrics, labels = _read(expr)
    assert metrics, where
    for metric in metrics:
        assert metric in exported, (where, metric)
    assert labels <= set().union(*(exported[m] for m in metrics)), (where, labels)


def test_every_series_the_rules_read_is_one_a_real_gateway_exports(exported) -> None:
    for name, alert in alerts_of(rule_object()).items():
        _check_exported(exported, name, alert["expr"])


RATE_INTERVAL, PICKED_NAMESPACE = "5m", NAMESPACE  # what Grafana puts for $__rate_interval and $namespace


def dashboard() -> dict:
    config = one(render(None, "metrics.grafanaDashboard.enabled=true"), "ConfigMap", f"{RELEASE}-tandem-dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    return json.loads(config["data"]["tandem.json"])


def _queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, expression with Grafana's variables filled in) for every query of the dashboard."""
    queries = [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel["targets"]]
    queries += [(f"${v['name']}", re.sub(r"label_values\((\w+), *(\w+)\)", r"group by (\2) (\1{})", v["definition"]))
                for v in board["templating"]["list"] if v["type"] == "query"]
    return [(title, expr.replace("$__rate_interval", RATE_INTERVAL).replace("$namespace", PICKED_NAMESPACE))
            for title, expr in queries]


def test_the_dashboard_renders_when_asked_and_every_query_parses(promtool, tmp_path: Path) -> None:
    assert not find(render(), "ConfigMap", f"{RELEASE}-tandem-dashboard")
    board = dashboard()
    assert board["uid"] and len({panel["id"] for panel in board["panels"]}) == len(board["panels"])
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
    # promtool parses PromQL only in rule files: each query as a recording rule.
    records = [{"record": f"tandem:dashboard_query_{i}", "expr": expr} for i, (_, expr) in enumerate(_queries(board))]
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    checked = subprocess.run([promtool, "check", "rules", str(tmp_path / "queries.yaml")], capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    annotated = one(render(None, "metrics.grafanaDashboard.enabled=true",
                           "metrics.grafanaDashboard.annotations.grafana_folder=LLM"), "ConfigMap",
                    f"{RELEASE}-tandem-dashboard")
    assert annotated["metadata"]["annotations"] == {"grafana_folder": "LLM"}


def test_every_series_the_dashboard_reads_is_one_tandem_exports(exported) -> None:
    for title, expr in _queries(dashboard()):
        _check_exported(exported, title, expr)


@pytest.mark.parametrize(("role", "method"), [("draft", "propose"), ("target", "verify")])
def test_a_fresh_workers_event_counters_are_exported_at_zero(role: str, method: str) -> None:
    """An alert on a counter's rate reads a series absent until its first event as no data: a worker exports its
    lost-state and eviction counters at 0 from the start."""
    worker = WorkerMetrics(role, f"{role}-0", "127.0.0.1", 0)
    try:
        families = scrape(worker.endpoint.url)
    finally:
        worker.endpoint.close()
    lost = [(labels, count) for name, labels, count in families.get("tandem_worker_state_lost", [])
            if name == "tandem_worker_state_lost_total"]
    assert lost == [({"tandem_worker_role": role, "tandem_worker_name": f"{role}-0", "tandem_worker_method": method},
                     0.0)]
    evicted = [count for name, _, count in families.get("tandem_worker_kv_evictions", [])
               if name == "tandem_worker_kv_evictions_total"]
    assert evicted == [0.0]
