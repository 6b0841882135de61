"""Figure of the number formats: FP8 e4m3's grid, one FP4 e2m1 group, per-32 quantisation errors (notebook 05)."""
from __future__ import annotations

import torch

from megamoe.demos.formats import fp8_positive_values
from megamoe.figures.style import log_axis, new_figure


def quantization_figure(q: dict):
    """Three panels: the FP8 grid (relative spacing per value), the FP4 staircase of one group, error histograms."""
    fig, axes = new_figure(1, 3, size=(14.0, 4.0))
    ax = axes[0, 0]
    v = fp8_positive_values()
    ax.plot(v[:-1].numpy(), ((v[1:] - v[:-1]) / v[:-1]).numpy(), ".", ms=3)
    ax.set_xscale("log", base=2)
    log_axis(ax)
    ax.set_xlabel("FP8 e4m3 value")
    ax.set_ylabel("gap to the next value / value")
    ax.set_title("FP8 e4m3: relative gap to the next value")
    ax = axes[0, 1]
    x, x4, amax = q["x"][0, :32], q["fp4"][0, :32], q["amax"][0, 0]
    order = torch.argsort(x)
    ax.plot(x[order].numpy(), x4[order].numpy(), "o-", drawstyle="steps-mid", label="FP4 e2m1 x scale")
    ax.plot(x[order].numpy(), x[order].numpy(), "k:", lw=1, label="exact")
    ax.set_xlabel("value (one group of 32)")
    ax.set_ylabel("dequantised")
    ax.set_title(f"FP4 e2m1: one group of 32 (amax {float(amax):.2f})")
    ax.legend()
    ax = axes[0, 2]
    for name, key in (("FP8 e4m3", "fp8"), ("FP4 e2m1", "fp4")):
        rel = ((q[key] - q["x"]).abs() / q["amax"]).flatten().numpy()
        ax.hist(rel, bins=80, histtype="step", label=name, density=True)
    ax.set_yscale("log")
    ax.set_xlabel("|error| / group amax")
    ax.set_ylabel("density")
    ax.set_title("per-32 quantisation error, N(0,1) data")
    ax.legend()
    return fig

