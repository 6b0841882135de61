"""The README's speed tables are the results files' numbers (``megamoe.speed_table``), and the renderer itself."""
import json
from pathlib import Path

import pytest

from megamoe.speed_table import ratios, speed_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["layer_h200.json", "layer_fp8_h200.json"])
def test_readme_tables_are_the_results_files(name):
    """Each committed layer results file's uniform-routing table appears verbatim in the README: a regenerated
    file without a regenerated README (or a hand-edited number) fails here."""
    table = speed_table(json.loads((ROOT / "results" / name).read_text()))
    assert table in (ROOT / "README.md").read_text(), (
        f"README.md lacks the table of results/{name}; paste `python -m megamoe.speed_table results/{name}`:\n{table}")


def _row(T, impl, us, numerics=None, **kw):
    return dict(num_tokens_per_rank=T, impl=impl, us=us, numerics=numerics, routing="uniform", roofline_us=100.0,
                **kw)


def test_table_and_ratios_from_rows():
    """Columns by T, a dash where a row is missing, the fused default's tiles, ratios to DeepGEMM and staged."""
    tiles = dict(tile_kind="fp8_ws", tile_block_m=64, tile_predecode=False)
    result = {"kind": "layer_fp8", "rows": [
        _row(8, "fused", 90.4, "exact", **tiles), _row(8, "staged", 180.0, "exact"), _row(8, "deepgemm_sm90", 100.0),
        _row(32, "fused", 200.0, "exact", **dict(tiles, tile_block_m=128, tile_predecode=True, tile_idle_decode=True)),
        _row(32, "staged", 300.0, "exact"), dict(_row(8, "fused", 1.0, "exact"), routing="skewed")]}
    lines = speed_table(result).splitlines()
    assert lines[0] == "| tokens/rank | 8 | 32 |"
    assert lines[2] == "| fused (default) | 90 | 200 |"
    assert lines[3] == "| (its tiles: kind, pool block) | fp8_ws 64 | fp8_ws 128, predecoded, idle decode |"
    assert "| DeepGEMM SM90 `fp8_mega_moe` (whole layer) | 100 | – |" in lines
    r = ratios(result)
    assert r[8] == pytest.approx({"vs_deepgemm": 0.904, "vs_staged": 180 / 90.4})
    assert r[32]["vs_deepgemm"] is None and r[32]["vs_staged"] == pytest.approx(1.5)


def test_ambiguous_rows_are_refused():
    result = {"kind": "layer", "rows": [_row(8, "fused", 1.0, "hopper"), _row(8, "fused", 2.0, "hopper")]}
    with pytest.raises(ValueError, match="ambiguous"):
        speed_table(result)
