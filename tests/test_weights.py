"""``mhla.weights``: one reader of checkpoint files for validate.py, model.init_from, resuming and the converters."""
import argparse
import re
import warnings

import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed

import models  # noqa: F401  (registers the models)
import validate
from mhla.training.evaluation import load_weights
from mhla.training.finetune import load_init_weights, read_state_dict
from mhla.weights import WeightsError, read_checkpoint, resample_pos_embed, unwrap_state_dict

TINY = dict(embed_dim=24, depth=1, num_heads=2, patch_size=8, block_grid=[2, 2])  # 4 x 4 tokens at 32 px


class Unlisted:
    """A class that no checkpoint may unpickle."""


def tiny_model(img_size: int = 32) -> torch.nn.Module:
    return timm.create_model("deit_tiny_mhla", img_size=img_size, num_classes=3, **TINY)


@pytest.fixture(scope="module")
def weights():
    """A tiny model's weights moved off their initialisation, and EMA weights that differ from them."""
    torch.manual_seed(0)
    state = {k: v + 0.1 * torch.randn_like(v) for k, v in tiny_model().state_dict().items()}
    return state, {k: v + 1 for k, v in state.items()}


def layouts(state, ema) -> dict[str, dict]:
    """Each writer's layout (see ``mhla.weights``), with the prefixes DDP and torch.compile add."""
    return {
        "train.py": {"model": state, "ema": {f"module.{k}": v for k, v in ema.items()}, "state": {"epoch": 3}},
        "timm": {"state_dict": {f"module.{k}": v for k, v in state.items()}, "state_dict_ema": ema, "epoch": 3,
                 "args": argparse.Namespace(model="deit_tiny_mhla", lr=1e-3, model_kwargs={"depth": 1})},
        "deit": {"model": {f"_orig_mod.{k}": v for k, v in state.items()}, "model_ema": ema},
        "plain": state,
    }


def assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


@pytest.mark.parametrize("layout", ["train.py", "timm", "deit", "plain"])
def test_every_layout_gives_its_model_and_ema_weights_without_prefixes(weights, tmp_path, layout):
    state, ema = weights
    path = tmp_path / f"{layout}.pth"
    torch.save(layouts(state, ema)[layout], path)
    checkpoint = read_checkpoint(path)
    assert_same(unwrap_state_dict(checkpoint), state)
    if layout == "plain":
        with pytest.raises(WeightsError, match=f"^--ema: checkpoint {re.escape(str(path))} is a plain state dict "
                                               f"without EMA weights$"):
            unwrap_state_dict(checkpoint, use_ema=True, path=path)
    else:
        assert_same(unwrap_state_dict(checkpoint, use_ema=True), ema)


@pytest.mark.parametrize("layout", ["train.py", "timm", "deit", "plain"])
def test_validate_and_init_from_read_a_file_alike(weights, tmp_path, layout):
    """The same file, at another resolution: the same state from validate.py's reader and from model.init_from's,
    and the same model after either has loaded it (positions resampled alike)."""
    state, ema = weights
    path = tmp_path / f"{layout}.pth"
    torch.save(layouts(state, ema)[layout], path)
    args = ["--checkpoint", str(path), "--model", "deit_tiny_mhla", "--dataset", "mnist5k", "--img-size", "48"]
    validated, spec = validate.resolve(validate.parse_args(args))
    assert spec["img_size"] == 48
    assert_same(validated, read_state_dict(path))
    evaluated, started = tiny_model(48), tiny_model(48)
    load_weights(evaluated, validated, path)
    assert load_init_weights(started, path)[1] == "pos_embed resampled from 4x4 to 6x6 positions (bicubic)"
    assert_same(evaluated.state_dict(), started.state_dict())
    expected = resample_abs_pos_embed(state["pos_embed"], new_size=[6, 6], num_prefix_tokens=0)
    assert torch.equal(evaluated.pos_embed, expected)


def test_wrong_or_missing_weights_are_one_line_errors_naming_the_file(weights, tmp_path):
    state, ema = weights
    path = tmp_path / "c.pth"
    where = re.escape(f"checkpoint {path}")
    cases = [
        ({"model": state, "ema": None}, dict(use_ema=True),
         f"^--ema: {where} holds no EMA weights \\(no 'state_dict_ema', 'ema', 'model_ema'; trained without "
         f"EMA\\?\\)$"),
        ({"state_dict_ema": ema, "epoch": 3}, dict(ema_option="--ema"),
         f"^{where} holds only EMA weights \\('state_dict_ema'\\), no 'state_dict' or 'model': --ema reads them$"),
        ({"state_dict_ema": ema}, dict(ema_option=None),
         f"^{where} holds only EMA weights \\('state_dict_ema'\\), no 'state_dict' or 'model'$"),
        ({"model": {"epoch": 3}}, {}, f"^{where} holds no state dict of tensors \\(looked under 'state_dict', 'model' "
                                      f"and at the top level\\)$"),
    ]
    for checkpoint, options, match in cases:
        with pytest.raises(WeightsError, match=match):
            unwrap_state_dict(checkpoint, path=path, **options)


def test_the_saver_args_are_allowed_and_no_other_class(tmp_path):
    args = argparse.Namespace(model="deit_tiny_pla_1d_v6_6", lr=1e-3, model_kwargs={"piece_size": 4}, input_size=None)
    saved = tmp_path / "last.pth.tar"
    torch.save({"state_dict": {"w": torch.ones(2)}, "args": args, "epoch": 1}, saved)
    assert read_checkpoint(saved)["args"] == args
    unsafe = tmp_path / "unsafe.pth.tar"
    torch.save({"state_dict": {"w": torch.ones(2)}, "args": args, "extra": Unlisted()}, unsafe)
    with pytest.raises(WeightsError) as error:
        read_checkpoint(unsafe)
    assert str(error.value) == (f"checkpoint {unsafe} cannot be read (it holds a pickled object of type "
                                f"{Unlisted.__module__}.Unlisted that is not allowed: a checkpoint holds tensors, "
                                f"plain Python types and argparse.Namespace)")


def test_an_unreadable_file_is_one_plain_line(tmp_path):
    truncated, garbage, tensor = tmp_path / "truncated.pth", tmp_path / "garbage.pth", tmp_path / "tensor.pth"
    torch.save({"w": torch.ones(1000)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:500])
    garbage.write_bytes(b"not a checkpoint")
    torch.save(torch.ones(3), tensor)
    protocol_103 = tmp_path / "protocol_103.pth"
    protocol_103.write_bytes(b"\x80garbage")  # a pickle protocol torch warns about, then refuses
    for path in (truncated, garbage, protocol_103):
        with warnings.catch_warnings(record=True) as warned, pytest.raises(WeightsError) as error:
            warnings.simplefilter("always")
            read_checkpoint(path)
        assert not warned, [str(w.message) for w in warned]  # a warning beside the one line would be a second message
        message = str(error.value)
        assert message.startswith(f"checkpoint {path} cannot be read (") and message.endswith(")"), message
        assert "\n" not in message and "\x1b" not in message and "weights_only=False" not in message, message
    with pytest.raises(WeightsError, match=f"^checkpoint {re.escape(str(garbage))} cannot be read \\(UnpicklingError: "
                                           f"Unsupported operand"):
        read_checkpoint(garbage)
    with pytest.raises(WeightsError, match=f"^checkpoint {re.escape(str(tensor))} holds a Tensor, not a dict of "
                                           f"weights$"):
        read_checkpoint(tensor)
    with pytest.raises(WeightsError, match=f"^checkpoint {re.escape(str(tmp_path / 'nope.pth'))} does not exist$"):
        read_checkpoint(tmp_path / "nope.pth")


def test_positions_are_resampled_to_the_model_grid_as_timm_does():
    pos_embed = torch.randn(1, 1 + 16, 8)  # a class token and a 4 x 4 grid
    with torch.device("meta"):
        ours = tiny_model(48)  # no class token, 6 x 6 tokens
        classy = timm.create_model("deit_tiny_patch16_224", img_size=96, patch_size=16, embed_dim=8, depth=1,
                                   num_heads=2)  # a class token, 6 x 6 tokens
    resampled, grid = resample_pos_embed(pos_embed, ours, source_prefix_tokens=1)
    assert grid == (4, 4) and torch.equal(resampled, resample_abs_pos_embed(pos_embed[:, 1:], [6, 6], [4, 4], 0))
    kept, _ = resample_pos_embed(pos_embed, classy)
    assert torch.equal(kept, resample_abs_pos_embed(pos_embed, [6, 6], [4, 4], num_prefix_tokens=1))
    fitting = torch.randn(1, 36, 8)
    same, grid = resample_pos_embed(fitting, ours)
    assert same is fitting and grid == (6, 6)
    with pytest.raises(WeightsError, match="^pos_embed: the checkpoint's 17 patch positions are not a square grid$"):
        resample_pos_embed(pos_embed, ours)
