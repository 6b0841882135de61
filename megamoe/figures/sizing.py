"""Figures of the symmetric buffer's size and of simulated pool occupancy and traffic (notebook 03).

The sizing figures evaluate :class:`megamoe.layout.Layout` over DeepGEMM's two shapes; the simulation figures draw
``megamoe.sim.SimResult``\\ s.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from megamoe.figures.style import GiB, MiB, fmt_bytes, log_axis, new_figure
from megamoe.layout import MAX_RANKS, Layout

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
        ax.text(max(s.nbytes, 1) * 1.15, y, fmt_bytes(s.nbytes), va="center", fontsize=7)
    ax.set_xlim(right=max(s.nbytes for s in segs) * 40)
    ax.grid(axis="y", visible=False)

    ax = axes[0, 1]
    bottom = 0.0
    for region, nbytes in layout.region_bytes().items():
        ax.bar(0, nbytes / GiB, bottom=bottom, color=REGION_COLORS[region], label=f"{region} {fmt_bytes(nbytes)}")
        bottom += nbytes / GiB
    ax.set_xticks([])
    ax.set_ylabel("GiB")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02))
    ax.grid(axis="x", visible=False)
    fig.suptitle(f"Symmetric buffer of one rank: R={layout.num_ranks}, E={layout.num_experts}, "
                 f"T={layout.num_max_tokens_per_rank}, top-{layout.num_topk}, H={layout.hidden}, "
                 f"I={layout.intermediate_hidden}, block_m={layout.block_m} -> {fmt_bytes(layout.num_bytes)}")
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

