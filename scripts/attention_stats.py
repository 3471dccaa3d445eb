"""Rank and entropy of every attention head's N x N matrix, over a set of images (paper Fig. 3b).

    python scripts/attention_stats.py --model deit_tiny_linear --model deit_tiny_softmax --model deit_tiny_mhla \\
        --dataset photos --img-size 256 --out outputs/attention_stats
    python scripts/attention_stats.py --model deit_tiny_mhla:output/quickstart/last.pth --dataset mnist5k

``--model SPEC[:CHECKPOINT]`` (repeatable): a registered model name or a training config (its model
and kwargs), at initialisation or with a ``train.py`` checkpoint (its config gives the model's
kwargs and class count) or a state dict. ``--include-lepe`` adds the LePE term as a banded matrix
(``mhla.analysis.lepe_matrix``); by default A is the attention alone.
Images: ``--dataset mnist5k`` (validation digits), ``--dataset photos`` (the photos scikit-image
ships), or ``--data-dir DIR`` (an ImageFolder or a plain folder of images). Per model the mean over
images, layers and heads of the numerical rank (``torch.linalg.matrix_rank`` default tolerance,
sigma_max * N * eps(float64), and the fixed relative tolerance ``--rtol``) and of the mean row
entropy (nats). Writes ``stats.json``, ``stats.md`` (beside the paper's DeiT-T figures, 256 tokens,
500 images) and PNG plots to ``--out``.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from PIL import Image
from timm.data import resolve_data_config
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm import tqdm

import models  # noqa: F401  (registers the models)
from mhla.analysis import attention_matrix, capture_attention, matrix_rank, row_entropy
from mhla.training.config import ConfigError
from mhla.training.data import AugmentedDataset, MNIST5k, SkimagePhotos, collate_skipping, eval_transform, image_folder
from mhla.training.evaluation import load_model_specs
from mhla.weights import WeightsError

PAPER = {"linear": (58.4, 5.12), "softmax": (254.8, 4.13), "mhla": (233.4, 4.06)}  # DeiT-T, 256 tokens


class ImageFiles(Dataset):
    """Every image file in a folder (no class structure)."""

    classes = ["image"]

    def __init__(self, root: Path) -> None:
        suffixes = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}
        self.paths = sorted(p for p in root.rglob("*") if p.suffix.lower() in suffixes)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        return Image.open(self.paths[index]).convert("RGB"), 0


def images_for(args) -> Dataset:
    if args.data_dir is not None:
        if not args.data_dir.is_dir():
            raise SystemExit(f"error: --data-dir: {args.data_dir} is not a directory")
        subdirs = [p for p in args.data_dir.iterdir() if p.is_dir()]
        return image_folder(args.data_dir) if subdirs else ImageFiles(args.data_dir)
    return MNIST5k(train=False) if args.dataset == "mnist5k" else SkimagePhotos()


def stats_for(model: torch.nn.Module, loader, rtol: float, label: str, include_lepe: bool = False) -> dict:
    """Per layer and head: mean rank (two tolerances) and mean row entropy over the images."""
    sums, count, clipped, shape = None, 0, 0.0, None
    for images, _, _ in tqdm(loader, desc=label, file=sys.stderr, disable=not sys.stderr.isatty()):
        captures = capture_attention(model, images)
        per_layer = []
        for capture in captures:
            a = attention_matrix(capture, include_lepe=include_lepe)  # [B, H, N, N]
            shape = (capture.q.shape[-1], a.shape[-1])
            entropy, frac = row_entropy(a)
            clipped = max(clipped, frac)
            per_layer.append(torch.stack([matrix_rank(a).double(), matrix_rank(a, rtol=rtol).double(),
                                          entropy]).sum(1))  # [3, H], summed over the batch
        batch = torch.stack(per_layer)  # [L, 3, H]
        sums = batch if sums is None else sums + batch
        count += images.shape[0]
    mean = sums / count
    return {
        "rank_mean": mean[:, 0].mean().item(), "rank_mean_rtol": mean[:, 1].mean().item(),
        "entropy_mean": mean[:, 2].mean().item(), "head_dim": shape[0], "num_tokens": shape[1],
        "num_images": count, "rtol": rtol, "clipped_fraction": clipped, "include_lepe": include_lepe,
        "layers": [{"rank": mean[i, 0].tolist(), "rank_rtol": mean[i, 1].tolist(), "entropy": mean[i, 2].tolist()}
                   for i in range(mean.shape[0])],
    }


def kind_of(name: str) -> str:
    return next((k for k in PAPER if name.split(":")[0].endswith("_" + k)), "")


def write_report(results: dict, out: Path) -> str:
    lines = ["| model | tokens | head dim | mean rank | mean rank (rtol) | mean row entropy (nats) | "
             "paper rank | paper entropy |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        paper = PAPER.get(kind_of(name), ("", ""))
        lines.append(f"| {name} | {r['num_tokens']} | {r['head_dim']} | {r['rank_mean']:.1f} | "
                     f"{r['rank_mean_rtol']:.1f} | {r['entropy_mean']:.2f} | {paper[0]} | {paper[1]} |")
    table = "\n".join(lines) + "\n"
    (out / "stats.md").write_text(table)
    return table


def plot(results: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(names, [results[n]["rank_mean"] for n in names])
    axes[0].set(title="mean rank of the attention matrix")
    axes[1].bar(names, [results[n]["entropy_mean"] for n in names])
    axes[1].set(title="mean row entropy (nats)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out / "rank_entropy.png", dpi=120)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in names:
        layers = results[name]["layers"]
        axes[0].plot([sum(x["rank"]) / len(x["rank"]) for x in layers], marker="o", label=name)
        axes[1].plot([sum(x["entropy"]) / len(x["entropy"]) for x in layers], marker="o", label=name)
    axes[0].set(xlabel="layer", ylabel="mean rank")
    axes[1].set(xlabel="layer", ylabel="mean row entropy (nats)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "per_layer.png", dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", required=True,
                        help="NAME or CONFIG.yaml, optionally :CHECKPOINT; repeatable")
    parser.add_argument("--include-lepe", action="store_true", help="add LePE to A as a banded matrix")
    parser.add_argument("--dataset", choices=["photos", "mnist5k"], default="photos")
    parser.add_argument("--data-dir", type=Path, help="ImageFolder or folder of images (instead of --dataset)")
    parser.add_argument("--num-images", type=int, default=500)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--rtol", type=float, default=1e-3, help="the fixed relative rank tolerance")
    parser.add_argument("--out", type=Path, default=Path("outputs/attention_stats"))
    args = parser.parse_args(argv)
    base = images_for(args)
    try:
        loaded = load_model_specs(args.model, args.img_size)
    except (WeightsError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = {}
    for spec, model in loaded.items():
        transform = eval_transform(args.img_size, resolve_data_config({}, model=model))
        data = Subset(AugmentedDataset(base, transform), range(min(args.num_images, len(base))))
        loader = DataLoader(data, batch_size=args.batch_size, collate_fn=collate_skipping)
        results[spec] = stats_for(model, loader, args.rtol, spec, args.include_lepe)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stats.json").write_text(json.dumps(results, indent=2) + "\n")
    print(write_report(results, args.out))
    plot(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
