"""Train a model from a YAML config.

    python train.py --config configs/quickstart.yaml
    python train.py --config configs/deit_t_mhla.yaml --set data.root=/data/imagenet --set epochs=100
    torchrun --nproc_per_node=8 train.py --config configs/deit_t_mhla.yaml
    python train.py --config configs/deit_t_mhla.yaml --resume auto

Configuration problems are reported in one line (exit code 2) before anything is created.
"""
import argparse
import sys

import models  # noqa: F401  (registers the models)
from mhla.training.config import ConfigError, check_resources, load_config
from mhla.training.engine import EmptyBatchError, NonFiniteLossError
from mhla.training.trainer import check_buildable, run
from mhla.weights import WeightsError


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value by dotted key, e.g. --set optim.lr=5e-4 (repeatable)")
    parser.add_argument("--resume", default=None, metavar="auto|PATH",
                        help="continue from the run's last.pth (auto) or from a checkpoint file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.set)
        check_resources(config)
        check_buildable(config)
        if args.resume not in (None, "auto"):
            from pathlib import Path

            if not Path(args.resume).is_file():
                raise ConfigError(f"--resume: checkpoint {args.resume} does not exist")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        run(config, resume=args.resume, argv=sys.argv if argv is None else ["train.py", *argv])
    except (NonFiniteLossError, EmptyBatchError, WeightsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
