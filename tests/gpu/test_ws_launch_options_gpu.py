"""The launch options of a Gluon kind's call on a GPU, each off and on: programmatic dependent launch between its
three launches (``megamoe.fused.WS_PDL``; session 14/15 also had the front's L2 prefetch here, since removed), the FP8
phase's math warpgroups started a ring apart (``FP8_WS_LEAD``; the FP8 x FP4 phase has no such option: the
``FP8_WS_*`` options skip that format), both phases' programs that share a weight tile starting it together
(``WS_GROUP_SYNC``, set for both kinds at once), the back launch's programs an SM (``WS_BACK_PROGRAMS_PER_SM``, 1
and 4: "off" and "on")
and the FP8 x FP4 block-128 decode's stage as two halves (``FP4_WS_DECODE_HALVES``) and its L2 A operand folded
once per pool block by the math warpgroups instead of per stage by the decode partition (``FP4_WS_FOLD_ONCE``), each
with per-block decode and predecoded weights; the idle math warpgroup's decode (``FP4_WS_IDLE_DECODE``) with
per-block decode; the FP8 phase's 2-CTA clusters with the weights multicast (``FP8_WS_MULTICAST``: pool blocks of
one, two and more an expert, so pairs with a second tile and padding slots); the FP8 phase's L2 epilogue through
shared memory and ``cp.async.bulk`` (``FP8_WS_BULK``: the same cases, blocks with padding rows) and those copies
issued by the pull warps (``FP8_WS_COPIER``, also beside the multicast).
Either way the same output bits on every local rank of a four-rank case (four GEMM-phase launches chained between
one front and one back launch), and within the format's tolerance of the reference. (Their CUDA-graph capture runs
in the graph tests of ``test_fp8_gpu.py`` / ``test_fp4_ws_gpu.py``, with the defaults.)"""
import pytest
import torch

from megamoe.cases import MoECase, expected_recv_counts, gluon_phase_cases, prepare_rank

pytestmark = pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0), reason="the Gluon phases are sm_90 only")

#: option -> its (off, on) values
OPTIONS = {"WS_PDL": (False, True), "FP8_WS_LEAD": (False, True),
           "WS_GROUP_SYNC": tuple({"fp8_ws": v, "fp4_ws": v} for v in (False, True)),
           "WS_BACK_PROGRAMS_PER_SM": (1, 4),
           "FP4_WS_DECODE_HALVES": tuple({128: v, 64: False} for v in (False, True)),
           "FP4_WS_FOLD_ONCE": tuple({128: v, 64: False} for v in (False, True)),
           "FP8_WS_MULTICAST": (False, True), "FP8_WS_BULK": (False, True), "FP8_WS_COPIER": (False, True)}
#: option -> constants of ``megamoe.fused`` set for both runs: the tile the option changes (the decode halves: the
#: decode-partition tile at pool block 128, per-block decode and, as ``FP4_WS_DECODE_HALVES@predecoded``, the
#: predecoded weights, where only the L2 A fold changes)
FORCE = {"FP4_WS_DECODE_HALVES": dict(FP4_BLOCK64_MAX_EXPECTED=-1, FP4_RS_MAX_EXPECTED=-1,
                                     FP4_PREDECODE_MIN_EXPECTED=float("inf")),
         "FP4_WS_DECODE_HALVES@predecoded": dict(FP4_BLOCK64_MAX_EXPECTED=-1, FP4_RS_MAX_EXPECTED=-1,
                                                FP4_PREDECODE_MIN_EXPECTED=0)}
OPTIONS["FP4_WS_DECODE_HALVES@predecoded"] = OPTIONS["FP4_WS_DECODE_HALVES"]
FORCE["FP4_WS_FOLD_ONCE"] = FORCE["FP4_WS_DECODE_HALVES"]
FORCE["FP4_WS_FOLD_ONCE@predecoded"] = FORCE["FP4_WS_DECODE_HALVES@predecoded"]
OPTIONS["FP4_WS_FOLD_ONCE@predecoded"] = OPTIONS["FP4_WS_FOLD_ONCE"]
#: the copier beside the 2-CTA multicast (its schedule the cluster's pairs, with padding slots)
OPTIONS["FP8_WS_COPIER@multicast"] = OPTIONS["FP8_WS_COPIER"]
FORCE["FP8_WS_COPIER@multicast"] = dict(FP8_WS_MULTICAST=True)
#: the idle math warpgroup's decode (block 128, per-block decode only: predecoded calls decode nothing)
OPTIONS["FP4_WS_IDLE_DECODE"] = tuple({128: v, 64: False} for v in (False, True))
FORCE["FP4_WS_IDLE_DECODE"] = dict(FORCE["FP4_WS_DECODE_HALVES"], FP4_WS_IDLE_MAX_EXPECTED=float("inf"))
#: option -> the indices of ``gluon_phase_cases`` it runs (by default the four-rank case): the idle decode needs
#: pool blocks of both kinds, <= 64 rows (one rank's 300 tokens at top-2 over 4 experts: 150 an expert, a block of
#: 128 and one of ~22; the skewed case's cold experts) and more (the four-rank case: ~88 an expert)
CASES = {"FP4_WS_IDLE_DECODE": (0, 2, 3), "FP8_WS_MULTICAST": (0, 2, 3), "FP8_WS_BULK": (0, 2, 3),
         "FP8_WS_COPIER": (0, 2, 3), "FP8_WS_COPIER@multicast": (0, 2, 3)}


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("fmt", ["fp8", "fp8_fp4"])
def test_launch_option_on_and_off_give_the_same_bits(fmt, option, monkeypatch):
    import megamoe.fused as mf

    if fmt == "fp8_fp4" and option.startswith("FP8_WS_"):
        pytest.skip("an option of the FP8 phase only: the FP8 x FP4 calls would run twice alike")

    monkeypatch.setattr(mf, option.split("@")[0], getattr(mf, option.split("@")[0]))  # (put back after the test)
    monkeypatch.setattr(mf, "FP8_WS_MIN_EXPECTED", -1)  # the Gluon kinds whatever the size
    monkeypatch.setattr(mf, "FP8_SWAP_MAX_EXPECTED", -1)
    monkeypatch.setattr(mf, "FP4_WS_MIN_EXPECTED", -1)
    for name, value in FORCE.get(option, {}).items():
        monkeypatch.setattr(mf, name, value)
    numerics = "exact" if fmt == "fp8" else "hopper"
    common = dict(format=fmt, block_m=128, impl="fused") if fmt == "fp8" else dict(block_m=128, impl="fused",
                                                                                    numerics=numerics)
    counts = []
    for index in CASES.get(option, (2, )):  # (2: four ranks, a clamp, an empty rank)
        counts.append(_same_bits_on_and_off(gluon_phase_cases(**common)[index], fmt, option, numerics, mf))
    if CASES.get(option) == (0, 2, 3):  # the cases had pool blocks of <= 64 rows and blocks of more
        counts = torch.cat(counts)
        tail = counts % 128
        assert ((tail >= 1) & (tail <= 64)).any() and ((tail > 64) | (counts >= 128)).any(), counts


def _same_bits_on_and_off(case: MoECase, fmt: str, option: str, numerics: str, mf) -> torch.Tensor:
    """``case`` run with ``option`` off and on (twice each, fresh buffers): the same bits on every rank, within the
    tolerance of the reference. Returns the (token, slot) pairs each rank's local experts received, int32."""
    from megamoe.symm import SymmBuffer
    from megamoe.testing import assert_moe_close, default_accumulation

    outs = []
    for value in OPTIONS[option]:
        setattr(mf, option.split("@")[0], value)  # (the test's monkeypatch puts it back)
        sbs = SymmBuffer.local(case.num_ranks, case.num_experts, case.max_tokens(), case.num_topk, case.hidden,
                               case.intermediate, block_m=case.block_m, device="cuda", format=case.format)
        problem = case.problem(device="cuda")
        prepared = [prepare_rank(sb, problem, r) for r, sb in enumerate(sbs)]
        ys, l1s, l2s, stats = (list(t) for t in zip(*prepared))
        cfg = mf.fused_config(sbs[0].layout, max(case.max_tokens(), 1), case.num_ranks, sbs[0].buffer.device,
                              numerics)
        assert cfg.kind == ("fp8_ws" if fmt == "fp8" else "fp4_ws")
        if option in FORCE and fmt == "fp8_fp4" and option.endswith("@rs"):  # the tile the option is about
            assert cfg.rs_block_n and not cfg.predecode, cfg
        elif option in FORCE and fmt == "fp8_fp4":
            assert (cfg.block_m, cfg.rs_block_n, cfg.predecode) == (128, 0, option.endswith("predecoded")), cfg
        for _ in range(2):  # twice: the second call runs after a back launch of its own kind
            case.run(ys, l1s, l2s, sbs, stats)
        torch.cuda.synchronize()
        outs.append([y.clone() for y in ys])
        for sb in sbs:
            sb.destroy()
    refs = problem.reference(activation_clamp=case.activation_clamp, numerics=numerics)
    for r, (off, on) in enumerate(zip(*outs)):
        assert torch.equal(off.view(torch.int16), on.view(torch.int16)), f"rank {r}: {option} changed the output"
        if on.numel():
            assert_moe_close(on, refs[r], name=f"y[rank {r}]", accumulation=default_accumulation(on.device))
    return torch.cat([expected_recv_counts(problem, r) for r in range(case.num_ranks)])  # tokens per local expert
