"""The Helm chart's pools Job (shared-pools topology): what it submits to the Ray head, and its reconcile script run
against a stub `tandem` (start, scale, restart, wait for KubeRay), end to end through a fake Ray Client and a stub
`ray` CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helm_harness import (
    CHART,
    FULLNAME,
    container,
    env_of,
    flags,
    one,
    pools_container,
    pools_job,
    ray_groups,
    render,
)


def test_pools_job_submits_the_reconcile_script_to_the_ray_head():
    objs = render()
    job = pools_job(objs)
    assert job["metadata"]["labels"]["app.kubernetes.io/component"] == "pools"
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] >= 3
    pools = container(pod, "pools")
    env = env_of(pools)
    # The dashboard (job submission) listens on the head's loopback only: the Job reaches the head through the Ray
    # Client port and submits from there (files/submit-on-head.py), so the Ray job, the driver and the pools' manager
    # actor live on the head, not on this pod.
    assert env["RAY_CLIENT_ADDRESS"] == f"ray://{FULLNAME}-ray-head-svc:10001"
    assert env["RAY_DASHBOARD_ADDRESS"] == "http://127.0.0.1:8265"
    head_ports = {p["name"]: p["containerPort"] for p in ray_groups(objs)["head"]["template"]["spec"]["containers"][0]
                  ["ports"]}
    assert head_ports["client"] == 10001 and "dashboard" not in head_ports and 8265 not in head_ports.values()
    assert pools["command"] == ["python3", "/etc/tandem/submit-on-head.py"]
    assert env["RECONCILE_SCRIPT"] == "/etc/tandem/reconcile-pools.sh"
    assert next(e for e in pools["env"] if e["name"] == "POD_NAME")["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.name"}}
    mount = next(m for m in pools["volumeMounts"] if m["mountPath"] == "/etc/tandem")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config = one(objs, "ConfigMap", volume["configMap"]["name"])
    for name in ("reconcile-pools.sh", "submit-on-head.py"):
        assert config["data"][name].strip() == (CHART / "files" / name).read_text().strip()

    args = flags(pools["args"])
    assert not [a for a in pools["args"] if a.startswith("--name")]
    assert args["tp"] == "1"
    assert (args["target"], args["draft"]) == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    assert (args["draft-workers"], args["target-replicas"], args["device"]) == ("2", "1", "cuda")
    assert (args["draft-gpus"], args["target-gpus"]) == ("1", "1")

    scaled = render("pools-autoscaling-values.yaml")
    scaled_args = pools_container(scaled)["args"]
    assert (flags(scaled_args)["draft-workers"], flags(scaled_args)["target-replicas"]) == ("4", "2")
    assert scaled_args[-4:] == ["--kv-tokens", "65536", "--batch-window-ms", "3"]
    assert math.isclose(float(flags(scaled_args)["draft-gpus"]), 0.5)  # two draft workers share a GPU pod


STUB_TANDEM = """#!{python}
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["pools", "status"]:
    status = os.environ.get("STUB_STATUS", "")
    if not status:
        print("tandem: no pools named " + repr(sys.argv[4]), file=sys.stderr)
        sys.exit(1)
    print("Connected to the Ray cluster.")  # stray output before the JSON line is tolerated
    print(status)
"""


def run_reconcile(tmp_path: Path, objs, status: dict | None, head_spec: str | None = None):
    """Run files/reconcile-pools.sh as the Ray job would (env and args from the rendered Job), `tandem` stubbed."""
    pools = pools_container(objs)
    env = env_of(pools)
    stub = tmp_path / "bin" / "tandem"
    stub.parent.mkdir(parents=True)
    stub.write_text(STUB_TANDEM.replace("{python}", sys.executable))
    stub.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    run_env = {"PATH": f"{stub.parent}:{os.environ['PATH']}", "STUB_LOG": str(log),
               "STUB_STATUS": json.dumps(status) if status else "",
               "TANDEM_POOLS": env["TANDEM_POOLS"], "TANDEM_IMAGE": env["TANDEM_IMAGE"],
               "TANDEM_RAY_SPEC_WANT": env["TANDEM_RAY_SPEC_WANT"],
               "TANDEM_RAY_SPEC": env["TANDEM_RAY_SPEC_WANT"] if head_spec is None else head_spec}
    script = one(objs, "ConfigMap", f"{FULLNAME}-pools")["data"]["reconcile-pools.sh"]
    result = subprocess.run(["/bin/sh", "-c", script, "reconcile-pools", *pools["args"]], env=run_env,
                            capture_output=True, text=True, timeout=60)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return result, calls


def pools_status(objs, image: str | None = None, target: str = "qwen2.5-coder-1.5b-instruct",
                 draft: str = "qwen2.5-coder-0.5b-instruct", drafts: int = 2, targets: int = 1, tp: int = 1) -> dict:
    workers = [{"role": "target", "name": f"target-{i}", "healthy": True} for i in range(targets)]
    workers += [{"role": "draft", "name": f"draft-{i}", "healthy": True} for i in range(drafts)]
    status = {"name": FULLNAME, "target": target, "draft": draft, "generation": 0, "workers": workers,
              "rows_per_verify_call": 0.0, "tensor_parallel": tp}
    if image != "":
        status["image"] = image or env_of(pools_container(objs))["TANDEM_IMAGE"]
    return status


STATUS = ["pools", "status", "--name", FULLNAME, "--json"]


def start_call(objs) -> list[str]:
    return ["pools", "start", "--name", FULLNAME, *pools_container(objs)["args"]]


def test_reconcile_starts_missing_pools(tmp_path):
    objs = render()
    result, calls = run_reconcile(tmp_path, objs, None)
    assert result.returncode == 0, result.stderr
    assert calls == [STATUS, start_call(objs)]


def test_reconcile_leaves_pools_of_this_image_and_size_alone(tmp_path):
    objs = render()
    result, calls = run_reconcile(tmp_path, objs, pools_status(objs))
    assert result.returncode == 0, result.stderr
    assert calls == [STATUS]
    assert "up to date" in result.stdout


def test_reconcile_scales_each_pool_to_the_values(tmp_path):
    objs = render("pools-autoscaling-values.yaml")  # 4 draft workers, 2 target replicas
    result, calls = run_reconcile(tmp_path, objs, pools_status(objs, drafts=6, targets=1))
    assert result.returncode == 0, result.stderr
    assert calls == [STATUS, ["pools", "scale", "--name", FULLNAME, "target", "2"],
                     ["pools", "scale", "--name", FULLNAME, "draft", "4"]]


@pytest.mark.parametrize("change", [{"image": "tandem:0.0.9"}, {"image": ""}, {"target": "other-target"},
                                    {"draft": "other-draft"}, {"tp": 2}])
def test_reconcile_restarts_pools_of_another_image_or_models(tmp_path, change):
    objs = render()
    result, calls = run_reconcile(tmp_path, objs, pools_status(objs, **change))
    assert result.returncode == 0, result.stderr
    assert calls == [STATUS, ["pools", "stop", "--name", FULLNAME], start_call(objs)]


def test_reconcile_keeps_tensor_parallel_pools_of_the_values_tp(tmp_path):
    objs = render(None, "pools.tp=2")
    result, calls = run_reconcile(tmp_path, objs, pools_status(objs, tp=2))
    assert result.returncode == 0, result.stderr
    assert calls == [STATUS]


def test_reconcile_without_a_draft_expects_plain_pools(tmp_path):
    objs = render(None, "pools.draftWorkers=0")
    result, calls = run_reconcile(tmp_path, objs, pools_status(objs, draft="", drafts=0))
    assert result.returncode == 0, result.stderr
    assert calls == [STATUS]


def test_reconcile_waits_for_kuberay_to_replace_an_older_head(tmp_path):
    objs = render()
    old_pools = pools_status(objs, image="tandem:0.0.9")
    result, calls = run_reconcile(tmp_path, objs, old_pools, head_spec="0123456789abcdef")
    assert result.returncode == 1 and calls == [], "nothing may be stopped or started on a head about to go"
    assert "KubeRay has not replaced the cluster yet" in result.stderr
    # Without upgradeStrategy Recreate there is no fingerprint to wait for.
    older = render("external-redis-servicemonitor-values.yaml")
    result, calls = run_reconcile(tmp_path / "older", older, None, head_spec="anything")
    assert result.returncode == 0 and calls[-1][:2] == ["pools", "start"]


STUB_RAY = """#!{python}
# `ray job list` answers; `ray job submit ... -- ENTRYPOINT...` runs shlex.join(ENTRYPOINT) in a shell, as Ray's job
# supervisor does on the head, and exits 1 when it fails, as Ray's CLI does.
import json, os, shlex, subprocess, sys
args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps(["ray", *args[:2]]) + "\\n")
if args[:2] == ["job", "list"]:
    sys.exit(0)
assert args[:2] == ["job", "submit"], args
entrypoint = args[args.index("--") + 1:]
env = {**os.environ, "RAY_ADDRESS": "10.0.0.1:6379"}
sys.exit(1 if subprocess.run(shlex.join(entrypoint), shell=True, env=env).returncode else 0)
"""


# A stand-in for the `ray` module that files/submit-on-head.py imports: ray.init as a Ray Client (refused twice, as
# while the head starts), and a remote task that runs right here and records where it asked to be scheduled.
FAKE_RAY_MODULE = """
import json, os
_log = os.environ["STUB_LOG"]
_refusals = [0]
def _write(entry):
    with open(_log, "a") as log:
        log.write(json.dumps(entry) + "\\n")
def init(address=None, **kwargs):
    _write(["ray.init", address])
    if _refusals[0] < 2:
        _refusals[0] += 1
        raise ConnectionError("ray client connection timeout")
def shutdown():
    pass
class _Task:
    def __init__(self, function):
        self.function = function
    def options(self, **options):
        _write(["options", options])
        return self
    def remote(self, *args):
        return self.function(*args)
def remote(function):
    return _Task(function)
def get(value):
    return value
"""


def test_pools_job_command_runs_the_script_through_ray_job_submit(tmp_path):
    """The Job's own command end to end: its env and args, submit-on-head.py and the script from the ConfigMap, a
    fake `ray` module (the Ray Client) and a stub `ray` CLI on the 'head' (here)."""
    objs = render("pools-autoscaling-values.yaml")
    pools = pools_container(objs)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("tandem", STUB_TANDEM), ("ray", STUB_RAY)):
        (bin_dir / name).write_text(text.replace("{python}", sys.executable))
        (bin_dir / name).chmod(0o755)
    module_dir = tmp_path / "module" / "ray"
    module_dir.mkdir(parents=True)
    (module_dir / "__init__.py").write_text(FAKE_RAY_MODULE)
    mount = tmp_path / "etc"
    mount.mkdir()
    config = one(objs, "ConfigMap", f"{FULLNAME}-pools")["data"]
    for name in ("reconcile-pools.sh", "submit-on-head.py"):
        (mount / name).write_text(config[name])
    log = tmp_path / "calls.jsonl"
    env = {k: v for k, v in env_of(pools).items() if v is not None}
    env |= {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(module_dir.parent), "STUB_LOG": str(log),
            "STUB_STATUS": "", "POD_NAME": f"{FULLNAME}-pools-r1-abcde",
            "TANDEM_RAY_SPEC": env_of(pools)["TANDEM_RAY_SPEC_WANT"],
            "RECONCILE_SCRIPT": env["RECONCILE_SCRIPT"].replace("/etc/tandem/", f"{mount}/")}
    script = pools["command"][1].replace("/etc/tandem/", f"{mount}/")
    source = (mount / "submit-on-head.py").read_text()
    for constant in ("RETRY_SECONDS = 5", "FLUSH_SECONDS = 2"):  # no waiting here
        assert constant in source
        source = source.replace(constant, constant.split("=")[0] + "= 0")
    Path(script).write_text(source)
    result = subprocess.run([sys.executable, script, *pools["args"]], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    client = f"ray://{FULLNAME}-ray-head-svc:10001"
    assert calls == [["ray.init", client]] * 3 + [
        ["options", {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}, "max_retries": 0}],
        ["ray", "job", "list"], ["ray", "job", "submit"], STATUS, start_call(objs)]
    assert result.stdout.count(f"waiting for the Ray head at {client}") == 2
    assert f"the Ray job {FULLNAME}-pools-r1-abcde exited with 0" in result.stdout
