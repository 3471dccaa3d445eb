"""The image sources timm reads: folder, tar and Hugging Face dataset on disk give the same samples and runs;
WebDataset shards stream deterministically and resume exactly."""
import importlib.util
import io
import itertools
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_image_folder, tiny_config

import models  # noqa: F401  (registers the models)
from mhla.training.config import ConfigError, check_resources, load_config
from mhla.training.data import base_dataset, image_folder
from mhla.training.trainer import _Run, run

HAS_DATASETS = importlib.util.find_spec("datasets") is not None
HAS_WEBDATASET = importlib.util.find_spec("webdataset") is not None


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


def wds_shards(root: Path, out: Path, per_shard: int = 4) -> Path:
    """The ImageFolder ``root`` as WebDataset shards (``<key>.jpg`` + ``<key>.cls``) with timm's ``_info.json``."""
    out.mkdir(parents=True)
    classes = sorted(p.name for p in (root / "train").iterdir())
    info = {"name": "tiny", "num_classes": len(classes), "splits": {}}
    for split, name in (("train", "train"), ("val", "validation")):
        files = _files(root / split)
        filenames, lengths = [], []
        for start in range(0, len(files), per_shard):
            filenames.append(f"tiny-{name}-{start // per_shard:04d}.tar")
            chunk = files[start:start + per_shard]
            with tarfile.open(out / filenames[-1], "w") as tar:
                for file in chunk:
                    label = str(classes.index(file.parent.name)).encode()
                    for suffix, data in (("jpg", file.read_bytes()), ("cls", label)):
                        item = tarfile.TarInfo(f"{file.stem}.{suffix}")
                        item.size = len(data)
                        tar.addfile(item, io.BytesIO(data))
            lengths.append(len(chunk))
        info["splits"][name] = {"name": name, "num_samples": len(files), "filenames": filenames,
                                "shard_lengths": lengths}
    (out / "_info.json").write_text(json.dumps(info))
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
    if HAS_WEBDATASET:
        out["wds"] = wds_shards(folder, root / "wds")
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


@pytest.mark.parametrize("dataset,package", [("hfds/imagenet-1k", "datasets"), ("wds/imagenet-1k", "webdataset")])
def test_missing_package_is_named_before_any_work(tmp_path, monkeypatch, dataset, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    config = load_config(tiny_config(tmp_path, tmp_path, data={"dataset": dataset}))
    with pytest.raises(ConfigError, match=f"^data.dataset: '{dataset}' needs the '{package}' package: pip "
                                          f"install {package} \\(from .*config.yaml\\)$"):
        check_resources(config)
    if package == "datasets":
        with pytest.raises(ImportError, match="needs the 'datasets' package"):
            base_dataset(dataset, tmp_path, train=True)


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


def _stream(sources, workers: int, batch_size: int = 3):
    from torch.utils.data import DataLoader

    from mhla.training.shards import shard_datasets

    config = load_config(tiny_config(Path(sources["wds"]).parent, sources["wds"], data={"dataset": "wds/tiny"}))
    model_cfg = {"mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 1.0, "interpolation": "bicubic"}
    train, val, num_classes = shard_datasets(config["data"], config["aug"], model_cfg, seed=3, batch_size=batch_size)
    train.set_loader_cfg(workers)
    generator = torch.Generator()
    loader = DataLoader(train, batch_size=batch_size, num_workers=workers, generator=generator,
                        persistent_workers=workers > 0)

    def epoch(number: int, start_batch: int = 0) -> list:
        train.set_epoch(number, start_batch)
        generator.manual_seed(3)
        return list(itertools.islice(loader, train.batches_per_epoch - start_batch))
    return train, val, num_classes, epoch


@pytest.mark.skipif(not HAS_WEBDATASET, reason="needs the webdataset package (requirements-dev.txt)")
@pytest.mark.parametrize("workers", [0, 2])
def test_shard_stream_is_the_same_each_time_and_resumes_mid_epoch(sources, workers):
    train, val, num_classes, epoch = _stream(sources, workers)
    assert num_classes == 3 and train.batches_per_epoch == 18 // 3
    first = epoch(0)
    assert len(first) == 6 and all(images.shape == (3, 3, 32, 32) for images, _ in first)
    labels = sorted(label for _, batch_labels in first for label in batch_labels.tolist())
    if workers == 0:
        assert labels == [0] * 6 + [1] * 6 + [2] * 6  # every training image once
    else:  # each worker reads 9 samples from its shards (2 + 3 of 4, 4, 4, 4, 2 images): timm's with_epoch
        assert len(labels) == 18 and set(labels) == {0, 1, 2}
    second = epoch(1)
    assert not torch.equal(torch.cat([b[0] for b in second]), torch.cat([b[0] for b in first]))
    again = epoch(0)  # the same epoch after another one (persistent workers) gives the same batches
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(again, first, strict=True))
    resumed = epoch(0, start_batch=4)  # two batches left, the stopped run's
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(resumed, first[4:], strict=True))


@pytest.mark.skipif(not HAS_WEBDATASET, reason="needs the webdataset package (requirements-dev.txt)")
def test_missing_class_count_is_named_before_any_work(sources, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    info = json.loads((sources["wds"] / "_info.json").read_text())
    del info["num_classes"]
    (shards / "_info.json").write_text(json.dumps(info))
    config = load_config(tiny_config(tmp_path, shards, data={"dataset": "wds/tiny"}))
    with pytest.raises(ConfigError, match="^data.num_classes: the shards' info under .* states no num_classes; set it"):
        check_resources(config)
    check_resources(load_config(tiny_config(tmp_path, shards, data={"dataset": "wds/tiny", "num_classes": 3})))


@pytest.mark.slow  # three 2-epoch training runs in this process, with loader workers
@pytest.mark.skipif(not HAS_WEBDATASET, reason="needs the webdataset package (requirements-dev.txt)")
def test_a_run_on_shards_stopped_mid_epoch_resumes_exactly(sources, tmp_path, monkeypatch):
    data = {"root": sources["wds"], "dataset": "wds/tiny", "workers": 2, "batch_size": 3}
    whole = _metrics(tmp_path, "whole", dict(data))

    class Stop(Exception):
        pass

    on_step = _Run.on_step

    def stop_at_step_8(self, state):
        on_step(self, state)
        if state.step == 8:  # epoch 1, batch 2 of 6; saved by checkpoint.interval_steps
            raise Stop

    (tmp_path / "stopped").mkdir()
    config = load_config(tiny_config(tmp_path / "stopped", sources["wds"], checkpoint={"interval_steps": 4},
                                     data={k: v for k, v in data.items() if k != "root"}))
    monkeypatch.setattr(_Run, "on_step", stop_at_step_8)
    with pytest.raises(Stop):
        run(config, argv=["test"])
    monkeypatch.setattr(_Run, "on_step", on_step)
    resumed = run(config, resume="auto", argv=["test"])
    drop = ("epoch_time_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in resumed] == whole[1:]
    final = lambda name: torch.load(tmp_path / name / "output" / "config" / "last.pth", weights_only=True)["model"]
    assert all(torch.equal(final("whole")[k], v) for k, v in final("stopped").items())
