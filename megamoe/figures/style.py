"""The project's figure plumbing: style, a figure on an Agg canvas, saving PNG + SVG, short log-axis labels.

Every figure function of :mod:`megamoe.figures` draws on :func:`new_figure` (no pyplot, no GUI, no global figure
state) and the notebooks save it with :func:`save_figure` (``figures/``, or ``$MEGAMOE_FIGURES_DIR``).
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from megamoe.env import REPO_ROOT

GiB = 2**30
MiB = 2**20


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


def fmt_bytes(n: float) -> str:
    """1536 -> "1.5 KiB" (binary units, 3 significant digits)."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"

