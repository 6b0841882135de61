"""The fused call's host path on CPU (``megamoe.host_path.hopper_host``): a repeated call compiles nothing, encodes
no TMA descriptor, builds no host object and launches what the first call launched, for every tile family the host
picks; with ``direct_launch.RAW`` off the compiled kernels' runners encode the descriptors on every call."""
import pytest

import megamoe.direct_launch as dl
import megamoe.fused as mf
from megamoe.cases import MoECase, prepare_rank
from megamoe.host_path import hopper_host
from megamoe.ops import fp8_fp4_mega_moe
from megamoe.ops_fp8 import fp8_mega_moe
from megamoe.symm import SymmBuffer

SHAPE = dict(num_ranks=1, hidden=1024, intermediate=512, num_experts=48, num_topk=6, block_m=128)
#: (format, T, the tile the host picks there: kind, pool block, register-operand chunk, predecode) -- V4-Pro's
#: routing, so T / 8 expected tokens per expert, as one EP8 rank.
CASES = [("fp8_fp4", 8, ("fp4_ws", 64, 8, False)), ("fp8_fp4", 128, ("fp4_ws", 128, 32, False)),
         ("fp8_fp4", 512, ("fp4_ws", 64, 64, False)), ("fp8_fp4", 1024, ("fp4_ws", 128, 0, False)),
         ("fp8_fp4", 4096, ("fp4_ws", 128, 0, True)), ("fp8", 8, ("fp8_swap", 32, 0, False)),
         ("fp8", 128, ("fp8_ws", 64, 0, False)), ("fp8", 2048, ("fp8_ws", 128, 0, False))]


def _rank(fmt: str, T: int):
    case = MoECase(num_tokens=T, format=fmt, **SHAPE)
    sb = SymmBuffer.local(1, case.num_experts, max(T, 128), case.num_topk, case.hidden, case.intermediate,
                          block_m=case.block_m, device="cpu", format=fmt)[0]
    y, l1, l2, stats = prepare_rank(sb, case.problem(device="cpu"), 0)
    if fmt == "fp8_fp4":
        return sb, lambda: fp8_fp4_mega_moe(y, l1, l2, sb, impl="fused", numerics="hopper", check=False,
                                            cumulative_local_expert_recv_stats=stats)
    return sb, lambda: fp8_mega_moe(y, l1, l2, sb, impl="fused", check=False,
                                    cumulative_local_expert_recv_stats=stats)


def _host_objects(sb) -> dict:
    return {name: len(cache) for name, cache in sb._host_caches.items()}


@pytest.mark.parametrize("fmt, T, tile", CASES)
def test_a_repeated_call_compiles_encodes_and_builds_nothing(fmt, T, tile):
    sb, call = _rank(fmt, T)
    try:
        with hopper_host() as log:
            cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device, "hopper" if fmt == "fp8_fp4" else "exact")
            assert (cfg.kind, cfg.block_m, cfg.rs_block_n, cfg.predecode) == tile
            call()
            first = list(log.launches)
            assert [name for name, _ in log.compiled] == [name for name, _ in first]  # (each kernel once)
            descriptors = len(log.encoded)  # (the first launches' runners encode each descriptor)
            assert (descriptors > 0) == (cfg.kind != "fp8_swap")  # (the one-launch kernel takes none)
            log.clear()
            call()  # the first hits: each descriptor encoded once more, into its memo
            assert not log.compiled and log.launches == first and len(log.encoded) == descriptors
            objects = _host_objects(sb)
            for _ in range(3):
                log.clear()
                call()
                assert not log.compiled and log.launches == first and not log.encoded
            assert _host_objects(sb) == objects
            dl.RAW = False
            try:
                log.clear()
                call()
                assert not log.compiled and log.launches == first and len(log.encoded) == descriptors
            finally:
                dl.RAW = True
    finally:
        sb.destroy()


def test_the_stand_in_puts_everything_back():
    """After ``hopper_host`` the library sees this machine again: what it changed is as before, no launch cached."""
    import torch
    from triton.runtime import driver

    import megamoe.env

    def state():
        return (megamoe.env.interpreting(), mf.interpreting(), mf.fused_config, mf.unsupported_reason,
                mf._check_resident, torch.cuda.get_device_properties, torch.cuda.current_device, dl._first_launch,
                driver._active)

    before = state()
    sb, call = _rank("fp8_fp4", 8)
    try:
        with hopper_host():
            call()
            assert dl._CACHE and state() != before
            assert all(entry[3] is not None for entry in dl._CACHE.values())  # (every hit takes the C launch)
        assert state() == before and not dl._CACHE
    finally:
        sb.destroy()
