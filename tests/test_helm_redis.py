"""The Helm chart's Redis: the bundled StatefulSet or an external one, the REDIS_URL the gateways get, and Ray's GCS
fault tolerance kept on it."""

from __future__ import annotations

import pytest

from helm_harness import (
    EMBEDDED,
    FULLNAME,
    container,
    env_of,
    find,
    gateway_container,
    gateways,
    one,
    ray_groups,
    render,
    selects,
)


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
