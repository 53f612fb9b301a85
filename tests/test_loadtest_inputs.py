"""loadtest/'s inputs: arrival schedules (Poisson and gamma gaps, seeded, sent at once at an infinite rate), the
prompt sets, and the targets it will run against (loopback only unless told otherwise; an unreachable server and bad
arguments fail cleanly)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats

from loadtest.__main__ import main
from loadtest.arrivals import ArrivalProcess, parse_rate
from loadtest.config import RunConfig
from loadtest.prompts import load_set, schedule
from loadtest.target import check_address


def test_poisson_gaps_follow_the_rate() -> None:
    rate, n = 4.0, 20_000
    gaps = ArrivalProcess(rate, seed=7).gaps(n)
    assert abs(gaps.mean() - 1 / rate) < 4 * (1 / rate) / math.sqrt(n)  # 4 standard errors
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01
    # Counts per one-second window of a Poisson process at rate 4 are Poisson(4): chi-square over counts 0..9, 10+.
    times = np.cumsum(gaps)
    counts = np.bincount(times[times < int(times[-1])].astype(int))
    observed = np.bincount(np.minimum(counts, 10), minlength=11)
    expected = np.append(stats.poisson.pmf(np.arange(10), rate), stats.poisson.sf(9, rate)) * counts.size
    assert stats.chisquare(observed, expected).pvalue > 0.01


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_burstiness_keeps_the_mean_and_sets_the_variance(burstiness: float) -> None:
    rate, n = 2.0, 20_000
    gaps = ArrivalProcess(rate, burstiness, seed=3).gaps(n)
    mean, variance = 1 / rate, 1 / (rate**2 * burstiness)  # gamma(shape=b, scale=1/(rate*b))
    assert abs(gaps.mean() - mean) < 4 * math.sqrt(variance / n)
    assert gaps.var() == pytest.approx(variance, rel=0.1)
    assert stats.kstest(gaps, "gamma", args=(burstiness, 0, 1 / (rate * burstiness))).pvalue > 0.01


def test_arrivals_are_seeded_and_infinite_rate_sends_at_once() -> None:
    a, b, c = (ArrivalProcess(3.0, seed=s).offsets(50) for s in (1, 1, 2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a[0] == 0.0 and np.all(np.diff(a) > 0)
    assert np.array_equal(ArrivalProcess(math.inf).offsets(5), np.zeros(5))
    assert parse_rate("inf") == math.inf and parse_rate("0.5") == 0.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_prompt_sets_ship_code_and_chat_in_three_lengths() -> None:
    prompts = load_set("mixed")
    assert {(p.kind, p.length) for p in prompts} == {(k, n) for k in ("code", "chat")
                                                     for n in ("short", "medium", "long")}
    assert len({p.id for p in prompts}) == len(prompts) >= 24
    assert all("prompt" in p.request_input() for p in load_set("code"))
    assert all(p.request_input()["chat"][-1][0] == "user" for p in load_set("chat"))
    order = schedule(prompts, 2 * len(prompts), seed=5)
    assert sorted(p.id for p in order[:len(prompts)]) == sorted(p.id for p in prompts)  # each used once per pass
    assert order == schedule(prompts, 2 * len(prompts), seed=5)


def test_refuses_non_loopback_addresses(tmp_path, capsys) -> None:
    for address in ("127.0.0.1:50051", "127.8.9.10:1", "[::1]:50051", "localhost:50051"):
        assert check_address(address) == address
    for address in ("10.1.2.3:50051", "8.8.8.8:53", "[2001:db8::1]:443"):
        with pytest.raises(ValueError, match="not a loopback address"):
            check_address(address)
        assert check_address(address, allow_remote=True) == address
    with pytest.raises(ValueError, match=r"address: 10\.1\.2\.3 is not a loopback address"):
        RunConfig(address="10.1.2.3:50051", requests=1)  # the library refuses too, not only the CLI
    assert RunConfig(address="10.1.2.3:50051", requests=1, allow_remote=True).load == "rate=inf"
    code = main(["--address", "192.0.2.1:50051", "--requests", "1", "--out", str(tmp_path / "x")])
    assert code == 2 and "error: --address:" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["--address", "127.0.0.1", "--requests", "1", "--out", str(tmp_path)]) == 2


def test_unreachable_server_and_bad_arguments_fail_cleanly(tmp_path, capsys) -> None:
    code = main(["--address", "127.0.0.1:9", "--requests", "1", "--connect-timeout", "0.5", "--out", str(tmp_path)])
    assert code == 1 and "error: --address: no server answered" in capsys.readouterr().err
    code = main(["--backend", "openai", "--url", "http://127.0.0.1:9", "--requests", "1", "--connect-timeout", "0.5",
                 "--out", str(tmp_path)])
    assert code == 1 and "error: --url: no server answered at http://127.0.0.1:9" in capsys.readouterr().err
    assert main(["--address", "127.0.0.1:9", "--requests", "0", "--out", str(tmp_path)]) == 2
    assert "error: --requests:" in capsys.readouterr().err
    with pytest.raises(ValueError, match="either a rate or a concurrency"):
        replace(RunConfig(address="127.0.0.1:1", requests=1), concurrency=2)
