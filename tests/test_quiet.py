"""Nothing a user runs prints warnings that are not about their input."""
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow  # every entry point in a subprocess

ENTRY_POINTS = sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("scripts/*.py"), ROOT / "train.py",
                                                           ROOT / "validate.py"])
PROGRAM = """
import contextlib, io, runpy, sys
import mhla, mhla.analysis, mhla.benchmark, mhla.training.evaluation, models
for path in {paths!r}:
    sys.argv = [path, "--help"]
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        runpy.run_path(path, run_name="__main__")
    assert "usage:" in out.getvalue(), path
"""


def test_imports_and_help_print_no_warnings():
    proc = subprocess.run([sys.executable, "-c", PROGRAM.format(paths=ENTRY_POINTS)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
