"""The kernels on the page: source text of the package's Triton kernels and CUDA headers, for the notebooks.

Notebooks never define kernels; they *show* them, read from the package at run time so the page cannot drift from
the code::

    from megamoe import source
    from megamoe.kernels import dispatch
    source.show(dispatch.count_and_publish_indices_kernel)                  # the whole kernel
    source.show(gemm.l1_tile, start="# epilogue", title="L1 epilogue")      # from a marker line to the end
    source.show_cuda("cupy_prims", start="for (u32 j = 0; j < num_local", end="bulk_wait_group<0>")

:func:`text` returns the source of a function (a ``@triton.jit`` function is unwrapped to its Python function);
:func:`excerpt` cuts lines between two markers (a marker that is missing raises, so a renamed line fails the
notebook instead of showing the wrong code); :func:`show` / :func:`show_cuda` display it as a fenced code block
(rendered markdown in a notebook, printed elsewhere) under a one-line caption naming the file and line.
"""
from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

from megamoe.env import REPO_ROOT


def _function(obj):
    """The Python function behind ``obj`` (a Triton ``JITFunction`` keeps it in ``.fn``)."""
    return getattr(obj, "fn", obj)


def text(obj) -> str:
    """Source of a function or ``@triton.jit`` kernel, decorator included, dedented."""
    return textwrap.dedent(inspect.getsource(_function(obj)))


def location(obj, line_offset: int = 0) -> str:
    """``kernels/gemm.py:138`` -- where ``obj`` is defined (plus ``line_offset`` lines), relative to the
    repository."""
    fn = _function(obj)
    path = Path(inspect.getsourcefile(fn)).resolve()
    try:
        path = path.relative_to(REPO_ROOT)
    except ValueError:
        pass
    return f"{path}:{inspect.getsourcelines(fn)[1] + line_offset}"


def excerpt(source: str, start: str | None = None, end: str | None = None) -> str:
    """The lines of ``source`` from the first one containing ``start`` through the first later one containing
    ``end`` (both included; None: from the top / to the bottom). A marker not found raises ValueError."""
    return _cut(source, start, end)[0]


def _cut(source: str, start: str | None, end: str | None) -> tuple[str, int]:
    """(:func:`excerpt`, index of its first line in ``source``)."""
    lines = source.splitlines()
    i = 0
    if start is not None:
        i = next((n for n, line in enumerate(lines) if start in line), None)
        if i is None:
            raise ValueError(f"start marker {start!r} not found")
    j = len(lines) - 1
    if end is not None:
        j = next((n for n in range(i, len(lines)) if end in lines[n]), None)
        if j is None:
            raise ValueError(f"end marker {end!r} not found after {start!r}")
    return textwrap.dedent("\n".join(lines[i:j + 1])), i


def cuda_text(name: str) -> str:
    """A CUDA source of the repo: ``kernels/cuda/<name>`` (a header), or ``"cupy_prims"`` for the translation unit
    that ``megamoe.kernels.cupy_prims`` compiles (``cuda/cupy_kernels.cu``)."""
    from megamoe.kernels import cupy_prims

    return (cupy_prims.CUDA_DIR / (cupy_prims.SOURCE if name == "cupy_prims" else name)).read_text()


def _display(code: str, lang: str, caption: str) -> None:
    block = f"{caption}\n\n```{lang}\n{code}\n```"
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display

        if get_ipython() is not None:
            display(Markdown(block))
            return
    except ImportError:
        pass
    print(block)


def show(obj, start: str | None = None, end: str | None = None, title: str | None = None) -> None:
    """Display the source of ``obj`` (or its :func:`excerpt` between ``start`` and ``end``) with a caption naming
    the function and the file:line the shown text starts at."""
    code, first = _cut(text(obj), start, end)
    name = _function(obj).__name__
    part = "" if start is None and end is None else " (excerpt)"
    _display(code, "python", f"**{title or name}**{part} — `{location(obj, first)}`")


def show_cuda(name: str, start: str | None = None, end: str | None = None, title: str | None = None) -> None:
    """Display (an excerpt of) a CUDA source of the repo, see :func:`cuda_text`."""
    code, first = _cut(cuda_text(name), start, end)
    where = "kernels/cupy_prims.py (_KERNELS)" if name == "cupy_prims" else f"kernels/cuda/{name}:{first + 1}"
    _display(code, "cpp", f"**{title or name}** — `{where}`")
