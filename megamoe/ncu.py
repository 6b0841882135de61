"""Nsight Compute text reports (``ncu --page details --print-units base``, what ``results/probes/device_run.sh ncu``
writes) as rows: one per profiled launch, its metrics by section, and a short summary of where the launch's time
goes (what it saturates, and the stall reasons of its warps).

    python -m megamoe.ncu OUT.json REPORT.txt [REPORT.txt ...]      (one results file of every launch's summary)

The text reports stay in ``results/probes/ncu_h200/`` as ncu printed them; ``results/probes/ncu_h200.json`` is made
from them by this module (the notebooks read that, through ``megamoe.figures.read_results``).
"""
from __future__ import annotations

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


def case_of(path: Path) -> dict:
    """``<format>_<T>_<commit>.txt`` (``device_run.sh ncu``'s files, renamed with the commit) -> its fields."""
    fmt, t, commit = re.fullmatch(r"(?P<f>.+)_(?P<t>\d+)_(?P<c>[0-9a-f]{7,40})", path.stem).group("f", "t", "c")
    return {"format": fmt, "num_tokens_per_rank": int(t), "commit": commit}


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megamoe.ncu", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSON file to write (e.g. results/probes/ncu_h200.json)")
    parser.add_argument("reports", type=Path, nargs="+", help="ncu --page details text reports, "
                        "named <format>_<T>_<commit>.txt")
    args = parser.parse_args(argv)
    out, reports = args.out, args.reports
    if out.suffix != ".json":
        parser.error(f"out: expected a .json path to write, got {str(out)!r}")
    rows = []
    for path in reports:
        for i, launch in enumerate(parse_details(path.read_text())):
            rows.append({**case_of(path), "launch": i, "report": path.name, **summary(launch)})
    out.write_text(json.dumps({"kind": "ncu", "provenance": {
        "command": "python -m megamoe.ncu " + " ".join(argv), "source": "Nsight Compute --page details reports of "
        "results/probes/device_run.sh ncu (one fused call a case; the commit in each row)"}, "rows": rows},
        indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
