"""The Helm chart's RayCluster: its worker groups (pool and image resources, sizes and autoscaling bounds in both
topologies, tensor parallelism, GPUs and the --device they imply, the CPU preload, node placement) and its
Recreate upgrades, which the pools Job waits for."""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml

from helm_harness import (
    CHART,
    EMBEDDED,
    ROOT,
    ci_values_fixture,  # noqa: F401 (the ci_values fixture)
    env_of,
    flags,
    gateway_container,
    gateways,
    image_resource,
    one,
    pools_container,
    ray_groups,
    ray_resources,
    render,
    worker_args,
)


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
