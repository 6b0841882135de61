"""The fused call's host path on CPU (``megamoe.host_path.hopper_host``): a repeated call compiles nothing, encodes
no TMA descriptor, builds no host object and launches what the first call launched, for every tile family the host
picks; with ``direct_launch.RAW`` off the compiled kernels' runners encode the descriptors on every call."""
import pytest

import megamoe.direct_launch as dl
import megamoe.fused as mf
from megamoe.host_path import hopper_host, small_rank

#: (format, T, the tile the host picks there: kind, pool block, register-operand chunk, predecode) -- V4-Pro's
#: routing, so T / 8 expected tokens per expert, as one EP8 rank. (T = 512: block 128 with IDLE_DECODE, 1024 without.)
CASES = [("fp8_fp4", 8, ("fp4_ws", 64, 8, False)), ("fp8_fp4", 128, ("fp4_ws", 128, 32, False)),
         ("fp8_fp4", 256, ("fp4_ws", 64, 64, False)), ("fp8_fp4", 512, ("fp4_ws", 128, 0, False)),
         ("fp8_fp4", 1024, ("fp4_ws", 128, 0, False)),
         ("fp8_fp4", 4096, ("fp4_ws", 128, 0, True)), ("fp8", 8, ("fp8_swap", 32, 0, False)),
         ("fp8", 128, ("fp8_ws", 64, 0, False)), ("fp8", 2048, ("fp8_ws", 128, 0, False))]


def _host_objects(sb) -> dict:
    return {name: len(cache) for name, cache in sb._host_caches.items()}


@pytest.mark.parametrize("fmt, T, tile", CASES)
def test_a_repeated_call_compiles_encodes_and_builds_nothing(fmt, T, tile):
    sb, _, call = small_rank(T, fmt, stats=True)
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
    sb, _, call = small_rank(8)
    try:
        with hopper_host():
            call()
            assert dl._CACHE and state() != before
            assert all(entry[3] is not None for entry in dl._CACHE.values())  # (every hit takes the C launch)
        assert state() == before and not dl._CACHE
    finally:
        sb.destroy()
