"""Security of the Helm chart's pods: every render meets Pod Security "restricted" (scripts/check_pod_security.py,
itself checked on planted violations), and tandem's containers run as the image's user on a read-only root."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import yaml

from helm_harness import (
    CI_VALUES,
    EMBEDDED,
    RAY_CLIENT,
    ROOT,
    container,
    env_of,
    find,
    gateways,
    one,
    ray_groups,
    render,
    tandem_containers,
)


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
