"""The Helm chart's gateway Deployments: gRPC health probes and a drain that fits the grace period, joining Ray as a
driver in both topologies (`tandem gateway --pools` on shared pools, embedded `tandem serve`), and the HPAs,
PodDisruptionBudgets and Services around them."""

from __future__ import annotations

import pytest

from helm_harness import (
    EMBEDDED,
    FULLNAME,
    ROOT,
    ci_values_fixture,  # noqa: F401 (the ci_values fixture)
    container,
    env_of,
    find,
    flags,
    gateway_container,
    gateways,
    one,
    pools_container,
    render,
    selects,
    serves_tls,
)


def test_gateway_probes_use_grpc_health(ci_values):
    for deployment in gateways(render(ci_values)):
        pod = deployment["spec"]["template"]["spec"]
        gateway = container(pod, "gateway")
        ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
        assert ports == {"grpc": 50051, "http": 8000, "metrics": 9464}
        startup = gateway["startupProbe"]
        if not serves_tls(gateway):  # under TLS: test_gateway_tls_moves_the_probes_to_https_and_mounts_the_secret
            # The HTTP API is served beside gRPC; gRPC health stays the probe (it reports loading and draining).
            assert gateway["livenessProbe"]["grpc"] == {"port": 50051, "service": ""}
            assert gateway["readinessProbe"]["grpc"] == {"port": 50051, "service": "tandem.v1.GenerationService"}
            assert startup["grpc"] == {"port": 50051, "service": "tandem.v1.GenerationService"}
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60, "startup budget below model loading"
        grace = float(flags(gateway["args"])["grace"])
        pre_stop = int(gateway["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] > pre_stop + grace


def assert_joins_ray_as_a_driver(objs, pod: dict, gateway: dict) -> str:
    head = f"{FULLNAME}-ray-head-svc:6379"  # KubeRay names the head Service <RayCluster>-head-svc
    assert one(objs, "RayCluster")["metadata"]["name"] == f"{FULLNAME}-ray"
    # The gateway joins Ray as a node that takes no actors, then execs tandem under tini.
    assert gateway["command"][:2] == ["tini", "--"]
    assert "--num-cpus=0 --num-gpus=0" in gateway["command"][4] and 'exec tandem "$@"' in gateway["command"][4]
    assert env_of(gateway)["RAY_ADDRESS"] == head
    assert "ray health-check" in pod["initContainers"][0]["command"][2]
    return head


def test_pools_gateway_attaches_to_the_release_pools():
    objs = render()
    pod = one(objs, "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]
    gateway = container(pod, "gateway")
    head = assert_joins_ray_as_a_driver(objs, pod, gateway)
    assert gateway["args"][0] == "gateway"
    args = flags(gateway["args"])
    assert args == {"pools": FULLNAME, "host": "0.0.0.0", "port": "50051", "http-port": "8000", "metrics-port": "9464",
                    "ray-address": head, "grace": "30", "response-ttl": "3600", "http-keep-alive": "620"}
    env = env_of(pools_container(objs))
    assert env["TANDEM_POOLS"] == args["pools"]
    # A stateless gateway loads no worker: no serve-only flags.
    assert not {"draft-workers", "tp", "device", "target"} & set(args)

    extra = gateway_container(gateways(render(None, "gateway.extraArgs={--lanes=2}"))[0])["args"]
    assert extra[-1] == "--lanes=2"


def test_embedded_gateway_runs_tandem_serve_against_the_ray_head():
    objs = render(None, EMBEDDED)
    assert not find(objs, "Job") and not find(objs, "ConfigMap")
    pod = one(objs, "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]
    gateway = container(pod, "gateway")
    head = assert_joins_ray_as_a_driver(objs, pod, gateway)
    assert gateway["args"][0] == "serve"
    args = flags(gateway["args"])
    assert args | {"host": "0.0.0.0", "port": "50051", "http-port": "8000", "metrics-port": "9464",
                   "ray-address": head} == args
    assert (args["draft-workers"], args["target-replicas"], args["tp"], args["grace"]) == ("2", "1", "1", "30")
    assert (args["target"], args["draft"]) == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")


def test_hpa_scales_each_gateway_deployment_within_bounds():
    objs = render()
    hpa = one(objs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULLNAME}-gateway"}
    assert hpa["spec"]["scaleTargetRef"] == target
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert "replicas" not in one(objs, "Deployment", f"{FULLNAME}-gateway")["spec"], "the HPA owns replicas"

    arms = render("canary-grpcroute-values.yaml")
    bounds = {h["spec"]["scaleTargetRef"]["name"]: (h["spec"]["minReplicas"], h["spec"]["maxReplicas"])
              for h in find(arms, "HorizontalPodAutoscaler")}
    assert bounds == {f"{FULLNAME}-gateway-stable": (2, 6), f"{FULLNAME}-gateway-candidate": (1, 2)}
    assert set(bounds) <= {d["metadata"]["name"] for d in find(arms, "Deployment")}

    fixed = render("external-redis-servicemonitor-values.yaml")
    assert not find(fixed, "HorizontalPodAutoscaler")
    assert one(fixed, "Deployment", f"{FULLNAME}-gateway")["spec"]["replicas"] == 3


@pytest.mark.parametrize("values, sets", [(None, ()), (None, (EMBEDDED,)), ("canary-grpcroute-values.yaml", ())])
def test_hpa_scales_on_requests_in_flight_not_cpu(values, sets):
    for hpa in find(render(values, *sets), "HorizontalPodAutoscaler"):
        assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
            "metric": {"name": "tandem_gateway_active_requests"},
            "target": {"type": "AverageValue", "averageValue": "12"}}}]
    # The metric is one the gateway exports (OpenTelemetry's Prometheus exporter turns dots into underscores).
    metrics_py = (ROOT / "services" / "tandem" / "telemetry" / "metrics.py").read_text()
    assert '"tandem.gateway.active_requests"' in metrics_py and '"tandem.gateway.queue_depth"' in metrics_py


def test_hpa_can_scale_on_queue_depth_and_add_cpu():
    metrics = one(render("pools-autoscaling-values.yaml"), "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metrics[0] == {"type": "Pods", "pods": {"metric": {"name": "tandem_gateway_queue_depth"},
                                                   "target": {"type": "AverageValue", "averageValue": "4"}}}
    assert metrics[1] == {"type": "Resource", "resource": {"name": "cpu", "target": {
        "type": "Utilization", "averageUtilization": 80}}}


def test_pdbs_and_services_select_exactly_their_gateway_pods(ci_values):
    objs = render(ci_values)
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in find(objs, "Deployment")}
    for deployment in find(objs, "Deployment"):
        assert selects(deployment["spec"]["selector"]["matchLabels"], pods[deployment["metadata"]["name"]])
    pdbs = find(objs, "PodDisruptionBudget")
    assert {p["apiVersion"] for p in pdbs} == {"policy/v1"}
    for pdb in pdbs:
        assert [name for name, labels in pods.items() if selects(pdb["spec"]["selector"]["matchLabels"], labels)] == [
            pdb["metadata"]["name"]]
    assert one(objs, "Service", f"{FULLNAME}-gateway")["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"
    for job in find(objs, "Job"):  # the pools Job's pod is no gateway
        assert not selects(one(objs, "Service", f"{FULLNAME}-gateway")["spec"]["selector"],
                           job["spec"]["template"]["metadata"]["labels"])
    for service in find(objs, "Service"):
        name = service["metadata"]["name"]
        if name.startswith(f"{FULLNAME}-gateway"):
            selected = [d for d, labels in pods.items() if selects(service["spec"]["selector"], labels)]
            assert selected and (name == f"{FULLNAME}-gateway" or selected == [name])
            assert service["spec"]["ports"][0] | {"name": "grpc", "port": 50051, "targetPort": "grpc"} == \
                service["spec"]["ports"][0]
            assert [p["name"] for p in service["spec"]["ports"]] == ["grpc", "http"]


def test_pdb_min_available_replaces_max_unavailable():
    spec = one(render("external-redis-servicemonitor-values.yaml"), "PodDisruptionBudget")["spec"]
    assert spec["minAvailable"] == 2 and "maxUnavailable" not in spec
    assert one(render(), "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
