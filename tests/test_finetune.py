"""``model.init_from``: a run that starts from another run's weights, at another resolution or class count."""
import re

import pytest
import timm
import torch
from helpers import ROOT, make_image_folder, tiny_config
from timm.layers import resample_abs_pos_embed

import models  # noqa: F401  (registers the models)
import train
from mhla.training.config import load_config
from mhla.training.distributed import init_distributed
from mhla.training.finetune import load_init_weights
from mhla.training.trainer import _Run, run

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
KWARGS = load_config(QUICKSTART)["model"]["kwargs"]  # width 96, depth 4, 3 heads, patch 4, 2 x 2 blocks
HEAD_NOTICE = ("head.weight, head.bias dropped (the checkpoint has 10 classes, the model {}): the head starts from "
               "its fresh initialisation")


def quickstart_model(img_size: int = 32, num_classes: int = 10, **kwargs) -> torch.nn.Module:
    return timm.create_model("deit_tiny_mhla", img_size=img_size, num_classes=num_classes, **{**KWARGS, **kwargs})


def resampled(pos_embed: torch.Tensor, side: int) -> torch.Tensor:
    """timm's resampling of quick-start positions (no prefix tokens) to a ``side x side`` grid."""
    return resample_abs_pos_embed(pos_embed, new_size=[side, side], num_prefix_tokens=0)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 32 px, 10-class quick-start model with every tensor moved off its initialisation (W too, inside [0, 1]),
    and its weights saved in each layout ``model.init_from`` reads."""
    torch.manual_seed(1)
    model = quickstart_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) if name.endswith("mixing.weight") else p + 0.1 * torch.randn_like(p))
    state = model.state_dict()
    ema = {k: v + 1 for k, v in state.items()}  # never the one loaded
    layouts = {
        "train.py": {"model": state, "ema": ema, "state": {"epoch": 3}, "model_name": "deit_tiny_mhla"},
        "deit": {"model": state},
        "plain": state,  # also what scripts/convert_official.py writes
        "timm": {"state_dict": {f"module.{k}": v for k, v in state.items()}, "state_dict_ema": ema},
    }
    tmp = tmp_path_factory.mktemp("source")
    paths = {}
    for layout, content in layouts.items():
        paths[layout] = tmp / f"{layout}.pth"
        torch.save(content, paths[layout])
    return state, paths


@pytest.mark.parametrize("layout", ["train.py", "deit", "plain", "timm"])
def test_a_larger_image_starts_from_the_checkpoint_with_positions_resampled(source, layout):
    state, paths = source
    model = quickstart_model(img_size=48)
    notices = load_init_weights(model, paths[layout])
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        if key != "pos_embed":
            assert torch.equal(loaded[key], value), key
    assert loaded["pos_embed"].shape == (1, 144, 96)
    assert torch.equal(loaded["pos_embed"], resampled(state["pos_embed"], 12))
    assert notices == [f"71 of 71 tensors from {paths[layout]}", "pos_embed resampled from 8x8 to 12x12 positions "
                       "(bicubic)"]


def test_a_head_of_another_class_count_keeps_its_fresh_initialisation(source):
    state, paths = source
    model = quickstart_model(num_classes=5)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    notices = load_init_weights(model, paths["deit"])
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], fresh[k]) for k in ("head.weight", "head.bias"))
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if not k.startswith("head."))  # pos_embed as is
    assert notices == [f"69 of 71 tensors from {paths['deit']}", HEAD_NOTICE.format(5)]


def _without(state, key):
    return {k: v for k, v in state.items() if k != key}


def _renamed(state, old, new):
    return {new if k == old else k: v for k, v in state.items()}


@pytest.mark.parametrize("make,match", [
    (None, r"model.init_from: checkpoint .*nope\.pth does not exist \(from --set\)$"),
    (lambda s: b"not a checkpoint", r"model.init_from: checkpoint .*bad\.pth cannot be read \(.*\) \(from --set\)$"),
    (lambda s: {**s, "blocks.0.attn.extra": torch.zeros(3)}, r"model.init_from: checkpoint .*bad\.pth: the weights do "
     r"not fit the model: unexpected keys blocks\.0\.attn\.extra; missing keys - \(from --set\)$"),
    (lambda s: _without(s, "blocks.3.mlp.fc2.bias"), r"model.init_from: checkpoint .*: the weights do not fit the "
     r"model: unexpected keys -; missing keys blocks\.3\.mlp\.fc2\.bias \(from --set\)$"),
    (lambda s: {**s, "blocks.1.attn.qkv.weight": torch.zeros(288, 95)}, r"model.init_from: checkpoint .*: "
     r"blocks\.1\.attn\.qkv\.weight has shape \(288, 95\) in the checkpoint, \(288, 96\) in the model \(from --set\)$"),
    (lambda s: quickstart_model(block_grid=[4, 4]).state_dict(), r"model.init_from: checkpoint .*: "
     r"blocks\.0\.attn\.mixing\.weight has shape \(16, 16\) in the checkpoint, \(4, 4\) in the model \(\+3 more of "
     r"another shape\): W is M x M for the block grid \(model.kwargs.block_grid\), whatever the image size"),
    (lambda s: _renamed(s, "blocks.0.attn.qkv.weight", "blocks.0.attn.to_qkv.weight"), r"model.init_from: checkpoint "
     r".*bad\.pth holds the released MHLA code's keys \(blocks\.0\.attn\.to_qkv\.weight\); convert it first with "
     r"scripts/convert_official\.py"),
    (lambda s: {**s, "cls_token": torch.zeros(1, 1, 96)}, r"unexpected keys cls_token; missing keys -; a timm DeiT "
     r"with a class token converts with models.convert_softmax_deit \(from --set\)$"),
], ids=["missing-file", "unreadable", "unexpected-key", "missing-key", "shape", "mixing-W", "released-code",
        "class-token"])
def test_weights_that_do_not_fit_are_a_one_line_error_before_anything_starts(source, tmp_path, capsys, make, match):
    state, _ = source
    path = tmp_path / ("nope.pth" if make is None else "bad.pth")
    if make is not None:
        content = make(state)
        path.write_bytes(content) if isinstance(content, bytes) else torch.save(content, path)
    args = ["--config", str(QUICKSTART), "--set", f"model.init_from={path}", "--set", f"output_dir={tmp_path / 'out'}"]
    assert train.main(args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.search(match, lines[0]), lines
    assert not (tmp_path / "out").exists()


def _fine_tune_config(tmp_path, init_from):
    """The quick-start model at 48 px on a 3-class ImageFolder, with EMA, from ``init_from`` (32 px, 10 classes)."""
    path = tiny_config(tmp_path, make_image_folder(tmp_path / "data"), epochs=1,
                       model={"kwargs": KWARGS, "init_from": str(init_from)}, data={"img_size": 48})
    return load_config(path)


def test_the_trainer_starts_the_model_and_its_ema_from_the_loaded_weights(source, tmp_path, capsys):
    state, paths = source
    config = _fine_tune_config(tmp_path, paths["train.py"])
    trainer = _Run(config, init_distributed("cpu"), tmp_path / "run")
    expected = {**state, "pos_embed": resampled(state["pos_embed"], 12)}
    model, ema = trainer.model.state_dict(), trainer.ema.module.state_dict()
    assert model["head.weight"].shape == (3, 96)
    for key, value in model.items():
        assert torch.equal(ema[key], value), key
        if not key.startswith("head."):
            assert torch.equal(value, expected[key]), key
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: model.init_from:")]
    expected_notes = [f"69 of 71 tensors from {paths['train.py']}", HEAD_NOTICE.format(3),
                      "pos_embed resampled from 8x8 to 12x12 positions (bicubic)"]
    assert notes == [f"note: model.init_from: {n}" for n in expected_notes]


def test_a_resumed_run_takes_its_checkpoint_and_never_reads_init_from(source, tmp_path, capsys):
    state, paths = source
    init = tmp_path / "init.pth"
    init.write_bytes(paths["plain"].read_bytes())
    config = _fine_tune_config(tmp_path, init)
    run_dir = tmp_path / "output" / config["run_name"]
    trainer = _Run(config, init_distributed("cpu"), run_dir)
    trainer.state.epoch = config["epochs"]  # a finished run: resuming it trains nothing
    trainer.save("last.pth")
    init.unlink()  # reading it now would fail
    capsys.readouterr()
    assert run(config, resume="auto") == []
    assert "model.init_from" not in capsys.readouterr().err
