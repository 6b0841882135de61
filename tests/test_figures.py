"""megamoe.figures: the figure functions the notebooks call (``make figures`` executes the notebooks, which write
every figure, PNG + SVG, into $MEGAMOE_FIGURES_DIR), and one plotter per result kind."""
import json

import pytest

from megamoe import figures
from megamoe.layout import Layout

PULL = {"kind": "pull_bandwidth", "provenance": {"device": "test"}, "config": {"emulated_ranks": True},
        "rows": [{"op": op, "row_bytes": rb, "num_rows": 8, "bytes": 8 * rb, "us": 1.0, "gb_s": rb / 1e3}
                 for op in ("pull", "push") for rb in (256, 1024, 7168)]}
GENERIC = {"provenance": {"device": "test"}, "config": {"x": "tokens", "y": "us", "series": "impl", "xlog": True},
           "rows": [{"impl": i, "tokens": t, "us": t * f} for i, f in (("staged", 2.0), ("fused", 1.0))
                    for t in (8, 64, 512)]}

LAYER = {"kind": "layer", "provenance": {"device": "test"}, "config": {},
         "rows": [{"num_tokens_per_rank": t, "dispatch": d, "us": t * f, "tflops": t / f,
                   "steps_us": {"count": 1.0, "l1": t * f / 2, "l2": t * f / 3}}
                  for d, f in (("pull", 1.0), ("push", 1.2)) for t in (8, 512, 8192)]}
CEILINGS = {"kind": "ceilings", "provenance": {"device": "test"},
            "rows": [{"what": "fp8_scaled_mm_8192", "ms": 0.75, "tflops": 1457.0},
                     {"what": "copy_1GiB", "ms": 0.5, "tb_per_s": 4.2}]}
TUNE = {"kind": "tune", "provenance": {"device": "test"}, "config": {},
        "rows": [{"block_m": 64, "num_tokens": 8, "variant": {}, "l1_us": 400.0, "l2_us": 200.0},
                 {"block_m": 64, "num_tokens": 8, "variant": {"BLOCK_N": 128, "l1_only": True}, "l1_us": 380.0}]}
LAYER_IMPLS = {"kind": "layer", "provenance": {"device": "test"}, "config": {},
               "rows": [{"impl": i, "numerics": m, "routing": r, "num_tokens_per_rank": t, "us": t * f,
                         "roofline_pct": 10.0 / f}
                        for i, m, f in (("fused", "exact", 1.0), ("staged", "exact", 1.5),
                                        ("torch_grouped_mm", None, 0.5))
                        for r in ("uniform", "skewed") for t in (8, 512, 8192)]}
TIMELINE = {"kind": "timeline", "provenance": {"device": "test"},
            "config": {"kinds": ["count", "barrier1", "pull", "l1", "l2", "barrier2", "combine", "barrier3"]},
            "rows": [{"numerics": "exact", "num_tokens_per_rank": 128, "block_m": 64, "programs": 2, "span_us": 9.0,
                      "events": [[[2, 0, 1000], [3, 1000, 5000], [4, 5000, 8000], [6, 8000, 9000]],
                                 [[3, 500, 4000], [4, 4000, 7000]]]}]}
FUSED_TUNE = {"kind": "fused_tune", "provenance": {"device": "test"}, "config": {},
              "rows": [{"num_tokens_per_rank": n, "numerics": "exact", "block_m": bm, "num_warps": w,
                        "programs_per_rank": p, "us": n * w, "staged_us": n * 6.0}
                       for n in (8, 512) for bm, w, p in ((64, 8, 132), (64, 4, 264))]}
PULL_PUSH = {"kind": "pull_push", "provenance": {"device": "test"}, "config": {"num_ranks": 4},
             "rows": [{"num_tokens_per_rank": 128, "dispatch": d, "us": 9000.0 * f, "tflops": 44.0 / f,
                       "steps_us": {"count": 130.0, "barrier1_arrive": 180.0, d: 160.0, "l1": 5600.0 * f}}
                      for d, f in (("pull", 1.0), ("push", 1.003))]}
RESULTS = {"pull_bandwidth": PULL, "latency_sweep": GENERIC, "layer_test": LAYER, "ceilings_test": CEILINGS,
           "tune_test": TUNE, "layer_impls": LAYER_IMPLS, "timeline_test": TIMELINE, "fused_tune_test": FUSED_TUNE,
           "pull_push_test": PULL_PUSH}


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    out, res = tmp_path / "figures", tmp_path / "results"
    res.mkdir()
    monkeypatch.setenv("MEGAMOE_FIGURES_DIR", str(out))
    monkeypatch.setenv("MEGAMOE_RESULTS_DIR", str(res))
    return out, res


def test_plot_results_missing_file_and_unplottable_rows(dirs, capsys):
    _, res = dirs
    assert figures.plot_results("does_not_exist") is None
    assert "skipping" in capsys.readouterr().out
    (res / "text_only.json").write_text(json.dumps({"kind": "notes", "config": {}, "rows": [{"what": "x"}]}))
    assert figures.plot_results("text_only") is None


def test_schema_drift_falls_back_to_the_generic_plot(dirs, capsys):
    _, res = dirs
    drifted = {"kind": "layer", "rows": [{"tokens": 8, "time_us": 5.0}, {"tokens": 64, "time_us": 9.0}]}
    (res / "layer_new.json").write_text(json.dumps(drifted))
    assert figures.plot_results("layer_new") is not None
    assert "generic" in capsys.readouterr().out


def test_a_plotter_bug_is_raised_not_hidden_by_the_fallback(dirs, monkeypatch):
    """Only declared keys that the results lack pick the generic plot; an error inside the plotter is raised."""
    _, res = dirs

    @figures.needs("tokens")
    def broken(data):
        return data["rows"][0]["not_declared"]

    monkeypatch.setitem(figures.BENCH_PLOTS, "broken_kind", broken)
    (res / "broken.json").write_text(json.dumps({"kind": "broken_kind", "rows": [{"tokens": 8, "us": 1.0}]}))
    with pytest.raises(KeyError, match="not_declared"):
        figures.plot_results("broken")
    assert figures.missing_keys(broken, {"rows": [{"us": 1.0}]}) == ["tokens"]
    assert figures.missing_keys(figures.bench_timeline, {"rows": []}) == ["config.kinds"]


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


def test_bench_figures_save_without_warnings(dirs):
    """No plotter leaves a warning in a notebook's output (e.g. constrained layout giving up on crowded panels)."""
    import warnings

    _, res = dirs
    for name, data in RESULTS.items():
        (res / f"{name}.json").write_text(json.dumps(data))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fig = figures.plot_results(name)
            if fig is not None:
                figures.save_figure(fig, name)
    assert figures.variant_label({"prmt_decode": True, "prefetch_w": False, "num_warps": 8}) == \
        "prmt decode, num warps 8"


def test_saved_png_is_a_compact_palette_rendering(dirs):
    """The PNG a notebook embeds is a 256-colour rendering at PNG_DPI: a fraction of a true-colour 150 dpi PNG."""
    import io

    from PIL import Image

    fig = figures.pool_size_sweep()
    png = figures.save_figure(fig, "sweep")[0]
    with Image.open(png) as image:  # (closed: an open file left to the collector is a ResourceWarning)
        assert image.mode == "P"
    full = io.BytesIO()
    fig.savefig(full, format="png", dpi=150, bbox_inches="tight")
    assert png.stat().st_size < len(full.getvalue()) / 3
    assert Image.open(io.BytesIO(fig._repr_png_())).mode == "P"  # a figure shown as a cell value is compact too


def test_every_result_kind_plots_with_its_own_plotter(dirs, capsys):
    """The layer (per implementation and routing), timeline (Gantt) and fused_tune plotters read the schemas that
    ``megamoe.bench`` writes; only the pre-fused layer schema (no ``impl``) drops to the generic plot."""
    _, res = dirs
    for name, data in RESULTS.items():
        (res / f"{name}.json").write_text(json.dumps(data))
        capsys.readouterr()
        assert figures.plot_results(name) is not None, name
        fell_back = "generic" in capsys.readouterr().out
        assert fell_back == (name == "layer_test"), name


def _layer_run(fmt: str | None, impls: dict, tokens=(8, 128, 8192)) -> dict:
    """A ``layer`` result of one weight format: ``impls`` maps (impl, numerics) to a time factor; DeepGEMM SM90 is
    measured at every T but the last (its ratios stop there)."""
    config = {"format": fmt} if fmt else {}
    rows = [{"impl": i, "numerics": m, "routing": r, "num_tokens_per_rank": t, "us": 100.0 * t * f}
            for (i, m), f in impls.items() for r in ("uniform", "skewed") for t in tokens
            if not (i == "deepgemm_sm90" and (r != "uniform" or t == tokens[-1]))]
    return {"kind": "layer_fp8" if fmt else "layer", "provenance": {"device": "test"}, "config": config, "rows": rows}


def test_format_comparison_divides_by_deepgemm_of_the_same_run(dirs):
    """Both formats side by side: each series' ratios use DeepGEMM SM90 of its own run, only where it was measured;
    the table has one cell per such T; the figure saves without warnings; ``layer_fp8`` has its own plotter."""
    import warnings

    _, res = dirs
    fp4 = _layer_run(None, {("fused", "exact"): 3.0, ("fused", "hopper"): 4.0, ("deepgemm_sm90", None): 1.0})
    fp8 = _layer_run("fp8", {("fused", "exact"): 1.25, ("staged", "exact"): 1.5, ("deepgemm_sm90", None): 1.1})
    series = figures.format_comparison(fp4, fp8)
    by = {(s["format"], s["impl"], s["numerics"]): s for s in series}
    assert set(by) == {("fp8_fp4", "fused", "exact"), ("fp8_fp4", "fused", "hopper"),
                       ("fp8_fp4", "deepgemm_sm90", None), ("fp8", "fused", "exact"), ("fp8", "staged", "exact"),
                       ("fp8", "deepgemm_sm90", None)}
    assert by["fp8_fp4", "fused", "exact"]["vs_deepgemm"] == pytest.approx({8: 3.0, 128: 3.0})
    assert by["fp8", "fused", "exact"]["vs_deepgemm"] == pytest.approx({8: 1.25 / 1.1, 128: 1.25 / 1.1})
    assert by["fp8", "fused", "exact"]["us"][8192] == pytest.approx(100.0 * 8192 * 1.25)   # no ratio, still plotted
    assert by["fp8_fp4", "fused", "exact"]["weights"] == figures.FORMAT_WEIGHTS["fp8_fp4"]
    assert by["fp8_fp4", "deepgemm_sm90", None]["weights"] == figures.PEER_WEIGHTS["deepgemm_sm90"]
    table = figures.format_table(series)
    assert [k for k in table[0] if k.startswith("T=")] == ["T=8", "T=128"]
    assert table[0]["run [format]"] == "fused exact [fp8_fp4]" and table[3]["run [format]"] == "fused [fp8]"
    assert table[3]["T=8"] == "1,000 (1.14x)"
    skewed = figures.format_comparison(fp4, fp8, routing="skewed")
    assert all(not s["vs_deepgemm"] for s in skewed)           # no DeepGEMM rows there: no ratios
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = figures.plot_formats(fp4, fp8)
        png, _ = figures.save_figure(fig, "formats")
    assert png.stat().st_size < 80_000
    (res / "layer_fp8_test.json").write_text(json.dumps(fp8))
    assert figures.plot_results("layer_fp8_test") is not None and figures.BENCH_PLOTS["layer_fp8"] is \
        figures.bench_layer_impls


def test_results_in_a_subfolder_are_recorded_by_their_relative_path(dirs, capsys):
    """A probe's output (``results/probes/x.json``) is read and recorded as ``probes/x.json``, so the freshness
    check finds it."""
    import nbformat

    from megamoe import notebooks as nbs

    _, res = dirs
    (res / "probes").mkdir()
    (res / "probes" / "x.json").write_text('{"rows": [1]}')
    assert figures.load_results("probes/x") == {"rows": [1]}
    line = capsys.readouterr().out
    assert line.startswith("read results/probes/x.json sha256:")
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("figures.load_results('probes/x')")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=line)]
    nb.cells = [cell]
    assert nbs.freshness_problems(nb) == []
    (res / "probes" / "x.json").write_text('{"rows": [2]}')
    assert any("changed since" in p for p in nbs.freshness_problems(nb))


def test_probe_jsonl_is_read_as_rows_and_plotted(dirs, capsys):
    """A probe's JSON-lines file loads as ``{"rows": [...]}`` (with the freshness line) and the fp4_ws probe figure
    draws it without warnings."""
    import warnings

    _, res = dirs
    (res / "probes").mkdir(exist_ok=True)
    rows = [{"probe": "start"}] + [{"probe": "fp4", "T": t, "variant": v, "us": us}
                                   for t in (512, 2048) for v, us in (("as_is", 2 * t), ("nodecode", t))]
    rows += [{"probe": "block", "T": t, "block_m": b, "us": t + b} for t in (32, 128) for b in (64, 128)]
    (res / "probes" / "p.jsonl").write_text("# made by a probe at some commit\n"  # a comment line: skipped
                                            + "\n".join(json.dumps(r) for r in rows) + "\n")
    data = figures.load_results("probes/p")
    assert data == {"rows": rows}
    assert "read results/probes/p.jsonl sha256:" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figures.save_figure(figures.fp4_ws_probe(data), "p")
    assert figures.load_results("probes/none") is None


def test_probe_runs_keep_two_runs_of_one_mode_apart():
    """``probe_runs`` pairs each row with the commit of the last start row above it, so the same T and variant
    measured at two commits are two rows, not one (the fp4_ws probe ran at T = 2048 in session 10 and again in 29)."""
    rows = [{"probe": "fp4", "T": 1, "us": 0.5},  # above any start row: run None
            {"probe": "start"}, {"probe": "fp4", "T": 2048, "variant": "as_is", "us": 5007.0},
            {"probe": "block", "T": 32, "us": 1.0},
            {"probe": "start", "commit": "ee9cef3"}, {"probe": "fp4", "T": 2048, "variant": "as_is", "us": 2877.0}]
    assert figures.probe_runs(rows, "fp4") == [(None, rows[0]), (None, rows[2]), ("ee9cef3", rows[5])]
    assert [run for run, _ in figures.probe_runs(rows)] == [None, None, None, "ee9cef3"]  # no start rows
    runs = {(run, r["T"]): r["us"] for run, r in figures.probe_runs(rows, "fp4")}
    assert runs[(None, 2048)] == 5007.0 and runs[("ee9cef3", 2048)] == 2877.0


def test_stage_profile_figure_draws_the_probe_rows():
    """The stage-profile figure draws the probe's rows (block 128 forced, and the host's predecoded row) without
    warnings and skips the rows that were not profiled."""
    import warnings

    row = {"probe": "stage_profile", "T": 2048, "config": "ws128", "predecode": False, "commit": "abc1234",
           **{f"dec_{k}_per_stage": v for k, v in (("total", 2750), ("ready", 118), ("tile", 230), ("fold", 410),
                                                     ("decode", 1628), ("sync", 221))},
           **{f"math0_{k}_per_stage": v for k, v in (("total", 2750), ("wait", 984), ("mma", 1366), ("epi", 290))}}
    rows = [{"probe": "start"}, row, {**row, "config": "host", "predecode": True},
            {"probe": "stage_profile", "T": 512, "config": "host", "skipped": "fp4_ws rs 64"}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = figures.stage_profile({"rows": rows})
    assert len(fig.axes[0].get_yticklabels()) == 4  # two rows drawn, two roles each


def test_knockout_table_averages_repeats_and_keeps_exactness_apart():
    """``knockout_table``: one row per (T, variant) in the file's T order and the labels' variant order, the mean
    of repeated calls, rows that failed to compile left out, ``bits_equal`` only for the exact variants (a
    knock-out's results are wrong by construction) and False when any repeat differed."""
    rows = [{"probe": "start", "commit": "abc"},
            {"probe": "knockout", "T": 512, "variant": "as_is", "us": 1000.0, "bitwise_equal_to_as_is": True},
            {"probe": "knockout", "T": 512, "variant": "nomma", "us": 800.0},
            {"probe": "knockout", "T": 512, "variant": "lut_gather", "error": "CompilationError(...)"},
            {"probe": "knockout", "T": 128, "variant": "as_is", "us": 700.0, "bitwise_equal_to_as_is": True},
            {"probe": "start", "commit": "abd"},
            {"probe": "knockout", "T": 512, "variant": "lut_gather", "us": 990.0, "bitwise_equal_to_as_is": False},
            {"probe": "knockout", "T": 512, "variant": "as_is", "us": 1010.0, "bitwise_equal_to_as_is": True}]
    out = figures.knockout_table({"rows": rows})
    assert [(r["T"], r["variant"]) for r in out] == [(512, "as_is"), (512, "lut_gather"), (512, "nomma"),
                                                     (128, "as_is")]
    assert out[0]["us"] == 1005.0 and out[0]["calls"] == 2 and out[0]["bits_equal"] is True
    assert out[1]["bits_equal"] is False and out[2]["bits_equal"] is None
