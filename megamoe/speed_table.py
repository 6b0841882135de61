"""The README's speed tables, rendered from a layer results file (``results/layer_<gpu>.json``,
``results/layer_fp8_<gpu>.json``; ``python -m megamoe.bench --suite layer | layer_fp8``), so that the numbers in
the README are the file's and cannot drift from it (``tests/test_speed_table.py`` compares them).

``python -m megamoe.speed_table results/layer_h200.json [--routing uniform]`` prints the markdown table and, under
it, the fused path's ratio to DeepGEMM's time and its speed-up over the staged pipeline at each T of the file.

A table has one column per ``num_tokens_per_rank`` and one row per implementation (``impl``, and ``numerics`` for
the fused FP8 x FP4 path), µs rounded to integers; ``–`` where the file has no such row (DeepGEMM's kit runs T =
8 / 128 / 512 / 2048 / 8192, the bench also 32). The tile row names the fused default's tile kind, pool block and
predecode flag from the file's ``tile_*`` fields.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megamoe.walkthrough import markdown_table

#: Row label, then the row's filter: ``impl`` and, where several rows share it, ``numerics``.
FP8_FP4_ROWS = (("fused, exact (default)", "fused", "exact"),
                ("fused, hopper numerics", "fused", "hopper"),
                ("fused, hopper_l2_per_block numerics", "fused", "hopper_l2_per_block"),
                ("staged", "staged", None),
                ("torch `_scaled_grouped_mm` FP8, L1+L2 GEMMs only (yardstick)", "torch_grouped_mm", None),
                ("DeepGEMM SM90 (FP8 weights, whole layer)", "deepgemm_sm90", None))
FP8_ROWS = (("fused (default)", "fused", None),
            ("staged", "staged", None),
            ("torch `_scaled_grouped_mm` FP8, GEMMs only (yardstick)", "torch_grouped_mm", None),
            ("DeepGEMM SM90 `fp8_mega_moe` (whole layer)", "deepgemm_sm90", None))
#: Rows left out of a table whose file has none of them (a numerics the bench's layer suite times since session 31:
#: older files have no such rows).
OPTIONAL_ROWS = {("fused", "hopper_l2_per_block")}
#: The fused row whose tiles the table names, by the file's format: (impl, numerics).
TILE_ROW = {"fp8_fp4": ("fused", "hopper"), "fp8": ("fused", None)}
#: The implementation the ratios compare against, and the one the speed-up is over.
PEER, STAGED = "deepgemm_sm90", "staged"


def _format(result: dict) -> str:
    return "fp8" if result["kind"] == "layer_fp8" else "fp8_fp4"


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
        if (impl, numerics) in OPTIONAL_ROWS and not any(picked):
            continue
        line(label, [_us(r) for r in picked])
        if (impl, numerics) == TILE_ROW[fmt]:
            line("(its tiles: kind, pool block)", [_tile(_pick(rows, t, impl, numerics)) for t in tokens])
    roof = [next((r["roofline_us"] for r in rows if r["num_tokens_per_rank"] == t and r.get("roofline_us")), None)
            for t in tokens]
    line("roofline (weight bytes ÷ copy rate or FLOPs ÷ FP8 rate, this run)",
         ["–" if v is None else f"{v:.0f}" for v in roof])
    return markdown_table(table, ["tokens/rank", *map(str, tokens)])


def ratios(result: dict, routing: str = "uniform") -> dict:
    """Per T: ``{"vs_deepgemm": fused / DeepGEMM time, "vs_staged": staged / fused time}`` of the fused default
    (None where a row is missing)."""
    fmt = _format(result)
    impl, numerics = TILE_ROW[fmt]
    rows = [r for r in result["rows"] if r.get("routing") == routing]
    out = {}
    for t in sorted({r["num_tokens_per_rank"] for r in rows}):
        fused, peer, staged = (_pick(rows, t, impl, numerics), _pick(rows, t, PEER, None),
                               _pick(rows, t, STAGED, None))
        out[t] = {"vs_deepgemm": fused["us"] / peer["us"] if fused and peer else None,
                  "vs_staged": staged["us"] / fused["us"] if fused and staged else None}
    return out


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


if __name__ == "__main__":
    main()
