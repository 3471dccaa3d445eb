"""The GPU check: the environment, the CUDA tests and the bf16 benchmarks of the models and the op, in one report.

    python scripts/gpu_check.py                          # on a GPU machine: ~8 min on one H200 (estimated)
    python scripts/gpu_check.py --dry-run                # the environment and the plan; runs nothing
    python scripts/gpu_check.py --smoke --device cpu     # the eager steps with tiny settings (minutes on 2 cores)
    python scripts/gpu_check.py --steps models-eager-1024 models-compiled-1024

Each step runs in a subprocess with a timeout, its output in ``<out-dir>/logs/<step>.log``: the CUDA-marked tests
(``pytest -q -m cuda tests/``, the Triton kernels' among them); ``scripts/benchmark_attention.py`` at 196, 1,024,
4,096 and 16,384 tokens (B = 8, H = 3, D = 64): SDPA, linear attention and MHLA on the torch path eager and
compiled, and eager only the Triton kernels (``linear_triton``, ``mhla_triton``) and SDPA pinned to FlashAttention
and to cuDNN attention; ``scripts/benchmark.py`` at 224, 512, 1024 and 2048 px (timm's DeiT-T, our softmax DeiT-T,
linear attention with LePE and MHLA; batch 256, 64, 16 and 4), at 224, 512 and 1024 px once more with
``--backend triton`` (our softmax DeiT-T beside linear attention and MHLA on the kernels) and, compiled block by
block (``--compile blocks``: regional compilation, a quarter of the whole model's cold start), at
``--compile-sizes`` (default 224 and 1024 px: MHLA and its target's baseline, timm's DeiT-T at 224 px and our
softmax DeiT-T at the others). ``--no-compile`` leaves the compiled steps out (the default with ``--smoke``); off
CUDA the kernels' methods and steps and the pinned SDPA are left out (``kernels_run``). A step that fails, runs out
of memory or runs over its timeout (it is killed with its children) prints one line naming it, and the check goes
on; the exit code is 1 if any step failed. ``--time-limit`` bounds the whole check: a step gets at most the time
left, and a step with none left is not run (and fails). The steps run in order of importance: the tests, the op,
the models eager, on the kernels and compiled at 224 and 1024 px (the targets), the op compiled, then 512 and 2048
px. A step first deletes its earlier output directory, and the report reads every result under ``--out-dir``, so
``--steps`` completes an earlier report.

Writes ``--out`` (default ``<out-dir>/gpu_report.md``): the environment, the steps, the test result, the tables
read from the benchmarks' CSV files (each model row naming the backend it ran on) and the targets of
``mhla.targets`` for ``--device`` (the GPU's table on CUDA), each "met" or "not met": SDPA / MHLA op time forward +
backward at 4,096 tokens (the torch path and the kernels, against each SDPA measured) and at 16,384 (the kernels);
``deit_tiny_mhla`` / timm's DeiT-T throughput at 224 px (compiled, batch 256); MHLA / softmax training-step time at
224 and 1024 px (on the kernels, and each other run); MHLA / linear time and the training peak memory against
softmax's.
"""
import argparse
import csv
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from mhla import backend as backends
from mhla import targets as goals
from mhla.benchmark import METHOD_LABELS as LABELS

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["deit_tiny_patch16_224", "deit_tiny_softmax", "deit_tiny_linear_lepe", "deit_tiny_mhla"]
TIMM_DEIT, SOFTMAX, LINEAR, MHLA = MODELS
# Images per batch at each resolution: about 50,000-65,000 tokens a batch.
BATCH_SIZES = {224: 256, 512: 64, 1024: 16, 2048: 4}
FIRST = (224, 1024)  # the targets' resolutions run first (eager, on the kernels, compiled), then the others
OP_SIZES = [196, 1024, 4096, 16384]  # the token counts of 224, 512, 1024 and 2048 px
OP_METHODS = ["sdpa", "linear", "mhla"]  # the torch path, eager and compiled
KERNEL_METHODS = ["linear_triton", "mhla_triton"]  # the Triton kernels, eager only (each is its own kernel)
PINNED_SDPA = ["sdpa_flash", "sdpa_cudnn"]  # SDPA with its backend named, CUDA only
TRITON_SIZES = (224, 512, 1024)  # the models on the kernels, beside the eager torch path
TRITON_MODELS = [SOFTMAX, LINEAR, MHLA]  # softmax: the targets' baseline, timed in the same process
# The model runs (each a directory <out-dir>/models/<run>-<px>) and how the report names them.
RUNS = ("eager", "triton", "compiled")
RUN_NAMES = {"eager": "eager", "triton": "eager on the kernels", "compiled": "compiled"}
MODEL_TIMING = dict(min_run_time=0.5, rounds=3)  # seconds of timed calls per model and mode, in interleaved rounds
OP_TIMING = dict(min_run_time=0.3, rounds=3)
# Expected seconds per step on one H200 (estimates, not measured: see docs/benchmarks.md, "Running the GPU check").
EXPECTED = {"tests": 75, "attention": 45, "attention-compiled": 80, "eager": 20, "triton": 25, "compiled": 55}
SMOKE = dict(batch_sizes={64: 2}, op_sizes=[64, 256], timing=dict(min_run_time=0.05, rounds=2))
TIME_LIMIT = 470  # s: the whole check stays under 8 minutes
OOM_MARKERS = ("out of memory", "outofmemoryerror")
PYTEST_SUMMARY = re.compile(r"(\d+ (passed|failed|skipped|deselected|errors?|xfailed|xpassed)|no tests ran)"
                            r".* in \d+(\.\d+)?s")


@dataclass(frozen=True)
class Step:
    """One subprocess: its name (``--steps``), command (run from the repository root), timeout, expected time and
    output directory (emptied before it runs, so that a failed step leaves no earlier run's results)."""

    name: str
    cmd: list[str]
    timeout: float
    estimate: float
    out_dir: Path | None = None

    def display(self) -> str:
        """The command as one would type it in the repository root."""
        return shlex.join(["python"] + [_relative(arg) for arg in self.cmd[1:]])


@dataclass(frozen=True)
class StepResult:
    name: str
    ok: bool
    seconds: float
    message: str  # "ok", or the one-line failure
    log: Path | None


def _relative(arg: str) -> str:
    path = Path(arg)
    if path.is_absolute() and path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    return arg


def compiled_models(size: int) -> list[str]:
    """What the compiled run at ``size`` times: its target's baseline (timm's DeiT-T at 224 px, else our softmax
    DeiT-T on FlashAttention) and MHLA."""
    return [TIMM_DEIT if size == 224 else SOFTMAX, MHLA]


def kernels_run(device: str) -> bool:
    """Whether the check times the Triton kernels: on CUDA, with the ``triton`` package (``mhla.backend``). Not on
    the CPU, even under ``TRITON_INTERPRET=1``: there the smoke run's op alone ran past its 3 minutes."""
    try:
        backends.check_backend("triton")
    except ValueError:
        return False
    return torch.device(device).type == "cuda"


def plan(args: argparse.Namespace) -> list[Step]:
    """The steps of the check, in the order they run."""
    batch_sizes = SMOKE["batch_sizes"] if args.smoke else BATCH_SIZES
    op_sizes = SMOKE["op_sizes"] if args.smoke else OP_SIZES
    model_timing = SMOKE["timing"] if args.smoke else MODEL_TIMING
    op_timing = SMOKE["timing"] if args.smoke else OP_TIMING
    common = ["--device", args.device, "--dtype", args.dtype]
    python = sys.executable

    def timing(t):
        return ["--min-run-time", str(t["min_run_time"]), "--rounds", str(t["rounds"])]

    cuda, kernels = torch.device(args.device).type == "cuda", kernels_run(args.device)

    def models_step(size: int, kind: str) -> Step:
        """``kind``: "eager", "triton" (eager, ``--backend triton``) or "compiled"."""
        out_dir = args.out_dir / "models" / f"{kind}-{size}"
        models = {"eager": MODELS, "triton": TRITON_MODELS, "compiled": compiled_models(size)}[kind]
        cmd = [python, "scripts/benchmark.py", *common, "--models", *models, "--img-sizes", str(size),
               "--batch-size", str(batch_sizes[size]), *timing(model_timing), "--out-dir", str(out_dir)]
        if kind == "triton":
            cmd += ["--backend", "triton"]
        if kind == "compiled":  # on the CPU, no fresh-process memory workers: each would compile again
            cmd += ["--compile", "blocks"] + ([] if cuda else ["--no-memory"])
        return Step(f"models-{kind}-{size}", cmd, timeout=300 if kind == "compiled" else 150,
                    estimate=EXPECTED[kind], out_dir=out_dir)

    def attention_step(compiled: bool) -> Step:
        name = "attention-compiled" if compiled else "attention"
        methods = OP_METHODS + ([] if compiled else (PINNED_SDPA if cuda else []) + (KERNEL_METHODS if kernels else []))
        cmd = [python, "scripts/benchmark_attention.py", *common, "--sizes", *map(str, op_sizes),
               "--methods", *methods, *timing(op_timing), "--out-dir", str(args.out_dir / name)]
        return Step(name, cmd + (["--compile"] if compiled else []), timeout=300 if compiled else 180,
                    estimate=EXPECTED[name], out_dir=args.out_dir / name)

    sizes = list(batch_sizes)
    triton_sizes = [size for size in sizes if kernels and (size in TRITON_SIZES or args.smoke)]
    steps = [Step("tests", [python, "-m", "pytest", "-q", "-m", "cuda", "tests/", "-p", "no:cacheprovider"],
                  timeout=180, estimate=EXPECTED["tests"]), attention_step(False)]
    for first in (True, False):
        steps += [models_step(size, "eager") for size in sizes if (size in FIRST) == first]
        steps += [models_step(size, "triton") for size in triton_sizes if (size in FIRST) == first]
        steps += [models_step(size, "compiled") for size in args.compile_sizes if (size in FIRST) == first]
        if first and not args.no_compile:
            steps.append(attention_step(True))
    return steps


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                        help="the benchmarks' dtype (autocast for the models, the inputs' dtype for the op)")
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/gpu_check"),
                        help="the benchmarks' outputs, the logs and (by default) the report")
    parser.add_argument("--out", type=Path, default=None, help="the report (default: <out-dir>/gpu_report.md)")
    parser.add_argument("--compile-sizes", type=int, nargs="+", default=None,
                        help=f"resolutions of the compiled model benchmark (default: the targets', {list(FIRST)})")
    parser.add_argument("--no-compile", action="store_true",
                        help="no compiled step, of the models or the op (the default with --smoke)")
    parser.add_argument("--steps", nargs="+", default=None, help="run only these steps (names: --dry-run)")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT, help="seconds for all the steps together")
    parser.add_argument("--smoke", action="store_true",
                        help=f"tiny settings ({list(SMOKE['batch_sizes'])} px, {SMOKE['op_sizes']} tokens) to "
                             "check the wiring, e.g. on a CPU")
    parser.add_argument("--dry-run", action="store_true", help="print the environment and the plan; run nothing")
    args = parser.parse_args(argv)
    args.out_dir = args.out_dir.resolve()
    args.out = (args.out or args.out_dir / "gpu_report.md").resolve()
    sizes = SMOKE["batch_sizes"] if args.smoke else BATCH_SIZES
    if args.no_compile and args.compile_sizes is not None:
        parser.error("--compile-sizes and --no-compile exclude each other")
    if args.smoke and args.compile_sizes is None:
        args.no_compile = True
    if args.no_compile:
        args.compile_sizes = []
    elif args.compile_sizes is None:
        args.compile_sizes = [size for size in sizes if size in FIRST]
    for size in args.compile_sizes:
        if size not in sizes:
            parser.error(f"--compile-sizes: {size} is not one of the check's resolutions {sorted(sizes)}")
    steps = plan(args)
    if args.steps:
        unknown = set(args.steps) - {step.name for step in steps}
        if unknown:
            parser.error(f"--steps: unknown {sorted(unknown)}; the steps are {[step.name for step in steps]}")
    return args


# Running the steps


def _last_line(log: Path) -> str:
    """The last non-empty line of ``log`` (its end only), shortened to one short line."""
    with open(log, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
        lines = [line.strip() for line in f.read().decode(errors="replace").splitlines()[1:] if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= 200 else line[:197] + "..."


def _ran_out_of_memory(log: Path) -> bool:
    with open(log, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
        text = f.read().decode(errors="replace").lower()
    return any(marker in text for marker in OOM_MARKERS)


def run_step(step: Step, log_dir: Path, timeout: float | None = None) -> StepResult:
    """Run ``step`` in a session of its own, its output in ``log_dir/<name>.log``; never raises for the step's sake.

    Past ``timeout`` (default ``step.timeout``) the step and every process it started are killed. A failure is
    one line: ``FAILED <name>: <why> after <seconds> s: <last line of its output> (log: <path>)``.
    """
    timeout = step.timeout if timeout is None else timeout
    log_dir.mkdir(parents=True, exist_ok=True)
    if step.out_dir is not None and step.out_dir.exists():
        shutil.rmtree(step.out_dir)
    log = log_dir / f"{step.name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    with open(log, "w") as out:
        out.write(f"$ {step.display()}\n")
        out.flush()
        try:
            proc = subprocess.Popen(step.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=ROOT, env=env, start_new_session=True)
        except OSError as error:
            return StepResult(step.name, False, 0.0, f"FAILED {step.name}: could not start: {error}", log)
        try:
            code = proc.wait(timeout=timeout)
            why = None
        except subprocess.TimeoutExpired:
            why = f"timed out after {timeout:.0f} s"
        except BaseException:  # Ctrl-C: take the step's processes down too
            _kill_session(proc)
            raise
        finally:
            if proc.poll() is None:
                _kill_session(proc)
    seconds = time.monotonic() - start
    if why is None and code == 0:
        return StepResult(step.name, True, seconds, "ok", log)
    if why is None:
        signal_name = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        why = f"out of memory ({signal_name})" if _ran_out_of_memory(log) else signal_name
        why += f" after {seconds:.0f} s"
    last = _last_line(log)
    return StepResult(step.name, False, seconds,
                      f"FAILED {step.name}: {why}" + (f": {last}" if last else "") + f" (log: {_relative(str(log))})",
                      log)


def _kill_session(proc: subprocess.Popen) -> None:
    """Kill the step's process group (the step and what it started: the benchmarks' memory workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_steps(steps: list[Step], log_dir: Path, time_limit: float = TIME_LIMIT, echo=print) -> list[StepResult]:
    """Every step in turn, each given at most the time left of ``time_limit``; one line per step to ``echo``."""
    deadline = time.monotonic() + time_limit
    results = []
    for i, step in enumerate(steps, 1):
        left = deadline - time.monotonic()
        if left < 1:
            result = StepResult(step.name, False, 0.0,
                                f"FAILED {step.name}: not run, the time limit ({time_limit:.0f} s) was reached", None)
        else:
            echo(f"[{i}/{len(steps)}] {step.name}: {step.display()}", flush=True)
            result = run_step(step, log_dir, min(step.timeout, left))
        echo(f"[{i}/{len(steps)}] {step.name}: ok ({result.seconds:.0f} s)" if result.ok else result.message,
             flush=True)
        results.append(result)
    return results


# The environment


def _command_output(cmd: list[str]) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def environment(device: str) -> dict[str, str]:
    """What the figures were measured with: software versions, the GPU and its driver, the CPU, the commit."""
    import timm

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "CUDA (torch's build)": torch.version.cuda or "none"}
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    env["cuDNN"] = str(cudnn) if cudnn else "none"
    if torch.cuda.is_available():
        target = torch.device(device)
        props = torch.cuda.get_device_properties(target.index if target.type == "cuda" and target.index else 0)
        env["GPU"] = (f"{props.name}, {props.total_memory / 2 ** 30:.1f} GiB, "
                      f"compute capability {props.major}.{props.minor}, {torch.cuda.device_count()} device(s)")
        env["driver"] = (_command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
                         or "unknown").splitlines()[0]
    else:
        env["GPU"] = "none (torch.cuda.is_available() is False)"
    env["timm"] = timm.__version__
    env["CPU"] = f"{os.cpu_count()} cores, {platform.machine()}"
    commit = _command_output(["git", "rev-parse", "--short", "HEAD"])
    if commit and _command_output(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += " (with uncommitted changes)"
    env["commit"] = commit or "unknown"
    return env


# The report


@dataclass(frozen=True)
class Outcome:
    """One target of the report: what was measured against it and its goal (``mhla.targets.Target.goal``)."""

    name: str
    value: float | None  # None: not measured
    goal: str
    met: bool | None


def _outcome(name: str, numerator: float | None, denominator: float | None, target: goals.Target) -> Outcome:
    value = None
    if numerator is not None and denominator and math.isfinite(numerator) and math.isfinite(denominator):
        value = numerator / denominator
    return Outcome(name, value, target.goal, None if value is None else target.met(value))


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_model_rows(out_dir: Path) -> list[dict]:
    """Every row of ``<out-dir>/models/<run>-<px>/benchmark.csv`` (``scripts/benchmark.py``), numbers parsed;
    ``run`` is the directory's (``RUNS``), ``backend`` empty where an earlier CSV has no such column."""
    rows = []
    for path in sorted((out_dir / "models").glob("*/benchmark.csv")):
        run = path.parent.name.split("-")[0]
        for r in _read_csv(path):
            rows.append(dict(r, img_size=int(r["img_size"]), batch_size=int(r["batch_size"]), run=run,
                             backend=r.get("backend", ""),
                             **{key: float(r[key]) for key in ("step_ms", "spread_pct", "img_per_s", "peak_mib")}))
    return rows


def read_op_rows(out_dir: Path) -> list[dict]:
    """The rows of ``<out-dir>/attention{,-compiled}/attention_benchmark.csv`` (``scripts/benchmark_attention.py``),
    each with ``compiled`` set."""
    rows = []
    for compiled, name in ((False, "attention"), (True, "attention-compiled")):
        path = out_dir / name / "attention_benchmark.csv"
        if path.exists():
            rows += [dict(r, n=int(r["n"]), compiled=compiled,
                          **{key: float(r[key]) for key in ("time_ms", "spread_pct", "peak_mib")})
                     for r in _read_csv(path)]
    return rows


def targets(model_rows: list[dict], op_rows: list[dict], device: str) -> list[Outcome]:
    """The headline targets (listed, measured or not), then the others where measured, each against the target of
    ``device``'s table (``mhla.targets``; a ratio whose target the table lacks is left out).

    Headline: the op's SDPA / MHLA time at 4,096 tokens (the torch path eager and compiled, the kernels) and at
    16,384 (the kernels); ``deit_tiny_mhla`` / timm's DeiT-T throughput at 224 px compiled; softmax / MHLA step
    time at 1024 px (the torch path); MHLA / softmax training-step time at 224 and 1024 px on the kernels. Where
    measured: the same against pinned SDPA and for the other runs, MHLA / linear time (op and models) and the
    training peak memory against softmax's.
    """
    table = goals.for_device(device)
    models = {(r["model"], r["img_size"], r["mode"], r["run"]): r for r in model_rows}
    op = {(r["method"], r["n"], r["mode"], r["compiled"]): r["time_ms"] for r in op_rows}
    op_kinds = [False] + ([True] if any(compiled for *_, compiled in op) else [])
    found = []

    def add(name: str, numerator: float | None, denominator: float | None, target: str) -> None:
        if target in table:
            found.append(_outcome(name, numerator, denominator, table[target]))

    def model(name, size, mode, run, key):
        row = models.get((name, size, mode, run))
        return None if row is None else row[key]

    def kind(compiled):
        return "compiled" if compiled else "eager"

    def op_ratio(n, numerator, denominator, compiled, target, listed=True):
        keys = [(method, n, "train", compiled) for method in (numerator, denominator)]
        if listed or all(key in op for key in keys):
            add(f"op, {n:,} tokens, forward + backward, {kind(compiled)}: {LABELS[numerator]} time / "
                f"{LABELS[denominator]} time", op.get(keys[0]), op.get(keys[1]), target)

    for n, target in ((4096, "op.speedup_4096"), (16384, "op.speedup_16384")):
        for compiled in op_kinds:
            op_ratio(n, "sdpa", "mhla", compiled, target, listed=n == 4096)
        op_ratio(n, "sdpa", "mhla_triton", False, target, listed=goals.device_kind(device) == "gpu")  # kernels: CUDA
        for sdpa in PINNED_SDPA:
            for mhla in ("mhla", "mhla_triton"):
                op_ratio(n, sdpa, mhla, False, target, listed=False)
    for mode in ("train", "inference"):
        add(f"{MHLA} / {TIMM_DEIT} throughput, 224 px, compiled, {mode}",
            model(MHLA, 224, mode, "compiled", "img_per_s"), model(TIMM_DEIT, 224, mode, "compiled", "img_per_s"),
            "model.throughput_vs_timm_224")
    for run in ("eager", "compiled"):
        for mode in ("train", "inference"):
            if run == "eager" or (MHLA, 1024, mode, run) in models:
                add(f"{SOFTMAX} / {MHLA} step time, 1024 px, {run}, {mode}",
                    model(SOFTMAX, 1024, mode, run, "step_ms"), model(MHLA, 1024, mode, run, "step_ms"),
                    "model.speedup_1024")
    for size, target in ((224, "model.train_vs_softmax_224"), (1024, "model.train_vs_softmax_1024")):
        for run in RUNS:
            if run == "triton" or all((name, size, "train", run) in models for name in (MHLA, SOFTMAX)):
                add(f"{MHLA} / {SOFTMAX} training-step time, {size} px, {RUN_NAMES[run]}",
                    model(MHLA, size, "train", run, "step_ms"), model(SOFTMAX, size, "train", run, "step_ms"), target)
    for compiled, n in sorted({(compiled, n) for _, n, _, compiled in op}):
        for mhla, linear in (("mhla", "linear"), ("mhla_triton", "linear_triton")):
            op_ratio(n, mhla, linear, compiled, "op.mhla_vs_linear", listed=False)
    for size, run in sorted({(size, run) for _, size, _, run in models}, key=lambda k: (RUNS.index(k[1]), k[0])):
        for mode in ("train", "inference"):
            if (MHLA, size, mode, run) in models and (LINEAR, size, mode, run) in models:
                add(f"{MHLA} / {LINEAR} step time, {size} px, {RUN_NAMES[run]}, {mode}",
                    model(MHLA, size, mode, run, "step_ms"), model(LINEAR, size, mode, run, "step_ms"),
                    "model.mhla_vs_linear")
        for name in (MHLA, LINEAR):
            peak, softmax_peak = (model(n, size, "train", run, "peak_mib") for n in (name, SOFTMAX))
            if peak is not None and softmax_peak is not None and math.isfinite(peak) and math.isfinite(softmax_peak):
                add(f"{name} / {SOFTMAX} training peak memory, {size} px, {RUN_NAMES[run]}", peak, softmax_peak,
                    "model.memory_vs_softmax")
    return found


def _number(value: float, digits: int = 1) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:,.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def tests_summary(log: Path | None) -> list[str]:
    """pytest's summary line and its FAILED / ERROR lines, from the tests step's log."""
    if log is None or not log.exists():
        return ["not run"]
    lines = [line.rstrip() for line in log.read_text(errors="replace").splitlines()]
    failures = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    summary = [line.strip("= ") for line in lines if PYTEST_SUMMARY.search(line)]
    return ([f"`pytest -q -m cuda tests/`: {summary[-1]}"] if summary else ["no pytest summary in the log"]) + \
        [f"- `{line}`" for line in failures]


def op_table(rows: list[dict]) -> list[str]:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by_key = {(r["method"], r["n"], r["mode"]): r for r in rows}
    header = (["N"] + [f"{m} fwd ms" for m in methods] + [f"{m} fwd+bwd ms" for m in methods]
              + [f"{m} fwd+bwd MiB" for m in methods])

    def cell(method, n, mode, key, digits):
        row = by_key.get((method, n, mode))
        return _number(None if row is None else row[key], digits)

    body = [[f"{n:,}"] + [cell(m, n, "forward", "time_ms", 2) for m in methods]
            + [cell(m, n, "train", "time_ms", 2) for m in methods]
            + [cell(m, n, "train", "peak_mib", 1) for m in methods] for n in sorted({r["n"] for r in rows})]
    return _table(header, body)


def model_table(rows: list[dict]) -> list[str]:
    """One line per model, resolution and run (eager, on the kernels, compiled), naming the backend it ran on."""
    by_key = {(r["model"], r["img_size"], r["run"], r["mode"]): r for r in rows}
    body = []

    def order(key):
        size, run, name = key
        return size, RUNS.index(run), MODELS.index(name) if name in MODELS else len(MODELS)

    for size, run, name in sorted({(r["img_size"], r["run"], r["model"]) for r in rows}, key=order):
        inference, train = by_key.get((name, size, run, "inference")), by_key.get((name, size, run, "train"))
        any_row = inference or train

        def get(row, key, digits=1):
            return _number(None if row is None else row[key], digits)

        spread = "" if train is None else f" ({train['spread_pct']:.0f}%)"
        body.append([name, str(size), str(any_row["batch_size"]), any_row["backend"] or "—",
                     "no" if any_row["compile"] == "none" else any_row["compile"],
                     get(inference, "img_per_s"), get(train, "img_per_s"), get(train, "step_ms") + spread,
                     get(inference, "peak_mib", 0), get(train, "peak_mib", 0)])
    return _table(["model", "px", "batch", "backend", "compiled", "inference img/s", "train img/s",
                   "train step ms (spread)", "inference MiB", "train MiB"], body)


def build_report(env: dict[str, str], steps: list[Step], results: list[StepResult], out_dir: Path,
                 command: str, device: str, dtype: str, started: str) -> str:
    """The Markdown report of a check whose benchmarks ran on ``device`` and wrote under ``out_dir``."""
    by_name = {r.name: r for r in results}
    failed = [r for r in results if not r.ok]
    total = sum(r.seconds for r in results)
    lines = ["# GPU check", "",
             f"`{command}`, started {started}, {total / 60:.1f} min of steps; "
             + (f"**{len(failed)} of {len(results)} steps failed**." if failed else f"all {len(results)} steps ok."),
             "", "## Environment", ""]
    lines += _table(["", ""], [[key, value] for key, value in env.items()])
    lines += ["", "## Steps", ""]
    step_rows = []
    for step in steps:
        result = by_name.get(step.name)
        outcome = "not run" if result is None else ("ok" if result.ok else result.message.replace("|", "\\|"))
        seconds = "" if result is None else f"{result.seconds:.0f} s"
        step_rows.append([step.name, f"`{step.display()}`", outcome, seconds, f"{step.estimate:.0f} s"])
    lines += _table(["step", "command", "result", "time", "expected"], step_rows)
    lines += ["", f"The tables and targets below read every result under `{_relative(str(out_dir))}`, with those of "
              "earlier checks' steps not run this time (`--steps`)."]

    model_rows, op_rows = read_model_rows(out_dir), read_op_rows(out_dir)
    lines += ["", "## Targets", "", f"All in {dtype}, against the {goals.device_kind(device).upper()} targets of "
              "`mhla/targets.py`; the models' ratios from `scripts/benchmark.py`'s CSV files, the op's from "
              "`scripts/benchmark_attention.py`'s (\"forward + backward\" is its `train` mode).", ""]
    met_text = {True: "met", False: "**not met**", None: "not measured"}
    lines += _table(["target", "measured", "goal", "met"],
                    [[t.name, _number(t.value, 3 if "memory" in t.name else 2), t.goal, met_text[t.met]]
                     for t in targets(model_rows, op_rows, device)])

    lines += ["", "## CUDA tests", ""]
    tests = by_name.get("tests")
    lines += tests_summary(None if tests is None else tests.log)

    lines += ["", "## The attention op", ""]
    if not op_rows:
        lines.append("not measured")
    for compiled, name in ((False, "attention"), (True, "attention-compiled")):
        rows = [r for r in op_rows if r["compiled"] == compiled]
        if rows:
            op_md = out_dir / name / "attention_benchmark.md"
            setting = op_md.read_text().splitlines()[0] if op_md.exists() else ""
            lines += ([setting, ""] if setting else []) + op_table(rows) + [""]
    lines += ["## The models", ""]
    if model_rows:
        lines += [f"{dtype} autocast; inference and training-step throughput, medians of interleaved rounds; "
                  "the peak memory each adds to what is in use (on CUDA read in the benchmark's process; — : not "
                  "measured).", ""]
        lines += model_table(model_rows)
    else:
        lines.append("not measured")
    return "\n".join(lines) + "\n"


def format_plan(steps: list[Step], time_limit: float) -> str:
    lines = [f"{len(steps)} steps, expected {sum(s.estimate for s in steps) / 60:.1f} min "
             f"(time limit {time_limit:.0f} s):"]
    lines += [f"  {s.name:<22} timeout {s.timeout:>4.0f} s, expected {s.estimate:>4.0f} s: {s.display()}"
              for s in steps]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    steps = plan(args)
    if args.steps:
        steps = [step for step in steps if step.name in args.steps]
    env = environment(args.device)
    print("\n".join(f"{key}: {value}" for key, value in env.items()))
    print(format_plan(steps, args.time_limit), flush=True)
    if args.dry_run:
        return 0
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); --dry-run shows the plan, "
              "--smoke --device cpu runs it on the CPU", file=sys.stderr)
        return 2
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = run_steps(steps, args.out_dir / "logs", args.time_limit)
    command = shlex.join(["python", "scripts/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(build_report(env, steps, results, args.out_dir, command, args.device, args.dtype, started))
    failed = [r for r in results if not r.ok]
    print(f"report: {_relative(str(args.out))}" + (f"; {len(failed)} step(s) failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
