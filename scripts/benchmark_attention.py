"""Speed and memory of the attention ops: SDPA softmax vs plain linear attention vs MHLA.

For each sequence length N (a square token grid) and each method, times the forward pass (no
grad) and the forward + backward pass, all methods interleaved in one process, and measures the
peak memory of each: on CUDA of the timed calls, in this process; on the CPU in a fresh process
each (see ``scripts/benchmark.py``). ``--compile`` compiles each op (``torch.compile``, one static
graph per size and mode). ``mhla`` is the op on its own contract, block-major inputs (at N = 196
the 4 x 4 blocks are unequal and padded slots are masked); ``mhla_tokens`` adds the partition of
token-order inputs and the gather back. In ``MultiHeadLinearAttention`` that partition takes the
place of the head-split copy every attention module makes, so ``mhla`` is the figure to compare
with ``linear``.

Beside them, the kernels and SDPA with its backend pinned: ``linear_triton`` and ``mhla_triton`` time
``mhla.kernels.qkv_attention`` as the modules call it, from the qkv projection's output ``[B, N, 3C]`` in token
order (without q/k RMSNorm or LePE; MHLA in its block form, as ``mhla``), so they include the head split and the
feature map (ReLU) that ``linear`` and ``mhla`` are given done; ``mhla_triton`` compares with ``mhla_tokens`` and
``linear_triton`` with ``linear``, and the two with each other. ``sdpa_flash`` and ``sdpa_cudnn`` are ``sdpa``
under ``torch.nn.attention.sdpa_kernel`` with FlashAttention or cuDNN attention, on CUDA only (``sdpa`` is
whichever PyTorch picks). ``--compile`` compiles ``sdpa``, ``linear`` and ``mhla`` (and ``mhla_tokens``'s op);
the kernels and the pinned SDPA run as they are, so eager, compiled and Triton sit side by side in one table.

    python scripts/benchmark_attention.py                       # CPU (or CUDA when present)
    python scripts/benchmark_attention.py --sizes 196 1024 --min-run-time 0.2
    python scripts/benchmark_attention.py --device cuda --dtype bfloat16 --compile

Writes ``<out-dir>/attention_benchmark.csv`` after each N, then ``attention_benchmark.{md,png}``, and
prints the Markdown table and the targets of ``mhla.targets`` for ``--device`` (the CPU's or the GPU's table)
that the measured methods and sizes allow: MHLA / linear time, SDPA / MHLA time at N = 4096 and 16384, MHLA / SDPA
time at N = 196 and MHLA's peak memory at N = 16384 / at N = 1024, each for the torch path and, where measured, the
kernels.
"""
import argparse
import functools
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mhla import backend as backends
from mhla import benchmark as bench
from mhla import block_layout, linear_attention, mhla_attention
from mhla import targets as goals
from mhla.benchmark import METHOD_LABELS as LABELS

METHODS = ("sdpa", "linear", "mhla", "mhla_tokens", "linear_triton", "mhla_triton", "sdpa_flash", "sdpa_cudnn")
TRITON = ("linear_triton", "mhla_triton")  # the kernels, from qkv
PINNED_SDPA = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}  # CUDA only
MODES = ("forward", "train")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[196, 256, 1024, 4096, 16384],
                        help="sequence lengths N, each a square number (token grid side = sqrt(N))")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS[:4]),
                        help="default: the torch path's (sdpa, linear, mhla, mhla_tokens), which run anywhere")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-grid", type=int, nargs=2, default=[4, 4], metavar=("BH", "BW"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--compile", action="store_true", help="torch.compile each op (static shapes)")
    parser.add_argument("--min-run-time", type=float, default=1.5, help="seconds of timed runs per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (the median is reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--system-malloc", action="store_true",
                        help="time with glibc's allocator as it is (default: keep freed memory, see mhla.benchmark)")
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/benchmark_attention"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "N", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for n in args.sizes:
        side = math.isqrt(n)
        if side * side != n:
            parser.error(f"--sizes: {n} is not a square number of tokens")
        if side < max(args.block_grid):
            parser.error(f"--sizes: {n} tokens ({side}x{side}) cannot be cut into {args.block_grid} blocks")
    pinned = [m for m in args.methods if m in PINNED_SDPA]
    if pinned and torch.device(args.device).type != "cuda":
        parser.error(f"--methods: {', '.join(pinned)} pin a CUDA backend of SDPA; --device is {args.device}")
    if any(m in TRITON for m in args.methods):
        try:
            backends.check_backend("triton")
            backends.uses_triton("triton", torch.device(args.device))
        except ValueError as error:
            parser.error(f"--methods: {error}")
    return args


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


OPS = {"sdpa": _sdpa, "linear": linear_attention, "mhla": mhla_attention}


@functools.cache
def op(name: str, compiled: bool):
    """The op ``name`` (sdpa, linear, mhla), compiled once for every size and mode (each a static graph)."""
    return torch.compile(OPS[name], dynamic=False) if compiled else OPS[name]


def build_call(method: str, n: int, mode: str, args) -> tuple:
    """Inputs for one measurement and a function running one forward (or forward + backward)."""
    train = mode == "train"
    if method in TRITON:
        return _triton_call(method, n, train, args)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    shape = (args.batch_size, args.heads, n, args.head_dim)
    gen = torch.Generator().manual_seed(0)
    if method in ("sdpa", *PINNED_SDPA):
        q, k = (torch.randn(shape, generator=gen) for _ in range(2))
    else:
        q, k = (torch.rand(shape, generator=gen) for _ in range(2))
    v = torch.randn(shape, generator=gen)
    inputs = [t.to(device, dtype).requires_grad_(train) for t in (q, k, v)]
    grad_out = torch.randn(shape, generator=gen).to(device, dtype)
    side = math.isqrt(n)

    if method in PINNED_SDPA:
        def attend():
            with sdpa_kernel(PINNED_SDPA[method]):
                return _sdpa(*inputs)
    elif method in ("sdpa", "linear"):
        fn = op(method, args.compile)

        def attend():
            return fn(*inputs)
    else:
        fn = op("mhla", args.compile)
        layout = block_layout((side, side), tuple(args.block_grid))
        mixing = torch.full((layout.num_blocks,) * 2, 1.0 / layout.num_blocks, device=device, requires_grad=train)
        key_mask = None if layout.evenly_divided else layout.mask[None].to(device)
        if method == "mhla":
            inputs = [layout.to_blocks(t.detach()).requires_grad_(train) for t in inputs]
            grad_out = layout.to_blocks(grad_out)
        inputs.append(mixing)

        def attend():
            if method == "mhla":
                return fn(*inputs, key_mask=key_mask)
            q_, k_, v_ = (layout.to_blocks(t) for t in inputs[:3])
            return layout.from_blocks(fn(q_, k_, v_, mixing, key_mask=key_mask))

    return _timed(attend, inputs, grad_out, train)


def _timed(attend, leaves: list[torch.Tensor], grad_out: torch.Tensor, train: bool):
    """One call of ``attend``: without grad, or forward + backward of ``grad_out`` into ``leaves``."""
    if not train:
        def call():
            with torch.no_grad():
                return attend()
    else:
        def call():
            for t in leaves:
                t.grad = None
            attend().backward(grad_out)
    return call


def _triton_call(method: str, n: int, train: bool, args):
    """The kernels (``mhla.kernels.qkv_attention``) from qkv ``[B, N, 3C]``; MHLA with uniform W, block form."""
    from mhla.kernels import qkv_attention  # needs triton (checked by parse_args)

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    dim = args.heads * args.head_dim
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(args.batch_size, n, 3 * dim, generator=gen).to(device, dtype).requires_grad_(train)
    grad_out = torch.randn(args.batch_size, n, dim, generator=gen).to(device, dtype)
    leaves, options = [qkv], {}
    if method == "mhla_triton":
        side = math.isqrt(n)
        layout = block_layout((side, side), tuple(args.block_grid), device=device)
        mixing = torch.full((layout.num_blocks,) * 2, 1.0 / layout.num_blocks, device=device, requires_grad=train)
        leaves.append(mixing)
        options = dict(mixing=mixing, layout=layout)

    def attend():
        return qkv_attention(qkv, args.heads, **options)
    return _timed(attend, leaves, grad_out, train)


def run_worker(args) -> float:
    """Peak memory (MiB) of one call in this fresh process, after a warm-up on a small grid."""
    method, n, mode = args.worker[0], int(args.worker[1]), args.worker[2]
    if args.threads:
        torch.set_num_threads(args.threads)
    bench.return_freed_memory()
    build_call(method, (2 * max(args.block_grid)) ** 2, mode, args)()
    call = build_call(method, n, mode, args)
    if args.compile:  # compile outside the measurement
        call()
    return bench.peak_memory(call, torch.device(args.device)) / 2 ** 20


def setup(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.system_malloc:
        bench.keep_freed_memory()
    if args.compile:  # one static graph per op, size and mode (and the memory worker's warm-up grid)
        bench.allow_compiled_variants(len(MODES) * (len(args.sizes) + 1))


def measure_memory(args, method: str, n: int, mode: str) -> float:
    """Run one memory worker in a fresh process and return its peak (MiB)."""
    cmd = [sys.executable, __file__, "--worker", method, str(n), mode, "--batch-size", str(args.batch_size),
           "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--block-grid", *map(str, args.block_grid),
           "--device", args.device, "--dtype", args.dtype]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.compile:
        cmd.append("--compile")
    return bench.peak_memory_in_worker(cmd, f"{method} N={n} {mode}")


def measure_size(args, n: int) -> tuple[dict, dict]:
    """Median time (ms) and spread (%) of every (method, mode) at N, all timed in interleaved rounds, and the
    peak memory (MiB) of each: of the timed calls on CUDA, else in fresh processes."""
    calls = {(m, mode): build_call(m, n, mode, args) for m in args.methods for mode in MODES}
    times = bench.time_interleaved(calls, args.min_run_time, args.rounds)
    device = torch.device(args.device)
    if device.type == "cuda":
        peaks = {key: bench.peak_memory(call, device) / 2 ** 20 for key, call in calls.items()}
    else:
        peaks = {(m, mode): measure_memory(args, m, n, mode) for m, mode in calls}
    return times, peaks


def markdown_table(rows: list[dict], methods: list[str], sizes: list[int]) -> str:
    """One line per N: forward time, forward + backward time and training peak memory of every method."""
    by_key = {(r["method"], r["n"], r["mode"]): r for r in rows}
    header = ["N"] + [f"{m} fwd ms" for m in methods] + [f"{m} fwd+bwd ms" for m in methods] + \
             [f"{m} fwd+bwd MiB" for m in methods]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for n in sizes:
        cells = [str(n)]
        cells += [f"{by_key[(m, n, 'forward')]['time_ms']:.2f}" for m in methods]
        cells += [f"{by_key[(m, n, 'train')]['time_ms']:.2f}" for m in methods]
        cells += [f"{by_key[(m, n, 'train')]['peak_mib']:.1f}" for m in methods]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(rows: list[dict], device: str) -> list[tuple[str, float, str, bool]]:
    """The targets of ``device``'s table (``mhla.targets``) that the measured methods and sizes allow:
    (name, value, goal, met); MHLA's on the torch path and on the kernels, the speed-ups against each SDPA
    measured."""
    table = goals.for_device(device)
    by_key = {(r["method"], r["n"], r["mode"]): r for r in rows}
    result = []

    def add(target: str, name: str, numerator: tuple, denominator: tuple, key: str = "time_ms") -> None:
        if target in table and numerator in by_key and denominator in by_key:
            ratio = by_key[numerator][key] / by_key[denominator][key]
            result.append((name, ratio, table[target].goal, table[target].met(ratio)))

    for n in sorted({r["n"] for r in rows}):
        for mode in MODES:
            for mhla, linear in (("mhla", "linear"), ("mhla_triton", "linear_triton")):
                add("op.mhla_vs_linear", f"{LABELS[mhla]} / {LABELS[linear]} time, N={n}, {mode}", (mhla, n, mode),
                    (linear, n, mode))
    for mhla in ("mhla", "mhla_triton"):
        for sdpa in ("sdpa", *PINNED_SDPA):
            for target, n in (("op.speedup_4096", 4096), ("op.speedup_16384", 16384)):
                add(target, f"{LABELS[sdpa]} / {LABELS[mhla]} time, N={n}, train", (sdpa, n, "train"),
                    (mhla, n, "train"))
        for mode in MODES:
            add("op.mhla_vs_sdpa_196", f"{LABELS[mhla]} / SDPA time, N=196, {mode}", (mhla, 196, mode),
                ("sdpa", 196, mode))
        add("op.memory_growth", f"{LABELS[mhla]} peak memory N=16384 / N=1024, train", (mhla, 16384, "train"),
            (mhla, 1024, "train"), key="peak_mib")
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(run_worker(args))
        return
    setup(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.sizes:
        times, peaks = measure_size(args, n)
        for method in args.methods:
            for mode in MODES:
                time_ms, spread = times[(method, mode)]
                peak = peaks[(method, mode)]
                rows.append(dict(method=method, n=n, mode=mode, time_ms=time_ms, spread_pct=spread, peak_mib=peak))
                print(f"{method:>11} N={n:<6} {mode:<7} {time_ms:10.2f} ms (spread {spread:3.0f}%) {peak:9.1f} MiB",
                      file=sys.stderr)
        bench.write_csv(rows, args.out_dir / "attention_benchmark.csv")
    setting = (f"B={args.batch_size}, H={args.heads}, D={args.head_dim}, M={args.block_grid[0] * args.block_grid[1]}, "
               f"{args.device}, {args.dtype}{', compiled' if args.compile else ''}, {torch.get_num_threads()} threads, "
               f"torch {torch.__version__}")
    table = markdown_table(rows, args.methods, args.sizes)
    target_lines = ["| target | measured | goal | met |", "|---|---|---|---|"]
    for name, value, goal, met in targets(rows, args.device):
        target_lines.append(f"| {name} | {value:.2f} | {goal} | {'yes' if met else 'no'} |")
    report = f"{setting}\n\n{table}\n\n" + "\n".join(target_lines) + "\n"
    (args.out_dir / "attention_benchmark.md").write_text(report)
    if not args.no_plot:
        bench.plot_log_log(rows, x="n", y="time_ms", series="method", panel="mode",
                           panels={"forward": "forward", "train": "forward + backward"},
                           path=args.out_dir / "attention_benchmark.png", xlabel="tokens N", ylabel="time (ms)",
                           sharey=True)
    print(report)


if __name__ == "__main__":
    main()
