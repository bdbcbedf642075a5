"""Command line: ``python -m twell {demo,check,bench,results,tune,warmup}``.

- ``demo``: the main job on an embedded default workload (``paperlike`` at the paper's
  shape, K=2048, N=5632): sparsity statistics, the packed format's size, and a check that
  the sparse block equals the dense block. Runs the GPU kernels when they can run here
  (CuPy and a Hopper GPU; timed against the dense block when torch has CUDA), else the
  NumPy reference, and says why.
- ``check``: cross-checks the block (``twell.ffn``, gated and not) against float64 dense
  math on every workload and prints a verdict table; exits 1 if anything fails.
- ``bench``: the benchmark of docs/benchmark.md (needs a GPU); ``bench --sweep``: its
  batch-size and density sweeps of the public torch API.
- ``warmup``: compiles, in parallel, the kernels a model's layer shape needs
  (twell.warmup), into CuPy's disk cache, so that a later process's first call only
  loads them (needs torch, and a GPU).
- ``tune``: measures the thresholds of twell/tuning/ on this GPU and writes its file
  (from a source checkout: the probes are in bench/tune/; needs a GPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import twell
from twell import workloads
from twell._optional import EXTRAS, install_hint
from twell.options import DEFAULT_SLOTS, DEFAULT_TILE, MAX_COLUMNS, MAX_K
from twell.reference.forward import ffn_dense
from twell.testing.asserts import as_host, relative_error

TOLERANCE = 1e-2  # docs/ops.md, Numerics: ‖y − y_ref‖ / ‖y_ref‖


def gpu_available() -> bool:
    """True when the GPU kernels can run here (CuPy and a Hopper GPU)."""
    from twell.kernels.compile import unavailable_reason

    return unavailable_reason() is None


class Steps:
    """A rich progress display whose steps report their own duration."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )

    def __enter__(self) -> Steps:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def run(self, description: str, work: Callable[[], Any]) -> Any:
        task = self.progress.add_task(description, total=1)
        result = work()
        self.progress.update(task, completed=1)
        return result


def _count_histogram(counts: np.ndarray, slots: int) -> list[tuple[str, int, float]]:
    """Row-tiles per count bucket: 0, 1, 2–3, 4–7, … up to slots − 1, then overflow."""
    edges = [(0, 0)]
    low = 1
    while low <= slots - 1:
        edges.append((low, min(2 * low - 1, slots - 1)))
        low *= 2
    edges.append((slots, int(counts.max(initial=slots))))
    rows = []
    for low, high in edges:
        n = int(((counts >= low) & (counts <= high)).sum())
        label = f"{low}" if low == high else f"{low}–{high}"
        if low >= slots:
            label = f"≥ {slots} (overflow: dense row)"
        rows.append((label, n, 100.0 * n / max(1, counts.size)))
    return rows


def _cpu_reason(args: argparse.Namespace) -> str | None:
    """Why the demo runs the NumPy reference instead of the kernels (None: it runs them)."""
    if args.cpu:
        return "--cpu was given"
    from twell.kernels.compile import unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        return None
    if reason.startswith("CuPy"):
        return (
            f"{reason}: on a machine with an H100/H200, install the kernels' runtime with "
            "pip install 'twell[cuda13]' (or [cuda12]); `make demo` does it when nvidia-smi "
            "lists a GPU"
        )
    return reason


def _torch_cuda() -> str | None:
    """Why the dense baseline cannot be timed with torch here (None: it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'twell[torch]')"
    if not torch.cuda.is_available():
        return f"this torch ({torch.__version__}) has no CUDA"
    return None


def _demo_cupy(problem: workloads.Problem) -> dict[str, Any]:
    """The kernels on CuPy arrays (no torch): the gate's Hybrid, the block's output
    against the float64 oracle on the first 256 rows, and its time per call."""
    from twell.benchmark import to_device
    from twell.timing import time_ms

    x, w_gate, w_up, w_down = (to_device(a) for a in problem.arrays())
    block = twell.SparseFFN(w_gate, w_up, w_down)
    y = block(x)
    rows = min(256, problem.x.shape[0])
    reference = ffn_dense(problem.x[:rows], problem.w_gate, problem.w_up, problem.w_down)
    return {
        "hybrid": twell.gate(x, w_gate),
        "rel. error": relative_error(as_host(y[:rows]), reference),
        f"twell M={problem.x.shape[0]} (ms)": time_ms(lambda i: block(x)),
    }


def demo(args: argparse.Namespace) -> int:
    console = Console()
    reason = _cpu_reason(args)
    on_gpu = reason is None
    no_torch = _torch_cuda() if on_gpu else None
    M, K, N = args.tokens, 2048, 5632  # noqa: N806
    console.rule(
        f"twell demo — paperlike workload, M={M} K={K} N={N} "
        f"({'GPU kernels' if on_gpu else 'NumPy reference, CPU'})"
    )
    if reason is not None:
        console.print(f"[yellow]The GPU kernels do not run here:[/] {escape(reason)}.")
    if no_torch is not None:
        console.print(f"[yellow]The dense baseline is not timed:[/] {escape(no_torch)}.")
    with Steps(console) as steps:
        problem = steps.run(
            "build the paperlike workload", lambda: workloads.paperlike(M, K, N, seed=args.seed)
        )
        x, w_gate, w_up, w_down = problem.arrays()
        if on_gpu and no_torch is not None:
            report = steps.run("run the kernels on CuPy arrays", lambda: _demo_cupy(problem))
            h = report.pop("hybrid")
        elif on_gpu:
            from twell.benchmark import demo as demo_gpu

            report = steps.run(
                "run the kernels and time them against cuBLAS", lambda: demo_gpu(problem)
            )
            h = report.pop("hybrid")
        else:
            start = time.perf_counter()
            h = steps.run(
                "gate: relu(x @ w_gate.T) packed into TwELL + dense backup",
                lambda: twell.gate(x, w_gate),
            )
            y = steps.run(
                "sparse up/down over the active units only",
                lambda: twell.gated_down(x, h, w_up, w_down),
            )
            t_sparse = time.perf_counter() - start
            start = time.perf_counter()
            y_dense = steps.run(
                "dense block in float64 (the oracle)", lambda: ffn_dense(x, w_gate, w_up, w_down)
            )
            t_dense = time.perf_counter() - start
            report = {
                "rel. error": relative_error(y, y_dense),
                "sparse path, CPU (s)": t_sparse,
                "dense float64, CPU (s)": t_dense,
            }
    h = twell.formats.to_host(h)
    counts = h.counts()
    nnz = int(counts.sum())
    heavy = int(h.dense_rows.size)
    dense_bytes = M * N * 2
    stats = Table(title="activation h = relu(x @ w_gate.T)", show_header=False)
    stats.add_row("L0 (active units per token)", f"{nnz / M:.1f} of {N}")
    stats.add_row("sparsity", f"{100 * (1 - nnz / (M * N)):.3f}%")
    stats.add_row("heavy rows (dense backup)", f"{heavy} ({100 * heavy / M:.3f}%)")
    stats.add_row(
        "TwELL packed", f"{h.ell.nbytes / 2**20:.1f} MiB (tile {h.tile}, slots {h.slots})"
    )
    stats.add_row("dense backup", f"{(h.dense.size * 2) / 2**20:.2f} MiB as bf16")
    stats.add_row(
        "h dense in bf16",
        f"{dense_bytes / 2**20:.1f} MiB "
        f"({dense_bytes / (h.ell.nbytes + h.dense.size * 2):.1f}× the hybrid)",
    )
    console.print(stats)
    histogram = Table(title=f"nonzeros per {h.tile}-column tile")
    histogram.add_column("count", justify="right")
    histogram.add_column("row-tiles", justify="right")
    histogram.add_column("share", justify="right")
    for label, n, share in _count_histogram(counts, h.slots):
        histogram.add_row(label, f"{n}", f"{share:.3f}%")
    console.print(histogram)
    verdict = Table(title="sparse block against the dense block")
    for key in report:
        verdict.add_column(key, justify="right")
    verdict.add_column("verdict")
    ok = report["rel. error"] <= TOLERANCE
    verdict.add_row(
        *(f"{v:.3g}" for v in report.values()), "[green]PASS[/]" if ok else "[red]FAIL[/]"
    )
    console.print(verdict)
    return 0 if ok else 1


def check(args: argparse.Namespace) -> int:
    console = Console()
    on_gpu = gpu_available() and not args.cpu
    table = Table(
        title=f"twell check — {'GPU kernels' if on_gpu else 'NumPy reference'} "
        f"against float64 dense math, K={args.width} N={args.ffn}, tolerance {TOLERANCE:g}"
    )
    for column in ("workload", "block", "M", "slots", "heavy", "rel. error", "verdict"):
        table.add_column(column, justify="right")
    if on_gpu:
        from twell.benchmark import to_device
    else:

        def to_device(a: Any) -> Any:
            return a

    cases = [("uniform", {}), ("heavy", {}), ("paperlike", {}), ("density", {"p": 0.05})]
    failures = 0
    with Steps(console) as steps:
        for name, kw in cases:
            for M in args.tokens:  # noqa: N806
                problem = workloads.make(name, M, args.width, args.ffn, seed=args.seed, **kw)
                for gated in (True, False):
                    p = problem if gated else problem.as_nongated()
                    for slots in (32, 128) if name == "heavy" else (32,):

                        def run(p: workloads.Problem = p, slots: int = slots) -> tuple:
                            x, wg, wu, wd = (
                                None if a is None else to_device(a) for a in p.arrays()
                            )
                            y = twell.ffn(x, wg, wu, wd, slots=slots)
                            y = as_host(y)
                            h = twell.reference.gate(
                                p.x, p.w_gate if p.gated else p.w_up, slots=slots
                            )
                            return relative_error(y, ffn_dense(*p.arrays())), h.dense_rows.size

                        err, heavy = steps.run(
                            f"{name} {'gated' if gated else 'non-gated'} M={M} slots={slots}", run
                        )
                        ok = err <= TOLERANCE
                        failures += not ok
                        table.add_row(
                            name,
                            "gated" if gated else "non-gated",
                            f"{M}",
                            f"{slots}",
                            f"{heavy}",
                            f"{err:.2e}",
                            "[green]PASS[/]" if ok else "[red]FAIL[/]",
                        )
    console.print(table)
    console.print(
        "[green]all checks passed[/]" if not failures else f"[red]{failures} check(s) failed[/]"
    )
    return 1 if failures else 0


def _bench_main(rest: list[str]) -> Callable[[list[str]], int]:
    """The runner ``rest`` asks for: the batch-size and density sweeps (``--sweep``,
    twell/sweeps.py) or the FFN benchmark (twell/benchmark.py)."""
    if "--sweep" in rest:
        from twell.sweeps import main as sweeps_main

        return lambda argv: sweeps_main([a for a in argv if a != "--sweep"])
    from twell.benchmark import main as bench_main

    return bench_main


def bench(args: argparse.Namespace) -> int:
    if {"-h", "--help"} & set(args.rest):  # the options can be shown without a GPU
        program, sys.argv[0] = sys.argv[0], "python -m twell bench"  # argparse's prog
        try:
            return _bench_main(args.rest)(args.rest)
        finally:
            sys.argv[0] = program
    if not gpu_available():
        print(
            "twell bench needs a Hopper GPU with CuPy (none usable here); "
            "the reference has nothing worth timing",
            file=sys.stderr,
        )
        return 2
    return _bench_main(args.rest)(args.rest)


def tune(args: argparse.Namespace) -> int:
    from twell import tuning

    if args.list:
        for probe, names in tuning.probes().items():
            quick = " (--quick)" if probe in tuning.QUICK else ""
            print(f"{probe + quick:<22} {', '.join(names)}")
        return 0
    if not gpu_available():
        print(
            "twell tune times the kernels on the GPU whose thresholds it measures: it needs "
            "a Hopper GPU with CuPy and torch (none usable here)",
            file=sys.stderr,
        )
        return 2
    try:
        from bench.tune.run import tune as run_probes
    except ModuleNotFoundError as error:
        package = (error.name or "").split(".")[0]
        if package != "bench":
            hint = install_hint(package) if package in EXTRAS else "pip install it"
            print(f"twell tune needs {package} ({hint})", file=sys.stderr)
        else:
            print(
                "twell tune runs the probes of bench/tune/ in a source checkout: run "
                f"`{tuning.TUNE_COMMAND}` from the repository's root",
                file=sys.stderr,
            )
        return 2
    return run_probes(out=args.out, only=args.only, quick=args.quick)


def warmup(args: argparse.Namespace) -> int:
    """Compile a layer shape's kernels in parallel (twell.warmup)."""
    try:
        import torch

        from twell import warmup as warm
    except ModuleNotFoundError as error:
        print(f"twell warmup needs {error.name} ({install_hint('torch')})", file=sys.stderr)
        return 2
    hidden, ffn = args.hidden or 2048, args.ffn or 5632
    if args.model:
        if args.hidden or args.ffn:
            print("--model gives K and N: leave out --hidden and --ffn", file=sys.stderr)
            return 2
        try:
            import transformers

            config = transformers.AutoConfig.from_pretrained(args.model)
            hidden, ffn = int(config.hidden_size), int(config.intermediate_size)
        except ModuleNotFoundError:
            print("--model needs transformers (pip install transformers)", file=sys.stderr)
            return 2
        except (OSError, ValueError, AttributeError) as error:
            print(f"--model {args.model}: no Llama-style config ({error})", file=sys.stderr)
            return 2
        try:
            _hidden_width(str(hidden)), _ffn_width(str(ffn))
        except argparse.ArgumentTypeError as error:
            print(f"--model {args.model}: K={hidden}, N={ffn}: {error}", file=sys.stderr)
            return 2
    from twell.kernels.compile import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        hint = f" ({install_hint('cupy')})" if "CuPy" in reason else ""
        print(f"twell warmup needs a GPU: {reason}{hint}", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    layer = warm.Layer(hidden, ffn, dtype, torch.device("cuda", torch.cuda.current_device()),
                       DEFAULT_TILE, args.slots, "auto", "mean")  # fmt: skip
    tokens = args.tokens or warm.INFERENCE_TOKENS
    report = warm.warmup([layer], tokens=tokens, training=args.training, workers=args.workers)
    print(report)
    return 1 if report.failed else 0


def _tuning_name(text: str) -> str:
    """An argparse type: a probe of bench/tune/ or a threshold of twell/tuning/."""
    from twell import tuning

    if text not in tuning.probes() and text not in tuning.SPECS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a probe ({', '.join(tuning.probes())}) nor a threshold "
            "(python -m twell tune --list)"
        )
    return text


def _positive(text: str) -> int:
    """An argparse type: an integer >= 1 (a clean usage error otherwise, no traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _hidden_width(text: str) -> int:
    """An argparse type: K, a positive multiple of 8 up to the kernels' limit (4096)."""
    value = _positive(text)
    if value % 8 or value > MAX_K:
        raise argparse.ArgumentTypeError(f"expected a multiple of 8 up to {MAX_K}, got {value}")
    return value


def _ffn_width(text: str) -> int:
    """An argparse type: N, a positive multiple of the default tile (256), at most 65536."""
    value = _positive(text)
    if value % DEFAULT_TILE or value > MAX_COLUMNS:
        raise argparse.ArgumentTypeError(
            f"expected a multiple of {DEFAULT_TILE} (the tile width) up to {MAX_COLUMNS}, "
            f"got {value}"
        )
    return value


def results(args: argparse.Namespace) -> int:
    """The results tables of twell.results (its own options)."""
    from twell import results as tables

    return tables.main(args.rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m twell",
        description="twell's command line: one subcommand's --help for its options.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("demo", help="sparsity report and sparse-vs-dense check")
    p.add_argument("--tokens", type=_positive, default=4096, help="M (default 4096)")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (default 0)")
    p.add_argument("--cpu", action="store_true", help="use the NumPy reference even on a GPU")
    p.set_defaults(run=demo)
    p = commands.add_parser(
        "check", help="the block against float64 math on every workload, verdict table"
    )
    p.add_argument("--tokens", type=_positive, nargs="+", default=[1, 257],
                   help="M of each check (default 1 257)")  # fmt: skip
    p.add_argument("--width", type=_positive, default=512, help="K (default 512)")
    p.add_argument("--ffn", type=_ffn_width, default=1536, help="N (default 1536)")
    p.add_argument("--seed", type=int, default=0, help="the workloads' seed (default 0)")
    p.add_argument("--cpu", action="store_true", help="check the NumPy reference only")
    p.set_defaults(run=check)
    p = commands.add_parser(
        "bench", help="the benchmark of docs/benchmark.md (GPU; python -m twell bench --help)",
        add_help=False,
    )  # fmt: skip
    p.set_defaults(run=bench)
    p = commands.add_parser(
        "results", help="the records of bench/results/ as tables (results --help)",
        add_help=False,
    )  # fmt: skip
    p.set_defaults(run=results)
    p = commands.add_parser("tune", help="measure the thresholds of twell/tuning/ on this GPU")
    p.add_argument(
        "--out",
        metavar="FILE",
        help="where to write them (default: twell/tuning/<h100|h200>.json; for another GPU, "
        "tuning-<name>.json here)",
    )
    p.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        type=_tuning_name,
        help="probes or thresholds to measure (the others keep the values in force)",
    )
    p.add_argument(
        "--quick", action="store_true", help="only the probes that matter most (about 2 minutes)"
    )
    p.add_argument("--list", action="store_true", help="list the probes and their thresholds")
    p.set_defaults(run=tune)
    p = commands.add_parser(
        "warmup", help="compile a layer shape's kernels ahead of the first call (GPU, torch)"
    )
    p.add_argument("--hidden", type=_hidden_width, default=None, help="K (default 2048)")
    p.add_argument("--ffn", type=_ffn_width, default=None, help="N (default 5632)")
    p.add_argument("--model", metavar="NAME", help="K and N from a transformers config instead")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the weights' dtype")
    p.add_argument("--slots", type=_positive, default=DEFAULT_SLOTS,
                   help="TwELL words per tile (default: SparseMLP's)")  # fmt: skip
    p.add_argument("--tokens", type=_positive, nargs="+", default=None,
                   help="inference batch sizes (default: one per route)")  # fmt: skip
    p.add_argument("--training", action="store_true", help="the training kernels too")
    p.add_argument("--workers", type=_positive, default=None, help="compile threads")
    p.set_defaults(run=warmup)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("bench", "results"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest  # the benchmark parses its own options
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
