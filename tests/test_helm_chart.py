"""The Helm chart helm/tandem: helm lint and helm template with every ci/ values file, Kubernetes schema validation of
what they render, assertions on how the rendered objects fit together (both topologies: shared pools with
`tandem gateway --pools`, and embedded `tandem serve` gateways), and the pools Job's reconcile script run against a
stub `tandem`.

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
import sys
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
EMBEDDED = "topology=embedded"
# kubernetes-validate has schemas for core kinds only. These CRD kinds are checked by the assertions below (the
# RayCluster's pod templates are validated as Pods); any other kind must validate.
CRD_KINDS = {("ray.io/v1", "RayCluster"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
             ("monitoring.coreos.com/v1", "PodMonitor"), ("gateway.networking.k8s.io/v1", "GRPCRoute"),
             ("gateway.networking.k8s.io/v1", "HTTPRoute")}
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


def env_of(cont: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in cont.get("env", [])}


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


def gateways(objs) -> list[dict]:
    return [d for d in find(objs, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"]


def gateway_container(deployment: dict) -> dict:
    return container(deployment["spec"]["template"]["spec"], "gateway")


def pools_job(objs) -> dict:
    return one(objs, "Job", f"{FULLNAME}-pools-r1")


def pools_container(objs) -> dict:
    return container(pools_job(objs)["spec"]["template"]["spec"], "pools")


def image_resource(objs) -> str:
    """The Ray resource that pins workers to the image (tandem.imageResource), read off the target pool."""
    names = [k for k in ray_resources(ray_groups(objs)["target-pool"]) if k.startswith("tandem_image_")]
    assert len(names) == 1, names
    return names[0]


def worker_args(objs) -> list[list[str]]:
    """The argument lists that start workers: the pools Job's `tandem pools start` flags, or every embedded gateway's
    `tandem serve` arguments."""
    if find(objs, "Job"):
        return [pools_container(objs)["args"]]
    return [gateway_container(d)["args"] for d in gateways(objs)]


def values_ids(path: Path) -> str:
    return path.stem


@pytest.fixture(params=CI_VALUES, ids=values_ids)
def ci_values(request) -> str:
    return request.param.name


def test_every_ci_values_file_lints(ci_values):
    result = helm("lint", "--strict", str(CHART), "-f", str(CHART / "ci" / ci_values))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_ci_values_cover_both_topologies():
    topologies = {yaml.safe_load((CHART / "ci" / p.name).read_text()).get("topology", "pools") for p in CI_VALUES}
    assert topologies == {"pools", "embedded"}
    assert yaml.safe_load((CHART / "values.yaml").read_text())["topology"] == "pools"


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
    for deployment in gateways(render(ci_values)):
        pod = deployment["spec"]["template"]["spec"]
        gateway = container(pod, "gateway")
        ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
        assert ports == {"grpc": 50051, "http": 8000, "metrics": 9464}
        # The HTTP API is served beside gRPC; gRPC health stays the probe (it reports loading and draining).
        assert gateway["livenessProbe"]["grpc"] == {"port": 50051, "service": ""}
        assert gateway["readinessProbe"]["grpc"] == {"port": 50051, "service": "tandem.v1.GenerationService"}
        startup = gateway["startupProbe"]
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
                    "ray-address": head, "grace": "30"}
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


def test_pools_job_submits_the_reconcile_script_to_the_ray_head():
    objs = render()
    job = pools_job(objs)
    assert job["metadata"]["labels"]["app.kubernetes.io/component"] == "pools"
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] >= 3
    pools = container(pod, "pools")
    env = env_of(pools)
    assert env["RAY_DASHBOARD_ADDRESS"] == f"http://{FULLNAME}-ray-head-svc:8265"
    head_ports = {p["name"]: p["containerPort"] for p in ray_groups(objs)["head"]["template"]["spec"]["containers"][0]
                  ["ports"]}
    assert head_ports["dashboard"] == 8265
    # Submitted as a Ray job: its driver, and the pools' manager actor it owns, live on the head, not on this pod.
    script = pools.get("command")[2]
    assert 'ray job submit --address "$RAY_DASHBOARD_ADDRESS" --submission-id "$POD_NAME"' in script
    assert "/bin/sh -c \"$(cat /etc/tandem/reconcile-pools.sh)\" reconcile-pools \"$@\"" in script
    assert next(e for e in pools["env"] if e["name"] == "POD_NAME")["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.name"}}
    for name in ("TANDEM_POOLS", "TANDEM_IMAGE", "TANDEM_RAY_SPEC_WANT"):
        assert f'{name}="${name}"' in script
    [mount] = pools["volumeMounts"]
    assert mount["mountPath"] == "/etc/tandem"
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config = one(objs, "ConfigMap", volume["configMap"]["name"])
    assert config["data"]["reconcile-pools.sh"].strip() == (CHART / "files" / "reconcile-pools.sh").read_text().strip()

    args = flags(pools["args"])
    assert not [a for a in pools["args"] if a.startswith("--name")]
    assert args["tp"] == "1"
    assert (args["target"], args["draft"]) == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    assert (args["draft-workers"], args["target-replicas"], args["device"]) == ("2", "1", "cuda")
    assert (args["draft-gpus"], args["target-gpus"]) == ("1", "1")

    scaled = render("pools-autoscaling-values.yaml")
    scaled_args = pools_container(scaled)["args"]
    assert (flags(scaled_args)["draft-workers"], flags(scaled_args)["target-replicas"]) == ("4", "2")
    assert scaled_args[-4:] == ["--kv-tokens", "65536", "--batch-window-ms", "3"]
    assert math.isclose(float(flags(scaled_args)["draft-gpus"]), 0.5)  # two draft workers share a GPU pod


def test_gateways_job_and_ray_pods_carry_one_image(ci_values):
    objs = render(ci_values)
    images = set()
    for deployment in gateways(objs):
        gateway = gateway_container(deployment)
        images |= {gateway["image"], env_of(gateway)["TANDEM_IMAGE"]}
    for group in ray_groups(objs).values():
        ray = group["template"]["spec"]["containers"][0]
        images |= {ray["image"], env_of(ray)["TANDEM_IMAGE"]}
    if find(objs, "Job"):
        pools = pools_container(objs)
        images |= {pools["image"], env_of(pools)["TANDEM_IMAGE"]}
    assert len(images) == 1, images
    assert image_resource(objs) == image_resource(render(ci_values))  # deterministic
    tagged = render(ci_values, "image.tag=9.9.9")
    assert image_resource(tagged) != image_resource(objs), "a new image must pin workers to new pods"


def test_workers_ask_for_their_pool_and_image_resources(ci_values):
    objs = render(ci_values)
    pin = image_resource(objs)
    groups = ray_groups(objs)
    assert "resources" not in groups["head"]["rayStartParams"], "the head takes no actors"
    for pool, group in (("draft", groups["draft-pool"]), ("target", groups["target-pool"])):
        advertised = ray_resources(group)
        assert advertised[pin] == 1000
        for args in worker_args(objs):
            asked = json.loads(flags(args)[f"{pool}-resources"])
            assert asked == {f"{pool}_pool": 1, pin: 1}
            assert set(asked) == set(advertised), f"{pool} actors must fit {pool}-pool pods and only those"


def pool_bounds(group: dict) -> tuple[int, int, int]:
    return group["replicas"], group["minReplicas"], group["maxReplicas"]


@pytest.mark.parametrize("values, sets, draft, target, autoscaled", [
    (None, (), (2, 2, 8), (1, 1, 4), True),                             # 2 drafts (max 8), 1 target (max 4)
    ("pools-autoscaling-values.yaml", (), (2, 2, 6), (2, 2, 6), True),  # 4..12 drafts, 2 per pod; 2..6 targets
    ("external-redis-servicemonitor-values.yaml", (), (2, 2, 2), (1, 1, 1), False),  # Ray autoscaler off: declared
    ("cpu-only-values.yaml", (), (2, 2, 8), (1, 1, 4), True),
    (None, ("pools.draftWorkers=0",), (0, 0, 0), (1, 1, 4), True),     # plain decoding: no draft pods
    (None, ("ray.draftPool.replicas=3",), (3, 3, 3), (1, 1, 4), True),  # pinned
])
def test_pools_worker_groups_scale_separately(values, sets, draft, target, autoscaled):
    objs = render(values, *sets)
    groups = ray_groups(objs)
    cluster = one(objs, "RayCluster")["spec"]
    assert pool_bounds(groups["draft-pool"]) == draft
    assert pool_bounds(groups["target-pool"]) == target
    assert cluster.get("enableInTreeAutoscaling", False) == autoscaled
    if autoscaled:
        assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    # The declared pools fit the minimum: pools start never waits for the autoscaler.
    args = flags(pools_container(objs)["args"])
    per_pod = ray_resources(groups["draft-pool"])["draft_pool"]
    assert int(args["draft-workers"]) <= draft[1] * per_pod
    assert int(args["target-replicas"]) <= target[1] * ray_resources(groups["target-pool"])["target_pool"]
    # pools.tp defaults to 1: one GPU and one target rank per target-pool pod.
    assert groups["target-pool"]["rayStartParams"]["num-cpus"] == "1"


@pytest.mark.parametrize("gpus_per_rank", [1, 0])  # 0: CPU ranks
def test_pools_tp_starts_tensor_parallel_pools_on_target_pods_sized_for_a_replica(gpus_per_rank):
    objs = render(None, "pools.tp=2", f"ray.targetPool.gpusPerRank={gpus_per_rank}")
    args = flags(pools_container(objs)["args"])
    assert (args["tp"], args["target-gpus"]) == ("2", str(gpus_per_rank))
    target = ray_groups(objs)["target-pool"]
    limits = target["template"]["spec"]["containers"][0]["resources"]["limits"]
    gpus = sum(v for k, v in limits.items() if k.endswith("/gpu"))
    assert ray_resources(target)["target_pool"] == 2  # one replica of 2 ranks per pod
    assert target["rayStartParams"]["num-cpus"] == "2"
    assert target["rayStartParams"]["num-gpus"] == str(2 * gpus_per_rank)
    assert gpus == 2 * gpus_per_rank  # tp x gpusPerRank
    assert not [a for d in gateways(objs) for a in gateway_container(d)["args"] if a.startswith("--tp")]


@pytest.mark.parametrize("values, sets, draft_pods, target_pods, gpus_per_target", [
    (None, (EMBEDDED,), (4, 12), (2, 6), 1),                            # HPA 2..6 gateways x 2 draft workers, 1 target
    ("external-redis-servicemonitor-values.yaml", (EMBEDDED,), (6, 6), (3, 3), 1),   # 3 fixed gateways
    ("canary-grpcroute-values.yaml", (), (6, 16), (3, 8), 1),           # arms: HPA 2..6 + 1..2
    ("tp4-multi-replica-values.yaml", (), (6, 6), (6, 6), 4),           # 3 gateways x 4 drafts / 2 per pod; x 2 TP-4
])
def test_embedded_worker_groups_carry_the_gateways_actors(values, sets, draft_pods, target_pods, gpus_per_target):
    objs = render(values, *sets)
    groups = ray_groups(objs)
    deployments = gateways(objs)
    args = flags(gateway_container(deployments[0])["args"])
    tp, workers = int(args["tp"]), int(args["draft-workers"])
    gpu_name = next(k for k in groups["target-pool"]["template"]["spec"]["containers"][0]["resources"]["limits"]
                    if k.endswith("/gpu"))

    assert groups["head"]["rayStartParams"]["num-cpus"] == "0" and groups["head"]["rayStartParams"]["num-gpus"] == "0"
    target = groups["target-pool"]
    assert ray_resources(target)["target_pool"] == tp
    assert tp == gpus_per_target and float(args["target-gpus"]) == 1
    assert target["rayStartParams"]["num-gpus"] == str(tp) and target["rayStartParams"]["num-cpus"] == str(tp)
    assert target["template"]["spec"]["containers"][0]["resources"]["limits"][gpu_name] == tp

    draft = groups["draft-pool"]
    per_pod = ray_resources(draft)["draft_pool"]
    pod_gpus = draft["template"]["spec"]["containers"][0]["resources"]["limits"][gpu_name]
    assert draft["rayStartParams"]["num-gpus"] == str(pod_gpus)
    assert math.isclose(float(args["draft-gpus"]) * per_pod, pod_gpus)
    assert workers * min(g["spec"].get("replicas", 1) for g in deployments) <= draft_pods[0] * per_pod

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
    (None, (EMBEDDED,), "cuda"),
    ("tp4-multi-replica-values.yaml", (), "cuda"),
    ("external-redis-servicemonitor-values.yaml", (), "cuda"),  # amd.com/gpu: ROCm torch calls its GPUs cuda too
    ("cpu-only-values.yaml", (), "cpu"),
    ("cpu-only-values.yaml", (EMBEDDED,), "cpu"),
    (None, ("ray.targetPool.gpusPerRank=0", "ray.draftPool.gpusPerPod=0"), "cpu"),
    (None, ("ray.draftPool.gpusPerPod=0",), "auto"),            # CPU drafts beside GPU targets: one flag for both
    (None, ("ray.targetPool.gpusPerRank=0",), "auto"),
    (None, ("ray.draftPool.gpusPerPod=0", "pools.draftWorkers=0"), "cuda"),  # no draft workers: targets alone
    (None, (EMBEDDED, "ray.draftPool.gpusPerPod=0", "serving.draftWorkers=0"), "cuda"),
])
def test_workers_load_on_cuda_exactly_when_their_pods_request_gpus(values, sets, device):
    objs = render(values, *sets)
    groups = ray_groups(objs)
    starters = worker_args(objs)
    assert starters
    for args in starters:
        assert [a for a in args if a.startswith("--device")] == [f"--device={device}"]
        # --device reaches every actor: the pools that get actors decide it.
        used = [groups["target-pool"]] + ([groups["draft-pool"]] if int(flags(args)["draft-workers"]) else [])
        with_gpus = [pod_gpus(group) > 0 for group in used]
        assert (device == "cuda") == all(with_gpus) and (device == "cpu") == (not any(with_gpus))
    assert pod_gpus(groups["head"]) == 0


@pytest.mark.parametrize("sets", [("pools.extraArgs={--device=auto}",),
                                  (EMBEDDED, "serving.extraArgs={--device=auto}")])
def test_extra_args_can_override_the_device(sets):
    [args] = worker_args(render(None, *sets))
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


def test_canary_arms_reach_every_gateway():
    objs = render("canary-grpcroute-values.yaml")
    declared = yaml.safe_load((CHART / "ci" / "canary-grpcroute-values.yaml").read_text())["canary"]["arms"]
    assert sum(arm["weight"] for arm in declared) == 100
    deployments = gateways(objs)
    assert len(deployments) == 2
    for deployment in deployments:
        env = env_of(gateway_container(deployment))
        assert json.loads(env["TANDEM_CANARY_ARMS"]) == declared
        assert env["TANDEM_GATEWAY_ARM"] == deployment["metadata"]["labels"]["tandem.io/arm"]
    candidate = gateway_container(one(objs, "Deployment", f"{FULLNAME}-gateway-candidate"))
    assert flags(candidate["args"])["draft"] == "qwen2.5-coder-1.5b-instruct"
    assert candidate["args"][-2:] == ["--k-max", "6"]
    default_env = gateway_container(one(render(), "Deployment"))["env"]
    assert "TANDEM_CANARY_ARMS" not in {e["name"] for e in default_env}


def test_pools_gateway_arms_share_the_pools():
    objs = render(None, "gatewayArms[0].name=stable", "gatewayArms[0].weight=80", "gatewayArms[1].name=wide",
                  "gatewayArms[1].weight=20", "gatewayArms[1].extraArgs={--lanes=2}")
    arms = {d["metadata"]["name"]: gateway_container(d)["args"] for d in gateways(objs)}
    assert set(arms) == {f"{FULLNAME}-gateway-stable", f"{FULLNAME}-gateway-wide"}
    assert {flags(args)["pools"] for args in arms.values()} == {FULLNAME}
    assert arms[f"{FULLNAME}-gateway-wide"][-1] == "--lanes=2"
    assert len(find(objs, "Job")) == 1, "one set of pools per release, whatever the arms"


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


def service_ports(service: dict) -> dict[str, dict]:
    return {p["name"]: p for p in service["spec"]["ports"]}


@pytest.mark.parametrize("values, sets, service_port", [
    (None, (), 8000), (None, (EMBEDDED,), 8000), ("canary-grpcroute-values.yaml", (), 80),
    ("tp4-multi-replica-values.yaml", (), 8000),
])
def test_gateways_serve_the_openai_http_api_beside_grpc(values, sets, service_port):
    objs = render(values, *sets)
    deployments = gateways(objs)
    assert deployments
    for deployment in deployments:
        gateway = gateway_container(deployment)
        assert flags(gateway["args"])["http-port"] == "8000"
        assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in gateway["ports"]
    services = [s for s in find(objs, "Service") if s["metadata"]["name"].startswith(f"{FULLNAME}-gateway")]
    assert len(services) == len(deployments) + (1 if len(deployments) > 1 else 0)  # the arms' and the shared one
    for service in services:
        ports = service_ports(service)
        assert ports["http"] == {"name": "http", "port": service_port, "targetPort": "http", "protocol": "TCP",
                                 "appProtocol": "http"}
        assert ports["grpc"]["port"] == 50051 and ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    # A port of another number reaches the flag, the container and (by default) the Service alike.
    moved = render(values, *sets, "gateway.httpPort=8080")
    for deployment in gateways(moved):
        gateway = gateway_container(deployment)
        assert flags(gateway["args"])["http-port"] == "8080"
        assert {p["name"]: p["containerPort"] for p in gateway["ports"]}["http"] == 8080
    assert service_ports(one(moved, "Service", f"{FULLNAME}-gateway"))["http"]["port"] == (
        8080 if service_port == 8000 else service_port)
    # The HPA and PDB do not change with the HTTP API.
    assert find(objs, "HorizontalPodAutoscaler") == find(moved, "HorizontalPodAutoscaler")
    assert find(objs, "PodDisruptionBudget") == find(moved, "PodDisruptionBudget")


@pytest.mark.parametrize("values, sets", [
    (None, ("gateway.httpPort=null",)),
    (None, ("gateway.httpPort=0",)),
    (None, ("gateway.http.enabled=false",)),
    (None, (EMBEDDED, "gateway.http.enabled=false")),
    ("canary-grpcroute-values.yaml", ("gateway.httpPort=null", "gatewayApi.httpRoute.enabled=false")),
])
def test_http_api_off_passes_minus_one_and_exposes_no_http_port(values, sets):
    objs = render(values, *sets)
    for deployment in gateways(objs):
        gateway = gateway_container(deployment)
        assert [a for a in gateway["args"] if a.startswith("--http-port")] == ["--http-port=-1"]
        assert [p["name"] for p in gateway["ports"]] == ["grpc", "metrics"]
    for service in find(objs, "Service"):
        assert "http" not in service_ports(service)
        assert 8000 not in {p["port"] for p in service["spec"]["ports"]}
    assert not find(objs, "HTTPRoute")


def test_httproute_sends_the_http_api_to_each_arm_by_weight():
    objs = render("canary-grpcroute-values.yaml")
    route = one(objs, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
    assert route["spec"]["parentRefs"] == [{"name": "public-gateway", "namespace": "gateway-system",
                                            "sectionName": "https"}]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    [rule] = route["spec"]["rules"]
    assert rule["timeouts"] == {"request": "600s"}
    assert {b["name"]: b["weight"] for b in rule["backendRefs"]} == {f"{FULLNAME}-gateway-stable": 80,
                                                                     f"{FULLNAME}-gateway-candidate": 20}
    # Each backend is the arm Service's http port (80 here), which leads to the gateway container's http port.
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in gateways(objs)}
    for backend in rule["backendRefs"]:
        service = one(objs, "Service", backend["name"])
        port = next(p for p in service["spec"]["ports"] if p["port"] == backend["port"])
        assert (port["name"], port["port"], port["targetPort"]) == ("http", 80, "http")
        [template] = [t for t in pods.values() if selects(service["spec"]["selector"], t["metadata"]["labels"])]
        container_ports = {p["name"]: p["containerPort"] for p in container(template["spec"], "gateway")["ports"]}
        assert container_ports["http"] == int(flags(container(template["spec"], "gateway")["args"])["http-port"])
    # The GRPCRoute beside it keeps the grpc port.
    assert {b["port"] for b in one(objs, "GRPCRoute")["spec"]["rules"][0]["backendRefs"]} == {50051}

    single = render(None, "gatewayApi.httpRoute.enabled=true", "gatewayApi.httpRoute.parentRefs[0].name=gw")
    [rule] = one(single, "HTTPRoute")["spec"]["rules"]
    assert rule == {"backendRefs": [{"name": f"{FULLNAME}-gateway", "port": 8000, "weight": 1}]}
    assert not find(single, "GRPCRoute")
    assert not find(render(), "HTTPRoute")


def redis_env(objs) -> dict:
    return next(e for e in gateway_container(one(objs, "Deployment"))["env"] if e["name"] == "REDIS_URL")


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
    for deployment in gateways(external):
        assert {"name": "REDIS_URL", "value": "redis://redis-master.data.svc:6379/0"} in gateway_container(deployment)[
            "env"]


@pytest.mark.parametrize("values, sets, options", [
    # The bundled Redis keeps the GCS tables too, under KubeRay's default namespace (the RayCluster's UID).
    (None, (), {"redisAddress": f"{FULLNAME}-redis:6379"}),
    (None, (EMBEDDED,), {"redisAddress": f"{FULLNAME}-redis:6379"}),
    ("pools-autoscaling-values.yaml", (), {"redisAddress": f"{FULLNAME}-redis:6379",
                                           "externalStorageNamespace": "tandem-prod"}),
    ("external-redis-servicemonitor-values.yaml", (), {
        "redisAddress": "redis-master.data.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "tandem-redis", "key": "password"}}}}),
    ("canary-grpcroute-values.yaml", (), None),  # external Redis: off unless asked for
    ("canary-grpcroute-values.yaml", ("ray.gcsFaultTolerance.enabled=true",),
     {"redisAddress": "redis-master.data.svc:6379"}),  # the host of a password-less redis.url
    (None, ("ray.gcsFaultTolerance.enabled=false",), None),
])
def test_gcs_fault_tolerance_on_redis(values, sets, options):
    objs = render(values, *sets)
    spec = one(objs, "RayCluster")["spec"]
    assert spec.get("gcsFaultToleranceOptions") == options
    head_env = {e["name"] for e in ray_groups(objs)["head"]["template"]["spec"]["containers"][0]["env"]}
    # KubeRay refuses these beside gcsFaultToleranceOptions (it sets them itself).
    assert not head_env & {"RAY_REDIS_ADDRESS", "REDIS_PASSWORD", "REDIS_USERNAME"}
    assert not {"redis-password", "redis-username"} & set(ray_groups(objs)["head"]["rayStartParams"])
    if options and find(objs, "StatefulSet"):  # the bundled Redis' Service
        host, port = options["redisAddress"].split(":")
        assert one(objs, "Service", host)["spec"]["ports"][0]["port"] == int(port)
    # Gateways are Ray nodes too: their raylets wait out a head restart as long as KubeRay's workers do.
    for deployment in gateways(objs):
        reconnect = env_of(gateway_container(deployment)).get("RAY_gcs_rpc_server_reconnect_timeout_s")
        assert reconnect == ("600" if options else None)


def test_upgrades_recreate_the_ray_cluster_and_the_job_waits_for_it():
    objs = render()
    spec = one(objs, "RayCluster")["spec"]
    assert spec["upgradeStrategy"] == {"type": "Recreate"}
    fingerprint = env_of(ray_groups(objs)["head"]["template"]["spec"]["containers"][0])["TANDEM_RAY_SPEC"]
    assert re.fullmatch(r"[0-9a-f]{16}", fingerprint)
    assert env_of(pools_container(objs))["TANDEM_RAY_SPEC_WANT"] == fingerprint

    def head_fingerprint(*sets: str) -> str:
        return env_of(ray_groups(render(None, *sets))["head"]["template"]["spec"]["containers"][0])["TANDEM_RAY_SPEC"]

    # A change KubeRay recreates the pods for changes the fingerprint; replica counts and tolerations do neither.
    assert head_fingerprint("image.tag=9.9.9") != fingerprint
    assert head_fingerprint("ray.targetPool.resources.requests.cpu=16") != fingerprint
    assert head_fingerprint("pools.maxDraftWorkers=16", "pools.targetReplicas=2", "pools.draftWorkers=4") == fingerprint
    assert head_fingerprint("ray.draftPool.tolerations=null") == fingerprint
    assert head_fingerprint("ray.upgradeStrategy=None") == fingerprint

    older = render("external-redis-servicemonitor-values.yaml")  # upgradeStrategy "": KubeRay < 1.6, no check
    assert "upgradeStrategy" not in one(older, "RayCluster")["spec"]
    assert env_of(pools_container(older))["TANDEM_RAY_SPEC_WANT"] == ""


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


STUB_TANDEM = """#!{python}
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["pools", "status"]:
    status = os.environ.get("STUB_STATUS", "")
    if not status:
        print("tandem: no pools named " + repr(sys.argv[4]), file=sys.stderr)
        sys.exit(1)
    print("Connected to the Ray cluster.")  # stray output before the JSON line is tolerated
    print(status)
"""


def run_reconcile(tmp_path: Path, objs, status: dict | None, head_spec: str | None = None):
    """Run files/reconcile-pools.sh as the Ray job would (env and args from the rendered Job), `tandem` stubbed."""
    pools = pools_container(objs)
    env = env_of(pools)
    stub = tmp_path / "bin" / "tandem"
    stub.parent.mkdir(parents=True)
    stub.write_text(STUB_TANDEM.replace("{python}", sys.executable))
    stub.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    run_env = {"PATH": f"{stub.parent}:{os.environ['PATH']}", "STUB_LOG": str(log),
               "STUB_STATUS": json.dumps(status) if status else "",
               "TANDEM_POOLS": env["TANDEM_POOLS"], "TANDEM_IMAGE": env["TANDEM_IMAGE"],
               "TANDEM_RAY_SPEC_WANT": env["TANDEM_RAY_SPEC_WANT"],
               "TANDEM_RAY_SPEC": env["TANDEM_RAY_SPEC_WANT"] if head_spec is None else head_spec}
    script = one(objs, "ConfigMap", f"{FULLNAME}-pools")["data"]["reconcile-pools.sh"]
    result = subprocess.run(["/bin/sh", "-c", script, "reconcile-pools", *pools["args"]], env=run_env,
                            capture_output=True, text=True, timeout=60)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return result, calls


def pools_status(objs, image: str | None = None, target: str = "qwen2.5-coder-1.5b-instruct",
                 draft: str = "qwen2.5-coder-0.5b-instruct", drafts: int = 2, targets: int = 1, tp: int = 1) -> dict:
    workers = [{"role": "target", "name": f"target-{i}", "healthy": True} for i in range(targets)]
    workers += [{"role": "draft", "name": f"draft-{i}", "healthy": True} for i in range(drafts)]
    status = {"name": FULLNAME, "target": target, "draft": draft, "generation": 0, "workers": workers,
              "rows_per_verify_call": 0.0, "tensor_parallel": tp}
    if image != "":
        status["image"] = image or env_of(pools_container(objs))["TANDEM_IMAGE"]
    return status


STATUS = ["pools", "status", "--name", FULLNAME, "--json"]


def start_call(objs) -> list[str]:
    return ["pools", "start", "--name", FULLNAME, *pools_container(objs)["args"]]


def test_reconcile_starts_missing_pools(tmp_path):
    objs = render()
    result, calls = run_reconcile(tmp_path, objs, None)
    assert result.returncode == 0, result.stderr
    assert calls == [STATUS, start_call(objs)]


def test_reconcile_leaves_pools_of_this_image_and_size_alone(tmp_path):
    objs = render()
    result, calls = run_reconcile(tmp_path, objs, pools_status(objs))
    assert result.returncode == 0, result.stderr
    assert calls == [STATUS]
    assert "up to date" in result.stdout


def test_reconcile_scales_each_pool_to_the_values(tmp_path):
    objs = render("pools-autoscaling-values.yaml")  # 4 draft workers, 2 target replicas
    result, calls = run_reconcile(tmp_path, objs, pools_status(objs, drafts=6, targets=1))
    assert result.returncode == 0, result.stderr
    assert calls == [STATUS, ["pools", "scale", "--name", FULLNAME, "target", "2"],
                     ["pools", "scale", "--name", FULLNAME, "draft", "4"]]


@pytest.mark.parametrize("change", [{"image": "tandem:0.0.9"}, {"image": ""}, {"target": "other-target"},
                                    {"draft": "other-draft"}, {"tp": 2}])
def test_reconcile_restarts_pools_of_another_image_or_models(tmp_path, change):
    objs = render()
    result, calls = run_reconcile(tmp_path, objs, pools_status(objs, **change))
    assert result.returncode == 0, result.stderr
    assert calls == [STATUS, ["pools", "stop", "--name", FULLNAME], start_call(objs)]


def test_reconcile_keeps_tensor_parallel_pools_of_the_values_tp(tmp_path):
    objs = render(None, "pools.tp=2")
    result, calls = run_reconcile(tmp_path, objs, pools_status(objs, tp=2))
    assert result.returncode == 0, result.stderr
    assert calls == [STATUS]


def test_reconcile_without_a_draft_expects_plain_pools(tmp_path):
    objs = render(None, "pools.draftWorkers=0")
    result, calls = run_reconcile(tmp_path, objs, pools_status(objs, draft="", drafts=0))
    assert result.returncode == 0, result.stderr
    assert calls == [STATUS]


def test_reconcile_waits_for_kuberay_to_replace_an_older_head(tmp_path):
    objs = render()
    old_pools = pools_status(objs, image="tandem:0.0.9")
    result, calls = run_reconcile(tmp_path, objs, old_pools, head_spec="0123456789abcdef")
    assert result.returncode == 1 and calls == [], "nothing may be stopped or started on a head about to go"
    assert "KubeRay has not replaced the cluster yet" in result.stderr
    # Without upgradeStrategy Recreate there is no fingerprint to wait for.
    older = render("external-redis-servicemonitor-values.yaml")
    result, calls = run_reconcile(tmp_path / "older", older, None, head_spec="anything")
    assert result.returncode == 0 and calls[-1][:2] == ["pools", "start"]


STUB_RAY = """#!{python}
# `ray job list` answers; `ray job submit ... -- ENTRYPOINT...` runs shlex.join(ENTRYPOINT) in a shell, as Ray's job
# supervisor does on the head, and exits 1 when it fails, as Ray's CLI does.
import json, os, shlex, subprocess, sys
args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps(["ray", *args[:2]]) + "\\n")
if args[:2] == ["job", "list"]:
    sys.exit(0)
assert args[:2] == ["job", "submit"], args
entrypoint = args[args.index("--") + 1:]
env = {**os.environ, "RAY_ADDRESS": "10.0.0.1:6379"}
sys.exit(1 if subprocess.run(shlex.join(entrypoint), shell=True, env=env).returncode else 0)
"""


def test_pools_job_command_runs_the_script_through_ray_job_submit(tmp_path):
    """The Job's own command end to end: its env and args, the script from the ConfigMap, through a stub `ray`."""
    objs = render("pools-autoscaling-values.yaml")
    pools = pools_container(objs)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("tandem", STUB_TANDEM), ("ray", STUB_RAY)):
        (bin_dir / name).write_text(text.replace("{python}", sys.executable))
        (bin_dir / name).chmod(0o755)
    mount = tmp_path / "etc"
    mount.mkdir()
    script = one(objs, "ConfigMap", f"{FULLNAME}-pools")["data"]["reconcile-pools.sh"]
    (mount / "reconcile-pools.sh").write_text(script)
    log = tmp_path / "calls.jsonl"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(log), "STUB_STATUS": "",
           "POD_NAME": f"{FULLNAME}-pools-r1-abcde", "TANDEM_RAY_SPEC": env_of(pools)["TANDEM_RAY_SPEC_WANT"]}
    env |= {k: v for k, v in env_of(pools).items() if v is not None}
    command = [c.replace("/etc/tandem/", f"{mount}/") for c in pools["command"]]
    result = subprocess.run([*command, *pools["args"]], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [["ray", "job", "list"], ["ray", "job", "submit"], STATUS, start_call(objs)]


@pytest.mark.parametrize("sets, message", [
    (("gateway.replicas=-1",), "gateway.replicas"),
    (("serving.tp=0",), "serving.tp"),
    (("ray.draftPool.workersPerPod=0",), "workersPerPod"),
    (("gateway.grpcPort=70000",), "gateway.grpcPort"),
    (("redis.bundled.enabled=false", "redis.url=http://cache:6379"), "redis.url"),
    (("gateway.replicaz=2",), "replicaz"),
    (("redis.url=redis://cache:6379/0",), "not both"),
    (("redis.bundled.enabled=false",), "set redis.url"),
    ((EMBEDDED, "canary.enabled=true", "canary.arms[0].name=a", "canary.arms[0].draftModel=d",
      "canary.arms[0].weight=50"), "weights must sum to 100"),
    (("gatewayArms[0].name=a", "gatewayArms[0].weight=60", "gatewayArms[1].name=a", "gatewayArms[1].weight=40"),
     "unique"),
    (("gateway.autoscaling.minReplicas=5", "gateway.autoscaling.maxReplicas=3"), "exceeds maxReplicas"),
    (("gatewayApi.grpcRoute.enabled=true",), "parentRefs"),
    (("gatewayApi.httpRoute.enabled=true",), "gatewayApi.httpRoute.parentRefs"),
    (("gatewayApi.httpRoute.enabled=true", "gatewayApi.httpRoute.parentRefs[0].name=gw", "gateway.httpPort=null"),
     "the HTTPRoute needs the gateway's HTTP API"),
    (("gatewayApi.httpRoute.enabled=true", "gatewayApi.httpRoute.parentRefs[0].name=gw",
      "gatewayApi.httpRoute.timeouts.request=10min"), "timeouts.request"),
    (("gateway.httpPort=70000",), "gateway.httpPort"),
    (("gateway.httpPort=50051",), "gateway.httpPort 50051: gateway.grpcPort takes it"),
    (("gateway.httpPort=9464",), "gateway.httpPort 9464: gateway.metricsPort takes it"),
    (("gateway.service.httpPort=50051",), "is also its grpc port"),
    (("topology=shared",), "topology"),
    # serving.* sizes embedded gateways; a tp set there with shared pools would silently do nothing.
    (("serving.tp=2",), "shared pools take pools.tp"),
    (("pools.tp=0",), "pools.tp"),
    (("canary.enabled=true", "canary.arms[0].name=a", "canary.arms[0].draftModel=d", "canary.arms[0].weight=100"),
     "set topology=embedded"),
    (("gatewayArms[0].name=a", "gatewayArms[0].weight=100", "gatewayArms[0].draftModel=other"),
     "every arm attaches to the same pools"),
    (("serving.extraArgs={--k-max=6}",), "use pools.extraArgs"),
    (("pools.maxDraftWorkers=1",), "pools.maxDraftWorkers 1 is below pools.draftWorkers 2"),
    (("pools.maxTargetReplicas=0",), "pools.maxTargetReplicas"),
    (("ray.workerMetricsPort=9465",), "ray.workerMetricsPort"),
    (("ray.draftPool.workersPerPod=3", "ray.workerMetricsPort=9463"), "ports 9463-9465, which takes ray.metricsPort"),
    (("ray.upgradeStrategy=Rolling",), "upgradeStrategy"),
    (("redis.bundled.enabled=false", "redis.existingSecret.name=s", "ray.gcsFaultTolerance.enabled=true"),
     "set ray.gcsFaultTolerance.redisAddress"),
    (("ray.gcsFaultTolerance.redisAddress=redis://r:6379",), "redisAddress"),
    (("gateway.autoscaling.metric.name=",), "metric"),
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
                                         "RayCluster", "StatefulSet", "Job", "ConfigMap"}
    assert all("namespace" not in o["metadata"] for o in objs), "plain manifests take the namespace from kubectl -n"
    assert one(objs, "Job")["metadata"]["name"] == "tandem-pools-r1"
    assert flags(gateway_container(one(objs, "Deployment"))["args"])["pools"] == "tandem"
    assert flags(gateway_container(one(objs, "Deployment"))["args"])["http-port"] == "8000"
    assert [p["name"] for p in one(objs, "Service", "tandem-gateway")["spec"]["ports"]] == ["grpc", "http"]


def test_image_build_follows_the_readme_install():
    readme = (ROOT / "README.md").read_text()
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    torch = re.search(r"pip install torch==([\w.]+)", readme).group(1)
    assert f"ARG TORCH_VERSION={torch}\n" in dockerfile
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    assert re.search(r'pip install --no-cache-dir "\.\[server\]" ', dockerfile)  # the base install is the client
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
