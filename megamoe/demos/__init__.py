"""Small, self-contained demonstrations the notebooks run and show, one module per idea.

* :mod:`~megamoe.demos.symmetric_memory` -- write on one rank and read on another, ``map(ptr, r)`` arithmetic,
  remote read/write through the Triton kernels' ``sym_map`` and through the CuPy/CUDA ``SymBuffer``;
* :mod:`~megamoe.demos.barrier` -- the cross-rank barrier's words step by step, and a timeout;
* :mod:`~megamoe.demos.formats` -- FP8 e4m3 / FP4 e2m1 / UE8M0 value tables, quantisation errors, the per-32
  block-scaled dot;
* :mod:`~megamoe.demos.weight_transform` -- what ``transform_weights_for_mega_moe`` does, on tiny tensors;
* :mod:`~megamoe.demos.pull_push` -- the layer with a pulling and a pushing dispatch: per-step times, same ``y``;
* :mod:`~megamoe.demos.end_to_end` -- a correctness grid of cases and the ``MegaMoE`` module on ranks.
* :mod:`~megamoe.demos.gemm_phase` -- the fused FP8 path's three launches (front, GEMM phase, back) on a CPU rank:
  the tile table the front launch writes, and the check against the reference.

Functions that run *inside rank processes* live in modules (not notebook cells) because spawned ranks cannot
import functions defined in a notebook (``megamoe.launch`` pickles a function by module and name). Everything
returns plain data (ints, lists, dicts, small tensors) that the notebook prints or plots.
"""

