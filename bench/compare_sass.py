"""Compare the machine code (SASS) of twell's kernels between a git revision and a tree,
on a machine without a GPU: a restructure of the sources must leave every kernel's code
as it was.

For each declared source of the revision (or those named by ``--sources``), each of its
example configurations and each of its kernels, both trees compile through their own
``twell.kernels.compile.compile_cubin`` (NVRTC, sm_90a), ``cuobjdump`` disassembles the
cubins, and the kernel's SASS (instructions, encodings, scheduling bits) and resource
usage (registers, shared memory, stack) are compared. The revision's kernel is looked up
by name among the tree's sources and compiled with the configuration's values of that
source's parameters (a source split in several keeps its kernels' names). One line per
source and configuration: identical, or the kernels that differ (``--diff``: their
instruction diffs). Every source takes about four minutes on two cores.

    python bench/compare_sass.py [--rev HEAD] [--tree .] [--sources a.cu b.cu] [--diff]

Needs NVRTC as the compile test does, and ``cuobjdump`` (``pip install
nvidia-cuda-cuobjdump``; found on PATH, in the venv's NVIDIA wheels, or ``--cuobjdump``).
"""

from __future__ import annotations

import argparse
import base64
import difflib
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ worker (one tree)
def _declared() -> dict:
    import twell.kernels  # noqa: F401 - imports every launcher, which declares its source
    from twell.kernels import compile as kc

    return {
        name: {"parameters": list(s.parameters), "examples": [dict(p) for p in s.examples],
               "text": s.text()}
        for name, s in kc.SOURCES.items()
    }  # fmt: skip


def _compile(job: tuple[str, dict]) -> str:
    from twell.kernels import compile as kc

    _declared()
    name, params = job
    cubin = kc.compile_cubin(kc.SOURCES[name], params, verbose_ptxas=False).cubin
    return base64.b64encode(cubin).decode()


def worker(mode: str) -> None:
    """Reads a JSON request on stdin, writes the answer on stdout (run with the tree to
    measure first on sys.path)."""
    if mode == "list":
        import twell

        json.dump({"package": twell.__file__, "sources": _declared()}, sys.stdout)
        return
    jobs = [(name, params) for name, params in json.load(sys.stdin)]
    with ProcessPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        json.dump(list(pool.map(_compile, jobs)), sys.stdout)


def _run_worker(tree: Path, mode: str, request: object = None) -> object:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, __file__, "--worker", mode], input=json.dumps(request), text=True,
        capture_output=True, env=env, cwd=tree, check=False,
    )  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"worker {mode} in {tree} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


def _listing(tree: Path) -> dict:
    """The declared sources of the package under ``tree`` (checked to be that one)."""
    found = _run_worker(tree, "list")
    if not Path(found["package"]).resolve().is_relative_to(tree):
        raise RuntimeError(f"imported {found['package']}, not the package under {tree}")
    return found["sources"]


# ------------------------------------------------------------------ disassembly
def _find_cuobjdump(given: str | None) -> str:
    found = given or shutil.which("cuobjdump")
    if found is None:
        for prefix in sys.path:
            hits = glob.glob(os.path.join(prefix, "nvidia", "cu1*", "bin", "cuobjdump"))
            if hits:
                return hits[0]
        raise SystemExit("cuobjdump not found: pip install nvidia-cuda-cuobjdump, or --cuobjdump")
    return found


def disassemble(cuobjdump: str, cubin: bytes) -> dict[str, dict[str, str]]:
    """Each kernel's SASS and resource-usage line, by name."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
    kernels: dict[str, dict[str, str]] = {}
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        name, _, body = block.partition("\n")
        body = body.split("\n\t\t.....")[0]
        # cuobjdump pads the instruction column to the widest instruction of the file
        lines = (" ".join(line.split()) for line in body.strip().splitlines())
        kernels[name.strip()] = {"sass": "\n".join(lines), "res": ""}
    for name, usage in re.findall(r"Function (\w+):\n\s*(.*)", res):
        kernels.setdefault(name, {"sass": "", "res": ""})["res"] = usage.strip()
    return kernels


def instructions(sass: str) -> list[str]:
    """The instruction text of a SASS listing, without addresses or encodings."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*(/\*.*)?$", line)
        if m and m.group(1):
            out.append(m.group(1))
    return out


# ------------------------------------------------------------------ comparison
def export(rev: str, into: Path) -> Path:
    """The package of ``rev`` (git archive of ``twell/``) unpacked under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "twell"],
                             capture_output=True, check=True).stdout  # fmt: skip
    path = into / "before.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD", help="git revision of the 'before' sources")
    parser.add_argument("--tree", default=str(ROOT), help="the 'after' tree (default: this one)")
    parser.add_argument("--sources", nargs="*", help="source names (default: all)")
    parser.add_argument("--diff", action="store_true", help="print the instruction diffs")
    parser.add_argument("--cuobjdump", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    cuobjdump = _find_cuobjdump(args.cuobjdump)
    tree = Path(args.tree).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        before_tree = export(args.rev, Path(tmp))
        before = _listing(before_tree)
        after = _listing(tree)
        names = args.sources or sorted(before)
        jobs = [(name, params) for name in names for params in before[name]["examples"]]
        print(f"compiling {len(jobs)} configurations of {args.rev} ...", flush=True)
        old = [disassemble(cuobjdump, base64.b64decode(c))
               for c in _run_worker(before_tree, "compile", jobs)]  # fmt: skip

    # Where each kernel lives now (a source whose text names it, else the source of the
    # same name: names made by token pasting), and the configurations to build there.
    def home(kernel: str, source: str, params: dict) -> tuple[str, dict] | None:
        names = [n for n, s in sorted(after.items()) if re.search(rf"\b{kernel}\b", s["text"])]
        for name in names or ([source] if source in after else []):
            if set(after[name]["parameters"]) <= set(params):
                return name, {p: params[p] for p in after[name]["parameters"]}
        return None

    wanted: dict[str, tuple[str, dict]] = {}
    homes: dict[tuple[int, str], str | None] = {}
    for i, ((source, params), kernels) in enumerate(zip(jobs, old, strict=True)):
        for kernel in kernels:
            found = home(kernel, source, params)
            key = None if found is None else json.dumps(found, sort_keys=True)
            homes[i, kernel] = key
            if key is not None:
                wanted[key] = found
    keys = sorted(wanted)
    print(f"compiling {len(keys)} configurations of {tree} ...", flush=True)
    built = _run_worker(tree, "compile", [wanted[k] for k in keys])
    new = {k: disassemble(cuobjdump, base64.b64decode(c)) for k, c in zip(keys, built, strict=True)}

    differ = 0
    for i, ((name, params), kernels) in enumerate(zip(jobs, old, strict=True)):
        problems = []
        for kernel, was in sorted(kernels.items()):
            key = homes[i, kernel]
            now = None if key is None else new[key].get(kernel)
            where = "" if key is None else json.loads(key)[0]
            if now is None:
                problems.append(f"{kernel}: not found in {tree.name}")
                continue
            if now["res"] != was["res"]:
                problems.append(f"{kernel} ({where}): resources {was['res']} -> {now['res']}")
            if now["sass"] != was["sass"]:
                a, b = instructions(was["sass"]), instructions(now["sass"])
                changed = sum(1 for op in difflib.SequenceMatcher(None, a, b).get_opcodes()
                              if op[0] != "equal")  # fmt: skip
                what = "scheduling bits only" if a == b else f"{changed} changed runs"
                problems.append(f"{kernel} ({where}): SASS differs ({len(a)} -> {len(b)} "
                                f"instructions, {what})")  # fmt: skip
                if args.diff:
                    problems.extend("    " + line for line in difflib.unified_diff(
                        a, b, "before", "after", lineterm="", n=2))  # fmt: skip
        config = " ".join(f"{k}={v}" for k, v in params.items()) or "-"
        status = "identical" if not problems else "DIFFERENT"
        print(f"{name} [{config}]: {len(kernels)} kernels {status}")
        for line in problems:
            print("  " + line)
        differ += bool(problems)
    print(f"{len(jobs) - differ} of {len(jobs)} configurations identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
