"""Run and check the notebooks: ``python -m megamoe.notebooks {run,check,list}``.

``run [--names 03 05_gemm_swiglu ...] [--world-size N] [--backend B] [--param KEY=VALUE ...] [--output-dir D]
[--timeout S]``
    Re-executes notebooks **in place** with papermill (outputs are kept in the files), injecting the parameters
    ``world_size`` (default: the number of GPUs when there are several, 4 local ranks on one GPU, else 2 CPU ranks)
    and ``backend`` (default ``auto``), plus any ``--param`` (a Python literal, else a string: ``--param
    routing=one_expert masked_ratio=0.5``). Prints ``[3/8] 03_pool_sizing ... 41.2 s`` per notebook and writes the
    times, with provenance, to ``results/notebook_times_<device>.json``. With ``--output-dir D`` the executed
    notebooks (and their times file) go to ``D`` and the committed notebooks are left untouched.
``check [--names ...]``
    Verifies the committed notebooks: every code cell was executed, no error outputs, a ``parameters`` cell, a
    provenance line (the output of ``megamoe.describe_environment()``), no kernel code (``@triton.jit``), and fresh
    outputs: every ``results/*.json`` a notebook read is recorded in its outputs with its hash
    (``megamoe.figures.read_results``) and still has that hash; and a size under :data:`MAX_NOTEBOOK_BYTES` with its
    outputs (figures are embedded as ``megamoe.figures.compact_png`` renderings).
    Exits 1 and lists the problems otherwise.
``list``
    Prints the notebooks in order with their titles.

Notebooks live in ``<repo>/notebooks`` and are numbered ``00_`` .. ``08_``; a name may be given in full, without
``.ipynb``, or as its number prefix.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from megamoe.env import REPO_ROOT, RESULTS_DIR, device_tag

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
KERNEL_NAME = "python3"
#: Seconds papermill waits for one cell before failing the notebook.
CELL_TIMEOUT_S = 1800
#: A provenance line printed by megamoe.describe_environment().
PROVENANCE_RE = re.compile(r"backend=\S+ device=.+ torch=\S+ triton=\S+ commit=\S+")
#: Source patterns that mean kernel code was written in a notebook (kernels belong in megamoe/kernels).
#: Largest committed notebook, outputs included: a reader (or GitHub's viewer) loads it whole.
MAX_NOTEBOOK_BYTES = 300_000
KERNEL_CODE_RE = re.compile(r"@triton\.jit|@triton\.autotune|import triton\.language|\btl\.(load|store|program_id)\(")


def notebook_paths(names: list[str] | None = None, directory: Path = NOTEBOOK_DIR) -> list[Path]:
    """The notebooks ``NN_*.ipynb`` of ``directory`` in order, or those matching ``names`` (full name, stem, or
    number prefix such as ``03``). Unknown names raise ValueError."""
    every = sorted(p for p in directory.glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return every
    chosen = []
    for name in names:
        stem = Path(name).name.removesuffix(".ipynb")
        hits = [p for p in every if p.stem == stem or p.stem.split("_")[0] == stem]
        if not hits:
            raise ValueError(f"no notebook {name!r} in {directory} (have: {', '.join(p.stem for p in every)})")
        chosen += [p for p in hits if p not in chosen]
    return chosen


#: Ranks for the notebooks on a single GPU: local ranks in one process, so the multi-rank pictures stay interesting.
LOCAL_RANKS_ON_ONE_GPU = 4


def default_world_size() -> int:
    """The number of GPUs when there are several, 4 local ranks on one GPU, else 2 (CPU ranks)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpus if gpus > 1 else LOCAL_RANKS_ON_ONE_GPU if gpus == 1 else 2


def title(path: Path) -> str:
    """The first markdown heading of a notebook."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("# ").strip()
    return ""


def execute(path: Path, output: Path | None = None, parameters: dict | None = None,
            cwd: Path | None = None, timeout_s: float = CELL_TIMEOUT_S) -> float:
    """Execute one notebook with papermill into ``output`` (default: in place); return the seconds it took.

    Raises ``papermill.PapermillExecutionError`` (naming the failing cell) when a cell fails; the output notebook
    then holds everything up to the error.
    """
    import papermill

    t0 = time.perf_counter()
    papermill.execute_notebook(str(path), str(output or path), parameters=parameters or {},
                               kernel_name=KERNEL_NAME, cwd=str(cwd or path.parent), progress_bar=False,
                               log_output=False, execution_timeout=timeout_s)
    return time.perf_counter() - t0


def figures(names: list[str] | None = None, world_size: int | None = None, backend: str = "auto",
            timeout_s: float = CELL_TIMEOUT_S) -> list[str]:
    """Regenerate ``figures/`` (``make figures``): execute the notebooks into a temporary folder, leaving the
    committed notebooks untouched. The notebooks are the one source of every figure. Returns the failed names."""
    import tempfile

    paths = notebook_paths(names)
    params = {"world_size": default_world_size() if world_size is None else world_size, "backend": backend}
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(paths, 1):
            t0 = time.perf_counter()
            try:
                execute(path, output=Path(tmp) / path.name, parameters=params, timeout_s=timeout_s)
                print(f"[{i}/{len(paths)}] {path.stem} ... {time.perf_counter() - t0:.1f} s", flush=True)
            except Exception as e:
                failed.append(path.stem)
                print(f"[{i}/{len(paths)}] {path.stem} FAILED: {type(e).__name__}: {str(e).strip()[:2000]}", flush=True)
    return failed


def run(names: list[str] | None = None, world_size: int | None = None, backend: str = "auto",
        timeout_s: float = CELL_TIMEOUT_S, results_dir: Path | None = None, output_dir: Path | None = None,
        extra_params: dict | None = None) -> dict:
    """Re-execute notebooks in place (outputs kept), or into ``output_dir``; print progress, write
    ``notebook_times_<device>.json`` (into ``results_dir``, default ``output_dir`` when given, else ``results/``).

    ``extra_params``: more papermill parameters (e.g. ``{"routing": "one_expert"}``) next to ``world_size`` and
    ``backend``. Returns the written record: ``{"kind": "notebook_times", "provenance", "config", "rows"}``; each
    row has ``notebook``, ``seconds`` and ``ok``. A failing notebook is reported and the others still run; the
    return record then has ``"failed"`` set and :func:`main` exits 1.
    """
    from megamoe.env import provenance

    paths = notebook_paths(names)
    world_size = default_world_size() if world_size is None else world_size
    params = {"world_size": world_size, "backend": backend, **(extra_params or {})}
    if output_dir is not None:
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        results_dir = output_dir if results_dir is None else results_dir
    where = "in place" if output_dir is None else f"into {output_dir}"
    print(f"executing {len(paths)} notebook(s) {where} with {params}", flush=True)
    rows, failed = [], []
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    for i, path in enumerate(paths, 1):
        head = f"[{i}/{len(paths)}] {path.stem} ..."
        t0 = time.perf_counter()
        try:
            execute(path, output=None if output_dir is None else output_dir / path.name, parameters=params,
                    timeout_s=timeout_s)
            ok = True
            print(f"{head} {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:  # report, keep going with the other notebooks
            ok = False
            failed.append(path.stem)
            print(f"{head} FAILED after {time.perf_counter() - t0:.1f} s: {type(e).__name__}: "
                  f"{str(e).strip()[:2000]}", flush=True)
        rows.append({"notebook": path.stem, "seconds": round(time.perf_counter() - t0, 2), "ok": ok,
                     "run_at": stamp})
    out_dir = Path(results_dir) if results_dir else RESULTS_DIR
    out = out_dir / f"notebook_times_{device_tag()}.json"
    rows = _merge_rows(out, rows, params)
    record = {"kind": "notebook_times",
              "provenance": provenance("python -m megamoe.notebooks run " + " ".join(sys.argv[2:])),
              "config": {**params, "title": "notebook execution time", "x": "notebook", "y": "seconds"},
              "rows": rows}
    if failed:
        record["failed"] = failed
    out_dir.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    total = sum(r["seconds"] for r in rows if r.get("run_at") == stamp)
    print(f"total {total:.1f} s; wrote {out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return record


def _merge_rows(path: Path, rows: list[dict], params: dict) -> list[dict]:
    """``rows`` plus the rows of an earlier record at ``path`` for notebooks not run now (same parameters only),
    in notebook order: a partial run (``--names``) updates its notebooks and keeps the others' times."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return rows
    cfg = old.get("config", {})
    if any(cfg.get(k) != v for k, v in params.items()):
        return rows
    fresh = {r["notebook"] for r in rows}
    kept = [r for r in old.get("rows", []) if r.get("notebook") not in fresh]
    return sorted(kept + rows, key=lambda r: r["notebook"])


def _outputs_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(str(out["data"].get("text/plain", "")))
            parts.append(str(out["data"].get("text/markdown", "")))
    return "".join(parts)


def check_notebook(path: Path) -> list[str]:
    """Problems of one committed notebook (empty list = fine); see the module docstring for the rules."""
    import nbformat

    problems = []
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:
        return [f"cannot read: {e}"]
    size = Path(path).stat().st_size
    if size > MAX_NOTEBOOK_BYTES:
        images = sum(len(str(o.get("data", {}).get("image/png", ""))) for c in nb.cells if c.cell_type == "code"
                     for o in c.get("outputs", []))
        problems.append(f"{size / 1e3:.0f} KB with outputs (limit {MAX_NOTEBOOK_BYTES / 1e3:.0f} KB; embedded PNGs "
                        f"{images / 1e3:.0f} KB): re-execute it (figures embed compact renderings) or trim outputs")
    code = [c for c in nb.cells if c.cell_type == "code"]
    if not any("parameters" in c.get("metadata", {}).get("tags", []) for c in code):
        problems.append("no cell tagged 'parameters'")
    if not any(c.get("outputs") for c in code):
        problems.append("no outputs (not executed?)")
    unexecuted = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()
                  and c.get("execution_count") is None]
    if unexecuted:
        problems.append(f"code cells never executed: {unexecuted}")
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code":
            continue
        for out in c.get("outputs", []):
            if out.get("output_type") == "error":
                problems.append(f"cell {i} has an error output: {out.get('ename')}: {out.get('evalue', '')[:200]}")
        if KERNEL_CODE_RE.search(c.source):
            problems.append(f"cell {i} contains kernel code (kernels belong in megamoe/kernels)")
    if not any(PROVENANCE_RE.search(_outputs_text(c)) for c in code):
        problems.append("no provenance line (print megamoe.describe_environment())")
    if nb.metadata.get("papermill", {}).get("exception"):
        problems.append("papermill recorded an exception for the last execution")
    problems += freshness_problems(nb)
    return problems


#: A code cell that reads ``results/*.json`` (its outputs must then record what it read, see ``RESULTS_READ_RE``).
READS_RESULTS_RE = re.compile(r"\b(load_results?|plot_results|results_files|read_results)\(")


def freshness_problems(nb) -> list[str]:
    """Outputs made from results files that have changed since: every ``read results/<file> sha256:<h>`` line in
    the outputs must name a committed ``results/`` file with that hash, and a notebook whose code reads results
    must carry such lines (outputs older than the record count as stale). Fix: re-execute the notebook."""
    from megamoe.figures import RESULTS_READ_RE, results_dir, results_sha

    problems = []
    code = [c for c in nb.cells if c.cell_type == "code"]
    seen = {(m["name"], m["sha"]) for c in code for m in RESULTS_READ_RE.finditer(_outputs_text(c))}
    if any(READS_RESULTS_RE.search(c.source) for c in code) and not seen:
        problems.append("reads results/*.json but its outputs record none of them (executed before the freshness "
                        "record): re-execute it")
    for name, sha in sorted(seen):
        path = results_dir() / name
        if not path.exists():
            problems.append(f"stale: its outputs were made from results/{name}, which no longer exists")
        elif results_sha(path) != sha:
            problems.append(f"stale: results/{name} changed since the outputs were made (sha256 {sha} -> "
                            f"{results_sha(path)}): re-execute it")
    return problems


def check(names: list[str] | None = None) -> dict[str, list[str]]:
    """:func:`check_notebook` for every (or the named) notebook; prints one line each."""
    report = {}
    for path in notebook_paths(names):
        problems = check_notebook(path)
        report[path.stem] = problems
        print(f"{'ok  ' if not problems else 'FAIL'} {path.stem}" + "".join(f"\n     - {p}" for p in problems))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megamoe.notebooks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="re-execute notebooks in place (papermill)")
    p_run.add_argument("--names", nargs="*", help="notebooks to run (default: all), e.g. 03 05_gemm_swiglu")
    p_run.add_argument("--world-size", type=int, default=None,
                       help=f"ranks (default: the number of GPUs when there are several, {LOCAL_RANKS_ON_ONE_GPU} "
                            "local ranks on one GPU, else 2 CPU ranks)")
    p_run.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda", "local"])
    p_run.add_argument("--param", nargs="*", default=[], metavar="KEY=VALUE",
                       help="more notebook parameters, e.g. routing=one_expert masked_ratio=0.5 (Python literals, "
                            "else strings)")
    p_run.add_argument("--output-dir", type=Path, default=None,
                       help="write the executed notebooks (and their times file) here instead of in place")
    p_run.add_argument("--timeout", type=float, default=CELL_TIMEOUT_S, help="seconds per cell")
    p_check = sub.add_parser("check", help="verify committed notebooks (outputs, no errors, provenance)")
    p_check.add_argument("--names", nargs="*")
    sub.add_parser("list", help="list the notebooks")
    p_fig = sub.add_parser("figures", help="regenerate figures/ by executing the notebooks into a temp dir")
    p_fig.add_argument("--names", nargs="*")
    p_fig.add_argument("--world-size", type=int, default=None, help="ranks (default: as for run)")
    p_fig.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda", "local"])
    args = parser.parse_args(argv)
    if args.command == "list":
        for path in notebook_paths():
            print(f"{path.stem:<24} {title(path)}")
        return 0
    if args.command == "check":
        return 1 if any(check(args.names).values()) else 0
    if args.command == "figures":
        return 1 if figures(args.names, args.world_size, args.backend) else 0
    record = run(args.names, args.world_size, args.backend, args.timeout, output_dir=args.output_dir,
                 extra_params=parse_params(args.param))
    return 1 if record.get("failed") else 0


def parse_params(items: list[str]) -> dict:
    """``["routing=one_expert", "masked_ratio=0.5", "grid_ranks=[1, 2]"]`` -> a parameter dict; each value is a
    Python literal where it parses as one, else the string itself."""
    import ast

    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise SystemExit(f"--param {item!r}: expected KEY=VALUE")
        try:
            params[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            params[key] = value
    return params


if __name__ == "__main__":
    sys.exit(main())
