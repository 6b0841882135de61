"""The symmetric buffer, byte for byte.

Every rank allocates one buffer of identical size and layout; a kernel turns a local address into the same offset
in another rank's buffer with ``map(ptr, rank) = ptr + (base[rank] - base[me])`` (DeepGEMM's ``SymBuffer``).
This module computes that layout: an ordered list of :class:`Segment` objects (offset, bytes, dtype, shape) for

    workspace | x | x_sf | topk_idx | topk_weights | l1 pool (acts, sf, topk weights) | l2 pool (acts, sf) | combine

following the order of DeepGEMM's ``get_symm_buffer_size_for_mega_moe`` (first release, no ring buffer).

Two formats (:data:`FORMATS`) share this layout. ``"fp8_fp4"`` (``fp8_fp4_mega_moe``) stores activation scales as
packed UE8M0 bytes, one per 32 columns, four per int32; ``"fp8"`` (DeepGEMM SM90's ``fp8_mega_moe``) stores one
float32 per 128 columns. Both take 4 bytes per 128 columns, so offsets, sizes and the pool formula are identical and
only the dtype of ``x_sf``, ``l1_acts_sf`` and ``l2_acts_sf`` differs -- as in DeepGEMM's SM90 build, whose
``slice_input_buffers`` only switches the view dtype (``kInt`` -> ``kFloat32``; its per-64 L2 scale variant, which we
do not use, doubles ``l2_acts_sf``).

Shapes use ``R`` ranks, ``E`` experts, ``El = E / R`` experts per rank, ``T`` = num_max_tokens_per_rank, ``k`` =
num_topk, ``H`` = hidden, ``I`` = intermediate_hidden, ``P`` = :func:`get_num_max_pool_tokens`, ``Pb = P / block_m``
pool blocks and ``SP`` = :func:`get_num_padded_sf_pool_tokens`.

Deviations from DeepGEMM, all in the workspace (documented per segment):

* ``barrier_signal`` i32[R] and ``barrier_state`` i32[4] follow the 32-byte grid-sync area. DeepGEMM's NVLink
  barrier adds +-1 into one shared counter; we store, per source rank, the epoch that rank last signalled. It is
  just as self-resetting (epochs only grow) and lets a timed-out barrier name the rank that never arrived.
* ``progress`` i32[R] (per-rank heartbeats, written remotely like the signals) and ``call_state`` i32[2] (calls
  begun / completed on this rank) are ours too: a wait times out only on a rank that stopped making progress, not
  on a slow one, and a call that never finished is detected by the next one (``megamoe.ops``,
  ``SymmBuffer.reset()``). The whole workspace is zero after ``reset()``; every field is valid at zero.
* ``src_token_topk_idx`` is i32[El][R][T]: one source rank sends at most T (token, slot) pairs to one expert,
  because a token's top-k experts are distinct (checked on the host).

The ring-buffer variant (upstream's later design) would shrink the two pools from ``P`` rows to
``num_ring_tokens`` rows: the pool then holds only the experts of one *wave* in flight, and consumed ring blocks are
recycled through l1/l2 full/empty counters. It helps when a wave holds fewer experts than top-k (at EP8, 8192
tokens/rank, top-6, 48 local experts the worst case is 402,432 rows, the seed's 393,408 being one block short). We
size the whole worst case (no reuse) so that the staged kernels can run every step to completion before the next;
see ``notebooks/03_pool_sizing.ipynb``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

#: Every segment starts on a 128-byte boundary (one L2 cache line / full coalesced warp access).
SEGMENT_ALIGNMENT = 128
#: DeepGEMM's kNumMaxRanks.
MAX_RANKS = 72
#: DeepGEMM asserts topk <= 32.
MAX_TOPK = 32
#: The smallest M tile of the kernels: the pool padding granularity (``block_m``) is a power of two at least this
#: large, and the fused kernel's per-pool-block arrival counters are sized for blocks this small.
MIN_BLOCK_M = 16
#: The number formats a layout can hold, named after their ops: ``"fp8_fp4"`` (``fp8_fp4_mega_moe``: activation
#: scales are packed UE8M0 per 32 columns, four per int32) and ``"fp8"`` (DeepGEMM SM90's ``fp8_mega_moe``: one
#: float32 scale per 128 columns, :mod:`megamoe.quant_fp8`). Both spend 4 bytes per 128 columns of a row, so the two
#: layouts have the same segments, offsets and size; only the scale segments' dtype (and meaning) differ.
FORMATS = ("fp8_fp4", "fp8")
#: Per format: (dtype of the activation scale segments ``x_sf``/``l1_acts_sf``/``l2_acts_sf``, a description).
SCALE_FORMATS = {
    "fp8_fp4": (torch.int32, "per-32 UE8M0 scales, 4 per int32"),
    "fp8": (torch.float32, "per-128 float32 scales (amax/448)"),
}


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def get_num_max_pool_tokens(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int,
                            num_experts_per_rank: int, block_m: int) -> int:
    """Worst-case number of rows in one rank's L1/L2 pool (DeepGEMM ``get_num_max_pool_tokens``).

    Worst case: every token of every rank picks ``min(num_topk, num_experts_per_rank)`` of *this* rank's experts,
    and every local expert wastes ``block_m - 1`` rows of padding. Aligned up to ``block_m``.
    """
    recv = num_ranks * num_max_tokens_per_rank * min(num_topk, num_experts_per_rank)
    return _align(recv + num_experts_per_rank * (block_m - 1), block_m)


def get_num_padded_sf_pool_tokens(num_max_pool_tokens: int, block_m: int) -> int:
    """Rows of the MN-major pool scale-factor arrays: each pool block's SF rows are padded to a multiple of 128
    (the UTCCP granularity on SM100; kept on Hopper for layout parity)."""
    return (num_max_pool_tokens // block_m) * _align(block_m, 128)


@dataclass(frozen=True)
class Segment:
    """One named region of the symmetric buffer.

    ``shape`` is the logical shape of the typed view; ``mn_major`` marks scale-factor arrays stored transposed
    (``[cols][rows]`` in memory, exposed as a ``[rows, cols]`` view with strides ``(1, rows)``).
    """

    name: str
    region: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    doc: str
    mn_major: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


_ELEM = {torch.uint8: 1, torch.int8: 1, torch.float8_e4m3fn: 1, torch.int32: 4, torch.float32: 4,
         torch.int64: 8, torch.bfloat16: 2}


class Layout:
    """Byte layout of one rank's Mega MoE symmetric buffer (identical on every rank).

    Args:
        num_ranks: expert-parallel world size R (1..72).
        num_experts: global number of experts E (divisible by R).
        num_max_tokens_per_rank: T, the most tokens any rank passes in one call.
        num_topk: k, experts per token (1..32).
        hidden: H, multiple of 128.
        intermediate_hidden: I, multiple of 128.
        block_m: pool padding granularity per expert (the GEMM's BLOCK_M).
        format: one of :data:`FORMATS` (``"fp8_fp4"``, the default, or ``"fp8"``): the dtype of the activation
            scale segments (:data:`SCALE_FORMATS`). The pool formula and every offset are the same for both.
    """

    def __init__(self, num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, num_topk: int,
                 hidden: int, intermediate_hidden: int, block_m: int = 128, format: str = "fp8_fp4"):
        _check_int("num_ranks", num_ranks, 1, MAX_RANKS)
        _check_int("num_experts", num_experts, 1)
        _check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, 1)
        _check_int("num_topk", num_topk, 1, MAX_TOPK)
        _check_int("hidden", hidden, 128)
        _check_int("intermediate_hidden", intermediate_hidden, 128)
        _check_int("block_m", block_m, 1)
        if format not in FORMATS:
            raise ValueError(f"format={format!r} must be one of {FORMATS}")
        if num_experts % num_ranks:
            raise ValueError(f"num_experts={num_experts} must be divisible by num_ranks={num_ranks}")
        if num_topk > num_experts:
            raise ValueError(f"num_topk={num_topk} exceeds num_experts={num_experts}")
        for name, v in (("hidden", hidden), ("intermediate_hidden", intermediate_hidden)):
            if v % 128:
                raise ValueError(f"{name}={v} must be a multiple of 128 (4 packed UE8M0 scales per int32)")

        self.num_ranks = num_ranks
        self.num_experts = num_experts
        self.num_experts_per_rank = num_experts // num_ranks
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_topk = num_topk
        self.hidden = hidden
        self.intermediate_hidden = intermediate_hidden
        self.block_m = block_m
        self.format = format
        self.num_max_pool_tokens = get_num_max_pool_tokens(num_ranks, num_max_tokens_per_rank, num_topk,
                                                           self.num_experts_per_rank, block_m)
        self.num_max_pool_blocks = self.num_max_pool_tokens // block_m
        self.num_padded_sf_pool_tokens = get_num_padded_sf_pool_tokens(self.num_max_pool_tokens, block_m)
        self.sf_block_m = _align(block_m, 128)
        self.segments: dict[str, Segment] = {}
        self._build()

    # ------------------------------------------------------------------ construction
    def _add(self, name: str, region: str, dtype: torch.dtype, shape: tuple[int, ...], doc: str,
             mn_major: bool = False) -> None:
        offset = _align(self._cursor, SEGMENT_ALIGNMENT)
        nbytes = _ELEM[dtype]
        for s in shape:
            nbytes *= s
        self.segments[name] = Segment(name, region, offset, nbytes, dtype, tuple(shape), doc, mn_major)
        self._cursor = offset + nbytes

    def _build(self) -> None:
        R, E, El = self.num_ranks, self.num_experts, self.num_experts_per_rank
        T, k = self.num_max_tokens_per_rank, self.num_topk
        H, I, P, SP = self.hidden, self.intermediate_hidden, self.num_max_pool_tokens, self.num_padded_sf_pool_tokens
        self._cursor = 0
        ws = "workspace"
        self._add("grid_sync", ws, torch.int32, (8,),
                  "32 B grid-sync area of the persistent kernel (4 counters + NVLink barrier words in DeepGEMM); ours: "
                  "[grid-sync counter, fused-kernel heartbeat, fused task counter, program 0 in a cross-rank barrier, "
                  "spare x4]; zero in the staged pipeline")
        self._add("barrier_signal", ws, torch.int32, (R,),
                  "slot r = last barrier epoch rank r signalled to this rank (written remotely, release/sys)")
        self._add("barrier_state", ws, torch.int32, (4,),
                  "[epoch of this rank's last barrier, failed barrier tag, rank that never arrived, spare]")
        self._add("progress", ws, torch.int32, (R,),
                  "slot r = rank r's heartbeat: bumped by rank r while it makes progress in a call and written "
                  "into slot r of every rank (as the signals); a barrier wait only times out on a rank whose "
                  "heartbeat stood still for the whole timeout")
        self._add("call_state", ws, torch.int32, (2,),
                  "[calls begun, calls completed] on this rank; they differ while a call runs, or after a call "
                  "that never finished (interrupted or crashed): the next call then refuses to run until "
                  "SymmBuffer.reset()")
        self._add("expert_send_count", ws, torch.int64, (E,),
                  "per global expert: (token, slot) pairs this rank sends; atomics hand out the slot index")
        self._add("expert_recv_count", ws, torch.int64, (R, El),
                  "[src rank][local expert]: pairs each source rank sends to each local expert (written remotely)")
        self._add("expert_recv_count_sum", ws, torch.int64, (El,),
                  "per local expert: sum over source ranks (remote atomic adds); feeds the recv stats")
        Pf = P // MIN_BLOCK_M  # the fused kernel may pick any block of MIN_BLOCK_M..block_m rows
        self._add("l1_arrival_count", ws, torch.int32, (Pf,),
                  "per pool block of the fused kernel: rows landed by the pull (L1 waits on it; unused when staged)")
        self._add("l2_arrival_mask", ws, torch.int64, (Pf,),
                  "per pool block of the fused kernel: bit n = L1 N-block n (128 columns) done (L2 K-block n "
                  "waits on it; unused when staged)")
        self._add("src_token_topk_idx", ws, torch.int32, (El, R, T),
                  "[local expert][src rank][i]: token*k + slot of the i-th pair that rank sends (written remotely)")
        self._add("token_src_metadata", ws, torch.int32, (P, 3),
                  "per pool row: (src rank, src token, top-k slot), used by the L2 epilogue to address combine")
        sf_dtype, sf_doc = SCALE_FORMATS[self.format]
        inp = "input"
        self._add("x", inp, torch.float8_e4m3fn, (T, H), "input tokens, FP8 e4m3")
        self._add("x_sf", inp, sf_dtype, (T, H // 128), f"{sf_doc} of x, K-major")
        self._add("topk_idx", inp, torch.int64, (T, k), "expert of each (token, slot); -1 = masked")
        self._add("topk_weights", inp, torch.float32, (T, k), "router weight of each (token, slot)")
        pool = "pool"
        self._add("l1_acts", pool, torch.float8_e4m3fn, (P, H),
                  "L1 pool: pulled tokens, expert-major, each expert padded to block_m")
        self._add("l1_acts_sf", pool, sf_dtype, (SP, H // 128),
                  f"L1 pool scales ({sf_doc}), MN-major: pool block b's rows start at b*align(block_m,128)",
                  mn_major=True)
        self._add("l1_topk_weights", pool, torch.float32, (P,), "router weight of each pool row")
        self._add("l2_acts", pool, torch.float8_e4m3fn, (P, I), "L2 pool: SwiGLU(L1)*weight, requantized FP8")
        self._add("l2_acts_sf", pool, sf_dtype, (SP, I // 128), f"L2 pool scales ({sf_doc}), MN-major like "
                  "l1_acts_sf", mn_major=True)
        self._add("combine", "combine", torch.bfloat16, (k, T, H),
                  "[slot][token]: BF16 expert outputs written by the owning rank straight into the source rank")
        self.num_bytes = _align(self._cursor, SEGMENT_ALIGNMENT)
        self.workspace_bytes = max(s.end for s in self.segments.values() if s.region == ws)
        del self._cursor

    # ------------------------------------------------------------------ access
    def __iter__(self) -> Iterator[Segment]:
        return iter(self.segments.values())

    def __getitem__(self, name: str) -> Segment:
        return self.segments[name]

    def offset(self, name: str) -> int:
        """Byte offset of segment ``name`` from the start of the buffer."""
        return self.segments[name].offset

    def sf_row(self, pool_row):
        """Row of the pool's scale segments (``l1_acts_sf``, ``l2_acts_sf``) holding the scales of pool row
        ``pool_row`` (an int or an integer tensor): pool block ``b`` of ``block_m`` rows owns scale rows
        ``[b * sf_block_m, b * sf_block_m + block_m)``, ``sf_block_m`` being ``block_m`` aligned up to 128 (the
        scale rows of a block are padded for TMA, as in DeepGEMM)."""
        return (pool_row // self.block_m) * self.sf_block_m + pool_row % self.block_m

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """Typed view of segment ``name`` inside ``buffer`` (a 1-D uint8/int8 tensor of ``num_bytes``)."""
        if buffer.dim() != 1 or buffer.element_size() != 1 or buffer.numel() < self.num_bytes:
            raise ValueError(f"buffer must be a 1-D byte tensor of at least {self.num_bytes} bytes, "
                             f"got {tuple(buffer.shape)} {buffer.dtype}")
        seg = self.segments[name]
        raw = buffer[seg.offset:seg.end].view(torch.uint8).view(seg.dtype)
        if seg.mn_major:
            rows, cols = seg.shape
            return raw.view(cols, rows).t()
        return raw.view(seg.shape)

    def region_bytes(self) -> dict[str, int]:
        """Bytes per region (workspace, input, pool, combine), padding included in the region it follows."""
        out: dict[str, int] = {}
        segs = list(self.segments.values())
        for i, s in enumerate(segs):
            end = segs[i + 1].offset if i + 1 < len(segs) else self.num_bytes
            out[s.region] = out.get(s.region, 0) + end - s.offset
        return out

    def table(self) -> str:
        """A printable table of every segment: offset, bytes, dtype, shape."""
        lines = [f"Layout R={self.num_ranks} E={self.num_experts} T={self.num_max_tokens_per_rank} k={self.num_topk} "
                 f"H={self.hidden} I={self.intermediate_hidden} block_m={self.block_m} format={self.format}: "
                 f"pool {self.num_max_pool_tokens:,} rows, sf pool {self.num_padded_sf_pool_tokens:,} rows",
                 f"{'segment':<22}{'region':<11}{'offset':>16}{'bytes':>16}  {'dtype':<15}shape"]
        for s in self:
            shape = "x".join(str(d) for d in s.shape) + (" (MN-major)" if s.mn_major else "")
            dtype = str(s.dtype).replace('torch.', '')
            lines.append(f"{s.name:<22}{s.region:<11}{s.offset:>16,}{s.nbytes:>16,}  {dtype:<15}{shape}")
        lines.append(f"{'total':<33}{self.num_bytes:>16,} bytes = {self.num_bytes / 2**30:.3f} GiB")
        return "\n".join(lines)

    def print_table(self) -> None:
        print(self.table())

    #: The constructor arguments that define a layout (every rank of a group must agree on them).
    FINGERPRINT_FIELDS = ("num_ranks", "num_experts", "num_max_tokens_per_rank", "num_topk", "hidden",
                          "intermediate_hidden", "block_m", "format")

    def fingerprint(self) -> dict:
        """The defining fields (:data:`FINGERPRINT_FIELDS`) plus ``num_bytes``: equal fingerprints mean equal
        layouts. Ranks exchange it before they allocate (``SymmBuffer``), so that a disagreement names the field."""
        return {name: getattr(self, name) for name in self.FINGERPRINT_FIELDS} | {"num_bytes": self.num_bytes}

    def __repr__(self) -> str:
        return (f"Layout(num_ranks={self.num_ranks}, num_experts={self.num_experts}, "
                f"num_max_tokens_per_rank={self.num_max_tokens_per_rank}, num_topk={self.num_topk}, "
                f"hidden={self.hidden}, intermediate_hidden={self.intermediate_hidden}, block_m={self.block_m}, "
                f"format={self.format!r}) "
                f"-> {self.num_bytes:,} bytes")


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}={value} must be {rng}")
