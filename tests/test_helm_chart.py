"""The Helm chart helm/tandem: helm lint and helm template with every ci/ values file, Kubernetes schema validation of
what they render, assertions on how the rendered objects fit together (both topologies: shared pools with
`tandem gateway --pools`, and embedded `tandem serve` gateways), and the pools Job's reconcile script run against a
stub `tandem`.

Needs helm: $TANDEM_HELM, else .venv/bin/helm (scripts/install_helm.sh puts it there), else helm on PATH.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import importlib.util
import ipaddress
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
RAY_CLIENT = f"ray.address=ray://{FULLNAME}-ray-head-svc:10001"  # a gateway with no Ray node of its own
EMBEDDED = "topology=embedded"
# kubernetes-validate has schemas for core kinds only. These CRD kinds are checked by the assertions below (the
# RayCluster's pod templates are validated as Pods); any other kind must validate.
CRD_KINDS = {("ray.io/v1", "RayCluster"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
             ("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
             ("gateway.networking.k8s.io/v1", "GRPCRoute"), ("gateway.networking.k8s.io/v1", "HTTPRoute"),
             ("cert-manager.io/v1", "Certificate")}
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


def secret_refs(node) -> set[tuple[str, str]]:
    """(Secret, key) of every secretKeyRef anywhere in a manifest object."""
    if isinstance(node, list):
        return {ref for item in node for ref in secret_refs(item)}
    if not isinstance(node, dict):
        return set()
    found = {(node["secretKeyRef"]["name"], node["secretKeyRef"]["key"])} if "secretKeyRef" in node else set()
    return found | {ref for value in node.values() for ref in secret_refs(value)}


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


def serves_tls(gateway: dict) -> bool:
    return any(arg.startswith("--tls-cert=") for arg in gateway["args"])


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
                    "ray-address": head, "grace": "30", "response-ttl": "3600"}
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
    # The dashboard (job submission) listens on the head's loopback only: the Job reaches the head through the Ray
    # Client port and submits from there (files/submit-on-head.py), so the Ray job, the driver and the pools' manager
    # actor live on the head, not on this pod.
    assert env["RAY_CLIENT_ADDRESS"] == f"ray://{FULLNAME}-ray-head-svc:10001"
    assert env["RAY_DASHBOARD_ADDRESS"] == "http://127.0.0.1:8265"
    head_ports = {p["name"]: p["containerPort"] for p in ray_groups(objs)["head"]["template"]["spec"]["containers"][0]
                  ["ports"]}
    assert head_ports["client"] == 10001 and "dashboard" not in head_ports and 8265 not in head_ports.values()
    assert pools["command"] == ["python3", "/etc/tandem/submit-on-head.py"]
    assert env["RECONCILE_SCRIPT"] == "/etc/tandem/reconcile-pools.sh"
    assert next(e for e in pools["env"] if e["name"] == "POD_NAME")["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.name"}}
    mount = next(m for m in pools["volumeMounts"] if m["mountPath"] == "/etc/tandem")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config = one(objs, "ConfigMap", volume["configMap"]["name"])
    for name in ("reconcile-pools.sh", "submit-on-head.py"):
        assert config["data"][name].strip() == (CHART / "files" / name).read_text().strip()

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


@pytest.mark.parametrize("values, sets", [
    (None, ()),                                    # both pools on GPUs: no pod preloads
    ("cpu-only-values.yaml", ()),
    ("cpu-only-values.yaml", (EMBEDDED,)),
    (None, ("ray.draftPool.gpusPerPod=0",)),       # CPU drafts beside GPU targets: the draft pool's pods alone
    ("cpu-only-values.yaml", ("ray.cpuPreload=",)),  # "": none
])
def test_pods_that_decode_on_their_cpu_preload_tcmalloc_and_intel_openmp(values, sets):
    objs = render(values, *sets)
    preload = yaml.safe_load((CHART / "values.yaml").read_text())["ray"]["cpuPreload"]
    if "ray.cpuPreload=" in sets:
        preload = ""
    for name, group in ray_groups(objs).items():
        env = env_of(group["template"]["spec"]["containers"][0])
        on_cpu = name != "head" and pod_gpus(group) == 0
        assert env.get("LD_PRELOAD") == (preload if on_cpu and preload else None), name


def test_cpu_preload_names_what_the_image_installs_where_cpu_runtime_looks():
    from tandem.core.cpu_runtime import TCMALLOC

    preload = yaml.safe_load((CHART / "values.yaml").read_text())["ray"]["cpuPreload"]
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    # The image checks the chart's paths at build time, installs Debian's tcmalloc and the lock's intel-openmp
    # (tandem[cpu]), whose libiomp5 pip puts in the prefix's lib/: /usr/local for python:3.11-slim.
    assert dict(re.findall(r"^ARG (\w+)=(.*)$", dockerfile, re.M))["CPU_PRELOAD"] == preload
    assert 'test -f "${lib}"' in dockerfile and "libtcmalloc-minimal4" in dockerfile
    assert preload.split(":") == [TCMALLOC[0], "/usr/local/lib/libiomp5.so"]
    assert "--extra cpu" in (ROOT / "scripts" / "lock_deps.sh").read_text()


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
        assert flags(gateway["args"])["response-ttl"] == "3600"  # kept in the release's Redis, which they share
        assert "allowed-origins" not in flags(gateway["args"])  # no browser origin by default
        assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in gateway["ports"]
    services = [s for s in find(objs, "Service") if s["metadata"]["name"].startswith(f"{FULLNAME}-gateway")]
    assert len(services) == len(deployments) + (1 if len(deployments) > 1 else 0)  # the arms' and the shared one
    for service in services:
        ports = service_ports(service)
        assert ports["http"] == {"name": "http", "port": service_port, "targetPort": "http", "protocol": "TCP",
                                 "appProtocol": "http"}
        assert ports["grpc"]["port"] == 50051 and ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    # A port of another number reaches the flag, the container and (by default) the Service alike.
    moved = render(values, *sets, "gateway.httpPort=8080", "gateway.http.responseTtlSeconds=0",
                   "gateway.http.allowedOrigins={https://app.example.com,http://localhost:3000}")
    for deployment in gateways(moved):
        gateway = gateway_container(deployment)
        assert flags(gateway["args"])["http-port"] == "8080" and flags(gateway["args"])["response-ttl"] == "0"
        assert flags(gateway["args"])["allowed-origins"] == "https://app.example.com,http://localhost:3000"
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
        assert not [a for a in gateway["args"] if a.startswith(("--response-ttl", "--allowed-origins"))]
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
    # The bundled Redis requires a password, which tandem takes from TANDEM_REDIS_PASSWORD, not the URL
    # (test_redis_requires_its_password_from_a_secret).
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


BUNDLED_REDIS_PASSWORD = {"valueFrom": {"secretKeyRef": {"name": f"{FULLNAME}-redis-auth", "key": "password"}}}


@pytest.mark.parametrize("values, sets, options", [
    # The bundled Redis keeps the GCS tables too, under KubeRay's default namespace (the RayCluster's UID), and KubeRay
    # hands the head its password.
    (None, (), {"redisAddress": f"{FULLNAME}-redis:6379", "redisPassword": BUNDLED_REDIS_PASSWORD}),
    (None, (EMBEDDED,), {"redisAddress": f"{FULLNAME}-redis:6379", "redisPassword": BUNDLED_REDIS_PASSWORD}),
    ("pools-autoscaling-values.yaml", (), {"redisAddress": f"{FULLNAME}-redis:6379",
                                           "redisPassword": BUNDLED_REDIS_PASSWORD,
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


# A stand-in for the `ray` module that files/submit-on-head.py imports: ray.init as a Ray Client (refused twice, as
# while the head starts), and a remote task that runs right here and records where it asked to be scheduled.
FAKE_RAY_MODULE = """
import json, os
_log = os.environ["STUB_LOG"]
_refusals = [0]
def _write(entry):
    with open(_log, "a") as log:
        log.write(json.dumps(entry) + "\\n")
def init(address=None, **kwargs):
    _write(["ray.init", address])
    if _refusals[0] < 2:
        _refusals[0] += 1
        raise ConnectionError("ray client connection timeout")
def shutdown():
    pass
class _Task:
    def __init__(self, function):
        self.function = function
    def options(self, **options):
        _write(["options", options])
        return self
    def remote(self, *args):
        return self.function(*args)
def remote(function):
    return _Task(function)
def get(value):
    return value
"""


def test_pools_job_command_runs_the_script_through_ray_job_submit(tmp_path):
    """The Job's own command end to end: its env and args, submit-on-head.py and the script from the ConfigMap, a
    fake `ray` module (the Ray Client) and a stub `ray` CLI on the 'head' (here)."""
    objs = render("pools-autoscaling-values.yaml")
    pools = pools_container(objs)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("tandem", STUB_TANDEM), ("ray", STUB_RAY)):
        (bin_dir / name).write_text(text.replace("{python}", sys.executable))
        (bin_dir / name).chmod(0o755)
    module_dir = tmp_path / "module" / "ray"
    module_dir.mkdir(parents=True)
    (module_dir / "__init__.py").write_text(FAKE_RAY_MODULE)
    mount = tmp_path / "etc"
    mount.mkdir()
    config = one(objs, "ConfigMap", f"{FULLNAME}-pools")["data"]
    for name in ("reconcile-pools.sh", "submit-on-head.py"):
        (mount / name).write_text(config[name])
    log = tmp_path / "calls.jsonl"
    env = {k: v for k, v in env_of(pools).items() if v is not None}
    env |= {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(module_dir.parent), "STUB_LOG": str(log),
            "STUB_STATUS": "", "POD_NAME": f"{FULLNAME}-pools-r1-abcde",
            "TANDEM_RAY_SPEC": env_of(pools)["TANDEM_RAY_SPEC_WANT"],
            "RECONCILE_SCRIPT": env["RECONCILE_SCRIPT"].replace("/etc/tandem/", f"{mount}/")}
    script = pools["command"][1].replace("/etc/tandem/", f"{mount}/")
    source = (mount / "submit-on-head.py").read_text()
    for constant in ("RETRY_SECONDS = 5", "FLUSH_SECONDS = 2"):  # no waiting here
        assert constant in source
        source = source.replace(constant, constant.split("=")[0] + "= 0")
    Path(script).write_text(source)
    result = subprocess.run([sys.executable, script, *pools["args"]], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    client = f"ray://{FULLNAME}-ray-head-svc:10001"
    assert calls == [["ray.init", client]] * 3 + [
        ["options", {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}, "max_retries": 0}],
        ["ray", "job", "list"], ["ray", "job", "submit"], STATUS, start_call(objs)]
    assert result.stdout.count(f"waiting for the Ray head at {client}") == 2
    assert f"the Ray job {FULLNAME}-pools-r1-abcde exited with 0" in result.stdout


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
    (("gateway.http.allowedOrigins={app.example.com/path}",), "gateway.http.allowedOrigins.0"),
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
    (("gateway.tls.secretName=tls", "gateway.http.enabled=false"), "the gateway's probes need the HTTP API under TLS"),
    (("gateway.tls.certManager.issuerRef.name=ca", "gateway.httpPort=null"), "need the HTTP API under TLS"),
    (("gateway.tls.clientCA.enabled=true",), "mutual TLS needs TLS"),
    (("redis.bundled.enabled=false", "redis.url=redis://r:6379/0", "redis.auth.existingSecret=s"),
     "an external Redis takes its password in its URL"),
    (("ray.version=2.51.0",), "needs Ray >= 2.52"),
    (("ray.head.rayStartParams.dashboard-host=0.0.0.0",), "stays on the head's loopback"),
    (("gateway.tls.certManager.duration=90d",), "duration"),
    (("networkPolicy.clients=all",), "networkPolicy.clients"),
    # Without a raylet in the pod, a GCS address cannot be joined: the gateway failed at start.
    (("gateway.joinRayCluster=false",), "ray.address must be the head's client URL, e.g. ray://"),
    (("gateway.joinRayCluster=false", "ray.address=h:6379"), "ray.address must be the head's client URL"),
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
                                         "RayCluster", "StatefulSet", "Job", "ConfigMap", "NetworkPolicy"}
    # No generated Secret in a committed file (its password would be everyone's): the user creates both.
    assert not find(objs, "Secret")
    assert {ref for o in objs for ref in secret_refs(o)} == {("tandem-redis-auth", "password"),
                                                             ("tandem-ray-auth", "auth_token")}
    header = committed.split("\n---", 1)[0]
    assert "kubectl create secret generic -n tandem tandem-redis-auth --from-literal=password=" in header
    assert "kubectl create secret generic -n tandem tandem-ray-auth --from-literal=auth_token=" in header
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
    # The base install is the client: the image's dependencies are the server extra's, locked (test_deploy_lock.py).
    assert "pip install --no-cache-dir --no-deps --no-build-isolation ." in dockerfile
    assert "--extra server" in (ROOT / "scripts" / "lock_deps.sh").read_text()
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
    assert '"${TORCH_VERSION}+${TORCH_VARIANT}"' in dockerfile  # the build checks torch.__version__: PyPI's is +cu130
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in dockerfile
    # The driver minimums the docs state are the ones a failing --device cuda reports (core/device.py).
    for text in (dockerfile, docs):
        assert f"CUDA 13.0, NVIDIA driver >= {MIN_DRIVER['13']}" in text or f"| 13.0 | >= {MIN_DRIVER['13']}" in text
        assert f">= {MIN_DRIVER['12']}" in text


# --- Security: Pod Security "restricted", TLS, Secrets, Ray's dashboard and token, NetworkPolicies ---------------

def pod_security():
    """scripts/check_pod_security.py, imported (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("check_pod_security", ROOT / "scripts" / "check_pod_security.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_pod_security", module)
    spec.loader.exec_module(module)
    return module


SECURITY_CASES = [(None, ()), (None, (EMBEDDED,)), (None, ("gateway.tls.secretName=tls",)),
                  (None, ("gateway.joinRayCluster=false", RAY_CLIENT)), ("secure-tls-values.yaml", (EMBEDDED,))]


@pytest.mark.parametrize("values, sets", [(name.name, ()) for name in CI_VALUES] + SECURITY_CASES)
def test_every_rendered_pod_meets_the_restricted_pod_security_standard(values, sets):
    objs = render(values, *sets)
    checked, found = pod_security().check_documents(objs)
    assert not found, "\n".join(map(str, found))
    # Every pod the chart renders was looked at: the gateways, Redis, the pools Job, the Ray head and worker groups.
    templates = len(find(objs, "Deployment")) + len(find(objs, "StatefulSet")) + len(find(objs, "Job"))
    assert checked == templates + len(ray_groups(objs))


def tandem_containers(objs) -> list[tuple[str, dict, dict]]:
    """(where, pod spec, container) for every container of the tandem image: gateways (init containers too), the pools
    Job, the Ray head and workers."""
    found = []
    pods = [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in gateways(objs) + find(objs, "Job")]
    pods += [(name, group["template"]["spec"]) for name, group in ray_groups(objs).items()]
    for name, pod in pods:
        for cont in pod.get("initContainers", []) + pod["containers"]:
            found.append((f"{name}/{cont['name']}", pod, cont))
    return found


@pytest.mark.parametrize("values", [None, "secure-tls-values.yaml", "tp4-multi-replica-values.yaml"])
def test_pods_run_as_their_images_users_with_a_read_only_root(values):
    objs = render(values)
    for where, pod, cont in tandem_containers(objs):
        context = pod["securityContext"]
        # deploy/Dockerfile: USER 1000 (useradd --uid 1000 tandem).
        assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (1000, 1000, 1000), where
        assert context["runAsNonRoot"] is True and context["seccompProfile"] == {"type": "RuntimeDefault"}
        assert cont["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                           "capabilities": {"drop": ["ALL"]}}, where
        # What Ray, torch and the Hugging Face client write goes to emptyDirs: /tmp (Ray's session directory) and HOME.
        mounts = {m["mountPath"]: m["name"] for m in cont.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert env_of(cont)["HOME"] == "/home/tandem", where
        for path in ("/tmp", "/home/tandem"):
            assert "emptyDir" in volumes[mounts[path]], (where, path)
    redis = one(objs, "StatefulSet")["spec"]["template"]["spec"] if find(objs, "StatefulSet") else None
    if redis:
        assert (redis["securityContext"]["runAsUser"], redis["securityContext"]["fsGroup"]) == (999, 999)  # redis:7
        assert container(redis, "redis")["securityContext"]["readOnlyRootFilesystem"] is True
    # No pod needs the Kubernetes API but the Ray head (KubeRay's autoscaler runs in it).
    for d in gateways(objs) + find(objs, "Job") + find(objs, "StatefulSet"):
        assert d["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    for name, group in ray_groups(objs).items():
        assert ("automountServiceAccountToken" in group["template"]["spec"]) == (name != "head")
    # KubeRay's autoscaler container takes the same restricted securityContext and scratch mounts.
    options = one(objs, "RayCluster")["spec"].get("autoscalerOptions")
    if options:
        assert options["securityContext"]["readOnlyRootFilesystem"] is True
        assert {m["mountPath"] for m in options["volumeMounts"]} == {"/tmp", "/home/tandem"}


PLANTED = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: planted}
spec:
  template:
    spec:
      securityContext: {runAsNonRoot: true, seccompProfile: {type: RuntimeDefault}}
      containers:
        - name: app
          securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
        - name: no-drop
          securityContext: {allowPrivilegeEscalation: false}
---
apiVersion: v1
kind: Pod
metadata:
  name: bad
  annotations: {container.apparmor.security.beta.kubernetes.io/app: unconfined}
spec:
  hostNetwork: true
  securityContext:
    runAsUser: 0
    sysctls: [{name: kernel.msgmax, value: "1"}]
    seLinuxOptions: {type: spc_t}
  volumes:
    - {name: host, hostPath: {path: /}}
    - {name: nfs, nfs: {server: nfs, path: /}}
  containers:
    - name: app
      ports: [{containerPort: 80, hostPort: 80}]
      securityContext:
        privileged: true
        procMount: Unmasked
        seccompProfile: {type: Unconfined}
        capabilities: {drop: [ALL], add: [SYS_ADMIN, NET_BIND_SERVICE]}
---
apiVersion: ray.io/v1
kind: RayCluster
metadata: {name: ray}
spec:
  enableInTreeAutoscaling: true
  headGroupSpec:
    template:
      spec:
        securityContext: {runAsNonRoot: true, seccompProfile: {type: RuntimeDefault}}
        containers:
          - name: ray-head
            securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
  workerGroupSpecs:
    - groupName: gpu
      template:
        spec:
          containers: [{name: ray-worker}]
"""


def test_pod_security_checker_names_the_object_container_and_rule_it_breaks(tmp_path):
    checker = pod_security()
    _, found = checker.check_documents(yaml.safe_load_all(PLANTED))
    lines = {str(v) for v in found}
    assert lines >= {
        'Deployment/planted spec.template: container "no-drop": Capabilities: securityContext.capabilities.drop '
        'must include ALL',
        "Pod/bad spec: pod: Host Namespaces: hostNetwork must be unset or false",
        "Pod/bad spec: pod: Running as Non-root user: securityContext.runAsUser must not be 0",
        "Pod/bad spec: pod: HostPath Volumes: volume 'host' is a hostPath",
        'Pod/bad spec: container "app": Privileged Containers: securityContext.privileged must be unset or false',
        'Pod/bad spec: container "app": Host Ports: hostPort 80 must be unset or 0',
        'Pod/bad spec: container "app": Running as Non-root: runAsNonRoot must be true (on the pod, or on every '
        'container)',
    }
    rules = {(v.pod.obj, v.container, v.rule) for v in found}
    assert {("Pod/bad", None, rule) for rule in ("Sysctls", "SELinux", "AppArmor", "Volume Types")} <= rules
    assert {("Pod/bad", "app", rule) for rule in ("/proc Mount Type", "Seccomp", "Capabilities",
                                                  "Privilege Escalation")} <= rules
    # KubeRay's autoscaler container (no autoscalerOptions.securityContext here) and a bare worker group.
    assert ("RayCluster/ray", "autoscaler (KubeRay)", "Privilege Escalation") in rules
    assert ("RayCluster/ray", "ray-worker", "Running as Non-root") in rules
    assert not [v for v in found if v.container == "app" and v.pod.obj == "Deployment/planted"]

    # The command line: exit 1 naming them, 0 on the chart's render, 2 on what is not YAML.
    planted = tmp_path / "planted.yaml"
    planted.write_text(PLANTED)
    script = str(ROOT / "scripts" / "check_pod_security.py")
    result = subprocess.run([sys.executable, script, str(planted)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f'{planted}: Deployment/planted spec.template: container "no-drop": Capabilities' in result.stderr
    chart = subprocess.run([sys.executable, script], input=yaml.safe_dump_all(render()), capture_output=True,
                           text=True, timeout=60)
    assert chart.returncode == 0 and "meet the restricted Pod Security Standard" in chart.stdout, chart.stderr
    (tmp_path / "broken.yaml").write_text("kind: [unclosed")
    broken = subprocess.run([sys.executable, script, str(tmp_path / "broken.yaml")], capture_output=True, text=True,
                            timeout=60)
    assert broken.returncode == 2


def test_render_check_runs_the_pod_security_checker_on_every_render():
    script = (ROOT / "scripts" / "render_helm.sh").read_text()
    assert '"$PYTHON" scripts/check_pod_security.py "$out/$name.yaml"' in script
    assert '"$PYTHON" scripts/check_pod_security.py "$MANIFEST"' in script


@pytest.mark.parametrize("values, sets", [(None, ("gateway.tls.secretName=gw-tls",)),
                                          (None, (EMBEDDED, "gateway.tls.secretName=gw-tls")),
                                          ("canary-grpcroute-values.yaml", ("gateway.tls.secretName=gw-tls",))])
def test_gateway_tls_moves_the_probes_to_https_and_mounts_the_secret(values, sets):
    objs = render(values, *sets)
    plain = render(values)
    for deployment in gateways(objs):
        pod = deployment["spec"]["template"]["spec"]
        gateway = container(pod, "gateway")
        args = flags(gateway["args"])
        assert (args["tls-cert"], args["tls-key"]) == ("/etc/tandem/tls/tls.crt", "/etc/tandem/tls/tls.key")
        assert "tls-client-ca" not in args
        mount = next(m for m in gateway["volumeMounts"] if m["name"] == "tls")
        assert mount == {"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True}
        assert next(v for v in pod["volumes"] if v["name"] == "tls")["secret"] == {"secretName": "gw-tls"}
        # Kubernetes' gRPC probes cannot speak TLS: /health over HTTPS (the kubelet skips verification), and a TCP
        # connect for liveness; the timings stay the values'.
        https = {"path": "/health", "port": "http", "scheme": "HTTPS"}
        assert gateway["readinessProbe"]["httpGet"] == https and gateway["startupProbe"]["httpGet"] == https
        assert gateway["livenessProbe"]["tcpSocket"] == {"port": "http"}
        assert not [p for p in ("livenessProbe", "readinessProbe", "startupProbe") if "grpc" in gateway[p]]
        assert gateway["startupProbe"]["failureThreshold"] == 180 and gateway["readinessProbe"]["periodSeconds"] == 5
        assert {p["name"]: p["containerPort"] for p in gateway["ports"]}["http"] == 8000
    for service in find(objs, "Service"):
        if service["metadata"]["name"].startswith(f"{FULLNAME}-gateway"):
            ports = service_ports(service)
            assert "appProtocol" not in ports["grpc"] and ports["http"]["appProtocol"] == "https"
    # Plaintext is as it was: gRPC probes, no TLS flags or mounts, h2c on the Service.
    for deployment in gateways(plain):
        gateway = gateway_container(deployment)
        assert not serves_tls(gateway) and "grpc" in gateway["readinessProbe"]
        assert "tls" not in {m["name"] for m in gateway["volumeMounts"]}
    assert service_ports(one(plain, "Service", f"{FULLNAME}-gateway"))["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert not find(objs, "Certificate")


def test_mutual_tls_checks_readiness_with_the_gateways_own_certificate():
    objs = render("secure-tls-values.yaml")
    pod = one(objs, "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]
    gateway = container(pod, "gateway")
    args = flags(gateway["args"])
    # cert-manager writes <fullname>-gateway-tls with ca.crt: the issuing CA is the client CA.
    assert args["tls-client-ca"] == "/etc/tandem/tls/ca.crt" and "--insecure" not in gateway["args"]
    assert args["api-keys"] == "/etc/tandem/api-keys/keys.jsonl"
    assert next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]["secretName"] == f"{FULLNAME}-gateway-tls"
    # The kubelet presents no client certificate: an exec probe presents the gateway's own.
    for probe in ("readinessProbe", "startupProbe"):
        command = gateway[probe]["exec"]["command"]
        assert command[:2] == ["python3", "-c"] and command[3:] == ["8000", "/etc/tandem/tls/tls.crt",
                                                                     "/etc/tandem/tls/tls.key"]
        assert "load_cert_chain(cert, key)" in command[2] and '"/health"' in command[2]
        compile(command[2], probe, "exec")
    assert gateway["livenessProbe"]["tcpSocket"] == {"port": "http"}
    certificate = one(objs, "Certificate")
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    spec = certificate["spec"]
    assert spec["secretName"] == f"{FULLNAME}-gateway-tls"
    assert spec["issuerRef"] == {"name": "tandem-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert f"{FULLNAME}-gateway" in spec["dnsNames"] and "llm.internal.example.com" in spec["dnsNames"]
    assert f"{FULLNAME}-gateway.default.svc.cluster.local" in spec["dnsNames"]
    assert (spec["duration"], spec["renewBefore"]) == ("2160h", "720h")
    # A client CA of its own: a second Secret, mounted beside the first.
    separate = render(None, "gateway.tls.secretName=gw-tls", "gateway.tls.clientCA.enabled=true",
                      "gateway.tls.clientCA.secretName=clients-ca", "gateway.tls.clientCA.key=bundle.pem")
    pod = one(separate, "Deployment")["spec"]["template"]["spec"]
    gateway = container(pod, "gateway")
    assert flags(gateway["args"])["tls-client-ca"] == "/etc/tandem/client-ca/bundle.pem"
    assert next(v for v in pod["volumes"] if v["name"] == "client-ca")["secret"] == {
        "secretName": "clients-ca", "items": [{"key": "bundle.pem", "path": "bundle.pem"}]}
    assert {"name": "client-ca", "mountPath": "/etc/tandem/client-ca", "readOnly": True} in gateway["volumeMounts"]


def secret_value(objs, name: str, key: str) -> str:
    return base64.b64decode(one(objs, "Secret", name)["data"][key]).decode()


def test_redis_requires_its_password_from_a_secret():
    objs = render()
    redis_pod = one(objs, "StatefulSet")["spec"]["template"]["spec"]
    redis = container(redis_pod, "redis")
    # Kubernetes expands $(REDIS_PASSWORD) from the container's env: the pod spec names the Secret, not the password.
    assert redis["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    password_ref = {"name": f"{FULLNAME}-redis-auth", "key": "password"}
    for name in ("REDIS_PASSWORD", "REDISCLI_AUTH"):
        assert next(e for e in redis["env"] if e["name"] == name)["valueFrom"] == {"secretKeyRef": password_ref}
    # The readiness probe authenticates (REDISCLI_AUTH) and needs PONG, which a refused AUTH does not print.
    assert redis["readinessProbe"]["exec"]["command"] == ["sh", "-c", "redis-cli ping | grep -q PONG"]
    password = secret_value(objs, f"{FULLNAME}-redis-auth", "password")
    assert re.fullmatch(r"[A-Za-z0-9]{40}", password)
    # Every consumer: the gateways (TANDEM_REDIS_PASSWORD, which tandem folds into REDIS_URL; it refuses a second
    # password in the URL itself) and the Ray head's GCS fault tolerance (KubeRay's redisPassword).
    for values, sets in ((None, ()), (None, (EMBEDDED,)), ("canary-grpcroute-values.yaml", ("redis.url=",
                         "redis.bundled.enabled=true"))):
        rendered = render(values, *sets)
        for deployment in gateways(rendered):
            env = {e["name"]: e for e in gateway_container(deployment)["env"]}
            assert env["TANDEM_REDIS_PASSWORD"]["valueFrom"] == {"secretKeyRef": password_ref}
            assert env["REDIS_URL"]["value"] == f"redis://{FULLNAME}-redis:6379/0"
            assert "@" not in env["REDIS_URL"]["value"] and "$(" not in json.dumps(list(env.values()))
        redis_password = one(rendered, "RayCluster")["spec"]["gcsFaultToleranceOptions"]["redisPassword"]
        assert redis_password == {"valueFrom": {"secretKeyRef": password_ref}}
    # An existing Secret: no generated one, and every reference moves to it.
    own = render(None, "redis.auth.existingSecret=my-redis", "redis.auth.key=pw")
    assert [s["metadata"]["name"] for s in find(own, "Secret")] == [f"{FULLNAME}-ray-auth"]
    refs = {ref for o in own for ref in secret_refs(o) if ref[0] != f"{FULLNAME}-ray-auth"}
    assert refs == {("my-redis", "pw")}
    # An external Redis: no password Secret, the URL carries it (redis.existingSecret) as before.
    external = render("external-redis-servicemonitor-values.yaml")
    assert [s["metadata"]["name"] for s in find(external, "Secret")] == [f"{FULLNAME}-ray-auth"]
    assert "TANDEM_REDIS_PASSWORD" not in env_of(gateway_container(one(external, "Deployment")))


def test_the_canary_key_is_one_secret_shared_by_every_gateway():
    """The in-gateway canary places sessions by HMAC: every replica must hold the same key, from a Secret."""
    ref = {"secretKeyRef": {"name": f"{FULLNAME}-canary-secret", "key": "secret"}}
    objs = render("canary-grpcroute-values.yaml")
    for deployment in gateways(objs):
        env = {e["name"]: e for e in gateway_container(deployment)["env"]}
        assert env["TANDEM_CANARY_SECRET"]["valueFrom"] == ref
    assert re.fullmatch(r"[A-Za-z0-9]{40}", secret_value(objs, f"{FULLNAME}-canary-secret", "secret"))
    own = render("canary-grpcroute-values.yaml", "canary.secret.existingSecret=my-canary", "canary.secret.key=k")
    assert not find(own, "Secret", f"{FULLNAME}-canary-secret")
    for deployment in gateways(own):
        env = {e["name"]: e for e in gateway_container(deployment)["env"]}
        assert env["TANDEM_CANARY_SECRET"]["valueFrom"] == {"secretKeyRef": {"name": "my-canary", "key": "k"}}
    plain = render()  # no in-gateway canary: no key
    assert not find(plain, "Secret", f"{FULLNAME}-canary-secret")
    assert all("TANDEM_CANARY_SECRET" not in env_of(gateway_container(d)) for d in gateways(plain))


def ray_auth_env(cont: dict) -> tuple[str | None, dict | None]:
    env = {e["name"]: e for e in cont.get("env", [])}
    mode = env.get("RAY_AUTH_MODE", {}).get("value")
    token = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom")
    return mode, token


@pytest.mark.parametrize("values, sets, secret", [
    (None, (), (f"{FULLNAME}-ray-auth", "auth_token")),
    (None, (EMBEDDED, "gateway.joinRayCluster=false", RAY_CLIENT), (f"{FULLNAME}-ray-auth", "auth_token")),
    ("secure-tls-values.yaml", (), ("tandem-ray-auth", "token")),
    ("external-redis-servicemonitor-values.yaml", (), (f"{FULLNAME}-ray-auth", "auth_token")),
])
def test_the_ray_token_comes_from_a_secret_on_every_ray_container(values, sets, secret):
    objs = render(values, *sets)
    want = ("token", {"secretKeyRef": {"name": secret[0], "key": secret[1]}})
    containers = tandem_containers(objs)
    assert {where.rsplit("/", 1)[1] for where, _, _ in containers} >= {"gateway", "ray-head", "ray-worker"}
    for where, _, cont in containers:
        assert ray_auth_env(cont) == want, where  # KubeRay copies the workers' env into wait-gcs-ready
    spec = one(objs, "RayCluster")["spec"]
    if spec.get("enableInTreeAutoscaling"):
        assert ray_auth_env(spec["autoscalerOptions"]) == want  # KubeRay's autoscaler container talks to the GCS
    generated = find(objs, "Secret", f"{FULLNAME}-ray-auth")
    assert bool(generated) == (secret[0] == f"{FULLNAME}-ray-auth")
    if generated:
        assert re.fullmatch(r"[A-Za-z0-9]{40}", secret_value(objs, *secret))


@pytest.mark.parametrize("values", [p.name for p in CI_VALUES])
def test_the_ray_dashboard_listens_on_the_heads_loopback_only(values):
    objs = render(values)
    groups = ray_groups(objs)
    assert groups["head"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    for group in groups.values():
        assert "0.0.0.0" not in json.dumps(group["rayStartParams"])
        ports = group["template"]["spec"]["containers"][0]["ports"]
        assert 8265 not in {p["containerPort"] for p in ports}  # nor does KubeRay's head Service expose it
    # No pod is told to reach the dashboard over the network.
    assert "head-svc:8265" not in json.dumps(objs)


# A NetworkPolicy evaluator for what the chart renders: podSelector/namespaceSelector matchLabels, ipBlock, numbered
# and named ports, endPort. The release lives in namespace "default" (helm template's).
@dataclasses.dataclass(frozen=True)
class Endpoint:
    labels: dict
    namespace: str = "default"
    ports: dict = dataclasses.field(default_factory=dict)  # named container ports, for a destination
    ip: str | None = None  # outside the cluster's pods


def peer_matches(peer: dict, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        return other.ip is not None and ipaddress.ip_address(other.ip) in ipaddress.ip_network(block["cidr"]) and \
            not any(ipaddress.ip_address(other.ip) in ipaddress.ip_network(e) for e in block.get("except", []))
    if other.ip is not None:
        return False
    if "namespaceSelector" in peer:
        namespace = {"kubernetes.io/metadata.name": other.namespace}
        in_namespace = selects(peer["namespaceSelector"].get("matchLabels", {}), namespace)
    else:
        in_namespace = other.namespace == "default"
    return in_namespace and selects(peer.get("podSelector", {}).get("matchLabels", {}), other.labels)


def port_matches(entries: list | None, port: int, named: dict) -> bool:
    if not entries:
        return True
    for entry in entries:
        wanted = entry.get("port")
        if wanted is None or (isinstance(wanted, str) and named.get(wanted) == port) or (
                isinstance(wanted, int) and wanted <= port <= entry.get("endPort", wanted)):
            return True
    return False


def direction_allows(policies, subject: Endpoint, other: Endpoint, port: int, kind: str) -> bool:
    rules_key, peers_key = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
    if subject.ip is not None or subject.namespace != "default":
        return True  # not the release's pod: no policy of the chart's selects it
    selecting = [p["spec"] for p in policies if kind in p["spec"]["policyTypes"]
                 and selects(p["spec"]["podSelector"].get("matchLabels", {}), subject.labels)]
    if not selecting:
        return True
    named = subject.ports if kind == "Ingress" else other.ports
    return any(port_matches(rule.get("ports"), port, named)
               and (peers_key not in rule or any(peer_matches(peer, other) for peer in rule[peers_key]))
               for spec in selecting for rule in spec.get(rules_key, []))


def network_allows(objs, source: Endpoint, destination: Endpoint, port: int) -> bool:
    policies = find(objs, "NetworkPolicy")
    return direction_allows(policies, destination, source, port, "Ingress") and \
        direction_allows(policies, source, destination, port, "Egress")


def release_endpoints(objs) -> dict[str, Endpoint]:
    def endpoint(template: dict) -> Endpoint:
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        return Endpoint(template["metadata"]["labels"], ports=ports)

    found = {"gateway": endpoint(gateways(objs)[0]["spec"]["template"])}
    found |= {name: endpoint(group["template"]) for name, group in ray_groups(objs).items()}
    for kind, name in (("StatefulSet", "redis"), ("Job", "pools")):
        if find(objs, kind):
            found[name] = endpoint(one(objs, kind)["spec"]["template"])
    return found


def test_network_policies_let_only_the_release_reach_ray_and_redis():
    objs = render()
    pods = release_endpoints(objs)
    gateway, head, worker, redis, pools = (pods[n] for n in ("gateway", "head", "draft-pool", "redis", "pools"))
    stranger = Endpoint({"app": "other"})                                  # any other pod of the namespace
    outside = Endpoint({"app": "client"}, namespace="apps")                # a client in another namespace
    prometheus = Endpoint({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
    internet = Endpoint({}, ip="203.0.113.7")
    allows = functools.partial(network_allows, objs)
    assert {o["metadata"]["name"] for o in find(objs, "NetworkPolicy")} == {
        f"{FULLNAME}-{name}" for name in ("gateway", "ray", "ray-client", "pools", "redis")}
    # Clients reach the gateways' gRPC and HTTP ports from anywhere; metrics only from Prometheus.
    for client in (outside, stranger):
        assert allows(client, gateway, 50051) and allows(client, gateway, 8000)
        assert not allows(client, gateway, 9464)
    assert allows(prometheus, gateway, 9464) and allows(prometheus, head, 9465) and allows(prometheus, worker, 9466)
    # Ray: every port between Ray nodes (head, workers, gateways: Ray picks most ports at start), nothing else.
    for port in (6379, 10001, 8265, 52365, 12345):
        for ray_node in (gateway, head, worker):
            assert allows(ray_node, head, port) and allows(ray_node, worker, port)
        for other in (stranger, outside, prometheus, internet):
            assert not allows(other, head, port) and not allows(other, worker, port), (other, port)
    assert allows(head, gateway, 23456) and allows(worker, gateway, 23456)  # Ray calls back into the gateway's driver
    # The pools Job: the head's Ray Client port and DNS, nothing else, and nothing reaches it.
    assert allows(pools, head, 10001)
    assert not allows(pools, head, 6379) and not allows(pools, worker, 10001) and not allows(pools, internet, 443)
    assert allows(pools, Endpoint({}, ip="10.96.0.10"), 53)
    assert not allows(gateway, pools, 8080) and not allows(head, pools, 10001)
    # Redis: the gateways and the Ray pods (GCS tables), on 6379 only; Redis itself calls nowhere but DNS.
    assert allows(gateway, redis, 6379) and allows(head, redis, 6379) and allows(worker, redis, 6379)
    assert not allows(stranger, redis, 6379) and not allows(pools, redis, 6379) and not allows(gateway, redis, 6380)
    assert not allows(redis, internet, 443) and allows(redis, Endpoint({}, ip="10.96.0.10"), 53)
    # Egress of gateways and Ray pods stays open by default: models come from the Hugging Face Hub.
    assert allows(head, internet, 443) and allows(gateway, internet, 443)

    assert not find(render(None, "networkPolicy.enabled=false"), "NetworkPolicy")
    embedded = {o["metadata"]["name"] for o in find(render(None, EMBEDDED), "NetworkPolicy")}
    assert embedded == {f"{FULLNAME}-{name}" for name in ("gateway", "ray", "redis")}  # no pools Job


def test_network_policies_can_restrict_clients_and_egress():
    objs = render("secure-tls-values.yaml")
    pods = release_endpoints(objs)
    gateway, head = pods["gateway"], pods["head"]
    allows = functools.partial(network_allows, objs)
    from_gateway_api = Endpoint({"app": "envoy"}, namespace="gateway-system")
    assert allows(from_gateway_api, gateway, 50051) and allows(from_gateway_api, gateway, 8000)
    assert not allows(Endpoint({"app": "client"}, namespace="apps"), gateway, 50051)
    assert allows(Endpoint({}, namespace="monitoring"), head, 9465)
    assert not allows(Endpoint({"app.kubernetes.io/name": "prometheus"}, namespace="other"), head, 9465)
    # restrictEgress: DNS, the release's pods and the extra rules (the API server, a model mirror), nothing else.
    for source in (gateway, head):
        assert allows(source, pods["redis"], 6379) and allows(source, head, 6379)
        assert allows(source, Endpoint({}, ip="172.20.0.10"), 6443)
        assert allows(source, Endpoint({}, ip="10.40.0.9"), 443)
        assert not allows(source, Endpoint({}, ip="203.0.113.7"), 443)
        assert allows(source, Endpoint({}, ip="10.96.0.10"), 53)
    # Without a local Ray node the gateways take no Ray traffic.
    client = render(None, "gateway.joinRayCluster=false", RAY_CLIENT)
    ray_pods = release_endpoints(client)
    assert not network_allows(client, ray_pods["head"], ray_pods["gateway"], 23456)
    assert network_allows(client, ray_pods["gateway"], ray_pods["head"], 10001)
