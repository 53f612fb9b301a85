"""The Helm chart helm/tandem: helm lint and helm template with every ci/ values file, Kubernetes schema validation of
what they render, and assertions on how the rendered objects fit together.

Needs helm: $TANDEM_HELM, else .venv/bin/helm (scripts/install_helm.sh puts it there), else helm on PATH.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kv

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "tandem"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RELEASE = "demo"
FULLNAME = "demo-tandem"
# kubernetes-validate has schemas for core kinds only. These CRD kinds are checked by the assertions below (the
# RayCluster's pod templates are validated as Pods); any other kind must validate.
CRD_KINDS = {("ray.io/v1", "RayCluster"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
             ("gateway.networking.k8s.io/v1", "GRPCRoute")}
K8S_VERSIONS = ("1.27.0", kv.latest_version())  # the chart's kubeVersion floor, and the newest schemas known


@functools.cache
def helm_binary() -> str:
    chosen = os.environ.get("TANDEM_HELM")
    if chosen and not os.access(chosen, os.X_OK):
        pytest.fail(f"TANDEM_HELM={chosen} is not an executable helm: run scripts/install_helm.sh or fix it")
    for candidate in (chosen, str(ROOT / ".venv" / "bin" / "helm"), shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("helm not found: run scripts/install_helm.sh (CI does), or set TANDEM_HELM to a helm v3 binary")


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120)


def values_args(values: str | None, sets: tuple[str, ...]) -> list[str]:
    args = ["-f", str(CHART / "ci" / values)] if values else []
    for item in sets:
        args += ["--set", item]
    return args


@functools.cache
def render(values: str | None = None, *sets: str) -> tuple[dict, ...]:
    result = helm("template", RELEASE, str(CHART), *values_args(values, sets))
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def find(objs, kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs, kind: str, name: str | None = None) -> dict:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def flags(args: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def ray_groups(objs) -> dict[str, dict]:
    cluster = one(objs, "RayCluster")["spec"]
    return {"head": cluster["headGroupSpec"]} | {g["groupName"]: g for g in cluster["workerGroupSpecs"]}


def ray_resources(group: dict) -> dict:
    """rayStartParams.resources is a JSON object wrapped in double quotes for KubeRay's `ray start` shell line."""
    quoted = group["rayStartParams"]["resources"]
    assert quoted.startswith('"') and quoted.endswith('"'), quoted
    return json.loads(json.loads(quoted))


def values_ids(path: Path) -> str:
    return path.stem


@pytest.fixture(params=CI_VALUES, ids=values_ids)
def ci_values(request) -> str:
    return request.param.name


def test_every_ci_values_file_lints(ci_values):
    result = helm("lint", "--strict", str(CHART), "-f", str(CHART / "ci" / ci_values))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_rendered_objects_validate_against_kubernetes_schemas(ci_values):
    objs = render(ci_values)
    for obj in objs:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            kv.validate(obj, version, strict=True)
    for name, group in ray_groups(objs).items():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **group["template"]["metadata"]},
               "spec": group["template"]["spec"]}
        for version in K8S_VERSIONS:
            kv.validate(pod, version, strict=True)


def test_gateway_probes_use_grpc_health(ci_values):
    for deployment in find(render(ci_values), "Deployment"):
        if not deployment["metadata"]["name"].startswith(f"{FULLNAME}-gateway"):
            continue
        pod = deployment["spec"]["template"]["spec"]
        gateway = container(pod, "gateway")
        ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
        assert ports == {"grpc": 50051, "metrics": 9464}
        assert gateway["livenessProbe"]["grpc"] == {"port": 50051, "service": ""}
        assert gateway["readinessProbe"]["grpc"] == {"port": 50051, "service": "tandem.v1.Generation"}
        startup = gateway["startupProbe"]
        assert startup["grpc"] == {"port": 50051, "service": "tandem.v1.Generation"}
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60, "startup budget below model loading"
        grace = float(flags(gateway["args"])["grace"])
        pre_stop = int(gateway["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] > pre_stop + grace


def test_gateway_runs_tandem_serve_against_the_ray_head():
    objs = render()
    pod = one(objs, "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]
    gateway = container(pod, "gateway")
    assert gateway["args"][0] == "serve"
    args = flags(gateway["args"])
    head = f"{FULLNAME}-ray-head-svc:6379"  # KubeRay names the head Service <RayCluster>-head-svc
    assert one(objs, "RayCluster")["metadata"]["name"] == f"{FULLNAME}-ray"
    assert args | {"host": "0.0.0.0", "port": "50051", "metrics-port": "9464", "ray-address": head} == args
    assert (args["draft-workers"], args["target-replicas"], args["tp"], args["grace"]) == ("2", "1", "1", "30")
    assert (args["target"], args["draft"]) == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    # The gateway joins Ray as a node that takes no actors, then execs tandem under tini.
    assert gateway["command"][:2] == ["tini", "--"]
    assert "--num-cpus=0 --num-gpus=0" in gateway["command"][4] and 'exec tandem "$@"' in gateway["command"][4]
    env = {e["name"]: e.get("value") for e in gateway["env"]}
    assert env["RAY_ADDRESS"] == head
    assert "ray health-check" in pod["initContainers"][0]["command"][2]


@pytest.mark.parametrize("values, draft_pods, target_pods, gpus_per_target", [
    (None, (4, 12), (2, 6), 1),                              # HPA 2..6 gateways x 2 draft workers, 1 target
    ("external-redis-servicemonitor-values.yaml", (6, 6), (3, 3), 1),   # 3 fixed gateways
    ("canary-grpcroute-values.yaml", (6, 16), (3, 8), 1),    # arms: HPA 2..6 + 1..2
    ("tp4-multi-replica-values.yaml", (6, 6), (6, 6), 4),    # 3 gateways x 4 drafts / 2 per pod; x 2 TP-4 targets
])
def test_worker_groups_carry_the_gateways_actors(values, draft_pods, target_pods, gpus_per_target):
    objs = render(values)
    groups = ray_groups(objs)
    gateways = [d for d in find(objs, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"]
                == "gateway"]
    args = flags(container(gateways[0]["spec"]["template"]["spec"], "gateway")["args"])
    tp, workers = int(args["tp"]), int(args["draft-workers"])
    gpu_name = next(k for k in groups["target-pool"]["template"]["spec"]["containers"][0]["resources"]["limits"]
                    if k.endswith("/gpu"))

    assert groups["head"]["rayStartParams"]["num-cpus"] == "0" and groups["head"]["rayStartParams"]["num-gpus"] == "0"
    target = groups["target-pool"]
    assert ray_resources(target) == {"target_pool": tp}
    assert json.loads(args["target-resources"]) == {"target_pool": 1}
    assert tp == gpus_per_target and float(args["target-gpus"]) == 1
    assert target["rayStartParams"]["num-gpus"] == str(tp) and target["rayStartParams"]["num-cpus"] == str(tp)
    assert target["template"]["spec"]["containers"][0]["resources"]["limits"][gpu_name] == tp

    draft = groups["draft-pool"]
    per_pod = ray_resources(draft)["draft_pool"]
    assert json.loads(args["draft-resources"]) == {"draft_pool": 1}
    pod_gpus = draft["template"]["spec"]["containers"][0]["resources"]["limits"][gpu_name]
    assert draft["rayStartParams"]["num-gpus"] == str(pod_gpus)
    assert math.isclose(float(args["draft-gpus"]) * per_pod, pod_gpus)
    assert workers * min(g["spec"].get("replicas", 1) for g in gateways) <= draft_pods[0] * per_pod

    assert (draft["minReplicas"], draft["maxReplicas"]) == draft_pods and draft["replicas"] == draft_pods[0]
    assert (target["minReplicas"], target["maxReplicas"]) == target_pods and target["replicas"] == target_pods[0]
    autoscaled = draft_pods[0] != draft_pods[1]
    assert one(objs, "RayCluster")["spec"].get("enableInTreeAutoscaling", False) == autoscaled


def pod_gpus(group: dict) -> int:
    """GPUs a Ray group's pods request, under any device plugin's resource name."""
    limits = group["template"]["spec"]["containers"][0]["resources"].get("limits", {})
    return sum(int(count) for name, count in limits.items() if name.endswith("/gpu"))


@pytest.mark.parametrize("values, sets, device", [
    (None, (), "cuda"),                                         # both pools: one nvidia.com/gpu per pod
    ("tp4-multi-replica-values.yaml", (), "cuda"),
    ("external-redis-servicemonitor-values.yaml", (), "cuda"),  # amd.com/gpu: ROCm torch calls its GPUs cuda too
    ("cpu-only-values.yaml", (), "cpu"),
    (None, ("ray.targetPool.gpusPerRank=0", "ray.draftPool.gpusPerPod=0"), "cpu"),
    (None, ("ray.draftPool.gpusPerPod=0",), "auto"),            # CPU drafts beside GPU targets: one flag for both
    (None, ("ray.targetPool.gpusPerRank=0",), "auto"),
    (None, ("ray.draftPool.gpusPerPod=0", "serving.draftWorkers=0"), "cuda"),  # no draft workers: targets alone
])
def test_workers_load_on_cuda_exactly_when_their_pods_request_gpus(values, sets, device):
    objs = render(values, *sets)
    groups = ray_groups(objs)
    gateways = [d for d in find(objs, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"]
                == "gateway"]
    assert gateways
    for gateway in gateways:
        args = container(gateway["spec"]["template"]["spec"], "gateway")["args"]
        assert [a for a in args if a.startswith("--device")] == [f"--device={device}"]
        # The gateway's --device reaches every actor it starts: the pools that get actors decide it.
        used = [groups["target-pool"]] + ([groups["draft-pool"]] if int(flags(args)["draft-workers"]) else [])
        with_gpus = [pod_gpus(group) > 0 for group in used]
        assert (device == "cuda") == all(with_gpus) and (device == "cpu") == (not any(with_gpus))
    assert pod_gpus(groups["head"]) == 0


def test_extra_args_can_override_the_device():
    args = container(one(render(None, "serving.extraArgs={--device=auto}"), "Deployment")["spec"]["template"]["spec"],
                     "gateway")["args"]
    assert args.index("--device=cuda") < args.index("--device=auto")  # argparse keeps the last
    assert flags(args)["device"] == "auto"


def test_worker_pools_are_placed_by_their_own_node_rules():
    groups = ray_groups(render("tp4-multi-replica-values.yaml"))
    target, draft = groups["target-pool"]["template"]["spec"], groups["draft-pool"]["template"]["spec"]
    assert target["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert draft["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert "podAntiAffinity" in target["affinity"] and "affinity" not in draft
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in target["tolerations"]
    assert target["volumes"][0]["persistentVolumeClaim"]["claimName"] == "tandem-models"
    amd = ray_groups(render("external-redis-servicemonitor-values.yaml"))["target-pool"]["template"]["spec"]
    assert amd["containers"][0]["resources"]["limits"]["amd.com/gpu"] == 1
    assert "nvidia.com/gpu" not in amd["containers"][0]["resources"]["limits"]


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
    for service in find(objs, "Service"):
        name = service["metadata"]["name"]
        if name.startswith(f"{FULLNAME}-gateway"):
            selected = [d for d, labels in pods.items() if selects(service["spec"]["selector"], labels)]
            assert selected and (name == f"{FULLNAME}-gateway" or selected == [name])
            assert service["spec"]["ports"][0] | {"name": "grpc", "port": 50051, "targetPort": "grpc"} == \
                service["spec"]["ports"][0]


def test_pdb_min_available_replaces_max_unavailable():
    spec = one(render("external-redis-servicemonitor-values.yaml"), "PodDisruptionBudget")["spec"]
    assert spec["minAvailable"] == 2 and "maxUnavailable" not in spec
    assert one(render(), "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


def test_canary_arms_reach_every_gateway():
    objs = render("canary-grpcroute-values.yaml")
    declared = yaml.safe_load((CHART / "ci" / "canary-grpcroute-values.yaml").read_text())["canary"]["arms"]
    assert sum(arm["weight"] for arm in declared) == 100
    gateways = [d for d in find(objs, "Deployment") if "gateway" in d["metadata"]["name"]]
    assert len(gateways) == 2
    for deployment in gateways:
        env = {e["name"]: e.get("value") for e in container(deployment["spec"]["template"]["spec"], "gateway")["env"]}
        assert json.loads(env["TANDEM_CANARY_ARMS"]) == declared
        assert env["TANDEM_GATEWAY_ARM"] == deployment["metadata"]["labels"]["tandem.io/arm"]
    candidate = container(one(objs, "Deployment", f"{FULLNAME}-gateway-candidate")["spec"]["template"]["spec"],
                          "gateway")
    assert flags(candidate["args"])["draft"] == "qwen2.5-coder-1.5b-instruct"
    assert candidate["args"][-2:] == ["--k-max", "6"]
    default_env = container(one(render(), "Deployment")["spec"]["template"]["spec"], "gateway")["env"]
    assert "TANDEM_CANARY_ARMS" not in {e["name"] for e in default_env}


def test_grpcroute_splits_by_weight_between_arm_services():
    objs = render("canary-grpcroute-values.yaml")
    route = one(objs, "GRPCRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"name": "public-gateway", "namespace": "gateway-system",
                                            "sectionName": "grpc"}]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    backends = route["spec"]["rules"][0]["backendRefs"]
    assert {b["name"]: b["weight"] for b in backends} == {f"{FULLNAME}-gateway-stable": 80,
                                                          f"{FULLNAME}-gateway-candidate": 20}
    services = {s["metadata"]["name"]: s for s in find(objs, "Service")}
    for backend in backends:
        assert backend["port"] in {p["port"] for p in services[backend["name"]]["spec"]["ports"]}

    single = render(None, "gatewayApi.grpcRoute.enabled=true", "gatewayApi.grpcRoute.parentRefs[0].name=gw")
    assert one(single, "GRPCRoute")["spec"]["rules"][0]["backendRefs"] == [
        {"name": f"{FULLNAME}-gateway", "port": 50051, "weight": 1}]
    assert not find(render(), "GRPCRoute")


def redis_env(objs) -> dict:
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    return next(e for e in container(pod, "gateway")["env"] if e["name"] == "REDIS_URL")


def test_redis_url_wiring():
    bundled = render()
    service, statefulset = one(bundled, "Service", f"{FULLNAME}-redis"), one(bundled, "StatefulSet")
    assert redis_env(bundled) == {"name": "REDIS_URL", "value": f"redis://{FULLNAME}-redis:6379/0"}
    assert service["spec"]["clusterIP"] == "None" and statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert selects(service["spec"]["selector"], statefulset["spec"]["template"]["metadata"]["labels"])
    assert container(statefulset["spec"]["template"]["spec"], "redis")["image"] == "redis:7"
    assert statefulset["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "1Gi"

    secret = render("external-redis-servicemonitor-values.yaml")
    assert redis_env(secret)["valueFrom"] == {"secretKeyRef": {"name": "tandem-redis", "key": "url"}}
    assert not find(secret, "StatefulSet")
    external = render("canary-grpcroute-values.yaml")
    for deployment in find(external, "Deployment"):
        env = container(deployment["spec"]["template"]["spec"], "gateway")["env"]
        assert {"name": "REDIS_URL", "value": "redis://redis-master.data.svc:6379/0"} in env


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


@pytest.mark.parametrize("sets, message", [
    (("gateway.replicas=-1",), "gateway.replicas"),
    (("serving.tp=0",), "serving.tp"),
    (("ray.draftPool.workersPerPod=0",), "workersPerPod"),
    (("gateway.grpcPort=70000",), "gateway.grpcPort"),
    (("redis.bundled.enabled=false", "redis.url=http://cache:6379"), "redis.url"),
    (("gateway.replicaz=2",), "replicaz"),
    (("redis.url=redis://cache:6379/0",), "not both"),
    (("redis.bundled.enabled=false",), "set redis.url"),
    (("canary.enabled=true", "canary.arms[0].name=a", "canary.arms[0].draftModel=d", "canary.arms[0].weight=50"),
     "weights must sum to 100"),
    (("gatewayArms[0].name=a", "gatewayArms[0].weight=60", "gatewayArms[1].name=a", "gatewayArms[1].weight=40"),
     "unique"),
    (("gateway.autoscaling.minReplicas=5", "gateway.autoscaling.maxReplicas=3"), "exceeds maxReplicas"),
    (("gatewayApi.grpcRoute.enabled=true",), "parentRefs"),
])
def test_bad_values_fail_the_render(sets, message):
    result = helm("template", RELEASE, str(CHART), *values_args(None, sets))
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_schema_errors_fail_helm_lint():
    result = helm("lint", str(CHART), "--set", "gateway.replicas=-1")
    assert result.returncode != 0
    assert "gateway.replicas" in result.stdout + result.stderr


def test_plain_manifests_match_a_fresh_render():
    env = os.environ | {"TANDEM_HELM": helm_binary()}
    fresh = subprocess.run(["bash", str(ROOT / "scripts" / "render_helm.sh"), "--stdout"], capture_output=True,
                           text=True, env=env, timeout=120, check=True).stdout
    committed = (ROOT / "deploy" / "manifests" / "tandem.yaml").read_text()
    assert committed == fresh, "deploy/manifests/tandem.yaml is stale: run scripts/render_helm.sh"
    objs = [doc for doc in yaml.safe_load_all(committed) if doc]
    assert {o["kind"] for o in objs} >= {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                                         "RayCluster", "StatefulSet"}
    assert all("namespace" not in o["metadata"] for o in objs), "plain manifests take the namespace from kubectl -n"


def test_image_build_follows_the_readme_install():
    readme = (ROOT / "README.md").read_text()
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    torch = re.search(r"pip install torch==([\w.]+)", readme).group(1)
    assert f"ARG TORCH_VERSION={torch}\n" in dockerfile
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    assert re.search(r"pip install --no-cache-dir \. ", dockerfile)
    assert 'ENTRYPOINT ["tandem"]' in dockerfile
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert (chart["apiVersion"], chart["name"]) == ("v2", "tandem")
    assert chart["appVersion"] == project["version"], "the chart's default image tag is the package version"


def test_image_pins_a_cuda_build_and_names_the_driver_it_needs():
    from tandem.core.device import MIN_DRIVER

    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    docs = (ROOT / "deploy" / "README.md").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(.*)$", dockerfile, re.M))
    assert args["TORCH_VARIANT"] == "cu130"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/${TORCH_VARIANT}"
    assert 'pip install --no-cache-dir "torch==${TORCH_VERSION}+${TORCH_VARIANT}" --index-url "${TORCH_INDEX_URL}"' \
        in dockerfile
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in dockerfile
    # The driver minimums the docs state are the ones a failing --device cuda reports (core/device.py).
    for text in (dockerfile, docs):
        assert f"CUDA 13.0, NVIDIA driver >= {MIN_DRIVER['13']}" in text or f"| 13.0 | >= {MIN_DRIVER['13']}" in text
        assert f">= {MIN_DRIVER['12']}" in text
