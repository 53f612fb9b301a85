"""`tandem serve --metrics-port / --no-metrics / --worker-metrics-port`, and the endpoint a real serve prints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tandem.cli.main import build_parser
from tandem.cli.serving import gateway_options
from tandem.cli.worker_options import worker_metrics_port
from tandem.client import TandemClient
from tandem.errors import InvalidArgument
from tandem.gateway.server import READINESS_SERVICE, SERVING
from telemetry_helpers import scrape, value

SERVICES = Path(__file__).resolve().parent.parent / "services"


def _options(*flags: str):
    args = build_parser().parse_args(["serve", *flags])
    return gateway_options(args), args


@pytest.mark.parametrize(("flags", "port", "fallback"), [
    ((), 9464, True),
    (("--metrics-port", "0"), 0, False),
    (("--metrics-port", "9999"), 9999, False),
    (("--metrics-port", "-1"), None, False),
    (("--no-metrics",), None, True),
])
def test_metrics_port_flags(flags, port, fallback) -> None:
    options, _ = _options(*flags)
    assert options.metrics_port == port
    if port is not None:
        assert options.metrics_port_fallback is fallback


def test_bad_metrics_ports_are_named_errors(monkeypatch) -> None:
    with pytest.raises(InvalidArgument, match=r"^metrics_port: must be between -1"):
        _options("--metrics-port", "70000")
    monkeypatch.delenv("TANDEM_WORKER_METRICS_PORT", raising=False)
    assert worker_metrics_port(_options()[1]) == 9465
    assert worker_metrics_port(_options("--no-metrics")[1]) == -1
    monkeypatch.setenv("TANDEM_WORKER_METRICS_PORT", "9600")
    assert worker_metrics_port(_options()[1]) == 9600
    assert worker_metrics_port(_options("--worker-metrics-port", "0")[1]) == 0
    with pytest.raises(InvalidArgument, match=r"^worker_metrics_port: "):
        worker_metrics_port(_options("--worker-metrics-port", "-2")[1])


def test_serve_prints_where_metrics_listen_and_traces_to_the_configured_exporter(tiny_dirs) -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(SERVICES), os.environ.get("PYTHONPATH")])),
                        "REDIS_URL": "", "OTEL_TRACES_EXPORTER": "console"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem", "serve", "--in-process", "--target", str(tiny_dirs.target), "--draft",
         str(tiny_dirs.draft), "--port", "0", "--metrics-port", "0", "--dtype", "float32", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []

    def read_until_serving() -> None:
        while (line := proc.stdout.readline()) and len(lines) < 20:
            lines.append(line)
            if "serving" in line:
                return

    try:
        reader = threading.Thread(target=read_until_serving, daemon=True)
        reader.start()
        reader.join(120)
        metrics = [line for line in lines if "Prometheus metrics at http://" in line]
        assert metrics and "serving" in lines[-1], (lines, proc.stderr.read() if proc.poll() is not None else "")
        url = metrics[0].split(" at ")[1].strip()
        address = lines[-1].split(" on ")[1].split()[0]
        with TandemClient(address, timeout=120) as client:
            _generate_when_ready(client)
        families = scrape(url)
        assert value(families, "gen_ai_server_request_duration_seconds_count") == 1
        assert value(families, "tandem_worker_healthy", tandem_worker_role="draft") == 1
        assert any("tracing on, exporting to console" in line for line in lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest = ""
    assert proc.returncode == 0
    assert '"name": "text_completion ' in rest and '"name": "tandem.prefill"' in rest  # flushed on the way out


def _generate_when_ready(client: TandemClient) -> None:
    deadline = time.monotonic() + 120
    while client.health_status(READINESS_SERVICE) != SERVING:
        assert time.monotonic() < deadline, "serve never became ready"
        time.sleep(0.25)
    client.generate_text(prompt="hello", temperature=0.0, max_tokens=8)
