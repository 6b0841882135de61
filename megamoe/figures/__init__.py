"""Figure functions called by the notebooks (``make figures`` re-executes the notebooks, the one source of figures/).

Every figure function returns a :class:`matplotlib.figure.Figure` drawn on an Agg canvas (no pyplot, no GUI, no
global figure state), so the same call works headless and in a notebook (which shows the saved PNG).
:func:`save_figure` writes ``<name>.png`` (a compact rendering: ``PNG_DPI``, 256 colours -- the file the
notebooks embed, so that a notebook with its figures stays small) and ``<name>.svg`` (full quality) to
``figures/`` (``$MEGAMOE_FIGURES_DIR`` overrides it). One module per subject, all re-exported here
(``from megamoe import figures; figures.X``):

* :mod:`~megamoe.figures.style` -- style, :func:`new_figure`, :func:`save_figure`, :func:`log_axis`;
* :mod:`~megamoe.figures.results` -- the one reader of ``results/*.json`` (:func:`read_results`,
  :func:`load_results`) and the result listings the notebooks show;
* :mod:`~megamoe.figures.sizing` -- buffer size sweeps, the layout breakdown, simulated occupancy and traffic;
* :mod:`~megamoe.figures.diagrams` -- data flow, pipeline and pool pictures;
* :mod:`~megamoe.figures.formats` -- the number formats and their quantisation errors;
* :mod:`~megamoe.figures.bench` -- benchmark results by ``kind`` (:func:`plot_results`), the roofline, and the two
  weight formats side by side (:func:`plot_formats`, :func:`format_comparison`).
"""
from megamoe.figures.bench import (
    BASELINE_IMPL,
    BENCH_PLOTS,
    FORMAT_WEIGHTS,
    PEER_WEIGHTS,
    bench_ceilings,
    bench_fused_tune,
    bench_layer_impls,
    bench_layer_timing,
    bench_pull_bandwidth,
    bench_pull_push,
    bench_timeline,
    bench_tune,
    bench_xy,
    format_comparison,
    format_table,
    fp4_ws_probe,
    knockout_table,
    missing_keys,
    needs,
    plot_formats,
    plot_results,
    roofline_figure,
    roofline_rows,
    run_format,
    stage_profile,
    variant_label,
)
from megamoe.figures.diagrams import dataflow_figure, pipeline_figure, pool_figure
from megamoe.figures.formats import quantization_figure
from megamoe.figures.results import (
    RESULTS_READ_RE,
    flatten_rows,
    load_results,
    probe_runs,
    read_results,
    results_dir,
    results_files,
    results_kind,
    results_name,
    results_overview,
    results_sha,
)
from megamoe.figures.sizing import (
    BASE,
    SHAPES,
    SWEEPS,
    layout_breakdown,
    occupancy_sweep,
    occupancy_vs_bound,
    pool_size_sweep,
    traffic_heatmap,
)
from megamoe.figures.style import (
    PNG_COLORS,
    PNG_DPI,
    apply_style,
    compact_png,
    figures_dir,
    fmt_bytes,
    log_axis,
    new_figure,
    save_figure,
)

__all__ = [
    "BASE", "BASELINE_IMPL", "BENCH_PLOTS", "FORMAT_WEIGHTS", "PEER_WEIGHTS", "PNG_COLORS", "PNG_DPI",
    "RESULTS_READ_RE", "SHAPES", "SWEEPS", "apply_style", "bench_ceilings", "bench_fused_tune", "bench_layer_impls",
    "bench_layer_timing", "bench_pull_bandwidth", "bench_pull_push", "bench_timeline", "bench_tune", "bench_xy",
    "compact_png", "dataflow_figure", "figures_dir", "flatten_rows", "fmt_bytes", "format_comparison",
    "format_table", "fp4_ws_probe", "knockout_table",
    "layout_breakdown", "load_results", "log_axis", "missing_keys", "needs",
    "new_figure",
    "occupancy_sweep", "occupancy_vs_bound", "pipeline_figure", "plot_formats", "plot_results", "pool_figure",
    "probe_runs",
    "pool_size_sweep", "quantization_figure", "read_results", "results_dir", "results_files", "results_kind",
    "results_name", "results_overview", "results_sha", "roofline_figure", "roofline_rows", "run_format",
    "stage_profile",
    "save_figure", "traffic_heatmap", "variant_label",
]
