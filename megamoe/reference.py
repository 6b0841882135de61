"""The semantics every megamoe kernel must match, in plain torch (any device, float32 accumulation).

One Mega MoE layer, per token ``t`` and top-k slot ``j`` with expert ``e = topk_idx[t, j] >= 0``:

1. ``a = dequant(x[t])``, FP8 x UE8M0 -> float32 ``[H]``.
2. ``h = bf16(a @ W1[e].T)``: float32 accumulate, then one rounding to bf16 (DeepGEMM rounds the L1
   accumulator to bf16 before the activation). ``gate = h[:I]``, ``up = h[I:]``.
3. Optional clamp ``c``: ``gate = min(gate, c)``, ``up = clamp(up, -c, c)``.
4. ``act = silu(gate) * up * topk_weights[t, j]`` in float32, ``silu(g) = g / (1 + exp(-g))``. The top-k
   weight is applied here, before requantisation, not in the combine.
5. ``act`` is requantised per 32 with :func:`megamoe.quant.per_token_cast_to_fp8`.
6. ``o = bf16(dequant(act) @ W2[e].T)`` (float32 accumulate), the row the combine buffer holds for ``(j, t)``.
7. ``y[t] = bf16(sum_j float32(o[j]))`` over valid slots in increasing ``j``, float32 accumulation and one
   round-to-nearest-even at the end; a token with every slot masked gets ``y[t] = 0``.

Every (token, slot) row is computed independently; a kernel may batch and order rows as it likes, and differs
from this reference only through float32 summation order (see :func:`megamoe.testing.assert_moe_close`).
Weights are in the untransformed (K-major, gate rows then up rows) layout of
:func:`megamoe.quant.cast_grouped_weights_to_fp4`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from megamoe.quant import (
    QuantWeights,
    check_moe_weights,
    dequant_fp4,
    dequant_fp8,
    e2m1_decode,
    fold_to_row_scale_dequant,
    per_128_cast_to_fp8,
    per_token_cast_to_fp8,
    unpack_nibbles,
)

#: ``"exact"``: the seeds' semantics (per-32 scales applied exactly; the staged kernels). ``"hopper"``: the fused
#: Hopper kernel's numerics -- per-32 scales folded into the 8-bit operands relative to each token's / weight
#: row's largest scale (:func:`megamoe.quant.fold_scales`); the L2 input quantised per 128, not per 32, then folded
#: per token the same way. ``"hopper_l2_per_block"``: as ``"hopper"`` but the L2 input's per-128 scales are not
#: folded: each 128-wide K block of L2 is applied with its own token scale (DeepGEMM SM90's promotion per K block,
#: here one exact power of two per token and block), so the L2 input is the per-128 dequantisation itself, exact
#: where ``"hopper"``'s fold rounds a value below e4m3's normal range (:data:`HOPPER_NUMERICS`, :func:`l2_folded`).
NUMERICS = ("exact", "hopper", "hopper_l2_per_block")
#: The numerics of the fused Hopper tiles (folded L1 input and weights: no per-32 promotion in a K loop).
HOPPER_NUMERICS = ("hopper", "hopper_l2_per_block")


def l2_folded(numerics: str) -> bool:
    """Whether ``numerics`` folds the L2 input per token relative to its largest per-128 scale (``"hopper"``), as
    opposed to applying each K block's scale (``"hopper_l2_per_block"``; ``"exact"``: per 32, exactly)."""
    return numerics == "hopper"


@contextlib.contextmanager
def _ieee_fp32_matmul() -> Iterator[None]:
    """Force full-precision float32 matmuls (no TF32 / bf16 shortcuts) on CUDA and oneDNN while inside."""
    backends = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    saved = [b.fp32_precision for b in backends]
    try:
        for b in backends:
            b.fp32_precision = "ieee"
        yield
    finally:
        for b, precision in zip(backends, saved):
            b.fp32_precision = precision


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------


def _check_tokens(
    x: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    hidden: int,
    num_experts: int,
    names: tuple[str, str, str, str] = ("x", "x_sf", "topk_idx", "topk_weights"),
    sf_dtype: torch.dtype = torch.int32,
) -> None:
    """Check one rank's inputs against the weights' ``hidden`` and ``num_experts``; errors use ``names``.
    ``sf_dtype``: int32 (packed UE8M0, the FP8 x FP4 format) or float32 (the SM90 FP8 format)."""
    tensors = (x, x_sf, topk_idx, topk_weights)
    dtypes = (torch.float8_e4m3fn, sf_dtype, torch.int64, torch.float32)
    for t, dtype, name in zip(tensors, dtypes, names):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected {dtype}, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    x_name, sf_name, idx_name, w_name = names
    n = x.shape[0]
    if x.shape[1] != hidden:
        raise ValueError(f"{x_name}: hidden size {x.shape[1]} does not match the weights' H={hidden}")
    if tuple(x_sf.shape) != (n, hidden // 128):
        raise ValueError(f"{sf_name}: expected shape {(n, hidden // 128)}, got {tuple(x_sf.shape)}")
    if topk_idx.shape[0] != n or topk_idx.shape[1] < 1:
        raise ValueError(f"{idx_name}: expected shape [{n}, num_topk >= 1], got {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"{w_name}: shape {tuple(topk_weights.shape)} does not match topk_idx {tuple(topk_idx.shape)}")
    if topk_idx.numel() and not bool(((topk_idx >= -1) & (topk_idx < num_experts)).all()):
        raise ValueError(f"{idx_name}: expert ids must lie in [-1, {num_experts}) (-1 = masked slot)")
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{x_name}: {', '.join(names)} must all be on one device")


def _check_clamp(activation_clamp: float | None) -> None:
    if activation_clamp is not None and not activation_clamp > 0:
        raise ValueError(f"activation_clamp: must be None or > 0, got {activation_clamp}")


# ----------------------------------------------------------------------------------------------------------
# One expert, and the combine
# ----------------------------------------------------------------------------------------------------------


@dataclass
class _ExpertOutput:
    l1_out: torch.Tensor  # bf16 [m, 2I]: gate | up, before the clamp
    l2_in: torch.Tensor  # float8_e4m3fn [m, I]
    l2_in_sf: torch.Tensor  # int32 [m, I/128]
    out: torch.Tensor  # bf16 [m, H]


def _expert_weights(weights: QuantWeights, e: int, numerics: str = "exact") -> torch.Tensor:
    """Expert ``e`` of FP4 weights ``(int8 [E, n, k/2], int32 [E, n, k/128])`` as float32 ``[n, k]``; with
    Hopper numerics each row's per-32 scales are folded relative to its largest (see ``NUMERICS``)."""
    if numerics in HOPPER_NUMERICS:
        return fold_to_row_scale_dequant(e2m1_decode(unpack_nibbles(weights[0][e])), weights[1][e])
    return dequant_fp4(weights[0][e], weights[1][e])


def _tokens(x: torch.Tensor, x_sf: torch.Tensor, numerics: str) -> torch.Tensor:
    """Dequantised tokens float32 ``[n, H]`` (folded per token with Hopper numerics)."""
    if numerics in HOPPER_NUMERICS:
        return fold_to_row_scale_dequant(x.float(), x_sf)
    return dequant_fp8(x, x_sf)


def _check_numerics(numerics: str) -> None:
    if numerics not in NUMERICS:
        raise ValueError(f"numerics: must be one of {NUMERICS}, got {numerics!r}")


def swiglu(h: torch.Tensor, activation_clamp: float | None) -> torch.Tensor:
    """SwiGLU of L1 outputs ``h [m, 2I]`` (gate | up, any float dtype) -> float32 ``[m, I]``.

    ``gate = min(gate, c)``, ``up = clamp(up, -c, c)`` when a clamp ``c`` is given; then
    ``gate / (1 + exp(-gate)) * up`` in float32, with ``exp`` evaluated in float64 and rounded once to float32
    (:func:`exp_f32`).
    """
    gate, up = h.float().chunk(2, dim=-1)
    if activation_clamp is not None:
        gate = gate.clamp(max=activation_clamp)
        up = up.clamp(-activation_clamp, activation_clamp)
    return gate / (1.0 + exp_f32(-gate)) * up


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``exp(x)`` computed in float64 and rounded once: correctly rounded but for double-rounding cases
    (~2^-29 of inputs), so it does not depend on the math library. float32 ``exp`` itself does: torch's and
    NumPy's (which Triton's interpreter uses) differ in the last bit for ~40% of inputs, and one such bit can flip
    an FP8 requantisation and change a whole output row (found by ``tests/test_fuzz.py``). The CPU kernels do the
    same (``F64_EXP`` in ``megamoe.kernels.gemm``); GPU kernels use the fast float32 ``exp`` and are compared with a
    tolerance anyway."""
    return torch.exp(x.double()).float()


def _expert_forward(
    a: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    activation_clamp: float | None,
    numerics: str = "exact",
) -> _ExpertOutput:
    """One expert on ``m`` rows: ``a`` float32 ``[m, H]``, top-k ``weights`` float32 ``[m]``, dequantised
    ``w1 [2I, H]`` and ``w2 [H, I]``; the L2 input is quantised per 32 (``"exact"``) or per 128 (Hopper numerics),
    and with ``"hopper"`` folded per token (:func:`l2_folded`)."""
    l1_out = (a @ w1.T).to(torch.bfloat16)
    act = swiglu(l1_out, activation_clamp) * weights.unsqueeze(1)
    l2_in, l2_in_sf = (per_128_cast_to_fp8 if numerics in HOPPER_NUMERICS else per_token_cast_to_fp8)(act)
    a2 = fold_to_row_scale_dequant(l2_in.float(), l2_in_sf) if l2_folded(numerics) else dequant_fp8(l2_in, l2_in_sf)
    out = (a2 @ w2.T).to(torch.bfloat16)
    return _ExpertOutput(l1_out, l2_in, l2_in_sf, out)


def combine(buffer: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """Reduce a combine buffer: bf16 ``[k, n, H]`` and int64 ``topk_idx [n, k]`` -> bf16 ``y [n, H]``.

    ``y[t] = bf16(sum of float32(buffer[j, t]) over j with topk_idx[t, j] >= 0, in increasing j)``; entries of
    masked slots are never read, so their content does not matter.
    """
    acc = torch.zeros(buffer.shape[1:], dtype=torch.float32, device=buffer.device)
    for j in range(buffer.shape[0]):
        valid = (topk_idx[:, j] >= 0).unsqueeze(1)
        acc = torch.where(valid, acc + buffer[j].float(), acc)
    return acc.to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------------------


def reference_mega_moe(
    x: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1_weights: QuantWeights,
    l2_weights: QuantWeights,
    *,
    activation_clamp: float | None = None,
    return_intermediates: bool = False,
    numerics: str = "exact",
) -> torch.Tensor | tuple[torch.Tensor, dict]:
    """The whole MoE layer on one rank holding all ``E`` experts (see the module docstring for the maths).

    Args:
        x: float8_e4m3fn ``[n, H]`` tokens.
        x_sf: int32 ``[n, H/128]`` packed UE8M0 scales of ``x`` (K-major).
        topk_idx: int64 ``[n, k]`` expert ids in ``[0, E)``, or -1 for a masked slot.
        topk_weights: float32 ``[n, k]``.
        l1_weights: ``(int8 [E, 2I, H/2], int32 [E, 2I, H/128])``, rows gate then up, untransformed.
        l2_weights: ``(int8 [E, H, I/2], int32 [E, H, I/128])``, untransformed.
        activation_clamp: optional ``c > 0``: ``gate <= c`` and ``|up| <= c`` before SwiGLU.
        numerics: ``"exact"``, ``"hopper"`` or ``"hopper_l2_per_block"`` (see :data:`NUMERICS`).
        return_intermediates: also return a dict with

            * ``expert_recv_count`` int64 ``[E]``: (token, slot) pairs each expert receives;
            * ``expert_rows``: per expert, int64 ``[m_e, 2]`` of ``(token, slot)``, token-major;
            * ``l1_out``: per expert, bf16 ``[m_e, 2I]`` L1 outputs (gate | up, before the clamp);
            * ``l2_in``: per expert, ``(float8_e4m3fn [m_e, I], int32 [m_e, I/128])`` L2 inputs;
            * ``combine``: bf16 ``[k, n, H]``, ``combine[j, t]`` = expert output for slot ``j`` of token
              ``t`` (zero for masked slots).

    Returns:
        ``y`` bf16 ``[n, H]``, or ``(y, intermediates)``.
    """
    num_experts, hidden, _ = check_moe_weights(l1_weights, l2_weights)
    _check_tokens(x, x_sf, topk_idx, topk_weights, hidden=hidden, num_experts=num_experts)
    _check_clamp(activation_clamp)
    _check_numerics(numerics)
    if x.device != l1_weights[0].device:
        raise ValueError(f"x: on {x.device} but the weights are on {l1_weights[0].device}")

    a = _tokens(x, x_sf, numerics)
    with _ieee_fp32_matmul():
        return _each_expert_then_combine(
            topk_idx, num_experts, x, return_intermediates,
            lambda e, token, slot: _expert_forward(
                a[token], topk_weights[token, slot],
                _expert_weights(l1_weights, e, numerics), _expert_weights(l2_weights, e, numerics),
                activation_clamp, numerics,
            ))


def _each_expert_then_combine(topk_idx: torch.Tensor, num_experts: int, x: torch.Tensor, return_intermediates: bool,
                              forward):
    """The single-rank layer around one format's expert math: for each expert ``e``, ``forward(e, token, slot)``
    on its (token, slot) pairs (int64 ``[m_e]`` each, token-major) returns an ``_ExpertOut`` whose bf16 rows go into
    combine row ``slot`` of their tokens; then the top-k reduce (:func:`combine`). Returns ``y`` bf16 ``[n, H]``
    (``x``'s shape and device), or ``(y, intermediates)`` as :func:`reference_mega_moe` documents."""
    buffer = torch.zeros((topk_idx.shape[1], *x.shape), dtype=torch.bfloat16, device=x.device)
    rows_per_expert, outputs = [], []
    for e in range(num_experts):
        rows = (topk_idx == e).nonzero()
        token, slot = rows.unbind(1)
        out = forward(e, token, slot)
        buffer[slot, token] = out.out
        rows_per_expert.append(rows)
        outputs.append(out)
    y = combine(buffer, topk_idx)
    if not return_intermediates:
        return y
    return y, {
        "expert_recv_count": torch.tensor([len(r) for r in rows_per_expert], dtype=torch.int64),
        "expert_rows": rows_per_expert,
        "l1_out": [o.l1_out for o in outputs],
        "l2_in": [(o.l2_in, o.l2_in_sf) for o in outputs],
        "combine": buffer,
    }


def _check_ep_lists(xs, x_sfs, topk_idxs, topk_weights_list, num_ranks, num_experts: int) -> dict:
    """The per-rank lists of an expert-parallel reference: ``num_ranks`` divides the experts and every list holds
    one tensor per rank. Returns the lists by argument name."""
    if not isinstance(num_ranks, int) or num_ranks < 1 or num_experts % num_ranks != 0:
        raise ValueError(
            f"num_ranks: must be a positive divisor of the number of experts {num_experts}, got {num_ranks}"
        )
    lists = {"xs": xs, "x_sfs": x_sfs, "topk_idxs": topk_idxs, "topk_weights_list": topk_weights_list}
    for name, values in lists.items():
        if not isinstance(values, (list, tuple)) or len(values) != num_ranks:
            raise ValueError(f"{name}: expected a list of num_ranks={num_ranks} tensors")
    return lists


def reference_mega_moe_ep(
    xs: list[torch.Tensor],
    x_sfs: list[torch.Tensor],
    topk_idxs: list[torch.Tensor],
    topk_weights_list: list[torch.Tensor],
    l1_weights: QuantWeights,
    l2_weights: QuantWeights,
    num_ranks: int,
    *,
    activation_clamp: float | None = None,
    numerics: str = "exact",
) -> list[torch.Tensor]:
    """The layer in expert-parallel form over ``num_ranks`` ranks, simulated in one process.

    Rank ``r`` holds tokens ``xs[r]`` ``[n_r, H]`` (with ``x_sfs[r]``, ``topk_idxs[r]``,
    ``topk_weights_list[r]``, as in :func:`reference_mega_moe`; ``n_r = 0`` allowed) and owns experts
    ``[r*El, (r+1)*El)`` of the global weights (``El = E / num_ranks``). Each rank runs its experts on the
    (token, slot) pairs routed to them from every rank (source rank, then token, then slot order) and writes
    each output row into the source rank's bf16 combine buffer ``[k, n_src, H]``; every rank then reduces
    its own buffer. Returns the per-rank ``y`` (bf16 ``[n_r, H]``), bitwise equal to
    :func:`reference_mega_moe` on the concatenated tokens. ``numerics``: see :data:`NUMERICS`.
    """
    num_experts, hidden, _ = check_moe_weights(l1_weights, l2_weights)
    lists = _check_ep_lists(xs, x_sfs, topk_idxs, topk_weights_list, num_ranks, num_experts)
    for r in range(num_ranks):
        names = tuple(f"{name}[{r}]" for name in lists)
        _check_tokens(xs[r], x_sfs[r], topk_idxs[r], topk_weights_list[r],
                      hidden=hidden, num_experts=num_experts, names=names)
        if xs[r].device != l1_weights[0].device:
            raise ValueError(f"xs[{r}]: on {xs[r].device} but the weights are on {l1_weights[0].device}")
        if topk_idxs[r].shape[1] != topk_idxs[0].shape[1]:
            raise ValueError(
                f"topk_idxs[{r}]: num_topk {topk_idxs[r].shape[1]} differs from rank 0's {topk_idxs[0].shape[1]}"
            )
    _check_clamp(activation_clamp)
    _check_numerics(numerics)

    num_local = num_experts // num_ranks
    a = [_tokens(x, sf, numerics) for x, sf in zip(xs, x_sfs)]
    buffers = [torch.zeros((idx.shape[1], *x.shape), dtype=torch.bfloat16, device=x.device)
               for x, idx in zip(xs, topk_idxs)]
    with _ieee_fp32_matmul():
        for rank in range(num_ranks):
            experts = slice(rank * num_local, (rank + 1) * num_local)
            local_l1 = (l1_weights[0][experts], l1_weights[1][experts])
            local_l2 = (l2_weights[0][experts], l2_weights[1][experts])
            for local_e in range(num_local):
                e = rank * num_local + local_e
                rows = [(idx == e).nonzero().unbind(1) for idx in topk_idxs]  # per source: (token, slot)
                counts = [len(token) for token, _ in rows]
                out = _expert_forward(
                    torch.cat([a_src[token] for a_src, (token, _) in zip(a, rows)]),
                    torch.cat([w[token, slot] for w, (token, slot) in zip(topk_weights_list, rows)]),
                    _expert_weights(local_l1, local_e, numerics), _expert_weights(local_l2, local_e, numerics),
                    activation_clamp, numerics,
                )
                for buffer, (token, slot), part in zip(buffers, rows, out.out.split(counts)):
                    buffer[slot, token] = part
    return [combine(buffer, idx) for buffer, idx in zip(buffers, topk_idxs)]


# ----------------------------------------------------------------------------------------------------------
# The SM90 FP8 x FP8 format (DeepGEMM ``fp8_mega_moe``, recipe (128, 128, 128)); see megamoe.quant_fp8
# ----------------------------------------------------------------------------------------------------------


def block_scaled_matmul(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """DeepGEMM SM90's FP8 GEMM with per-128 promotion: float32 ``[m, n]``.

    ``a`` float32 ``[m, K]`` (FP8 values), ``sa`` float32 ``[m, K/128]``; ``w`` float32 ``[n, K]`` (FP8 values),
    ``sw`` float32 ``[n, K/128]`` (each row's block scale per K block). For each K block ``b`` of 128 in order:
    ``acc += (sa[:, b] * sw[:, b]) * (a[:, b] @ w[:, b].T)``, the block dot summed exactly and rounded once to
    float32 (its products are multiples of 2^-18 below 2^17.7: float64 holds every partial sum of a block exactly,
    so the order does not matter) and the promotion in float32 -- ``final_accum += scale_a * sb * accum`` of
    ``sm90_fp8_mega_moe.cuh``. The interpreted kernels sum their FP8 dots the same way
    (``megamoe.env.exact_fp8_dots_under_interpreter``: bit for bit); a GPU's tensor cores sum a block in float32 in
    their own order (within the MMA tolerance of ``megamoe.testing``)."""
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32, device=a.device)
    for b in range(a.shape[1] // 128):
        cols = slice(128 * b, 128 * (b + 1))
        block = (a[:, cols].double() @ w[:, cols].double().T).float()
        acc = acc + (sa[:, b, None] * sw[None, :, b]) * block
    return acc


def _fp8_expert_forward(a, sa, weights, w1, sw1, w2, sw2, activation_clamp) -> _ExpertOutput:
    """One expert on ``m`` rows in the SM90 format (FP8 values as float32, per-row block scales ``[n, K/128]``)."""
    from megamoe.quant_fp8 import per_token_cast_to_fp8_128

    l1_out = block_scaled_matmul(a, sa, w1, sw1).to(torch.bfloat16)
    act = swiglu(l1_out, activation_clamp) * weights.unsqueeze(1)
    l2_in, l2_in_sf = per_token_cast_to_fp8_128(act)
    out = block_scaled_matmul(l2_in.float(), l2_in_sf, w2, sw2).to(torch.bfloat16)
    return _ExpertOutput(l1_out, l2_in, l2_in_sf, out)


def reference_fp8_mega_moe(
    x: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1_weights,
    l2_weights,
    *,
    activation_clamp: float | None = None,
    return_intermediates: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, dict]:
    """The SM90 ``fp8_mega_moe`` layer on one rank holding all ``E`` experts.

    As :func:`reference_mega_moe` (steps 1-7 of the module docstring) with the SM90 formats of
    :mod:`megamoe.quant_fp8`: both GEMMs are :func:`block_scaled_matmul` (one float32 promotion per K block of 128,
    activation scale per token x weight scale per 128x128 block), and the L2 input is requantised with
    :func:`megamoe.quant_fp8.per_token_cast_to_fp8_128` (fp32 scale ``amax/448`` per 128 columns).

    Args:
        x: float8_e4m3fn ``[n, H]``; x_sf: float32 ``[n, H/128]`` (one scale per token and 128 columns).
        topk_idx: int64 ``[n, k]`` (-1 = masked); topk_weights: float32 ``[n, k]``.
        l1_weights: ``(float8_e4m3fn [E, 2I, H], float32 [E, 2I/128, H/128])``, rows gate then up, untransformed
            (a :class:`~megamoe.quant_fp8.TransformedWeightsSM90` is rejected: its rows are interleaved).
        l2_weights: ``(float8_e4m3fn [E, H, I], float32 [E, H/128, I/128])``.
        activation_clamp, return_intermediates: as :func:`reference_mega_moe` (``l2_in`` scales are float32
            ``[m_e, I/128]``).
    """
    from megamoe.quant_fp8 import TransformedWeightsSM90, check_moe_weights_fp8

    for name, pair in (("l1_weights", l1_weights), ("l2_weights", l2_weights)):
        if isinstance(pair, TransformedWeightsSM90):
            raise TypeError(f"{name}: the reference takes untransformed weights (rows gate then up); got the output "
                            "of transform_weights_for_mega_moe_sm90 (untransform_weights_for_mega_moe_sm90 inverts it)")
    num_experts, hidden, _ = check_moe_weights_fp8(l1_weights, l2_weights)
    _check_tokens(x, x_sf, topk_idx, topk_weights, hidden=hidden, num_experts=num_experts, sf_dtype=torch.float32)
    _check_clamp(activation_clamp)
    if x.device != l1_weights[0].device:
        raise ValueError(f"x: on {x.device} but the weights are on {l1_weights[0].device}")

    (w1, sf1), (w2, sf2) = l1_weights, l2_weights
    a = x.float()
    return _each_expert_then_combine(
        topk_idx, num_experts, x, return_intermediates,
        lambda e, token, slot: _fp8_expert_forward(
            a[token], x_sf[token], topk_weights[token, slot],
            w1[e].float(), sf1[e].repeat_interleave(128, dim=0),
            w2[e].float(), sf2[e].repeat_interleave(128, dim=0), activation_clamp))


def reference_fp8_mega_moe_ep(
    xs: list[torch.Tensor],
    x_sfs: list[torch.Tensor],
    topk_idxs: list[torch.Tensor],
    topk_weights_list: list[torch.Tensor],
    l1_weights,
    l2_weights,
    num_ranks: int,
    *,
    activation_clamp: float | None = None,
) -> list[torch.Tensor]:
    """:func:`reference_fp8_mega_moe` in expert-parallel form (as :func:`reference_mega_moe_ep`): per-rank ``y``.

    Each expert sees its rows in (source rank, token, slot) order either way, so this is the single-rank reference
    on the concatenated tokens, split back per rank -- bitwise the same rows."""
    from megamoe.quant_fp8 import check_moe_weights_fp8

    num_experts, _, _ = check_moe_weights_fp8(l1_weights, l2_weights)
    _check_ep_lists(xs, x_sfs, topk_idxs, topk_weights_list, num_ranks, num_experts)
    for r in range(num_ranks):
        if topk_idxs[r].dim() != 2 or topk_idxs[r].shape[1] != topk_idxs[0].shape[1]:
            raise ValueError(f"topk_idxs[{r}]: shape {tuple(topk_idxs[r].shape)} differs from rank 0's num_topk")
    y = reference_fp8_mega_moe(torch.cat(list(xs)), torch.cat(list(x_sfs)), torch.cat(list(topk_idxs)),
                               torch.cat(list(topk_weights_list)), l1_weights, l2_weights,
                               activation_clamp=activation_clamp)
    return list(y.split([x.shape[0] for x in xs]))
