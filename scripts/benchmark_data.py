"""Input pipeline speed: how many loader workers does one GPU need to train DeiT-T/S with MHLA?

    python scripts/benchmark_data.py --workers 1 2                  # JPEGs made from scikit-image's photos
    python scripts/benchmark_data.py --data /data/imagenet --workers 1 2 4 8     # ImageNet's training JPEGs

Times what one DataLoader worker does for the trainer: decode a JPEG (PIL), the training augmentation of
``--config`` (timm's ``create_transform(is_training=True)`` as ``mhla.training.data.build_datasets`` builds it:
RandomResizedCrop, flip, RandAugment, bicubic, normalisation, random erasing) and collate into a batch, in
one DataLoader worker process on one torch thread, batch after batch as the worker's own loop (the
worker path of the per-sample seed, which restores no generator state). Two pipelines, timed in interleaved
rounds (``mhla.benchmark.time_interleaved``, medians of the rounds) so a slow spell of the machine hits
both alike: ``seeded`` is ``AugmentedDataset`` as the trainer uses it (each sample's augmentation under a
seed from run seed, epoch and index, for exact resume), ``unseeded`` the same transform without the
seed. With ``--workers`` it also times a real ``DataLoader`` with that many workers. Then, for each model's
training throughput on one GPU (``--train-throughput``; the defaults and where they come from are printed),
the workers needed: ceil(training img/s / one worker's img/s). Prints a Markdown table (``--out`` writes it).

The images are ``--files`` JPEGs (``--image-size``, quality ``--quality``), crops of scikit-image's photos at
random places and scales, in ``--classes`` class folders of a temporary ImageFolder (about 40 KB a file at
500 x 375 px, ImageNet's average about 110 KB); ``--data DIR`` reads real images instead, through
``mhla.training.data.image_folder`` as the trainer does (``DIR/train`` where there is one, e.g. ImageNet's root).
"""
import argparse
import functools
import itertools
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import PIL
import timm
import torch
from PIL import Image, features
from timm.data import resolve_data_config
from torch.utils.data import DataLoader

import models  # noqa: F401  (registers the models)
from mhla import benchmark as bench
from mhla.training.config import load_config
from mhla.training.data import AugmentedDataset, SkimagePhotos, collate_skipping, image_folder, train_transform

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = ("unseeded", "seeded")

# Training images per second of one GPU, and where each figure comes from.
DEFAULT_TRAIN_THROUGHPUT: dict[str, tuple[float, str]] = {
    "deit_tiny_mhla": (
        128 / 65.6e-3,
        "measured: an H200 training step at 224 px, batch 128, fp32 took 65.6 ms (docs/benchmarks.md, "
        "'On a GPU'; 74.9 ms, 1,709 img/s, under bf16 autocast, the configs' default)"),
    "deit_small_mhla": (
        128 / 65.6e-3 * 1.26 / 4.60,
        "estimate, not measured: deit_tiny_mhla's 1,951 img/s scaled by the GMACs at 224 px (1.26 / 4.60, "
        "README); no GPU figure exists for it, and the paper gives no throughput"),
}


def parse_train_throughput(items: list[str]) -> dict[str, tuple[float, str]]:
    """``MODEL=IMG_PER_S`` items over the defaults: model -> (images per second, where the figure comes from)."""
    out = dict(DEFAULT_TRAIN_THROUGHPUT)
    for item in items:
        name, sep, value = item.partition("=")
        try:
            throughput = float(value)
        except ValueError:
            throughput = -1.0
        if not sep or throughput <= 0:
            raise ValueError(f"--train-throughput: expected MODEL=IMAGES_PER_SECOND (> 0), got {item!r}")
        out[name] = (throughput, "given with --train-throughput")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "deit_t_mhla.yaml",
                        help="training config whose augmentation, image size and seed are timed")
    parser.add_argument("--img-size", type=int, help="training image size (default: the config's)")
    parser.add_argument("--data", type=Path, help="images to read instead of the generated JPEGs: a folder of class "
                        "folders or a .tar (DIR/train where there is one)")
    parser.add_argument("--files", type=int, default=320, help="generated JPEGs")
    parser.add_argument("--classes", type=int, default=4, help="class folders of the generated JPEGs")
    parser.add_argument("--image-size", type=int, nargs=2, default=[500, 375], metavar=("WIDTH", "HEIGHT"),
                        help="size of the generated JPEGs (ImageNet's typical photo)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality of the generated files")
    parser.add_argument("--batch-size", type=int, default=128, help="per-GPU batch (1,024 over 8 GPUs)")
    parser.add_argument("--min-run-time", type=float, default=30.0,
                        help="seconds of timed batches per pipeline, over all rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="*", default=[],
                        help="also time a DataLoader with each of these worker counts")
    parser.add_argument("--loader-batches", type=int, default=4,
                        help="timed DataLoader batches per worker (after each worker's first)")
    parser.add_argument("--train-throughput", nargs="*", default=[], metavar="MODEL=IMG_PER_S",
                        help="one GPU's training images per second for a model (adds or replaces a default)")
    parser.add_argument("--out", type=Path, help="also write the Markdown report here")
    args = parser.parse_args(argv)
    try:
        args.targets = parse_train_throughput(args.train_throughput)
    except ValueError as e:
        parser.error(str(e))
    for name in ("files", "classes", "quality", "batch_size", "rounds", "loader_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1")
    if args.files < args.classes:
        parser.error("--files: at least one file per class is needed")
    if any(n < 0 for n in args.workers):
        parser.error("--workers: worker counts must be >= 0")
    if args.data is not None and not args.data.exists():
        parser.error(f"--data: {args.data} does not exist")
    return args


@functools.cache
def skimage_photos() -> list[Image.Image]:
    """The RGB photos scikit-image ships (``mhla.training.data.SkimagePhotos``), loaded once."""
    return SkimagePhotos().images


def make_jpeg_folder(root: Path, files: int, classes: int, size: tuple[int, int] = (500, 375), quality: int = 90,
                     seed: int = 0) -> Path:
    """An ImageFolder of ``files`` JPEGs of ``size`` (width, height): crops of scikit-image's photos.

    Each file crops one photo (in turn) at a random place and scale (half to all of the largest crop of the
    target's aspect ratio), resizes it (bicubic) and flips it half of the time, so no two files are alike.
    File i goes to ``root/class_<i % classes>/``.
    """
    rng = np.random.default_rng(seed)
    photos = skimage_photos()
    width, height = size
    for i in range(files):
        photo = photos[i % len(photos)]
        crop_w = min(photo.width, photo.height * width / height) * rng.uniform(0.5, 1.0)
        crop_h = crop_w * height / width
        left, top = rng.uniform(0, photo.width - crop_w), rng.uniform(0, photo.height - crop_h)
        image = photo.resize((width, height), Image.BICUBIC, box=(left, top, left + crop_w, top + crop_h))
        if rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        folder = root / f"class_{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{i:05d}.jpg", quality=quality)
    return root


def train_transform_of(config: dict):
    """The training transform the trainer builds for ``config`` (``mhla.training.data.train_transform``)."""
    model_cfg = resolve_data_config({}, pretrained_cfg=timm.get_pretrained_cfg(config["model"]["name"]).to_dict())
    return train_transform(config["data"]["img_size"], config["aug"], model_cfg)


class Unseeded:
    """``(transform(image), label)`` of a base dataset: ``AugmentedDataset`` without the per-sample seed.

    Takes an index or ``(epoch, index)``, as ``AugmentedDataset`` does (the epoch changes nothing here).
    """

    def __init__(self, base, transform) -> None:
        self.base, self.transform = base, transform

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, item: int | tuple[int, int]):
        image, label = self.base[item[1] if isinstance(item, tuple) else item]
        return self.transform(image), label


def index_stream(size: int, seed: int = 0) -> Iterator[tuple[int, int]]:
    """``(epoch, index)`` for ever, as the trainer's ``EpochSampler`` yields them: each epoch a new shuffle
    (the same for the same ``seed``), so no sample is augmented the same way twice."""
    rng = np.random.default_rng(seed)
    for epoch in itertools.count():
        yield from ((epoch, index) for index in rng.permutation(size).tolist())


def batch_call(dataset, batch_size: int, seed: int = 0):
    """A function that loads the next ``batch_size`` samples of ``dataset`` and collates them, as a worker does."""
    indices = index_stream(len(dataset), seed)

    def call():
        return collate_skipping([dataset[next(indices)] for _ in range(batch_size)])
    return call


def time_one_worker(pipelines: dict, batch_size: int, min_run_time: float, rounds: int) -> dict[str, dict]:
    """Images per second of each pipeline, one process on one torch thread (as a DataLoader worker runs).

    All pipelines read the same images in the same order; returns name -> ``img_per_s``, ``ms_per_batch`` and
    ``spread_pct`` (max - min over the rounds, % of the median).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = bench.time_interleaved({name: batch_call(ds, batch_size) for name, ds in pipelines.items()},
                                       min_run_time, rounds)
    finally:
        torch.set_num_threads(threads)
    return {name: dict(img_per_s=batch_size * 1e3 / ms, ms_per_batch=ms, spread_pct=spread)
            for name, (ms, spread) in times.items()}


def time_seed_context(seed: int, min_run_time: float, rounds: int, samples: int = 100) -> float:
    """Microseconds the per-sample seed of ``AugmentedDataset`` adds to a sample (an empty transform)."""
    base = [(0, 0)] * samples
    seeded, plain = AugmentedDataset(base, lambda image: image, seed), Unseeded(base, lambda image: image)
    times = bench.time_interleaved({name: lambda ds=ds: [ds[i] for i in range(samples)]
                                    for name, ds in (("seeded", seeded), ("plain", plain))}, min_run_time, rounds)
    return (times["seeded"][0] - times["plain"][0]) * 1e3 / samples


def time_worker(pipelines: dict, args, seed: int) -> tuple[dict[str, dict], float]:
    """``time_one_worker`` of the pipelines, then ``time_seed_context``: (one-worker figures, seed µs per sample)."""
    one_worker = time_one_worker(pipelines, args.batch_size, args.min_run_time, args.rounds)
    budget = min(1.0, args.min_run_time / 10)  # seconds: the seed context alone is quick to time
    return one_worker, time_seed_context(seed, budget, args.rounds, samples=max(10, round(100 * budget)))


class _Call(torch.utils.data.Dataset):
    """One item: ``fn()``, computed where the DataLoader reads it."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int):
        return self.fn()


def in_worker(fn):
    """``fn()`` run inside a DataLoader worker process (as the trainer's samples are loaded) and its result."""
    return next(iter(DataLoader(_Call(fn), batch_size=None, num_workers=1)))


def time_loader(dataset, batch_size: int, workers: int, batches_per_worker: int, data: dict | None = None,
                seed: int = 0) -> dict:
    """Samples per second a ``DataLoader`` with ``workers`` worker processes (0: in this process) loads.

    Loaded as the trainer loads: ``collate_skipping``, and the ``data`` section's ``pin_memory`` (default:
    where CUDA is) and ``prefetch_factor``. The clock starts when every worker has delivered its first
    batch (start-up and the first wave are not timed) and runs for ``batches_per_worker`` batches per
    worker. Returns ``img_per_s``.
    """
    data = data or {}
    options = dict(pin_memory=torch.cuda.is_available() if data.get("pin_memory") is None else data["pin_memory"])
    if workers and data.get("prefetch_factor") is not None:
        options["prefetch_factor"] = data["prefetch_factor"]
    waves, timed = max(1, workers), batches_per_worker * max(1, workers)
    order = index_stream(len(dataset), seed)
    sampler = [next(order) for _ in range((waves + timed) * batch_size)]
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                        collate_fn=collate_skipping, **options)
    batches = iter(loader)
    for _ in range(waves):
        next(batches)
    start, samples = time.perf_counter(), 0
    for batch, _, skipped in batches:
        samples += len(batch) + skipped
    return dict(img_per_s=samples / (time.perf_counter() - start))


def workers_needed(train_img_per_s: float, worker_img_per_s: float) -> int:
    """Loader workers that keep up with ``train_img_per_s``, each delivering ``worker_img_per_s``."""
    return math.ceil(train_img_per_s / worker_img_per_s)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def report(args, config: dict, data: str, one_worker: dict, seed_us: float, loader: dict[int, dict]) -> str:
    """The Markdown report: setting, one-worker table, seeding overhead, DataLoader scaling, workers per GPU."""
    aug = config["aug"]
    seeded, unseeded = one_worker["seeded"], one_worker["unseeded"]
    overhead = 100 * (1 - seeded["img_per_s"] / unseeded["img_per_s"])
    libjpeg_turbo = "yes" if features.check_feature("libjpeg_turbo") else "no"
    lines = [
        f"Input pipeline of `{args.config.name}` at {config['data']['img_size']} px: PIL decode, "
        f"RandomResizedCrop {tuple(aug['scale'])}, flip {aug['hflip']}, RandAugment `{aug['auto_augment']}`, "
        f"{aug['interpolation']}, random erasing {aug['reprob']}, normalisation; collate into batches of "
        f"{args.batch_size}. Data: {data}.",
        f"CPU: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}, timm {timm.__version__}, "
        f"Pillow {PIL.__version__} (libjpeg-turbo: {libjpeg_turbo}); medians of {args.rounds} interleaved rounds, "
        f"{args.min_run_time:g} s per pipeline.",
        "",
        "| one DataLoader worker (1 thread) | img/s | ms / image | spread |",
        "|---|---|---|---|",
    ]
    for name, label in (("unseeded", "without the per-sample seed"),
                        ("seeded", "seeded (`AugmentedDataset`, as the trainer)")):
        r = one_worker[name]
        lines.append(f"| {label} | {r['img_per_s']:.1f} | {1e3 / r['img_per_s']:.2f} | {r['spread_pct']:.0f}% |")
    lines += ["", f"Seeding overhead: {overhead:.1f}% of one worker's throughput (the seed context alone: "
                  f"{seed_us:.0f} µs per sample, {seed_us * unseeded['img_per_s'] / 1e4:.1f}% of an unseeded "
                  "sample's time)."]
    if loader:
        lines += ["", "| DataLoader workers | img/s | img/s per worker |", "|---|---|---|"]
        lines += [f"| {n} | {r['img_per_s']:.1f} | {r['img_per_s'] / max(1, n):.1f} |" for n, r in loader.items()]
    lines += ["", f"| model | one GPU's training img/s | loader workers needed at {seeded['img_per_s']:.1f} img/s "
                  "per worker (seeded) |", "|---|---|---|"]
    notes = []
    for i, (name, (throughput, source)) in enumerate(args.targets.items(), start=1):
        lines.append(f"| {name} | {throughput:.0f} [{i}] | {workers_needed(throughput, seeded['img_per_s'])} |")
        notes.append(f"[{i}] {source}.")
    lines += ["", *notes, "Each worker takes about one CPU core; the trainer's main process needs one more."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    config = load_config(args.config, [f"data.img_size={args.img_size}"] if args.img_size else [])
    with tempfile.TemporaryDirectory() as tmp:
        if args.data is not None:
            root = args.data / "train" if (args.data / "train").is_dir() else args.data
            data = f"the images under {root}"
        else:
            width, height = args.image_size
            root = make_jpeg_folder(Path(tmp), args.files, args.classes, (width, height), args.quality)
            data = (f"{args.files} JPEGs of {width} x {height} px, quality {args.quality}, crops of scikit-image's "
                    f"photos in {args.classes} class folders")
        base, transform = image_folder(root), train_transform_of(config)
        pipelines = {"unseeded": Unseeded(base, transform),
                     "seeded": AugmentedDataset(base, transform, config["seed"],
                                                config["data"]["on_bad_image"] == "skip")}
        one_worker, seed_us = in_worker(functools.partial(time_worker, pipelines, args, config["seed"]))
        for name in PIPELINES:
            print(f"{name:>9}: {one_worker[name]['img_per_s']:8.1f} img/s per worker", file=sys.stderr)
        loader = {}
        for n in args.workers:
            loader[n] = time_loader(pipelines["seeded"], args.batch_size, n, args.loader_batches, config["data"])
            print(f"DataLoader, {n} workers: {loader[n]['img_per_s']:8.1f} img/s", file=sys.stderr)
    text = report(args, config, data, one_worker, seed_us, loader)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
