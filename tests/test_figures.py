"""megamoe.figures: `python -m megamoe.figures` writes every figure (PNG + SVG) into $MEGAMOE_FIGURES_DIR."""
import json
import time

import pytest

from megamoe import figures
from megamoe.layout import Layout

PULL = {"kind": "pull_bandwidth", "provenance": {"device": "test"}, "config": {"emulated_ranks": True},
        "rows": [{"op": op, "row_bytes": rb, "num_rows": 8, "bytes": 8 * rb, "us": 1.0, "gb_s": rb / 1e3}
                 for op in ("pull", "push") for rb in (256, 1024, 7168)]}
GENERIC = {"provenance": {"device": "test"}, "config": {"x": "tokens", "y": "us", "series": "impl", "xlog": True},
           "rows": [{"impl": i, "tokens": t, "us": t * f} for i, f in (("staged", 2.0), ("fused", 1.0))
                    for t in (8, 64, 512)]}


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    out, res = tmp_path / "figures", tmp_path / "results"
    res.mkdir()
    monkeypatch.setenv("MEGAMOE_FIGURES_DIR", str(out))
    monkeypatch.setenv("MEGAMOE_RESULTS_DIR", str(res))
    return out, res


def test_main_writes_every_figure(dirs, capsys):
    out, res = dirs
    (res / "pull_bandwidth.json").write_text(json.dumps(PULL))
    (res / "latency_sweep.json").write_text(json.dumps(GENERIC))
    t0 = time.perf_counter()
    written = figures.main()
    assert time.perf_counter() - t0 < 30
    names = list(figures.static_figures()) + ["bench_pull_bandwidth", "bench_latency_sweep"]
    for name in names:
        for ext in ("png", "svg"):
            path = out / f"{name}.{ext}"
            assert path.exists() and path.stat().st_size > 1000, path
    assert sorted(p.name for p in written) == sorted(f"{n}.{e}" for n in names for e in ("png", "svg"))
    assert "bench_pull_bandwidth" in capsys.readouterr().out


def test_main_without_results_skips_bench_figures(dirs, capsys, monkeypatch):
    out, _ = dirs
    monkeypatch.setattr(figures, "static_figures", lambda: {"pool_size_sweep": figures.pool_size_sweep})
    written = figures.main()
    assert [p.name for p in written] == ["pool_size_sweep.png", "pool_size_sweep.svg"]
    assert "no benchmark figures" in capsys.readouterr().out


def test_plot_results_missing_file_and_unplottable_rows(dirs, capsys):
    _, res = dirs
    assert figures.plot_results("does_not_exist") is None
    assert "skipping" in capsys.readouterr().out
    (res / "text_only.json").write_text(json.dumps({"kind": "notes", "config": {}, "rows": [{"what": "x"}]}))
    assert figures.plot_results("text_only") is None


def test_kind_dispatch():
    assert figures.results_kind(PULL, "f") == "pull_bandwidth"
    assert figures.results_kind({"config": {"kind": "k"}}, "f") == "k"
    assert figures.results_kind(GENERIC, "latency_sweep") == "latency_sweep"


def test_layout_breakdown_small_layout(dirs):
    out, _ = dirs
    fig = figures.layout_breakdown(Layout(2, 8, 64, 2, 512, 512))
    paths = figures.save_figure(fig, "tiny_layout")
    assert [p.suffix for p in paths] == [".png", ".svg"] and all(p.exists() for p in paths)
    assert "<svg" in paths[1].read_text()[:500]
