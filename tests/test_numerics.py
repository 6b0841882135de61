"""The integer-op rounding helpers in megamoe.kernels.numerics must give torch's bits on every back end."""
import torch
import triton
import triton.language as tl

from megamoe.kernels import numerics as nx


@triton.jit
def _round_kernel(x_ptr, e4m3_ptr, bf16_ptr, back_ptr, pow2_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(e4m3_ptr + offs, nx.f32_to_e4m3_bits(x).to(tl.uint8))
    b = nx.f32_to_bf16_bits(x)
    tl.store(bf16_ptr + offs, b.to(tl.int16))
    tl.store(back_ptr + offs, nx.bf16_bits_to_f32(b))
    p, _ = nx.ceil_ue8m0(tl.maximum(tl.abs(x), 1e-20))
    tl.store(pow2_ptr + offs, p)


@triton.jit
def _fp4_kernel(nib_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, nx.e2m1_to_e4m3(tl.load(nib_ptr + offs)).to(tl.float32))


def _run(x):
    n = x.numel()
    outs = [torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.int16), torch.empty(n), torch.empty(n)]
    _round_kernel[(1,)](x, *outs, N=n)
    return outs


def _interesting_floats(n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    exact = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    exact = exact[torch.isfinite(exact)]
    mids = (exact[:-1] + exact[1:]) / 2  # ties, including across binades
    rand = torch.randn(n, generator=g) * torch.exp2(torch.randint(-14, 10, (n,), generator=g).float())
    sat = torch.tensor([448.0, 449.0, 464.0, 479.9, 500.0, 1e6, -1e6, 0.0, -0.0, 2 ** -10, 2 ** -9 * 1.5])
    x = torch.cat([exact, mids, -mids, rand, sat]).float()
    pad = (1 << (x.numel() - 1).bit_length()) - x.numel()
    return torch.cat([x, torch.zeros(pad)])


def test_f32_to_e4m3_matches_torch_rtne_satfinite():
    x = _interesting_floats()
    got = _run(x)[0]
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} mismatches, e.g. x={x[bad[:5]].tolist()} got={got[bad[:5]].tolist()} "
                              f"want={want[bad[:5]].tolist()}")


def test_f32_to_bf16_matches_torch_rtne_and_back_is_exact():
    x = _interesting_floats(seed=1)
    _, bits, back, _ = _run(x)
    want = x.to(torch.bfloat16)
    assert torch.equal(bits, want.view(torch.int16))
    assert torch.equal(back, want.float())


def test_ceil_ue8m0_is_smallest_power_of_two_above():
    x = _interesting_floats(seed=2).abs().clamp_min(1e-20)
    p = _run(x)[3]
    want = torch.exp2(torch.ceil(torch.log2(x.double()))).float()
    ok = (p >= x) & (p / 2 < x)
    assert ok.all(), x[~ok][:5]
    assert torch.equal(p, want)


@triton.jit
def _fp4_scaled_kernel(nib_ptr, sbyte_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, nx.e2m1_scaled_f32(tl.load(nib_ptr + offs), tl.load(sbyte_ptr + offs)))


def test_e2m1_scaled_decode_is_exact():
    nib = torch.arange(16, dtype=torch.int32).repeat(16)
    sbyte = torch.tensor([2, 20, 100, 120, 126, 127, 128, 130, 140, 160, 200, 230, 240, 250, 251, 252],
                         dtype=torch.int32).repeat_interleave(16)
    out = torch.empty(256)
    _fp4_scaled_kernel[(1,)](nib, sbyte, out, N=256)
    vals = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    want = (torch.cat([vals, -vals]).repeat(16) * torch.exp2(sbyte.double() - 127)).float()
    assert torch.equal(out, want)


def test_e2m1_decode_to_e4m3_is_exact():
    nib = torch.arange(16, dtype=torch.int32)
    out = torch.empty(16)
    _fp4_kernel[(1,)](nib, out, N=16)
    vals = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6])
    assert torch.equal(out, torch.cat([vals, -vals]))
