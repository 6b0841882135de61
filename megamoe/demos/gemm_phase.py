"""The fused FP8 path's three launches on one rank (notebook 08, section 6): the front launch
(``fused_mega_moe_kernel`` with ``PHASE=1``: count, barrier 1, rows placed, the tile table), the GEMM phase
(on a GPU the warp-specialised Gluon launch :mod:`megamoe.kernels.gemm_fp8_ws`; under Triton's interpreter its
pure-torch model :mod:`megamoe.gemm_phase`) and the back launch (``PHASE=2``: barrier 2, combine, cleanup), forced
with ``FusedConfig(kind="fp8_ws")`` -- ``megamoe.fused.fused_config`` takes that path only on an sm_90 GPU, above
``FP8_WS_MIN_EXPECTED`` tokens per expert. Returns what the front launch wrote for the GEMM phase and the check
of ``y`` against the reference: bit-exact under the interpreter; on a GPU (the kernel device) within the FP8-MMA
tolerance profile (``megamoe.testing.assert_moe_close``)."""
from __future__ import annotations

import torch

from megamoe.cases import MoECase, prepare_rank
from megamoe.fused import FusedConfig, _tile_table, run_fused
from megamoe.gemm_phase import tile_table
from megamoe.ops import guarded_call
from megamoe.ops_fp8 import bind_calls_fp8
from megamoe.quant_fp8 import SM90_RECIPE
from megamoe.symm import SymmBuffer
from megamoe.testing import assert_moe_close, moe_error_stats


def fp8_ws_split_demo(block_m: int = 128, num_tokens: int = 300, hidden: int = 512, intermediate: int = 384,
                      num_experts: int = 6, num_topk: int = 3, seed: int = 21) -> dict:
    """One call of ``num_tokens`` tokens (uniform routing, 10 % of the slots masked) through the three launches,
    pool blocks of ``block_m`` (128, or the Gluon phase's 64-row tile). Returns ``tiles`` (the table's entries
    ``(pool block, n-tile, local expert, valid rows)``, L1 tiles first), ``num_l1``, ``block_rows`` (valid rows of
    each pool block, what the GEMM phase's pull copies and its L1 tiles wait for), ``tiles_per_block``
    ``(L1, L2)``, ``bitwise_equal`` / ``rel_fro`` of ``y`` against ``megamoe.reference``, ``on_gpu`` and ``close``
    (bit-exact on CPU ranks, within the ``"fp8_mma"`` tolerance profile on a GPU)."""
    case = MoECase(format="fp8", num_ranks=1, num_tokens=num_tokens, hidden=hidden, intermediate=intermediate,
                   num_experts=num_experts, num_topk=num_topk, masked_ratio=0.1, block_m=128, seed=seed)
    sb = SymmBuffer.local(1, num_experts, num_tokens, num_topk, hidden, intermediate, block_m=128,
                          format="fp8")[0]
    try:
        on_gpu = sb.buffer.device.type == "cuda"
        problem = case.problem(device=sb.buffer.device)
        y, l1, l2, stats = prepare_rank(sb, problem, 0)
        calls = bind_calls_fp8(y, l1, l2, sb, stats, SM90_RECIPE, "swiglu", None, True, "pull", True)
        cfg = FusedConfig(block_m=block_m, programs_per_rank=1, num_warps=8, num_stages=2, kind="fp8_ws")
        with guarded_call(calls, kernel_marks_calls=True):
            run_fused(calls, numerics="exact", config=cfg)
        ref = problem.reference()[0].to(y.device)
        entries, num_l1, block_rows = tile_table(_tile_table(sb))
        err = moe_error_stats(y, ref)
        bitwise = bool(torch.equal(y.view(torch.int16), ref.view(torch.int16)))
        try:
            close = bitwise or (on_gpu and bool(assert_moe_close(y, ref, accumulation="fp8_mma")))
        except AssertionError:
            close = False
        return {"tiles": entries, "num_l1": num_l1, "block_rows": block_rows,
                "tiles_per_block": (intermediate // 128, hidden // 256), "bitwise_equal": bitwise,
                "rel_fro": err["rel_fro"], "on_gpu": on_gpu, "close": close}
    finally:
        sb.destroy()
