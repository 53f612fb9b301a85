"""How the Helm chart routes clients to its gateways: canary and gateway arms, the GRPCRoute and HTTPRoute that split
traffic between the arms' Services by weight, and the OpenAI HTTP API served beside gRPC (or turned off)."""

from __future__ import annotations

import json

import pytest
import yaml

from helm_harness import (
    CHART,
    EMBEDDED,
    FULLNAME,
    container,
    env_of,
    find,
    flags,
    gateway_container,
    gateways,
    one,
    render,
    selects,
    service_ports,
)


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
        assert flags(gateway["args"])["http-keep-alive"] == "620"  # above Google Cloud's load balancers' 600 s
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
                   "gateway.http.keepAliveSeconds=90",
                   "gateway.http.allowedOrigins={https://app.example.com,http://localhost:3000}")
    for deployment in gateways(moved):
        gateway = gateway_container(deployment)
        assert flags(gateway["args"])["http-port"] == "8080" and flags(gateway["args"])["response-ttl"] == "0"
        assert flags(gateway["args"])["allowed-origins"] == "https://app.example.com,http://localhost:3000"
        assert flags(gateway["args"])["http-keep-alive"] == "90"
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
