"""Nsight Compute text reports (``ncu --page details --print-units base``, what ``results/probes/device_run.sh ncu``
writes) as rows: one per profiled launch, its metrics by section, and a short summary of where the launch's time
goes (what it saturates, and the stall reasons of its warps).

    python -m megamoe.ncu OUT.json REPORT.txt [REPORT.txt ...]      (one results file of every launch's summary)

Also the SASS source page of a PC-sampling report (``ncu --import R.ncu-rep --page source --print-source sass
--csv``, gzipped: what ``device_run.sh ncu_source`` writes) as a per-instruction stall ledger: which instructions the
warps were sampled at and why (``parse_source``, ``source_summary``; the same command with ``.sass.csv.gz`` files).

The text reports stay in ``results/probes/ncu_h200/`` as ncu printed them; ``results/probes/ncu_h200.json`` (and
``ncu_source_h200.json``) are made from them by this module (the notebooks read those, through
``megamoe.figures.read_results``).
"""
from __future__ import annotations

import csv
import gzip
import io
import json
import re
import sys
from pathlib import Path

#: A launch's header line: kernel name, grid and block.
_KERNEL_RE = re.compile(r"^  (?P<name>[A-Za-z_]\w*) \((?P<grid>\d+, \d+, \d+)\)x\((?P<block>\d+, \d+, \d+)\)")
#: The stall-reason metrics (``--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio``):
#: cycles a warp spends stalled for that reason per instruction issued.
_STALL_RE = re.compile(r"smsp__average_warps_issue_stalled_(?P<reason>\w+)_per_issue_active\.ratio")


def _number(text: str):
    """``'1,177,238'`` -> 1177238, ``'83.76'`` -> 83.76; other text as it is (``'no data'``)."""
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return text
    return int(value) if value.is_integer() and "." not in text else value


def parse_details(text: str) -> list[dict]:
    """The launches of one ``--page details`` report: ``[{"kernel", "grid", "block", "sections": {section: {metric:
    value}}}]`` in profiling order (metric rows are the lines of a section's tables: name, optional unit, value,
    separated by two or more spaces; rule messages and table borders are skipped)."""
    launches, section = [], None
    for line in text.splitlines():
        m = _KERNEL_RE.match(line)
        if m:
            launches.append({"kernel": m["name"], "grid": [int(v) for v in m["grid"].split(", ")],
                             "block": [int(v) for v in m["block"].split(", ")], "sections": {}})
            section = None
            continue
        if not launches or not line.startswith("    ") or line.startswith("     "):
            continue  # (rule messages are indented further)
        stripped = line.strip()
        if stripped.startswith("Section: "):
            section = launches[-1]["sections"].setdefault(stripped[len("Section: "):], {})
            continue
        if section is None or stripped.startswith("-") or stripped.split()[0] in ("OPT", "INF", "WRN", "Metric"):
            continue
        parts = re.split(r"\s{2,}", stripped)
        if len(parts) >= 2:  # (a unit and a long value can be one space apart: "hz 1,975,473,151.41")
            last = _number(parts[-1].rsplit(" ", 1)[-1])
            section[parts[0]] = last if isinstance(last, (int, float)) else parts[-1]
    return launches


def summary(launch: dict) -> dict:
    """The figures of one launch that say where its time goes: duration (us), SM clock (MHz), throughput in % of
    peak of DRAM, L2, L1 / shared memory and the SMs (``Compute (SM) Throughput``: the busiest pipeline), issue
    slots busy (%), local-memory (spill) requests, and the stall reasons as cycles per issued instruction, largest
    first."""
    s = launch["sections"]
    sol, mem = s.get("GPU Speed Of Light Throughput", {}), s.get("Memory Workload Analysis", {})
    stalls = {m["reason"]: v for k, v in s.get("Command line profiler metrics", {}).items()
              if (m := _STALL_RE.fullmatch(k)) and isinstance(v, (int, float))}
    return {"kernel": launch["kernel"], "grid": launch["grid"], "block": launch["block"],
            "us": sol.get("Duration", 0) / 1e3, "sm_mhz": round(sol.get("SM Frequency", 0) / 1e6),
            "dram_pct": sol.get("DRAM Throughput"), "l2_pct": sol.get("L2 Cache Throughput"),
            "l1_pct": sol.get("L1/TEX Cache Throughput"), "sm_pct": sol.get("Compute (SM) Throughput"),
            "issue_busy_pct": s.get("Compute Workload Analysis", {}).get("Issue Slots Busy"),
            "l2_hit_pct": mem.get("L2 Hit Rate"), "dram_bytes_per_s": mem.get("Memory Throughput"),
            "spill_requests": mem.get("Local Memory Spilling Requests"),
            "stalls": dict(sorted(stalls.items(), key=lambda kv: -kv[1]))}


#: The source page's column of every sample at an instruction (issued or not) and the per-reason columns' prefix.
_SAMPLES = "Warp Stall Sampling (All Samples)"
_REASON = "stall_"


def parse_source(text: str) -> list[dict]:
    """The instructions of a ``--page source --print-source sass --csv`` page in address order: ``{"address",
    "sass", "samples", "executed", "reasons": {reason: samples}}`` (the lines above the ``"Address"`` header -- the
    kernel's name -- are skipped; empty cells read as 0)."""
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if header is None:
        raise ValueError("not an ncu source page: no \"Address\" header line")
    rows = []
    for r in csv.DictReader(io.StringIO("\n".join(lines[header:]))):
        num = lambda k: float(r.get(k) or 0)  # noqa: E731
        rows.append({"address": int(r["Address"], 16), "sass": r["Source"].strip(), "samples": num(_SAMPLES),
                     "executed": num("Instructions Executed"),
                     "reasons": {k[len(_REASON):]: num(k) for k in r if k.startswith(_REASON) and "(" not in k}})
    return rows


def _is_join_wait(rows: list[dict], i: int) -> bool:
    """Instruction ``i`` is where a finished warp-specialised partition waits for the others: the ``NOP`` of the
    ``USETMAXREG.TRY_ALLOC`` retry loop after the partitions' closing ``BAR.SYNC`` (its samples are idle warps --
    a pull or loader warp done early -- not a cost of the running ones)."""
    return rows[i]["sass"] == "NOP" and i + 1 < len(rows) and "USETMAXREG.TRY_ALLOC" in rows[i + 1]["sass"]


def source_summary(rows: list[dict], top: int = 12) -> dict:
    """Where the sampled warps were: all samples; the share at the partitions' join (``_is_join_wait``, excluded
    from what follows); the rest by stall reason (% of the rest, largest first) and by opcode; the ``top``
    instructions by samples with their main reason, and for an mbarrier wait loop (``@!P BRA`` back to a
    ``SYNCS.PHASECHK``) the barrier's shared-memory operand, which names the ring barrier waited on."""
    total = sum(r["samples"] for r in rows)
    rest = [i for i in range(len(rows)) if not _is_join_wait(rows, i)]
    busy = sum(rows[i]["samples"] for i in rest) or 1.0
    reasons, ops = {}, {}
    for r in (rows[i] for i in rest):
        for k, v in r["reasons"].items():
            reasons[k] = reasons.get(k, 0.0) + v
        op = re.sub(r"^@!?U?P\w+\s+", "", r["sass"]).split(" ")[0].split(".")[0]
        ops[op] = ops.get(op, 0.0) + r["samples"]
    by_reason_total = sum(reasons.values()) or 1.0
    pct = lambda d, n: {k: round(100 * v / n, 1) for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v}  # noqa: E731
    hot = []
    for i in sorted(rest, key=lambda i: -rows[i]["samples"])[:top]:
        r = rows[i]
        entry = {"address": hex(r["address"] - rows[0]["address"]), "sass": r["sass"], "pct": round(100 * r["samples"]
                 / busy, 1), "reason": max(r["reasons"], key=r["reasons"].get) if r["reasons"] else None}
        wait = [q["sass"] for q in rows[max(0, i - 2):i] if q["sass"].startswith("SYNCS.PHASECHK")]
        if "BRA" in r["sass"] and wait:
            entry["mbarrier"] = re.search(r"\[([^\]]*)\]", wait[-1]).group(1)
        hot.append(entry)
    return {"samples": total, "join_wait_pct": round(100 * (total - busy) / (total or 1), 1),
            "reasons_pct": pct(reasons, by_reason_total), "opcodes_pct": dict(list(pct(ops, busy).items())[:12]),
            "top": hot}


def case_of(path: Path) -> dict:
    """``<format>_<T>_<commit>.txt`` or ``.sass.csv.gz`` (``device_run.sh ncu`` / ``ncu_source``'s files, renamed
    with the commit) -> its fields."""
    stem = path.name.split(".")[0]
    fmt, t, commit = re.fullmatch(r"(?P<f>.+)_(?P<t>\d+)_(?P<c>[0-9a-f]{7,40})", stem).group("f", "t", "c")
    return {"format": fmt, "num_tokens_per_rank": int(t), "commit": commit}


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megamoe.ncu", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSON file to write (e.g. results/probes/ncu_h200.json)")
    parser.add_argument("reports", type=Path, nargs="+", help="ncu --page details text reports, "
                        "named <format>_<T>_<commit>.txt, or gzipped SASS source pages, <format>_<T>_<commit>"
                        ".sass.csv.gz (all of one kind)")
    args = parser.parse_args(argv)
    out, reports = args.out, args.reports
    if out.suffix != ".json":
        parser.error(f"out: expected a .json path to write, got {str(out)!r}")
    sources = [p.name.endswith(".sass.csv.gz") for p in reports]
    if any(sources) and not all(sources):
        parser.error("reports: details reports (.txt) and source pages (.sass.csv.gz) go to separate files")
    rows = []
    for path in reports:
        if sources[0]:
            rows.append({**case_of(path), "report": path.name,
                         **source_summary(parse_source(gzip.decompress(path.read_bytes()).decode()))})
            continue
        for i, launch in enumerate(parse_details(path.read_text())):
            rows.append({**case_of(path), "launch": i, "report": path.name, **summary(launch)})
    source = ("Nsight Compute PC sampling of the Gluon GEMM phase, its SASS source page (results/probes/device_run.sh "
              "ncu_source; the commit in each row)" if sources[0] else "Nsight Compute --page details reports of "
              "results/probes/device_run.sh ncu (one fused call a case; the commit in each row)")
    out.write_text(json.dumps({"kind": "ncu_source" if sources[0] else "ncu", "provenance": {
        "command": "python -m megamoe.ncu " + " ".join(argv), "source": source}, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
