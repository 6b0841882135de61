"""Whole-call time of ``fp8_fp4_mega_moe(impl="fused")`` in ``numerics="exact"`` (and "hopper" as a control) with
the package of an **older commit**: the bisect of the `exact` slowdown on the H200 that session 42 noticed
(`results/layer_h200.json` at cf2641f against 5996cc5's: 25-32 % slower at every T, T = 32 1970 -> 2479 µs; on
H100s `exact` did not move between sessions 38 and 42). The suspect is session 37's blocked FP4 weight layout
(964d386: the transform's layout, read by the one-launch Triton tiles that `exact` runs), so the trees to compare
are 964d386's parent 9c425dd, 964d386 and the head.

A tree is a directory holding that commit's ``megamoe/`` with its ``kernels/`` copied in as ``megamoe/kernels``
(what ``pip install -e`` maps), made on a CPU machine with::

    git archive C megamoe kernels | tar -x -C .bisect/C && mv .bisect/C/kernels .bisect/C/megamoe/kernels

and carried to the device (``.bisect`` is git-ignored). The tree goes first on ``sys.path``, so its ``megamoe``
is imported instead of the installed one (the editable finder is appended after the path finder); the row
records the file it came from. Each tree runs in its own process; run them alternating (A B A B) in one device
call, since machines differ between calls::

    python results/probes/exact_bisect.py TREE LABEL [T1,..] [numerics1,..] >> exact_bisect_h200.jsonl
                                                  (default 32,128 exact,hopper)

One row per (T, numerics): ``us`` (median of ``triton.testing.do_bench``, L2 flushed, as the bench's ``us``),
the GPU's name, the label. One EP8 rank's 48 experts of V4-Pro, world size 1, uniform routing, a fresh buffer per T.
The same calls in every tree use only the API those commits share (``MoECase``, ``prepare_rank``, ``SymmBuffer
.local``, ``fp8_fp4_mega_moe``).
"""
import json
import os
import sys

if __name__ == "__main__":
    TREE, LABEL = os.path.abspath(sys.argv[1]), sys.argv[2]
    sys.path.insert(0, TREE)

import torch  # noqa: E402

# fp8_ws_probe.SHAPE's values, written out: importing that probe would import this checkout's megamoe first
SHAPE = dict(num_ranks=1, hidden=7168, intermediate=3072, num_experts=48, num_topk=6, block_m=128)


def main() -> None:
    import megamoe  # noqa: F401  (before triton)
    from megamoe.bench import _median_ms
    from megamoe.cases import MoECase, prepare_rank
    from megamoe.ops import fp8_fp4_mega_moe
    from megamoe.symm import SymmBuffer

    if not megamoe.__file__.startswith(TREE):
        sys.exit(f"exact_bisect: imported {megamoe.__file__}, not the tree {TREE}")
    tokens = [int(t) for t in sys.argv[3].split(",")] if len(sys.argv) > 3 else [32, 128]
    numerics_list = sys.argv[4].split(",") if len(sys.argv) > 4 else ["exact", "hopper"]
    for T in tokens:
        case = MoECase(num_tokens=T, format="fp8_fp4", **SHAPE)
        shape = (case.num_experts, T, case.num_topk, case.hidden, case.intermediate)
        sb = SymmBuffer.local(1, *shape, block_m=case.block_m, device="cuda", format="fp8_fp4")[0]
        problem = case.problem(device=sb.buffer.device)
        y, l1, l2, _ = prepare_rank(sb, problem, 0)
        for numerics in numerics_list:
            def call(numerics=numerics, args=(y, l1, l2, sb)):
                fp8_fp4_mega_moe(*args, impl="fused", numerics=numerics, check=False)
            call()
            torch.cuda.synchronize()
            us = _median_ms(call) * 1e3
            print(json.dumps({"label": LABEL, "T": T, "numerics": numerics, "us": round(us, 1),
                              "gpu": torch.cuda.get_device_name(), "megamoe_file": megamoe.__file__}), flush=True)
        del sb, y, l1, l2, call
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
