"""Figures of benchmark results (``results/<name>.json``), dispatched on the file's ``kind``.

``kind`` (top level, else ``config["kind"]``, else the file name) picks the plotter in :data:`BENCH_PLOTS`; any
other kind is drawn by :func:`bench_xy` from the hints ``config["x"]``, ``config["y"]`` (a column or a list),
``config["series"]`` (a column splitting rows into lines), ``config["xlog"]`` / ``config["ylog"]`` and
``config["title"]``, or, without hints, the first numeric column against the other numeric columns.
Also the roofline of a ``layer`` result against the measured ``ceilings`` (notebook 05).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import matplotlib
import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megamoe.figures.results import load_results, probe_runs, results_kind
from megamoe.figures.style import log_axis, new_figure


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
    """``kind = "layer"`` or ``"layer_fp8"`` (``megamoe.bench``, one row per implementation and size): µs per call
    and % of the run's roofline against tokens per rank, one line per ``impl`` (+ ``numerics``), one column of
    panels per ``routing``. Rows need ``impl``, ``num_tokens_per_rank``, ``us``; ``roofline_pct`` where known."""
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
    fmt = (data.get("config") or {}).get("format")
    fig.suptitle(_title(data, "Mega MoE layer, one EP8 rank's 48 V4-Pro experts" + (f", format {fmt}" if fmt else "")))
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
            # one collection per kind: thousands of bars (one per program and kind took ~60 s to draw and save on CPU)
            bars = [((x, p), (x + w, p), (x + w, p + 0.9), (x, p + 0.9)) for p, events in enumerate(run["events"])
                    for x, w in ((a / 1e3, max(b - a, 1) / 1e3) for kk, a, b in events if kk == k)]
            if bars:
                ax.add_collection(PolyCollection(bars, facecolors=colors[kind], rasterized=True))
        ax.autoscale_view()
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


def fp4_ws_probe(data: dict) -> Figure:
    """``results/probes/ws_variants_probe_h200.jsonl``: the FP8 x FP4 call with its Gluon phase ("fp4_ws") as it is
    and with the decode (and the per-K-block add) patched out, by run (the commit of its start row, ``probe_runs``;
    "12-02" for the first runs, which named none) and tokens per rank (left), and the phase at pool block 64 against
    128 (right). µs per call, one EP8 rank of V4-Pro on an H200."""
    rows = data["rows"]
    fig, axes = new_figure(1, 2, size=(10.0, 3.6))
    variants = [("as_is", "as it is", "#222222"), ("nodecode", "decode patched out", "#4c72b0"),
                ("nodecode+nopromote", "decode and per-K add out", "#55a868")]
    ax = axes[0, 0]
    fp4 = {(run or "12-02", r["T"], r["variant"]): r["us"] for run, r in probe_runs(rows, "fp4")}
    cases = list(dict.fromkeys((run, t) for run, t, _ in fp4))  # in file order: older runs first
    width = 0.8 / len(variants)
    for i, (v, label, color) in enumerate(variants):
        xs = [j + (i - 1) * width for j, c in enumerate(cases) if (*c, v) in fp4]
        bars = ax.bar(xs, [fp4[(*c, v)] for c in cases if (*c, v) in fp4], width, label=label, color=color)
        ax.bar_label(bars, fmt="%.0f", fontsize=6)
    ax.set_xticks(range(len(cases)), [f"{t}\n{run}" for run, t in cases], fontsize=7)
    ax.set_xlabel("tokens per rank, run")
    ax.set_ylabel("µs per call")
    ax.set_title("fp4_ws: the FP4 decode sets the pace", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    for block, color in ((128, "#222222"), (64, "#dd8452")):
        pts = sorted((r["T"], r["us"]) for r in rows if r.get("probe") == "block" and r["block_m"] == block)
        if pts:
            ax.plot(*zip(*pts), "o-", color=color, label=f"pool block {block}")
    log_axis(ax, "x")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("µs per call")
    ax.set_title("fp4_ws at block 64 (8 decode warps) vs 128 (4)", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle("FP8 x FP4 Gluon GEMM phase, one EP8 rank of V4-Pro (H200)")
    return fig


#: The stage-profile components drawn per role: (row key prefix, label, [(counter, label, colour), ...]).
STAGE_PROFILE_ROLES = (
    ("dec", "decode partition", [("ready", "wait: stage landed", "#bbbbbb"), ("tile", "tile preamble", "#8172b3"),
                                 ("fold", "L2 A fold", "#c44e52"), ("decode", "W decode", "#4c72b0"),
                                 ("sync", "fence + barrier + arrive", "#937860")]),
    ("math0", "math warpgroup 0", [("wait", "wait: decoded", "#bbbbbb"), ("mma", "wgmma + add", "#55a868"),
                                   ("epi", "epilogue", "#dd8452")]),
)


#: The stage-profile configurations the figure and notebook 08 show: block 128 forced, in either Hopper numerics.
STAGE_PROFILE_CONFIGS = ("ws128", "ws128_pb")


@needs("probe")
def stage_profile(data: dict) -> Figure:
    """``results/probes/stage_profile_probe_h200.jsonl``: cycles a ring stage of the FP8 x FP4 decode-partition tile
    (block 128), per role and what it did (``%clock64`` sums per CTA, mean over CTAs, divided by the stages), one bar
    pair per (commit, tokens per rank, predecoded) row: the decode partition and the first math warpgroup. Where a
    role's stage is mostly waiting, another role sets the pace."""
    rows = [r for r in data["rows"] if r.get("probe") == "stage_profile" and "dec_total_per_stage" in r
            and (r.get("config") in STAGE_PROFILE_CONFIGS or r.get("predecode"))]  # (the host's: predecoded rows)
    fig, axes = new_figure(1, 1, size=(10.0, 0.55 * 2 * max(1, len(rows)) + 1.4))
    ax = axes[0, 0]
    labels, y = [], 0.0
    seen = set()
    for r in rows:
        for prefix, role, parts in STAGE_PROFILE_ROLES:
            left = 0.0
            for key, label, color in parts:
                v = r.get(f"{prefix}_{key}_per_stage", 0.0)
                ax.barh(y, v, left=left, color=color, height=0.8,
                        label=label if (prefix, key) not in seen else None)
                seen.add((prefix, key))
                left += v
            ax.text(left, y, f" {r[f'{prefix}_total_per_stage']:.0f}", va="center", fontsize=6)
            labels.append(f"{role}, T = {r['T']}{' predecoded' if r.get('predecode') else ''}"
                          f"{' L2 per block' if r.get('numerics') == 'hopper_l2_per_block' else ''} "
                          f"@ {str(r.get('commit'))[:7]}")
            y += 1.0
        y += 0.5
    ax.set_yticks([i + 0.5 * (i // 2) for i in range(len(labels))], labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("cycles a ring stage (mean over CTAs)")
    ax.legend(fontsize=6, ncols=4, loc="lower right")
    fig.suptitle("fp4_ws block 128: where a stage's cycles go, by role (H200, %clock64)")
    return fig


#: ``knockout``'s variants as the table labels them, in its order (``results/probes/ws_variants_probe.py``).
KNOCKOUT_LABELS = {"as_is": "as is (tables computed)", "lut_gather": "tables gathered (as before)",
                   "lut_const": "no table arithmetic", "nofence": "no fence.proxy.async",
                   "nowdecode": "no W decode", "nodecode": "no decode (W, L2 A fold)", "nomma": "no wgmma"}


def knockout_table(data: dict) -> list[dict]:
    """``results/probes/knockout_runs/*.jsonl`` (``ws_variants_probe.py knockout``) as one row per (T, variant):
    the mean of its timed rows (``us``), how many, and whether every exact variant's output equalled the as-is
    output bit for bit (``None`` for the knock-outs, whose results are wrong by construction). Rows that failed to
    compile (``error``) are left out; T in the file's order, variants in ``KNOCKOUT_LABELS``' order."""
    by: dict[tuple[int, str], list[dict]] = {}
    for _, r in probe_runs(data["rows"], "knockout"):
        if "us" in r:
            by.setdefault((r["T"], r["variant"]), []).append(r)
    order = list(KNOCKOUT_LABELS)
    out = []
    for (T, v), rs in sorted(by.items(), key=lambda kv: (list(dict.fromkeys(t for t, _ in by)).index(kv[0][0]),
                                                         order.index(kv[0][1]) if kv[0][1] in order else 99)):
        bits = [r["bitwise_equal_to_as_is"] for r in rs if "bitwise_equal_to_as_is" in r]
        out.append({"T": T, "variant": v, "label": KNOCKOUT_LABELS.get(v, v), "calls": len(rs),
                    "us": sum(r["us"] for r in rs) / len(rs), "bits_equal": all(bits) if bits else None})
    return out


#: ``kind`` -> plotting function for results/*.json.
BENCH_PLOTS: dict[str, Callable[[dict], Figure | None]] = {
    "pull_bandwidth": bench_pull_bandwidth, "layer": bench_layer_impls, "layer_fp8": bench_layer_impls,
    "pull_push": bench_pull_push,
    "ceilings": bench_ceilings, "tune": bench_tune, "tma_pull": bench_pull_bandwidth, "timeline": bench_timeline,
    "fused_tune": bench_fused_tune,
}


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


def roofline_rows(layer: dict, ceilings: dict | None, impl: str = "staged", routing: str = "uniform") -> list[dict]:
    """Per row of a ``layer`` result of implementation ``impl`` (rows without ``impl`` count as staged) and
    ``routing``: measured TFLOP/s against the roofline from a ``ceilings`` result (measured FP8 matmul TFLOP/s and
    device copy TB/s): ``time >= max(flops / peak, touched weight bytes / bandwidth)``."""
    peak = bw = None
    for r in (ceilings or {}).get("rows", []):
        if "tflops" in r:
            peak = r["tflops"]
        if "tb_per_s" in r:
            bw = r["tb_per_s"]
    rows = []
    for r in layer.get("rows", []):
        if r.get("impl", "staged") != impl or r.get("routing", "uniform") != routing:
            continue
        row = {"tokens/rank": r.get("num_tokens_per_rank"), "ranks": r.get("num_ranks"), "us": r.get("us"),
               "TFLOP/s": r.get("tflops")}
        if peak and bw and r.get("flops"):
            t_compute = r["flops"] / (peak * 1e12)
            t_memory = r.get("weight_bytes_touched", 0) / (bw * 1e12)
            bound = max(t_compute, t_memory)
            row.update({"roofline us": bound * 1e6, "roofline TFLOP/s": r["flops"] / bound / 1e12,
                        "bound by": "compute" if t_compute >= t_memory else "weights (HBM)",
                        "fraction of roofline": bound / (r["us"] * 1e-6)})
        rows.append(row)
    return rows


def roofline_figure(rows: Sequence[dict], title: str):
    """Measured TFLOP/s (and the roofline when known) against tokens per rank."""
    fig, axes = new_figure(size=(6.5, 4.0))
    ax = axes[0, 0]
    xs = [r["tokens/rank"] for r in rows]
    ax.plot(xs, [r["TFLOP/s"] for r in rows], "o-", label="measured")
    if all("roofline TFLOP/s" in r for r in rows):
        ax.plot(xs, [r["roofline TFLOP/s"] for r in rows], "s--", color="k", label="roofline (measured ceilings)")
    ax.set_xscale("log", base=2)
    log_axis(ax)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.legend()
    return fig



#: The weights each layer-benchmark implementation multiplies, per format of the run (``config["format"]``; absent
#: means ``"fp8_fp4"``). The torch yardstick and DeepGEMM's SM90 kernel use FP8 weights in both runs
#: (``megamoe.bench.torch_grouped_mm_peer``; the ``note`` of DeepGEMM's rows).
FORMAT_WEIGHTS = {"fp8_fp4": "FP4 e2m1, UE8M0 per 32", "fp8": "FP8 e4m3, fp32 per 128x128"}
PEER_WEIGHTS = {"torch_grouped_mm": "FP8 e4m3, row-wise (GEMMs only)", "deepgemm_sm90": "FP8 e4m3, fp32 per 128x128"}
#: The implementation every ratio of :func:`format_comparison` is taken against (measured in the same run).
BASELINE_IMPL = "deepgemm_sm90"


def run_format(data: dict) -> str:
    """The weight format of a ``layer`` / ``layer_fp8`` result: ``config["format"]``, else ``"fp8_fp4"``."""
    return (data.get("config") or {}).get("format", "fp8_fp4")


def format_comparison(*runs: dict, routing: str = "uniform") -> list[dict]:
    """One series per (run, ``impl``, ``numerics``) of ``layer`` results of both formats (e.g. ``layer_h200`` and
    ``layer_fp8_h200``), for one ``routing``: ``{"format", "impl", "numerics", "weights", "us": {T: µs},
    "vs_deepgemm": {T: µs / DeepGEMM SM90's µs}}``. Each ratio divides by :data:`BASELINE_IMPL` of the *same* run
    (same session), at the token counts where it was measured; a run without it has empty ratios."""
    series = []
    for data in runs:
        fmt = run_format(data)
        rows = [r for r in data["rows"] if r.get("routing", "uniform") == routing]
        base = {r["num_tokens_per_rank"]: r["us"] for r in rows if r["impl"] == BASELINE_IMPL}
        for impl, numerics in dict.fromkeys((r["impl"], r.get("numerics")) for r in rows):
            mine = sorted((r for r in rows if (r["impl"], r.get("numerics")) == (impl, numerics)),
                          key=lambda r: r["num_tokens_per_rank"])
            us = {r["num_tokens_per_rank"]: r["us"] for r in mine}
            series.append({"format": fmt, "impl": impl, "numerics": numerics,
                           "weights": PEER_WEIGHTS.get(impl, FORMAT_WEIGHTS.get(fmt, fmt)), "us": us,
                           "vs_deepgemm": {t: v / base[t] for t, v in us.items() if t in base}})
    return series


def _series_label(s: dict, series: list[dict]) -> str:
    """``fused exact [fp8_fp4]``: the numerics only where the run has several for that implementation."""
    several = sum(1 for o in series if (o["format"], o["impl"]) == (s["format"], s["impl"])) > 1
    return f"{s['impl']}{' ' + s['numerics'] if several and s['numerics'] else ''} [{s['format']}]"


def format_table(series: list[dict]) -> list[dict]:
    """The rows of :func:`format_comparison` as a compact table: one row per series, one column per token count
    where DeepGEMM SM90 was measured, each cell ``µs (x DeepGEMM)``."""
    tokens = sorted({t for s in series for t in s["vs_deepgemm"]})
    return [{"run [format]": _series_label(s, series), "weights": s["weights"],
             **{f"T={t}": (f"{s['us'][t]:,.0f} ({s['vs_deepgemm'][t]:.2f}x)" if t in s["vs_deepgemm"] else "")
                for t in tokens}}
            for s in series]


_IMPL_COLORS = {("fused", "exact"): "C0", ("fused", "hopper"): "C4", ("fused", "hopper_l2_per_block"): "C6",
                ("staged", "exact"): "C1",
                ("torch_grouped_mm", None): "C2", ("deepgemm_sm90", None): "k"}


def plot_formats(*runs: dict, routing: str = "uniform") -> Figure:
    """The two weight formats side by side (``layer`` results of each, e.g. ``layer_h200`` and
    ``layer_fp8_h200``): µs per call against tokens per rank (left), and the same time divided by DeepGEMM SM90's
    in the same run (right, :func:`format_comparison`; the ratios of the FP8 run's fused kernel are printed). One
    colour per implementation, one line style per run: solid = ``fp8``, dashed = ``fp8_fp4``."""
    series = format_comparison(*runs, routing=routing)
    fig, axes = new_figure(1, 2, size=(11.0, 4.2))
    ax_us, ax_ratio = axes[0]
    style = {"fp8": ("-", "o"), "fp8_fp4": ("--", "s")}
    for i, s in enumerate(series):
        ls, marker = style.get(s["format"], (":", "^"))
        color = _IMPL_COLORS.get((s["impl"], s["numerics"]), f"C{5 + i % 5}")
        kw = dict(ls=ls, marker=marker, color=color, label=_series_label(s, series), ms=4)
        ax_us.plot(*zip(*sorted(s["us"].items())), **kw)
        ratio = sorted(s["vs_deepgemm"].items())
        if ratio and s["impl"] != BASELINE_IMPL:
            ax_ratio.plot(*zip(*ratio), **kw)
            if (s["format"], s["impl"]) == ("fp8", "fused"):
                for t, v in ratio:
                    ax_ratio.annotate(f"{v:.2f}x", (t, v), textcoords="offset points", xytext=(0, -12),
                                      ha="center", fontsize=7.5, color=color,
                                      bbox=dict(facecolor="white", edgecolor="none", alpha=0.85, pad=0.6))
    ax_ratio.axhline(1.0, color="k", lw=1.2, label="DeepGEMM SM90 (same run)")
    for ax in (ax_us, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
    log_axis(ax_us)
    log_axis(ax_ratio)
    ax_us.set_ylabel("µs per call")
    ax_us.set_title(f"time per call, {routing} routing")
    ax_ratio.set_ylabel("time / DeepGEMM SM90's time")
    ax_ratio.set_title("relative to DeepGEMM SM90 measured in the same run")
    handles, labels = ax_us.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=7.5)
    device = next((d.get("provenance", {}).get("device") for d in runs), None) or "unknown device"
    fig.suptitle(f"Both weight formats, one EP8 rank's 48 V4-Pro experts ({device}); [run format]: solid fp8, "
                 "dashed fp8_fp4")
    return fig
