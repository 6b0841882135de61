"""The README's speed tables, rendered from a layer results file (``results/layer_<gpu>.json``,
``results/layer_fp8_<gpu>.json``; ``python -m megamoe.bench --suite layer | layer_fp8``), so that the numbers in
the README are the file's and cannot drift from it (``tests/test_speed_table.py`` compares them).

``python -m megamoe.speed_table results/layer_h200.json [--routing uniform]`` prints the markdown table, under it
the fused path's ratio to DeepGEMM's time and its speed-up over the staged pipeline at each T of the file, and the
table of the format's issue targets (:data:`TARGETS`: issue #7 for FP8 x FP4, #8 for FP8 x FP8), each cell the
measured value and whether it meets the target there.

A table has one column per ``num_tokens_per_rank`` and one row per implementation (``impl``, and ``numerics`` for
the fused FP8 x FP4 path), µs rounded to integers; ``–`` where the file has no such row (DeepGEMM's kit runs T =
8 / 128 / 512 / 2048 / 8192, the bench also 32), and no row for an implementation without any at that routing
(DeepGEMM's kit runs uniform routing only). The tile row names the fused default's tile kind, pool block and
predecode flag from the file's ``tile_*`` fields.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from megamoe.walkthrough import markdown_table

#: Row label, then the row's filter: ``impl`` and, where several rows share it, ``numerics``.
FP8_FP4_ROWS = (("fused, exact numerics", "fused", "exact"),
                ("fused, hopper numerics", "fused", "hopper"),
                ("fused, hopper_l2_per_block numerics", "fused", "hopper_l2_per_block"),
                ("staged", "staged", None),
                ("torch `_scaled_grouped_mm` FP8, L1+L2 GEMMs only (yardstick)", "torch_grouped_mm", None),
                ("DeepGEMM SM90 (FP8 weights, whole layer)", "deepgemm_sm90", None))
FP8_ROWS = (("fused (default)", "fused", None),
            ("staged", "staged", None),
            ("torch `_scaled_grouped_mm` FP8, GEMMs only (yardstick)", "torch_grouped_mm", None),
            ("DeepGEMM SM90 `fp8_mega_moe` (whole layer)", "deepgemm_sm90", None))
#: What ``numerics="auto"`` ran on a GPU in FP8 x FP4 files without ``config["default_numerics"]`` (before session 38).
OLD_DEFAULT_NUMERICS = "hopper"
#: The label's mark of the fused default's row (its tiles follow it; the ratios and targets are its).
DEFAULT_MARK = " (the default on a GPU)"
#: The implementation the ratios compare against, and the one the speed-up is over.
PEER, STAGED = "deepgemm_sm90", "staged"



@dataclass(frozen=True)
class Target:
    """One of an issue's targets for the fused default: ``measure`` (a key of :func:`measures`) at most / at least
    (``at_most``) ``limit`` at every T in ``[t_min, t_max]``."""
    issue: int
    what: str
    measure: str
    limit: float
    at_most: bool
    t_min: int = 0
    t_max: float = math.inf


#: The targets of the issues, as they state them, by format (one H200, world size 1, 48 experts of V4-Pro).
TARGETS = {
    "fp8_fp4": (Target(7, "at most 0.8× DeepGEMM's time (T ≤ 512)", "vs_deepgemm", 0.8, True, t_max=512),
                Target(7, "at most 1.25× DeepGEMM's time (T ≥ 2048)", "vs_deepgemm", 1.25, True, t_min=2048),
                Target(7, "at least 3× faster than staged", "vs_staged", 3.0, False)),
    "fp8": (Target(8, "at most 1.0× DeepGEMM's time", "vs_deepgemm", 1.0, True),
            Target(8, "FP8 weights streamed at ≥ 3.8 TB/s (T ≤ 128)", "weight_tb_per_s", 3.8, False, t_max=128),
            Target(8, "≥ 1000 TFLOP/s (T = 8192)", "tflops", 1000.0, False, t_min=8192, t_max=8192)),
}
#: How each measure is printed.
MEASURE_FORMAT = {"vs_deepgemm": "{:.2f}×", "vs_staged": "{:.2f}×", "weight_tb_per_s": "{:.2f} TB/s",
                  "tflops": "{:.0f} TFLOP/s"}

def _format(result: dict) -> str:
    return "fp8" if result["kind"] == "layer_fp8" else "fp8_fp4"


def default_row(result: dict) -> tuple[str, str | None]:
    """``(impl, numerics)`` of the fused default in ``result``: FP8 x FP8 has one fused row; FP8 x FP4 the numerics
    ``numerics="auto"`` ran on a GPU at the file's commit (``config["default_numerics"]``, written by the bench
    since session 38; :data:`OLD_DEFAULT_NUMERICS` before)."""
    if _format(result) == "fp8":
        return "fused", None
    return "fused", result.get("config", {}).get("default_numerics", OLD_DEFAULT_NUMERICS)


def _pick(rows: list[dict], T: int, impl: str, numerics: str | None) -> dict | None:
    hits = [r for r in rows if r["num_tokens_per_rank"] == T and r["impl"] == impl
            and (numerics is None or r.get("numerics") == numerics)]
    if len(hits) > 1:
        raise ValueError(f"{len(hits)} rows for T={T}, impl={impl!r}, numerics={numerics!r}: the filter is ambiguous")
    return hits[0] if hits else None


def _us(row: dict | None) -> str:
    return "–" if row is None else f"{row['us']:.0f}"


def _tile(row: dict | None) -> str:
    if row is None:
        return "–"
    return (f"{row['tile_kind']} {row['tile_block_m']}" + (", predecoded" if row.get("tile_predecode") else "")
            + (f", register A (chunk {row['tile_rs_block_n']})" if row.get("tile_rs_block_n") else "")
            + (", idle decode" if row.get("tile_idle_decode") else ""))


def speed_table(result: dict, routing: str = "uniform") -> str:
    """The markdown table of ``result`` (a layer results file's JSON) at ``routing``: µs per call by
    implementation and tokens per rank, the fused default's tiles, and the file's roofline."""
    fmt = _format(result)
    rows = [r for r in result["rows"] if r.get("routing") == routing]
    tokens = sorted({r["num_tokens_per_rank"] for r in rows})
    table = []

    def line(label: str, cells) -> None:
        table.append({"tokens/rank": label, **{str(t): c for t, c in zip(tokens, cells)}})

    for label, impl, numerics in (FP8_FP4_ROWS if fmt == "fp8_fp4" else FP8_ROWS):
        picked = [_pick(rows, t, impl, numerics) for t in tokens]
        if not any(picked):  # (none at this routing: e.g. DeepGEMM's kit runs uniform routing only, and files
            continue         # before session 31 have no hopper_l2_per_block rows)
        default = (impl, numerics) == default_row(result)
        line(label + (DEFAULT_MARK if default and fmt == "fp8_fp4" else ""), [_us(r) for r in picked])
        if default:
            line("(its tiles: kind, pool block)", [_tile(_pick(rows, t, impl, numerics)) for t in tokens])
    roof = [next((r["roofline_us"] for r in rows if r["num_tokens_per_rank"] == t and r.get("roofline_us")), None)
            for t in tokens]
    line("roofline (weight bytes ÷ copy rate or FLOPs ÷ FP8 rate, this run)",
         ["–" if v is None else f"{v:.0f}" for v in roof])
    return markdown_table(table, ["tokens/rank", *map(str, tokens)])


def ratios(result: dict, routing: str = "uniform") -> dict:
    """Per T: ``{"vs_deepgemm": fused / DeepGEMM time, "vs_staged": staged / fused time}`` of the fused default
    (None where a row is missing)."""
    impl, numerics = default_row(result)
    rows = [r for r in result["rows"] if r.get("routing") == routing]
    out = {}
    for t in sorted({r["num_tokens_per_rank"] for r in rows}):
        fused, peer, staged = (_pick(rows, t, impl, numerics), _pick(rows, t, PEER, None),
                               _pick(rows, t, STAGED, None))
        out[t] = {"vs_deepgemm": fused["us"] / peer["us"] if fused and peer else None,
                  "vs_staged": staged["us"] / fused["us"] if fused and staged else None}
    return out


def measures(result: dict, routing: str = "uniform") -> dict:
    """Per T, what :data:`TARGETS` compare: :func:`ratios` and the fused default's ``tflops`` and weight stream
    (``weight_tb_per_s``: its row's ``weight_gb_per_s`` / 1000); None where the file has no such value."""
    impl, numerics = default_row(result)
    rows = [r for r in result["rows"] if r.get("routing") == routing]
    out = ratios(result, routing)
    for t, m in out.items():
        fused = _pick(rows, t, impl, numerics) or {}
        m["tflops"] = fused.get("tflops")
        gbps = fused.get("weight_gb_per_s")
        m["weight_tb_per_s"] = None if gbps is None else gbps / 1000
    return out


def target_table(result: dict, routing: str = "uniform") -> str:
    """The markdown table of the format's :data:`TARGETS` against ``result``: one row per target, one column per T,
    each cell the measured value and "met" / "missed" (empty where the target does not apply, "–" where the file
    has no value)."""
    fmt = _format(result)
    m = measures(result, routing)
    tokens = sorted(m)
    table = []
    for g in TARGETS[fmt]:
        row = {"target": f"#{g.issue}: {g.what}"}
        for t in tokens:
            if not g.t_min <= t <= g.t_max:
                row[str(t)] = ""
                continue
            v = m[t][g.measure]
            if v is None:
                row[str(t)] = "–"
                continue
            ok = v <= g.limit if g.at_most else v >= g.limit
            row[str(t)] = MEASURE_FORMAT[g.measure].format(v) + (" met" if ok else " **missed**")
        table.append(row)
    return markdown_table(table, ["target", *map(str, tokens)])


def ratio_line(result: dict, routing: str = "uniform") -> str:
    """One line: the fused default's time as a multiple of DeepGEMM's, and its speed-up over staged, per T."""
    r = ratios(result, routing)
    parts = []
    for key, what, digits in (("vs_deepgemm", "fused / DeepGEMM", 3), ("vs_staged", "staged / fused", 2)):
        have = {t: v[key] for t, v in r.items() if v[key] is not None}
        if have:
            parts.append(f"{what} at T = " + " / ".join(map(str, have)) + ": "
                         + " / ".join(f"{x:.{digits}f}×" for x in have.values()))
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m megamoe.speed_table", description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, help="a layer results file, e.g. results/layer_h200.json")
    p.add_argument("--routing", default="uniform")
    a = p.parse_args(argv)
    result = json.loads(a.result.read_text())
    print(speed_table(result, a.routing))
    print()
    print(ratio_line(result, a.routing))
    print()
    print(target_table(result, a.routing))


if __name__ == "__main__":
    main()
