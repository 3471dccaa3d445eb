"""Convert a checkpoint of the paper's released code into a state dict for the matching model here.

    python scripts/convert_official.py --src model_best.pth.tar --model deit_tiny_mhla_official --out mhla_t.pth
    python scripts/convert_official.py --src last.pth.tar --ema --model deit_small_mhla_official --out mhla_s_ema.pth
    python scripts/convert_official.py --src linear.pth.tar --model deit_small_linear --out linear_s.pth

The source is what the released timm training script (DAGroup-PKU/MHLA, ``mhla_image_classification``)
saved, ``model_best.pth.tar`` or ``last.pth.tar`` as timm's ``CheckpointSaver`` writes them (read with
``weights_only=True``, its ``args`` namespace allowed: ``mhla.weights.read_checkpoint``): their
``state_dict`` (or ``state_dict_ema`` with ``--ema``), or a bare state dict. Its MHLA models
convert into ``deit_{tiny,small,base}_mhla_official``, its linear ones into ``deit_{small,tiny}_linear``;
the class count comes from the checkpoint's head. The output is a plain state dict, written atomically,
that loads with ``strict=True``: ``timm.create_model(NAME, checkpoint_path=OUT)``. Mixing matrices
with entries outside [0, 1] are reported. Anything that does not fit is a one-line error (exit 2).
"""
import argparse
import sys
from pathlib import Path

import timm
from timm.utils import ParseKwargs

import models
from mhla.training.checkpoint import save_atomic
from mhla.weights import read_checkpoint, unwrap_state_dict


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", type=Path, required=True, help="checkpoint of the released code (.pth/.pth.tar)")
    parser.add_argument("--model", default="deit_tiny_mhla_official", help="target model name")
    parser.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs, metavar="KEY=VALUE",
                        help="create_model keywords for other sizes, e.g. depth=6")
    parser.add_argument("--ema", action="store_true", help="convert the EMA weights (state_dict_ema)")
    parser.add_argument("--out", type=Path, required=True, help="output .pth")
    args = parser.parse_args(argv)
    if not timm.is_model(args.model):
        print(f"error: --model {args.model!r} is not a registered model", file=sys.stderr)
        return 2
    try:
        checkpoint = read_checkpoint(args.src)
        state = unwrap_state_dict(checkpoint, args.ema)
        num_classes = state["head.weight"].shape[0] if "head.weight" in state else 0
        model = timm.create_model(args.model, num_classes=num_classes, **args.model_kwargs)
        converted, report = models.convert_official(checkpoint, model, args.ema)
    except (ValueError, TypeError) as e:  # mhla.weights.WeightsError is a ValueError
        print(f"error: --src {args.src}: {e}", file=sys.stderr)
        return 2
    save_atomic(converted, args.out)
    print(f"{args.out}: {len(converted)} tensors for {args.model} ({num_classes} classes)")
    for key, low, high in report["mixing_out_of_range"]:
        mixing = model.get_submodule(key.removesuffix(".weight"))
        fate = f"{args.model} clamps it to [0, 1] on use" if mixing.constrain else "kept as it is"
        print(f"note: {key} has entries in [{low:.4g}, {high:.4g}], outside [0, 1]: {fate}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
