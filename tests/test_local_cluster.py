"""tandem.bench.local_cluster: the Ray heads that the pool benchmarks and tests start on loopback."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from tandem.bench.local_cluster import BIN, start_ray_head


def test_a_head_that_exits_is_tried_again_then_reported_with_its_log(tmp_path) -> None:
    """A head that cannot start (here: a negative CPU count) ends each wait as soon as it exits, is tried again on
    a fresh port, and after the last try the error names the log that says why."""
    if shutil.which("ray", path=str(BIN)) is None:
        pytest.skip("no ray command")
    log = tmp_path / "head.log"
    temp = tempfile.mkdtemp(prefix="t-ray-")  # short: Ray's socket paths under it must stay within 107 bytes
    try:
        with pytest.raises(RuntimeError, match=r"no Ray head started in 2 tries \(see .*head\.log\)"):
            start_ray_head(temp, cpus=-1, log=log, tries=2)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert log.read_text().count("Resource quantities must be nonnegative") == 2
