"""Host side of the fused kernel (``megamoe.kernels.fused``): its configuration, computed from the shapes of each
call, its argument table, the launch and the optional intra-kernel timeline.

``fp8_fp4_mega_moe(..., impl="fused")`` lands here after the same validation as the staged path. One call is
**one launch**: with the ``local`` backend the grid holds every local rank's programs (``programs_per_rank``
each), so 4 local ranks on one GPU still exercise the cross-rank protocol in-kernel. The exception is the SM90 FP8
format's ``"fp8_ws"`` tile kind (see ``FP8_WS_MIN_EXPECTED``): front launch, one warp-specialised Gluon GEMM launch
per local rank, back launch (``_run_ws``); and, for the FP8 x FP4 format with "hopper" numerics, its sibling
``"fp4_ws"`` (``megamoe.kernels.gemm_fp4_ws``; ``FP4_WS_ENABLED`` switches it off).

Configuration (as ``triton_kernels``' ``matmul_ogs``: derived from the call, no global table):

* ``block_m`` (tokens per pool block) from the expected tokens per local expert ``n * R * k / E`` (DeepGEMM's
  key): "hopper" (tokens = the MMA's N) the smallest power of two >= it in [16, MAX_BLOCK_M]; "exact" (tokens = the
  MMA's M, where wgmma needs 64 rows) 64 (measured fastest, see ``PROGRAMS_PER_SM``); the SM90 FP8 format
  (``fp8_mega_moe``) its swap-AB tile ``"fp8_swap"`` (tokens on the MMA's N) at <= ``FP8_SWAP_MAX_EXPECTED``
  expected tokens, with block ``FP8_SWAP_BLOCK_M``, else its staged tile ``"fp8"`` with 64 / 128. Never
  above ``layout.block_m``: the pool is sized for it (the largest block it may pick), so every choice fits.
* programs per rank: ``PROGRAMS_PER_SM[kind]`` per SM with its register cap (GPU; divided among local
  ranks), 1 under the interpreter (its programs run one after another, so a grid sync between programs could never
  complete).
* ``numerics``: ``"exact"`` runs the staged kernels' GEMM tiles (``megamoe.kernels.gemm.l1_tile`` / ``l2_tile``)
  inside the persistent launch; ``"hopper"`` its swap-AB tiles with folded scales (``megamoe.kernels.fused``),
  ``"hopper_l2_per_block"`` the same tiles with the L2 input's per-128 token scales applied per K block instead of
  folded (constexpr ``L2_FOLDED`` off here and in both Gluon FP8 x FP4 phases; ``megamoe.reference.l2_folded``).
* ``promote_every`` ("hopper"): K-steps of 128 per MMA chain before the chain is added into the fp32 accumulator.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
import triton

from megamoe import direct_launch, multicast
from megamoe.env import compute_capability, interpreting, sm_count
from megamoe.kernels import fused as kf
from megamoe.kernels.formats import TILE_PAIR_WORDS, WS_TILE_M, WS_TILE_N
from megamoe.layout import MIN_BLOCK_M
from megamoe.ops import largest_pow2_tile
from megamoe.quant import FP4_BLOCK_BYTES, fold_lut
from megamoe.quant_fp8 import FP8_BLOCK
from megamoe.reference import HOPPER_NUMERICS, l2_folded

#: Intra-kernel timeline events, as recorded per program: ``(kind, start ns, end ns)``, kind indexing this tuple.
TIMELINE_KINDS = kf.EVENT_NAMES
#: Events kept per program when a timeline is requested.
TIMELINE_MAX_EVENTS = 512
#: Resident 4-warp programs per SM and the register cap that lets them all fit (every program must be resident:
#: they meet in grid syncs), by tile kind. Measured on an H200 (``results/fused_tune_h200.json``, and at 6423414 a
#: sweep of 2/3/4 programs at T = 8 / 128 / 512): "exact" 3 programs capped at 168 registers beat 2 uncapped by
#: 3-4% (1457 / 2290 / 3548 us against 1512 / 2359 / 3701; 4 at 128 registers spill in its per-32 tiles and lose
#: 60%); "hopper" 4 programs at 128 registers beat 2 uncapped by 9-13% (1066 / 2247 / 5157 against 1174 / 2596 /
#: 5726). One 8-warp program of block 64 / 128 per SM was 3-35% slower than two 4-warp programs (01b60b0).
#: "fp8_swap": two uncapped 4-warp 3-stage programs, from an offline sm_90a compile (Triton 3.6, V4-Pro shapes; on an
#: H200, ``results/layer_fp8_h200.json`` at 561162e, T = 8 / 32 / 128 ran 523 / 826 / 1025 us against 642 / 1002 /
#: 1026 us with the "fp8" tile at 08be005; other configurations not swept): 254 / 255 registers at block 16 / 32
#: with no spill and 104448 / 110592 B of shared memory, so both
#: registers and shared memory hold exactly two. (Two stages with a 168-register cap would hold three at block 16 --
#: 69632 B, 24 B of stack -- but spill 376 B at block 32; one 8-warp 3-stage program: 229 registers, 104448 B.)
#: "fp8_ws": the front and back launches around the Gluon GEMM phase (no GEMM tile compiled in; see FP8_WS_*):
#: offline sm_90a compile, front 211 registers at 8 warps (one program an SM; at 4 warps it spills 968 B), back 40.
#: "fp4_ws": its front launch (PHASE=1 with the folding row copy) and back launch, one 8-warp program an SM as
#: "fp8_ws": offline sm_90a compile (``results/probes/fused_front_compile.py``, EP8 rank of V4-Pro) front 255
#: registers, no local memory, 2048 B shared; back 32 registers. (The same probe gives the "fp8_ws" front 255
#: registers too, not the 211 above: its setup differs from the one behind that number in some way not found.)
PROGRAMS_PER_SM = {"exact": (3, 168), "hopper": (4, 128), "fp8": (1, None), "fp8_swap": (2, None),
                   "fp8_ws": (1, None), "fp4_ws": (1, None)}
#: Programs per SM of the Gluon kinds' back launch (barrier 2, the combine reduce, cleanup; 32-40 registers at 8
#: warps and little shared memory, so several fit -- ``_check_resident`` checks it). The combine is a memory-bound
#: sweep over the top-k rows of every token (T = 8192: ~700 MB of bf16 read, 357 us at one program an SM on an
#: H200, where the bytes at 3.5 TB/s take ~230; ``results/probes/fused_fp8_wall_gap_probe_h200.jsonl``). Measured
#: at 1 / 2 / 4 (``results/probes/ws_variants_probe_h200.jsonl``, whole call, same output bits): FP8 T = 2048 2635 /
#: 2619 / 2613 us, T = 8192 8285 / 8260 / 8266; FP8 x FP4 T = 8192 15552 / 15510 / 15471 -- under 1 % then (session
#: 11). Session 22, the back launch alone (``fused_fp8_ws_profile.py``, FP8 T = 8192, torch profiler, rows in
#: ``results/probes/fused_fp8_ws_profile_h200.jsonl`` at 6da294e): 351 / 353 us at one program an SM, 204 / 203 at
#: four, whole span 6188 / 6156 against 6030 / 6008 us. Whole calls alternating 1 / 4 / 1 / 4 (``back_programs`` rows
#: of ``results/probes/fp8_ws_probe_h200.jsonl`` at a67b3d2, same error; the bits in
#: ``tests/gpu/test_ws_launch_options_gpu.py``): FP8 T = 512 913 / 909 / 917 / 910 us, 2048 2141 / 2115 / 2142 / 2131,
#: 8192 6895 / 6892 / 6961 / 6893; FP8 x FP4 T = 512 1325 / 1319 / 1326 / 1316, 2048 3276 / 3243 / 3273 / 3237, 8192
#: 8398 / 8259 / 8357 / 8269; T = 128 within 3 us either way; FP8 x FP4 T = 8 407 / 410 / 408 / 410 (the one loss,
#: 0.6 %). Why the whole FP8 call at T = 8192 gains much less than the back launch's 148 us in the profile is not
#: known. A fraction (e.g. 0.25) gives a fraction of the SMs one program each (fewer programs, cheaper grid syncs,
#: where the combine is small; session 15: no gain).
WS_BACK_PROGRAMS_PER_SM = 4
#: Warps and software-pipeline stages per program, by tile kind. "fp8" (the SM90 FP8 x FP8 format of
#: ``fp8_mega_moe``): one 8-warp, 3-stage program per SM, as its staged GEMMs; measured on an H200 at T = 8 / 128 /
#: 2048 / 8192 (``results/probes/fused_fp8_config_probe_h200.json``): block 64 625 / 1000 / 3550 / 12232 us, block
#: 128 762 / 1205 / 3145 / 10031 us, against 975 / 1591 / 5988 / 21020 us for two 4-warp 2-stage programs of block 64
#: (255 registers, 352 bytes spilled); two 4-warp 3-stage programs do not fit one SM's shared memory together and
#: dead-lock in the first grid sync (``_check_resident`` now refuses such a launch). "fp8_swap": see PROGRAMS_PER_SM.
WARPS_STAGES = {"exact": (4, 2), "hopper": (4, 2), "fp8": (8, 3), "fp8_swap": (4, 3), "fp8_ws": (8, 2),
                "fp4_ws": (8, 2)}
#: "fp8": largest expected tokens per local expert that still takes block 64 (block 128 above; see WARPS_STAGES).
FP8_BLOCK64_MAX_EXPECTED = 64
#: The SM90 FP8 format takes its swap-AB tiles ("fp8_swap": 128 weight rows on the MMA's M, block_m tokens on N,
#: ``megamoe.kernels.gemm_fp8.l1_tile_fp8_swap``) up to this many expected tokens per local expert; above, the Gluon
#: GEMM phase "fp8_ws" (FP8_WS_MIN_EXPECTED) where it can run, else the staged tile (tokens on M). At T tokens per
#: rank of one EP8 rank of V4-Pro (384 experts, top-6) the expectation is T / 8. Measured on an H200, whole call
#: (``results/probes/fp8_ws_probe_h200.jsonl``, ``threshold`` rows at 5bcfb3e, session 13): swap-AB / "fp8_ws"
#: block 64 / block 128 at T = 32 822 / 814 / 840 us, T = 128 844 / 838 / 861, T = 256 966 / 864 / 887; at T = 8
#: 495 / 506 / 668 and T = 16 710 / 709 / 733 (a later call, 181923a). T = 8 runs swap-AB in
#: ``results/layer_fp8_h200.json`` (below DeepGEMM's time there). Until session 13 this was 32 (swap up to T = 256),
#: set when "fp8_ws" had no 64-row tile.
FP8_SWAP_MAX_EXPECTED = 2
#: Pool block (MMA N) of the "fp8_swap" tiles, whatever the expectation: a block is read against all of its expert's
#: weights, so an expert whose tokens overflow one block streams its weights twice. On an H200 (same probe file, a
#: kernel with an atomic task counter, c186048 / 6e7f8ff), block 32 against 16: T = 8 506 / 501 us, T = 128 (16
#: expected; routing puts more than 16 on many experts: 68 blocks of 16 for 48 experts) 861 / 935 us.
FP8_SWAP_BLOCK_M = 32
#: Largest pool block (MMA N) the swap-AB ("hopper") tiles take: the L1 tile holds gate and up accumulators
#: [128, BM] fp32 and their promotion partials; at BM 64 with 4 warps that is 256 registers a thread and the kernel
#: spills 792 bytes (compiled for sm_90a), at 32 it fits in 255 without spilling.
MAX_BLOCK_M = 32
#: Pairs per pull task.
PULL_BLOCK_PAIRS = 16
#: Pairs per task of a front launch that only places rows (metadata and top-k weights; the FP8 format's Gluon phase
#: copies the bytes itself): a task is a few dependent loads and an atomic, not a copy, so larger than a pull task.
#: H100, session 45 (``results/probes/place_runs/``): the front launch at T = 8192 took 42 instead of 62 us (16 pairs,
#: the pull's), none the shorter at T <= 2048; whole calls 16 / 128 alternating twice, same bits: T = 2048 2074 / 2070,
#: 2068 / 2058 us, T = 8192 6392 / 6362, 6600 / 6406.
PLACE_BLOCK_PAIRS = 128
#: Columns of a pool row that the front launch of a Gluon kind moves per step of its row copy (``BLOCK_H`` of PHASE
#: 1; the one-launch kernel keeps 256, as its pull shares registers with its GEMM tiles). Each step is a dependent
#: load -> fold -> store round trip, so the copy's speed is the bytes a step has in flight: at 256 columns (4 KB a
#: program) the FP8 x FP4 front at T = 2048 took 113 us at 18 % of DRAM's throughput (Nsight Compute,
#: ``results/probes/ncu_h200/fp8_fp4_2048_193bd42.txt``).
PULL_BLOCK_H = 1024
#: Polls of a barrier wait without progress before it fails, per second of ``barrier_timeout_s`` (interpreter).
INTERPRETER_POLLS_PER_S = 2000


@dataclass(frozen=True)
class FusedConfig:
    """Launch configuration of one fused call (see the module docstring)."""

    block_m: int
    programs_per_rank: int
    numerics: str = "exact"
    promote_every: int = 4
    num_warps: int = 4
    num_stages: int = 2
    #: Register cap per thread (ptxas ``maxnreg``; None = up to 255): what lets more than two programs share an SM.
    maxnreg: int | None = None
    #: Tile family (a key of ``TILE_N``): None = ``tile_kind(layout, numerics)``; ``fused_config`` sets it.
    kind: str | None = None
    #: "fp4_ws" only: decode the FP4 weights once per call (``megamoe.fold_decode``) and stream them as e4m3
    #: (FP4_PREDECODE_MIN_EXPECTED).
    predecode: bool = False
    #: "fp4_ws" at pool block 64 only: > 0 runs the register-operand tile (``megamoe.kernels.gemm_fp4_rs``: the FP4
    #: decode in the math warps, tokens in chunks of this many on the MMA's N; FP4_RS_MAX_EXPECTED) instead of the
    #: decode-partition tile; 0 = the decode-partition tile.
    rs_block_n: int = 0
    #: "fp4_ws" decode-partition tile at pool block 128: math warpgroup 1 decodes the high halves of tiles without
    #: rows of its own (``fp4_ws_idle_decode``: FP4_WS_IDLE_DECODE, FP4_WS_IDLE_MAX_EXPECTED).
    idle_decode: bool = False


def expected_tokens_per_expert(layout, num_tokens: int) -> float:
    """DeepGEMM's block-config key: ``num_tokens * R * k / E`` (this rank's count stands for every rank's)."""
    return num_tokens * layout.num_ranks * layout.num_topk / layout.num_experts


#: Columns per L1 / L2 tile (weight rows of L2) by numerics: "exact" reuses the staged tile of
#: ``megamoe.kernels.gemm`` (tokens on the MMA's M, BLOCK_N weight rows), "hopper" its own swap-AB tile (128
#: weight rows on the MMA's M, tokens on N).
TILE_N = {"exact": (64, 128), "hopper": (128, 128), "fp8": (128, 128), "fp8_swap": (128, 128), "fp8_ws": (128, 128),
          "fp4_ws": (128, 128)}
#: The tile kinds of the SM90 FP8 x FP8 format (the others are the FP8 x FP4 format's numerics).
FP8_KINDS = ("fp8", "fp8_swap", "fp8_ws")
#: "fp8_ws": the SM90 FP8 format's GEMMs as one warp-specialised Gluon launch (``megamoe.kernels.gemm_fp8_ws``:
#: TMA ring, mbarriers, two math warpgroups + a loader warp) between a front launch (count, barrier 1, pull, tile
#: table) and a back launch (barrier 2, combine, cleanup) of ``fused_mega_moe_kernel``. Taken above this many expected
#: tokens per local expert (its tiles are pool blocks of 128 rows, or 64 up to FP8_WS_BLOCK64_MAX_EXPECTED; the pool
#: is sized for 128). On an H200 at T = 512 (64 expected, ``results/probes/fused_fp8_ws_profile_1add9b3_h200.jsonl``):
#: front + back launches 59 us + GEMM phase 987 us (1012 us with 128-row tiles), against 1325 us for the one-launch
#: "fp8" kernel of block 64 (``fused_fp8_ws_profile_h200.jsonl``).
#: Since session 13 the same bound as FP8_SWAP_MAX_EXPECTED (the numbers there): "fp8_ws" from 3 expected tokens.
FP8_WS_MIN_EXPECTED = FP8_SWAP_MAX_EXPECTED
#: "fp8_ws": largest expected tokens per local expert that takes the 64-row tile (both math warpgroups on one block,
#: ``_math_partition_m64``; 128 above). Measured on an H200 (``results/probes/fp8_ws_probe_h200.jsonl``, whole call):
#: T = 512 = 64 expected, where about half of the experts need a second 64-row block: with the epilogues' hardware
#: conversions and 16-byte stores (251c94c) 128-row tiles 924 us, 64-row 951; before them (beb53e5) 1066 / 1091, and
#: with the L1 tiles' padding warpgroup still issuing its MMAs 1117 / 1096. At 4 / 16 / 32 expected (T = 32 / 128 /
#: 256, ``threshold`` rows at 5bcfb3e) 64-row tiles 814 / 838 / 864 us, 128-row 840 / 861 / 887.
FP8_WS_BLOCK64_MAX_EXPECTED = 32
#: Ring stages, register split (math warpgroups / loader warp / pull warps, the kernel's maxnreg) and pull warps of
#: the Gluon GEMM phase: 4 x 48.5 KB of shared memory; 16 warps (4 + 4 math, the loader padded to 4, 4 pull) at
#: 128 registers = the SM's 64 K. Offline sm_90a compile (Triton 3.6, V4-Pro shapes): no spill in a K loop (32
#: spill stores elsewhere at block 128 in session 47's compile with ``FP8_WS_BULK``, 52 without, within
#: ``tests/test_hopper_compile.py``'s budget).
#: Stages by pool block: 4 x 48.5 KB at block 128, 5 x 40.25 KB at block 64 (block 128 runs one fewer with
#: ``FP8_WS_BULK``, :func:`fp8_ws_stages`).
FP8_WS_STAGES, FP8_WS_REGS, FP8_WS_PULL_WARPS = {128: 4, 64: 5}, (216, 40, 40, 128), 4
#: "fp8_ws" at pool block 128: whether math warpgroup 1 starts only once warpgroup 0 has taken a ring's worth of
#: stages (``LEAD`` of ``megamoe.kernels.gemm_fp8_ws._math_partition``), so that the two run that far apart and their
#: epilogues do not coincide (the tensor cores idled through every shared epilogue: session 11's ``noepi`` rows).
#: Same bits. Measured on an H200 (``stagger`` rows of ``results/probes/fp8_ws_probe_h200.jsonl``, session 16, whole
#: call, a 2 us / 20 us start delay of warpgroup 1 standing in for it): T = 2048 2310 / 2314 us as is, 2301 / 2299
#: staggered; T = 8192 7551 / 7566 as is, 7457 / 7455 staggered (1.3 %). (Power-capped there: the SM clock sits at
#: ~1440 of 1980 MHz at 690-695 of 700 W, ``results/probes/clock_probe_h200.jsonl``.) The mbarrier form itself, off /
#: on alternating (``lead`` rows at 4af2dae; ``fp8_ws_probe.py lead`` reruns it): T = 2048 2327 / 2349 / 2405 / 2389 us,
#: T = 8192 7631 / 7664 / 7690 / 7654 -- no gain beyond the run's spread, so off; GPU-tested both ways (same bits,
#: ``tests/gpu/test_ws_launch_options_gpu.py``; the layer bench with it on: ``layer_fp8_h200_4af2dae_lead_on.json``).
FP8_WS_LEAD = False
#: "fp8_ws" at pool block 128: the L2 epilogue through shared memory and the copy engine (``BULK`` of
#: ``megamoe.kernels.gemm_fp8_ws._l2_epilogue_bulk``): each math warpgroup stores its 64 x 256 bf16 rows into its own
#: padded staging slice straight from the wgmma layout and issues one 256-byte ``cp.async.bulk`` per (row, half) to
#: the row's combine slot, then goes back to its MMAs while the copies run -- instead of
#: converting the tile to a 16-bytes-a-thread layout (4 rounds through 8 KB of scratch, 8 barriers) and storing from
#: registers. Built because the L2 epilogue's knock-out took 5-6 % of the phase's cycles at T = 8192 (both warpgroups in
#: it at once, the tensor cores idle), only ~2 % of them its memory traffic
#: (``results/probes/knockout_runs/fp8_l2epi8192_d6771f1_h100.jsonl``). The staging (67.5 KB) takes the ring's fourth
#: stage, which costs nothing measurable: ``stages3`` rows of
#: ``results/probes/knockout_runs/fp8_stages3_80ffb1a_h100.jsonl`` (H100, off / on twice: T = 512 1241 / 1228 / 1240 /
#: 1225 us, 2048 2128 / 2122 / 2135 / 2157, 8192 in 3 s windows 6641 / 6611 / 6778 / 6800). Same bits
#: (``tests/gpu/test_ws_launch_options_gpu.py``). Measured on an H100, off / on alternating
#: (``results/probes/bulk_runs/``): T = 512 1210 / 1191 / 1211 / 1188 us, 1024 1349 / 1347 / 1347 / 1351, 2048 2120 /
#: 2128 / 2118 / 2124, 8192 in 3 s windows 6647 / 6578 / 6630 / 6677 at the same clocks: faster at T = 512 only (the
#: 3-stage ring alone 1196 / 1193 there), so the L2 epilogue's share of the cycles at T = 8192 was not the warpgroups'
#: time in it. On, for the T = 512 gain and the shorter path out of the MMA stream.
FP8_WS_BULK = True
#: "fp8_ws" with ``FP8_WS_BULK``: the pull warps, once their pull is done, issue the staged L2 rows' copies
#: (``COPIER`` of ``megamoe.kernels.gemm_fp8_ws``: :func:`~megamoe.kernels.gemm_fp8_ws._copy_rows`), so that a math
#: warpgroup's L2 epilogue is only the bf16 conversion, a wait for its staging rows to be free, the stores into them
#: and an arrive. Why: the clock profile (``stage_profile_probe.py fp8``, ``results/probes/fp8_profile_runs/
#: profile_split_fc7ca77_h100.jsonl``, H100, T = 8192) split the staged epilogue's ~4750 cycles a tile (both
#: warpgroups at once, the tensor cores idle) into ~750 conversion and destinations, ~500 wait, ~800 staging stores
#: and ~2700 in the copies' issue (the destinations' dependent loads waited for there, 128 copies a warpgroup).
#: Built in session 49, on since session 50: same bits off / on, with and without the multicast
#: (``tests/gpu/test_ws_launch_options_gpu.py``; ``tests/gpu/test_fp8_gpu.py -k "fused or graph"`` 9 passed with it on,
#: and the fused interrupt repair), and faster on an H100 (``results/probes/copier_runs/phase_ee3b74f_h100.jsonl``,
#: the phase alone, off / on alternating, 3 s windows at T = 8192: 6494 / 6302 and 6580 / 6441 us; 0.3 s windows:
#: T = 2048 2010 / 1905, T = 512 1229 / 1228). The layer bench with it on
#: (``results/probes/layer_fp8_variants/layer_fp8_h100_ee3b74f_copier.json``): T = 8192 6205 us (6623 in f7e564b's
#: run, ``results/probes/layer_fp8_variants/layer_fp8_h100_f7e564b.json``, on another H100; 6273 at 5e6f0c0 on a
#: third, ``results/layer_fp8_h100-80gb-hbm3.json``). One 512-byte copy a row instead of two of 256 bytes
#: (``fp8_ws_probe.py``'s ``copier_rowcopies``) was no faster under the copier (6367 / 6406 us), so it stays a probe.
FP8_WS_COPIER = True
# Tried and removed (session 46, f2a3976, ``FP8_WS_PREFETCH``): each math warpgroup prefetching into L1, as a tile
# started, the per-row words its epilogue loads (L2: the rows' ``token_src_metadata``, then the buffer bases; L1: the
# top-k weights), since the L2 epilogue costs 5-6 % of the phase's cycles and only ~2 % is its stores' traffic
# (``results/probes/knockout_runs/fp8_l2epi8192_d6771f1_h100.jsonl``). Same bits; H100, T = 8192, 3 s windows, off /
# on alternating: 6644 / 6712 against 6660 / 6755 us (``results/probes/prefetch_runs/``) -- no gain. Nor did storing
# the L2 rows in pool order without any metadata load change the time (``l2contig``,
# ``knockout_runs/fp8_l2contig8192_f2a3976_h100.jsonl``: 6691 / 6786 against 6728 / 6710): the epilogue's cost is
# not its loads' latency or its scatter.
# Tried and removed (session 25, e546abb): the math warpgroups reading a K block's 64 token rows into registers once
# for both halves' wgmmas ("RS", ``A_REGS``) instead of from shared memory per half ("SS"), at 224 math registers
# (216 spilled in the K loop). The question: is the phase bound by shared-memory bandwidth (SS: 48 KB in by TMA and
# 96 KB out to the tensor cores per ~1024 MMA cycles)? Same bits; whole call, as is / RS at three register splits,
# alternating twice (``a_regs`` rows of ``results/probes/fp8_ws_probe_h200.jsonl``): T = 2048 2041 / 2054 us against
# 2095 - 2116, T = 8192 6773 / 6758 against 6992 - 7016 -- RS 3 % slower, so shared memory is not what binds.
# Tried and removed (session 45, 3edfd15, ``FP8_WS_SLIDE``): each K block as four N = 64 wgmmas into two dot tiles by
# turns, each issued before the one before it was waited for (``wait(1)``), so that a promotion overlapped the
# warpgroup's own next MMA (same 192 registers, same bits). H100, whole call, off / on: T = 2048 2099 - 2112 against
# 2110 - 2143 us, T = 8192 6510 - 6583 against 6524 - 6579; in 3 s windows at T = 8192 ~2 % fewer cycles at a 2-3 %
# lower clock, no faster (``results/probes/slide_runs/``): under the power cap the MMA issue is not what binds. A
# wgmma in flight across the K loop's back edge whose registers are read after the next wait makes ptxas serialise
# every wgmma of the kernel (C7514).

#: By tile kind: whether the Gluon phase's programs whose tiles of one wave share a weight tile start them together
#: (``GROUP_SYNC`` of ``megamoe.kernels.gemm_fp8_ws._group_sync``, on the group words and counters the front launch
#: writes after the tile table), so the weight boxes they load meet in the L2 cache instead of streaming from DRAM
#: once per pool block. Why: Nsight Compute (``results/probes/ncu_h200/fp8_2048_193bd42.txt``) had the FP8 phase at
#: T = 2048 at 75 % of DRAM's throughput (~7.2 GB in 2.0 ms, ~2.3x the weights' 3.2 GB) with an L2 hit rate of 33 %,
#: what no reuse of the weights at all gives. Same bits (``tests/gpu/test_ws_launch_options_gpu.py``). Measured on an
#: H200, whole call off / on / off / on (``group_sync`` rows at 02781a3 in ``fp8_ws_probe_h200.jsonl``, session 21):
#: FP8 at T = 512 921 / 923 / 926 / 924 us (one pool block an expert: groups of one), T = 2048 2325 / 2179 / 2339 /
#: 2175, T = 8192 7566 / 7042 / 7561 / 7035 (-7 %); its GEMM phase alone 1997 -> 1771 us at T = 2048, 6778 -> 5765 at
#: 8192 (profile rows in ``fused_fp8_ws_profile_h200.jsonl``) -> on. FP8 x FP4 (the decode-partition tile, whose
#: packed stream was at 14 % of DRAM, ``fp8_fp4_2048_193bd42.txt``; predecoded e4m3 at 8192): T = 512 1327 / 1336 /
#: 1330 / 1338, T = 2048 3280 / 3301 / 3279 / 3301, T = 8192 8381 / 8426 / 8422 / 8418 -> off.
WS_GROUP_SYNC = {"fp8_ws": True, "fp4_ws": False}
#: "fp8_ws" at pool block 128: the GEMM phase runs in clusters of two CTAs that take pairs of tiles (the front
#: launch's pair table, ``megamoe.kernels.formats.TILE_PAIR_WORDS``) and stream their shared operand once for both,
#: each CTA loading one half multicast to both (``MC`` of ``megamoe.kernels.gemm_fp8_ws``, by the PTX pass of
#: ``megamoe.multicast``): weight pairs (two pool blocks of an expert on one weight tile) and, for the last block of
#: an expert with an odd count, token pairs (one block on two n-tiles). Same bits. Why: at T = 8192 the phase runs at
#: the board's power cap, and loading half of each weight stage had raised the SM clock 1440 -> 1665 MHz at the same
#: 700 W (``results/probes/knockout_runs/fp8_phase8192_80c9104_h100.jsonl``, ``halfw``). Measured on an H100, whole
#: call off / on alternating (``results/probes/multicast_runs/mc*_13f5a93_h100.jsonl``): T = 512 1208 / 1206 -> 1212 /
#: 1206 us, 2048 2119 / 2115 -> 2103 / 2109, 8192 6845 / 6620 -> 6673 / 6590; in 3 s windows at T = 8192 6845 / 6814
#: (1455 MHz) -> 6733 / 6732 (1470 MHz): ~1.5 %, the clock up 1 % (each SM's shared memory is still filled with the
#: whole stage; the L2 reads the multicast halves are not where the power goes). On from session 44. (Its first
#: version padded an odd expert's last block instead of the token pairs: 2-8 % slower, ``mc*_5a7d2ee_h100.jsonl``.)
#: Off since session 48: that gain was measured without ``FP8_WS_BULK``; with the staged epilogue (and its 3-stage
#: ring) the multicast costs time. The clock profile (``stage_profile_probe.py fp8``, ``results/probes/
#: fp8_profile_runs/profile_bdeb87c_h100.jsonl``, T = 8192) has the call at 9.74 M cycles with it, 9.14 M without:
#: each ring stage's MMAs, promotion and release take 1249 cycles with it, 1172 without (the data waits the same,
#: 120-140 cycles a stage either way); why the two options interact is not known. H100, whole calls alternating
#: twice, bits equal (``fp8_profile_runs/mc_bulk_6f5af29_h100.jsonl``): T = 8192 (3 s windows) 6592 @ 1470 /
#: 6846 @ 1425 us on -> 6531 @ 1440 / 6615 @ 1425 off (9.69 / 9.76 -> 9.40 / 9.43 M cycles), T = 2048 2150 / 2149
#: -> 2074 / 2096, T = 512 1239 / 1238 -> 1236 / 1234; the 4-stage ring without the staging (``FP8_WS_BULK``
#: off) 6666 / 6768 with the multicast and 6724 / 6909 without (still its ~1.5 %), both behind the staging without
#: the multicast.
FP8_WS_MULTICAST = False
#: Bytes of a pool row one pull warp moves per load step (``PULL_CHUNK / 512`` 16-byte loads in flight a thread).
FP8_WS_PULL_CHUNK = 1024
#: The combine reduce's work item (``fused_mega_moe_kernel``'s back part): tokens x hidden columns (at most; the
#: largest power of two dividing H), strided over the programs.
COMBINE_TOKENS, COMBINE_COLUMNS = 8, 256
#: The tile kinds whose GEMMs run in a separate Gluon launch between a front and a back launch (``_run_ws``).
WS_KINDS = ("fp8_ws", "fp4_ws")
#: Programmatic dependent launch (sm_90's PDL) between a Gluon kind's three launches: the front lets the GEMM
#: phase's grid be scheduled as its programs exit (``griddepcontrol.launch_dependents`` at its start), the GEMM phase
#: and the back launch are launched as programmatic dependents and wait (``griddepcontrol.wait``) at their first
#: instruction for the launch before them to complete, so no data dependence changes: what it can take off is the
#: launch latency and ramp between the three grids (a T = 128 FP8 call: front + back 35 us, GEMM phase 762, the
#: whole call 810 -- ``results/probes/fused_fp8_ws_profile_181923a_h200.jsonl``). Never under the interpreter.
#: Off: measured on an H200 (``pdl`` rows of ``results/probes/fp8_ws_probe_h200.jsonl``, 8411cb3, whole call, off /
#: on) FP8 T = 128 838 / 846 us, FP8 x FP4 T = 128 872 / 883, T = 8 577 / 577: nothing to gain where one SM holds
#: one program of each launch (a dependent grid's programs cannot start before the previous grid's leave their SM).
#: Output bits the same either way and CUDA-graph capture works with it on
#: (``tests/gpu/test_ws_launch_options_gpu.py``, the graph tests). Also tried to hide the launches: the front starting
#: the GEMM phase's weight stream by an L2 prefetch (``cp.async.bulk.prefetch.L2``) of the first bytes of every weight
#: row of each Gluon CTA's first tile -- once the tile table is written (session 14, f56e1d4): whole call unchanged; at
#: the front's first instruction, for the tiles expected from the token count (session 15): 6-10 us slower at every T of
#: both formats (``prefetch`` rows of ``results/probes/fp8_ws_probe_h200.jsonl``: FP8 T = 128 off / 1024 / 1536 / 2048 B
#: a row 832 / 840 / 841 / 842 us, off again 835; T = 32 809 / 818; T = 512 945 / 954; FP8 x FP4 T = 128 874 / 877, 512
#: 1332 / 1339): the front is a chain of dependent memory round trips (count atomics, grid syncs, barrier 1, tile table)
#: and 35 MB of prefetches queued in HBM lengthen each of them more than the phase gains. Removed both times; so was the
#: GEMM phase's loader issuing an L1 tile's first weight boxes before its wait for the pulled rows (same run, T = 128 /
#: 32 / 512: 833 / 817 / 947 us against 832 / 818 / 954 -- no change).
WS_PDL = False
#: "fp4_ws": the FP8 x FP4 format's GEMMs with "hopper" numerics as one warp-specialised Gluon launch
#: (``megamoe.kernels.gemm_fp4_ws``: TMA loader warp, 4-warp FP4 decode partitions, math warpgroups) between the
#: front launch (which here also copies and folds the rows) and the back launch. On by default: its GPU tests
#: (``tests/gpu/test_fp4_ws_gpu.py``: 1 / 2 / 4 local ranks, masks, skew, clamp, spread scales, the real size, CUDA
#: graph) passed on an H200 at pool blocks 128 and 64, and (block 128) it took the layer at T = 512 / 2048 / 8192
#: from 5132 / 16870 / 64165 us (the one-launch "hopper" kernel, c1f41b1) to 2118 / 4995 / 15650
#: (``results/layer_h200.json`` at 3e811ce; the file at 5bee5a1, with block 64 and the leaner decode: 1824 / 4869 /
#: 15078). ``tile_kind`` takes it on sm_90 above FP4_WS_MIN_EXPECTED expected tokens per
#: local expert (``fused_config``: pool block 64 up to FP4_BLOCK64_MAX_EXPECTED, 128 above);
#: ``FusedConfig(kind="fp4_ws", block_m=128 or 64, numerics="hopper")`` forces it; ``FP4_WS_ENABLED = False`` turns
#: it off. FP4_WS_MIN_EXPECTED: measured on an H200 (``results/probes/ws_variants_probe_h200.jsonl``, 48 experts of
#: V4-Pro), the one-launch kernel against "fp4_ws" forced (block 128): 950 / 1304 us at 1 expected token per expert
#: (T = 8), 1516 / 1998 at 4 (T = 32), 2098 / 2013 at 16 (T = 128), 4851 / 2109 at 64 (T = 512); "fp4_ws" at block
#: 64 (``block`` rows, another device call): 1277 us at 4 (T = 32), 1298 at 16. Since then "fp4_ws" gained its
#: prefetch, scale TMA and leaner decode; at 1 expected (T = 8, ``fp4_threshold`` rows of
#: ``results/probes/fp8_ws_probe_h200.jsonl`` at 5bcfb3e, session 13) the one-launch kernel took 930 us, "fp4_ws"
#: block 64 577, block 128 862. So "fp4_ws" at every expectation it can run (the one-launch kernel stays for pools of
#: block_m < 64, other GPUs and the timeline view).
FP4_WS_ENABLED = True
FP4_WS_MIN_EXPECTED = 0
#: Ring stages and the register split (math warpgroups / loader warp / decode warps, the kernel's maxnreg) by pool
#: block; offline sm_90a compiles (Triton 3.6, H = 7168, I = 3072, ``results/probes/gemm_fp4_ws_compile.py``, env
#: ``BM``). Block 128: A 16 KB + packed W 16 KB + decoded W 32 KB a stage; two math warpgroups and one 4-warp decode
#: partition, 2 x 208 + 24 (the loader's warpgroup) + 72 = 512 = 64 K / 128 threads; 200092 B of shared memory, no
#: spill in the math or loader partitions, the decode partition spills 140 B in its per-tile row maxima (outside its
#: K loop). Block 64: A 8 KB + packed W 16 KB + decoded W 32 KB = 56 KB a stage; one math warpgroup (64 rows x 256
#: weight rows) and two 4-warp decode partitions (128 weight rows and 32 pool rows each), 232 + 24 + 2 x 128 = 512
#: (the math warpgroup is the default partition and gets what the workers leave, so MATH_REGS is not used at this
#: block); 174988 B, no spill anywhere. Block 64 takes 4 stages with PREFETCH (below): 232332 B, 20 B spilled once
#: a tile (outside the K loop).
#: Measured on an H200 (``results/probes/ws_variants_probe_h200.jsonl``, ``scale_words`` rows at eca4bf7, whole
#: call, block 64, T = 128 / 512): 3 stages 1089 / 1742 us, 4 stages 1067 / 1707, SF_TMA 997 / 1627, PREFETCH
#: 1038 / 1561, PREFETCH at 4 stages 954 / 1527.
FP4_WS_STAGES = {128: 3, 64: 4}
FP4_WS_REGS = {128: (208, 24, 72, 128), 64: (232, 24, 128, 128)}
#: (Two decode partitions at block 128 -- each a 128-row half of every stage's weights, the math warpgroups in four
#: 64-row wgmma chains so that 5 warpgroups fit ``maxnreg`` 96 -- were built in session 34 and measured 2-5 % slower
#: on an H100 in session 35, ``results/probes/README.md``: removed.)
#: Whether the decode partitions load each K block's scale words one K block ahead (``PREFETCH`` of
#: ``megamoe.kernels.gemm_fp4_ws``: in flight during the previous block's decode instead of first on each stage's
#: dependency chain, words -> fold-table gathers -> PRMT), by pool block. Only block 64 (a partition's 128 weight
#: rows decoded as one chunk, two rows a thread); block 128's single partition at 72 registers has no room.
#: Block 64's fastest choice with 4 stages (numbers above; all GPU tests at block 64 run it).
FP4_WS_PREFETCH = {128: False, 64: True}
#: (The packed FP4 weight stage 64-byte swizzled, against the decode warps' 2-way bank conflicts on it, was measured
#: 1-2 % slower on an H100 in session 35, ``results/probes/README.md``: removed; the stage is unswizzled.)
#: Whether each ring stage carries its K block's scale words by TMA (``SF_TMA``: the loader's 1 KB of the tile's 256
#: weight rows + the pool rows' words, as DeepGEMM's SM90 kernel loads its scales; the decode reads them from shared
#: memory, no global load left in its K loop), by pool block. Exclusive with FP4_WS_PREFETCH. Shared memory +1.25 KB
#: (block 64) / +1.5 KB (128) a stage. Measured (same file, T = 2048, block 128, 3 stages): 4713 us without, 4129
#: with. At block 64 PREFETCH with a fourth stage beats it (SF_TMA's extra shared memory leaves no room for that).
#: Also tried for the decode and removed: its fold-table words computed (a multiply-subtract a word, shifts <= 5),
#: not gathered from ``fold_lut``: same bits, whole call 8-17 % slower on an H200 (issue bound; fp4_ws at 5bcfb3e,
#: gathered / computed: T = 32 862 / 1001 us, 512 1377 / 1615 (block 64), 2048 3343 / 3597 (block 128)).
FP4_WS_SF_TMA = {128: True, 64: False}
#: Whether the block-128 decode partition writes a stage's decoded weights as two ``[128, 128]`` halves into two
#: buffers, one store each (the halves the math warpgroups' two wgmmas read), and folds the L2 A stage with one load
#: and one store (``DECODE_HALVES`` of ``megamoe.kernels.gemm_fp4_ws``). One ``[256, 128]`` buffer written in four
#: 64-row chunks made Triton's shared-memory barrier pass put a ``bar.sync`` before each chunk's store (a write after
#: a write to one allocation: it cannot tell the chunks' rows apart), and the A fold's chunks likewise. Offline
#: (sm_90a, Triton 3.6, ``tests/test_hopper_compile.py``): the stage loop's barriers 8 -> 3 (predecoded 5 -> 3),
#: 658 -> 651 instructions, its one spilled register a stage gone. Same values, same bits
#: (``tests/gpu/test_ws_launch_options_gpu.py``). Block 64 (PREFETCH: 128 rows a partition in one store) has none.
FP4_WS_DECODE_HALVES = {128: True, 64: False}
#: "fp4_ws": fold the L2 A operand **once** per pool block (the math warpgroup that completes its rows' L1 bits folds
#: them in place in the L2 pool, ``gemm_fp4_ws._l1_fold_once``; the L2 loader waits for the folds) instead of in the
#: decode partition, per stage, in every L2 tile (28 tiles a block at H = 7168: the same rows folded 28 times). Why it
#: was tried: the per-stage clock profile (``results/probes/stage_profile_probe_h200.jsonl``, session 30, block 128)
#: put the decode partition on the tile's critical path (its stage 2750 cycles; the math warpgroups wait ~1000 of
#: their 2750 for it) and the per-stage fold at ~1200 cycles of each L2 stage. Measured (``fold_once`` rows of
#: ``results/probes/fp8_ws_probe_h200.jsonl`` at 7aafcf0, same bits, GPU-tested): **slower**, off / on T = 512 1130 /
#: 1233 us, 2048 2809 / 3007, 8192 (predecoded) 7936 / 9392. The decode partition's stage did shrink (2750 -> 2405
#: cycles, profile rows at 7aafcf0), but each fold (64 rows x I bytes, one math warpgroup) falls to whichever CTA
#: completes a block's rows, and the block's L2 tiles wait for it: the work is uneven, and the slowest CTA's phase,
#: which ends the call, grew (1.16-1.26x the mean, against 1.01-1.03x; T = 8192: 10.7 -> 12.1 M cycles) while the
#: mean fell. (Which CTAs fold, and for how long, was not measured.) Session 28 had measured the same idea
#: (its fold one row a thread pair, 16 rows a step: T = 2048 2971 -> 3921 us, ``fold_once`` rows at 1e9b888) and
#: its branch was lost with the checkout; this form loses less, and the profile says why it loses at all. Off; kept as
#: a GPU-tested option for a fold that is spread over the CTAs. (DeepGEMM's alternative, the per-128 token scales
#: applied in the per-K-block add instead of folded into the operand -- a change of numerics -- is
#: ``numerics="hopper_l2_per_block"`` since session 31; this option does nothing there.)
FP4_WS_FOLD_ONCE = {128: False, 64: False}
#: "fp4_ws" at block 128 (with ``FP4_WS_DECODE_HALVES``, not predecoded): in a tile whose pool block has no row past
#: its first 64 (``valid <= 64``), math warpgroup 1 has nothing to multiply; with this on it decodes the high half of
#: each stage's weights (``IDLE_DECODE`` of ``megamoe.kernels.gemm_fp4_ws``) while the decode partition decodes the
#: low half, so that tile's stage has two decoding warpgroups -- a second decode warp on each scheduler, at the math
#: warpgroup's registers (the stage profile puts the tile's time in its one decode partition, latency-bound). Where it
#: applies: an expert's last pool block when it holds <= 64 rows -- at 64 expected tokens per expert (T = 512 of one
#: EP8 rank) about half of the blocks, under skew the cold experts' blocks.
#: Measured on an H200 (session 33, ``results/probes/idle_decode_runs/``, whole call, the decode-partition tile forced,
#: off / on / off / on, same bits -- ``tests/gpu/test_ws_launch_options_gpu.py``): T = 512 1109 / 1048 / 1117 / 1055 us
#: (-5.5 %), T = 2048 2801 / 2844 / 2828 / 2850 (+1.1 %: the full tiles lose what the idle ones gain; at T = 1024 the
#: first form lost 1 %). The stage profile with every tile idle (T = 256 forced to block 128): the decode partition's
#: stage 2632 -> 2024 cycles (W decode 1634 -> 1067 for its 128 rows, fold 418 -> 272 for 64), warpgroup 1's decode
#: of the other 128 rows 1245 + 466 waiting for the TMA, warpgroup 0's MMA 1027 -- the call 1093 -> 878 us. Two
#: forms were slower on the full tiles and replaced: a branch between the halves inside the decode partition's stage
#: (the halves no longer one basic block; T = 2048 +3 %), and warpgroup 1 arriving on ``decoded[s]`` in every tile
#: (the two math warpgroups tied stage by stage; +2 %). So on up to FP4_WS_IDLE_MAX_EXPECTED expected tokens per
#: local expert (``fp4_ws_idle_decode``, ``FusedConfig.idle_decode``; with FP4_RS_MAX_EXPECTED = 32 that is T = 264
#: ... 512 of one EP8 rank), off above.
FP4_WS_IDLE_DECODE = {128: True, 64: False}
FP4_WS_IDLE_MAX_EXPECTED = 64
#: (Math warpgroup 1 decoding the high half of every stage's weights in *every* tile -- in a full one before its own
#: wgmma -- so that the decode partition decodes the low half only, ``FP4_WS_FULL_DECODE``, was built in session 40
#: and measured slower on an H100 in session 41 with the same bits, whole calls off / on / off / on in the default
#: GPU numerics (``results/probes/full_decode_runs/full_decode_a506418_h100.jsonl``): T = 512 995 / 1008 / 1002 /
#: 1011 us, T = 2048 2554 / 2758 / 2555 / 2775 (+8 %). Warpgroup 1's decode sits in series before its own wgmma, and
#: warpgroup 0 waits for it. Removed in session 42: check out 6813224 to re-run it.)
#: "fp4_ws": largest expected tokens per local expert that takes pool block 64 (block 128 above), as
#: FP8_WS_BLOCK64_MAX_EXPECTED for "fp8_ws" (until session 11): at T = 128 / 512 of one EP8 rank of V4-Pro (16 / 64
#: expected) a 128-row block is mostly padding, and the second math warpgroup's registers go to a second decode
#: partition (the decode bounds the 128-row tile: ``results/probes/ws_variants_probe_h200.jsonl``). Measured on an H200
#: (same file, ``block`` rows, one device call, block 64 / 128): 1277 / 2005 us at T = 32, 1298 / 2022 at T = 128, 1329
#: / 2051 at T = 256; at T = 512 (64 expected, where about half of the experts take two 64-row blocks and decode their
#: weights twice) block 64 took 2058 us, block 128 2108-2118 in two earlier calls (the probe ran out of time before its
#: own block-128 row). With today's kernels (prefetch, scale TMA, leaner decode; ``fp4_threshold`` rows of
#: ``results/probes/fp8_ws_probe_h200.jsonl``, session 13, whole call): block 64 / 128 at T = 8 577 / 862 us, T = 32
#: 862 / 1299, T = 512 1379 / 1347. So block 64 up to 32 expected (T = 256; not measured between 32 and 64).
FP4_BLOCK64_MAX_EXPECTED = 32
#: "fp4_ws": from this many expected tokens per local expert, decode the weights once per call into folded e4m3
#: (``megamoe.fold_decode``: one elementwise pass, 1.5 bytes a weight of HBM traffic) and let the Gluon phase
#: stream those (its decode partitions then only fold the L2 A stage), instead of decoding each weight stage once
#: per pool block. The scratch (El x (2I x H + H x I) bytes, 3.2 GB for one EP8 rank of V4-Pro) is kept on the
#: buffer for the weights in use. Measured on an H200 (``results/probes/ws_variants_probe_h200.jsonl``,
#: ``predecode`` rows at eca4bf7, whole call, 3 stages, per block / predecoded): T = 512 (64 expected) 1617 /
#: 3090 us, T = 2048 (256) 4117 / 4635, T = 8192 (1024) 13485 / 10988; the pass alone 1867 us (2.6 TB/s). The
#: difference is about linear in T (the per-block decode repeats once per 128-row block): even near 390 expected
#: (T ~ 3100), so from 512 (T = 4096; not measured between 256 and 1024). With today's pass (1329 us) and
#: kernels, T = 2048 per block / predecoded: 3341 / 3389 us (``fp4_threshold`` rows of
#: ``results/probes/fp8_ws_probe_h200.jsonl`` at 5bcfb3e): still per block there.
FP4_PREDECODE_MIN_EXPECTED = 512

#: "fp4_ws": up to this many expected tokens per local expert the GEMM phase is the register-operand tile (at its own
#: pool block, ``fp4_rs_block_m``; ``fp4_ws_tiles``) (``megamoe.kernels.gemm_fp4_rs``; FusedConfig.rs_block_n, its token
#: chunk from ``fp4_rs_block_n``); ``FP4_RS_ENABLED = False`` keeps the decode-partition tile. Measured on an H200 (one
#: EP8 rank of V4-Pro, GEMM phase alone, ``results/probes/rs_sweep_h200.jsonl``, session 19 at 43f8755: the L2 A fold
#: once per pool block): T = 8 / 32 / 128 / 256 (1 / 4 / 16 / 32 expected) register-operand 401 / 658 / 805 / 1185 us
#: (chunk 8 / 16 / 32 / 32; chunk 16 at T = 128 / 256: 1000 / 1649) against the decode-partition tile's 535 / 824 /
#: 827 / 836: faster up to 16 expected, slower at 32. (Session 18, with the fold in every L2 stage: 424 / 682 / 861
#: at T = 8 / 32 / 128, ``results/probes/fp4_rs_profile_h200.jsonl``; the threshold was 4.) Since then two or four
#: chains share a token stage (``FP4_RS_PAIR``): phase 371 / 572 / 655 us at T = 8 / 32 / 128
#: (``results/probes/rs_variants_h200.jsonl``, ``fused_fp8_ws_profile_h200.jsonl`` at 25affd4), and chunk 32 runs two
#: 128-row chains over two math warpgroups at two CTAs an SM (session 23, below). Re-swept with them (session 23,
#: ``rs_sweep`` rows at 1b275c4, phase alone, one call): T = 128 / 256 / 512 (16 / 32 / 64 expected) register-operand
#: 611 / 784 / 1187 us (chunk 32 / 64 / 64; chunk 32 forced at 256 / 512: 895 / 1560) against the decode-partition
#: tile's 826 / 834 / 1268 -> 64 (was 16). Whole call, alternating twice (``rs_threshold`` rows of
#: ``results/probes/fp8_ws_probe_h200.jsonl``, session 25, also timed back to back without the L2 flush): T = 512
#: register-operand at chunk 64 1280 / 1284 us (unflushed 1289 / 1298) against 1320 / 1316 (1313 / 1312); T = 1024
#: (128 expected) 2016 / 2027 (2146 / 2242) against 1999 / 1997 (1993 / 1993) -- there its phase's 2 % lead is lost in
#: the whole call, flushed or not. Not measured between 128 and 256 expected (T = 2048). Session 28, after the
#: register-order FP4 words sped both tiles up (same rows, at 46082b6, whole call alternating twice): T = 256 register-
#: operand 823 / 822 us against the decode-partition tile's (block 64) 828 / 829; T = 512 1229 / 1229 against (block
#: 128) 1211 / 1214; T = 768 (96 expected, past the threshold) 1546 / 1560 against 1243 / 1246. So the hand-over now
#: sits between 32 and 64 expected. Session 29, with the decode-partition tile's decoded stage as two halves
#: (``FP4_WS_DECODE_HALVES``; ``halves`` rows of the same file at eb2ce4f): T = 512 register-operand 1228 / 1230 us
#: against the decode-partition tile's 1168 / 1169 (1215 / 1215 with the halves off), so the layer run at c54f4b5
#: took the threshold to 32: uniform T = 512 1229 -> 1192 us, but with skewed routing (the bench's Zipf rows) 1176 ->
#: 1431 (1441 in its repeat; ``results/probes/layer_variants/``): the expected count is the uniform one, and under skew
#: the 128-row blocks decode the hot experts' weights once per block where the register-operand tile's 64-row blocks
#: and token chunks do not. 3 % on uniform routing is not worth 22 % on skewed: back to 64. T = 256 (32 expected,
#: block 64 for both) register-operand 819 / 820 against 832 / 837 (``halves`` rows at c54f4b5).
#: Session 33, with the decode-partition tile's idle warpgroup decoding (FP4_WS_IDLE_DECODE, about half of T = 512's
#: blocks): T = 512 1048 / 1055 us against the register-operand tile's 1219 / 1223 (``idle_decode_3cbecb5.jsonl``), and
#: the layer bench at T = 512 with it (``layer_h200_3cbecb5_t512_idle.json``): uniform 1067, skewed 1198 -- against
#: 1222 / 1176 for the register-operand tile in ``results/layer_h200.json`` at 3d6d852: 13 % faster uniform, 2 %
#: slower skewed. So 32 (T = 264 ... 512 take the decode-partition tile).
FP4_RS_ENABLED = True
FP4_RS_MAX_EXPECTED = 32
#: CTAs of the register-operand tile per SM, by token chunk (each CTA a math warpgroup and a loader warp, launched
#: as 8 warps at ``maxnreg`` ``fp4_rs_maxnreg``: 65536 registers shared by the SM's CTAs). Four up to chunk 16
#: (``maxnreg`` 64; ``fp4_rs_probe``: 4 CTAs an SM 2.5 TB/s of FP4, 2 CTAs 2.3); two at chunk 32, where four weight
#: chains share a token stage (below) and need ``maxnreg`` 128; two at chunk 64, whose ``[128, 64]`` float32 stash
#: alone is 32 KB (four CTAs would leave no room for a second ring stage) and whose two ``[64, 64]`` float32 register
#: tiles need ``maxnreg`` 128. Chunk 64 with one chain a stage measured slower than the alternatives
#: (``results/probes/rs_sweep_h200.jsonl`` at 8dd6787): 1062 / 1063 / 1621 us at T = 128 / 256 / 512 against chunk
#: 32's 803 and the decode-partition tile's 836 / 1272; with two chains a stage (since session 20) 784 / 1187 at
#: T = 256 / 512 against 834 / 1268 (1b275c4): the default there since session 23.
FP4_RS_CTAS_PER_SM = {8: 4, 16: 4, 32: 2, 64: 2, 128: 1}
#: Weight rows of a chain by token chunk: 64 (one math warpgroup), or 128 (two math warpgroups in lock-step,
#: ``num_warps`` 8, pool blocks of 128): at chunk 32 by default since session 23 (2 CTAs an SM, two chains a stage,
#: below), at chunk 128 (one CTA an SM) chosen only explicitly: ``FusedConfig(kind="fp4_ws", block_m=128,
#: rs_block_n=128)``. Chunk 64 on 128-row chains (``fused_fp8_ws_profile``'s
#: ``FP4_RS_WIDE=64`` patches these dicts) compiles too: 168 registers, 150792 B shared (6 stages), no spill.
FP4_RS_ROWS = {8: 64, 16: 64, 32: 128, 64: 64, 128: 128}
#: Weight chains that share one token stage of the register-operand tile, by token chunk (``PAIR``: 2 or 4; each
#: chain one ``[64, chunk]`` float32 accumulator, so four fit the math warpgroup's 104 registers at four CTAs an SM
#: only up to chunk 16; chunk 32 takes them at two CTAs an SM, 232 registers).
#: What a stage moves into shared memory is ``PAIR`` x 4 KB of weights and chunk x 128 bytes of tokens.
#: Measured (``results/probes/rs_variants_h200.jsonl``, e47d7b4, two runs each): at chunk 16 (T = 32) four chains
#: 572 / 572 us against two chains' 580 / 580; at chunk 8 (T = 8) four chains 402 / 401 against 374 / 368 -- there
#: the tokens are 1 KB of a stage and the second ring stage four chains leave is what is missed. At chunk 32 (T = 128,
#: where Nsight Compute had the phase L2-bound, L2 at 84 %: each stage re-read the chunk's 4 KB of tokens per pair of
#: chains), whole call alternating twice (``rs_ctas`` rows of ``results/probes/fp8_ws_probe_h200.jsonl`` at 1d6df46,
#: same error): 2 CTAs an SM with four chains 667 / 668 us against 4 CTAs with two chains 700 / 701 and 2 CTAs with
#: two chains 699 / 698 (FP4_RS_CANDIDATES). Session 23 (``rs_ctas`` rows at afac6ff, same error): the same 256
#: weight rows a stage as two 128-row chains over two math warpgroups at 2 CTAs an SM (16 math warps an SM, where
#: the four-chain tile has 8) 649 / 658 us against the four-chain tile's 667 / 665 -> the default.
FP4_RS_PAIR = {8: 2, 16: 4, 32: 2, 64: 2, 128: 1}
#: The loader warp's ``setmaxnreg`` by token chunk (the math warpgroup gets 104 at four CTAs an SM, 232 at two).
#: Offline sm_90a (Triton 3.6, two chains a token stage): at chunk 32 and four CTAs the loader at 40 left the math
#: spilling in its K loop (5 STL + 5 LDL a stage; 304 B spilled in all), at 24 it spilled 84 B outside the K loops;
#: at chunk 16 36 B (40) against 4 B (24); at chunk 8 none (40) against 4 B (24). Four chains a stage (chunks 8 / 16):
#: the loader at 24 leaves 24 / 36 B spilled outside the K loops, at 40 56 / 168 B. Chunk 32 at two CTAs an SM, four
#: chains, loader 40: 128 registers, 4 stages, 106632 B shared, no spill. Chunk 32 on 128-row chains (the default),
#: loader 24: maxnreg 80, 4 stages, 110728 B shared, 88 B spilled outside the K loop (none in it).
FP4_RS_LOAD_REGS = {8: 24, 16: 24, 32: 24, 64: 40, 128: 40}
#: Settings of the register-operand tile measured against the defaults, by token chunk and name: (chain rows, CTAs an
#: SM, weight chains a token stage, loader registers) for ``FP4_RS_ROWS`` / ``FP4_RS_CTAS_PER_SM`` / ``FP4_RS_PAIR`` /
#: ``FP4_RS_LOAD_REGS`` (``fp4_rs_variant``). ``c2p4`` (chunk 32, T = 128: four 64-row chains a stage at 2 CTAs an SM)
#: was the default in session 22; whole call against the default (``rs_ctas`` rows of
#: ``results/probes/fp8_ws_probe_h200.jsonl`` at 39e2be2, session 24, alternating twice, same error): 674 / 674 us
#: against 653 / 658. Kept selectable for ``fp8_ws_probe.py rs_ctas`` (``device_run.sh rs_ctas``), so GPU-tested
#: (``tests/gpu/test_fp4_rs_gpu.py -k rs_variant``) and host-path tested on CPU. Measured and dropped (session 24, same
#: rows): at chunk 32 64-row chains, two a stage, at 4 / 2 CTAs an SM (``c4p2`` / ``c2p2``: 708-715 / 702 us; slower
#: in sessions 22 and 23 too); at chunk 64 two 128-row chains over two math warpgroups at one CTA an SM (``w1p2``:
#: whole call 1321 / 1322 us against 1301 / 1305 at T = 512; GEMM phase, ``rs_variant_sweep.jsonl``, 804 / 1259 /
#: 1969 / 3525 us against 787 / 1185 / 1868 / 3297 at T = 256 / 512 / 1024 / 2048); and the two chains of a stage
#: overlapped (the second chain's decode issued under the first chain's wgmmas, both waited for at once; session 23,
#: e28e026): whole call at T = 8 434 / 434 us against 412 / 412, T = 32 621 / 617 against 613 / 608, T = 128 (on
#: ``c2p2``) 687 / 689, T = 512 1318 / 1316 against 1301 / 1305 -- removed from the kernel.
FP4_RS_CANDIDATES = {32: {"c2p4": (64, 2, 4, 40)}}
#: Most ring stages of the register-operand tile (``fp4_rs_probe``: 6 at 64 weight rows a stage).
FP4_RS_MAX_STAGES = 6


def fp4_rs_variant(block_n: int, rows: int, ctas: int, pair: int, load_regs: int) -> dict:
    """The four settings dicts of the register-operand tile with token chunk ``block_n`` on chains of ``rows`` weight
    rows (64: one math warpgroup; 128: two, pool block 128), ``ctas`` CTAs an SM, ``pair`` chains a token stage,
    ``load_regs`` loader registers: ``{"FP4_RS_ROWS": {...}, ...}``, the other
    chunks as they are -- what a test monkeypatches and a probe overrides (one entry of ``FP4_RS_CANDIDATES``:
    ``fp4_rs_variant(chunk, *entry)``)."""
    return {"FP4_RS_ROWS": {**FP4_RS_ROWS, block_n: rows}, "FP4_RS_CTAS_PER_SM": {**FP4_RS_CTAS_PER_SM, block_n: ctas},
            "FP4_RS_PAIR": {**FP4_RS_PAIR, block_n: pair}, "FP4_RS_LOAD_REGS": {**FP4_RS_LOAD_REGS, block_n: load_regs}}


def fp4_rs_maxnreg(block_n: int) -> int:
    """``maxnreg`` of the register-operand tile at token chunk ``block_n``: an SM's 64 K registers over its
    ``FP4_RS_CTAS_PER_SM[block_n]`` CTAs of ``fp4_rs_num_warps(block_n)`` math warps and a loader warpgroup (64 at
    four CTAs of 4 + 4 warps, 128 at two, 168 at one of 8 + 4), a multiple of 8."""
    warps = fp4_rs_num_warps(block_n) + 4
    return 65536 // (FP4_RS_CTAS_PER_SM[block_n] * warps * 32) // 8 * 8


def fp4_rs_block_m(block_n: int) -> int:
    """The register-operand tile's pool block at token chunk ``block_n``: 64, or 128 where its chains are 128 rows
    (``FP4_RS_ROWS``: two math warpgroups -- a pool block of 128 feeds them whole chunks)."""
    return 128 if FP4_RS_ROWS[block_n] == 128 else 64


def fp4_rs_num_warps(block_n: int) -> int:
    """The register-operand tile's math warps at token chunk ``block_n``: a warpgroup per 64 rows of a chain."""
    return FP4_RS_ROWS[block_n] // 16


def fp4_rs_block_n(expected: float) -> int:
    """Tokens per chunk of the register-operand tile at ``expected`` tokens per local expert: the MMA's N (8, 16,
    32 or 64). Each chunk streams (and decodes) the tile's weights once, so a chunk should hold most experts' tokens;
    a wider N costs registers and shared memory (chunk 64: half the CTAs an SM), while the decode bounds the tile."""
    return 8 if expected <= 2 else 16 if expected <= 8 else 32 if expected <= 16 else 64


def fp4_rs_stages(block_n: int, ctas_per_sm: int | None = None) -> int:
    """Ring stages of the register-operand tile at token chunk ``block_n``: as many as fit ``ctas_per_sm`` CTAs
    (default ``FP4_RS_CTAS_PER_SM[block_n]``) in an SM's shared memory (a stage: ``FP4_RS_PAIR[block_n]`` chains'
    64 x 64 packed weight bytes and 64 scale words, ``block_n`` x 128 token bytes; plus the ``[128, block_n]``
    float32 stash of the L1 requant, barriers and the epilogue's layout scratch), at most FP4_RS_MAX_STAGES."""
    ctas = FP4_RS_CTAS_PER_SM[block_n] if ctas_per_sm is None else ctas_per_sm
    per_cta = _SM90_LIMITS["shared_memory_per_multiprocessor"] // ctas - 1024  # (the driver's 1 KiB a CTA)
    rows = FP4_RS_ROWS[block_n]
    stage = FP4_RS_PAIR[block_n] * (rows * 64 + rows * 4) + block_n * 128
    fixed = 128 * block_n * 4 + rows * block_n * 2 + 512
    return max(2, min(FP4_RS_MAX_STAGES, (per_cta - fixed) // stage))


def ws_unsupported_reason(layout, device: torch.device | None) -> str | None:
    """Why a Gluon GEMM phase ("fp8_ws", "fp4_ws": the same tile geometry) cannot run ``layout`` on ``device``
    (None = it can)."""
    if interpreting() or device is None or device.type != "cuda":
        return "the Gluon GEMM phase needs a CUDA device (no interpreter)"
    if compute_capability(device) != (9, 0):
        return "the Gluon GEMM phase uses sm_90 wgmma"
    if layout.block_m < WS_TILE_M.value:
        return f"pool block_m={layout.block_m} < {WS_TILE_M.value} (the Gluon tile's pool rows)"
    if layout.intermediate_hidden % 128 or layout.hidden % 256 or 2 * layout.intermediate_hidden // 128 > 64:
        return (f"H={layout.hidden}, I={layout.intermediate_hidden}: the Gluon GEMM phase needs I % 128 == 0, "
                "H % 256 == 0 and I <= 4096 (two bits per 128 columns in the 64-bit arrival mask)")
    return None


def tile_kind(layout, numerics: str, expected: float | None = None, device: torch.device | None = None) -> str:
    """The tile family of a call. The layout's format ``"fp8"`` (``fp8_mega_moe``): ``"fp8_swap"`` (swap-AB) when
    ``expected`` tokens per local expert are given and at most ``FP8_SWAP_MAX_EXPECTED``; ``"fp8_ws"`` (the Gluon
    GEMM phase) above ``FP8_WS_MIN_EXPECTED`` where it can run on ``device``; else ``"fp8"`` (the staged FP8 x FP8
    tiles, whose L1 owns whole 128-column requant groups). Else the FP8 x FP4 ``numerics``; with "hopper" numerics
    its Gluon GEMM phase ``"fp4_ws"`` instead (unless ``FP4_WS_ENABLED`` is off), above ``FP4_WS_MIN_EXPECTED``
    expected tokens and where it can run on ``device``."""
    if getattr(layout, "format", "fp8_fp4") != "fp8":
        if (numerics in HOPPER_NUMERICS and FP4_WS_ENABLED and expected is not None
                and expected > FP4_WS_MIN_EXPECTED and ws_unsupported_reason(layout, device) is None):
            return "fp4_ws"
        return "hopper" if numerics in HOPPER_NUMERICS else numerics
    if expected is not None and expected <= FP8_SWAP_MAX_EXPECTED:
        return "fp8_swap"
    if expected is not None and expected > FP8_WS_MIN_EXPECTED and ws_unsupported_reason(layout, device) is None:
        return "fp8_ws"
    return "fp8"


def fp4_ws_tiles(layout, expected: float) -> tuple[int, int, bool]:
    """The "fp4_ws" (FP8 x FP4 Gluon GEMM phase) tiles at ``expected`` tokens per local expert, whatever machine
    asks (a notebook on a CPU reads the H200's choice here): ``(block_m, rs_block_n, predecode)`` -- the pool block
    (64 up to FP4_BLOCK64_MAX_EXPECTED, else 128; the register-operand tile's own, ``fp4_rs_block_m``), the
    register-operand tile's token chunk (0: the decode-partition tile; up to FP4_RS_MAX_EXPECTED, when the layout's
    pool holds its block) and whether the weights are decoded once per call (from FP4_PREDECODE_MIN_EXPECTED)."""
    block_m = 64 if expected <= FP4_BLOCK64_MAX_EXPECTED else 128  # (64 rows where 128 would be mostly padding)
    predecode = expected >= FP4_PREDECODE_MIN_EXPECTED
    rs = fp4_rs_block_n(expected) if FP4_RS_ENABLED and not predecode and expected <= FP4_RS_MAX_EXPECTED else 0
    if rs and fp4_rs_block_m(rs) <= layout.block_m:
        block_m = fp4_rs_block_m(rs)
    elif rs:
        rs = 0
    return block_m, rs, predecode


def fp4_ws_idle_decode(expected: float, block_m: int, rs_block_n: int, predecode: bool) -> bool:
    """Whether the "fp4_ws" decode-partition tile runs with ``IDLE_DECODE`` at ``expected`` tokens per local expert
    (its pool block ``block_m``; not the register-operand tile, ``rs_block_n`` > 0, nor predecoded weights):
    FP4_WS_IDLE_DECODE at the block, which is block 128 (the helper of its one decode partition: block 64 runs two),
    up to FP4_WS_IDLE_MAX_EXPECTED."""
    return (FP4_WS_IDLE_DECODE.get(block_m, False) and block_m == 128 and not rs_block_n and not predecode
            and expected <= FP4_WS_IDLE_MAX_EXPECTED)


def fused_config(layout, num_tokens: int, num_local_ranks: int, device: torch.device,
                 numerics: str = "exact") -> FusedConfig:
    """The configuration for a call with ``num_tokens`` tokens on this rank (``num_local_ranks`` share a launch)."""
    expected = expected_tokens_per_expert(layout, num_tokens)
    kind = tile_kind(layout, numerics, expected, device)
    warps, stages = WARPS_STAGES[kind]
    rs, predecode, idle = 0, False, False  # (the register-operand chunk, predecode, idle decode: "fp4_ws" only)
    if kind == "exact":  # tokens on the MMA's M, where wgmma needs 64 rows
        block_m = min(layout.block_m, 64)
    elif kind == "fp8_swap":  # tokens on the MMA's N; expected <= FP8_SWAP_MAX_EXPECTED
        block_m = max(MIN_BLOCK_M, min(layout.block_m, FP8_SWAP_BLOCK_M))
    elif kind == "fp8":
        block_m = min(layout.block_m, 64 if expected <= FP8_BLOCK64_MAX_EXPECTED else 128)
    elif kind == "fp8_ws":  # its 64-row tile (both math warpgroups on one block) where 128 rows would be half padding
        block_m = 64 if expected <= FP8_WS_BLOCK64_MAX_EXPECTED else 128
    elif kind == "fp4_ws":
        block_m, rs, predecode = fp4_ws_tiles(layout, expected)
        idle = fp4_ws_idle_decode(expected, block_m, rs, predecode)
    else:  # tokens on the MMA's N
        want = triton.next_power_of_2(max(1, int(expected + 0.999)))
        block_m = max(MIN_BLOCK_M, min(MAX_BLOCK_M, layout.block_m, want))
    if interpreting() or device.type != "cuda":
        programs = 1
    else:
        sms = sm_count(device)
        per_sm, maxnreg = PROGRAMS_PER_SM[kind]
        programs = max(1, per_sm * sms // num_local_ranks)
        return FusedConfig(block_m=block_m, programs_per_rank=programs, numerics=numerics, num_warps=warps,
                           num_stages=stages, maxnreg=maxnreg, kind=kind, predecode=predecode, rs_block_n=rs,
                           idle_decode=idle)
    return FusedConfig(block_m=block_m, programs_per_rank=programs, numerics=numerics, num_warps=warps,
                       num_stages=stages, kind=kind, predecode=predecode, rs_block_n=rs, idle_decode=idle)


def unsupported_reason(sym_buffers, device: torch.device) -> str | None:
    """Why the fused kernel cannot run these buffers here (None = it can)."""
    L = sym_buffers[0].layout
    bn1 = min(n for n, _ in TILE_N.values())
    if L.intermediate_hidden // bn1 > 64:
        return (f"intermediate_hidden={L.intermediate_hidden} > {64 * bn1} (one bit of the 64-bit L2 arrival mask per "
                f"{bn1} columns)")
    if interpreting():
        if len(sym_buffers) > 1:
            return ("the interpreter runs a launch's programs one after another, so local ranks cannot meet in one "
                    "launch: use one process per rank (backend 'cpu') or impl='staged'")
        return None
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    major, minor = compute_capability(device)
    if (major, minor) < (9, 0):
        return f"compute capability {major}.{minor} < 9.0 (the fused kernel targets Hopper)"
    return None


def _offsets(L) -> dict[str, int]:
    names = dict(OFF_GRID="grid_sync", OFF_SIGNAL="barrier_signal", OFF_STATE="barrier_state",
                 OFF_SEND="expert_send_count", OFF_RECV="expert_recv_count", OFF_RECV_SUM="expert_recv_count_sum",
                 OFF_ARRIVAL="l1_arrival_count", OFF_L2_MASK="l2_arrival_mask", OFF_SRC_IDX="src_token_topk_idx",
                 OFF_META="token_src_metadata", OFF_X="x", OFF_X_SF="x_sf", OFF_TOPK_IDX="topk_idx",
                 OFF_TOPK_W="topk_weights", OFF_L1="l1_acts", OFF_L1_SF="l1_acts_sf", OFF_L1_W="l1_topk_weights",
                 OFF_L2="l2_acts", OFF_L2_SF="l2_acts_sf", OFF_COMBINE="combine", OFF_CALL="call_state")
    return {k: L.offset(v) for k, v in names.items()}


def kernel_meta(L, cfg: FusedConfig, *, has_clamp: bool, has_stats: bool, timeline: bool) -> dict:
    """The constexpr keywords of ``fused_mega_moe_kernel`` for layout ``L`` and ``cfg``."""
    gpu = not interpreting()
    kind = cfg.kind or tile_kind(L, cfg.numerics)
    if kind == "fp8_ws" and cfg.block_m not in FP8_WS_STAGES:
        raise ValueError(f"FusedConfig kind='fp8_ws' runs pool blocks of {sorted(FP8_WS_STAGES)} rows (its Gluon "
                         f"tiles), got block_m={cfg.block_m}")
    if cfg.rs_block_n and (kind != "fp4_ws" or cfg.rs_block_n not in FP4_RS_CTAS_PER_SM or cfg.predecode
                           or cfg.block_m != fp4_rs_block_m(cfg.rs_block_n)):
        chunks = ", ".join(map(str, FP4_RS_CTAS_PER_SM))
        raise ValueError(f"FusedConfig rs_block_n={cfg.rs_block_n} (the register-operand FP4 tile) needs "
                         f"kind='fp4_ws', no predecode, a token chunk of {chunks} and block_m="
                         f"fp4_rs_block_m(chunk) (64; 128 on 128-row chains, FP4_RS_ROWS); got kind={kind!r}, "
                         f"block_m={cfg.block_m}, predecode={cfg.predecode}")
    if kind == "fp4_ws" and (cfg.block_m not in FP4_WS_STAGES or cfg.numerics not in HOPPER_NUMERICS):
        raise ValueError(f"FusedConfig kind='fp4_ws' runs pool blocks of {sorted(FP4_WS_STAGES)} rows with "
                         f"numerics in {HOPPER_NUMERICS} (its folded operands), got block_m={cfg.block_m}, "
                         f"numerics={cfg.numerics!r}")
    if (kind in FP8_KINDS) != (getattr(L, "format", "fp8_fp4") == "fp8"):
        raise ValueError(f"FusedConfig kind={kind!r} does not run a layout of format "
                         f"{getattr(L, 'format', 'fp8_fp4')!r}")
    return dict(
        **_offsets(L), R=L.num_ranks, E=L.num_experts, El=L.num_experts_per_rank, T=L.num_max_tokens_per_rank,
        K=L.num_topk, H=L.hidden, I=L.intermediate_hidden, SP=L.num_padded_sf_pool_tokens, LAYOUT_BM=L.block_m,
        LAYOUT_SF_BM=L.sf_block_m, BM=cfg.block_m, BLOCK_R=max(2, triton.next_power_of_2(L.num_ranks)),
        BLOCK_E=max(2, triton.next_power_of_2(L.num_experts_per_rank)), BLOCK_J=PULL_BLOCK_PAIRS,
        BLOCK_H=largest_pow2_tile(L.hidden, 256), BLOCK_W=triton.next_power_of_2(L.hidden // 32),
        COUNT_BLOCK=256, COMBINE_T=COMBINE_TOKENS, COMBINE_H=largest_pow2_tile(L.hidden, COMBINE_COLUMNS),
        HAS_CLAMP=has_clamp,
        HAS_STATS=has_stats, PROMOTE_EVERY=cfg.promote_every, PRMT_DECODE=gpu, HW_CVT=gpu, TIMED=gpu,
        TIMELINE=timeline and gpu, MAX_EVENTS=TIMELINE_MAX_EVENTS, FOLDED=cfg.numerics in HOPPER_NUMERICS,
        L2_FOLDED=l2_folded(cfg.numerics),
        BN1=TILE_N[kind][0], BN2=TILE_N[kind][1], F64_EXP=not gpu, FP8W=kind in FP8_KINDS,
        FP8_SWAP=kind == "fp8_swap",
        KW1_PAD=triton.next_power_of_2(L.hidden // 128), KW2_PAD=triton.next_power_of_2(L.intermediate_hidden // 128),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
        **({"PAIRS": True} if fp8_ws_multicast(kind, cfg.block_m) else {}))


def fp8_ws_multicast(kind: str, block_m: int) -> bool:
    """Whether a call of tile kind ``kind`` at pool block ``block_m`` runs the FP8 GEMM phase in 2-CTA clusters
    (``FP8_WS_MULTICAST``; the front launch then writes the pair table, on a CPU rank too)."""
    return FP8_WS_MULTICAST and kind == "fp8_ws" and block_m == 128


def _buffer_cache(sb, name: str, key, build, limit: int = 8):
    """``build()`` once per ``key``, kept on buffer ``sb`` in its host cache ``name`` (``SymmBuffer.host_cache``;
    emptied past ``limit`` entries): host objects of the launches (keywords, argument tables) are made once and a
    repeated or CUDA-graph-captured call builds none. Objects made from the call's weights go through
    ``_weights_cache``."""
    cache = sb.host_cache(name)
    if key not in cache:
        if len(cache) > limit:
            cache.clear()
        cache[key] = build()
    return cache[key]


#: Weight sets whose host objects (TMA descriptors over the weights, the register-operand tile's row maxima) a
#: buffer keeps (``_weights_cache``). A model's MoE layers share one symmetric buffer and call it with their own
#: weights in turn, so with fewer entries than layers every call of a forward would make them again -- the row
#: maxima a read of the scales, 71 us at one EP8 rank of V4-Pro -- while a one-layer benchmark never does. An entry
#: is host objects plus (row maxima) El x (2I + H) bytes of GPU memory: 0.64 MB at one EP8 rank of V4-Pro.
WEIGHT_CACHE_SETS = 64


def _weight_owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose lifetime ``t``'s memory follows: a view's base, else ``t``."""
    return t if t._base is None else t._base


def _drop_weight_entry(cache: dict, key) -> None:
    entry = cache.pop(key, None)
    if entry is not None:
        for f in entry[1]:
            f.detach()


def _weight_freed(sb_ref, name: str, key) -> None:
    """A weight tensor of entry ``key`` of host cache ``name`` was freed: drop the entry if its buffer lives (the
    finalizer holds the buffer weakly: a buffer dropped before the weights must not be kept by them)."""
    sb = sb_ref()
    if sb is not None:
        _drop_weight_entry(sb.host_cache(name), key)


def _detached(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s memory with ``t``'s shape and strides that is not a view of it (no ``_base``): what a
    cached host object may hold without keeping the caller's tensor object alive (``_weights_cache``)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                                t.stride())


def _weights_cache(c, name: str, key, build):
    """``build(l1, l2)`` once per ``key`` and set of bound call ``c``'s four weight tensors (their addresses), kept on
    the buffer's host cache ``name`` for up to WEIGHT_CACHE_SETS weight sets. An entry is dropped the moment any of
    those tensors (a view's base) is freed: it holds views of the weights (a descriptor keeps its tensor), which must
    not keep a caller's dropped weights alive, and a new tensor later made at a freed one's address must not find
    it (descriptors over the old scale words, the old row maxima). ``build`` gets ``(w, sf)`` pairs that share the
    weights' memory but are not views of the caller's tensors (``_detached``), so that what it keeps (views of
    those) lets the caller's tensor objects die and the entry go with them."""
    tensors = (c.l1[0], c.l1[1], c.l2[0], c.l2[1])
    full = (key, *(t.data_ptr() for t in tensors))
    cache = c.sb.host_cache(name)
    entry = cache.get(full)
    if entry is None:
        if len(cache) >= WEIGHT_CACHE_SETS:
            for k in list(cache):
                _drop_weight_entry(cache, k)
        aliases = [_detached(t) for t in tensors]
        value = build((aliases[0], aliases[1]), (aliases[2], aliases[3]))
        owners = {id(o): o for o in map(_weight_owner, tensors)}.values()
        sb_ref = weakref.ref(c.sb)
        cache[full] = entry = (value, [weakref.finalize(o, _weight_freed, sb_ref, name, full) for o in owners])
    return entry[0]


def _arg_table(calls, timelines, tiles) -> torch.Tensor:
    """int64 ``[local ranks, NUM_ARGS]``: per local rank the byte deltas of its tensors from local rank 0's
    (``kf.ARG_NAMES`` order) and its token count. Cached on the first buffer so a repeated call (and a CUDA-graph
    capture after a warm-up call) allocates nothing. Every address must be 16-byte aligned (the kernel keeps vector
    accesses)."""
    def addrs(c, tl_, tiles_):
        base = c.sb.buffer.data_ptr()
        return [base, c.y.data_ptr(), c.l1[0].data_ptr(), c.l1[1].data_ptr(), c.l2[0].data_ptr(),
                c.l2[1].data_ptr(), c.stats.data_ptr() if c.stats is not None else base,
                None, tl_.data_ptr() if tl_ is not None else base, tiles_.data_ptr() if tiles_ is not None else base]

    rows = [addrs(c, t, g) for c, t, g in zip(calls, timelines, tiles)]
    key = tuple(map(tuple, rows)) + tuple(c.n for c in calls)  # (every address: a hit was checked when built)

    def build():
        for c, row in zip(calls, rows):
            for name, a in zip(kf.ARG_NAMES, row):
                if a is not None and a % 16:
                    raise ValueError(f"{name} of rank {c.sb.rank} is not 16-byte aligned (address {a:#x}): the fused "
                                     "kernel needs aligned tensors (a fresh allocation, not an offset view)")
        table_rows = [[c.n if a is None else a - a0 for a, a0 in zip(row, rows[0])] for c, row in zip(calls, rows)]
        return torch.tensor(table_rows, dtype=torch.int64, device=calls[0].sb.buffer.device)

    return _buffer_cache(calls[0].sb, "_fused_arg_tables", key, build, limit=64)


_FOLD_LUTS: dict = {}


def _fold_lut(device: torch.device) -> torch.Tensor:
    """``megamoe.quant.fold_lut`` on ``device``, made once per device (no allocation inside a captured call)."""
    key = str(device)
    if key not in _FOLD_LUTS:
        _FOLD_LUTS[key] = fold_lut(device)
    return _FOLD_LUTS[key]


def run_fused(calls, *, numerics: str = "exact", timeline: bool = False, config: FusedConfig | None = None):
    """Launch the fused kernel once for every rank of ``calls`` (``megamoe.ops`` bound calls, already validated).

    ``numerics``: ``"exact"`` (the staged kernels' tiles and per-32 promotion; bit-exact to the reference on CPU) or
    ``"hopper"`` (folded scales, swap-AB; ``megamoe.reference`` with ``numerics="hopper"``).
    Returns None, or with ``timeline=True`` (GPU) one int64 tensor ``[programs_per_rank, TIMELINE_MAX_EVENTS, 3]``
    per rank of ``(kind, start ns, end ns)`` rows (kind -1 = unused; kinds index :data:`TIMELINE_KINDS`)."""
    sb0 = calls[0].sb
    L, dev = sb0.layout, sb0.buffer.device
    cfg = config or fused_config(L, calls[0].n, len(calls), dev, numerics)
    if timeline and cfg.kind == "fp8_ws":  # the Gluon GEMM phase records no timeline: the one-launch kernel does
        warps, stages = WARPS_STAGES["fp8"]  # (both kinds run one program per SM; block 128 is an "fp8" block too)
        cfg = replace(cfg, kind="fp8", num_warps=warps, num_stages=stages, maxnreg=PROGRAMS_PER_SM["fp8"][1])
    if timeline and cfg.kind == "fp4_ws":  # likewise: the one-launch "hopper" kernel (its block and programs)
        warps, stages = WARPS_STAGES["hopper"]
        per_sm, maxnreg = PROGRAMS_PER_SM["hopper"]
        programs = cfg.programs_per_rank if interpreting() or dev.type != "cuda" else max(
            1, per_sm * sm_count(dev) // len(calls))
        cfg = replace(cfg, kind="hopper", block_m=min(MAX_BLOCK_M, L.block_m), programs_per_rank=programs,
                      num_warps=warps, num_stages=stages, maxnreg=maxnreg)
    timelines = [None] * len(calls)
    if timeline and not interpreting():
        timelines = [torch.full((cfg.programs_per_rank, TIMELINE_MAX_EVENTS, 3), -1, dtype=torch.int64, device=dev)
                     for _ in calls]
    tiles = [_tile_table(c.sb) if cfg.kind in WS_KINDS else None for c in calls]
    table = _arg_table(calls, timelines, tiles)
    clamp = calls[0].clamp
    timeout_s = sb0.barrier_timeout_s
    metas = _launch_metas(sb0, cfg, has_clamp=clamp is not None, has_stats=calls[0].stats is not None,
                          timeline=timeline)
    meta = metas[0][0]
    rank0 = 0 if sb0.backend == "local" else sb0.rank
    grid = (len(calls) * cfg.programs_per_rank,)
    c0 = calls[0]

    def args_for(G: int) -> tuple:  # the kernel's arguments with G programs per local rank
        return (c0.sb.buffer, c0.y, c0.l1[0], c0.l1[1], c0.l2[0], c0.l2[1],
                c0.stats if c0.stats is not None else c0.sb.buffer,
                timelines[0] if timelines[0] is not None else c0.sb.buffer,
                tiles[0] if tiles[0] is not None else c0.sb.buffer,
                table, sb0.buffer_ptrs, _fold_lut(dev), rank0, G,
                float(clamp) if clamp is not None else 0.0,
                int(timeout_s * 1e9), max(1000, int(timeout_s * INTERPRETER_POLLS_PER_S)))

    if cfg.kind in WS_KINDS:
        _run_ws(calls, args_for, cfg.programs_per_rank, metas, tiles, rank0, L, dev, cfg.kind, cfg.predecode,
                cfg.rs_block_n, cfg.numerics, cfg.idle_decode)
        return None
    args = args_for(cfg.programs_per_rank)
    if not interpreting():
        _check_resident(args, grid, *metas[0], dev)
    direct_launch.launch(kf.fused_mega_moe_kernel, grid, args, meta)
    return timelines if timeline else None


def phase_meta(meta: dict, phase: int, L) -> dict:
    """``kernel_meta``'s keywords ``meta`` for launch ``phase`` of layout ``L``: 0 the one launch (``meta`` itself),
    1 / 2 the front / back launch of a Gluon kind (``PHASE``; the front's row copy ``PULL_BLOCK_H`` columns a step,
    its tasks ``PLACE_BLOCK_PAIRS`` pairs where it only places rows: the FP8 format)."""
    if phase == 0:
        return meta
    m = dict(meta, PHASE=phase)
    if phase == 1:
        m["BLOCK_H"] = largest_pow2_tile(L.hidden, PULL_BLOCK_H)
        if meta["FP8W"]:  # its tasks place rows, the Gluon phase's pull partition copies them
            m["BLOCK_J"] = PLACE_BLOCK_PAIRS
    return m


def _launch_metas(sb, cfg: FusedConfig, *, has_clamp: bool, has_stats: bool, timeline: bool) -> dict:
    """``kernel_meta`` for ``sb``'s layout and ``cfg`` as ``{PHASE: (constexpr keywords, their hashable key)}`` for
    PHASE 0 (the one launch), 1 and 2 (the front and back launches of a Gluon kind), built once per configuration
    and cached on the buffer: a repeated call builds no keyword dict (that was ~25 of the ~65 µs of Python a fused
    call spends on a CPU machine, most of it in ``triton.next_power_of_2``; the key is what ``_check_resident``
    remembers)."""
    pdl = _ws_pdl()

    def build():
        meta = kernel_meta(sb.layout, cfg, has_clamp=has_clamp, has_stats=has_stats, timeline=timeline)
        out = {}
        for phase in (0, 1, 2):
            m = phase_meta(meta, phase, sb.layout)
            if pdl and phase:  # the front triggers, the back is a programmatic dependent (WS_PDL)
                m.update(PDL=True, **({"launch_pdl": True} if phase == 2 else {}))
            frozen = direct_launch.FrozenKeywords(m)
            out[phase] = (frozen, direct_launch.keywords_token(frozen))
        return out

    return _buffer_cache(sb, "_fused_metas", (cfg, has_clamp, has_stats, timeline, interpreting(), pdl,
                                              FP8_WS_MULTICAST), build, limit=64)


def _ws_pdl() -> bool:
    """Whether a Gluon kind's launches are chained by programmatic dependent launch (``WS_PDL``; never under the
    interpreter, which runs no ``griddepcontrol``)."""
    return WS_PDL and not interpreting()


def _pdl_keywords() -> dict:
    """A Gluon GEMM phase's ``PDL`` constexpr and ``launch_pdl`` launch option (both ``_ws_pdl()``)."""
    pdl = _ws_pdl()
    return {"PDL": pdl, "launch_pdl": pdl}


def _tile_table(sb) -> torch.Tensor:
    """The int32 tile table of the Gluon GEMM phase for ``sb``'s rank (``megamoe.kernels.formats.TILE_HEADER``
    words, ``TILE_WORDS`` per tile, one word per pool block, a group word and a group counter per tile, the pair
    table: ``TILE_PAIR_WORDS``), sized for the most pool blocks (of 64 rows); allocated once per buffer."""
    def build():
        L = sb.layout
        blocks = L.num_max_pool_tokens // 64  # the smallest pool block the Gluon phase takes
        n = blocks * (L.intermediate_hidden // 128 + L.hidden // WS_TILE_N.value)
        return torch.zeros(kf.TILE_HEADER.value + (kf.TILE_WORDS.value + 2 + TILE_PAIR_WORDS) * n + blocks + 2,
                           dtype=torch.int32, device=sb.buffer.device)

    return _buffer_cache(sb, "_ws_tiles", 0, build)


def ws_descriptor_specs(kind: str, bm: int, predecode: bool = False, block_n: int = 0) -> dict:
    """Per TMA descriptor argument of a Gluon GEMM phase ("fp8_ws" or "fp4_ws") at pool block ``bm``: ``(Triton
    dtype name, box, shared layout)``. The one home of what the launch builds (``_ws_descriptors``,
    ``_fp4_ws_descriptors``) and what ``megamoe.hopper_compile`` compiles offline. ``predecode`` ("fp4_ws"): the
    weights are ``_predecode``'s e4m3, box [256, 128] in the layout the math reads."""
    from triton.experimental.gluon import language as gl

    bn = WS_TILE_N.value
    lay_a = gl.NVMMASharedLayout.get_default_for([bm, 128], gl.float8e4nv)
    a = ("fp8e4nv", [bm, 128], lay_a)
    words = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)  # flat runs of 32-bit words
    if kind == "fp4_rs":  # the register-operand tile: 32-byte boxes (one K=32 MMA's tokens; half a K block's
        # packed weight rows), 32-byte swizzled; the scale words of a chain's 64 rows
        s32 = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2)
        rows = FP4_RS_ROWS[block_n]
        a, w, ws = ("fp8e4nv", [block_n, 32], s32), ("u8", [rows, 32], s32), ("i32", [rows], words)
        return dict(a1_desc=a, a2_desc=a, w1_desc=w, w2_desc=w, ws1_desc=ws, ws2_desc=ws)
    if kind == "fp4_ws":  # the transformed FP4 weights as bytes, 256 rows x 128 K values; the decode warps read rows
        if predecode:
            w = ("fp8e4nv", [bn, 128], gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv))
        else:
            w = ("u8", [bn, 64], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2))
        ws, as_ = ("i32", [bn], words), ("i32", [bm], words)  # SF_TMA's scale words of the weight and pool rows
        return dict(a1_desc=a, a2_desc=a, w1_desc=w, w2_desc=w, ws1_desc=ws, ws2_desc=ws, as1_desc=as_, as2_desc=as_)
    # one 128 x 128 block of the blocked weights (megamoe.quant_fp8.block_weights) a box: a ring stage's 256 weight
    # rows are two boxes, into the two halves of its [256, 128] buffer (the same 128-byte swizzle)
    w = ("fp8e4nv", [FP8_BLOCK, FP8_BLOCK], gl.NVMMASharedLayout.get_default_for([bn, FP8_BLOCK], gl.float8e4nv))
    # the pools' scales are MN-major [K/128][SP]: one flat float32 run each (the kernel addresses kb * SP + row)
    sa = ("fp32", [bm], words)
    # MC (FP8_WS_MULTICAST): the pools again, half a block's rows a box (a token pair's multicast half, into its half
    # of the A stage: the same layout), and the weights again (the loads that stay in their CTA)
    am = ("fp8e4nv", [bm // 2, 128], lay_a)
    return dict(a1_desc=a, a2_desc=a, w1_desc=w, w2_desc=w, sa1_desc=sa, sa2_desc=sa, a1m_desc=am, a2m_desc=am,
                w1u_desc=w, w2u_desc=w)


def _ws_descriptors(c, L, bm: int):
    """TMA descriptors of one rank's GEMM phase (``megamoe.kernels.gemm_fp8_ws.fp8_gemm_phase_kernel``), cached on
    its buffer by the weights' addresses (a repeated or captured call builds none)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def build(l1, l2):
        f8 = torch.float8_e4m3fn
        spec = ws_descriptor_specs("fp8_ws", bm)
        sa1, sa2 = (c.sb.view(name).t().view(-1) for name in ("l1_acts_sf", "l2_acts_sf"))
        # the weights are blocked by 128 x 128 (megamoe.quant_fp8.block_weights): rows of 128 values, a box a block
        w1, w2 = l1[0].view(f8).reshape(-1, FP8_BLOCK), l2[0].view(f8).reshape(-1, FP8_BLOCK)
        a1, a2 = c.sb.view("l1_acts"), c.sb.view("l2_acts")  # (a*m / w*u: the same tensors again, MC's boxes)
        tensors = dict(a1_desc=a1, a2_desc=a2, w1_desc=w1, w2_desc=w2, sa1_desc=sa1, sa2_desc=sa2, a1m_desc=a1,
                       a2m_desc=a2, w1u_desc=w1, w2u_desc=w2)
        def desc(k):  # (the scales: one flat run, 1-D)
            t, (_, box, layout) = tensors[k], spec[k]
            if t.dim() == 1:
                return TensorDescriptor(t, [t.numel()], [1], box, layout)
            return TensorDescriptor.from_tensor(t, box, layout)

        return tuple(desc(k) for k in spec)

    return _weights_cache(c, "_ws_descs", ("fp8", bm), build)


def _predecode_scratch(c):
    """The predecoded path's scratch for bound call ``c``: ``((folded1 e4m3 [El, 2I, H], exp1 int32 [El, 2I]),
    (folded2 [El, H, I], exp2 [El, H]))``, a workspace kept on the buffer (El x (2I x H + H x I) bytes) and written
    again by every call (``_predecode``), so it is keyed by the weights' shapes, not by the weights: the layers of a
    model that share the buffer share it."""
    def build():
        return tuple((torch.empty((w.shape[0], w.shape[1], 2 * w.shape[2]), dtype=torch.float8_e4m3fn,
                                  device=w.device),
                      torch.empty((w.shape[0], w.shape[1]), dtype=torch.int32, device=w.device))
                     for w in (c.l1[0], c.l2[0]))

    return _buffer_cache(c.sb, "_predecoded", (tuple(c.l1[0].shape), tuple(c.l2[0].shape)), build, limit=0)


def _predecode(c):
    """``megamoe.fold_decode`` of both of ``c``'s weights into ``_predecode_scratch(c)``, on every call (the weights
    are FP4 and may have changed in place); returns the scratch."""
    from megamoe.fold_decode import fold_decode

    scratch = _predecode_scratch(c)
    for weights, (out, row_exp) in zip((c.l1, c.l2), scratch):
        fold_decode(weights, out=out, row_exp=row_exp)
    return scratch


def _fp4_ws_descriptors(c, L, bm: int = 128, predecode: bool = False):
    """TMA descriptors of one rank's FP8 x FP4 GEMM phase (``megamoe.kernels.gemm_fp4_ws.fp4_gemm_phase_kernel``):
    the two pools (e4m3, box [bm, 128]: the pool block), the transformed FP4 weights as bytes (box [256, 64]: 256
    rows x 128 K values), and four flat int32 runs of scale words (``SF_TMA``: both weights' [El][K/128][N], box
    [256]; both pools' [K/128][SP], box [bm]), cached on the buffer by the weights' addresses and the block like
    ``_ws_descriptors``. ``predecode``: the weights are ``_predecode``'s e4m3 scratch instead (box [256, 128], the
    layout the math reads; the kernel takes the predecoded path from their dtype). The packed weights are blocked by
    256 rows x 128 K (``megamoe.quant.block_fp4_weights``): the descriptor sees them as ``[rows, 64]`` bytes, a box
    one block's K block (``megamoe.kernels.gemm_fp4_ws._w_coord``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def build(l1, l2):
        H, I = L.hidden, L.intermediate_hidden
        spec = ws_descriptor_specs("fp4_ws", bm, predecode)
        if predecode:
            (f1, _), (f2, _) = scratch
            w1, w2 = f1.view(-1, H), f2.view(-1, I)
        else:
            w1, w2 = (w[0].view(torch.uint8).reshape(-1, FP4_BLOCK_BYTES) for w in (l1, l2))
        # scale words as flat int32 runs (SF_TMA): the weights' MN-major [El][K/128][N], the pools' [K/128][SP]
        ws1, ws2 = (w[1].transpose(1, 2).view(-1) for w in (l1, l2))
        as1, as2 = (c.sb.view(name).t().view(-1) for name in ("l1_acts_sf", "l2_acts_sf"))
        boxed = dict(a1_desc=c.sb.view("l1_acts"), a2_desc=c.sb.view("l2_acts"), w1_desc=w1, w2_desc=w2)
        flat = dict(ws1_desc=ws1, ws2_desc=ws2, as1_desc=as1, as2_desc=as2)
        return tuple(TensorDescriptor.from_tensor(t, spec[k][1], spec[k][2]) for k, t in boxed.items()) + tuple(
            TensorDescriptor(t, [t.numel()], [1], spec[k][1], spec[k][2]) for k, t in flat.items())

    scratch = _predecode_scratch(c) if predecode else None  # (its address is in the key: it may be re-made)
    return _weights_cache(c, "_ws_descs", ("fp4", bm, scratch and scratch[0][0].data_ptr()), build)


def _run_ws(calls, args_for, G: int, metas, tiles, rank0, L, dev, kind: str = "fp8_ws",
            predecode: bool = False, rs_block_n: int = 0, numerics: str = "hopper", idle: bool = False) -> None:
    """A Gluon kind's call ("fp8_ws", "fp4_ws"): front launch (``G`` programs per local rank), one Gluon GEMM phase
    per local rank (one CTA per SM each; they need no other rank inside, so local ranks take turns), back launch
    (``WS_BACK_PROGRAMS_PER_SM`` programs per SM). ``args_for(G)``: the fused kernel's arguments for G programs per
    local rank; ``numerics``: "fp4_ws"'s (``"hopper"`` or ``"hopper_l2_per_block"``). Under the interpreter (only
    with an explicit ``FusedConfig(kind=...)``: ``fused_config`` picks these kinds on sm_90 GPUs) the GEMM phase is
    its torch model, ``megamoe.gemm_phase``, and both launches have G programs. ``idle``: "fp4_ws"'s
    ``IDLE_DECODE`` (``FusedConfig.idle_decode``)."""
    from megamoe.kernels import gemm_fp8_ws as kws

    (meta, _), (front, front_key), (back, back_key) = metas[0], metas[1], metas[2]
    args, grid = args_for(G), (len(calls) * G,)
    if interpreting():  # CPU ranks: the GEMM phase's torch model between the two interpreted launches
        from megamoe.gemm_phase import run_gemm_phase, run_gemm_phase_fp4

        for c in calls:  # host code only: the Gluon launch's descriptors and keywords are built on CPU CI too
            if kind == "fp4_ws" and rs_block_n:
                _fp4_rs_descriptors(c, L, meta["BM"], rs_block_n)
                _fp4_rs_constexprs(c.sb, meta["BM"], rs_block_n, c.clamp is not None, numerics)
                _fp4_row_maxima(c)
            elif kind == "fp4_ws":
                _fp4_ws_descriptors(c, L, meta["BM"], predecode)
                _fp4_ws_constexprs(c.sb, meta["BM"], c.clamp is not None, predecode, numerics, idle)
                _fp4_row_maxima(c)
            else:
                _ws_descriptors(c, L, meta["BM"])
                _ws_constexprs(c.sb, meta["BM"], c.clamp is not None)
        kf.fused_mega_moe_kernel[grid](*args, **front)
        if kind == "fp4_ws":  # (the predecoded path: the model reads the decode pass's output)
            run_gemm_phase_fp4(calls, tiles, meta["BM"], [_predecode(c) for c in calls] if predecode else None,
                               numerics)
        else:
            run_gemm_phase(calls, tiles, meta["BM"])
        kf.fused_mega_moe_kernel[grid](*args, **back)
        return
    sms = sm_count(dev)
    g_back = max(1, int(WS_BACK_PROGRAMS_PER_SM * sms) // len(calls))
    args_back, grid_back = args_for(g_back), (len(calls) * g_back,)
    _check_resident(args, grid, front, front_key, dev)
    _check_resident(args_back, grid_back, back, back_key, dev)
    direct_launch.launch(kf.fused_mega_moe_kernel, grid, args, front)
    if kind == "fp4_ws":
        if predecode:  # stream order: the decode pass, then the Gluon phase that reads its output
            for c in calls:
                _predecode(c)
        if rs_block_n:
            _launch_fp4_rs(calls, tiles, rank0, L, dev, meta["BM"], rs_block_n, numerics)
        else:
            _launch_fp4_ws(calls, tiles, rank0, L, dev, meta["BM"], predecode, numerics, idle)
        direct_launch.launch(kf.fused_mega_moe_kernel, grid_back, args_back, back)
        return
    timeout_ns = int(calls[0].sb.barrier_timeout_s * 1e9)
    for lr, c in enumerate(calls):
        args = (*_ws_descriptors(c, L, meta["BM"]), c.sb.buffer, c.l1[1], c.l2[1], tiles[lr], c.sb.buffer_ptrs,
                rank0 + lr, float(c.clamp) if c.clamp is not None else 0.0, timeout_ns)
        kw = _ws_constexprs(c.sb, meta["BM"], c.clamp is not None)
        if kw["MC"]:  # clusters of two (grid = clusters): as many as the GPU holds at once, at most one CTA an SM
            direct_launch.launch(kws.fp8_gemm_phase_kernel, (_fp8_ws_clusters(args, kw, dev),), args, kw,
                                 multicast.as_cluster)
        else:
            direct_launch.launch(kws.fp8_gemm_phase_kernel, (sms,), args, kw)
    direct_launch.launch(kf.fused_mega_moe_kernel, grid_back, args_back, back)


_CLUSTERS: dict = {}


def _fp8_ws_clusters(args, kw, dev) -> int:
    """The FP8 GEMM phase's grid in 2-CTA clusters on ``dev``: half its SMs, or fewer where the GPU cannot hold that
    many clusters at once (``cuOccupancyMaxActiveClusters``: the phase's CTAs wait on each other's pulls and L1
    tiles, so every one must be resident). Asked once per (device, keywords)."""
    from megamoe.kernels import gemm_fp8_ws as kws

    key = (str(dev), direct_launch.keywords_token(kw))
    if key not in _CLUSTERS:
        kernel = kws.fp8_gemm_phase_kernel.warmup(*args, grid=(1,), **kw)
        _CLUSTERS[key] = min(sm_count(dev) // multicast.CLUSTER, multicast.max_active_clusters(kernel))
    return _CLUSTERS[key]


def _launch_fp4_ws(calls, tiles, rank0, L, dev, bm: int = 128, predecode: bool = False,
                   numerics: str = "hopper", idle: bool = False) -> None:
    """One FP8 x FP4 Gluon GEMM phase per local rank (one CTA per SM each) at pool block ``bm``, as the FP8 phase in
    ``_run_ws``; ``predecode``: on the weights ``_predecode`` wrote (e4m3 descriptors). The decode partitions take
    each weight row's fold reference from ``_fp4_row_maxima`` (as the register-operand tile)."""
    from megamoe.kernels import gemm_fp4_ws as k4

    sms = sm_count(dev)
    timeout_ns = int(calls[0].sb.barrier_timeout_s * 1e9)
    for lr, c in enumerate(calls):
        rmax1, rmax2 = _fp4_row_maxima(c)
        direct_launch.launch(k4.fp4_gemm_phase_kernel, (sms,), (
            *_fp4_ws_descriptors(c, L, bm, predecode), c.sb.buffer, c.l1[1], c.l2[1], rmax1, rmax2, _fold_lut(dev),
            tiles[lr], c.sb.buffer_ptrs, rank0 + lr, float(c.clamp) if c.clamp is not None else 0.0, timeout_ns),
            _fp4_ws_constexprs(c.sb, bm, c.clamp is not None, predecode, numerics, idle))


def _launch_fp4_rs(calls, tiles, rank0, L, dev, bm: int, block_n: int, numerics: str = "hopper") -> None:
    """One register-operand FP8 x FP4 GEMM phase per local rank (``megamoe.kernels.gemm_fp4_rs``,
    ``FP4_RS_CTAS_PER_SM[block_n]`` persistent CTAs an SM), after this call's weight-row maxima
    (``_fp4_row_maxima``)."""
    from megamoe.kernels import gemm_fp4_rs as krs

    sms = sm_count(dev)
    timeout_ns = int(calls[0].sb.barrier_timeout_s * 1e9)
    for lr, c in enumerate(calls):
        rmax1, rmax2 = _fp4_row_maxima(c)
        sched = _buffer_cache(c.sb, "_fp4_rs_sched", 0, lambda: torch.zeros(4, dtype=torch.int32, device=dev))
        sched.zero_()  # the phase's tile counter (a memset: an interrupted call leaves nothing for the next)
        direct_launch.launch(krs.fp4_rs_gemm_phase_kernel, (FP4_RS_CTAS_PER_SM[block_n] * sms,), (
            *_fp4_rs_descriptors(c, L, bm, block_n), c.sb.buffer, rmax1, rmax2, _fold_lut(dev), tiles[lr], sched,
            c.sb.buffer_ptrs, rank0 + lr, float(c.clamp) if c.clamp is not None else 0.0, timeout_ns),
            _fp4_rs_constexprs(c.sb, bm, block_n, c.clamp is not None, numerics))


def _fp4_row_maxima(c):
    """Each weight row's largest UE8M0 byte over all of K, uint8 ``(rmax1 [El*2I], rmax2 [El*H])`` (the fold's
    reference of both FP8 x FP4 Gluon tiles) from bound call ``c``'s transformed scales, by
    ``megamoe.fold_decode.row_maxima`` (one read of the scales: ~100 MB for one EP8 rank of V4-Pro, 71 us on an
    H200), kept on the buffer and made again only when the scales are other tensors or were changed in place since
    (torch's version counter of each scale tensor is part of the key; a tensor without one -- made under
    ``torch.inference_mode`` -- is read on every call), one entry per weight set (``_weights_cache``: the layers of
    a model that share the buffer each keep theirs). (Two torch ``amax`` reductions over the byte view took
    181 + 146 us a call: ``results/probes/fp4_rs_profile_h200.jsonl``.)"""
    from megamoe.fold_decode import row_maxima

    def build(l1, l2):
        return [torch.empty(w[1].shape[0] * w[1].shape[1], dtype=torch.uint8, device=w[1].device)
                for w in (l1, l2)] + [None]

    entry = _weights_cache(c, "_fp4_rmax", None, build)
    key = (_tensor_version(c.l1[1]), _tensor_version(c.l2[1]))
    if entry[2] != key or None in key:
        for w, out in zip((c.l1, c.l2), entry):
            row_maxima(w[1], out=out)
        entry[2] = key
    return entry[0], entry[1]


def _tensor_version(t):
    """torch's version counter of ``t`` (it counts in-place changes), or None for a tensor that tracks none (made
    under ``torch.inference_mode``): a cache keyed by it must then be refreshed on every call."""
    try:
        return t._version
    except RuntimeError:
        return None


def _fp4_rs_descriptors(c, L, bm: int, block_n: int):
    """TMA descriptors of one rank's register-operand GEMM phase (``megamoe.kernels.gemm_fp4_rs``): the two pools
    (e4m3, box ``[block_n, 32]``), the transformed FP4 weights as bytes (box ``[64, 32]``), both weights' scale
    words as flat int32 runs (box ``[64]``); cached on the buffer like ``_fp4_ws_descriptors``. The weights are
    blocked (``megamoe.quant.block_fp4_weights``): the descriptor sees them as ``[rows, 64]`` bytes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def build(l1, l2):
        spec = ws_descriptor_specs("fp4_rs", bm, block_n=block_n)
        w1, w2 = (w[0].view(torch.uint8).reshape(-1, FP4_BLOCK_BYTES) for w in (l1, l2))
        ws1, ws2 = (w[1].transpose(1, 2).view(-1) for w in (l1, l2))
        boxed = dict(a1_desc=c.sb.view("l1_acts"), a2_desc=c.sb.view("l2_acts"), w1_desc=w1, w2_desc=w2)
        flat = dict(ws1_desc=ws1, ws2_desc=ws2)
        return tuple(TensorDescriptor.from_tensor(t, spec[k][1], spec[k][2]) for k, t in boxed.items()) + tuple(
            TensorDescriptor(t, [t.numel()], [1], spec[k][1], spec[k][2]) for k, t in flat.items())

    return _weights_cache(c, "_ws_descs", ("fp4_rs", bm, block_n), build)


def _fp4_rs_constexprs(sb, bm: int, block_n: int, has_clamp: bool, numerics: str = "hopper") -> dict:
    """``fp4_rs_keywords`` for ``sb``'s layout, cached on the buffer (as ``_fp4_ws_constexprs``)."""
    return _buffer_cache(sb, "_ws_constexprs", ("fp4_rs", bm, block_n, has_clamp, _ws_pdl(), numerics),
                         lambda: direct_launch.FrozenKeywords(fp4_rs_keywords(sb.layout, bm, block_n, has_clamp,
                                                                              numerics)))


def fp4_rs_keywords(L, bm: int, block_n: int, has_clamp: bool, numerics: str = "hopper") -> dict:
    """The constexpr and launch keywords of ``megamoe.kernels.gemm_fp4_rs.fp4_rs_gemm_phase_kernel`` for layout
    ``L``, pool block ``bm`` and token chunk ``block_n``: buffer offsets, shapes, ``fp4_rs_stages``, the loader's
    registers, ``num_warps`` 4 and ``maxnreg`` ``fp4_rs_maxnreg(block_n)``; ``L2_FOLDED`` from ``numerics``
    (:func:`megamoe.reference.l2_folded`)."""
    offs = _offsets(L)
    return dict(
        {k: offs[k] for k in _FP4_WS_OFFSETS}, T=L.num_max_tokens_per_rank, H=L.hidden, I=L.intermediate_hidden,
        SP=L.num_padded_sf_pool_tokens, BM=bm, HAS_CLAMP=has_clamp, STAGES=fp4_rs_stages(block_n),
        LOAD_REGS=FP4_RS_LOAD_REGS[block_n], KW2_PAD=triton.next_power_of_2(L.intermediate_hidden // 128),
        PAIR=FP4_RS_PAIR[block_n], L2_FOLDED=l2_folded(numerics),
        num_warps=fp4_rs_num_warps(block_n), maxnreg=fp4_rs_maxnreg(block_n), **_pdl_keywords())


def _fp4_ws_constexprs(sb, bm: int, has_clamp: bool, predecode: bool, numerics: str = "hopper",
                       idle: bool = False) -> dict:
    """The constexpr and launch keywords of ``megamoe.kernels.gemm_fp4_ws.fp4_gemm_phase_kernel`` for ``sb``'s
    layout at pool block ``bm`` (``fp4_ws_keywords``); built once per (block, clamp, predecode, idle) and cached on the
    buffer, as ``_ws_constexprs``. The key holds every module setting ``fp4_ws_keywords`` reads at ``bm``, so a probe
    or test that changes one on a live buffer gets new keywords."""
    settings = (FP4_WS_STAGES[bm], FP4_WS_REGS[bm], FP4_WS_PREFETCH[bm], FP4_WS_SF_TMA[bm], FP4_WS_DECODE_HALVES[bm],
                FP4_WS_FOLD_ONCE[bm], WS_GROUP_SYNC["fp4_ws"])  # (IDLE_DECODE: ``idle``, the config)
    key = ("fp4", bm, has_clamp, predecode, _ws_pdl(), settings, numerics, idle)
    return _buffer_cache(sb, "_ws_constexprs", key, lambda: direct_launch.FrozenKeywords(
        fp4_ws_keywords(sb.layout, bm, has_clamp, predecode, numerics, idle)))


def fp4_ws_keywords(L, bm: int, has_clamp: bool, predecode: bool = False, numerics: str = "hopper",
                    idle: bool | None = None) -> dict:
    """The constexpr and launch keywords of ``megamoe.kernels.gemm_fp4_ws.fp4_gemm_phase_kernel`` for layout ``L``
    at pool block ``bm`` (64 or 128): the buffer offsets, shapes, ``FP4_WS_STAGES`` / ``FP4_WS_REGS`` /
    ``FP4_WS_PREFETCH`` / ``FP4_WS_SF_TMA`` / ``FP4_WS_DECODE_HALVES`` / ``FP4_WS_FOLD_ONCE`` /
    ``FP4_WS_IDLE_DECODE`` at ``bm``, ``num_warps`` and ``maxnreg``.
    What a launch passes, and what ``megamoe.hopper_compile`` compiles offline. ``predecode``: the phase streams
    ``_predecode``'s e4m3 weights, so no weight scale words are prefetched (``PREFETCH`` off). ``numerics``:
    ``L2_FOLDED`` (:func:`megamoe.reference.l2_folded`). ``idle``: ``IDLE_DECODE`` (``FusedConfig.idle_decode``;
    None: FP4_WS_IDLE_DECODE at ``bm``, as an offline compile asks), where the tile can run it."""
    offs = _offsets(L)
    H, I = L.hidden, L.intermediate_hidden
    # (the halves decode from the stage's TMA'd scale words: with SF_TMA off, e.g. in a probe, the chunked decode)
    halves = FP4_WS_DECODE_HALVES[bm] and FP4_WS_SF_TMA[bm]
    # (the fold once is a fold of the L2 A operand: none to do where the numerics do not fold it)
    fold_once = FP4_WS_FOLD_ONCE[bm] and l2_folded(numerics)
    # (the idle warpgroup's decode takes a half of the two-halves stage; predecoded calls decode nothing)
    idle = (FP4_WS_IDLE_DECODE[bm] if idle is None else idle) and halves and not predecode and not fold_once
    math_regs, load_regs, decode_regs, maxnreg = FP4_WS_REGS[bm]
    return dict(
        {k: offs[k] for k in _FP4_WS_OFFSETS + ("OFF_ARRIVAL",)}, T=L.num_max_tokens_per_rank, H=H, I=I,
        SP=L.num_padded_sf_pool_tokens, HAS_CLAMP=has_clamp, STAGES=FP4_WS_STAGES[bm], MATH_REGS=math_regs,
        LOAD_REGS=load_regs, DECODE_REGS=decode_regs, KW2_PAD=triton.next_power_of_2(I // 128),
        PREFETCH=FP4_WS_PREFETCH[bm] and not predecode,
        SF_TMA=FP4_WS_SF_TMA[bm], GROUP_SYNC=WS_GROUP_SYNC["fp4_ws"], num_warps=4, maxnreg=maxnreg,
        DECODE_HALVES=halves, FOLD_ONCE=fold_once, L2_FOLDED=l2_folded(numerics),
        IDLE_DECODE=bool(idle),
        **_pdl_keywords())


#: The workspace and buffer offsets both FP8 x FP4 Gluon GEMM phases take (``_offsets`` names; the decode-partition
#: tile also ``OFF_ARRIVAL``, for ``FP4_WS_FOLD_ONCE``).
_FP4_WS_OFFSETS = ("OFF_GRID", "OFF_STATE", "OFF_L2_MASK", "OFF_L1_SF", "OFF_L1_W", "OFF_L2", "OFF_L2_SF", "OFF_META",
                   "OFF_COMBINE")


#: The workspace and buffer offsets the Gluon GEMM phase takes (``_offsets`` names).
_WS_OFFSETS = ("OFF_GRID", "OFF_STATE", "OFF_L2_MASK", "OFF_ARRIVAL", "OFF_X", "OFF_X_SF", "OFF_L1", "OFF_L1_SF",
               "OFF_L1_W", "OFF_L2", "OFF_L2_SF", "OFF_META", "OFF_COMBINE")


def _ws_constexprs(sb, bm: int, has_clamp: bool) -> dict:
    """The constexpr and launch keywords of ``megamoe.kernels.gemm_fp8_ws.fp8_gemm_phase_kernel`` for ``sb``'s
    layout at pool block ``bm`` (``fp8_ws_keywords``); built once per (block, clamp) and cached on the buffer (no
    per-call work)."""
    key = ("fp8", bm, has_clamp, _ws_pdl(), FP8_WS_LEAD, WS_GROUP_SYNC["fp8_ws"], FP8_WS_MULTICAST, FP8_WS_BULK,
           FP8_WS_COPIER, FP8_WS_STAGES[bm])
    return _buffer_cache(sb, "_ws_constexprs", key,
                         lambda: direct_launch.FrozenKeywords(fp8_ws_keywords(sb.layout, bm, has_clamp)))


def fp8_ws_keywords(L, bm: int, has_clamp: bool) -> dict:
    """The constexpr and launch keywords of ``megamoe.kernels.gemm_fp8_ws.fp8_gemm_phase_kernel`` for layout ``L``
    at pool block ``bm`` (64 or 128), as ``fp4_ws_keywords``."""
    offs = _offsets(L)
    math_regs, load_regs, pull_regs, maxnreg = FP8_WS_REGS
    return dict(
        {k: offs[k] for k in _WS_OFFSETS}, T=L.num_max_tokens_per_rank, H=L.hidden, I=L.intermediate_hidden,
        SP=L.num_padded_sf_pool_tokens, HAS_CLAMP=has_clamp, STAGES=fp8_ws_stages(bm), MATH_REGS=math_regs,
        LOAD_REGS=load_regs, PULL_WARPS=FP8_WS_PULL_WARPS, PULL_REGS=pull_regs, PULL_CHUNK=FP8_WS_PULL_CHUNK,
        LEAD=fp8_ws_stages(bm) if FP8_WS_LEAD and bm == 128 else 0, GROUP_SYNC=WS_GROUP_SYNC["fp8_ws"],
        MC=fp8_ws_multicast("fp8_ws", bm), BULK=fp8_ws_bulk(bm), COPIER=FP8_WS_COPIER, num_warps=4, maxnreg=maxnreg,
        **_pdl_keywords())


def fp8_ws_bulk(bm: int) -> bool:
    """Whether the FP8 Gluon phase at pool block ``bm`` stages its L2 epilogue (``FP8_WS_BULK``: block 128 only)."""
    return FP8_WS_BULK and bm == 128


def fp8_ws_stages(bm: int) -> int:
    """Ring stages of the FP8 Gluon phase at pool block ``bm``: ``FP8_WS_STAGES``, one fewer where it stages its
    L2 epilogue (:func:`fp8_ws_bulk`: the staging takes that stage's shared memory)."""
    return FP8_WS_STAGES[bm] - fp8_ws_bulk(bm)


#: (device, grid, constexprs) launches already checked by ``_check_resident``.
_RESIDENT_OK: set = set()
#: Per-SM limits of sm_90 (H100 / H200), used where torch does not report them.
_SM90_LIMITS = {"regs_per_multiprocessor": 65536, "shared_memory_per_multiprocessor": 233472,
                "max_threads_per_multi_processor": 2048}


def max_resident_programs(n_regs: int, shared_bytes: int, num_warps: int, props) -> int:
    """Programs of one compiled kernel that fit on one SM at once: registers (allocated per warp in units of 256),
    shared memory (+1 KiB the driver reserves per block) and threads."""
    limit = {k: getattr(props, k, v) for k, v in _SM90_LIMITS.items()}
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = limit["regs_per_multiprocessor"] // (regs_per_warp * num_warps)
    by_smem = limit["shared_memory_per_multiprocessor"] // (shared_bytes + 1024)
    by_threads = limit["max_threads_per_multi_processor"] // (32 * num_warps)
    return min(by_regs, by_smem, by_threads, 32)


def _check_resident(args, grid, meta, meta_key, device) -> None:
    """Refuse, before it launches, a fused grid whose programs cannot all be resident at once: they meet in grid
    syncs, so one program left waiting for an SM dead-locks the launch until the in-kernel timeout. Compiles (or
    finds) the kernel without running it; checked once per (device, grid, constexprs); ``meta_key``: the constexprs
    ``meta`` as a hashable key (``_launch_metas``: ``direct_launch.keywords_token``)."""
    key = (device, grid, meta_key)
    if key in _RESIDENT_OK:
        return
    kernel = kf.fused_mega_moe_kernel.warmup(*args, grid=grid, **meta)
    kernel._init_handles()
    props = torch.cuda.get_device_properties(device)
    per_sm = max_resident_programs(kernel.n_regs, kernel.metadata.shared, meta["num_warps"], props)
    if grid[0] > per_sm * props.multi_processor_count:
        raise RuntimeError(
            f"fused kernel: {grid[0]} programs cannot all be resident on {props.multi_processor_count} SMs: at "
            f"{kernel.n_regs} registers/thread, {kernel.metadata.shared} B shared memory and {meta['num_warps']} warps "
            f"an SM holds {per_sm}; lower programs_per_rank, num_stages or the register cap (FusedConfig)")
    _RESIDENT_OK.add(key)


__all__ = ["FusedConfig", "fused_config", "run_fused", "unsupported_reason", "expected_tokens_per_expert",
           "TIMELINE_KINDS", "kernel_meta"]
