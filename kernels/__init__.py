"""megamoe.kernels: the device code.

Triton kernels (one source for GPU and for Triton's CPU interpreter) and, under ``cuda/``, the seed's low-level CUDA
primitives (``SymBuffer``, TMA 1-D bulk pull, release/acquire barrier) compiled at run time with CuPy.

Without CUDA the kernels run under Triton's interpreter, which must be switched on before Triton is imported (see
``megamoe.env``): importing this package checks that it was, and otherwise raises an ImportError naming the fix.
Under the interpreter it also stops Triton re-patching ``triton.language`` on every device-function call
(``megamoe.env.patch_language_once_per_launch``: ~30 % of the interpreted kernels' time, results unchanged), and sums
each dot of two FP8 tiles exactly before one rounding (``megamoe.env.exact_fp8_dots_under_interpreter``: its bits no
longer depend on the CPU's BLAS).
"""
from megamoe.env import (
    ensure_interpreter_if_no_cuda,
    exact_fp8_dots_under_interpreter,
    patch_language_once_per_launch,
    require_interpreted_triton,
)

ensure_interpreter_if_no_cuda()
require_interpreted_triton()
patch_language_once_per_launch()
exact_fp8_dots_under_interpreter()
