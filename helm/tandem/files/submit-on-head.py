"""The pools Job's command: submit files/reconcile-pools.sh as a Ray job, from inside the Ray head.

The head's dashboard, which serves Ray's job submission API (code execution for whoever reaches it), listens on the
head's 127.0.0.1 only. So this pod connects to the head's Ray Client server instead (ray://<head>:10001, with the Ray
token; the only port the chart's NetworkPolicies open to this pod) and runs one zero-CPU task pinned to the head node
(Ray's node:__internal_head__ resource). That task waits for the dashboard on the head's loopback and runs
`ray job submit` there, so the script still runs as a Ray job on the head and the pools' manager actor is placed on
the head, not on this short-lived pod.

    python3 submit-on-head.py <tandem pools start flags, without --name>

env: RAY_CLIENT_ADDRESS     the head's Ray Client server, ray://<head service>:10001
     RAY_DASHBOARD_ADDRESS  the dashboard as the head itself reaches it, http://127.0.0.1:8265
     POD_NAME               the Ray job's submission id (one per attempt of the Job)
     TANDEM_POOLS, TANDEM_IMAGE, TANDEM_RAY_SPEC_WANT   handed to the script (files/reconcile-pools.sh)
     RECONCILE_SCRIPT       the script's path (default /etc/tandem/reconcile-pools.sh)
     RAY_AUTH_MODE, RAY_AUTH_TOKEN                      Ray token authentication
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

import ray

HEAD_RESOURCE = "node:__internal_head__"  # every Ray head advertises it (1 unit); no other node does
RETRY_SECONDS = 5
FLUSH_SECONDS = 2
TAIL_LINES = 40
SCRIPT_ENV = ("TANDEM_POOLS", "TANDEM_IMAGE", "TANDEM_RAY_SPEC_WANT")


def submit_command(dashboard: str, submission_id: str, script: str, flags: list[str]) -> list[str]:
    """`ray job submit` of the script with its environment and flags (Ray joins the entrypoint into one shell line)."""
    env = [f"{name}={os.environ.get(name, '')}" for name in SCRIPT_ENV]
    return ["ray", "job", "submit", "--address", dashboard, "--submission-id", submission_id, "--",
            "env", *env, "/bin/sh", "-c", script, "reconcile-pools", *flags]


def on_head(dashboard: str, command: list[str]) -> tuple[int, list[str]]:
    """Runs on the head: wait for its dashboard, then submit and follow the job. Returns its exit status and last
    lines: Ray forwards a task's output to the client as it comes, but may not flush the end of it before the
    client disconnects, and a failure's reason is in those last lines."""
    while subprocess.run(["ray", "job", "list", "--address", dashboard], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL).returncode != 0:
        print(f"waiting for the Ray dashboard at {dashboard} on the head", flush=True)
        time.sleep(RETRY_SECONDS)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as job:
        for line in job.stdout:
            print(line, end="", flush=True)
            tail.append(line.rstrip("\n"))
    return job.returncode, list(tail)


def connect(address: str) -> None:
    """Attach to the cluster as a Ray Client, waiting while the head (or KubeRay's replacement of it) comes up."""
    attempts = 0
    while True:
        try:
            ray.init(address=address)
            return
        except ConnectionError as exc:
            attempts += 1
            # Ray's client retries a refused token like an unreachable server and ends in the same timeout.
            hint = "" if attempts < 3 else "; if the head is up, check that RAY_AUTH_TOKEN is the cluster's token"
            print(f"waiting for the Ray head at {address}: {exc}{hint}", flush=True)
            ray.shutdown()
            time.sleep(RETRY_SECONDS)


def main(flags: list[str]) -> int:
    with open(os.environ.get("RECONCILE_SCRIPT", "/etc/tandem/reconcile-pools.sh")) as file:
        script = file.read()
    dashboard = os.environ["RAY_DASHBOARD_ADDRESS"]
    command = submit_command(dashboard, os.environ["POD_NAME"], script, flags)
    connect(os.environ["RAY_CLIENT_ADDRESS"])
    # max_retries=0: a failed submission fails this pod, and the Job's backoffLimit retries it with a new id.
    task = ray.remote(on_head).options(num_cpus=0, resources={HEAD_RESOURCE: 0.001}, max_retries=0)
    status, tail = ray.get(task.remote(dashboard, command))
    time.sleep(FLUSH_SECONDS)  # let Ray forward the rest of the task's output before this client goes
    if status != 0:
        print("submit-on-head: the last lines of `ray job submit` on the head:", *tail, sep="\n", flush=True)
    print(f"submit-on-head: the Ray job {os.environ['POD_NAME']} exited with {status}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
