"""The Helm chart helm/tandem as helm and Kubernetes see it: helm lint --strict with every ci/ values file, every object
they render validated against Kubernetes' schemas (the RayCluster's pod templates as Pods), bad values refused by
the chart's checks and its values schema, and deploy/manifests/tandem.yaml kept a fresh render."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml
from kubernetes_validate import utils as kv

from helm_harness import (
    CHART,
    CI_VALUES,
    CRD_KINDS,
    EMBEDDED,
    RELEASE,
    ROOT,
    ci_values_fixture,  # noqa: F401 (the ci_values fixture)
    find,
    flags,
    gateway_container,
    helm,
    helm_binary,
    one,
    ray_groups,
    render,
    secret_refs,
    values_args,
)

K8S_VERSIONS = ("1.27.0", kv.latest_version())  # the chart's kubeVersion floor, and the newest schemas known


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
