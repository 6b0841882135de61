"""megamoe's own steps in Triton's compile pipeline, behind one stages hook.

Triton 3.6 lets a process change the stages of every compile: ``knobs.runtime.add_stages_inspection_hook`` is
called with the backend's fresh ``stages`` dict (stage name -> ``f(module, metadata)``) before each compile runs
them. megamoe adds two kinds of step there, each of which looks for its own marker in the kernel and leaves every
other kernel as it was:

* **TTGIR inspections** (:func:`add_ttgir_inspection`): ``f(module, metadata, options, capability) -> None``, run on
  the ``llir`` stage's input (the TritonGPU module) before the stage lowers it -- :mod:`megamoe.shared_address`
  reads there where the shared-memory allocator will put a named buffer;
* **PTX passes** (:func:`add_ptx_pass`): ``f(ptx, metadata) -> ptx``, run on the ``ptx`` stage's output in the
  order they were added -- :mod:`megamoe.multicast`'s rewrite and :mod:`megamoe.shared_address`'s (which touch
  different instructions, so either order gives the same PTX).

One hook however often :func:`install` runs (it carries :data:`MARK`), chained after any hook set before it; each
stage is wrapped once. Neither kind of step is part of Triton's cache key: a kernel that uses one reads a digest of
the module that implements it (``PASS_VERSION`` of each), so that an edit of the step compiles the kernel anew.
"""
from __future__ import annotations

from typing import Callable

#: The attribute that marks megamoe's hook and the stages it wrapped.
MARK = "_megamoe_compile_hooks"
#: Name -> PTX pass ``f(ptx, metadata) -> ptx`` (insertion order is the order they run).
_PTX_PASSES: dict[str, Callable] = {}
#: Name -> TTGIR inspection ``f(module, metadata, options, capability) -> None``.
_TTGIR_INSPECTIONS: dict[str, Callable] = {}


def add_ptx_pass(name: str, fn: Callable) -> None:
    """Run ``fn(ptx, metadata) -> ptx`` on every compile's PTX (after the passes added before it); installs the
    hook (:func:`install`). Adding a name again replaces its pass in place."""
    _PTX_PASSES[name] = fn
    install()


def add_ttgir_inspection(name: str, fn: Callable) -> None:
    """Run ``fn(module, metadata, options, capability)`` on every compile's TritonGPU module before the ``llir``
    stage lowers it (``fn`` must not change ``module``); installs the hook (:func:`install`)."""
    _TTGIR_INSPECTIONS[name] = fn
    install()


def _wrap(stages: dict, key: str, make: Callable) -> None:
    stage = stages.get(key)
    if stage is None or getattr(stage, MARK, False):
        return
    wrapped = make(stage)
    setattr(wrapped, MARK, True)
    stages[key] = wrapped


def _hook_for(previous):
    def hook(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)

        def llir(make_llir):
            def stage(src, metadata):
                for inspect in list(_TTGIR_INSPECTIONS.values()):
                    inspect(src, metadata, options, capability)
                return make_llir(src, metadata)
            return stage

        def ptx(make_ptx):
            def stage(src, metadata):
                out = make_ptx(src, metadata)
                for rewrite in list(_PTX_PASSES.values()):
                    out = rewrite(out, metadata)
                return out
            return stage

        _wrap(stages, "llir", llir)
        _wrap(stages, "ptx", ptx)
    setattr(hook, MARK, True)
    return hook


def install() -> None:
    """Put megamoe's hook into Triton's compile pipeline (once per process; a stages hook set before is kept and
    runs first). A kernel that no step recognises compiles as before."""
    from triton import knobs

    current = knobs.runtime.add_stages_inspection_hook
    if not getattr(current, MARK, False):
        knobs.runtime.add_stages_inspection_hook = _hook_for(current)
