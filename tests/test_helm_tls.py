"""The Helm chart's gateway TLS: the Secret mounted and the probes moved to HTTPS, and mutual TLS from a cert-manager
Certificate with a readiness probe that presents the gateway's own certificate."""

from __future__ import annotations

import pytest

from helm_harness import (
    EMBEDDED,
    FULLNAME,
    container,
    find,
    flags,
    gateway_container,
    gateways,
    one,
    render,
    serves_tls,
    service_ports,
)


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
