"""scripts/benchmark_data.py: the JPEG maker, the timed pipelines, the workers arithmetic and a tiny run of main()."""
import hashlib
import math
import random
import re

import numpy as np
import pytest
import timm
import torch
from helpers import ROOT, load_script
from PIL import Image
from timm.data import resolve_data_config

from mhla.training.config import load_config
from mhla.training.data import AugmentedDataset, build_datasets, image_folder

benchmark_data = load_script("benchmark_data")
CONFIG = ROOT / "configs" / "deit_t_mhla.yaml"


def test_jpeg_maker_writes_distinct_jpegs_of_the_asked_size_in_class_folders(tmp_path):
    root = benchmark_data.make_jpeg_folder(tmp_path, files=7, classes=3, size=(40, 30), quality=90)
    files = sorted(root.glob("*/*"))
    assert [f.parent.name for f in files] == ["class_0"] * 3 + ["class_1"] * 2 + ["class_2"] * 2
    for path in files:
        with Image.open(path) as image:
            assert image.format == "JPEG" and image.size == (40, 30)
    assert len({hashlib.sha1(path.read_bytes()).hexdigest() for path in files}) == 7
    folder = image_folder(root)  # as the trainer reads it
    assert folder.classes == ["class_0", "class_1", "class_2"] and len(folder) == 7
    samples = [folder[i] for i in range(len(folder))]
    assert sorted(label for _, label in samples) == [0, 0, 0, 1, 1, 2, 2]
    for image, _ in samples:
        assert image.mode == "RGB" and image.size == (40, 30) and np.asarray(image).std() > 10  # a photo


@pytest.fixture(scope="module")
def folder_and_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs")
    for split in ("train", "val"):
        benchmark_data.make_jpeg_folder(root / split, files=4, classes=2, size=(48, 40))
    config = load_config(CONFIG, ["data.img_size=32", "data.dataset=imagefolder", f"data.root={root}"])
    return root, config


def test_the_timed_transform_is_the_one_the_trainer_builds(folder_and_config):
    _, config = folder_and_config
    model_cfg = resolve_data_config({}, pretrained_cfg=timm.get_pretrained_cfg(config["model"]["name"]).to_dict())
    train_set, _, _ = build_datasets(config["data"], config["aug"], model_cfg, config["seed"])
    timed = repr(benchmark_data.train_transform_of(config))
    assert timed == repr(train_set.transform)
    assert "RandAugment(n=2" in timed and "m=9, mstd=0.5" in timed and "RandomErasing(p=0.25" in timed


def test_seeded_batches_repeat_and_unseeded_ones_do_not(folder_and_config):
    root, config = folder_and_config
    base, transform = image_folder(root / "train"), benchmark_data.train_transform_of(config)
    seeded = AugmentedDataset(base, transform, seed=config["seed"])
    random.seed(0)  # the unseeded pipeline draws from the global generators
    np.random.seed(0)
    unseeded = benchmark_data.Unseeded(base, transform)
    first, again = benchmark_data.batch_call(seeded, 3)(), benchmark_data.batch_call(seeded, 3)()
    images, labels, skipped = first
    assert images.shape == (3, 3, 32, 32) and images.dtype == torch.float32 and skipped == 0
    assert labels.dtype == torch.long and set(labels.tolist()) <= {0, 1}
    assert torch.equal(images, again[0]) and torch.equal(labels, again[1])  # same seed, epoch, indices
    stream = benchmark_data.index_stream(len(base))
    epoch0, epoch1 = [next(stream) for _ in range(len(base))], [next(stream) for _ in range(len(base))]
    assert {e for e, _ in epoch0} == {0} and {e for e, _ in epoch1} == {1}  # every file once per epoch
    assert sorted(i for _, i in epoch0) == sorted(i for _, i in epoch1) == list(range(len(base)))
    assert not torch.equal(seeded[(0, 1)][0], seeded[(1, 1)][0])  # a new epoch augments anew
    plain, plain_again = benchmark_data.batch_call(unseeded, 3)(), benchmark_data.batch_call(unseeded, 3)()
    assert plain[0].shape == (3, 3, 32, 32) and torch.equal(plain[1], labels)  # same images, in the same order
    assert not torch.equal(plain[0], plain_again[0])


def test_workers_needed():
    assert benchmark_data.workers_needed(2000, 300) == 7
    assert benchmark_data.workers_needed(600, 300) == 2
    assert benchmark_data.workers_needed(100, 300) == 1


def test_default_throughputs_are_the_documented_figures():
    tiny, source = benchmark_data.DEFAULT_TRAIN_THROUGHPUT["deit_tiny_mhla"]
    assert tiny == pytest.approx(128 / 0.0656) and "docs/benchmarks.md" in source
    assert "| fp32, 224 px, batch 128 | 44.7 ms | 47.1 ms | 56.6 ms | 65.6 ms |" in (
        ROOT / "docs" / "benchmarks.md").read_text()
    small, source = benchmark_data.DEFAULT_TRAIN_THROUGHPUT["deit_small_mhla"]
    assert small == pytest.approx(tiny * 1.26 / 4.60) and source.startswith("estimate, not measured")
    targets = benchmark_data.parse_args(["--train-throughput", "deit_small_mhla=800", "deit_base_mhla=300"]).targets
    assert targets["deit_small_mhla"] == (800.0, "given with --train-throughput")
    assert targets["deit_tiny_mhla"][0] == tiny and targets["deit_base_mhla"][0] == 300.0


@pytest.mark.parametrize("item", ["deit_tiny_mhla", "deit_tiny_mhla=fast", "deit_tiny_mhla=0"])
def test_bad_train_throughput_is_refused(item, capsys):
    with pytest.raises(SystemExit) as exc:
        benchmark_data.parse_args(["--train-throughput", item])
    assert exc.value.code == 2 and "MODEL=IMAGES_PER_SECOND" in capsys.readouterr().err


def test_main_prints_and_writes_the_table(tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "report" / "data.md"
    assert benchmark_data.main([
        "--files", "4", "--classes", "2", "--image-size", "48", "40", "--img-size", "32", "--batch-size", "2",
        "--min-run-time", "0.1", "--rounds", "1", "--workers", "0", "--loader-batches", "1",
        "--train-throughput", "deit_tiny_mhla=1000", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads
    text = capsys.readouterr().out
    assert out.read_text() in text
    per_worker = {}
    for name in ("without the per-sample seed", "seeded (`AugmentedDataset`, as the trainer)"):
        img_per_s, ms = re.search(rf"\| {re.escape(name)} \| ([\d.]+) \| ([\d.]+) \|", text).groups()
        assert float(img_per_s) > 0 and float(ms) == pytest.approx(1e3 / float(img_per_s), rel=0.02)
        per_worker[name] = float(img_per_s)
    assert float(re.search(r"\| 0 \| ([\d.]+) \|", text).group(1)) > 0  # the DataLoader row
    rows = {name: (float(throughput), int(workers)) for name, throughput, workers in
            re.findall(r"\| (deit_\w+) \| ([\d.]+) \[\d\] \| (\d+) \|", text)}
    assert set(rows) == {"deit_tiny_mhla", "deit_small_mhla"} and rows["deit_tiny_mhla"][0] == 1000
    seeded = float(re.search(r"needed at ([\d.]+) img/s per worker", text).group(1))
    assert seeded == per_worker["seeded (`AugmentedDataset`, as the trainer)"]
    for throughput, workers in rows.values():  # the printed figures are rounded
        assert workers >= 1 and workers in {math.ceil((throughput + dt) / (seeded + dw))
                                             for dt in (-0.5, 0.5) for dw in (-0.05, 0.05)}
    assert "[1] given with --train-throughput." in text and "[2] estimate, not measured" in text
