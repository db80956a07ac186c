"""`python -m jdp.bench gpu --smoke`: the prepared GPU check's code paths, on CPU with tiny
shapes: the test subprocess, both workloads' jdp and minimal loops with the GPU settings
on, the memory plan and the profile's phase split, written as JSON and a table."""

import json
import re
import subprocess
import sys

import pytest

from runs import REPO

pytestmark = pytest.mark.slow


def test_the_smoke_run_measures_every_part_and_writes_json_and_a_table(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jdp.bench", "gpu", "--smoke",
                           f"--out={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.match(r"^gpu: jdp loop / minimal loop examples/s = \d+\.\d{3} \(worst of 2\); "
                    r"figures in \S+gpu_bench\.json$", proc.stdout.strip().splitlines()[-1])
    results = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert results["tests"]["returncode"] == 0 and results["tests"]["counts"]["passed"] > 0
    by_name = {m["workload"]: m for m in results["workloads"]}
    assert sorted(by_name) == ["smoke_lm", "smoke_vit"]
    for measured in by_name.values():
        assert "error" not in measured, measured
        assert measured["settings"], "the 'on' arm put jdp's GPU flags in XLA_FLAGS"
        assert measured["examples_per_s"] > 0 and measured["minimal_examples_per_s"] > 0
        assert measured["planned_bytes"] > 0
        assert measured["phases"]["steps"] >= 1 and measured["phases"]["compute_s"] > 0
    assert by_name["smoke_lm"]["tokens_per_s"] == pytest.approx(
        by_name["smoke_lm"]["examples_per_s"] * 32)
    assert by_name["smoke_vit"]["tokens_per_s"] is None
    table = (tmp_path / "gpu_bench.txt").read_text()
    assert "smoke_vit settings on" in table and "minimal loop" in table


def test_without_xdist_the_tests_run_serially_despite_pyprojects_workers(monkeypatch):
    """The GPU image lacks pytest-xdist: pyproject's `-n 4` must not fail the check."""
    from jdp.bench import gpu

    monkeypatch.setitem(sys.modules, "xdist", None)  # `import xdist` raises ImportError
    result = gpu.run_tests(("tests/test_lint.py",), timeout_s=300)
    assert result["returncode"] == 0, result["tail"]
    assert result["counts"] == {"passed": 1}
    assert "bringing up nodes" not in result["tail"]
