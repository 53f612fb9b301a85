"""The Helm chart's NetworkPolicies, through a small evaluator of what it renders: only the release reaches Ray and
Redis, and clients, scrapers and egress can be narrowed."""

from __future__ import annotations

import dataclasses
import functools
import ipaddress

from helm_harness import (
    EMBEDDED,
    FULLNAME,
    RAY_CLIENT,
    find,
    gateways,
    one,
    ray_groups,
    render,
    selects,
)


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
