"""Atomic checkpoint writes; reading one back to resume."""
import pytest
import torch

from mhla.training.checkpoint import RESUME_KEYS, load_checkpoint, save_atomic
from mhla.weights import WeightsError


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


def test_resuming_takes_a_train_py_checkpoint_and_names_what_a_state_dict_lacks(tmp_path):
    full = save_atomic({key: {} for key in RESUME_KEYS}, tmp_path / "last.pth")
    assert load_checkpoint(full).keys() == set(RESUME_KEYS)
    weights = save_atomic({"model": {"w": torch.ones(3)}, "state": {}}, tmp_path / "weights.pth")
    with pytest.raises(WeightsError) as error:
        load_checkpoint(weights)
    assert str(error.value) == (f"checkpoint {weights} is not a train.py checkpoint to resume from: no 'optimizer', "
                                f"'scheduler', 'scaler', 'ema', 'rng' (weights alone start a fresh run with "
                                f"model.init_from)")
