"""Parameters and GMACs of every registered MHLA/linear/softmax DeiT at one resolution, as a Markdown table.

    python scripts/model_sizes.py                 # 224 px
    python scripts/model_sizes.py --img-size 384

MACs come from ``torch.utils.flop_counter`` (matmuls, convolutions and attention; elementwise
operations are not counted), on one image. timm's own ``deit_tiny_patch16_224`` and
``deit_small_patch16_224`` are listed for reference, beside the paper's figures and the parameter
counts of the released code's models that ours reproduce (counted on its registrations by
``tests/fixtures/make_official_fixtures.py --param-counts``, timm 1.0.15).
"""
import argparse

import timm

import models  # noqa: F401  (registers the models)
from mhla.flops import count_macs

PAPER = {"deit_tiny": "5.7M / 1.1G", "deit_small": "22M / 4.2G"}
RELEASED = {  # our model: (the released registration, its parameter count)
    "deit_tiny_mhla_official": ("deit_tiny_pla_1d_v6_6", 5_793_832),
    "deit_small_mhla_official": ("deit_small_pla_1d_v6_6", 22_200_424),
    "deit_base_mhla_official": ("deit_base_pla_1d_v6_6", 86_864_104),
    "deit_small_linear": ("deit_small_linear", 22_035_688),
}
REFERENCES = ["deit_tiny_patch16_224", "deit_small_patch16_224"]


def model_names() -> list[str]:
    names = timm.list_models(module="deit_mhla")
    return sorted(names, key=lambda n: (["tiny", "small", "base"].index(n.split("_")[1]), n)) + REFERENCES


def measure(name: str, img_size: int) -> tuple[float, float]:
    """(parameters in millions, GMACs) of ``name`` at ``img_size``."""
    model = timm.create_model(name, img_size=img_size).eval()
    params = sum(p.numel() for p in model.parameters())
    return params / 1e6, count_macs(model, (3, img_size, img_size)) / 1e9


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--models", nargs="+", default=None, help="model names (default: all registered + timm's)")
    args = parser.parse_args(argv)
    print(f"| model | params (M) | GMACs at {args.img_size} px | paper (params / FLOPs) | released code (params) |")
    print("|---|---|---|---|---|")
    for name in args.models or model_names():
        params, gmacs = measure(name, args.img_size)
        paper = PAPER.get("_".join(name.split("_")[:2]), "") if name not in REFERENCES else ""
        released = f"{RELEASED[name][0]}: {RELEASED[name][1] / 1e6:.3f}" if name in RELEASED else ""
        print(f"| {name} | {params:.3f} | {gmacs:.2f} | {paper} | {released} |")


if __name__ == "__main__":
    main()
