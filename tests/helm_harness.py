"""What the tests of the Helm chart helm/tandem (tests/test_helm_*.py) share: helm, `helm template` renders (cached),
and readers of the rendered objects. Those tests cover helm lint and helm template with every ci/ values file,
Kubernetes schema validation of what they render, assertions on how the rendered objects fit together (both
topologies: shared pools with `tandem gateway --pools`, and embedded `tandem serve` gateways), and the pools Job's
reconcile script run against a stub `tandem`.

Needs helm: $TANDEM_HELM, else .venv/bin/helm (scripts/install_helm.sh puts it there), else helm on PATH.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "tandem"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RELEASE = "demo"
FULLNAME = "demo-tandem"
RAY_CLIENT = f"ray.address=ray://{FULLNAME}-ray-head-svc:10001"  # a gateway with no Ray node of its own
EMBEDDED = "topology=embedded"
# kubernetes-validate has schemas for core kinds only. These CRD kinds are checked by the test_helm_* modules'
# assertions and test_helm_crds.py (test_helm_validation.py validates the RayCluster's pod templates as Pods); any
# other kind must validate.
CRD_KINDS = {("ray.io/v1", "RayCluster"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
             ("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
             ("gateway.networking.k8s.io/v1", "GRPCRoute"), ("gateway.networking.k8s.io/v1", "HTTPRoute"),
             ("cert-manager.io/v1", "Certificate")}


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


def serves_tls(gateway: dict) -> bool:
    return any(arg.startswith("--tls-cert=") for arg in gateway["args"])


def service_ports(service: dict) -> dict[str, dict]:
    return {p["name"]: p for p in service["spec"]["ports"]}


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


def values_ids(path: Path) -> str:
    return path.stem


@pytest.fixture(params=CI_VALUES, ids=values_ids, name="ci_values")
def ci_values_fixture(request) -> str:
    """Each ci/ values file's name. A module whose tests take `ci_values` imports this (by this name, so that it is
    not shadowed by their argument)."""
    return request.param.name
