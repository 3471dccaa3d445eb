"""Fixtures and markers for every test; helper functions live in helpers.py."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors in Triton's interpreter; read at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def restore_dynamo_limits():
    """Dynamo's recompile limits as they were before the test, restored by value (``config.patch``).

    Not ``monkeypatch.setattr`` on ``torch._dynamo.config``: pytest >= 9.2 undoes it with ``delattr``,
    which torch's config module turns into a hidden key, so every later read of it would raise.
    """
    config = torch._dynamo.config
    with config.patch(recompile_limit=config.recompile_limit,
                      fail_on_recompile_limit_hit=config.fail_on_recompile_limit_hit):
        yield


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped where no CUDA device is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):  # the marker, not a keyword: a test id may say "cuda" and run anywhere
            item.add_marker(skip)
