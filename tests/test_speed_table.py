"""The README's speed tables are the results files' numbers (``megamoe.speed_table``), and the renderer itself."""
import json
from pathlib import Path

import pytest

from megamoe.speed_table import ratios, speed_table, target_table

ROOT = Path(__file__).resolve().parents[1]


#: The layer files whose tables the README shows (the H200's, the issues' GPU; an H100's of session 38 beside them).
README_FILES = ["layer_h200.json", "layer_fp8_h200.json", "layer_h100-80gb-hbm3.json", "layer_fp8_h100-80gb-hbm3.json"]


@pytest.mark.parametrize("name", README_FILES)
def test_readme_tables_are_the_results_files(name):
    """Each committed layer results file's uniform-routing table appears verbatim in the README: a regenerated
    file without a regenerated README (or a hand-edited number) fails here."""
    table = speed_table(json.loads((ROOT / "results" / name).read_text()))
    assert table in (ROOT / "README.md").read_text(), (
        f"README.md lacks the table of results/{name}; paste `python -m megamoe.speed_table results/{name}`:\n{table}")


@pytest.mark.parametrize("name", README_FILES)
def test_readme_target_tables_are_the_results_files(name):
    """The README's table of the issue targets (met / missed per T) is the committed file's, verbatim."""
    table = target_table(json.loads((ROOT / "results" / name).read_text()))
    assert table in (ROOT / "README.md").read_text(), (
        f"README.md lacks the targets of results/{name}; paste from `python -m megamoe.speed_table results/{name}`:"
        f"\n{table}")


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


def test_target_table_cells():
    """Each FP8 target's cell: the value and met / missed where the target applies, blank where it does not, a dash
    where the file lacks the value -- the limits are the issue's, compared at the boundary both ways."""
    def fused(T, us, tflops, gbps):
        return _row(T, "fused", us, None, tflops=tflops, weight_gb_per_s=gbps)

    result = {"kind": "layer_fp8", "rows": [
        fused(8, 100.0, 5.0, 3800.0), _row(8, "deepgemm_sm90", 100.0), _row(8, "staged", 300.0),
        fused(128, 101.0, 50.0, 3799.0), _row(128, "deepgemm_sm90", 100.0),
        fused(8192, 90.0, 1000.0, None), _row(8192, "deepgemm_sm90", 100.0)]}
    lines = target_table(result).splitlines()
    assert lines[0] == "| target | 8 | 128 | 8192 |"
    assert lines[2] == "| #8: at most 1.0× DeepGEMM's time | 1.00× met | 1.01× **missed** | 0.90× met |"
    assert lines[3] == "| #8: FP8 weights streamed at ≥ 3.8 TB/s (T ≤ 128) | 3.80 TB/s met | 3.80 TB/s **missed** |  |"
    assert lines[4] == "| #8: ≥ 1000 TFLOP/s (T = 8192) |  |  | 1000 TFLOP/s met |"
    fp4 = {"kind": "layer", "rows": [_row(512, "fused", 80.0, "hopper"), _row(2048, "fused", 10.0, "hopper"),
                                     _row(2048, "staged", 29.0)]}
    lines = target_table(fp4).splitlines()
    assert lines[2] == "| #7: at most 0.8× DeepGEMM's time (T ≤ 512) | – |  |"
    assert lines[4] == "| #7: at least 3× faster than staged | – | 2.90× **missed** |"


def test_the_default_row_is_the_files_default_numerics():
    """An FP8 x FP4 file names the numerics ``numerics="auto"`` ran (``config["default_numerics"]``): that row is
    marked the default, carries the tiles, and is the one the ratios and targets read; a file without the key
    (before session 38) had ``"hopper"``."""
    tiles = dict(tile_kind="fp4_ws", tile_block_m=128, tile_predecode=False)
    rows = [_row(512, "fused", 90.0, "hopper", **tiles), _row(512, "fused", 70.0, "hopper_l2_per_block", **tiles),
            _row(512, "deepgemm_sm90", 100.0)]
    new = {"kind": "layer", "config": {"default_numerics": "hopper_l2_per_block"}, "rows": rows}
    lines = speed_table(new).splitlines()
    assert lines[2:5] == ["| fused, hopper numerics | 90 |",
                          "| fused, hopper_l2_per_block numerics (the default on a GPU) | 70 |",
                          "| (its tiles: kind, pool block) | fp4_ws 128 |"]
    assert ratios(new)[512]["vs_deepgemm"] == pytest.approx(0.7)
    assert "| #7: at most 0.8× DeepGEMM's time (T ≤ 512) | 0.70× met |" in target_table(new)
    old = {"kind": "layer", "rows": rows}
    assert speed_table(old).splitlines()[2] == "| fused, hopper numerics (the default on a GPU) | 90 |"
    assert ratios(old)[512]["vs_deepgemm"] == pytest.approx(0.9)
