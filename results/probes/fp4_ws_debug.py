"""GPU debugging probe of the FP8 x FP4 Gluon GEMM phase (``megamoe.kernels.gemm_fp4_ws``, tile kind "fp4_ws"): one
fused call with the kind forced, then each GEMM of the phase checked on its own against the torch model
(``megamoe.gemm_phase.run_gemm_phase_fp4``) fed with the kernel's own inputs, so a failure names L1 (the L2 pool
the L1 epilogues wrote) or L2 (the combine rows the L2 epilogues wrote), and the end result against the reference.

    python results/probes/fp4_ws_debug.py [TOKENS] [H] [I] [EXPERTS] [TOPK]      (default 300 512 384 6 3)

Prints, per GEMM, the fraction of differing output elements and the largest relative difference over the valid
rows (the model sums in another order than the tensor cores, so a few requantised bytes may differ by one step;
whole rows or tiles wrong point at a bug). Without CUDA it dry-runs on CPU (the model in the kernel's place:
no differences).
"""
import sys

import torch

import megamoe  # noqa: F401  (before triton)
import megamoe.fused as mf
from megamoe.cases import MoECase, prepare_rank
from megamoe.gemm_phase import run_gemm_phase_fp4, tile_table
from megamoe.kernels.formats import TILE_HEADER, TILE_WORDS
from megamoe.ops import fp8_fp4_mega_moe
from megamoe.symm import SymmBuffer
from megamoe.testing import assert_moe_close

n, H, I, E, K = ([int(a) for a in sys.argv[1:]] + [300, 512, 384, 6, 3][len(sys.argv) - 1:])[:5]
dev = "cuda" if torch.cuda.is_available() else "cpu"
mf.FP4_WS_ENABLED, mf.FP4_WS_MIN_EXPECTED = True, -1
if dev == "cpu":  # a dry run of the probe itself: the interpreter runs the model in the kernel's place (no diffs)
    cfg = mf.FusedConfig(block_m=128, programs_per_rank=1, numerics="hopper", num_warps=8, kind="fp4_ws")
    mf.fused_config = lambda *a, **k: cfg
tables = []
real_table = mf._tile_table
mf._tile_table = lambda sb: tables.append(real_table(sb)) or tables[-1]
case = MoECase(num_ranks=1, num_tokens=n, hidden=H, intermediate=I, num_experts=E, num_topk=K, block_m=128, seed=21)
sb = SymmBuffer.local(1, E, n, K, H, I, block_m=128, device=dev)[0]
problem = case.problem(device=dev)
y, l1, l2, _ = prepare_rank(sb, problem, 0)
fp8_fp4_mega_moe(y, l1, l2, sb, impl="fused", numerics="hopper")
if dev == "cuda":
    torch.cuda.synchronize()
entries, num_l1, block_rows = tile_table(tables[-1])
valid_rows = torch.cat([torch.arange(b * 128, b * 128 + v) for b, v in enumerate(block_rows)]).to(dev)
kernel = {name: sb.view(name).clone() for name in ("l2_acts", "l2_acts_sf", "combine")}


def sub_table(first: int, count: int, l1: bool) -> torch.Tensor:
    """A copy of the tile table holding only entries [first, first + count) (as L1 tiles or as L2 tiles)."""
    t = tables[-1].clone()
    h, w = TILE_HEADER.value, TILE_WORDS.value
    t[h: h + count * w] = tables[-1][h + first * w: h + (first + count) * w]
    t[0], t[1] = (count, 0) if l1 else (0, count)
    return t


def compare(name, got, want):
    got, want = got.float(), want.float()
    diff = got != want
    rel = ((got - want).abs() / want.abs().clamp(min=1e-30)).max().item() if diff.any() else 0.0
    print(f"{name}: {diff.float().mean().item():.2e} of {got.numel()} elements differ, max rel {rel:.3e}")


calls = [type("Call", (), dict(sb=sb, l1=l1, l2=l2, clamp=None))()]
# L1: the model's L2 pool from the kernel's L1 pool (the front launch's folded rows)
run_gemm_phase_fp4(calls, [sub_table(0, num_l1, True)], 128)
compare("L1 -> l2_acts", kernel["l2_acts"][valid_rows], sb.view("l2_acts")[valid_rows])
compare("L1 -> l2_acts_sf", kernel["l2_acts_sf"][valid_rows], sb.view("l2_acts_sf")[valid_rows])
# L2: the model's combine rows from the kernel's L2 pool
sb.view("l2_acts").copy_(kernel["l2_acts"])
sb.view("l2_acts_sf").copy_(kernel["l2_acts_sf"])
run_gemm_phase_fp4(calls, [sub_table(num_l1, len(entries) - num_l1, False)], 128)
slot_tok = sb.view("token_src_metadata")[valid_rows][:, [2, 1]].long()
compare("L2 -> combine", kernel["combine"][slot_tok[:, 0], slot_tok[:, 1]],
        sb.view("combine")[slot_tok[:, 0], slot_tok[:, 1]])
assert_moe_close(y, problem.reference(numerics="hopper")[0], accumulation="fp8_mma")
print("end to end: within the fp8_mma tolerance of the hopper reference")
sb.destroy()
