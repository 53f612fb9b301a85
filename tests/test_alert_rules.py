"""The Helm chart's alerting rules (templates/prometheusrule.yaml): rendered only when asked, checked and unit-tested
by Prometheus's own promtool (each alert fires on the series it is about and stays quiet on healthy ones and on
another release's), and every metric and label they read is one a real gateway exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway_harness import ServerThread, tiny_backend
from tandem.client import TandemClient
from telemetry_helpers import scrape
from test_helm_chart import CHART, RELEASE, find, helm, one, render

ENABLED = ("metrics.serviceMonitor.enabled=true", "metrics.prometheusRule.enabled=true")
NAMESPACE, JOB = "default", f"{RELEASE}-tandem-metrics"  # helm template's namespace; the ServiceMonitor's job
SCRAPE_LABELS = {"namespace", "job", "pod", "le"}  # added by Prometheus or the histogram, not by tandem


def rules(*sets: str) -> dict[str, dict]:
    rule = one(render(None, *ENABLED, *sets), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def test_rules_render_when_asked_with_the_values_thresholds() -> None:
    assert not find(render(None, ENABLED[0]), "PrometheusRule")
    refused = helm("template", RELEASE, str(CHART), "--set", ENABLED[1])
    assert refused.returncode != 0 and "needs metrics.serviceMonitor.enabled" in refused.stderr
    alerts = rules("metrics.prometheusRule.queueDepth=40", "metrics.prometheusRule.labels.release=kps")
    assert set(alerts) == {"TandemRequestErrors", "TandemRequestsRefused", "TandemSlowFirstToken",
                           "TandemQueueBacklog", "TandemWorkerDown", "TandemKVPreemptions",
                           "TandemSpeculationFallback"}
    assert alerts["TandemQueueBacklog"]["expr"].endswith("> 40")
    assert one(render(None, *ENABLED, "metrics.prometheusRule.labels.release=kps"),
               "PrometheusRule")["metadata"]["labels"]["release"] == "kps"
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
    alerts = rules()
    spec = one(render(None, *ENABLED), "PrometheusRule")["spec"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
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


def test_every_series_the_rules_read_is_one_a_real_gateway_exports(tiny_models) -> None:
    target, draft, _ = tiny_models
    server = ServerThread(tiny_backend(target, draft), metrics_port=0)
    try:
        with TandemClient(server.address, timeout=60) as client:
            client.generate_text(token_ids=[5, 17, 99], max_tokens=8, temperature=0.0)
            with pytest.raises(Exception, match="temperature"):
                client.generate_text(token_ids=[1], temperature=-1.0)  # a failed request: its error_type label
        assert server.wait_for(lambda: server.gateway.loop.active == 0)
        families = scrape(server.gateway.metrics_url)
    finally:
        server.stop()
    exported: dict[str, set[str]] = {}
    for family in families.values():
        for name, labels, _ in family:
            exported.setdefault(name, set()).update(labels)
    for name, alert in rules().items():
        metrics, labels = _read(alert["expr"])
        assert metrics, name
        for metric in metrics:
            assert metric in exported, (name, metric)
        assert labels <= set().union(*(exported[m] for m in metrics)), (name, labels)
