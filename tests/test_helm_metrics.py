"""The Helm chart's Prometheus scraping: the PodMonitor on the pool workers' metrics ports and the ServiceMonitor on the
gateways' and Ray nodes' exporters (alerts and dashboard: test_monitoring.py)."""

from __future__ import annotations

from helm_harness import (
    FULLNAME,
    env_of,
    find,
    one,
    ray_groups,
    ray_resources,
    render,
    selects,
)


def test_worker_metrics_reach_prometheus_through_a_pod_monitor():
    objs = render("pools-autoscaling-values.yaml")
    groups = ray_groups(objs)
    monitor = one(objs, "PodMonitor", f"{FULLNAME}-workers")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["podMetricsEndpoints"])
    selector = monitor["spec"]["selector"]
    [expression] = selector["matchExpressions"]
    assert expression["key"] == "tandem.io/ray-group" and expression["operator"] == "In"
    exposed = set()
    for name, group in groups.items():
        template = group["template"]
        labels = template["metadata"]["labels"]
        selected = selects(selector["matchLabels"], labels) and labels[expression["key"]] in expression["values"]
        ray = template["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in ray["ports"]}
        worker_ports = {n: p for n, p in ports.items() if n.startswith("wrk-metrics-")}
        if name == "head":
            assert not selected and not worker_ports and "TANDEM_WORKER_METRICS_PORT" not in env_of(ray)
            continue
        assert selected
        first = int(env_of(ray)["TANDEM_WORKER_METRICS_PORT"])
        # Each worker of the pod takes the first free port from TANDEM_WORKER_METRICS_PORT on: one port per worker.
        per_pod = ray_resources(group)["draft_pool" if name == "draft-pool" else "target_pool"]
        assert sorted(worker_ports.values()) == list(range(first, first + per_pod))
        # 9465 is Ray's own exporter (--metrics-export-port), which must not be taken by a worker.
        assert int(group["rayStartParams"]["metrics-export-port"]) == ports["metrics"] == 9465
        assert ports["metrics"] not in worker_ports.values()
        exposed |= set(worker_ports)
    assert exposed == scraped == {"wrk-metrics-0", "wrk-metrics-1"}  # two draft workers per draft-pool pod
    assert not find(render(), "PodMonitor")
    # Embedded tensor-parallel pods host tp ranks, each with its own port.
    tp4 = ray_groups(render("tp4-multi-replica-values.yaml", "metrics.serviceMonitor.enabled=true"))
    tp4_ports = [p for p in tp4["target-pool"]["template"]["spec"]["containers"][0]["ports"]
                 if p["name"].startswith("wrk-metrics-")]
    assert len(tp4_ports) == 4


def test_service_monitor_scrapes_gateways_and_ray_nodes():
    objs = render("external-redis-servicemonitor-values.yaml")
    monitor, service = one(objs, "ServiceMonitor"), one(objs, "Service", f"{FULLNAME}-metrics")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s",
                                             "scrapeTimeout": "10s"}]
    assert service["spec"]["ports"][0]["name"] == "metrics" and service["spec"]["ports"][0]["targetPort"] == "metrics"
    templates = [d["spec"]["template"] for d in find(objs, "Deployment")]
    templates += [g["template"] for g in ray_groups(objs).values()]
    metrics_ports = set()
    for template in templates:
        assert selects(service["spec"]["selector"], template["metadata"]["labels"])
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        metrics_ports.add(ports["metrics"])
    assert metrics_ports == {9464, 9465}
    for group in ray_groups(objs).values():
        assert group["rayStartParams"]["metrics-export-port"] == "9465"
    assert not find(render(), "ServiceMonitor")
    assert one(objs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["interval"] == "15s"
