"""Model speed and memory: inference and training throughput, step time and peak memory over resolutions.

    python scripts/benchmark.py                                   # CPU (or CUDA when present), fp32
    python scripts/benchmark.py --img-sizes 224 1024 --dtype bfloat16 --batch-size 256 --compile blocks

For each model and resolution: inference (forward, no grad) and training (forward, cross-entropy,
backward, AdamW step) time per batch and images per second, medians of interleaved rounds (all
models of a resolution timed in one process), and the peak memory of each (``mhla.benchmark.peak_memory``):
on CUDA of the timed calls themselves, in this process (``max_memory_allocated`` counts what is allocated,
not what the caching allocator keeps, so the other models' steps leave no trace in it); on the CPU in a
fresh process each; what a training forward keeps for backward (whole model, MiB; one attention layer,
floats per token in units of C: SDPA keeps q, k, v, the output and a log-sum-exp, about 5 C with the
layer's input); parameters and GMACs (counted on the meta device); then the ratios that say whether MHLA
is worth it (MHLA against linear and softmax attention of the same size, and against timm's own DeiT-T),
each beside its target from ``mhla.targets`` (the CPU's or the GPU's table, by ``--device``). Writes
``<out-dir>/benchmark.csv`` after each resolution, then ``<out-dir>/benchmark.{json,md}`` and ``throughput.png``.
``--compile`` compiles the whole model, ``--compile blocks`` each transformer block (``mhla.training.compiling``:
a cold start a quarter as long).
``--no-memory`` leaves the peak memory out (NaN; on the CPU a compiled model compiles again in each fresh
process). ``--backend`` (``mhla.backend``) picks the attention's implementation in our linear-attention and MHLA
models: ``triton`` times them on the Triton kernels (on CUDA, or on the CPU under ``TRITON_INTERPRET=1``); timm's and
the softmax models have none. Each row names the backend its model ran on (``torch`` or ``triton``, empty for the
models without one).
"""
import argparse
import contextlib
import functools
import json
import math
import sys
from pathlib import Path

import timm
import torch

import models  # noqa: F401  (registers the models)
from mhla import backend as backends
from mhla import benchmark as bench
from mhla import targets as goals
from mhla.flops import count_macs
from mhla.training.compiling import compile_blocks

DEFAULT_MODELS = ["deit_tiny_patch16_224", "deit_tiny_softmax", "deit_tiny_linear_lepe", "deit_tiny_mhla",
                  "deit_small_softmax", "deit_small_linear_lepe", "deit_small_mhla"]
MODES = ("inference", "train")
DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
COMPILE = ("none", "model", "blocks")
TIMM_DEIT = "deit_tiny_patch16_224"
HIGH_RES = 1024  # px: 4,096 tokens, where linear attention has to pay off
TRAIN_VS_SOFTMAX = {224: "model.train_vs_softmax_224", HIGH_RES: "model.train_vs_softmax_1024"}  # target by px


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--img-sizes", type=int, nargs="+", default=[224, 384, 512, 1024])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="autocast dtype (float32: none)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", nargs="?", const="model", choices=COMPILE, default="none",
                        help="torch.compile the whole model (--compile) or each of its blocks (--compile blocks)")
    parser.add_argument("--min-run-time", type=float, default=2.0, help="seconds of timed runs per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/benchmark"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak memory (on the CPU one fresh process per model and mode, where a "
                             "compiled model compiles again); peak_mib is NaN and the memory ratios are left out")
    parser.add_argument("--backend", choices=backends.BACKENDS, default="auto",
                        help="the attention's implementation in our linear-attention and MHLA models (mhla.backend)")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "IMG_SIZE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in args.models:
        if not timm.is_model(name):
            parser.error(f"--models: unknown model {name!r}")
    for size in args.img_sizes:
        if size % 16:
            parser.error(f"--img-sizes: {size} is not divisible by the patch size 16")
    try:
        backends.check_backend(args.backend)
        args.resolved_backend = "triton" if backends.uses_triton(args.backend, torch.device(args.device)) else "torch"
    except ValueError as error:
        parser.error(f"--backend: {error}")
    return args


@functools.cache
def takes_backend(name: str) -> bool:
    """Whether ``name`` is one of our linear-attention or MHLA models (built on the meta device to ask)."""
    with torch.device("meta"):
        return getattr(timm.create_model(name), "attn_type", "softmax") != "softmax"


def create(name: str, img_size: int, args):
    """``name`` at ``img_size`` on ``--device``, on ``--backend`` where the model takes one."""
    kwargs = dict(backend=args.backend) if takes_backend(name) else {}
    return timm.create_model(name, img_size=img_size, **kwargs).to(args.device)


def build_call(name: str, img_size: int, mode: str, args):
    """A function running one inference batch or one training step of ``name`` at ``img_size``."""
    device = torch.device(args.device)
    model = create(name, img_size, args)
    if args.compile == "model":
        model = torch.compile(model)
    elif args.compile == "blocks":
        compile_blocks(model)
    x = torch.randn(args.batch_size, 3, img_size, img_size, device=device)
    autocast = (torch.autocast(device.type, dtype=DTYPES[args.dtype]) if DTYPES[args.dtype]
                else contextlib.nullcontext())
    if mode == "inference":
        model.eval()

        def call():
            with torch.no_grad(), autocast:
                return model(x)
        return call
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device.type) if args.dtype == "float16" else None
    target = torch.randint(0, 1000, (args.batch_size,), device=device)

    def call():
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = torch.nn.functional.cross_entropy(model(x), target)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    return call


def memory_worker(args) -> float:
    """Peak memory (MiB) of one call in this fresh process, after one warm-up call."""
    name, size, mode = args.worker[0], int(args.worker[1]), args.worker[2]
    bench.return_freed_memory()
    call = build_call(name, size, mode, args)
    call()
    return bench.peak_memory(call, torch.device(args.device)) / 2 ** 20


def measure_memory(args, name: str, size: int, mode: str) -> float:
    cmd = [sys.executable, __file__, "--worker", name, str(size), mode, "--models", name, "--img-sizes", str(size),
           "--batch-size", str(args.batch_size), "--dtype", args.dtype, "--device", args.device,
           "--backend", args.backend]
    cmd += ["--compile", args.compile]
    return bench.peak_memory_in_worker(cmd, f"{name} {size}px {mode}")


def measure_kept(args, name: str, size: int) -> tuple[float, float]:
    """What a training forward keeps for backward: MiB for the whole model, and floats per token (in units of
    C) for one attention layer (``mhla.benchmark.saved_bytes``)."""
    model = create(name, size, args)
    x = torch.randn(args.batch_size, 3, size, size, device=args.device)
    autocast = (torch.autocast(x.device.type, dtype=DTYPES[args.dtype]) if DTYPES[args.dtype]
                else contextlib.nullcontext())

    def forward():
        with autocast:
            return model(x).sum()

    attn = model.blocks[len(model.blocks) // 2].attn
    whole = bench.saved_bytes(forward, exclude=model.parameters())
    layer = bench.saved_bytes(forward, exclude=model.parameters(), within=attn)
    tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    return whole / 2 ** 20, layer / (args.batch_size * tokens * model.embed_dim * 4)


def measure_size(args, size: int) -> tuple[dict, dict]:
    """Median time (ms) and spread (%) per (model, mode) at ``size``, all timed in interleaved rounds, and the
    peak memory (MiB) of each: NaN with ``--no-memory``, of the timed calls on CUDA, else in fresh processes."""
    calls = {(name, mode): build_call(name, size, mode, args) for name in args.models for mode in MODES}
    times = bench.time_interleaved(calls, args.min_run_time, args.rounds)
    device = torch.device(args.device)
    if args.no_memory:
        peaks = {key: math.nan for key in calls}
    elif device.type == "cuda":
        peaks = {key: bench.peak_memory(call, device) / 2 ** 20 for key, call in calls.items()}
    else:
        peaks = {(name, mode): measure_memory(args, name, size, mode) for name, mode in calls}
    return times, peaks


def model_size(name: str, size: int) -> tuple[float, float]:
    """Parameters (millions) and GMACs of one forward at batch 1, counted on the meta device (no compute)."""
    with torch.device("meta"):
        model = timm.create_model(name, img_size=size).eval()
    return sum(p.numel() for p in model.parameters()) / 1e6, count_macs(model, (3, size, size)) / 1e9


def ratios(rows: list[dict], device: str) -> list[dict]:
    """MHLA against its baselines wherever both were measured: ratio, target and whether it is met.

    Per model size (tiny, small) and resolution: MHLA / linear step time (against ``*_linear_lepe``, the same
    network with one block, so the ratio is the cost of the blocks), softmax / MHLA step time (the speed-up) and
    MHLA / softmax training-step time, MHLA / softmax and linear / softmax training peak memory; at 224 px, MHLA-T /
    timm's DeiT-T inference and training throughput. Each target is that of ``device``'s table (``mhla.targets``),
    or none where the table has none for the ratio at that resolution.
    """
    table = goals.for_device(device)
    by_key = {(r["model"], r["img_size"], r["mode"]): r for r in rows}
    out = []

    def add(name, size, mode, value, *keys):
        """One ratio; its target is the first of ``keys`` (None: no key) that the table holds, if any."""
        target = next((table[key] for key in keys if key in table), None)
        out.append(dict(ratio=name, img_size=size, mode=mode, value=value,
                        target=None if target is None else target.goal,
                        met=None if target is None else target.met(value)))

    for size in sorted({r["img_size"] for r in rows}):
        for family in ("tiny", "small"):
            mhla, linear, softmax = (f"deit_{family}_{kind}" for kind in ("mhla", "linear_lepe", "softmax"))
            for mode in MODES:
                m, lin, soft = (by_key.get((name, size, mode)) for name in (mhla, linear, softmax))
                if m and lin:
                    add(f"{mhla} / {linear} step time", size, mode, m["step_ms"] / lin["step_ms"],
                        "model.mhla_vs_linear")
                if m and soft:
                    add(f"{softmax} / {mhla} step time (speed-up)", size, mode, soft["step_ms"] / m["step_ms"],
                        "model.speedup_1024" if size == HIGH_RES else None)
                if m and soft and mode == "train":
                    add(f"{mhla} / {softmax} training-step time", size, mode, m["step_ms"] / soft["step_ms"],
                        TRAIN_VS_SOFTMAX.get(size))
            for name in (mhla, linear, f"deit_{family}_linear"):
                m, soft = by_key.get((name, size, "train")), by_key.get((softmax, size, "train"))
                if m and soft and math.isfinite(m["peak_mib"]) and math.isfinite(soft["peak_mib"]):
                    add(f"{name} / {softmax} peak memory", size, "train", m["peak_mib"] / soft["peak_mib"],
                        "model.mhla_memory_vs_softmax_1024" if size == HIGH_RES and name == mhla else None,
                        "model.memory_vs_softmax")
        for mode in MODES:
            m, timm_deit = by_key.get(("deit_tiny_mhla", size, mode)), by_key.get((TIMM_DEIT, size, mode))
            if m and timm_deit:
                add(f"deit_tiny_mhla / {TIMM_DEIT} throughput", size, mode, m["img_per_s"] / timm_deit["img_per_s"],
                    "model.throughput_vs_timm_224" if size == 224 else None)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(memory_worker(args))
        return 0
    bench.keep_freed_memory()
    if args.compile != "none":  # every model, mode and size compiles the same forward again
        bench.allow_compiled_variants(len(args.models) * len(MODES) * len(args.img_sizes))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in args.img_sizes:
        times, peaks = measure_size(args, size)
        for name in args.models:
            params, gmacs = model_size(name, size)
            kept_mib, attn_kept_c = measure_kept(args, name, size)
            for mode in MODES:
                ms, spread = times[(name, mode)]
                rows.append(dict(model=name, img_size=size, mode=mode, batch_size=args.batch_size, dtype=args.dtype,
                                 compile=args.compile, backend=args.resolved_backend if takes_backend(name) else "",
                                 step_ms=ms, spread_pct=spread,
                                 img_per_s=args.batch_size * 1e3 / ms, peak_mib=peaks[(name, mode)],
                                 params_m=params, gmacs=gmacs, kept_mib=kept_mib, attn_kept_c=attn_kept_c))
                print(f"{name:>24} {size:>5}px {mode:<9} {ms:10.1f} ms {rows[-1]['img_per_s']:9.1f} img/s "
                      f"{rows[-1]['peak_mib']:9.1f} MiB", file=sys.stderr)
        bench.write_csv(rows, args.out_dir / "benchmark.csv")
    found = ratios(rows, args.device)
    (args.out_dir / "benchmark.json").write_text(json.dumps(dict(rows=rows, ratios=found), indent=2) + "\n")
    lines = [f"{args.device}, {args.dtype}, batch {args.batch_size}, backend {args.resolved_backend} (linear "
             f"attention and MHLA), {torch.get_num_threads()} threads, "
             f"torch {torch.__version__}{'' if args.compile == 'none' else ', compiled: ' + args.compile}", "",
             "| model | px | params (M) | GMACs | inference img/s | train img/s | train step ms (spread) | "
             "inference MiB | train MiB | kept MiB | attention kept / token |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    by_key = {(r["model"], r["img_size"], r["mode"]): r for r in rows}
    for size in args.img_sizes:
        for name in args.models:
            inf, train = by_key[(name, size, "inference")], by_key[(name, size, "train")]
            lines.append(f"| {name} | {size} | {inf['params_m']:.2f} | {inf['gmacs']:.2f} | {inf['img_per_s']:.1f} | "
                         f"{train['img_per_s']:.1f} | {train['step_ms']:.1f} ({train['spread_pct']:.0f}%) | "
                         f"{inf['peak_mib']:.0f} | {train['peak_mib']:.0f} | {train['kept_mib']:.0f} | "
                         f"{train['attn_kept_c']:.2f} C |")
    if found:
        lines += ["", "| ratio | px | mode | value | target | met |", "|---|---|---|---|---|---|"]
        for r in found:
            met = {True: "yes", False: "**no**", None: ""}[r["met"]]
            lines.append(f"| {r['ratio']} | {r['img_size']} | {r['mode']} | {r['value']:.2f} | {r['target'] or ''} | "
                         f"{met} |")
    report = "\n".join(lines) + "\n"
    (args.out_dir / "benchmark.md").write_text(report)
    if not args.no_plot:
        bench.plot_log_log(rows, x="img_size", y="img_per_s", series="model", panel="mode",
                           panels={mode: mode for mode in MODES}, path=args.out_dir / "throughput.png",
                           xlabel="image size (px)", ylabel="images / s")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
