"""The chart's custom resources against their projects' CRD schemas (scripts/validate_crds.mjs over the validators
scripts/install_crd_schemas.sh installs): every ServiceMonitor, PodMonitor, PrometheusRule, Certificate, GRPCRoute and
HTTPRoute any CI values file renders, with every optional part turned on; and planted mistakes are refused, so a pass
means something. KubeRay's RayCluster has no packaged schema: test_helm_validation.py validates its pod templates."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from helm_harness import CHART, CI_VALUES, CRD_KINDS, render, values_ids

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / ".venv" / "crd-schemas"
VALIDATOR = ROOT / "scripts" / "validate_crds.mjs"
WITHOUT_SCHEMA = {("ray.io/v1", "RayCluster")}
MONITORING = ("metrics.serviceMonitor.enabled=true", "metrics.prometheusRule.enabled=true")


@functools.cache
def node() -> str:
    found = shutil.which("node")
    if found is None or not (SCHEMAS / "node_modules").is_dir():
        pytest.fail("no node or no CRD schemas: run scripts/install_crd_schemas.sh (.ci/run does)")
    return found


def validate(objects: list[dict]) -> subprocess.CompletedProcess:
    return subprocess.run([node(), str(VALIDATOR), str(SCHEMAS)], input=json.dumps(objects), capture_output=True,
                          text=True, timeout=120)


def custom(objects) -> list[dict]:
    return [o for o in objects if (o["apiVersion"], o["kind"]) in CRD_KINDS - WITHOUT_SCHEMA]


@pytest.mark.parametrize("values", CI_VALUES, ids=values_ids)
def test_custom_resources_validate_against_their_crd_schemas(values: Path) -> None:
    objects = custom(render(values.name, *MONITORING))
    assert {o["kind"] for o in objects} >= {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    result = validate(objects)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(objects)} of {len(objects)} objects valid" in result.stdout


def test_every_custom_kind_but_the_raycluster_is_rendered_somewhere_and_has_a_schema() -> None:
    kinds = {(o["apiVersion"], o["kind"]) for values in CI_VALUES for o in custom(render(values.name))}
    assert kinds == CRD_KINDS - WITHOUT_SCHEMA
    assert (CHART / "templates" / "raycluster.yaml").exists()


def test_planted_mistakes_are_refused() -> None:
    objects = custom(render("secure-tls-values.yaml", *MONITORING)) + custom(render("canary-grpcroute-values.yaml"))
    by_kind = {o["kind"]: o for o in objects}
    rule = json.loads(json.dumps(by_kind["PrometheusRule"]))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"  # a duration Prometheus does not read
    certificate = json.loads(json.dumps(by_kind["Certificate"]))
    del certificate["spec"]["secretName"]  # required
    route = json.loads(json.dumps(by_kind["GRPCRoute"]))
    route["spec"]["rules"][0]["backendRefs"][0]["port"] = "grpc"  # a Service port number, not a name
    monitor = json.loads(json.dumps(by_kind["ServiceMonitor"]))
    monitor["spec"]["endpoints"][0]["scheme"] = "grpc"  # http or https
    result = validate([rule, certificate, route, monitor])
    assert result.returncode == 1
    refused = [line for line in result.stdout.splitlines() if not line.startswith("validate_crds:")]
    assert len(refused) == 4, result.stdout
    for planted, line in zip(("PrometheusRule", "Certificate", "GRPCRoute", "ServiceMonitor"), refused, strict=True):
        assert line.startswith(planted), line
    assert "0 of 4 objects valid" in result.stdout
