"""Evaluate a checkpoint: load weights with clear errors, run the validation set, report."""
import time
from dataclasses import dataclass, field

import torch

from ..flops import count_macs
from ..weights import WeightsError, read_checkpoint, resample_pos_embed, unwrap_state_dict
from .distributed import DistInfo
from .engine import evaluate

__all__ = ["ModelSpec", "load_model_spec", "load_model_specs", "load_weights", "measure", "resolve_model"]


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], path) -> None:
    """Load weights (``mhla.weights.unwrap_state_dict`` of the file at ``path``) into ``model``, strictly.

    Position embeddings are resampled to the model's grid (``mhla.weights.resample_pos_embed``); every
    other tensor must fit as it is.

    Raises:
        WeightsError: another architecture (first missing and unexpected keys), another class count, or a
            tensor of another shape; the message names the file.
    """
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
    state = dict(state)
    if "pos_embed" in state:
        try:
            state["pos_embed"], _ = resample_pos_embed(state["pos_embed"], model)
        except WeightsError as e:
            raise WeightsError(f"checkpoint {path}: {e}") from None
    for key, value in state.items():
        if value.shape != target[key].shape:
            raise WeightsError(f"checkpoint {path}: {key} has shape {tuple(value.shape)}, the model expects "
                               f"{tuple(target[key].shape)}")
    model.load_state_dict(state)


@dataclass
class ModelSpec:
    """What to build to evaluate or analyse weights: ``timm.create_model(name, **kwargs)`` and how it trained.

    Attributes:
        name: registered model name.
        kwargs: ``create_model`` keywords (the training config's ``model.kwargs``).
        num_classes: classes of the checkpoint's head (None without a checkpoint).
        img_size, crop_pct, interpolation: the training config's evaluation settings (None: unknown).
    """

    name: str
    kwargs: dict = field(default_factory=dict)
    num_classes: int | None = None
    img_size: int | None = None
    crop_pct: float | None = None
    interpolation: str | None = None


def resolve_model(checkpoint: dict | None = None, name: str | None = None, kwargs: dict | None = None,
                  config: dict | None = None, use_ema: bool = False) -> ModelSpec:
    """The model a checkpoint holds, from the one rule that ``validate.py`` and every script use.

    Highest first: the command line (``name``, ``kwargs``), then a ``train.py`` checkpoint's own
    config (model name, ``model.kwargs``, image size, crop and interpolation: exactly what was
    trained, ``--set`` overrides included), then a training ``config`` given beside it. The
    checkpoint's (or config's) keywords apply only to its own model: naming another model on the
    command line starts from no keywords. A plain state dict says nothing about its model, so it
    needs ``name`` or ``config``. Call after the model registrations are imported.

    Args:
        checkpoint: the loaded checkpoint (``mhla.weights.read_checkpoint``), or None for a fresh model.
        name: model name from the command line.
        kwargs: ``create_model`` keywords from the command line, over the others.
        config: a training config (``load_config``).
        use_ema: the class count is the EMA weights' head's (``unwrap_state_dict``).

    Raises:
        WeightsError: no model named anywhere, an unknown model name, or no weights where ``use_ema`` says.
    """
    import timm

    sources = []  # lowest first
    if config is not None:
        sources.append(_spec_of(config))
    if checkpoint is not None and isinstance(checkpoint.get("config"), dict):
        sources.append(_spec_of(checkpoint["config"]))
    spec = sources[-1] if sources else None
    if name is not None and (spec is None or name != spec.name):
        spec = ModelSpec(name)
    if spec is None:
        raise WeightsError("--model: the checkpoint is a plain state dict, which does not say which model it holds; "
                           "name the model with --model (or --config)")
    if not timm.is_model(spec.name):
        raise WeightsError(f"--model: unknown model {spec.name!r}")
    spec.kwargs = {**spec.kwargs, **(kwargs or {})}
    if checkpoint is not None:
        weights = unwrap_state_dict(checkpoint, use_ema)
        if "head.weight" in weights:
            spec.num_classes = weights["head.weight"].shape[0]
    return spec


def _spec_of(config: dict) -> ModelSpec:
    data, aug = config.get("data", {}), config.get("aug", {})
    return ModelSpec(config["model"]["name"], dict(config["model"].get("kwargs", {})), None, data.get("img_size"),
                     aug.get("crop_pct"), aug.get("interpolation"))


def load_model_spec(spec: str, img_size: int) -> torch.nn.Module:
    """``NAME``, ``CONFIG.yaml`` or either with ``:CHECKPOINT`` -> a model in eval mode at ``img_size``.

    The model is the one ``resolve_model`` finds: a ``train.py`` checkpoint's own model and
    keywords, a training config's, or the name; the class count is the checkpoint's. Call after the
    model registrations are imported.
    """
    import timm

    from .config import load_config

    source, _, path = spec.partition(":")
    config = load_config(source) if source.endswith((".yaml", ".yml")) else None
    checkpoint = read_checkpoint(path) if path else None
    state = unwrap_state_dict(checkpoint, path=path, ema_option=None) if checkpoint is not None else None
    resolved = resolve_model(checkpoint, None if config else source, config=config)
    extra = {} if resolved.num_classes is None else {"num_classes": resolved.num_classes}
    model = timm.create_model(resolved.name, img_size=img_size, **resolved.kwargs, **extra)
    if state is not None:
        load_weights(model, state, path)
    return model.eval()


def load_model_specs(specs: list[str], img_size: int) -> dict[str, torch.nn.Module]:
    """``load_model_spec`` of every spec, all loaded before any is used, so a bad one fails first."""
    return {spec: load_model_spec(spec, img_size) for spec in specs}


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
