"""Figure functions called by the notebooks (``make figures`` re-executes the notebooks, the one source of figures/).

Every figure function returns a :class:`matplotlib.figure.Figure` drawn on an Agg canvas (no pyplot, no GUI, no
global figure state), so the same call works headless and in a notebook (which shows the saved PNG).
:func:`save_figure` writes ``<name>.png`` (a compact rendering: :data:`PNG_DPI`, 256 colours -- the file the notebooks
embed, so that a notebook with its figures stays small) and ``<name>.svg`` (full quality) to ``figures/``
(``$MEGAMOE_FIGURES_DIR`` overrides it).

Benchmark figures read ``results/<name>.json`` (``$MEGAMOE_RESULTS_DIR`` overrides the folder), schema::

    {"kind": "...", "provenance": {...},            # megamoe.env.provenance()
     "config": {...},                               # what was run; optional plot hints below
     "rows": [{...}, ...]}                          # one flat dict per measurement

``kind`` (top level, else ``config["kind"]``, else the file name) picks the plotter in :data:`BENCH_PLOTS`; any
other kind is drawn by :func:`bench_xy` from the hints ``config["x"]``, ``config["y"]`` (a column or a list),
``config["series"]`` (a column splitting rows into lines), ``config["xlog"]`` / ``config["ylog"]`` and
``config["title"]``, or, without hints, the first numeric column against the other numeric columns.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from megamoe.env import REPO_ROOT
from megamoe.layout import MAX_RANKS, Layout

GiB = 2**30
MiB = 2**20

#: DeepGEMM's two test shapes (tests/test_mega_moe.py and PR #316).
SHAPES = {
    "V4-Flash": dict(num_experts=256, hidden=4096, intermediate_hidden=2048),
    "V4-Pro": dict(num_experts=384, hidden=7168, intermediate_hidden=3072),
}
#: The point every sweep of :func:`pool_size_sweep` varies one parameter around (DeepGEMM's EP8 test).
BASE = dict(num_ranks=8, num_max_tokens_per_rank=8192, num_topk=6, block_m=128)
SWEEPS = {
    "num_ranks": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 72),
    "num_max_tokens_per_rank": (128, 512, 1024, 2048, 4096, 8192, 16384, 32768),
    "num_topk": (1, 2, 4, 6, 8, 12, 16),
    "block_m": (16, 32, 64, 96, 128, 192, 256),
}
SWEEP_LABELS = {"num_ranks": "ranks (EP size)", "num_max_tokens_per_rank": "tokens per rank",
                "num_topk": "top-k", "block_m": "block_m"}
REGION_COLORS = {"workspace": "#8c8c8c", "input": "#4c72b0", "pool": "#dd8452", "combine": "#55a868"}


# ---------------------------------------------------------------------------------------------------- plumbing
def apply_style() -> None:
    """The project's matplotlib style (rcParams): small fonts, light grid, no top/right spines, deterministic SVG."""
    matplotlib.rcParams.update({
        "figure.dpi": 100, "savefig.dpi": 150, "font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9,
        "legend.fontsize": 8, "xtick.labelsize": 8, "ytick.labelsize": 8, "axes.grid": True, "grid.alpha": 0.3,
        "axes.spines.top": False, "axes.spines.right": False, "lines.linewidth": 1.6, "lines.markersize": 4,
        "svg.hashsalt": "megamoe", "svg.fonttype": "none",
    })


class NotebookFigure(Figure):
    """A Figure that shows itself as PNG when it is a notebook cell's value (``_repr_png_``), even when pyplot --
    which installs matplotlib's own notebook hooks -- was never imported."""

    def _repr_png_(self) -> bytes:
        return compact_png(self)


def new_figure(nrows: int = 1, ncols: int = 1, *, size: tuple[float, float] = (6.0, 4.0), **subplot_kw):
    """(Figure on an Agg canvas, axes array of shape [nrows, ncols]) in the project style."""
    apply_style()
    fig = NotebookFigure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **subplot_kw)
    return fig, axes


def figures_dir() -> Path:
    """Output folder: ``$MEGAMOE_FIGURES_DIR`` or ``<repo>/figures``."""
    return Path(os.environ.get("MEGAMOE_FIGURES_DIR") or REPO_ROOT / "figures")


def results_dir() -> Path:
    """Benchmark results folder: ``$MEGAMOE_RESULTS_DIR`` or ``<repo>/results``."""
    return Path(os.environ.get("MEGAMOE_RESULTS_DIR") or REPO_ROOT / "results")


#: Resolution of the PNGs (figures/ and the notebooks' embedded images); the SVGs carry full quality.
PNG_DPI = 110
#: Colours of the PNG palette: figures are flat colours plus anti-aliasing, which 256 colours keep legible while the
#: file shrinks about 3x against a true-colour PNG.
PNG_COLORS = 256


def compact_png(fig: Figure, dpi: int = PNG_DPI) -> bytes:
    """``fig`` as a small PNG: rendered at ``dpi`` (tight bounding box), quantised to a :data:`PNG_COLORS` palette
    (median cut, no dithering: deterministic, and text stays crisp), saved with ``optimize``. A notebook embeds
    this, so a figure costs tens of KB instead of a few hundred."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    buf.seek(0)
    image = Image.open(buf).convert("RGB").quantize(colors=PNG_COLORS, method=Image.Quantize.MEDIANCUT,
                                                    dither=Image.Dither.NONE)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def save_figure(fig: Figure, name: str) -> list[Path]:
    """Write ``<figures_dir>/<name>.png`` (:func:`compact_png`) and ``.svg`` (tight bounding box, full quality);
    return both paths."""
    out = figures_dir()
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.svg"]
    paths[0].write_bytes(compact_png(fig))
    fig.savefig(paths[1], bbox_inches="tight", metadata={"Date": None})
    return paths


def _short_number(v: float) -> str:
    """3 -> "3", 20000 -> "20k", 1500000 -> "1.5M", 0.1 -> "0.1"."""
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:g}{suffix}"
    return f"{v:g}"


def log_axis(ax, axis: str = "y", base: int = 10) -> None:
    """Log scale on ``axis`` (call after plotting) with short plain labels ("20k", not "2x10^4"); over less than
    two decades the 2x and 5x minor ticks are labelled too."""
    getattr(ax, f"set_{axis}scale")("log", base=base)
    if base != 10:
        return
    lo, hi = ax.get_ylim() if axis == "y" else ax.get_xlim()
    label_minor = hi < 100 * lo

    def minor(v, _pos):
        mantissa = v / 10 ** np.floor(np.log10(v) + 1e-9)
        return _short_number(v) if label_minor and round(mantissa) in (2, 5) else ""

    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_formatter(FuncFormatter(lambda v, _pos: _short_number(v)))
    target.set_minor_formatter(FuncFormatter(minor))


def _fmt_bytes(n: float) -> str:
    """1536 -> "1.5 KiB" (binary units, 3 significant digits)."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------------------------------------------- layout figures
def _layout(shape: str, **overrides) -> Layout:
    kw = {**BASE, **SHAPES[shape], **overrides}
    return Layout(kw["num_ranks"], kw["num_experts"], kw["num_max_tokens_per_rank"], kw["num_topk"],
                  kw["hidden"], kw["intermediate_hidden"], kw["block_m"])


def _sweep_values(param: str, shape: str) -> list[int]:
    """Values of ``param`` valid for ``shape`` (the rank count must divide the experts)."""
    experts = SHAPES[shape]["num_experts"]
    if param == "num_ranks":
        return [r for r in SWEEPS[param] if experts % r == 0 and r <= MAX_RANKS]
    return list(SWEEPS[param])


def pool_size_sweep() -> Figure:
    """Symmetric buffer size (GiB, top row) and pool rows per rank (bottom row) of both DeepGEMM shapes, varying
    ranks, tokens per rank, top-k and block_m one at a time around EP8, T=8192, top-6, block_m=128."""
    fig, axes = new_figure(2, 4, size=(13.0, 6.0))
    for col, param in enumerate(SWEEPS):
        ys: tuple[list[float], list[float]] = ([], [])
        for shape in SHAPES:
            xs = _sweep_values(param, shape)
            layouts = [_layout(shape, **{param: x}) for x in xs]
            for row, values in enumerate(([lay.num_bytes / GiB for lay in layouts],
                                          [lay.num_max_pool_tokens for lay in layouts])):
                axes[row, col].plot(xs, values, marker="o", label=shape)
                ys[row].extend(values)
        for row in range(2):
            ax = axes[row, col]
            if max(ys[row]) > 10 * min(ys[row]):
                log_axis(ax)
            if param in ("num_ranks", "num_max_tokens_per_rank"):
                log_axis(ax, "x", base=2)
            ax.axvline(BASE[param], color="k", lw=0.8, ls=":")
        axes[1, col].set_xlabel(SWEEP_LABELS[param])
    axes[0, 0].set_ylabel("symmetric buffer per rank (GiB)")
    axes[1, 0].set_ylabel("pool rows per rank (worst case)")
    axes[0, 0].legend()
    fig.suptitle("Mega MoE symmetric buffer, first-release sizing (no ring): one parameter varied around "
                 "EP8, T=8192, top-6, block_m=128 (dotted)")
    return fig


def layout_breakdown(layout: Layout) -> Figure:
    """Bytes of every segment (left, log scale, coloured by region) and the regions stacked (right, GiB)."""
    fig, axes = new_figure(1, 2, size=(11.0, 4.5), width_ratios=[3, 1])
    ax = axes[0, 0]
    segs = list(layout)
    ys = np.arange(len(segs))[::-1]
    ax.barh(ys, [max(s.nbytes, 1) for s in segs], color=[REGION_COLORS[s.region] for s in segs])
    ax.set_yticks(ys, [s.name for s in segs])
    ax.set_xscale("log")
    ax.set_xlabel("bytes")
    for y, s in zip(ys, segs):
        ax.text(max(s.nbytes, 1) * 1.15, y, _fmt_bytes(s.nbytes), va="center", fontsize=7)
    ax.set_xlim(right=max(s.nbytes for s in segs) * 40)
    ax.grid(axis="y", visible=False)

    ax = axes[0, 1]
    bottom = 0.0
    for region, nbytes in layout.region_bytes().items():
        ax.bar(0, nbytes / GiB, bottom=bottom, color=REGION_COLORS[region], label=f"{region} {_fmt_bytes(nbytes)}")
        bottom += nbytes / GiB
    ax.set_xticks([])
    ax.set_ylabel("GiB")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02))
    ax.grid(axis="x", visible=False)
    fig.suptitle(f"Symmetric buffer of one rank: R={layout.num_ranks}, E={layout.num_experts}, "
                 f"T={layout.num_max_tokens_per_rank}, top-{layout.num_topk}, H={layout.hidden}, "
                 f"I={layout.intermediate_hidden}, block_m={layout.block_m} -> {_fmt_bytes(layout.num_bytes)}")
    return fig


# --------------------------------------------------------------------------------------------------- simulation figures
def occupancy_sweep(ranks: Sequence[int] = (8, 16, 24, 32, 48, 64, 72), *, num_experts: int = 576,
                    num_tokens_per_rank: int = 8192, num_topk: int = 8, hidden: int = 7168,
                    intermediate_hidden: int = 3072, block_m: int = 128, zipf_alpha: float = 1.0,
                    seed: int = 0) -> list:
    """Simulations feeding :func:`occupancy_vs_bound`: uniform and Zipf routing at each rank count.

    576 experts divide every rank count from 8 to 72 (8 experts per rank at NVL72). Returns ``SimResult``\\ s.
    """
    from megamoe.sim import simulate_routing

    out = []
    for routing in ("uniform", "zipf"):
        for r in ranks:
            out.append(simulate_routing(r, num_tokens_per_rank, num_experts, num_topk, hidden=hidden,
                                        intermediate_hidden=intermediate_hidden, block_m=block_m, routing=routing,
                                        zipf_alpha=zipf_alpha, seed=seed))
    return out


def occupancy_vs_bound(results: Sequence) -> Figure:
    """Pool rows per rank (left, log) and worst-rank occupancy (right) against the buffer's worst-case bound.

    ``results``: ``SimResult``\\ s of one shape at several rank counts, any mix of routings (one line each).
    """
    fig, axes = new_figure(1, 2, size=(11.0, 4.2))
    ax_rows, ax_occ = axes[0]
    by_routing: dict[str, list] = {}
    for res in sorted(results, key=lambda r: r.num_ranks):
        label = res.routing if res.routing != "zipf" else f"zipf a={res.zipf_alpha:g}"
        by_routing.setdefault(label, []).append(res)
    for label, group in by_routing.items():
        xs = [r.num_ranks for r in group]
        worst = [r.pool_rows.max(axis=1).mean() for r in group]
        line, = ax_rows.plot(xs, worst, marker="o", label=f"{label}: busiest rank")
        ax_rows.plot(xs, [r.pool_rows.mean() for r in group], ls="--", color=line.get_color(),
                     label=f"{label}: mean rank")
        ax_occ.plot(xs, [100 * r.occupancy.max(axis=1).mean() for r in group], marker="o", label=label)
    first = next(iter(by_routing.values()))
    ax_rows.plot([r.num_ranks for r in first], [r.pool_bound for r in first], color="k", marker="s",
                 label="bound (buffer size)")
    log_axis(ax_rows)
    lo, hi = ax_rows.get_ylim()
    ax_rows.set_ylim(lo, hi * 12)   # a decade of headroom for the legend
    ax_rows.set_xlabel("ranks")
    ax_rows.set_ylabel("pool rows per rank")
    ax_rows.legend(loc="upper left", ncol=2)
    log_axis(ax_occ)
    ax_occ.set_xlabel("ranks")
    ax_occ.set_ylabel("busiest rank's pool / bound (%)")
    ax_occ.legend()
    r0 = first[0]
    fig.suptitle(f"Realized pool vs worst-case bound: E={r0.num_experts}, T={r0.num_tokens_per_rank}, "
                 f"top-{r0.num_topk}, block_m={r0.block_m}")
    return fig


def traffic_heatmap(result, trial: int = 0) -> Figure:
    """Dispatch and combine bytes between every pair of ranks (MiB; row = sender, column = receiver).

    ``result``: a ``SimResult``; the diagonal is local (no NVLink). Cells are annotated up to 16 ranks.
    """
    fig, axes = new_figure(1, 2, size=(11.0, 4.8))
    mats = {"dispatch (pulled by the expert's rank)": result.dispatch_bytes[trial],
            "combine (written back to the token's rank)": result.combine_bytes[trial]}
    for ax, (title, m) in zip(axes[0], mats.items()):
        mib = m / MiB
        im = ax.imshow(mib, cmap="viridis")
        fig.colorbar(im, ax=ax, label="MiB", shrink=0.85)
        ax.set_title(title)
        ax.set_xlabel("receiver rank")
        ax.set_ylabel("sender rank")
        ax.grid(False)
        if result.num_ranks <= 16:
            for (i, j), v in np.ndenumerate(mib):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=6,
                        color="w" if v < mib.max() / 2 else "k")
    alpha = f" a={result.zipf_alpha:g}" if result.routing == "zipf" else ""
    fig.suptitle(f"Traffic of one call: R={result.num_ranks}, E={result.num_experts}, "
                 f"T={result.num_tokens_per_rank}, top-{result.num_topk}, H={result.hidden}, "
                 f"{result.routing}{alpha} routing; load imbalance {result.load_imbalance[trial]:.2f}")
    return fig


# ---------------------------------------------------------------------------------------------------- benchmark figures
def needs(*row_keys: str, config: tuple[str, ...] = ()) -> Callable:
    """Declare what a benchmark plotter reads: keys every row has, and keys of ``config``. :func:`plot_results`
    checks them first and falls back to :func:`bench_xy` when the results lack one (the schema moved on)."""
    def declare(plotter: Callable) -> Callable:
        plotter.row_keys, plotter.config_keys = frozenset(row_keys), frozenset(config)
        return plotter
    return declare


def missing_keys(plotter: Callable, data: dict) -> list[str]:
    """The keys :func:`needs` declared for ``plotter`` that ``data`` lacks (``config.<key>`` for config keys)."""
    rows = data.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return ["rows"]
    missing = {k for r in rows for k in getattr(plotter, "row_keys", ()) if k not in r}
    config = data.get("config") or {}
    missing |= {f"config.{k}" for k in getattr(plotter, "config_keys", ()) if k not in config}
    return sorted(missing)


def _title(data: dict, default: str) -> str:
    device = data.get("provenance", {}).get("device", "unknown device")
    return f"{data.get('config', {}).get('title', default)} ({device})"


@needs("row_bytes", "gb_s")
def bench_pull_bandwidth(data: dict) -> Figure:
    """``kind = "pull_bandwidth"`` (``cupy_prims.bench_pull``): GB/s against row size, one line per ``op``."""
    fig, axes = new_figure(size=(6.5, 4.0))
    ax = axes[0, 0]
    for op in sorted({r.get("op", "pull") for r in data["rows"]}):
        rows = sorted((r for r in data["rows"] if r.get("op", "pull") == op), key=lambda r: r["row_bytes"])
        ax.plot([r["row_bytes"] for r in rows], [r["gb_s"] for r in rows], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("row bytes")
    ax.set_ylabel("payload GB/s")
    ax.legend()
    where = "two ranks emulated on one GPU" if data.get("config", {}).get("emulated_ranks") else "peer over NVLink"
    ax.set_title(_title(data, f"1-D bulk copy through shared memory, {where}"))
    return fig


@needs("num_tokens_per_rank", "us", "tflops")
def bench_layer_timing(data: dict) -> Figure:
    """``kind = "layer"`` or ``"pull_push"`` (``megamoe.bench``): total time, per-step time and TFLOP/s against
    tokens per rank, one line style per ``dispatch`` mode. Rows need ``num_tokens_per_rank``, ``us``, ``tflops``
    and may carry ``dispatch`` and ``steps_us`` ({step: us})."""
    fig, axes = new_figure(1, 3, size=(14.0, 4.2))
    ax_total, ax_steps, ax_rate = axes[0]
    styles = ["-", "--", ":", "-."]
    modes = sorted({r.get("dispatch", "") for r in data["rows"]})
    step_colors: dict[str, str] = {}
    for style, mode in zip(styles * len(modes), modes):
        rows = sorted((r for r in data["rows"] if r.get("dispatch", "") == mode),
                      key=lambda r: r["num_tokens_per_rank"])
        xs = [r["num_tokens_per_rank"] for r in rows]
        tag = f" ({mode})" if mode else ""
        ax_total.plot(xs, [r["us"] for r in rows], ls=style, marker="o", label=f"total{tag}")
        ax_rate.plot(xs, [r["tflops"] for r in rows], ls=style, marker="o", label=f"TFLOP/s{tag}")
        for step in (rows[0].get("steps_us") or {}) if rows else {}:
            line, = ax_steps.plot(xs, [r["steps_us"][step] for r in rows], ls=style, marker=".",
                                  color=step_colors.get(step), label=step if step not in step_colors else None)
            step_colors[step] = line.get_color()
    for ax in (ax_total, ax_steps, ax_rate):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
    log_axis(ax_total)
    ax_total.set_ylabel("us per call")
    ax_total.legend()
    if step_colors:
        log_axis(ax_steps)
        styles_note = " / ".join(f"{m} {s}" for m, s in zip(modes, styles)) if len(modes) > 1 else None
        ax_steps.legend(ncol=2, fontsize=7, title=styles_note)
    ax_steps.set_ylabel("us per step")
    ax_rate.set_ylabel("TFLOP/s")
    ax_rate.set_ylim(bottom=0)  # a small difference must not fill the panel
    ax_rate.legend()
    fig.suptitle(_title(data, f"Mega MoE layer: {data.get('kind', '')}"))
    return fig


@needs("impl", "num_tokens_per_rank", "us")
def bench_layer_impls(data: dict) -> Figure:
    """``kind = "layer"`` (``megamoe.bench``, one row per implementation and size): µs per call and % of the
    run's roofline against tokens per rank, one line per ``impl`` (+ ``numerics``), one column of panels per
    ``routing``. Rows need ``impl``, ``num_tokens_per_rank``, ``us``; ``roofline_pct`` where known."""
    routings = sorted({r.get("routing", "uniform") for r in data["rows"]}, key=lambda x: x != "uniform")
    fig, axes = new_figure(2, len(routings), size=(6.0 * len(routings), 7.5), sharey=False)
    series = sorted({(r["impl"], r.get("numerics")) for r in data["rows"]}, key=str)
    color = {key: f"C{i}" for i, key in enumerate(series)}  # one colour per implementation in every panel
    for col, routing in enumerate(routings):
        ax_us, ax_pct = axes[0, col], axes[1, col]
        for impl, numerics in series:
            rows = sorted((r for r in data["rows"] if (r["impl"], r.get("numerics")) == (impl, numerics)
                           and r.get("routing", "uniform") == routing), key=lambda r: r["num_tokens_per_rank"])
            if not rows:
                continue
            label = impl + (f" ({numerics})" if numerics else "")
            xs = [r["num_tokens_per_rank"] for r in rows]
            ax_us.plot(xs, [r["us"] for r in rows], marker="o", label=label, color=color[impl, numerics])
            pct = [(r["num_tokens_per_rank"], r["roofline_pct"]) for r in rows if r.get("roofline_pct") is not None]
            if pct:
                ax_pct.plot(*zip(*pct), marker="o", label=label, color=color[impl, numerics])
        for ax in (ax_us, ax_pct):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per rank")
        log_axis(ax_us)
        ax_us.set_ylabel("µs per call")
        ax_us.set_title(f"{routing} routing")
        ax_us.legend(fontsize=8)
        ax_pct.set_ylabel("% of roofline (this run's ceilings)")
    fig.suptitle(_title(data, "Mega MoE layer, one EP8 rank's 48 V4-Pro experts"))
    return fig


@needs("num_tokens_per_rank", "block_m", "span_us", "events", config=("kinds",))
def bench_timeline(data: dict) -> Figure:
    """``kind = "timeline"`` (``megamoe.bench --suite timeline``): one Gantt chart per recorded run of the fused
    kernel -- a row per program, a bar per task coloured by kind (pull, L1, L2, ...) -- so the overlap of the pull
    with the GEMMs, and of L2 with L1, is visible."""
    kinds = data["config"]["kinds"]
    runs = data["rows"]
    fig, axes = new_figure(len(runs), 1, size=(11.0, 3.2 * len(runs)), sharey=False)
    colors = dict(zip(kinds, ["#8c8c8c", "#222222", "#dd8452", "#4c72b0", "#55a868", "#222222", "#c44e52", "#222222"]))
    for ax, run in zip(axes[:, 0], runs):
        for kind in kinds:
            k = kinds.index(kind)
            for p, events in enumerate(run["events"]):
                spans = [(a / 1e3, max(b - a, 1) / 1e3) for kk, a, b in events if kk == k]
                if spans:
                    ax.broken_barh(spans, (p, 0.9), facecolors=colors[kind], rasterized=True)  # thousands of bars
        ax.set_xlabel("µs since the first event")
        ax.set_ylabel("program")
        ax.set_title(f"{run.get('numerics', '')} numerics, {run['num_tokens_per_rank']} tokens, block_m "
                     f"{run['block_m']}, span {run['span_us']:.0f} µs", fontsize=9)
        handles = [matplotlib.patches.Patch(color=colors[k], label=k)
                   for k in kinds if k in ("pull", "l1", "l2", "combine")]
        ax.legend(handles=handles, fontsize=8, loc="upper right")
        ax.grid(axis="y", visible=False)
    fig.suptitle(_title(data, "Fused kernel: one launch, per-program tasks over time"))
    return fig


@needs("num_tokens_per_rank", "numerics", "block_m", "num_warps", "programs_per_rank")
def bench_fused_tune(data: dict) -> Figure:
    """``kind = "fused_tune"``: time of each fused launch configuration per token count (one panel each, bars
    labelled with their µs), the staged pipeline of the same run as a dashed line."""
    tokens = sorted({r["num_tokens_per_rank"] for r in data["rows"]})
    fig, axes = new_figure(1, len(tokens), size=(3.6 * len(tokens) + 1.4, 3.6), sharey=False)
    for ax, n in zip(axes[0], tokens):
        rows = [r for r in data["rows"] if r["num_tokens_per_rank"] == n and "us" in r]
        labels = [f"{r['numerics']} bm{r['block_m']} {r['num_warps']}w x{r['programs_per_rank']}" for r in rows]
        ys = np.arange(len(rows))[::-1]
        ax.barh(ys, [r["us"] for r in rows], height=0.6, color=["#4c72b0" if r["numerics"] == "exact" else "#8172b3"
                                                                 for r in rows])
        ax.axvline(rows[0]["staged_us"], color="k", ls="--", label="staged pipeline, same run")
        for y, r in zip(ys, rows):
            ax.text(r["us"], y, f" {r['us']:,.0f}", va="center", fontsize=7,
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.5))
        ax.set_xlim(0, max(max(r["us"] for r in rows), rows[0]["staged_us"]) * 1.22)
        ax.set_yticks(ys, labels, fontsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(4))
        ax.set_xlabel("µs per call")
        ax.set_title(f"T = {n}")
        ax.grid(axis="y", visible=False)
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center")
    fig.suptitle(_title(data, "Fused kernel launch configurations (numerics, block_m, warps, programs)"))
    return fig


@needs("what")
def bench_ceilings(data: dict) -> Figure:
    """``kind = "ceilings"``: one bar per measured ceiling, labelled with its rate (``tflops`` / ``tb_per_s`` /
    ``gb_s``)."""
    metrics = {"tflops": "TFLOP/s", "tb_per_s": "TB/s", "gb_s": "GB/s"}
    rows = [(r["what"], m, r[m]) for r in data["rows"] for m in metrics if m in r]
    fig, axes = new_figure(1, len(rows), size=(3.2 * len(rows), 3.2))
    for ax, (what, metric, value) in zip(axes[0], rows):
        ax.bar([0], [value], color="#4c72b0", width=0.6)
        ax.text(0, value, f"{value:,.0f}" if value >= 100 else f"{value:.3g}", ha="center", va="bottom")
        ax.set_xticks([0], [what])
        ax.set_ylabel(metrics[metric])
        ax.grid(axis="x", visible=False)
    fig.suptitle(_title(data, "Measured ceilings"))
    return fig


def variant_label(variant: dict) -> str:
    """A short name for a launch-config variant: its switches that are on, and its other settings
    (``{"prmt_decode": True, "prefetch_w": False, "num_warps": 8}`` -> ``"prmt decode, num warps 8"``)."""
    on = [k.replace("_", " ") for k, v in variant.items() if v is True]
    other = [f"{k.replace('_', ' ')} {v}" for k, v in variant.items() if not isinstance(v, bool)]
    return ", ".join(on + other) or "all switches off"


@needs("block_m", "num_tokens", "variant")
def bench_tune(data: dict) -> Figure:
    """``kind = "tune"``: L1 + L2 step time (stacked, total printed at the bar) of every launch-config variant, one
    panel per (block_m, tokens) sharing the variant axis; a variant is named by the switches it turns on."""
    groups: dict[tuple, list[dict]] = {}
    for r in data["rows"]:
        groups.setdefault((r["block_m"], r["num_tokens"]), []).append(r)
    labels = list(dict.fromkeys(variant_label(r["variant"]) for r in data["rows"]))
    fig, axes = new_figure(1, len(groups), size=(3.6 * len(groups) + 2.6, 0.42 * len(labels) + 1.6), sharey=True)
    ys = {label: i for i, label in enumerate(labels[::-1])}
    for ax, ((block_m, tokens), rows) in zip(axes[0], sorted(groups.items())):
        y = [ys[variant_label(r["variant"])] for r in rows]
        l1 = np.array([r.get("l1_us", np.nan) for r in rows])
        l2 = np.array([r.get("l2_us", np.nan) for r in rows])
        ax.barh(y, l1, height=0.6, color="#4c72b0", label="L1 step")
        ax.barh(y, l2, left=l1, height=0.6, color="#dd8452", label="L2 step")
        for yy, total in zip(y, l1 + l2):
            ax.text(total, yy, f" {total:,.0f}", va="center", fontsize=7)
        ax.set_xlim(0, np.nanmax(l1 + l2) * 1.25)
        ax.xaxis.set_major_locator(MaxNLocator(4))
        ax.set_xlabel("µs (L1 + L2)")
        ax.set_title(f"block_m={block_m}, T={tokens}")
        ax.grid(axis="y", visible=False)
    axes[0, 0].set_yticks(list(ys.values()), list(ys))
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=2)
    fig.suptitle(_title(data, "GEMM launch-config sweep"))
    return fig


@needs("num_tokens_per_rank", "us", "dispatch", "steps_us")
def bench_pull_push(data: dict) -> Figure:
    """``kind = "pull_push"``: with one token count, each step's µs for both dispatch modes side by side (log axis,
    steps of one mode only are shown for that mode) and the totals in the title with their relative difference; with
    several token counts, :func:`bench_layer_timing`."""
    sizes = sorted({r["num_tokens_per_rank"] for r in data["rows"]})
    if len(sizes) > 1:
        return bench_layer_timing(data)
    rows = {r["dispatch"]: r for r in data["rows"]}
    steps = list(dict.fromkeys(s for r in rows.values() for s in r["steps_us"] if not s.endswith("_arrive")))
    fig, axes = new_figure(size=(7.5, 0.17 * len(steps) * len(rows) + 1.4))
    ax = axes[0, 0]
    height = 0.8 / len(rows)
    for i, (mode, r) in enumerate(rows.items()):
        ys = [len(steps) - 1 - j + (len(rows) / 2 - i - 0.5) * height for j in range(len(steps))]
        vals = [r["steps_us"].get(s, np.nan) for s in steps]
        ax.barh(ys, vals, height=height, label=f"{mode}: {r['us']:,.0f} µs per call", color=f"C{i}")
        for y, v in zip(ys, vals):
            if not np.isnan(v):
                ax.text(v, y, f" {v:,.0f}", va="center", fontsize=6.5)
    ax.set_yticks(range(len(steps))[::-1], steps)
    log_axis(ax, "x")
    lo, hi = ax.get_xlim()
    ax.set_xlim(lo, hi * 3)
    ax.set_xlabel("µs per step (log; the *_arrive steps are left out)")
    ax.grid(axis="y", visible=False)
    ax.legend(loc="lower right")
    totals = [r["us"] for r in rows.values()]
    spread = (max(totals) - min(totals)) / min(totals)
    cfg = data.get("config", {})
    fig.suptitle(_title(data, f"pull vs push dispatch, {cfg.get('num_ranks', '?')} ranks, {sizes[0]} tokens/rank: "
                              f"totals differ by {spread:.1%}"))
    return fig


def _numeric_columns(rows: list[dict]) -> list[str]:
    return [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]


def bench_xy(data: dict) -> Figure | None:
    """Any other kind: ``config`` hints x / y / series / xlog / ylog / title, else first numeric column vs the rest.

    Returns None (and prints why) when the rows have nothing numeric to plot.
    """
    rows, cfg = data.get("rows") or [], data.get("config", {})
    numeric = _numeric_columns(rows) if rows else []
    x = cfg.get("x") or (numeric[0] if numeric else None)
    ys = cfg.get("y") or [c for c in numeric if c != x]
    ys = [ys] if isinstance(ys, str) else list(ys)
    if x is None or not ys:
        print(f"figures: results of kind {data.get('kind')!r} have no numeric columns to plot, skipping")
        return None
    series_key = cfg.get("series")
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault("" if series_key is None else f"{series_key}={r.get(series_key)}", []).append(r)
    fig, axes = new_figure(size=(6.5, 4.0))
    ax = axes[0, 0]
    for group, members in groups.items():
        members = sorted(members, key=lambda r: r[x])
        for y in ys:
            label = " ".join(p for p in (group, y if len(ys) > 1 or not group else "") if p)
            ax.plot([r[x] for r in members], [r[y] for r in members], marker="o", label=label or y)
    if cfg.get("xlog"):
        ax.set_xscale("log", base=2)
    if cfg.get("ylog"):
        log_axis(ax)
    ax.set_xlabel(x)
    ax.set_ylabel(ys[0] if len(ys) == 1 else "value")
    ax.legend()
    ax.set_title(_title(data, str(data.get("kind", "benchmark"))))
    return fig


#: ``kind`` -> plotting function for results/*.json.
BENCH_PLOTS: dict[str, Callable[[dict], Figure | None]] = {
    "pull_bandwidth": bench_pull_bandwidth, "layer": bench_layer_impls, "pull_push": bench_pull_push,
    "ceilings": bench_ceilings, "tune": bench_tune, "tma_pull": bench_pull_bandwidth, "timeline": bench_timeline,
    "fused_tune": bench_fused_tune,
}


#: The line :func:`read_results` prints for every results file it reads: notebooks carry it in their outputs, and
#: ``python -m megamoe.notebooks check`` compares the hash with the file as committed (a stale output fails).
RESULTS_READ_RE = re.compile(r"read results/(?P<name>[\w.\-/]+\.json) sha256:(?P<sha>[0-9a-f]{16})")


def results_sha(path: Path) -> str:
    """The first 16 hex digits of a results file's SHA-256 (what :data:`RESULTS_READ_RE` records)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def read_results(path: Path) -> dict:
    """A results file as a dict; prints ``read results/<file> sha256:<16 hex>`` so that outputs made from it can be
    checked for freshness later. The one reader of ``results/*.json`` (figures, notebooks, walkthrough)."""
    path = Path(path)
    print(f"read results/{path.name} sha256:{results_sha(path)}")
    with open(path) as f:
        return json.load(f)


def load_results(name: str) -> dict | None:
    """``results/<name>.json`` as a dict (through :func:`read_results`), or None (with a printed line) when the
    file does not exist."""
    path = results_dir() / f"{name}.json"
    if not path.exists():
        print(f"figures: no {path}, skipping")
        return None
    return read_results(path)


def results_kind(data: dict, name: str) -> str:
    """The ``kind`` of a results dict: top-level, else in ``config``, else the file name."""
    return data.get("kind") or data.get("config", {}).get("kind") or name


def plot_results(name: str) -> Figure | None:
    """The figure of ``results/<name>.json``, dispatched on its ``kind``; None when there is nothing to plot.

    When the results lack a key the kind's plotter declared (:func:`needs`; the schema moved on), the generic
    :func:`bench_xy` draws them instead. Any error of the plotter itself is raised.
    """
    data = load_results(name)
    if data is None:
        return None
    kind = results_kind(data, name)
    plotter = BENCH_PLOTS.get(kind, bench_xy)
    missing = missing_keys(plotter, data) if plotter is not bench_xy else []
    if missing:
        print(f"figures: {name}: the {kind!r} plotter needs {', '.join(missing)}; using the generic x/y plot")
        return bench_xy(data)
    return plotter(data)


# ---------------------------------------------------------------------------------------------------- make figures
if __name__ == "__main__":
    sys.exit("figures are made by the notebooks: run `make figures` (python -m megamoe.notebooks figures)")
