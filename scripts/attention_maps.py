"""Attention maps of one query position, per layer (head-averaged), for several models side by side.

    python scripts/attention_maps.py --model deit_tiny_linear --model deit_tiny_softmax --model deit_tiny_mhla
    python scripts/attention_maps.py --model deit_tiny_mhla:output/quickstart/last.pth --image digit.png --img-size 32

``--image`` is one of the photos scikit-image ships (default ``chelsea``) or a file; ``--query ROW COL``
is a token of the patch grid (default: its centre). Writes one PNG: a row per model, a column per
layer, each map upsampled and overlaid on the (resized, centre-cropped) image.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from timm.data import resolve_data_config

import models  # noqa: F401  (registers the models)
from mhla.analysis import attention_map, capture_attention
from mhla.training.config import ConfigError
from mhla.training.data import SKIMAGE_PHOTOS, SkimagePhotos, eval_transform
from mhla.training.evaluation import load_model_specs
from mhla.weights import WeightsError


def load_image(name: str) -> Image.Image:
    if name in SKIMAGE_PHOTOS:
        return SkimagePhotos((name,))[0][0]
    if not Path(name).is_file():
        raise SystemExit(f"error: --image: {name} is neither a scikit-image photo {SKIMAGE_PHOTOS} nor a file")
    return Image.open(name).convert("RGB")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", required=True, help="NAME[:CHECKPOINT], repeatable")
    parser.add_argument("--image", default="chelsea")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--query", type=int, nargs=2, metavar=("ROW", "COL"), help="query token (default: centre)")
    parser.add_argument("--out", type=Path, default=Path("outputs/attention_maps/maps.png"))
    args = parser.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    image = load_image(args.image)
    try:
        loaded = load_model_specs(args.model, args.img_size)
    except (WeightsError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for spec, model in loaded.items():
        x = eval_transform(args.img_size, resolve_data_config({}, model=model))(image)[None]
        grid = tuple(model.patch_embed.grid_size)
        row, col = args.query or (grid[0] // 2, grid[1] // 2)
        if not (0 <= row < grid[0] and 0 <= col < grid[1]):
            raise SystemExit(f"error: --query {row} {col} is outside the {grid[0]}x{grid[1]} token grid")
        maps = [attention_map(c, row * grid[1] + col, grid)[0] for c in capture_attention(model, x)]
        rows.append((spec.split(":")[0], maps, x[0], (row, col), grid))
    layers = max(len(m) for _, m, _, _, _ in rows)
    fig, axes = plt.subplots(len(rows), layers, figsize=(1.6 * layers, 1.8 * len(rows)), squeeze=False)
    for r, (name, maps, x, (row, col), grid) in enumerate(rows):
        shown = (x - x.min()) / (x.max() - x.min())
        for layer, ax in enumerate(axes[r]):
            ax.axis("off")
            if layer >= len(maps):
                continue
            up = F.interpolate(maps[layer][None, None].float(), size=x.shape[1:], mode="nearest")[0, 0]
            ax.imshow(shown.permute(1, 2, 0).numpy())
            ax.imshow(up.numpy(), alpha=0.6, cmap="inferno")
            ax.scatter([(col + 0.5) * x.shape[2] / grid[1]], [(row + 0.5) * x.shape[1] / grid[0]], s=12, c="cyan")
            ax.set_title(f"{name}\nlayer {layer}" if layer == 0 else f"layer {layer}", fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    plt.close(fig)
    print(args.out)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
