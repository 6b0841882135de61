"""FP8 Gluon phase with ``megamoe.fused.FP8_WS_LEAD`` off / on, alternating, whole ``fp8_mega_moe(impl="fused")``
call (µs: the bench's timing), one EP8 rank of V4-Pro (``fp8_ws_probe.rank``); outputs compared bitwise.

    python results/probes/lead_ab.py [T1,..] >> fp8_ws_probe_h200.jsonl        (default 2048,8192)
"""
import importlib.util
import json
import pathlib
import sys

import torch

import megamoe.fused as mf
from megamoe.bench import _median_ms
from megamoe.env import git_commit

spec = importlib.util.spec_from_file_location("fp8_ws_probe", pathlib.Path(__file__).with_name("fp8_ws_probe.py"))
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)

tokens = [int(t) for t in sys.argv[1].split(",")] if len(sys.argv) > 1 else [2048, 8192]
for T in tokens:
    want = None
    for lead in (False, True, False, True):
        mf.FP8_WS_LEAD = lead
        sb, _, y, call = probe.rank(T)
        call()
        torch.cuda.synchronize()
        want = y.clone() if want is None else want
        print(json.dumps(dict(probe="lead", T=T, lead=lead, commit=git_commit(), us=_median_ms(call) * 1e3,
                              bitwise_equal=bool(torch.equal(y, want)))), flush=True)
        sb.destroy()
