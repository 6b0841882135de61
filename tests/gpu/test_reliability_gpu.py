"""Issue #12's interrupt guarantee on the GPU: local ranks on one device, staged (a KeyboardInterrupt after every
step) and fused (after its launches, in both numerics). The repaired buffer must give the same ``y`` as an
uninterrupted call, bit for bit (the kernels are deterministic), and a zero workspace after the repair."""
import pytest
import torch

from megamoe import fused as mfused
from megamoe import ops
from megamoe.cases import MoECase, prepare_rank
from megamoe.symm import SymmBuffer

CASE = MoECase(num_ranks=2, num_tokens=[24, 9], hidden=256, intermediate=256, num_experts=4, num_topk=2,
               block_m=64, seed=4)
PIPELINE_STEPS = ops.pipeline_steps


def _ranks():
    sbs = SymmBuffer.local(CASE.num_ranks, CASE.num_experts, CASE.max_tokens(), CASE.num_topk, CASE.hidden,
                           CASE.intermediate, block_m=CASE.block_m, device="cuda", barrier_timeout_s=3.0)
    problem = CASE.problem(device="cuda")
    ys, l1s, l2s, _ = (list(t) for t in zip(*[prepare_rank(sb, problem, r) for r, sb in enumerate(sbs)]))
    return sbs, ys, l1s, l2s


def _call(sbs, ys, l1s, l2s, impl, numerics="auto"):
    for y in ys:
        y.fill_(float("nan"))
    ops.fp8_fp4_mega_moe(ys, l1s, l2s, sbs, impl=impl, numerics=numerics)
    return [y.clone() for y in ys]


def _zero(sbs):
    return all(int(sb.buffer[:sb.layout.workspace_bytes].count_nonzero()) == 0 for sb in sbs)


def test_staged_interrupt_at_every_step_boundary_is_repaired(monkeypatch):
    sbs, ys, l1s, l2s = _ranks()
    good = _call(sbs, ys, l1s, l2s, "staged")
    names = [n for n, _ in PIPELINE_STEPS("pull")]
    for after in range(len(names)):
        steps = PIPELINE_STEPS("pull")
        name, fn = steps[after]

        def step(c, fn=fn, name=name):
            fn(c)
            if c.sb.rank == 0:
                raise KeyboardInterrupt(f"injected after {name}")
        monkeypatch.setattr(ops, "pipeline_steps", lambda d, s=steps[:after] + [(name, step)] + steps[after + 1:]: s)
        with pytest.raises(KeyboardInterrupt):
            _call(sbs, ys, l1s, l2s, "staged")
        monkeypatch.setattr(ops, "pipeline_steps", PIPELINE_STEPS)
        assert [sb.fault for sb in sbs] == [None, None] and _zero(sbs), name
        assert all(torch.equal(a, b) for a, b in zip(_call(sbs, ys, l1s, l2s, "staged"), good)), name
    for sb in sbs:
        sb.destroy()


@pytest.mark.skipif(torch.cuda.get_device_capability() < (9, 0), reason="the fused kernel needs sm_90")
@pytest.mark.parametrize("numerics", ["exact", "auto"])  # (auto: the default Hopper numerics' launches)
def test_fused_interrupt_after_the_launch_is_repaired(monkeypatch, numerics):
    sbs, ys, l1s, l2s = _ranks()
    good = _call(sbs, ys, l1s, l2s, "fused", numerics)
    real = mfused.run_fused

    def interrupted(calls, **kw):
        real(calls, **kw)
        raise KeyboardInterrupt("injected after the fused launch")
    monkeypatch.setattr(mfused, "run_fused", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _call(sbs, ys, l1s, l2s, "fused", numerics)
    monkeypatch.setattr(mfused, "run_fused", real)
    assert [sb.fault for sb in sbs] == [None, None] and _zero(sbs)
    assert all(torch.equal(a, b) for a, b in zip(_call(sbs, ys, l1s, l2s, "fused", numerics), good))
    for sb in sbs:
        sb.destroy()
