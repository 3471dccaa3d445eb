"""Config loading and validation, and train.py's refusal of bad configs before any work."""
import re

import pytest
import timm
import torch
import yaml
from helpers import ROOT, make_image_folder, run_train, tiny_config

import models  # noqa: F401  (registers the models)
import train
from mhla import MultiHeadLinearAttention
from mhla.training.config import DEFAULTS, ConfigError, load_config
from mhla.training.trainer import build_model, check_buildable


def write(path, data):
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    return path


def test_defaults_base_chain_and_overrides(tmp_path):
    write(tmp_path / "base.yaml", "epochs: 7\noptim:\n  lr: 5e-4\n  weight_decay: 0.1\n")
    write(tmp_path / "child.yaml", "base: base.yaml\noptim:\n  weight_decay: 1e-2\n")
    config = load_config(tmp_path / "child.yaml", ["data.img_size=32", "sched.min_lr=1e-7"])
    assert config["epochs"] == 7
    assert config["optim"]["lr"] == 5e-4 and isinstance(config["optim"]["lr"], float)
    assert config["optim"]["weight_decay"] == 0.01
    assert config["optim"]["betas"] == DEFAULTS["optim"]["betas"]
    assert config["data"]["img_size"] == 32 and config["sched"]["min_lr"] == 1e-7
    assert config["run_name"] == "child"


def test_model_kwargs_merge_key_by_key(tmp_path):
    write(tmp_path / "base.yaml", "model:\n  kwargs: {block_grid: [2, 2], depth: 4}\n")
    write(tmp_path / "child.yaml", "base: base.yaml\nmodel:\n  kwargs: {depth: 2}\n")
    assert load_config(tmp_path / "child.yaml")["model"]["kwargs"] == {"block_grid": [2, 2], "depth": 2}


def test_set_one_model_kwarg_keeps_the_others():
    quickstart = load_config(ROOT / "configs" / "quickstart.yaml")
    config = load_config(ROOT / "configs" / "quickstart.yaml", ["model.kwargs.block_grid=[1,1]"])
    assert config["model"]["kwargs"] == {**quickstart["model"]["kwargs"], "block_grid": [1, 1]}
    assert {"embed_dim", "depth", "num_heads", "patch_size"} <= config["model"]["kwargs"].keys()
    assert config["_sources"]["model.kwargs.block_grid"] == "--set"


@pytest.mark.parametrize("content,overrides,match", [
    ("optim:\n  lrr: 1\n", [], "unknown key 'optim.lrr' \\(from .*bad.yaml\\); did you mean 'optim.lr'\\?"),
    ("epochs: ten\n", [], "epochs: expected int, got str 'ten' \\(from .*bad.yaml\\)"),
    ("optim:\n  lr: -1\n", [], "optim.lr: -1 is out of range \\(must be > 0\\)"),
    ("data:\n  dataset: imagenette\n", [], "data.dataset: 'imagenette' is not one of .* nor a timm reader name "
                                          "\\(hfds/NAME, wds/NAME\\)"),
    ("data:\n  prefetch_factor: 0\n", [], "data.prefetch_factor: 0 is out of range \\(must be >= 1\\)"),
    ("data:\n  pin_memory: yes please\n", [], "data.pin_memory: expected bool"),
    ("ema:\n  enabled: 1\n", [], "ema.enabled: expected bool"),
    ("compile: 1\n", [], "compile: 1 is not one of \\(False, True, 'blocks'\\) \\(from .*bad.yaml\\)"),
    ("", ["compile=block"], "compile: 'block' is not one of \\(False, True, 'blocks'\\) \\(from --set\\)"),
    ("", ["optim.lr=abc"], "optim.lr: expected float, got str 'abc' \\(from --set\\)"),
    ("", ["optim"], "--set 'optim': expected key=value"),
    ("aug:\n  scale: [0.1]\n", [], "aug.scale: expected two numbers"),
    ("base: missing.yaml\n", [], "missing.yaml does not exist"),
    ("epochs: [1\n", [], "not valid YAML"),
])
def test_bad_values_name_the_key_and_the_file(tmp_path, content, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path / "bad.yaml", content), overrides)


@pytest.mark.parametrize("sections,overrides,match", [
    ({}, ["model.name=deit_tiny_mhlaa"], "model.name: unknown model 'deit_tiny_mhlaa' \\(from --set\\); did you mean"),
    ({}, ["data.root=/nonexistent/imagenet"], "data.root: /nonexistent/imagenet/train is neither a directory nor a "
                                              "\\.tar"),
    ({}, ["data.train_split=ILSVRC2012_img_train.tar"], "data.root: .*/ILSVRC2012_img_train.tar is neither a "
                                                        "directory nor a \\.tar .*data.train_split naming one"),
    ({}, ["data.dataset=cifar10", "data.root=/nonexistent/cifar"], "set data.download: true"),
    ({}, ["optim.lrr=1"], "unknown key 'optim.lrr' \\(from --set\\); did you mean 'optim.lr'"),
    ({}, ["data.batch_size=6", "optim.accum_steps=4"], "data.batch_size: 6 is not divisible"),
    ({"aug": {"mixup": 0.8}}, ["data.batch_size=3"], "must be even with mixup"),
    ({}, ["data.img_size=30"], r"data.img_size: cannot build deit_tiny_mhla: img_size \(30, 30\) is not divisible by "
                               r"patch_size \(8, 8\) \(from --set\)$"),
    ({}, ["model.kwargs.block_grid=[20,20]"],
     r"model.kwargs.block_grid: .*block_grid 20x20 is larger than the token grid 4x4 \(from --set\)$"),
    ({}, ["model.kwargs.transform=nope"], r"model.kwargs.transform: .*unknown mixing transform 'nope'"),
    ({}, ["model.kwargs.nope=1"], r"model.kwargs.nope: .*unexpected keyword argument 'nope' \(from --set\)$"),
    ({}, ["model.kwargs.depth=-1"],
     r"model.kwargs.depth: cannot build deit_tiny_mhla: depth must be an integer >= 0, got -1 \(from --set\)$"),
    ({}, ["model.kwargs.patch_size=0"],
     r"model.kwargs.patch_size: cannot build deit_tiny_mhla: patch_size must be an integer >= 1, got 0 "
     r"\(from --set\)$"),
    ({}, ["sched.name=cosinee"], r"sched.name: Unknown scheduler 'cosinee'. \(from --set\)$"),
    ({}, ["optim.name=adamww"], r"optim.name: Optimizer adamww not found in registry \(from --set\)$"),
    ({"model": {"name": "swin_tiny_patch4_window7_224", "drop_path": 0.0, "kwargs": {"window_size": 4}}},
     ["compile=blocks"],
     r"compile: compile 'blocks' needs a model with a non-empty `blocks` sequence; SwinTransformer has none "
     r"\(from --set\)$"),
])
def test_train_refuses_bad_configs_before_any_work(tmp_path, capsys, sections, overrides, match):
    config = tiny_config(tmp_path, make_image_folder(tmp_path / "data"), **sections)
    args = ["--config", str(config)] + [x for o in overrides for x in ("--set", o)]
    assert train.main(args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.search(match, lines[0]), lines
    assert not (tmp_path / "output").exists()


@pytest.mark.parametrize("bug", [RuntimeError("boom"), KeyError("block_grid"), AssertionError("num_heads")],
                         ids=lambda e: type(e).__name__)
def test_a_bug_while_building_the_model_keeps_its_type(tmp_path, monkeypatch, bug):
    """Only a refused argument becomes a config error: a failing code path is not blamed on a key its message names."""
    def broken_init(self, *args, **kwargs):
        raise bug

    monkeypatch.setattr(MultiHeadLinearAttention, "__init__", broken_init)
    config = load_config(tiny_config(tmp_path, tmp_path))
    with pytest.raises(type(bug)) as raised:
        check_buildable(config)
    assert raised.value is bug and not isinstance(raised.value, ConfigError)


@pytest.mark.slow  # train.py in a subprocess
def test_bad_config_from_the_command_line_has_no_traceback(tmp_path):
    config = tiny_config(tmp_path, make_image_folder(tmp_path / "data"))
    proc = run_train("--config", str(config), "--set", "optim.lrr=1", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown key 'optim.lrr'")
    assert not (tmp_path / "output").exists()


def test_missing_config_and_missing_resume(tmp_path, capsys):
    assert train.main(["--config", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err
    assert "config file" in err and "does not exist" in err
    config = tiny_config(tmp_path, make_image_folder(tmp_path / "data"))
    assert train.main(["--config", str(config), "--resume", str(tmp_path / "nope.pth")]) == 2
    assert "--resume: checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_builds(path, tmp_path):
    """Each config's model, optimizer and scheduler build (on the meta device), its base chain merged. A fine-tuning
    config's ``model.init_from`` names another run's output, so here it takes a 224 px state dict of its own model,
    which must fit (positions resampled, head dropped if the class count differs)."""
    config = load_config(path)
    if config["model"]["init_from"] is not None:
        source = {**config, "data": {**config["data"], "img_size": 224}}
        with torch.device("meta"):
            shapes = build_model(source, num_classes=1000).state_dict()
        torch.save({k: torch.zeros(v.shape) for k, v in shapes.items()}, tmp_path / "source.pth")
        config["model"]["init_from"] = str(tmp_path / "source.pth")
    check_buildable(config)
    assert config["model"]["name"] in timm.list_models(module="deit_mhla")


def test_a_null_keyword_removes_what_the_base_set():
    config = load_config(ROOT / "configs" / "quickstart_softmax.yaml")
    assert config["model"]["kwargs"]["block_grid"] is None and config["model"]["kwargs"]["embed_dim"] == 96
    model = build_model(config, num_classes=10)
    assert model.embed_dim == 96 and len(model.blocks) == 4 and type(model.blocks[0].attn).__name__ == "Attention"
