"""Evaluate a checkpoint: load weights with clear errors, run the validation set, report."""
import time

import torch
from timm.models.vision_transformer import checkpoint_filter_fn

from .benchmark import count_macs
from .checkpoint import load_checkpoint
from .distributed import DistInfo
from .engine import evaluate

__all__ = ["WeightsError", "load_model_spec", "load_weights", "measure"]


class WeightsError(ValueError):
    """Weights that do not fit the model; the message names the first offending keys."""


def _state_dict(checkpoint: dict, use_ema: bool, path) -> dict:
    """The model (or EMA) weights of a ``train.py`` checkpoint, or a plain state dict as it is."""
    if isinstance(checkpoint.get("model"), dict):
        if not use_ema:
            return checkpoint["model"]
        if checkpoint.get("ema") is None:
            raise WeightsError(f"--ema: checkpoint {path} holds no EMA weights")
        return {k.removeprefix("module."): v for k, v in checkpoint["ema"].items()}
    if use_ema:
        raise WeightsError(f"--ema: checkpoint {path} is a plain state dict without EMA weights")
    return checkpoint


def load_weights(model: torch.nn.Module, path, use_ema: bool = False) -> None:
    """Load a ``train.py`` checkpoint (model or EMA weights) or a state dict into ``model``.

    Position embeddings are resampled to the model's grid (timm's ``checkpoint_filter_fn``).

    Raises:
        CheckpointError: missing or unreadable file.
        WeightsError: another architecture (first missing and unexpected keys), another class
            count, or no EMA weights when they are asked for.
    """
    state = _state_dict(load_checkpoint(path), use_ema, path)
    state = checkpoint_filter_fn(state, model)
    target = model.state_dict()
    head = "head.weight"
    if head in state and head in target and state[head].shape[0] != target[head].shape[0]:
        raise WeightsError(f"class-count mismatch: checkpoint {path} has {state[head].shape[0]} classes, "
                           f"the model and data have {target[head].shape[0]}")
    missing = [k for k in target if k not in state]
    unexpected = [k for k in state if k not in target]
    if missing or unexpected:
        raise WeightsError(f"checkpoint {path} does not fit the model: {len(missing)} missing keys (first: "
                           f"{missing[0] if missing else '-'}), {len(unexpected)} unexpected keys (first: "
                           f"{unexpected[0] if unexpected else '-'})")
    for key, value in state.items():
        if value.shape != target[key].shape:
            raise WeightsError(f"checkpoint {path}: {key} has shape {tuple(value.shape)}, the model expects "
                               f"{tuple(target[key].shape)}")
    model.load_state_dict(state)


def load_model_spec(spec: str, img_size: int) -> torch.nn.Module:
    """``NAME``, ``CONFIG.yaml`` or either with ``:CHECKPOINT`` -> a model in eval mode at ``img_size``.

    A training config gives the model's name and kwargs; a ``train.py`` checkpoint gives its kwargs
    (from its config) and class count; a state dict gives the class count. Call after the model
    registrations are imported.
    """
    import timm

    from .config import load_config

    name, _, path = spec.partition(":")
    kwargs = {}
    if name.endswith((".yaml", ".yml")):
        config = load_config(name)
        name, kwargs = config["model"]["name"], dict(config["model"]["kwargs"])
    if not timm.is_model(name):
        raise WeightsError(f"--model: unknown model {name!r}")
    if path:
        checkpoint = load_checkpoint(path)
        if isinstance(checkpoint.get("config"), dict):
            kwargs = dict(checkpoint["config"]["model"]["kwargs"])
        kwargs["num_classes"] = checkpoint.get("model", checkpoint)["head.weight"].shape[0]
    model = timm.create_model(name, img_size=img_size, **kwargs)
    if path:
        load_weights(model, path)
    return model.eval()


def measure(model: torch.nn.Module, loader, info: DistInfo, img_size: int, autocast) -> dict:
    """Top-1/top-5 (percent), loss, image count, images per second, parameters and GMACs."""
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    gmacs = count_macs(model, (3, img_size, img_size)) / 1e9
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
    start = time.perf_counter()
    result = evaluate(model, loader, info, autocast)
    elapsed = time.perf_counter() - start
    return {"top1": result["top1"], "top5": result["top5"], "loss": result["loss"], "num_images": result["count"],
            "img_per_s": result["count"] / elapsed, "params": params, "gmacs": gmacs}
