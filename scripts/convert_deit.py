"""Convert a timm softmax DeiT checkpoint into an MHLA (or linear/softmax) DeiT checkpoint for fine-tuning.

    python scripts/convert_deit.py --src deit_tiny.pth --model deit_tiny_mhla --out mhla_init.pth

The source is a state dict (or a checkpoint holding one under "model" or "state_dict", read by
``mhla.weights.read_checkpoint``) in timm's ``deit_*_patch16_224`` layout. The output is a plain state
dict for ``--model`` (built with ``--img-size``), written atomically; load it with
``timm.create_model(name, checkpoint_path=...)``. See ``models.convert`` for what is copied, resampled,
dropped and initialised.
"""
import argparse
import sys
from pathlib import Path

import timm

import models
from mhla.training.checkpoint import save_atomic
from mhla.weights import WeightsError, read_checkpoint


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", type=Path, required=True, help="timm DeiT state dict (.pth)")
    parser.add_argument("--model", default="deit_tiny_mhla", help="target model name")
    parser.add_argument("--img-size", type=int, default=224, help="target resolution (positions are resampled)")
    parser.add_argument("--out", type=Path, required=True, help="output .pth")
    args = parser.parse_args(argv)
    if not timm.is_model(args.model):
        print(f"error: --model {args.model!r} is not a registered model", file=sys.stderr)
        return 2
    try:
        checkpoint = read_checkpoint(args.src)
    except WeightsError as e:
        print(f"error: --src: {e}", file=sys.stderr)
        return 2
    model = timm.create_model(args.model, img_size=args.img_size)
    try:
        converted, report = models.convert_softmax_deit(checkpoint, model)
    except ValueError as e:
        print(f"error: --src {args.src}: {e}", file=sys.stderr)
        return 2
    save_atomic(converted, args.out)
    print(f"{args.out}: {len(report['copied'])} tensors copied, {len(report['dropped'])} dropped "
          f"({', '.join(report['dropped'][:4])}{', ...' if len(report['dropped']) > 4 else ''}), "
          f"{len(report['initialised'])} initialised")
    return 0


if __name__ == "__main__":
    sys.exit(main())
