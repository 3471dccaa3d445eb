"""Fixtures and markers for every test; helper functions live in helpers.py."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
