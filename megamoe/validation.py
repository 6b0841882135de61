"""What a bad call is told, for both ops (``fp8_fp4_mega_moe`` and ``fp8_mega_moe``): the argument and input checks
that run before any kernel, and the :class:`WeightFormat` each op declares.

The two ops share everything but the number format of the weights and of the activation scales, so the checks are
written once against a :class:`WeightFormat` (:data:`FP8_FP4` and :data:`FP8`, defined here, the one place that
knows both): which tagged pair the weights must be, their dtypes, shapes and memory layout, and what an invalid
activation scale looks like. Every message names the argument (``y[1]``, ``l1_weights``, ``sym_buffer[0].x_sf``).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

import torch

from megamoe.quant import TaggedWeights, TransformedWeights
from megamoe.quant_fp8 import FP8_BLOCK, TransformedWeightsSM90
from megamoe.symm import SymmBuffer

#: FP8 e4m3fn NaN: exponent and mantissa bits all set (0x7F / 0xFF); UE8M0 NaN: the byte 0xFF.
FP8_E4M3FN_NAN_BITS = 0x7F
UE8M0_NAN = 0xFF


class WorkspaceStateError(RuntimeError):
    """A call refused to run because an earlier call on this buffer did not complete (interrupted, raised, timed
    out at a barrier, or its process died): the workspace counters and barrier epochs may disagree across ranks.
    The fix is the collective :meth:`megamoe.symm.SymmBuffer.reset` on every rank."""


@dataclass(frozen=True)
class WeightFormat:
    """One op's number format, as its checks need it.

    ``weights``: the tagged pair class the op takes (``role`` ``"l1"`` / ``"l2"``); ``weight_dtype`` /
    ``k_per_element`` give ``w [El, n_rows, k / k_per_element]``; ``scale_shape(n_rows, k)`` the per-expert shape of
    ``sf``; ``scales_laid_out(sf)`` whether ``sf`` still has the transform's memory layout. ``bad_x_sf(x_sf)``:
    bool mask of invalid activation scales (``x_sf`` as the buffer holds it), ``x_sf_error(t, b, x_sf)`` the message
    for entry ``[t, b]``."""

    name: str
    op: str
    describes: str
    weights: type
    transform: str
    why_transformed: str
    weight_dtype: torch.dtype
    k_per_element: int
    scale_dtype: torch.dtype
    scale_shape: Callable[[int, int], tuple]
    scales_laid_out: Callable[[torch.Tensor], bool]
    layout_error: str
    bad_x_sf: Callable[[torch.Tensor], torch.Tensor]
    x_sf_error: Callable[[int, int, torch.Tensor], str]


def _mn_major(sf: torch.Tensor) -> bool:
    """Whether scales ``sf [El, N, KW]`` are stored MN-major, ``[El][KW][N]`` (``sf.transpose(1, 2).is_contiguous()``,
    read from the strides: no view made on every call; ``check_weights`` checked the shape first)."""
    (e, n, kw), (s0, s1, s2) = sf.shape, sf.stride()
    return (e * n * kw == 0 or ((n == 1 or s1 == 1) and (kw == 1 or s2 == n) and (e == 1 or s0 == n * kw)))


FP8_FP4 = WeightFormat(
    name="fp8_fp4", op="fp8_fp4_mega_moe",
    describes="FP4 weights of the fp8_fp4 format (transform_weights_for_mega_moe)",
    weights=TransformedWeights, transform="megamoe.transform_weights_for_mega_moe",
    why_transformed=("the kernels read a re-laid-out form and would compute garbage from untransformed weights. "
                     "Pass {arg} of `l1, l2 = transform_weights_for_mega_moe(l1_fp4, l2_fp4)` (MegaMoE does this "
                     "itself)"),
    weight_dtype=torch.int8, k_per_element=2, scale_dtype=torch.int32,
    scale_shape=lambda n_rows, k: (n_rows, k // 128),
    scales_laid_out=lambda sf: _mn_major(sf),
    layout_error=("must come from transform_weights_for_mega_moe (contiguous weights, MN-major scales); it was re-laid "
                  "out since"),
    bad_x_sf=lambda x_sf: x_sf.view(torch.uint8) == UE8M0_NAN,  # packed words: one UE8M0 byte per 32
    x_sf_error=lambda t, b, x_sf: (f"holds a NaN UE8M0 scale (byte 0xFF) at token {t}, scale group {b} (of H/32); "
                                   "per_token_cast_to_fp8 never produces one"),
)

FP8 = WeightFormat(
    name="fp8", op="fp8_mega_moe",
    describes="FP8 weights with 128x128 float32 block scales (transform_weights_for_mega_moe_sm90)",
    weights=TransformedWeightsSM90, transform="megamoe.quant_fp8.transform_weights_for_mega_moe_sm90",
    why_transformed=("its L1 rows must be interleaved and untransformed weights look the same. Pass {arg} of "
                     "`l1, l2 = transform_weights_for_mega_moe_sm90(l1_fp8, l2_fp8)`"),
    weight_dtype=torch.float8_e4m3fn, k_per_element=1, scale_dtype=torch.float32,
    scale_shape=lambda n_rows, k: (n_rows // FP8_BLOCK, k // FP8_BLOCK),
    scales_laid_out=lambda sf: sf.is_contiguous(),
    layout_error="must be contiguous (weights and block scales), as transform_weights_for_mega_moe_sm90 returns them",
    bad_x_sf=lambda x_sf: ~(torch.isfinite(x_sf) & (x_sf > 0)),
    x_sf_error=lambda t, b, x_sf: (f"holds the scale {float(x_sf[t, b])} at token {t}, column block {b}; float32 "
                                   "scales must be finite and > 0 (per_token_cast_to_fp8_128 gives amax/448 >= "
                                   "1e-4/448)"),
)

#: Every format, by ``Layout.format`` name.
FORMATS = {f.name: f for f in (FP8_FP4, FP8)}


# ---------------------------------------------------------------------------------------------------- arguments
def as_list(value, name: str, count: int, is_list: bool) -> list:
    """``[value]``, or with a list of buffers ``value`` itself, which must be a list of ``count`` entries."""
    if not is_list:
        return [value]
    if not isinstance(value, (list, tuple)) or isinstance(value, TaggedWeights) or len(value) != count:
        raise TypeError(f"{name} must be a list of {count} entries (one per local rank) with a list of sym_buffers")
    return list(value)


def check_buffers(sym_buffer, fmt: WeightFormat) -> tuple[list[SymmBuffer], bool]:
    """The buffers of a call (one, or a whole local group in rank order) and whether they came as a list; each
    must be live, healthy and made for ``fmt``."""
    is_list = isinstance(sym_buffer, (list, tuple))
    buffers = list(sym_buffer) if is_list else [sym_buffer]
    if not buffers or not all(isinstance(b, SymmBuffer) for b in buffers):
        got = type(sym_buffer).__name__ if not is_list else f"a list of {[type(b).__name__ for b in buffers]}"
        raise TypeError(f"sym_buffer must be a SymmBuffer (or, for the local backend, a list of them), got {got}")
    for i, b in enumerate(buffers):
        if b._views is None:
            raise RuntimeError(f"sym_buffer{f'[{i}]' if is_list else ''} (rank {b.rank}) was destroyed "
                               "(SymmBuffer.destroy()); allocate a new one")
    if is_list:
        ranks = [b.rank for b in buffers]
        if ranks != list(range(buffers[0].num_ranks)) or any(b.backend != "local" for b in buffers):
            raise ValueError(f"a list of sym_buffers must hold every rank of one local group in order, got ranks "
                             f"{ranks} of world size {buffers[0].num_ranks}"
                             + ("" if all(b.backend == "local" for b in buffers) else
                                f" and backends {[b.backend for b in buffers]} (only 'local' buffers come in lists)"))
        group = [p.data_ptr() for p in buffers[0]._peers]
        for i, b in enumerate(buffers):
            if [p.data_ptr() for p in b._peers] != group or b.layout.num_bytes != buffers[0].layout.num_bytes:
                raise ValueError(f"sym_buffer[{i}] belongs to a different SymmBuffer.local group than sym_buffer[0]: "
                                 "pass the buffers of one SymmBuffer.local(...) call (mixing groups would leave "
                                 "barriers waiting on ranks that never arrive)")
    for i, b in enumerate(buffers):
        if b.fault is not None:
            raise state_error(b, f"sym_buffer{f'[{i}]' if is_list else ''}", b.fault)
    for i, b in enumerate(buffers):
        if b.layout.format != fmt.name:
            other = FORMATS.get(b.layout.format)
            raise ValueError(f"sym_buffer{f'[{i}]' if is_list else ''} was made for format {b.layout.format!r}"
                             f"{f' ({other.op})' if other else ''}; {fmt.op} needs "
                             f"SymmBuffer(..., format={fmt.name!r})")
    return buffers, is_list


def state_error(sb: SymmBuffer, name: str, reason: str) -> WorkspaceStateError:
    fix = ("call reset() on every SymmBuffer of the local group" if sb.backend == "local" else
           "call sym_buffer.reset() on every rank of the group (collective)")
    return WorkspaceStateError(f"{name} (rank {sb.rank}) cannot run a call: {reason}. Its workspace counters and "
                               f"barrier epochs may disagree with the other ranks', so this call would compute "
                               f"garbage or time out. To recover, {fix}, then call again.")


def check_clamp(clamp) -> None:
    if clamp is None:
        return
    if isinstance(clamp, bool) or not isinstance(clamp, numbers.Real):
        raise TypeError(f"activation_clamp must be a number > 0 or None, got {type(clamp).__name__} {clamp!r}")
    if not (math.isfinite(float(clamp)) and float(clamp) > 0):
        raise ValueError(f"activation_clamp={clamp} must be a finite number > 0 (or None)")


def check_options(activation, dispatch, check) -> None:
    if activation != "swiglu":
        raise ValueError(f"activation={activation!r}: only 'swiglu' is supported")
    if dispatch not in ("pull", "push"):
        raise ValueError(f"dispatch={dispatch!r} must be 'pull' or 'push'")
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")


def check_tensor(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor (shape only, no data); pass a real tensor")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def check_weights(name: str, pair, role: str, fmt: WeightFormat, n_rows: int, k: int, sb: SymmBuffer) -> None:
    """``pair`` must be the ``role`` weights of this rank's experts in ``fmt``: ``n_rows`` output rows, ``k``
    reduction length."""
    L, dev = sb.layout, sb.buffer.device
    El = L.num_experts_per_rank
    if not isinstance(pair, fmt.weights):
        other = next((f for f in FORMATS.values() if isinstance(pair, f.weights)), None)
        if other is not None:
            raise TypeError(f"{name} holds {other.describes}; {fmt.op} takes {fmt.describes}")
        if isinstance(pair, (tuple, list)):
            raise TypeError(f"{name} is a plain {type(pair).__name__}, not the output of {fmt.transform}: "
                            + fmt.why_transformed.format(arg=name[:2]))
        raise TypeError(f"{name} must be the {fmt.weights.__name__} (w, sf) returned by "
                        f"{fmt.transform.rsplit('.', 1)[-1]}, got {type(pair).__name__}")
    if pair.role != role:
        raise ValueError(f"{name} holds {pair.role} weights (role {pair.role!r}); l1_weights and l2_weights swapped?")
    w, sf = pair
    if isinstance(w, torch.Tensor) and w.dim() == 3 and w.shape[0] != El:
        raise ValueError(f"{name} holds {w.shape[0]} experts but the buffer has {El} experts per rank "
                         f"(num_experts={L.num_experts} over {L.num_ranks} ranks): mismatched world size?")
    check_tensor(f"{name}[0]", w, fmt.weight_dtype, (El, n_rows, k // fmt.k_per_element), dev)
    check_tensor(f"{name}[1]", sf, fmt.scale_dtype, (El, *fmt.scale_shape(n_rows, k)), dev)
    if not (w.is_contiguous() and fmt.scales_laid_out(sf)):
        raise ValueError(f"{name} {fmt.layout_error}")


def check_call(c, fmt: WeightFormat, gemm_config: dict, config_name: str, block_n_multiple: int = 1) -> None:
    """One rank's bound call (``megamoe.ops._RankCall``): ``y``, both weight pairs, the stats, and the GEMM steps'
    ``BLOCK_N`` against the shapes (``config_name`` names ``gemm_config`` in the message)."""
    L, dev = c.sb.layout, c.sb.buffer.device
    El, H, I, T = L.num_experts_per_rank, L.hidden, L.intermediate_hidden, L.num_max_tokens_per_rank
    y = f"y{c.index}"
    if not isinstance(c.y, torch.Tensor):
        raise TypeError(f"{y} must be a bf16 torch.Tensor [num_tokens, {H}], got {type(c.y).__name__}")
    if c.y.dim() != 2:
        raise ValueError(f"{y} must be a 2-D bf16 tensor [num_tokens, {H}], got shape {tuple(c.y.shape)}")
    if c.y.shape[0] > T:
        raise ValueError(f"{y} has {c.y.shape[0]} tokens, more than num_max_tokens_per_rank={T} of the buffer")
    check_tensor(y, c.y, torch.bfloat16, (c.y.shape[0], H), dev)
    if not c.y.is_contiguous():
        raise ValueError(f"{y} must be contiguous (the kernel writes rows of {H} at a stride of {H}); got strides "
                         f"{c.y.stride()}")
    check_weights(f"l1_weights{c.index}", c.l1, "l1", fmt, 2 * I, H, c.sb)
    check_weights(f"l2_weights{c.index}", c.l2, "l2", fmt, H, I, c.sb)
    if c.stats is not None:
        name = f"cumulative_local_expert_recv_stats{c.index}"
        check_tensor(name, c.stats, torch.int32, (El,), dev)
        if not c.stats.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel adds into {El} consecutive int32), got stride "
                             f"{c.stats.stride()}")
    for step, extent in (("l1", I), ("l2", H)):
        block_n = gemm_config[step]["BLOCK_N"]
        if extent % block_n or block_n % block_n_multiple:
            need = f" and be a multiple of {block_n_multiple}" if block_n_multiple > 1 else ""
            raise ValueError(f"{config_name}[{step!r}]['BLOCK_N']={block_n} does not divide the {step} N extent "
                             f"{extent} ({'intermediate_hidden' if step == 'l1' else 'hidden'}){need}")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) bytes a contiguous ``t`` covers."""
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def check_no_aliasing(calls) -> None:
    """Outputs must not overlap each other (two local ranks sharing y or stats) nor any symmetric buffer."""
    spans = []
    for c in calls:
        spans.append((f"y{c.index}", _byte_range(c.y)))
        if c.stats is not None:
            spans.append((f"cumulative_local_expert_recv_stats{c.index}", _byte_range(c.stats)))
    for c in calls:
        for i, p in enumerate(c.sb._peers):
            spans.append((f"the symmetric buffer of rank {i}", _byte_range(p)))
    for i, (name_a, (a0, a1)) in enumerate(spans):
        for name_b, (b0, b1) in spans[i + 1:]:
            if name_a.startswith("the symmetric") and name_b.startswith("the symmetric"):
                continue
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{name_a} and {name_b} share memory; every output must have its own storage")


# ---------------------------------------------------------------------------------------------------- the inputs
def check_inputs(c, fmt: WeightFormat) -> None:
    """``check=True``: the inputs in ``sym_buffer`` (first n rows) and the workspace marks, in one host sync."""
    L, sb, n = c.sb.layout, c.sb, c.n
    E = L.num_experts
    name = f"sym_buffer{c.index}"
    idx, w, x_sf = sb.topk_idx[:n], sb.topk_weights[:n], sb.x_sf[:n]
    x_bytes = sb.x[:n].view(torch.uint8)
    call_state, barrier_state = sb.view("call_state"), sb.view("barrier_state")
    s = idx.sort(dim=1).values
    dup_rows = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(dim=1)
    bad_w = ~torch.isfinite(w) & (idx >= 0)
    bad_sf = fmt.bad_x_sf(x_sf)
    nan_x = (x_bytes & FP8_E4M3FN_NAN_BITS) == FP8_E4M3FN_NAN_BITS
    flags = torch.stack([((idx < -1) | (idx >= E)).any(), dup_rows.any(), bad_w.any(), bad_sf.any(), nan_x.any(),
                         call_state[0] != call_state[1], barrier_state[1] != 0]).tolist()
    if not any(flags):
        return
    bad_range, dup, any_bad_w, any_bad_sf, any_nan_x, unfinished, failed = flags
    if unfinished:
        begun, done = call_state.tolist()
        raise state_error(sb, name, f"its workspace records {begun} calls begun but {done} completed: a call "
                          "never finished (its process was interrupted or died before this host object knew)")
    if failed:
        _, tag, missing, _ = barrier_state.tolist()
        raise state_error(sb, name, f"barrier tag {tag} timed out in an earlier call (rank {missing} never arrived)")
    if bad_range:
        lo, hi = int(idx.min()), int(idx.max())
        raise ValueError(f"topk_idx ({name}.topk_idx[:{n}]) holds expert ids in [{lo}, {hi}]; valid are "
                         f"-1 (masked) and 0..{E - 1}")
    if dup:
        t = int(dup_rows.nonzero()[0])
        raise ValueError(f"topk_idx ({name}.topk_idx[:{n}]) has a token ({t}: {idx[t].tolist()}) that selects the "
                         "same expert twice; a token's top-k experts must be distinct")
    if any_bad_w:
        t, j = (int(v) for v in bad_w.nonzero()[0])
        raise ValueError(f"topk_weights ({name}.topk_weights[:{n}]) holds a non-finite weight ({float(w[t, j])}) at "
                         f"token {t}, slot {j} (expert {int(idx[t, j])}); router weights must be finite")
    if any_bad_sf:
        t, b = (int(v) for v in bad_sf.nonzero()[0])
        raise ValueError(f"x_sf ({name}.x_sf[:{n}]) {fmt.x_sf_error(t, b, x_sf)}")
    if any_nan_x:
        t, h = (int(v) for v in nan_x.nonzero()[0])
        raise ValueError(f"x ({name}.x[:{n}]) holds an FP8 NaN (byte 0x{int(x_bytes[t, h]):02X}) at token {t}, "
                         f"column {h}; the activations must be finite")
