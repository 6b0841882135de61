"""``megamoe.direct_launch`` on a GPU with Triton's real CUDA launcher: every kernel a fused call launches is
recognised (a hit goes straight into its C launcher, ``_Raw``), and the outputs are bitwise equal whether the hits
take the C launcher (``RAW``, the default), the compiled kernel's runner (``RAW`` off) or every launch goes through
``JITFunction.run`` (``ENABLED`` off) -- eager, and captured in a CUDA graph and replayed -- for each tile kind the
host picks in both formats (the register-operand and decode-partition FP8 x FP4 tiles with their TMA descriptors,
swap-AB and the FP8 Gluon phase). ``tests/test_direct_launch.py`` checks the arguments against Triton's launcher
code on CPU; this is the same against the binary."""
import pytest
import torch

import megamoe.direct_launch as dl
from megamoe.host_path import small_rank

pytestmark = pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0), reason="the Hopper tiles are sm_90 only")


@pytest.mark.parametrize("fmt, num_tokens", [("fp8_fp4", 8), ("fp8_fp4", 128), ("fp8_fp4", 2048), ("fp8", 8),
                                             ("fp8", 128)])
def test_hits_take_the_c_launcher_with_the_same_bits(fmt, num_tokens, monkeypatch):
    sb, y, call = small_rank(num_tokens, fmt, device="cuda")
    try:
        dl.clear()
        call()  # first launches: compile (or disk cache), keep the compiled kernels
        call()  # first hits: each descriptor encoded once, into its memo
        torch.cuda.synchronize()
        want = y.clone()
        assert dl._CACHE and all(entry[3] is not None for entry in dl._CACHE.values()), [
            (entry[0].__name__, entry[3]) for entry in dl._CACHE.values()]
        assert not want.isnan().any()
        for switch in ("RAW", "ENABLED"):
            with monkeypatch.context() as m:
                m.setattr(dl, switch, False)
                y.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                assert torch.equal(y.view(torch.int16), want.view(torch.int16)), switch
        y.fill_(float("nan"))
        call()
        torch.cuda.synchronize()
        assert torch.equal(y.view(torch.int16), want.view(torch.int16))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        for _ in range(2):
            y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    finally:
        dl.clear()
        sb.destroy()
