"""Where megamoe runs: backend detection, the Triton interpreter switch, and provenance for results.

The interpreter switch, in one place: on a machine without CUDA every Triton kernel runs under Triton's interpreter
(``TRITON_INTERPRET=1``) on CPU tensors at their real addresses. Triton reads the switch when it *defines* a
function: its own library (``tl.sum``, ``tl.cdiv``, ...) when ``triton`` is first imported, megamoe's kernels when
``megamoe.kernels`` is imported. So importing ``megamoe`` sets it (:func:`ensure_interpreter_if_no_cuda`: the one
process-wide setting megamoe changes, and only without CUDA; spawned CPU ranks inherit it). When ``triton`` was
imported before ``megamoe`` on such a machine, everything but the kernels still works (layout, quant, reference,
sim, figures, ...); importing ``megamoe.kernels`` raises :func:`require_interpreted_triton`'s ImportError, which
names the fix: import megamoe before triton, or set ``TRITON_INTERPRET=1`` in the environment.

Under the interpreter, importing ``megamoe.kernels`` also makes two changes to Triton's interpreter itself:
:func:`patch_language_once_per_launch` (a device-function call no longer re-patches ``triton.language`` when the
launch already did; a speed-up of ~30 %, nothing that a kernel computes changes) and
:func:`exact_fp8_dots_under_interpreter` (a dot of two FP8 tiles is summed exactly and rounded once, so its bits no
longer depend on the CPU's BLAS). With the compiler nothing is changed.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Where benchmarks write ``results/*.json`` and figures read them (``$MEGAMOE_RESULTS_DIR`` overrides it for readers:
#: ``megamoe.figures.results_dir``).
RESULTS_DIR = REPO_ROOT / "results"
#: Whether ``triton`` was already imported when megamoe was (then the interpreter switch came too late for Triton's
#: own library, see the module docstring).
TRITON_IMPORTED_FIRST = "triton" in sys.modules


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device (and the interpreter is not forced)."""
    import torch

    return torch.cuda.is_available()


def ensure_interpreter_if_no_cuda() -> None:
    """Set ``TRITON_INTERPRET=1`` when no CUDA device exists (an explicit setting is left alone)."""
    if "TRITON_INTERPRET" not in os.environ and not cuda_available():
        os.environ["TRITON_INTERPRET"] = "1"


def require_interpreted_triton() -> None:
    """Under the interpreter, raise an ImportError with the fix when Triton's own library was defined for the
    compiler (``triton`` imported before the switch was set); called by ``megamoe.kernels`` before its kernels."""
    if not interpreting():
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.standard.sum, InterpretedFunction):
        raise ImportError(
            "megamoe's kernels run under Triton's interpreter here (no CUDA), but Triton was imported before the "
            "interpreter was switched on, so its own library was built for the compiler. Fix: import megamoe before "
            "triton, or set TRITON_INTERPRET=1 in the environment."
            + (" (triton was imported before megamoe)" if TRITON_IMPORTED_FIRST else ""))


def patch_language_once_per_launch() -> bool:
    """Under the interpreter only: stop Triton re-patching ``triton.language`` on every device-function call.

    Triton 3.6's interpreter swaps ``triton.language``'s builtins (``tl.load``, ``tl.sum``, the ``tl.tensor``
    operators, ``tl.range``, ...) for interpreted versions when a kernel is launched (``GridExecutor``) and puts the
    originals back when the launch returns. Each call of a ``@triton.jit`` *device* function inside the kernel patches
    the same modules again (``InterpretedFunction.__call__`` -> ``_patch_lang``): a scan of every member of
    ``triton.language``, ``tl.tensor`` and ``tl.math`` that finds nothing left to replace and sets the remaining
    attributes to equivalent fresh closures, never restored. That re-patch was ~30 % of the CPU time of megamoe's
    kernels (thousands of device calls per launch). This wraps ``_patch_lang`` so that when everything it would patch
    for the function is already patched (a builtin of each part -- ``tl.load`` / ``tl.core.load``, ``tl.math.exp``,
    ``tl.tensor.__add__``, ``tensor_descriptor.load`` -- is no longer the builtin) it returns an empty scope: nothing
    to patch, nothing to restore. The first patch of a launch, its restore, and any module not yet patched
    go through Triton's own code unchanged. Installed by ``megamoe.kernels`` on import, only when interpreting (the
    compiler path is untouched), once per process; it changes only how often Triton repeats a patch, not what a
    kernel computes (the bit-exact tests run with it). Returns whether it is installed (False when not
    interpreting, or when this Triton lacks ``interpreter._patch_lang``: then nothing is changed).
    """
    if not interpreting():
        return False
    import triton.language as tl
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or not hasattr(interpreter, "_LangPatchScope"):
        return False
    if getattr(patch, "_megamoe_once", False):
        return True
    is_builtin = tl.core.is_builtin

    def patched(lang) -> bool:  # a builtin of each part one _patch_lang(fn) replaces, still replaced
        return not (is_builtin(lang.load) or (lang is tl and is_builtin(tl.math.exp)))

    def _patch_lang(fn):
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        if (langs and all(patched(lang) for lang in langs) and not is_builtin(tl.core.tensor.__add__)
                and not is_builtin(tl.core.tensor_descriptor_base.load)):
            return interpreter._LangPatchScope()  # already patched by this launch: nothing to do or undo
        return patch(fn)

    _patch_lang._megamoe_once = True
    _patch_lang.__wrapped__ = patch
    interpreter._patch_lang = _patch_lang
    return True


def exact_fp8_dots_under_interpreter() -> bool:
    """Under the interpreter only: compute each ``tl.dot`` of two FP8 e4m3 tiles into float32 exactly, then round
    it once to float32 (then add the accumulator, as before), instead of Triton's float16 ``np.matmul(...,
    dtype=float32)``, which is OpenBLAS sgemm in an order that depends on the CPU.

    Why: the bit-exact tests compare the interpreted kernels with ``megamoe.reference``, and a block dot whose
    float32 sum rounds gives different last bits in different summation orders. Triton's sgemm order changed with
    the OpenBLAS kernel family (seen 2026-12-02 on an AMD EPYC with ``OPENBLAS_CORETYPE=Haswell``: ``dot(a, w^T)``,
    ``dot(w, a^T)^T`` and torch's matmul all differed on such blocks; with "SkylakeX" they agreed), so whether a
    test passed depended on the machine. Exact is order-free: a product of two e4m3 values is a multiple of 2^-18
    (the smallest e4m3 step is 2^-9) of magnitude below 448^2 < 2^17.7, so every partial sum of a dot of K <= 2^17
    of them is a multiple of 2^-18 below 2^35 -- at most 53 significant bits, exact in float64 in any order -- and
    ``megamoe.reference.block_scaled_matmul`` sums its blocks the same way (megamoe's dots have K <= 128). Dots of
    other operand types (none in megamoe's kernels) go through Triton's code unchanged. Installed by
    ``megamoe.kernels`` on import with :func:`patch_language_once_per_launch`; returns whether it is installed."""
    if not interpreting():
        return False
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or not hasattr(interpreter, "_convert_float"):
        return False
    if getattr(original, "_megamoe_exact", False):
        return True

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype != tl.float8e4nv or b.dtype != tl.float8e4nv or d.data.dtype != np.float32:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        a64, b64 = (interpreter._convert_float(t.data, tl.float8e4nv, tl.float16, None).view(np.float16)
                    .astype(np.float64) for t in (a, b))
        return interpreter.TensorHandle(np.matmul(a64, b64).astype(np.float32) + d.data, d.dtype.scalar)

    create_dot._megamoe_exact = True
    create_dot.__wrapped__ = original
    builder.create_dot = create_dot
    return True


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_DEVICE_FACTS: dict = {}


def device_fact(device, read):
    """``read(device)`` -- ``torch.cuda.get_device_properties`` or ``get_device_capability`` -- once per CUDA device
    and query: the fused path's host code asked torch up to seven times a call, ~90 us of host time under cProfile
    (``results/probes/fp8_ws_probe_h200.jsonl``, ``"probe": "host"`` rows: ``get_device_properties`` 5 calls 59 us,
    ``get_device_capability`` 2 calls 32 us). (The key holds the query function itself, so a test that fakes a
    device by patching one of them gets its fake's answer.)"""
    import torch

    index = device.index
    if index is None and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
    key = (index, read)
    if key not in _DEVICE_FACTS:
        _DEVICE_FACTS[key] = read(device if index is None else index)
    return _DEVICE_FACTS[key]


def sm_count(device) -> int:
    """SMs of CUDA ``device`` (:func:`device_fact`)."""
    import torch

    return device_fact(device, torch.cuda.get_device_properties).multi_processor_count


def compute_capability(device) -> tuple[int, int]:
    """Compute capability of CUDA ``device`` (:func:`device_fact`)."""
    import torch

    return tuple(device_fact(device, torch.cuda.get_device_capability))


def kernel_device():
    """The torch device the kernels run on in this process: ``cuda`` unless interpreting, else ``cpu``."""
    import torch

    if interpreting() or not cuda_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


#: What a caller may ask for: ``local`` runs every rank in this process (one GPU, or CPU tensors in lock-step).
BACKENDS = ("auto", "cpu", "cuda", "local")


def resolve_backend(backend: str = "auto", world_size: int = 1, *, local: bool = True) -> str:
    """The one backend resolver: ``backend`` for ``world_size`` ranks -> ``"cpu"``, ``"cuda"`` or ``"local"``.

    ``cpu``: one process per rank, gloo + POSIX shared memory + Triton's interpreter. ``cuda``: one process per GPU,
    NCCL + ``torch.distributed._symmetric_memory`` (needs ``world_size`` GPUs). ``local``: every rank in this
    process (lock-step), for callers that can run ranks that way (``local=True``; ``megamoe.launch`` cannot).
    ``auto``: ``cuda`` when at least ``world_size`` GPUs exist; with fewer GPUs ``local`` (all ranks on one GPU)
    where allowed, else ``cpu``; ``cpu`` without a GPU.
    """
    allowed = BACKENDS if local else tuple(b for b in BACKENDS if b != "local")
    if backend not in allowed:
        raise ValueError(f"backend={backend!r} must be one of {', '.join(map(repr, allowed))}")
    import torch

    gpus = torch.cuda.device_count() if cuda_available() else 0
    if backend == "auto":
        return "cuda" if gpus >= world_size else "local" if gpus and local else "cpu"
    if backend == "cuda" and gpus < world_size:
        raise ValueError(f"backend='cuda' needs {world_size} GPUs, found {gpus}")
    return backend


def device_tag() -> str:
    """``cpu``, or the GPU's name in lower case with dashes (``h200``): the suffix of result file names."""
    import torch

    if not cuda_available():
        return "cpu"
    return torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-").lower()


@lru_cache(maxsize=1)
def git_commit() -> str:
    """The repository's HEAD commit (with ``-dirty`` when the tree has changes), or ``"unknown"``.

    ``MEGAMOE_GIT_COMMIT`` overrides it, for copies of the tree without ``.git`` (e.g. a remote GPU machine)."""
    if os.environ.get("MEGAMOE_GIT_COMMIT"):
        return os.environ["MEGAMOE_GIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def provenance(command: str | None = None) -> dict:
    """A dict to store beside every measured number: device, versions, commit, command."""
    import torch
    import triton

    info = {
        "device": (torch.cuda.get_device_name() if cuda_available()
                   else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "interpreter": interpreting(),
        "num_gpus": torch.cuda.device_count() if cuda_available() else 0,
    }
    if command is not None:
        info["command"] = command
    return info


def describe_environment() -> str:
    """One line: backend, device and versions (printed by ``make setup`` and by the notebooks)."""
    p = provenance()
    return (f"backend={resolve_backend(local=False)} device={p['device']} torch={p['torch']} triton={p['triton']} "
            f"commit={p['git_commit'][:12]}{'-dirty' if p['git_commit'].endswith('-dirty') else ''}")
