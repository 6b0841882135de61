"""Reading ``results/*.json`` (benchmark results): the one reader, :func:`read_results`, and helpers around it.

Schema of a results file::

    {"kind": "...", "provenance": {...},            # megamoe.env.provenance()
     "config": {...},                               # what was run; optional plot hints (megamoe.figures.bench)
     "rows": [{...}, ...]}                          # one flat dict per measurement

``$MEGAMOE_RESULTS_DIR`` overrides the folder.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from megamoe.env import RESULTS_DIR


def results_dir() -> Path:
    """Benchmark results folder: ``$MEGAMOE_RESULTS_DIR`` or ``<repo>/results``."""
    return Path(os.environ.get("MEGAMOE_RESULTS_DIR") or RESULTS_DIR)



#: The line :func:`read_results` prints for every results file it reads: notebooks carry it in their outputs, and
#: ``python -m megamoe.notebooks check`` compares the hash with the file as committed (a stale output fails).
RESULTS_READ_RE = re.compile(r"read results/(?P<name>[\w.\-/]+\.jsonl?) sha256:(?P<sha>[0-9a-f]{16})")


def results_sha(path: Path) -> str:
    """The first 16 hex digits of a results file's SHA-256 (what :data:`RESULTS_READ_RE` records)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def results_name(path: Path) -> str:
    """``path`` relative to :func:`results_dir` (``probes/x.json`` for a file in a subfolder), else its name."""
    path = Path(path)
    try:
        return path.resolve().relative_to(results_dir().resolve()).as_posix()
    except ValueError:
        return path.name


def read_results(path: Path) -> dict:
    """A results file as a dict; prints ``read results/<name> sha256:<16 hex>`` (``<name>`` relative to the results
    folder: ``probes/x.json`` for a probe's output) so that outputs made from it can be checked for freshness later.
    The one reader of ``results/*.json`` and of the probes' ``*.jsonl`` (one JSON row a line, read as
    ``{"rows": [...]}``; lines starting with ``#`` are comments: which commit and command made the rows below) for
    figures and notebooks."""
    path = Path(path)
    print(f"read results/{results_name(path)} sha256:{results_sha(path)}")
    with open(path) as f:
        if path.suffix == ".jsonl":
            return {"rows": [json.loads(line) for line in f if line.strip() and not line.startswith("#")]}
        return json.load(f)


def load_results(name: str) -> dict | None:
    """``results/<name>.json`` (else ``.jsonl``) as a dict (through :func:`read_results`), or None (with a printed
    line) when neither exists. ``name`` may name a subfolder (``"probes/gemm_tile_probe_h200"``)."""
    for suffix in (".json", ".jsonl"):
        path = results_dir() / f"{name}{suffix}"
        if path.exists():
            return read_results(path)
    print(f"figures: no {results_dir() / name}.json(l), skipping")
    return None


def probe_runs(rows: Sequence[dict], probe: str | None = None) -> list[tuple[str | None, dict]]:
    """A probe file's rows (``read_results`` of a ``*.jsonl``) paired with the run each belongs to: every run of a
    probe script starts with a ``{"probe": "start", "commit": ...}`` row, so a row's run is the ``commit`` of the
    last start row above it (None for runs whose start row names none, or rows above any start row). ``probe``: only
    rows whose ``probe`` is that. Start rows themselves are left out. So two runs of one mode at different commits
    (e.g. the same ``T`` and variant, kernels of different sessions) stay apart instead of one overwriting the
    other in a dict keyed by their fields."""
    out, commit = [], None
    for r in rows:
        if r.get("probe") == "start":
            commit = r.get("commit")
        elif probe is None or r.get("probe") == probe:
            out.append((commit, r))
    return out


def results_kind(data: dict, name: str) -> str:
    """The ``kind`` of a results dict: top-level, else in ``config``, else the file name."""
    return data.get("kind") or data.get("config", {}).get("kind") or name



def results_files(prefix: str = "") -> list[Path]:
    """``results/<prefix>*.json`` (``$MEGAMOE_RESULTS_DIR`` overrides the folder), sorted, without the notebooks'
    own execution times (``notebook_times_*``: rewritten by every notebook run, so no notebook output made from
    them could stay fresh; the README cites them)."""
    return sorted(p for p in results_dir().glob(f"{prefix}*.json") if not p.stem.startswith("notebook_times"))



def results_overview() -> list[dict]:
    """One row per ``results/*.json``: file, kind, device, commit, number of rows."""
    rows = []
    for p in results_files():
        d = read_results(p)
        prov = d.get("provenance", {})
        rows.append({"file": p.name, "kind": d.get("kind"), "device": prov.get("device"),
                     "commit": str(prov.get("git_commit", ""))[:12], "rows": len(d.get("rows") or [])})
    return rows


def flatten_rows(data: dict, columns: Sequence[str] | None = None) -> list[dict]:
    """The ``rows`` of a results dict with nested dicts (e.g. ``steps_us``) flattened to ``key.sub`` columns."""
    out = []
    for r in data.get("rows") or []:
        flat = {}
        for k, v in r.items():
            if isinstance(v, dict):
                flat.update({f"{k}.{kk}": vv for kk, vv in v.items()})
            else:
                flat[k] = v
        out.append({c: flat.get(c) for c in columns} if columns else flat)
    return out

