"""Shared pools: `tandem pools` on a real Ray cluster (`ray start --head`), separate `tandem gateway` processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("ray")

import grpc
import httpx

from pools_harness import (
    BIN,
    NOT_SERVING,
    PROMPTS,
    SERVING,
    TOKENS,
    Gateway,
    assert_workers_kept,
    at_once,
    expected_fixture,  # noqa: F401 (the expected fixture)
    head_env,
    kill_for_good,
    named_actors,
    pool_status,
    ray_head,
    start_gateways,
    tandem_cli,
    wait_health,
    wait_sequences_released,
)
from tandem.bench.local_cluster import free_port
from tandem.client import TandemClient
from tandem.sessions import EmbeddedRedis


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ray_head(tmp_path_factory.mktemp("ray")) as address:
        yield address


@pytest.fixture(scope="module")
def pools(cluster, tiny_dirs):
    tandem_cli(cluster, "pools", "start", "--name", "t", "--target", str(tiny_dirs.target), "--draft",
            str(tiny_dirs.draft), "--threads", "1", "--dtype", "float32", "--fixed-k", "4",
            "--batch-window-ms", "50")  # tiny forwards take well under a millisecond: a window calls surely share
    yield cluster
    tandem_cli(cluster, "pools", "stop", "--name", "t")


@pytest.fixture(scope="module")
def gateways(pools):
    """Two gateway processes sharing the pools and one Redis (the session store every gateway of a deployment uses)."""
    with EmbeddedRedis() as redis:
        started = start_gateways(pools, redis.url, 2)
        yield started
        for gateway in started:
            if gateway.process.poll() is None:
                gateway.stop()


def test_two_gateways_share_one_pool_and_batch_across_gateways(pools, gateways, expected) -> None:
    # A gateway's first request pays for joining the workers (handles, connections); under load one gateway's whole
    # stream could end before the other's first call arrived, so each serves one alone first.
    for n, gateway in enumerate(gateways):
        assert at_once([(gateway.address, n)])[(0, n)] == expected[n]
    before = {w["name"]: w["merged_forwards"] for w in pool_status(pools)["workers"]}
    # Both gateways' streams at once (the same request id on two gateways is kept apart on the shared workers:
    # test_shared_kv). Calls meeting in one window is up to the scheduler of a loaded machine: up to three bursts.
    for _ in range(3):
        out = at_once([(gateways[0].address, 0), (gateways[1].address, 1)] * 2)
        assert {key: ids for key, ids in out.items()} == {(n, i): expected[i] for n, i in [(0, 0), (1, 1), (2, 0),
                                                                                            (3, 1)]}
        status = pool_status(pools)
        if next(w for w in status["workers"] if w["role"] == "target")["merged_forwards"] > before["target-0"]:
            break
    assert sorted(w["role"] for w in status["workers"]) == ["draft", "target"]
    assert all(w["healthy"] for w in status["workers"]) and {w["threads"] for w in status["workers"]} == {1}
    assert {w["weights"] for w in status["workers"]} == {"float32"}  # a float32 draft is held as loaded
    assert all(w["gc_frozen_objects"] > 0 for w in status["workers"])  # loaded heaps out of later collections
    target = next(w for w in status["workers"] if w["role"] == "target")
    assert target["merged_forwards"] > before["target-0"], "no verify forward served both gateways"
    assert status["rows_per_verify_call"] > 1


def test_worker_actors_are_the_pools_alone(pools, gateways) -> None:
    """Two gateways attached, yet the cluster holds one draft worker and one target replica: the named workers, and
    the CPUs in use (each worker asks for one; the manager and the gateways' drivers for none)."""
    names, cpus_used = named_actors(pools)
    assert names == ["tandem-pools-t", "tandem-pools-t-draft-0", "tandem-pools-t-target-0"]
    assert cpus_used == 2


def test_status_as_text_says_how_each_worker_holds_its_weights(pools) -> None:
    """`tandem pools status` without --json: a line a worker, with how its weights are held (what a draft's
    `--draft-quantization auto` picked shows nowhere else but its log)."""
    lines = tandem_cli(pools, "pools", "status", "--name", "t").splitlines()
    assert lines[0].startswith("pools t: target "), lines
    for role in ("draft", "target"):
        line = next(line for line in lines if line.split()[:2] == [role, f"{role}-0"])
        assert " healthy  float32  threads 1  " in line, line


def test_each_worker_serves_its_metrics_as_documented(pools, gateways) -> None:
    """`pools start` workers served no /metrics unless $TANDEM_WORKER_METRICS_PORT was set on the Ray nodes; the
    docs say each serves one from 9465 (`--worker-metrics-port`)."""
    workers = pool_status(pools)["workers"]
    assert {w["name"] for w in workers} == {"draft-0", "target-0"}
    for worker in workers:
        url = worker["metrics"]
        assert url is not None and url.startswith("http://") and int(url.rsplit(":", 1)[1].split("/")[0]) >= 9465
        text = httpx.get(url, timeout=10, trust_env=False).text
        assert f'tandem_worker_role="{worker["role"]}"' in text and "tandem_worker_kv_tokens{" in text, text[:2000]


# `tandem` in a fresh interpreter that writes, at exit, the top-level packages it imported to $IMPORTS_FILE.
REPORT_IMPORTS = """
import atexit, json, os, sys
from tandem.cli.main import main

atexit.register(lambda: open(os.environ["IMPORTS_FILE"], "w").write(json.dumps(sorted(
    {name.split(".")[0] for name in sys.modules}))))
sys.exit(main(sys.argv[1:]))
"""


def test_commands_that_only_ask_the_manager_import_no_model_stack(pools, tmp_path) -> None:
    """status and scale (as stop) ask the pool's manager and nothing else: they join Ray and get the manager's handle
    without importing torch or transformers, which took most of each call's ten seconds here."""
    out, imports = {}, tmp_path / "imports.json"
    for command in (["status", "--name", "t", "--json"], ["scale", "--name", "t", "draft", "1"]):
        done = subprocess.run([sys.executable, "-c", REPORT_IMPORTS, "pools", *command],
                              env=head_env(pools) | {"IMPORTS_FILE": str(imports)}, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert {"torch", "transformers"} & set(json.loads(imports.read_text())) == set(), command
        out[command[0]] = json.loads(done.stdout)
    assert sorted(w["name"] for w in out["status"]["workers"]) == ["draft-0", "target-0"]
    assert out["scale"]["workers"] == {"draft": ["draft-0"], "target": ["target-0"]}


def test_a_refusal_from_the_manager_is_its_message_alone(pools) -> None:
    """The manager actor refuses a count: the error reaches the CLI as Ray's subclass of it, whose text is the
    remote traceback; the CLI prints the refusal's message, one line."""
    done = subprocess.run([str(BIN / "tandem"), "pools", "scale", "--name", "t", "target", "0"], env=head_env(pools),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "\x1b" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == "error: count: a pool keeps at least one target worker, got 0"


# The interpreter of a `tandem[gateway]` install, which has no torch at all: `.ci/run` makes one and names it here.
GATEWAY_PYTHON = os.environ.get("TANDEM_GATEWAY_PYTHON", sys.executable)


def test_a_gateway_takes_the_tokenizer_from_the_pools_and_imports_no_torch(pools, tiny_models, tmp_path) -> None:
    """A gateway tokenizes with the target worker's tokenizer (it needs no model files: a gateway pod pulled the
    whole target for it before) and never imports torch: not to start, nor to pass sampled drafts' distributions
    from the draft worker to the target (numpy arrays, core.protocol.DraftDist). In CI it runs from the gateway
    install (GATEWAY_PYTHON), where torch could not be imported (and transformers' advice that models then cannot
    load is no news to put in the gateway's log)."""
    imports, http, log = tmp_path / "imports.json", f"http://127.0.0.1:{free_port()}", tmp_path / "gateway.log"
    with EmbeddedRedis() as redis:
        gateway = Gateway(pools, redis.url, "--http-port", http.rsplit(":", 1)[1], log=log,
                          program=(GATEWAY_PYTHON, "-c", REPORT_IMPORTS), env={"IMPORTS_FILE": str(imports)})
        try:
            with TandemClient(gateway.address, timeout=120) as client:
                text = "the quick brown fox"
                assert client.tokenize(text) == tiny_models[0].tokenizer.encode(text)
                for options in ({"temperature": 0.0}, {"temperature": 0.8}, {"temperature": 0.8, "seed": 7}):
                    result = client.generate_result(text, max_tokens=12, ignore_eos=True, **options).choices[0]
                    assert len(result.token_ids) == 12, options
                    assert result.speculation.drafted_tokens > 0, options  # fixed k: every round drafts
            model = httpx.get(f"{http}/v1/models", timeout=30).json()["data"][0]["id"]
            chat = httpx.post(f"{http}/v1/chat/completions", timeout=120, json={
                "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0.9})
            assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] > 0, chat.text
        finally:
            gateway.stop()
    assert gateway.process.returncode == 0
    imported = json.loads(imports.read_text())
    assert "torch" not in imported and "ray" in imported and "transformers" in imported
    assert "PyTorch was not found" not in log.read_text() and "Traceback" not in log.read_text()


def test_scaling_under_load_fails_nothing(pools, gateways, expected) -> None:
    rounds: list[dict] = []
    scaled = threading.Event()
    jobs = [(gateways[n % 2].address, n % len(PROMPTS)) for n in range(8)]

    def load() -> None:
        while not scaled.is_set() or not rounds:
            rounds.append(at_once(jobs))

    runner = threading.Thread(target=load)
    runner.start()
    for role, count in (("draft", "2"), ("target", "2"), ("target", "1"), ("draft", "1")):
        tandem_cli(pools, "pools", "scale", "--name", "t", role, count)
    time.sleep(3)  # gateways follow the membership every 2 s
    scaled.set()
    runner.join(timeout=300)
    assert all(len(out) == 8 for out in rounds), [len(out) for out in rounds]
    assert all(ids == expected[i] for out in rounds for (_, i), ids in out.items())
    names = sorted(w["name"] for w in pool_status(pools)["workers"])
    assert names == ["draft-0", "target-0"]


def test_a_sessions_next_turn_through_another_gateway_reuses_the_pools_cache(pools, gateways) -> None:
    def turn(gateway: Gateway, prompt: list[int]) -> list[int]:
        with TandemClient(gateway.address, timeout=120) as client:
            return [t for item in client.generate(token_ids=prompt, temperature=0.0, max_tokens=8, ignore_eos=True,
                                                  session_id="chat-1") for t in getattr(item, "token_ids", [])]

    def reused() -> int:
        return sum(w["reused_tokens"] for w in pool_status(pools)["workers"] if w["role"] == "target")

    first = PROMPTS[2] * 4
    answer = turn(gateways[0], first)
    before = reused()
    turn(gateways[1], first + answer + [9, 10, 11])
    assert reused() - before >= len(first), "the second turn should start from the first turn's cached tokens"


def test_a_gateway_killed_leaves_the_workers_and_the_other_gateway_serving(pools, gateways, expected) -> None:
    pids = {w["name"]: w["pid"] for w in pool_status(pools)["workers"]}
    out: dict = {}
    killed: dict = {}
    runners = [threading.Thread(target=lambda: out.update(at_once([(gateways[1].address, i) for i in range(4)]))),
               threading.Thread(target=lambda: killed.update(at_once([(gateways[0].address, i) for i in range(4)],
                                                                     tokens=400, ids="k")))]
    for runner in runners:
        runner.start()
    time.sleep(0.5)
    gateways[0].stop(signal.SIGKILL)  # its streams end (the client sees the connection drop)
    for runner in runners:
        runner.join(timeout=300)
    assert [out[(i, i)] for i in range(4)] == expected
    assert all(isinstance(result, grpc.RpcError) for result in killed.values()), killed
    assert_workers_kept(pools, pids)
    # The killed gateway never released its sequences: the workers do, once the GCS marks its job dead.
    wait_sequences_released(pools, 60)


def test_a_gateway_with_two_engine_lanes_stays_exact_on_the_shared_pools(pools, expected) -> None:
    with EmbeddedRedis() as redis:
        gateway = Gateway(pools, redis.url, "--lanes", "2", "--max-batch", "2")  # a lane takes requests past 2
        try:
            out = at_once([(gateway.address, i) for i in range(len(PROMPTS))] * 2)
        finally:
            gateway.stop()
    assert len(out) == 2 * len(PROMPTS)
    assert all(ids == expected[i] for (_, i), ids in out.items())


def test_predicted_outputs_draft_on_the_shared_pools(pools, gateways, tiny_models, expected) -> None:
    """A prediction's drafts reach the target replica as a draft worker's do (an unseeded sampled row's with its
    one-hot q): greedy output stays plain decoding's; a fixed k (the pools' --fixed-k 4) drafts what is offered."""
    tokenizer = tiny_models[0].tokenizer
    live = next(gateway for gateway in gateways if gateway.process.poll() is None)  # one was killed above
    with TandemClient(live.address, timeout=120) as client:
        greedy = client.generate_result(token_ids=PROMPTS[0], temperature=0.0, max_tokens=TOKENS, ignore_eos=True,
                                        prediction=tokenizer.decode(expected[0]))
        sampled = client.generate_result(token_ids=PROMPTS[1], temperature=0.9, max_tokens=TOKENS, ignore_eos=True,
                                         prediction=tokenizer.decode(expected[1]))
    assert greedy.token_ids == expected[0] and greedy.speculation.predicted_rounds > 0
    assert greedy.speculation.drafted_tokens == 0  # the draft workers are not asked for a predicted row
    assert len(sampled.token_ids) == TOKENS and sampled.speculation.predicted_rounds > 0


def test_a_gateway_refuses_pools_of_another_image() -> None:
    from tandem.engines.shared_pools import check_image
    from tandem.errors import TandemError

    check_image("t", "", "repo/tandem:2")  # pools started without an image: nothing to compare
    check_image("t", "repo/tandem:2", "repo/tandem:2")
    with pytest.raises(TandemError, match=r"repo/tandem:2 but pools 't' run repo/tandem:1"):
        check_image("t", "repo/tandem:1", "repo/tandem:2")


def test_a_restarted_manager_adopts_its_workers_and_gateways_keep_serving(pools, gateways, expected) -> None:
    before = pool_status(pools)
    os.kill(before["manager_pid"], signal.SIGKILL)  # Ray restarts it (its node, or the head, went away)
    deadline = time.monotonic() + 120
    while True:
        try:
            after = pool_status(pools)
            if after["manager_pid"] != before["manager_pid"]:
                break
        except AssertionError:
            pass  # still restarting
        assert time.monotonic() < deadline, "the manager did not come back"
        time.sleep(0.5)
    assert [(w["name"], w["pid"]) for w in after["workers"]] == [(w["name"], w["pid"]) for w in before["workers"]]
    tandem_cli(pools, "pools", "scale", "--name", "t", "draft", "2")  # it still manages them: scaling goes on
    time.sleep(3)
    gateway = next(g for g in gateways if g.process.poll() is None)
    out = at_once([(gateway.address, i) for i in range(len(PROMPTS))])
    assert [out[(i, i)] for i in range(len(PROMPTS))] == expected
    tandem_cli(pools, "pools", "scale", "--name", "t", "draft", "1")


def test_pool_commands_need_a_cluster_and_refuse_duplicates_and_models_that_fail_their_checks(
        pools, tiny_dirs, changed_model) -> None:
    done = subprocess.run([str(BIN / "tandem"), "pools", "status"], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in head_env(pools).items() if k != "RAY_ADDRESS"})
    assert done.returncode == 2 and "--ray-address" in done.stderr
    done = subprocess.run([str(BIN / "tandem"), "pools", "start", "--name", "t", "--target", str(tiny_dirs.target),
                           "--no-spec"], env=head_env(pools), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "already running" in done.stderr
    # A model changed after its pull: the worker that loads it refuses it, and the command says why in one line.
    done = subprocess.run([str(BIN / "tandem"), "pools", "start", "--name", "changed", "--target",
                           str(changed_model.path), "--no-spec"], env=head_env(pools), capture_output=True, text=True,
                          timeout=180)
    error = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and error.startswith("error: a target worker on ")
    assert changed_model.refusal in error and "Traceback" not in done.stderr
    assert not [name for name in named_actors(pools)[0] if "changed" in name]  # nor its manager nor a worker left
    done = subprocess.run([str(BIN / "tandem"), "gateway", "--pools", "nope", "--port", "0"], env=head_env(pools),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no pools named 'nope'" in done.stderr + done.stdout


def test_a_dead_target_replica_moves_its_sessions_and_none_left_is_unavailable_until_one_is_back(pools, gateways,
                                                                                                  expected) -> None:
    """Last in this module: it kills the pools' target replicas for good."""
    gateway = next(g for g in gateways if g.process.poll() is None)
    tandem_cli(pools, "pools", "scale", "--name", "t", "target", "2")
    time.sleep(3)  # gateways follow the membership every 2 s
    first, second = (w["name"] for w in pool_status(pools)["workers"] if w["role"] == "target")
    out: dict = {}
    jobs = [(gateway.address, i) for i in range(len(PROMPTS))] * 2
    runner = threading.Thread(target=lambda: out.update(at_once(jobs)))
    runner.start()
    time.sleep(0.3)
    kill_for_good(pools, f"tandem-pools-t-{first}")
    runner.join(timeout=300)
    assert len(out) == len(jobs), "a replica's death must not fail its sessions while another replica is left"
    assert all(ids == expected[i] for (_, i), ids in out.items())
    deadline = time.monotonic() + 30  # the manager drops a worker that died for good within seconds
    while [w["name"] for w in pool_status(pools)["workers"] if w["role"] == "target"] != [second]:
        assert time.monotonic() < deadline, pool_status(pools)
        time.sleep(0.5)

    kill_for_good(pools, f"tandem-pools-t-{second}")
    wait_health(gateway.address, NOT_SERVING, 30)  # before any request finds it: the idle gateway probes them
    with TandemClient(gateway.address, timeout=60) as client, pytest.raises(grpc.RpcError) as failed:
        list(client.generate(token_ids=PROMPTS[0], temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
    # A new replica, whether or not the manager's periodic prune has seen the last one die yet.
    scaled = json.loads(tandem_cli(pools, "pools", "scale", "--name", "t", "target", "1"))
    assert len(scaled["workers"]["target"]) == 1 and scaled["workers"]["target"][0] not in (first, second), scaled
    wait_health(gateway.address, SERVING, 300)  # a new replica loads its model: minutes on a loaded CI host
    out = at_once([(gateway.address, 0)])
    assert out[(0, 0)] == expected[0]
