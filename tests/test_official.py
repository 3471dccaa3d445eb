"""The released code's models, reproduced: its checkpoints convert and give its logits.

The fixtures are small models built and run by the released code itself (DAGroup-PKU/MHLA, commit
ccf97b2, timm 1.0.15), every parameter perturbed, one of them trained two steps and saved by timm's
``CheckpointSaver`` as the released training script saves it; ``tests/fixtures/make_official_fixtures.py``
says how they were made. Nothing is fetched here.
"""
import argparse

import pytest
import timm
import torch
import torch.nn.functional as F
from helpers import ROOT, load_script

import models
from models.convert import convert_official, convert_softmax_deit

FIXTURES = ROOT / "tests" / "fixtures"
SIZES = dict(embed_dim=48, num_heads=2, depth=2, mlp_ratio=2.0, patch_size=4, num_classes=10)  # as the fixtures
SAVER_SIZES = dict(SIZES, embed_dim=8, depth=1)  # official_mhla_best.pth.tar
SAVED = FIXTURES / "official_mhla_best.pth.tar"


@pytest.fixture(scope="module")
def official_mhla():
    return torch.load(FIXTURES / "official_mhla.pt", weights_only=True)


@pytest.fixture(scope="module")
def official_linear():
    return torch.load(FIXTURES / "official_linear.pt", weights_only=True)


@pytest.fixture(scope="module")
def saved_logits():
    return torch.load(FIXTURES / "official_mhla_best_logits.pt", weights_only=True)


def mhla_official(**kwargs):
    return timm.create_model("deit_tiny_mhla_official", img_pad_to=64, **SIZES, **kwargs).double().eval()


def logits_of(model, fixture):
    with torch.no_grad():
        return model(fixture["input"])


def test_the_fixtures_come_from_the_released_code(official_mhla, official_linear, saved_logits):
    for fixture in (official_mhla, official_linear, saved_logits):
        assert fixture["source"]["commit"] == "ccf97b2" and fixture["source"]["timm"] == "1.0.15"
    for fixture in (official_mhla, official_linear):
        assert "blocks.1.attn.to_qkv.weight" in fixture["state_dict"]
    assert "blocks.0.attn.piece_attn.conv.weight" in official_mhla["state_dict"]
    assert official_mhla["input"].shape == (2, 3, 56, 56) and official_mhla["logits"].dtype == torch.float64
    with torch.serialization.safe_globals([argparse.Namespace]):
        saved = torch.load(SAVED, weights_only=True)
    assert list(saved) == ["epoch", "arch", "state_dict", "optimizer", "version", "args", "state_dict_ema", "metric"]
    assert isinstance(saved["args"], argparse.Namespace) and saved["args"].model == saved["arch"]
    assert saved["args"].model_ema and saved["version"] == 2 and set(saved["optimizer"]) == {"state", "param_groups"}
    assert "blocks.0.attn.piece_attn.conv.weight" in saved["state_dict"]
    assert saved_logits["input"].shape == (2, 3, 32, 32) and saved_logits["logits"].dtype == torch.float32
    sizes = {p.name: p.stat().st_size for p in FIXTURES.iterdir() if p.is_file() and p.suffix != ".py"}
    assert len(sizes) == 4 and max(sizes.values()) < 1_000_000  # small fixtures, each under 1 MB


def test_a_converted_mhla_checkpoint_gives_the_released_logits(official_mhla):
    model = mhla_official()
    state, report = convert_official(official_mhla, model)
    model.load_state_dict(state, strict=True)
    assert (logits_of(model, official_mhla) - official_mhla["logits"]).abs().max() <= 1e-10
    assert report == {"mixing_out_of_range": []}
    torch.testing.assert_close(model.blocks[0].attn.mixing.weight,
                               official_mhla["state_dict"]["blocks.0.attn.piece_attn.conv.weight"][:, :, 0, 0])


@pytest.mark.parametrize("change", ["input_norm", "padding", "normalizer", "norm_eps"])
def test_every_official_option_is_needed(official_mhla, change):
    """With any one difference set back to our default, the logits leave the equivalence tolerance."""
    state, _ = convert_official(official_mhla, mhla_official())
    options = {"input_norm": dict(input_norm=False), "normalizer": dict(normalizer="paper"),
               "norm_eps": dict(norm_eps=1e-6), "padding": {}}[change]
    model = mhla_official(**options)
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=True)
    x = official_mhla["input"]
    if change == "padding":  # bottom/right instead of centred
        model.img_pad_to = None
        x = F.pad(x, (0, 8, 0, 8))
    with torch.no_grad():
        assert (model(x) - official_mhla["logits"]).abs().max() > 1e-10


def test_a_converted_linear_checkpoint_gives_the_released_logits(official_linear):
    model = timm.create_model("deit_tiny_linear", img_size=56, **SIZES).eval()
    state, _ = convert_official(official_linear, model)
    model.load_state_dict(state, strict=True)
    assert (logits_of(model, official_linear) - official_linear["logits"]).abs().max() <= 1e-5
    lepe = timm.create_model("deit_tiny_linear_lepe", img_size=56, **SIZES)
    with pytest.raises(ValueError, match=r"0 keys without a place \(-\), \d+ missing \(blocks.0.norm1.bias"):
        convert_official(official_linear, lepe)


def test_the_released_baselines_have_the_released_parameter_counts():
    # counted on the released code's registrations (make_official_fixtures.py --param-counts)
    released = {"deit_tiny_mhla_official": 5_793_832, "deit_small_mhla_official": 22_200_424,
                "deit_base_mhla_official": 86_864_104, "deit_small_linear": 22_035_688}
    for name, count in released.items():
        with torch.device("meta"):
            model = timm.create_model(name)
        assert sum(p.numel() for p in model.parameters()) == count, name


def test_prefixes_ema_and_out_of_range_mixing(official_mhla):
    state = {f"module.{k}": v.clone() for k, v in official_mhla["state_dict"].items()}
    state["module.blocks.1.attn.piece_attn.conv.weight"][0, 0] = -0.25
    checkpoint = {"state_dict": official_mhla["state_dict"], "state_dict_ema": state}
    model = mhla_official()
    converted, report = convert_official(checkpoint, model, use_ema=True)
    assert report["mixing_out_of_range"] == [("blocks.1.attn.mixing.weight", -0.25, pytest.approx(
        state["module.blocks.1.attn.piece_attn.conv.weight"].max().item()))]
    model.load_state_dict(converted, strict=True)
    logits_of(model, official_mhla)
    assert model.blocks[1].attn.mixing.weight[0, 0] == -0.25  # official: W is kept as trained
    constrained = mhla_official(constrain_mixing=True)
    constrained.load_state_dict(converted, strict=True)
    logits_of(constrained, official_mhla)
    assert constrained.blocks[1].attn.mixing.weight[0, 0] == 0.0
    with pytest.raises(ValueError, match="the checkpoint holds no EMA weights"):
        convert_official({"state_dict": official_mhla["state_dict"]}, model, use_ema=True)


def test_each_converter_refuses_the_other_kind(official_mhla):
    softmax = timm.create_model("deit_tiny_patch16_224", depth=2).state_dict()
    with pytest.raises(ValueError, match="not a checkpoint of the released MHLA code: no 'blocks.N.attn.to_qkv"):
        convert_official({"state_dict": softmax}, mhla_official())
    with pytest.raises(ValueError, match=r"not a softmax DeiT: 16 attention keys of another kind "
                                         r"\(blocks.0.attn.norm.weight, blocks.0.attn.norm.bias"):
        convert_softmax_deit(official_mhla["state_dict"], timm.create_model("deit_tiny_mhla", depth=2))
    ours = timm.create_model("deit_tiny_mhla", depth=2).state_dict()
    with pytest.raises(ValueError, match="not a softmax DeiT: .*blocks.0.attn.q_norm.weight|mixing.weight"):
        convert_softmax_deit(ours, timm.create_model("deit_tiny_mhla", depth=2))


def test_the_cli_converts_and_refuses_in_one_line(official_mhla, tmp_path, capsys):
    convert = load_script("convert_official").main
    convert_deit = load_script("convert_deit").main
    sizes = ["--model-kwargs", *[f"{k}={v}" for k, v in SIZES.items() if k != "num_classes"], "img_pad_to=64"]
    out = tmp_path / "converted.pth"
    assert convert(["--src", str(FIXTURES / "official_mhla.pt"), *sizes, "--out", str(out)]) == 0
    model = mhla_official()
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    assert (logits_of(model, official_mhla) - official_mhla["logits"]).abs().max() <= 1e-10

    softmax = tmp_path / "deit.pth"
    torch.save(timm.create_model("deit_tiny_patch16_224", depth=2).state_dict(), softmax)
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes((FIXTURES / "official_mhla.pt").read_bytes()[:5000])
    capsys.readouterr()
    for main, src, match in ((convert, softmax, "not a checkpoint of the released MHLA code"),
                             (convert_deit, FIXTURES / "official_mhla.pt", "not a softmax DeiT"),
                             (convert, truncated, "cannot be read"),
                             (convert_deit, truncated, "cannot be read")):
        assert main(["--src", str(src), "--out", str(tmp_path / "x.pth")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and match in err[0], err
    assert not (tmp_path / "x.pth").exists()
    assert models.convert_official is convert_official


class Unlisted:
    """A class that no checkpoint may unpickle."""


def convert_saved(src, out, *flags):
    """``scripts/convert_official.py`` on a checkpoint of the released training script's sizes."""
    sizes = [f"{k}={v}" for k, v in SAVER_SIZES.items() if k != "num_classes"]
    return load_script("convert_official").main(["--src", str(src), "--model-kwargs", *sizes, "img_pad_to=64",
                                                 *flags, "--out", str(out)])


@pytest.mark.parametrize("flags,logits", [([], "logits"), (["--ema"], "ema_logits")], ids=["model", "ema"])
def test_a_checkpoint_as_the_released_training_script_saves_it_converts(saved_logits, tmp_path, capsys, flags,
                                                                        logits):
    out = tmp_path / "converted.pth"
    assert convert_saved(SAVED, out, *flags) == 0
    converted = torch.load(out, weights_only=True)
    assert capsys.readouterr().out == f"{out}: {len(converted)} tensors for deit_tiny_mhla_official (10 classes)\n"
    model = timm.create_model("deit_tiny_mhla_official", img_pad_to=64, **SAVER_SIZES).eval()
    model.load_state_dict(converted, strict=True)
    assert (logits_of(model, saved_logits) - saved_logits[logits]).abs().max() <= 1e-5
    assert (saved_logits["logits"] - saved_logits["ema_logits"]).abs().max() > 1e-2  # the two are told apart


def test_ema_weights_alone_convert_with_ema_only(tmp_path, capsys):
    with torch.serialization.safe_globals([argparse.Namespace]):
        saved = torch.load(SAVED, weights_only=True)
    ema_only = tmp_path / "ema_only.pth.tar"
    torch.save({k: v for k, v in saved.items() if k != "state_dict"}, ema_only)
    capsys.readouterr()
    assert convert_saved(ema_only, tmp_path / "x.pth") == 2
    assert capsys.readouterr().err == (f"error: --src {ema_only}: the checkpoint holds only EMA weights "
                                       f"('state_dict_ema'), no 'state_dict' or 'model': --ema reads them\n")
    assert not (tmp_path / "x.pth").exists()
    assert convert_saved(ema_only, tmp_path / "x.pth", "--ema") == 0


def test_a_checkpoint_holding_another_class_is_refused_in_one_plain_line(tmp_path, capsys):
    """``args`` (``argparse.Namespace``) is the one class allowed beyond ``weights_only``'s own."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        saved = torch.load(SAVED, weights_only=True)
    unsafe = tmp_path / "unsafe.pth.tar"
    torch.save({**saved, "extra": Unlisted()}, unsafe)
    capsys.readouterr()
    assert convert_saved(unsafe, tmp_path / "x.pth") == 2
    err = capsys.readouterr().err
    assert err == (f"error: --src {unsafe}: checkpoint {unsafe} cannot be read (it holds a pickled object of type "
                   f"{Unlisted.__module__}.Unlisted that is not allowed: a checkpoint holds tensors, plain Python "
                   f"types and argparse.Namespace)\n")
    assert "\x1b" not in err and "weights_only=False" not in err
    assert not (tmp_path / "x.pth").exists()


def test_model_sizes_lists_ours_beside_the_released_counts(capsys):
    load_script("model_sizes").main(["--models", "deit_tiny_mhla_official", "deit_tiny_mhla"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].endswith("| released code (params) |")
    assert rows[2].startswith("| deit_tiny_mhla_official | 5.794 |") and rows[2].endswith(
        "| deit_tiny_pla_1d_v6_6: 5.794 |")
    assert rows[3].startswith("| deit_tiny_mhla | 5.778 |") and rows[3].endswith("|  |")
