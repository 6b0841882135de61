"""Notebook glue: markdown tables, showing a saved figure, and the package map of notebook 00.

Everything the notebooks *compute* lives in modules named for the idea (``megamoe.demos.*``, ``megamoe.stepping``,
``megamoe.cases``, ``megamoe.figures``, ...); this module only presents results in a notebook (or prints them).
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence

from megamoe.env import REPO_ROOT


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None, floatfmt: str = ".4g") -> str:
    """A GitHub-markdown table of ``rows`` (dicts); ``columns`` picks and orders the keys (default: the first row's)."""
    rows = list(rows)
    if not rows:
        return "_(no rows)_"
    columns = list(columns or rows[0].keys())

    def cell(v) -> str:
        if isinstance(v, bool) or v is None:
            return str(v)
        if isinstance(v, float):
            return format(v, floatfmt)
        if isinstance(v, int):
            return f"{v:,}"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def show_table(rows: Sequence[dict], columns: Sequence[str] | None = None, floatfmt: str = ".4g") -> None:
    """Display :func:`markdown_table` as rendered markdown in a notebook (printed elsewhere)."""
    show_markdown(markdown_table(rows, columns, floatfmt))


def show_markdown(text: str) -> None:
    """Display markdown ``text`` (e.g. a table of ``megamoe.speed_table``) rendered in a notebook, printed
    elsewhere."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display

        if get_ipython() is not None:
            display(Markdown(text))
            return
    except ImportError:
        pass
    print(text)


def show_figure(fig, name: str) -> None:
    """Save ``fig`` with :func:`megamoe.figures.save_figure` (PNG + SVG) and display the PNG (notebooks)."""
    from megamoe.figures import save_figure

    paths = save_figure(fig, name)
    try:
        from IPython import get_ipython
        from IPython.display import Image, display

        if get_ipython() is not None:
            display(Image(filename=str(paths[0])))
    except ImportError:
        pass
    folder = paths[0].parent
    try:
        folder = folder.relative_to(REPO_ROOT)
    except ValueError:
        pass
    print(f"saved {', '.join(p.name for p in paths)} in {folder}/")



PACKAGE_MODULES = ("env", "layout", "quant", "reference", "testing", "symm", "launch", "harness", "ops", "fused",
                   "cases", "stepping", "sim", "fuzz", "figures", "bench", "walkthrough", "notebooks", "demos")
KERNEL_MODULES = ("symm", "dispatch", "pool", "gemm", "combine", "numerics", "cupy_prims")


def _first_sentence(doc: str | None) -> str:
    doc = (doc or "").strip().split("\n\n")[0].replace("\n", " ")
    return doc.split(". ")[0].rstrip(".") + "." if doc else ""


def package_map() -> list[dict]:
    """One row per module of ``megamoe`` and ``megamoe.kernels`` (and per CUDA header): what it holds, read from its
    docstring (or the header's first comment line)."""
    from megamoe.kernels.cupy_prims import CUDA_DIR

    rows = []
    for name in PACKAGE_MODULES:
        try:
            mod = importlib.import_module(f"megamoe.{name}")
        except ImportError as e:  # a module that cannot load here (never expected): say so
            rows.append({"module": f"megamoe.{name}", "holds": f"(not importable: {e})"})
            continue
        rows.append({"module": f"megamoe.{name}", "holds": _first_sentence(mod.__doc__)})
    for name in KERNEL_MODULES:
        mod = importlib.import_module(f"megamoe.kernels.{name}")
        rows.append({"module": f"megamoe.kernels.{name}", "holds": _first_sentence(mod.__doc__)})
    for path in sorted(CUDA_DIR.glob("*.cuh")):
        first = path.read_text().splitlines()[0].lstrip("/ ")
        rows.append({"module": f"kernels/cuda/{path.name}", "holds": first.split(" -- ", 1)[-1]})
    return rows

