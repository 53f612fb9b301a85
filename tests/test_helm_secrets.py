"""The Helm chart's Secrets and Ray's access: the Redis password, the canary key and the Ray token come from Secrets
(generated or the user's) to every consumer, and Ray's dashboard listens on the head's loopback only."""

from __future__ import annotations

import base64
import json
import re

import pytest

from helm_harness import (
    CI_VALUES,
    EMBEDDED,
    FULLNAME,
    RAY_CLIENT,
    container,
    env_of,
    find,
    gateway_container,
    gateways,
    one,
    ray_groups,
    render,
    secret_refs,
    tandem_containers,
)


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
