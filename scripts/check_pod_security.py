#!/usr/bin/env python3
"""Check rendered Kubernetes manifests against the Pod Security Standards' "restricted" profile.

    scripts/check_pod_security.py [FILE ...]        (no FILE, or "-": read stdin)

Reads multi-document YAML (what `helm template` prints) and checks every pod spec in it: Pods, the pod templates of
Deployments, StatefulSets, DaemonSets, ReplicaSets, ReplicationControllers, Jobs and CronJobs, and KubeRay's
RayCluster (the head's and every worker group's template, plus the autoscaler container KubeRay adds to the head pod
with `enableInTreeAutoscaling`, whose securityContext comes from `autoscalerOptions`), also inside RayJob and
RayService. Each violation prints one line naming the object, the pod spec, the container and the rule; the exit
status is 1 when there is any, 2 when the input cannot be read.

Why a checker of our own: the API server enforces these rules only in namespaces labelled
pod-security.kubernetes.io/enforce=restricted, and only on Pods, so a template that breaks them fails at install
time, or (for a RayCluster's pods, which KubeRay creates) only in the operator's events. The rules follow
https://kubernetes.io/docs/concepts/security/pod-security-standards/ (the baseline controls, which restricted
includes, then restricted's own), as of Kubernetes 1.33.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# Baseline "Capabilities": what a container may add at most; restricted narrows it to NET_BIND_SERVICE.
RESTRICTED_ADD_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
# Baseline "Sysctls": the safe set.
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
})
# Baseline "SELinux": the types a pod or container may ask for (unset is fine too).
SELINUX_TYPES = frozenset({"container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
# Restricted "Volume Types".
ALLOWED_VOLUME_SOURCES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                    "persistentVolumeClaim", "projected", "secret"})
SECCOMP_OK = frozenset({"RuntimeDefault", "Localhost"})
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")
WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "ReplicationController", "Job"})


@dataclass(frozen=True, slots=True)
class PodSpec:
    """One pod spec found in a manifest: which object and where in it, its metadata and spec."""
    obj: str          # e.g. "Deployment/demo-gateway"
    where: str        # e.g. "spec.template", or "spec.headGroupSpec.template"
    metadata: dict[str, Any]
    spec: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Violation:
    pod: PodSpec
    container: str | None  # None: the pod spec itself
    rule: str              # the Pod Security Standards control, e.g. "Privilege Escalation"
    detail: str

    def __str__(self) -> str:
        place = f'container "{self.container}"' if self.container else "pod"
        return f"{self.pod.obj} {self.pod.where}: {place}: {self.rule}: {self.detail}"


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _template(obj: str, where: str, template: Any) -> Iterator[PodSpec]:
    template = _dict(template)
    yield PodSpec(obj, where, _dict(template.get("metadata")), _dict(template.get("spec")))


def _ray_cluster(obj: str, where: str, spec: dict[str, Any]) -> Iterator[PodSpec]:
    """A RayCluster spec's pod templates. KubeRay adds an autoscaler container to the head pod when in-tree
    autoscaling is on, with autoscalerOptions' securityContext: checked as part of the head's pod."""
    head = _dict(_dict(spec.get("headGroupSpec")).get("template"))
    head_spec = dict(_dict(head.get("spec")))
    if spec.get("enableInTreeAutoscaling"):
        options = _dict(spec.get("autoscalerOptions"))
        autoscaler = {"name": "autoscaler (KubeRay)", "securityContext": options.get("securityContext")}
        head_spec["containers"] = [*(head_spec.get("containers") or []), autoscaler]
    yield PodSpec(obj, f"{where}.headGroupSpec.template", _dict(head.get("metadata")), head_spec)
    for index, group in enumerate(spec.get("workerGroupSpecs") or []):
        name = _dict(group).get("groupName", index)
        yield from _template(obj, f"{where}.workerGroupSpecs[{name}].template", _dict(group).get("template"))


def pod_specs(doc: Any) -> Iterator[PodSpec]:
    """Every pod spec a manifest object carries (a List's items too)."""
    doc = _dict(doc)
    kind = doc.get("kind")
    if kind == "List":
        for item in doc.get("items") or []:
            yield from pod_specs(item)
        return
    obj = f"{kind}/{_dict(doc.get('metadata')).get('name', '?')}"
    spec = _dict(doc.get("spec"))
    if kind == "Pod":
        yield PodSpec(obj, "spec", _dict(doc.get("metadata")), spec)
    elif kind in WORKLOAD_KINDS:
        yield from _template(obj, "spec.template", spec.get("template"))
    elif kind == "CronJob":
        job = _dict(_dict(spec.get("jobTemplate")).get("spec"))
        yield from _template(obj, "spec.jobTemplate.spec.template", job.get("template"))
    elif kind == "RayCluster":
        yield from _ray_cluster(obj, "spec", spec)
    elif kind == "RayJob":
        yield from _ray_cluster(obj, "spec.rayClusterSpec", _dict(spec.get("rayClusterSpec")))
        if spec.get("submitterPodTemplate"):
            yield from _template(obj, "spec.submitterPodTemplate", spec["submitterPodTemplate"])
    elif kind == "RayService":
        yield from _ray_cluster(obj, "spec.rayClusterConfig", _dict(spec.get("rayClusterConfig")))


def _containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for key in CONTAINER_LISTS:
        for container in spec.get(key) or []:
            yield _dict(container)


def _check_selinux(options: Any) -> str | None:
    options = _dict(options)
    if options.get("type") not in (None, "", *SELINUX_TYPES):
        return f"seLinuxOptions.type {options['type']!r} is not one of {sorted(SELINUX_TYPES)}"
    for field in ("user", "role"):
        if options.get(field):
            return f"seLinuxOptions.{field} must be unset"
    return None


def check_pod(pod: PodSpec) -> list[Violation]:
    """The restricted profile's controls, baseline's included, on one pod spec."""
    found: list[Violation] = []
    spec = pod.spec
    pod_context = _dict(spec.get("securityContext"))
    windows = _dict(spec.get("os")).get("name") == "windows"  # exempt from the Linux-only controls

    def flag(container: str | None, rule: str, detail: str) -> None:
        found.append(Violation(pod, container, rule, detail))

    # Pod-level controls.
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            flag(None, "Host Namespaces", f"{field} must be unset or false")
    if _dict(pod_context.get("windowsOptions")).get("hostProcess"):
        flag(None, "HostProcess", "securityContext.windowsOptions.hostProcess must be unset or false")
    if (problem := _check_selinux(pod_context.get("seLinuxOptions"))) is not None:
        flag(None, "SELinux", problem)
    for sysctl in pod_context.get("sysctls") or []:
        if _dict(sysctl).get("name") not in SAFE_SYSCTLS:
            flag(None, "Sysctls", f"sysctl {_dict(sysctl).get('name')!r} is not in the safe set")
    if _dict(pod_context.get("appArmorProfile")).get("type") not in (None, "RuntimeDefault", "Localhost"):
        flag(None, "AppArmor", "securityContext.appArmorProfile.type must be RuntimeDefault or Localhost")
    for key, value in _dict(pod.metadata.get("annotations")).items():
        if key.startswith(APPARMOR_ANNOTATION) and value != "runtime/default" and not str(value).startswith(
                "localhost/"):
            flag(None, "AppArmor", f"annotation {key}={value!r} must be runtime/default or localhost/*")
    pod_seccomp = _dict(pod_context.get("seccompProfile")).get("type")
    if pod_seccomp == "Unconfined":
        flag(None, "Seccomp", "securityContext.seccompProfile.type must not be Unconfined")
    if pod_context.get("runAsUser") == 0:
        flag(None, "Running as Non-root user", "securityContext.runAsUser must not be 0")
    for volume in spec.get("volumes") or []:
        volume = _dict(volume)
        sources = set(volume) - {"name"}
        if "hostPath" in sources:
            flag(None, "HostPath Volumes", f"volume {volume.get('name')!r} is a hostPath")
        elif disallowed := sorted(sources - ALLOWED_VOLUME_SOURCES):
            flag(None, "Volume Types", f"volume {volume.get('name')!r} is of type {disallowed[0]!r}; allowed: "
                 f"{', '.join(sorted(ALLOWED_VOLUME_SOURCES))}")

    pod_non_root = pod_context.get("runAsNonRoot") is True
    for container in _containers(spec):
        name = str(container.get("name", "?"))
        context = _dict(container.get("securityContext"))
        if context.get("privileged"):
            flag(name, "Privileged Containers", "securityContext.privileged must be unset or false")
        if _dict(context.get("windowsOptions")).get("hostProcess"):
            flag(name, "HostProcess", "securityContext.windowsOptions.hostProcess must be unset or false")
        for port in container.get("ports") or []:
            if _dict(port).get("hostPort"):
                flag(name, "Host Ports", f"hostPort {port['hostPort']} must be unset or 0")
        if (problem := _check_selinux(context.get("seLinuxOptions"))) is not None:
            flag(name, "SELinux", problem)
        if context.get("procMount") not in (None, "Default"):
            flag(name, "/proc Mount Type", f"securityContext.procMount {context['procMount']!r} must be Default")
        if _dict(context.get("appArmorProfile")).get("type") not in (None, "RuntimeDefault", "Localhost"):
            flag(name, "AppArmor", "securityContext.appArmorProfile.type must be RuntimeDefault or Localhost")
        if context.get("runAsUser") == 0:
            flag(name, "Running as Non-root user", "securityContext.runAsUser must not be 0")
        non_root = context.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            flag(name, "Running as Non-root", "runAsNonRoot must be true (on the pod, or on every container)")
        if windows:
            continue
        if context.get("allowPrivilegeEscalation") is not False:
            flag(name, "Privilege Escalation", "securityContext.allowPrivilegeEscalation must be false")
        seccomp = _dict(context.get("seccompProfile")).get("type")
        if seccomp == "Unconfined":
            flag(name, "Seccomp", "securityContext.seccompProfile.type must not be Unconfined")
        elif seccomp is None and pod_seccomp not in SECCOMP_OK:
            flag(name, "Seccomp", "seccompProfile.type must be RuntimeDefault or Localhost (on the pod, or here)")
        capabilities = _dict(context.get("capabilities"))
        if "ALL" not in (capabilities.get("drop") or []):
            flag(name, "Capabilities", "securityContext.capabilities.drop must include ALL")
        added = set(capabilities.get("add") or []) - RESTRICTED_ADD_CAPABILITIES
        if added:
            flag(name, "Capabilities", f"capabilities.add {sorted(added)}: only NET_BIND_SERVICE may be added")
    return found


def check_documents(docs: Iterable[Any]) -> tuple[int, list[Violation]]:
    """(pod specs checked, violations) over manifest objects."""
    checked, found = 0, []
    for doc in docs:
        for pod in pod_specs(doc):
            checked += 1
            found += check_pod(pod)
    return checked, found


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__.strip())
        return 0
    sources = argv or ["-"]
    status = 0
    for source in sources:
        try:
            text = sys.stdin.read() if source == "-" else Path(source).read_text()
            docs = [doc for doc in yaml.safe_load_all(text) if doc]
        except (OSError, yaml.YAMLError) as exc:
            print(f"check_pod_security.py: {source}: cannot read: {exc}", file=sys.stderr)
            return 2
        label = "stdin" if source == "-" else source
        checked, found = check_documents(docs)
        for violation in found:
            print(f"check_pod_security.py: {label}: {violation}", file=sys.stderr)
        if found:
            status = 1
        else:
            print(f"check_pod_security.py: {label}: {checked} pod specs meet the restricted Pod Security Standard")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
