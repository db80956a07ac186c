"""The code passes the linter configured in pyproject.toml ([tool.ruff]), so a
change that leaves an unused import, an unsorted import block or a
mutable default argument fails here rather than in review."""

import subprocess
import sys

from runs import REPO


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "jdp", "tests", "experiments",
                           "launch"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
