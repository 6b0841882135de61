"""Diagrams: the data flow (DeepEP's push vs Mega MoE's pull), the staged pipeline vs a fused kernel, the pool.

:func:`pool_figure` draws :class:`megamoe.stepping.PoolMap`\\ s read from a :class:`~megamoe.stepping.StagedRun`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle

from megamoe.figures.style import new_figure

if TYPE_CHECKING:
    from megamoe.stepping import PoolMap


_EXPERT_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
                  "#ccb974", "#64b5cd")
_RANK_HATCHES = ("", "////", "\\\\\\\\", "xxxx", "....", "oo", "++", "**")


def _box(ax, x, y, w, h, text, color, fontsize=8, alpha=0.9, **kw):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="k",
                                lw=0.8, alpha=alpha, **kw))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, x0, y0, x1, y1, text="", color="k", style="-|>", ls="-", text_offset=(0.0, 0.12), fontsize=7):
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle=style, mutation_scale=10, color=color, lw=1.2,
                                 ls=ls, shrinkA=0, shrinkB=0))
    if text:
        ax.text((x0 + x1) / 2 + text_offset[0], (y0 + y1) / 2 + text_offset[1], text, ha="center", va="bottom",
                fontsize=fontsize, color=color)


def dataflow_figure():
    """DeepEP's push pipeline (5 buffer levels between the router and the experts) above Mega MoE's pull on
    symmetric memory (input -> pool -> combine), with the rank each buffer lives on."""
    fig, axes = new_figure(2, 1, size=(12.5, 6.6), height_ratios=[1, 1.25])
    src, dst, net = "#c6dbef", "#fdd0a2", "#e0e0e0"
    ax = axes[0, 0]
    ax.set_xlim(0, 13)
    ax.set_ylim(0, 3.2)
    ax.axis("off")
    ax.set_title("DeepEP (normal kernels): the source PUSHES; five buffer levels between router and expert",
                 loc="left")
    boxes = [("Token buffer\n(token-major,\nrouter output)", src), ("Dispatch buffer\n(destination-major)", src),
             ("Chunk buffer\n(aggregated\nfor the wire)", src), ("Network\nNVLink / RDMA\n(+ forwarding)", net),
             ("Receive buffer\n(on the\nexpert's GPU)", dst), ("Expert buffer\n(expert-major,\nGEMM input)", dst)]
    for i, (t, c) in enumerate(boxes):
        _box(ax, 0.2 + i * 2.1, 1.35, 1.75, 1.2, t, c)
        if i:
            _arrow(ax, 0.2 + (i - 1) * 2.1 + 1.75, 1.95, 0.2 + i * 2.1, 1.95)
    ax.text(0.2, 0.75, "source GPU: layout kernel + CPU sync on counts, copy into send buffers", fontsize=8,
            color="#2b5d8c")
    ax.text(8.6, 0.75, "destination GPU: unpack, then grouped GEMM;\ncombine = the mirror image", fontsize=8,
            color="#a3541d")
    ax.text(0.2, 0.25, "token = scheduling unit, chunk = communication unit; a separate kernel each way, "
            "buffers sized per destination", fontsize=8)

    ax = axes[1, 0]
    ax.set_xlim(0, 13)
    ax.set_ylim(0, 4.3)
    ax.axis("off")
    ax.set_title("Mega MoE: the expert's rank PULLS from the source's symmetric buffer; three levels: "
                 "input -> pool -> combine", loc="left")
    _box(ax, 0.2, 2.7, 2.4, 1.25, "input segments\nx (FP8), x_sf, topk_idx,\ntopk_weights", src)
    _box(ax, 0.2, 0.35, 2.4, 1.25, "combine buffer\n[top-k slot][token] (BF16)\n-> top-k reduce -> y", src)
    _box(ax, 4.3, 2.7, 2.2, 1.25, "L1 pool\nexpert-major,\npadded to block_m", dst)
    _box(ax, 7.3, 2.7, 2.4, 1.25, "L1 GEMM (FP8xFP4)\n+ SwiGLU x weight\n+ FP8 requant", dst, alpha=0.6)
    _box(ax, 10.4, 2.7, 2.3, 1.25, "L2 pool\n(FP8, per-32 scales)", dst)
    _box(ax, 10.4, 0.35, 2.3, 1.25, "L2 GEMM\n(FP8xFP4 -> BF16)", dst, alpha=0.6)
    _arrow(ax, 2.6, 3.33, 4.3, 3.33, "pull: map(&x[t], src)\n(NVLink read)", color="#a3541d")
    _arrow(ax, 6.5, 3.33, 7.3, 3.33)
    _arrow(ax, 9.7, 3.33, 10.4, 3.33)
    _arrow(ax, 11.55, 2.7, 11.55, 1.6)
    _arrow(ax, 10.4, 0.97, 2.6, 0.97, "write-back: map(&combine[slot][t], src)  (NVLink write)", color="#a3541d")
    _box(ax, 4.3, 1.75, 2.2, 0.7, "workspace: recv counts,\nsource indices", dst, fontsize=7, alpha=0.5)
    _arrow(ax, 2.6, 2.85, 4.3, 2.1, "", ls=":")
    ax.text(2.75, 2.05, "step 1: remote stores\n+ atomics (no data)", fontsize=7)
    _arrow(ax, 5.4, 2.45, 5.4, 2.7, "", ls=":")
    ax.text(0.2, 4.1, "source rank (every rank is a source)", fontsize=8, color="#2b5d8c")
    ax.text(4.3, 4.1, "expert's rank (every rank owns E/R experts)", fontsize=8, color="#a3541d")
    return fig


_STEP_TEXT = {
    "count": "count\npairs per expert;\natomic slot; write\nsrc index to owner",
    "publish": "publish\nsend counts ->\nowner's recv_count",
    "pull": "pull\nowner copies x, x_sf,\nweights of its pairs\ninto the L1 pool",
    "push": "push\nsource copies its\nrows into the\nowner's L1 pool",
    "l1": "l1\nFP8xFP4 GEMM,\nSwiGLU x weight,\nFP8 requant -> L2 pool",
    "l2": "l2\nFP8xFP4 GEMM -> BF16\nstored into the source's\ncombine[slot][token]",
    "combine": "combine\nsum the top-k slots\n-> y (BF16)",
    "cleanup": "cleanup\nzero the counters\n(+ recv stats)",
}


def pipeline_figure(dispatch: str = "pull"):
    """Top: the staged pipeline of one call (one launch per step, names from ``megamoe.ops.pipeline_steps``) with the
    cross-rank barriers. Bottom: a schematic of the same work in a fused persistent kernel, where the launch
    boundaries inside each barrier interval become per-block arrival counters and the roles overlap."""
    from megamoe.stepping import stage_names  # imports the kernels: only when drawn

    names = stage_names(dispatch)
    colors = {"count": "#c6dbef", "publish": "#c6dbef", "pull": "#9ecae1", "push": "#9ecae1", "l1": "#fdd0a2",
              "l2": "#fdae6b", "combine": "#c7e9c0", "cleanup": "#e0e0e0"}
    fig, axes = new_figure(2, 1, size=(13.0, 6.4), height_ratios=[1.1, 1])
    ax = axes[0, 0]
    ax.axis("off")
    x = 0.0
    for name in names:
        if name.endswith("_arrive"):
            continue
        if name.endswith("_wait"):
            tag = name.removeprefix("barrier").split("_")[0]
            ax.add_patch(Rectangle((x, 0.5), 0.16, 1.9, color="k"))
            ax.text(x + 0.08, 2.5, f"barrier\ntag {tag}", ha="center", va="bottom", fontsize=7)
            x += 0.45
            continue
        _box(ax, x, 0.7, 1.55, 1.5, _STEP_TEXT.get(name, name), colors.get(name, "#ffffff"), fontsize=7)
        x += 1.75
    ax.set_xlim(-0.2, x)
    ax.set_ylim(0.0, 3.2)
    ax.set_title(f"This repo: one call of fp8_fp4_mega_moe (dispatch={dispatch!r}); every box is one kernel launch "
                 "per rank, each launch boundary a grid-wide sync", loc="left")

    ax = axes[1, 0]
    ax.set_xlim(-0.2, 15.5)
    ax.set_ylim(-0.9, 4.3)
    ax.axis("off")
    lanes = ["dispatch warps", "TMA + MMA warps", "epilogue warps"]
    for i, lane in enumerate(lanes):
        ax.text(-0.1, 3.3 - i, lane, ha="right", va="center", fontsize=8)
    spans = [(0, 0.0, 1.6, "count + publish", "#c6dbef"), (0, 2.1, 4.6, "pull token rows (per pool block)", "#9ecae1"),
             (1, 2.6, 6.9, "L1 blocks start when their rows arrived; then L2 blocks", "#fdd0a2"),
             (2, 3.0, 7.6, "L1 epilogue (SwiGLU, requant) | L2 epilogue + write-back", "#fdae6b"),
             (2, 8.2, 10.4, "combine: sum slots -> y", "#c7e9c0"), (0, 8.2, 9.6, "cleanup", "#e0e0e0")]
    for lane, x0, x1, text, color in spans:
        _box(ax, x0 + 0.15, 3.0 - lane, x1 - x0, 0.6, text, color, fontsize=7)
    for xb, tag in ((1.95, 1), (8.0, 2), (10.75, 3)):
        ax.add_patch(Rectangle((xb, 0.6), 0.1, 3.2, color="k"))
        ax.text(xb + 0.05, 3.9, f"barrier tag {tag}", ha="center", fontsize=7)
    ax.text(0.0, 0.15, "A fused persistent kernel (DeepGEMM) keeps one CTA per SM for the whole layer. Inside a "
            "barrier interval the launch boundaries become per-block arrival counters (l1_arrival_count,\n"
            "l2_arrival_mask in the workspace): a GEMM block starts as soon as its pool rows have landed, so "
            "pulling, both GEMMs and the write-back overlap. Only the three cross-rank barriers remain.",
            fontsize=8, va="top")
    ax.set_title("Where a fused kernel would fuse (schematic, not to scale)", loc="left")
    return fig


def pool_figure(pool_maps: Sequence["PoolMap"], title: str = ""):
    """Pool rows of each rank as a grid (one line per pool block of ``block_m`` rows): colour = local expert,
    hatch = source rank, white = padding, light grey = allocated but unused (up to the worst-case capacity)."""
    n = len(pool_maps)
    bm = pool_maps[0].block_m
    cap_blocks = pool_maps[0].capacity // bm
    fig, axes = new_figure(1, n, size=(min(5.5 * n, 16), 0.9 + 0.28 * cap_blocks))
    num_src = 1 + max(int(pm.src_rank.max()) if pm.used_rows else 0 for pm in pool_maps)
    for ax, pm in zip(axes[0], pool_maps):
        for b in range(cap_blocks):
            for i in range(bm):
                p = b * bm + i
                y = cap_blocks - 1 - b
                if p >= pm.used_rows:
                    ax.add_patch(Rectangle((i, y), 1, 0.9, fc="#f2f2f2", ec="none"))
                    continue
                e = int(pm.expert[p])
                if not pm.valid[p]:
                    ax.add_patch(Rectangle((i, y), 1, 0.9, fc="white", ec=_EXPERT_COLORS[e % 10], lw=0.4))
                    continue
                s = int(pm.src_rank[p])
                ax.add_patch(Rectangle((i, y), 1, 0.9, fc=_EXPERT_COLORS[e % 10], ec="k", lw=0.15,
                                       hatch=_RANK_HATCHES[s % len(_RANK_HATCHES)]))
        for e, (lo, nb) in enumerate(zip(pm.first_row, pm.blocks)):
            if nb:
                ax.text(-0.8, cap_blocks - 1 - lo // bm + 0.45, f"e{e}", ha="right", va="center", fontsize=7)
        ax.set_xlim(-4, bm)
        ax.set_ylim(0, cap_blocks)
        ax.set_xticks([0, bm // 2, bm])
        ax.set_yticks([cap_blocks - 0.55 - b for b in range(cap_blocks)], [str(b) for b in range(cap_blocks)])
        ax.set_xlabel("row within the block")
        ax.set_ylabel("pool block")
        ax.grid(False)
        s = pm.summary()
        ax.set_title(f"rank {pm.rank}: {s['pairs received']} pairs, {s['rows used']} rows used "
                     f"({s['padding rows']} padding) of {pm.capacity}", fontsize=8)
    handles = [Patch(fc=_EXPERT_COLORS[e % 10], label=f"local expert {e}")
               for e in range(len(pool_maps[0].n))]
    handles += [Patch(fc="white", ec="k", hatch=_RANK_HATCHES[s % len(_RANK_HATCHES)], label=f"from rank {s}")
                for s in range(num_src)]
    handles += [Patch(fc="white", ec="#999999", label="padding"), Patch(fc="#f2f2f2", label="unused capacity")]
    fig.legend(handles=handles, loc="outside right center", fontsize=7)
    if title:
        fig.suptitle(title)
    return fig

