"""megamoe.kernels: the device code.

Triton kernels (one source for GPU and for Triton's CPU interpreter) and, under ``cuda/``, the seed's low-level CUDA
primitives (``SymBuffer``, TMA 1-D bulk pull, release/acquire barrier) compiled at run time with CuPy.

Importing this package on a machine without CUDA switches Triton to its interpreter (``TRITON_INTERPRET=1``),
which must happen before any ``@triton.jit`` kernel is defined.
"""
from megamoe.env import ensure_interpreter_if_no_cuda

ensure_interpreter_if_no_cuda()
