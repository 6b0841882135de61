"""megamoe.kernels: the device code.

Triton kernels (one source for GPU and for Triton's CPU interpreter) and, under ``cuda/``, the seed's low-level CUDA
primitives (``SymBuffer``, TMA 1-D bulk pull, release/acquire barrier) compiled at run time with CuPy.

Importing this package on a machine without CUDA switches Triton to its interpreter (``TRITON_INTERPRET=1``),
which must happen before any ``@triton.jit`` kernel is defined.
"""
import sys

from megamoe.env import ensure_interpreter_if_no_cuda, interpreting

_triton_already_imported = "triton" in sys.modules
ensure_interpreter_if_no_cuda()
if interpreting():
    import triton.language as _tl
    from triton.runtime.interpreter import InterpretedFunction as _Interpreted

    if not isinstance(_tl.standard.sum, _Interpreted):
        raise ImportError(
            "Triton was imported before megamoe on a machine without CUDA, so its standard library was built for "
            "the compiler, not the interpreter. Import megamoe before triton, or set TRITON_INTERPRET=1 in the "
            "environment." + (" (triton was already in sys.modules)" if _triton_already_imported else ""))
