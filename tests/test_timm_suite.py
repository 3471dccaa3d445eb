"""timm's own model tests (``tests/test_models.py`` of timm's source distribution) on every model we register.

The test file is taken from the source distribution of the installed timm version (downloaded once
from PyPI with pip into ``~/.cache/mhla-tests``, or read from ``$MHLA_TIMM_TESTS``, a folder holding
timm's ``test_models.py``). Without a package index these tests are skipped with pip's reason, except under
``CI=true``, where they fail. Two parts:

- The file itself, run by pytest with our models registered: every test it parametrizes with our
  model names (forward, backward, the non-standard default-cfg checks on the ``meta`` device, FX
  forward and backward), except TorchScript, which our custom autograd functions do not support.
- timm selects its ``forward_intermediates`` tests by the module that registers a model (``deit``,
  ``vision_transformer``, ...), so it never picks ours up although they are ``VisionTransformer``
  models; those two test functions of the same file are called here with our model names (all but
  the ``_official`` ones, whose padding makes their feature maps larger than timm's bound).
"""
import importlib.util
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
import timm
from helpers import ROOT

import models  # noqa: F401  (registers the models)

OUR_MODELS = sorted(timm.list_models(module="deit_mhla"))
# The released code's MHLA pads 224 px images to 256 px: its feature maps are 16 x 16 where timm's
# forward_intermediates tests expect at most 224 / 16 + 1 = 15 per side, by design of that model.
UNPADDED = [name for name in OUR_MODELS if not name.endswith("_official")]
FILE_TESTS = ("test_model_forward", "test_model_backward", "test_model_default_cfgs_non_std", "test_model_forward_fx",
              "test_model_backward_fx")
INTERMEDIATES_TESTS = ("test_model_forward_intermediates", "test_model_forward_intermediates_features")


def _download_test_file(version: str, cache: Path) -> Path:
    """timm's ``tests/test_models.py`` of ``version`` from its source distribution on PyPI, cached."""
    target = cache / f"timm-{version}" / "test_models.py"
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                               f"timm=={version}", "-d", tmp], capture_output=True, text=True, timeout=300)
        if proc.returncode:
            reason = (proc.stderr.strip().splitlines() or ["no message"])[-1]
            message = (f"cannot download timm {version}'s source distribution with pip ({reason}); set "
                       f"MHLA_TIMM_TESTS to a folder holding timm's tests/test_models.py")
            if os.environ.get("CI") == "true":  # CI has a package index: there a failed download is a failure
                pytest.fail(message)
            pytest.skip(message)
        (sdist,) = Path(tmp).glob("timm-*.tar.gz")
        with tarfile.open(sdist) as archive:
            member = archive.getmember(f"timm-{version}/tests/test_models.py")
            text = archive.extractfile(member).read()
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".tmp")
        partial.write_bytes(text)
        partial.replace(target)
    return target


@pytest.fixture(scope="module")
def timm_test_file() -> Path:
    folder = os.environ.get("MHLA_TIMM_TESTS")
    if folder:
        return Path(folder) / "test_models.py"
    return _download_test_file(timm.__version__, Path.home() / ".cache" / "mhla-tests")


@pytest.mark.slow  # timm's test file in a subprocess, every model at 224 px
def test_timm_test_file_passes_on_our_models(timm_test_file):
    selection = f"({' or '.join(OUR_MODELS)}) and ({' or '.join(FILE_TESTS)}) and not torchscript"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "models", "-p", "no:cacheprovider", "-W", "ignore",
         "--rootdir", str(timm_test_file.parent), str(timm_test_file), "-k", selection],
        capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:]
    passed = set(re.findall(r"^PASSED \S*::(\w+)\[\d+-(\w+)(?:\.\w+)?\]$", proc.stdout, re.M))
    assert passed == {(test, name) for test in FILE_TESTS for name in OUR_MODELS}, proc.stdout[-3000:]


@pytest.fixture(scope="module")
def timm_tests(timm_test_file, pytestconfig):
    """timm's test file imported here, its own markers (``base``, ``cfg``, ``timeout``, ...) registered first:
    under ``--strict-markers`` an unknown one fails the import."""
    known = {line.split(":")[0].split("(")[0].strip() for line in pytestconfig.getini("markers")}
    for name in sorted(set(re.findall(r"pytest\.mark\.(\w+)", timm_test_file.read_text())) - known - {"parametrize"}):
        pytestconfig.addinivalue_line("markers", f"{name}: a marker of timm's tests/test_models.py")
    spec = importlib.util.spec_from_file_location("timm_test_models", timm_test_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # every model at 224 px
@pytest.mark.parametrize("model_name", UNPADDED)
@pytest.mark.parametrize("test_name", INTERMEDIATES_TESTS)
def test_timm_forward_intermediates_tests_on_our_models(timm_tests, test_name, model_name):
    getattr(timm_tests, test_name)(model_name, 1)


def _failing_pip(monkeypatch):
    def run(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"]
        return subprocess.CompletedProcess(command, 1, "", "WARNING: Retrying\nERROR: No matching distribution found "
                                                             "for timm==1.0.31\n")
    monkeypatch.setattr(subprocess, "run", run)


def test_without_a_package_index_the_timm_tests_are_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    _failing_pip(monkeypatch)
    with pytest.raises(pytest.skip.Exception) as skipped:
        _download_test_file("1.0.31", tmp_path)
    assert str(skipped.value) == ("cannot download timm 1.0.31's source distribution with pip (ERROR: No matching "
                                  "distribution found for timm==1.0.31); set MHLA_TIMM_TESTS to a folder holding "
                                  "timm's tests/test_models.py")
    assert not list(tmp_path.iterdir())


def test_under_ci_a_failed_download_of_the_timm_tests_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    _failing_pip(monkeypatch)
    with pytest.raises(pytest.fail.Exception, match="set MHLA_TIMM_TESTS"):
        _download_test_file("1.0.31", tmp_path)
