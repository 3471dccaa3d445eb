"""The image sources timm reads (folder, tar, Hugging Face dataset on disk) give the same samples and runs."""
import importlib.util
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_image_folder, tiny_config

import models  # noqa: F401  (registers the models)
from mhla.training import config as config_module
from mhla.training.config import ConfigError, check_resources, load_config
from mhla.training.data import base_dataset, image_folder
from mhla.training.trainer import run

HAS_DATASETS = importlib.util.find_spec("datasets") is not None


def _files(split_dir: Path) -> list[Path]:
    return sorted(p for p in split_dir.rglob("*.jpg"))


def tar_of_class_tars(split_dir: Path, out: Path) -> Path:
    """``split_dir``'s class folders as one tar holding a tar per class (the layout of ILSVRC's train tar)."""
    with tarfile.open(out, "w") as outer:
        for folder in sorted(p for p in split_dir.iterdir() if p.is_dir()):
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w") as inner:
                for file in sorted(folder.iterdir()):
                    inner.add(file, arcname=file.name)
            info = tarfile.TarInfo(f"{folder.name}.tar")
            info.size = buffer.tell()
            buffer.seek(0)
            outer.addfile(info, buffer)
    return out


def tar_of_class_folders(split_dir: Path, out: Path) -> Path:
    with tarfile.open(out, "w") as tar:
        for file in _files(split_dir):
            tar.add(file, arcname=f"{file.parent.name}/{file.name}")
    return out


def hf_parquet(root: Path, out: Path) -> Path:
    """The ImageFolder ``root`` (train, val) as a Hugging Face dataset on disk: one parquet file per split."""
    import datasets

    classes = sorted(p.name for p in (root / "train").iterdir())
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
    for split, name in (("train", "train"), ("val", "validation")):
        files = _files(root / split)
        table = {"image": [{"bytes": f.read_bytes(), "path": f.name} for f in files],
                 "label": [classes.index(f.parent.name) for f in files]}
        datasets.Dataset.from_dict(table, features=features).to_parquet(out / "data" / f"{name}-00000-of-00001.parquet")
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same images as a folder, tars and (with ``datasets``) parquet files."""
    root = tmp_path_factory.mktemp("sources")
    folder = make_image_folder(root / "folder", classes=3, train_per_class=6, val_per_class=3)
    tars = root / "tars"
    tars.mkdir()
    tar_of_class_tars(folder / "train", tars / "train.tar")
    tar_of_class_folders(folder / "val", tars / "val.tar")
    out = {"folder": folder, "tars": tars}
    if HAS_DATASETS:
        out["hfds"] = hf_parquet(folder, root / "hf")
    return out


def _samples(dataset) -> list[tuple[bytes, int]]:
    return [(np.asarray(image).tobytes(), label) for image, label in (dataset[i] for i in range(len(dataset)))]


@pytest.mark.parametrize("train", [True, False])
def test_tars_hold_the_folders_samples_in_its_order(sources, train):
    split = "train" if train else "val"
    folder = base_dataset("imagefolder", sources["folder"], train)
    tar = base_dataset("imagefolder", sources["tars"], train, split=f"{split}.tar")
    assert folder.classes == tar.classes == ["class_0", "class_1", "class_2"]
    assert len(folder) == (18 if train else 9)
    assert _samples(tar) == _samples(folder)
    assert [label for _, label in _samples(folder)] == sorted(label for _, label in _samples(folder))


@pytest.mark.skipif(not HAS_DATASETS, reason="needs the datasets package (requirements-dev.txt)")
@pytest.mark.parametrize("train", [True, False])
def test_hugging_face_dataset_on_disk_holds_the_folders_samples(sources, train):
    folder = base_dataset("imagefolder", sources["folder"], train)
    hfds = base_dataset(f"hfds/{sources['hfds']}", sources["hfds"].parent / "cache", train)
    assert hfds.classes == folder.classes
    assert _samples(hfds) == _samples(folder)


def test_a_broken_file_in_a_tar_is_named(tmp_path):
    folder = make_image_folder(tmp_path / "data", classes=2, train_per_class=1, val_per_class=1)
    (folder / "train" / "class_1" / "broken.jpg").write_bytes(b"not a jpeg")
    dataset = image_folder(tar_of_class_folders(folder / "train", tmp_path / "train.tar"))
    with pytest.raises(RuntimeError, match="cannot read image class_1/broken.jpg"):
        [dataset[i] for i in range(len(dataset))]


def test_missing_package_is_named_before_any_work(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    config = load_config(tiny_config(tmp_path, tmp_path, data={"dataset": "hfds/imagenet-1k"}))
    with pytest.raises(ConfigError, match="^data.dataset: 'hfds/imagenet-1k' needs the 'datasets' package: pip "
                                          "install datasets \\(from .*config.yaml\\)$"):
        check_resources(config)
    assert config_module.READER_PREFIXES == ("hfds/",)
    with pytest.raises(ImportError, match="needs the 'datasets' package"):
        base_dataset("hfds/imagenet-1k", tmp_path, train=True)


def _metrics(tmp_path: Path, name: str, data: dict) -> list[dict]:
    (tmp_path / name).mkdir()
    config = load_config(tiny_config(tmp_path / name, Path(data.pop("root")), data={"batch_size": 6, **data}))
    check_resources(config)
    rows = run(config, argv=["test"])
    assert len(rows) == 2
    return [{k: v for k, v in row.items() if k != "epoch_time_s"} for row in rows]


@pytest.mark.slow  # five 2-epoch training runs in this process
def test_every_map_style_source_and_loader_setting_gives_the_same_run(sources, tmp_path):
    folder = _metrics(tmp_path, "folder", {"root": sources["folder"]})
    tars = _metrics(tmp_path, "tars", {"root": sources["tars"], "train_split": "train.tar", "val_split": "val.tar"})
    assert tars == folder
    persistent = _metrics(tmp_path, "persistent", {"root": sources["folder"], "workers": 1,
                                                   "persistent_workers": True, "prefetch_factor": 1})
    fresh = _metrics(tmp_path, "fresh", {"root": sources["folder"], "workers": 1, "persistent_workers": False})
    assert persistent == fresh == folder  # workers that live across epochs augment each epoch afresh
    if HAS_DATASETS:
        hfds = _metrics(tmp_path, "hfds", {"root": sources["hfds"] / "cache", "dataset": f"hfds/{sources['hfds']}"})
        assert hfds == folder
    assert folder[0]["train_loss"] != folder[1]["train_loss"] and torch.isfinite(torch.tensor(folder[1]["val_loss"]))
