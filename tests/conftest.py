"""Fixtures and markers for every test; helper functions live in helpers.py."""
import pytest
import torch

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped where no CUDA device is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
