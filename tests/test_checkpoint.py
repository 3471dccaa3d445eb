"""Atomic checkpoint writes."""
import pytest
import torch

from mhla.training.checkpoint import save_atomic


def test_save_atomic_writes_and_replaces(tmp_path):
    path = save_atomic({"w": torch.ones(3)}, tmp_path / "sub" / "ckpt.pth")
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    save_atomic({"w": torch.zeros(3)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.zeros(3))


def test_failed_save_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = save_atomic({"w": torch.ones(3)}, tmp_path / "ckpt.pth")
    with pytest.raises((AttributeError, TypeError, RuntimeError)):
        save_atomic({"w": lambda: None}, path)  # cannot be pickled
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pth"]
