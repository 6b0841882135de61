#!/usr/bin/env bash
# The GPU work of one `device` call, as named steps, run from the repository root on the device machine:
#
#     bash results/probes/device_run.sh STEP [STEP ...]        (each step's log and files under $OUT)
#
# Steps (seconds measured on the H200 where known; a call has 600 s, a session 1800 s of device time):
#   install        megamoe into the machine's python3 (no network: --no-deps --no-build-isolation), papermill
#                  from .whl when carried; prints the versions (~20 s)
#   probes         fp8_ws_probe.py threshold / fp4_threshold / host: which tile kind each T should take and where
#                  the host's enqueue time goes (-> $OUT/probes.jsonl, appended row by row; 22 buffers of V4-Pro
#                  size and the kernels' first compiles: estimated 5-8 min, not yet timed -- run it in its own call)
#   gputests       tests/gpu (the whole suite; failures in the output's tail). Longer than one call: session 39 ran
#                  it on an H100 in three calls of 531 / 291 / ~400 s, so run its three parts in three calls:
#   gputests_1     tests/gpu: the CuPy primitives and both FP8 x FP4 Gluon tiles' files (97 tests in 531 s, H100,
#                  session 39)
#   gputests_2     tests/gpu: the FP8 x FP8 file, the one-launch fused kernel, the staged path, the transforms' memory
#                  (~59 tests; 55 of them in 291 s, H100, session 39)
#   gputests_3     tests/gpu: everything else (reliability, symm, weight cache, launch options, l2_per_block; the
#                  notebooks only with papermill carried; not timed as one part)
#   gputests_fp8   tests/gpu/test_fp8_gpu.py (the FP8 x FP8 format's staged and fused paths; not timed alone yet)
#   gputests_quick the GPU tests of the kinds the bench times (fused FP8, both FP8 x FP4 tiles, graph capture; ~120 s
#                  before the register-operand tile's were added; 31 tests in 440 s, session 29)
#   rs_pair        fused_fp8_ws_profile.py at T = 8, 32 with 2 and 4 weight chains a token stage (FP4_RS_PAIR at
#                  chunks 8 / 16), alternating twice (-> $OUT/rs_pair.jsonl; not timed)
#   gputests_wide  tests/gpu/test_fp4_rs_gpu.py -k wide (the chunk-128 tile: 5 small cases, T = 512 / 2048)
#   rs_wide        fused_fp8_ws_profile.py: the chunk-128 tile (and chunk 64 on 128-row chains at T = 512) against the
#                  decode-partition tile at T = 512, 2048
#                  (-> $OUT/rs_wide.jsonl)
#   idle           FP4_WS_IDLE_DECODE: its GPU tests, fp8_ws_probe.py idle_decode at T = $IDLE_TOKENS (512,1024,2048),
#                  the layer bench at T = 512 on the decode-partition tile with it on (not timed)
#   defaults       the GPU tests of numerics="auto" (the default since session 35: "hopper" on the fused path):
#                  MegaMoE at T = 128 in every numerics, the fused interrupt repair in both, the slow-but-live rank
#                  in "exact" (not timed; est. 1-2 min)
#   epilogue       fp8_ws_probe.py phase at T = $EPI_TOKENS (512,2048,8192): the FP8 Gluon phase as it is against
#                  session 35's two epilogue changes undone one at a time (guarded SwiGLU / bf16 rounding, the L2
#                  rows' destinations made per half), alternating twice; bits compared (-> $OUT/epilogue.jsonl;
#                  not timed: 4 variants x 3 T, each a compile and a timing)
#   ws_tests       test_fp4_ws_gpu.py block-128 small cases, IDLE_DECODE at T = 512 / 384, graph at 512; one EP8 rank
#                  at T = 512 in hopper_l2_per_block (not timed)
#   host           fp8_ws_probe.py host at T = $HOST_TOKENS (8,128): the host's enqueue time of one eager call,
#                  with megamoe.direct_launch on and off and its C-launcher hits (RAW) off, and its cProfile
#                  (-> $OUT/host.jsonl; not timed)
#   layer_fp8      python -m megamoe.bench --suite layer_fp8, DeepGEMM's kit (when .peers is carried), merged
#                  (-> $OUT/layer_fp8_h200.json with the kit's rows, $OUT/dg_layer_fp8.json; ~170 s)
#   layer          the same for --suite layer (FP8 x FP4; -> $OUT/layer_h200.json, $OUT/dg_layer.json; ~200 s;
#                  120 s with the kit in session 18)
# At most 8 files come back from $OUT: logs go to the output, whose last 12,000 characters come back.
#   notebooks      python -m megamoe.notebooks run (needs papermill from .whl)
#   clocks         clock_probe.py: SM clock, power, throttle reasons while the fused call runs eager / as a graph, with
#                  and without the L2 flush, both formats at T = 2048 / 8192 (-> $OUT/clocks.jsonl; est. 2-3 min)
#   ceiling        clock_probe.py at T = 8192: cuBLAS's dense FP8 GEMMs of the layer's FLOPs (per-tensor and block
#                  scales) beside the fused FP8 call, clocks and power sampled (-> $OUT/ceiling.jsonl; est. 2 min)
#   exact_bisect   exact_bisect.py over the trees in .bisect (carry it), A B C twice, H200 only (-> $OUT/
#                  exact_bisect.jsonl; est. 3-4 min)
#   halfw          fp8_ws_probe.py phase 8192 with 3 s windows: as is, halfw, now, nomma, noepi, nopromote (the FP8
#                  phase's knock-outs at the power cap; -> $OUT/phase8192.jsonl; ~45 s on an H100, session 43)
#   multicast      multicast_probe.py: the 2-CTA weight multicast toy against its unicast twin at three K
#                  (-> $OUT/multicast.jsonl; ~25 s)
#   mc_tests       tests/gpu/test_ws_launch_options_gpu.py's FP8_WS_MULTICAST cases, FP8 (not timed)
#   mc             fp8_ws_probe.py multicast at T = $MC_TOKENS (512,2048,8192): the 2-CTA weight multicast off / on
#                  twice, bits compared (-> $OUT/mc.jsonl; not timed)
#   sync_fp8       fp8_ws_probe.py sync_fp8 at T = $SYNC_TOKENS (2048,8192): the FP8 phase's group sync off / on twice
#                  (-> $OUT/sync_fp8.jsonl; not timed)
#   gputests_fp4   tests/gpu: the CuPy primitives and the FP8 x FP4 Gluon file (the decode-partition tile only;
#                  48 tests in 278 s, session 17)
#   fp4_rs         fp4_rs_probe.py run: the register-operand FP4 decode probe, its CONFIGS at both shapes (-> $OUT/
#                  fp4_rs.jsonl; ~15 s a run of 5 configs x 2 shapes, session 17)
#   gputests_decode tests/gpu: the staged, one-launch Triton, decode-partition and fold_decode kernels' files (every
#                  FP4 word decoder but the register-operand tile's; 51 tests in 365 s, session 26)
#   gputests_rs    tests/gpu/test_fp4_rs_gpu.py (the register-operand FP4 tile; stops at the first failure; 21 tests
#                  in 123-163 s, session 18)
#   layer_rs       python -m megamoe.bench --suite layer at T = 8, 32, 128, 256 (no kit; -> $OUT/layer_h200.json;
#                  56 s, session 18)
#   rs_sweep       fused_fp8_ws_profile.py: the register-operand tile's GEMM phase at T = 8, 32, 128, 256 (forced past
#                  FP4_RS_MAX_EXPECTED; chunks 16 / 32 forced at 128, 256) and the decode-partition tile's (-> $OUT/
#                  rs_sweep.jsonl): where the threshold belongs (not yet timed)
#   weights_cache  tests/gpu/test_weights_cache_gpu.py (new scale words beside the same packed FP4 weights, both FP8 x FP4
#                  tiles; session 22, not yet run: est. 1 min)
#   launch_options tests/gpu/test_ws_launch_options_gpu.py (the Gluon kinds' launch options on and off: same bits; ~80 s)
#   ws_regs        FP4_WS_REGS[128] as is against 200 / 24 / 88 (decode-partition tile, T = 512 / 2048; not timed)
#   group_sync     WS_GROUP_SYNC: GPU tests, off / on at T = 512 / 2048 / 8192, both formats (-> $OUT/group_sync.jsonl;
#                  not timed: ~24 rows of a fresh V4-Pro buffer each + 8 profile runs, est. 4-6 min)
#   rs_ctas        the register-operand tile as is against FP4_RS_CANDIDATES at the chunk each T takes (T = 128:
#                  c2p4): its GPU tests (-k rs_variant), then whole calls alternating with their error
#                  (-> $OUT/rs_ctas.jsonl; 224 s for 8 candidates' 24 tests and rows at T = 8 / 32 / 128 / 512 in
#                  session 24)
#   rs_variant_sweep  the register-operand tile's GEMM phase at T = 256 / 512 / 1024 / 2048 (forced past
#                  FP4_RS_MAX_EXPECTED at chunk 64: as is and each chunk-64 candidate of FP4_RS_CANDIDATES) against
#                  the decode-partition tile's (-> $OUT/rs_variant_sweep.jsonl; 94 s in session 24)
#   rs_threshold   FP4_RS_MAX_EXPECTED: the GPU test of the register-operand tile at T = 1024, then whole calls at
#                  T = $RS_THRESHOLD_TOKENS (512, 1024) with the tile at chunk 64 against the decode-partition tile,
#                  alternating twice, also timed back to back without the L2 flush (-> $OUT/rs_threshold.jsonl; 54 s
#                  at T = 1024 without that, session 24)
#   back_programs  the back launch at 1 / 4 programs an SM: its GPU tests (same bits), then whole calls alternating
#                  at T = 8 ... 8192, both formats, with the error (-> $OUT/back_programs.jsonl; 40 rows, 159 s in session 22)
#   ncu            Nsight Compute sections of one fused call's launches per case (-> $OUT/ncu_<fmt>_<T>.txt; not timed)
#   ncu_source     Nsight Compute's PC sampling of the GEMM phase alone, per SASS instruction (which instructions the
#                  warps stall at, and why: e.g. the FP8 phase's barrier stall at T = 8192, pull warps or math
#                  warpgroups?; the decode-partition phase's excess shared wavefronts at T = 2048, which
#                  instructions?) -> $OUT/ncu_src_<fmt>_<T>.ncu-rep and its source page as CSV, gzipped
#                  (NCU_SOURCE_CASES, default "fp8:8192 fp8_fp4:2048": 4 files; not yet run)
#   halves         FP4_WS_DECODE_HALVES: its GPU tests, then whole calls off / on / off / on at T = 512 ... 8192 and the
#                  register-operand tile at T = 512 (-> $OUT/halves.jsonl; 174 s in session 29)
#   fold_tests     FP4_WS_FOLD_ONCE and the weight-row maxima of the decode-partition tile: tests/gpu/test_fp4_ws_gpu.py
#                  and the launch-options test of the fold, off / on (not yet timed)
#   fold_once      fp8_ws_probe.py fold_once: off / on / off / on at T = 512, 2048, 8192 and the register-operand tile at
#                  T = 512 (-> $OUT/fold_once.jsonl); then the layer bench at T = 512 (uniform, skewed) with
#                  FP4_RS_MAX_EXPECTED = 32 (-> $OUT/thr32/layer_h200.json; not yet timed)
#   t512_ws        the layer bench at T = 512 (uniform and skewed) with FP4_RS_MAX_EXPECTED = 32, i.e. the
#                  decode-partition tile at block 128 instead of the register-operand tile (-> $OUT/t512_ws/
#                  layer_h200.json; ~35 s est.): whether the hand-over can move to 32 now that the tile reads the row
#                  maxima once per weight set (uniform 1130 against 1229 us in session 30's probe rows; skewed unmeasured)
#   direct_tests   tests/gpu/test_direct_launch_gpu.py: every kernel of a fused call recognised by
#                  megamoe.direct_launch (hits straight into Triton's C launcher, TMA descriptors encoded once), the
#                  bits equal with RAW off / ENABLED off / a CUDA graph, both formats (session 32: the C-launcher hits
#                  were built without a device; run this before any timing; est. 3 min: ~10 compiles at its small shape)
#   l2pb_tests     numerics="hopper_l2_per_block" (no L2 A fold; each K block's token scales in the per-K-block add) in
#                  every FP8 x FP4 Hopper tile: tests/gpu/test_l2_per_block_gpu.py (small cases, the two modes bit for
#                  bit where the fold is exact, one EP8 rank at T = 8 ... 8192, CUDA graphs; not yet timed, est. 5 min)
#   l2pb           fp8_ws_probe.py l2_per_block: "hopper" against "hopper_l2_per_block" alternating twice at T = 128,
#                  512, 2048, 8192, the host's tile, and at T = 512 the decode-partition tile too
#                  (-> $OUT/l2_per_block.jsonl; est. 2-3 min)
#   stage_profile  stage_profile_probe.py: per-stage cycles of each role of the decode-partition tile (block 128
#                  forced) at T = $STAGE_TOKENS (512,2048,8192) in the configs $STAGE_CONFIGS (ws128; also ws128_idle,
#                  *_pb, host, ws64) (-> $OUT/stage_profile.jsonl; ~20 s a row)
#   fp8_profile    stage_profile_probe.py fp8: the FP8 phase (block 128, as the host runs it) at T = $FP8_PROF_TOKENS
#                  (2048,8192), under megamoe.fused constants $FP8_PROF_SETTINGS (JSON, e.g. '{"FP8_WS_LEAD": true}'):
#                  each math warpgroup's cycles per L1 / L2 tile in ready waits, MMAs and epilogues (the staged L2
#                  epilogue in parts: conversion, wait for the staging rows, staging stores, and with FP8_WS_COPIER
#                  off the copies; the L1 epilogue in three: quantisation, stores, publish), the loader's waits, the
#                  copier's waits / issue / read-waits per L2 tile (-> $OUT/fp8_profile.jsonl; ~30 s for
#                  512,2048,8192 on an H100; 20 s for 2048,8192 under the copier, session 51)
#   gputests_fp4_readers  the GPU tests of every kernel that reads the transformed FP4 weights, smallest first: both
#                  Gluon tiles' small cases (clamp, I = 640), fold_decode against the CPU pass, the one-launch and staged
#                  kernels' small cases (H = 384: a shorter last 256-row block), predecoded / real-size calls, a CUDA
#                  graph (23 tests in 262 s on an H100, session 37: run it after any change of the weight layout)
#   knockout       ws_variants_probe.py knockout at T = $KO_TOKENS (512,128,2048): whole calls with the decode partition's
#                  fold tables computed (as is; error against the model) / gathered (bits compared), then without the
#                  table, the fence, the W decode, the decode, the wgmma ($KNOCKOUTS; -> $OUT/knockout.jsonl; not
#                  timed: 7 compiles)
#   words          ws_variants_probe.py knockout2 with KNOCKOUTS as_is,words,lds_ahead (twice) at T = $WORDS_TOKENS
#                  (512,2048): session 41's exact int32-word decode variants, bits compared with as is
#                  (-> $OUT/words.jsonl; 31 s on an H100, session 42: both slower, results/README.md)
#   knockout2      ws_variants_probe.py knockout2 at T = $KO2_TOKENS (512,2048), in the default GPU numerics: no packed-W
#                  load in the decode warps, no packed-W TMA, both, no token TMA, half the wgmma, against the whole W
#                  decode and wgmma knocked out (session 40: which shared-memory stream the decode and the MMA contend
#                  for; -> $OUT/knockout2.jsonl; not timed: 8 compiles, each compiled offline first)
#   profile        fused_fp8_ws_profile.py: front / Gluon phase / back launch times and the gaps, both formats at
#                  T = 32, 128, 512, as they are and with 32 front programs / a quarter of the SMs in the back launch
#                  (-> $OUT/profile.jsonl; 8 processes, each a V4-Pro buffer: not yet timed, est. 3 min)
#
# Commit: pass MEGAMOE_GIT_COMMIT=<this checkout's short HEAD> in the call's command, written out as a literal
# (a `$(git rev-parse ...)` in the command runs on the device machine, whose copy's HEAD was stale in session 15
# too: two results files had to be corrected by hand). The device copy's own git HEAD
# was seen stale (session 13: it read 5bcfb3e while the working tree was 181923a), and the bench's provenance takes
# this variable first.
# Carry: [".peers", ".whl"] -- .peers/deepgemm_sm90 a copy of ../shared/peers/deepgemm_sm90 (the kit), .whl the
# papermill wheels (`notebooks`). Both are ignored by git (.gitignore); copy them in before the call.
set -u -o pipefail  # (a step's "pytest ... | tail || return 1" fails with pytest)
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MEGAMOE_GIT_COMMIT="${MEGAMOE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
OUT="${OUT:-/tmp/megamoe-out}"
mkdir -p "$OUT"
PY=python3
status=0

step_install() {
    if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            && export PYTHONPATH=/tmp/site
    fi
    $PY -m pip install -q --no-deps --no-build-isolation -e . || return 1
    $PY -c "import megamoe, torch, triton; print('megamoe', megamoe.describe_environment())"
}

step_probes() {
    for mode in "threshold 32,128,256" "fp4_threshold 8,32,2048" "host 128,512"; do
        # shellcheck disable=SC2086
        $PY results/probes/fp8_ws_probe.py $mode >>"$OUT/probes.jsonl" || return 1
    done
}

step_gputests() { $PY -m pytest tests/gpu -q -rfE; }

GPUTESTS_1="tests/gpu/test_cupy_prims.py tests/gpu/test_fp4_ws_gpu.py tests/gpu/test_fp4_rs_gpu.py"
GPUTESTS_2="tests/gpu/test_fp8_gpu.py tests/gpu/test_fused_gpu.py tests/gpu/test_mega_moe_gpu.py
            tests/gpu/test_transform_memory_gpu.py"
# shellcheck disable=SC2086
step_gputests_1() { $PY -m pytest -q -rfE $GPUTESTS_1; }
# shellcheck disable=SC2086
step_gputests_2() { $PY -m pytest -q -rfE $GPUTESTS_2; }
# shellcheck disable=SC2086
step_gputests_3() { $PY -m pytest -q -rfE tests/gpu $(printf -- "--ignore=%s " $GPUTESTS_1 $GPUTESTS_2); }

step_gputests_fp8() { $PY -m pytest -q -rfE tests/gpu/test_fp8_gpu.py; }

step_gputests_rs() { $PY -m pytest -q -x -rfE tests/gpu/test_fp4_rs_gpu.py; }

# the GPU tests of every kernel that decodes the transform's FP4 words besides the register-operand tile: the staged
# kernels, the one-launch Triton kernel, the decode-partition tile and fold_decode (the predecoded path)
step_gputests_decode() {
    $PY -m pytest -q -rfE tests/gpu/test_mega_moe_gpu.py tests/gpu/test_fused_gpu.py tests/gpu/test_fp4_ws_gpu.py \
        -k "not one_process_per_gpu"
}

step_weights_cache() { $PY -m pytest -q -rfE tests/gpu/test_weights_cache_gpu.py; }

step_layer_rs() { $PY -m megamoe.bench --suite layer --tokens 8,32,128,256 --out "$OUT"; }

step_rs_sweep() {  # the register-operand tile's phase at T = 8..512 whatever the threshold, chunks as the host picks
    # them (8 / 16 / 32 / 64 / 64) and forced to 16 / 32 / 64, and the decode-partition tile's (-> $OUT/rs_sweep.jsonl;
    # 52 s for T <= 256, session 19)
    local bn
    FP4_RS_MAX_EXPECTED=1000 FP4_BLOCK64_MAX_EXPECTED=1000 $PY results/probes/fused_fp8_ws_profile.py 8,32,128,256,512 \
        fp8_fp4 \
        >>"$OUT/rs_sweep.jsonl" || return 1
    for bn in ${RS_SWEEP_CHUNKS:-16 32 64}; do
        FP4_RS_MAX_EXPECTED=1000 FP4_BLOCK64_MAX_EXPECTED=1000 FP4_RS_BLOCK_N=$bn \
            $PY results/probes/fused_fp8_ws_profile.py 128,256,512 fp8_fp4 \
            >>"$OUT/rs_sweep.jsonl" || return 1
    done
    FP4_RS_MAX_EXPECTED=-1 $PY results/probes/fused_fp8_ws_profile.py ${RS_SWEEP_DP_TOKENS:-8,32,128,256,512} fp8_fp4 \
        >>"$OUT/rs_sweep.jsonl"
}

step_gputests_quick() {
    $PY -m pytest -q -rfE tests/gpu/test_fp8_gpu.py tests/gpu/test_fp4_ws_gpu.py tests/gpu/test_fp4_rs_gpu.py \
        -k "graph or real or block64 or one_ep8"
}

step_rs_pair() {  # chains a token stage at chunks 8 / 16: 2 against 4, the phase at T = 8, 32 (-> $OUT/rs_pair.jsonl)
    local p
    for p in "8:2,16:2" "8:4,16:4" "8:2,16:2" "8:4,16:4"; do
        FP4_RS_PAIR=$p $PY results/probes/fused_fp8_ws_profile.py 8,32 fp8_fp4 >>"$OUT/rs_pair.jsonl" || return 1
    done
}

step_rs_wide() {  # the wide register-operand tile (chunk 128, 128-row chains, block 128) against the decode-partition
    # tile at T = 512, 2048 (-> $OUT/rs_wide.jsonl; not timed)
    FP4_RS_MAX_EXPECTED=1000 FP4_BLOCK64_MAX_EXPECTED=-1 FP4_RS_BLOCK_N=128 \
        $PY results/probes/fused_fp8_ws_profile.py 512,2048 fp8_fp4 >>"$OUT/rs_wide.jsonl" || return 1
    FP4_RS_MAX_EXPECTED=1000 FP4_BLOCK64_MAX_EXPECTED=-1 FP4_RS_BLOCK_N=64 FP4_RS_WIDE=64 \
        $PY results/probes/fused_fp8_ws_profile.py 512 fp8_fp4 >>"$OUT/rs_wide.jsonl" || return 1
    FP4_RS_MAX_EXPECTED=-1 $PY results/probes/fused_fp8_ws_profile.py 512,2048 fp8_fp4 >>"$OUT/rs_wide.jsonl"
}

step_gputests_wide() { $PY -m pytest -q -x -rfE tests/gpu/test_fp4_rs_gpu.py -k wide; }

step_host() { $PY results/probes/fp8_ws_probe.py host "${HOST_TOKENS:-8,128}" >>"$OUT/host.jsonl"; }

_layer() {  # suite: the bench names its file for the GPU it ran on (layer_h200.json, layer_fp8_h100-80gb-hbm3.json,
    # ...); the kit's rows are merged into the file it says it wrote
    local written
    written=$(set -o pipefail; $PY -m megamoe.bench --suite "$1" --out "$OUT" | tee /dev/stderr |
              sed -n 's/^\[bench\] wrote //p' | tail -1) && [ -f "$written" ] || return 1
    if [ -f .peers/deepgemm_sm90/run.sh ]; then
        bash .peers/deepgemm_sm90/run.sh --out "$OUT/dg_$1.json" >"/tmp/dg_$1.log" 2>&1
        local rc=$?
        grep -E "^\[dg\] T=|rror" "/tmp/dg_$1.log"
        [ -f "$OUT/dg_$1.json" ] && $PY -m megamoe.bench --merge-peer "$written" "$OUT/dg_$1.json"
        return $rc
    fi
}
step_layer_fp8() { _layer layer_fp8; }
step_layer() { _layer layer; }

step_profile() {
    local fmt env
    for fmt in fp8 fp8_fp4; do
        for env in "" "FRONT_PROGRAMS=32" "BACK_PROGRAMS_PER_SM=0.25" "FRONT_PROGRAMS=32 BACK_PROGRAMS_PER_SM=0.25"; do
            # shellcheck disable=SC2086
            env $env $PY results/probes/fused_fp8_ws_profile.py 32,128,512 $fmt >>"$OUT/profile.jsonl" || return 1
        done
    done
    cut -c1-400 "$OUT/profile.jsonl"
}

step_ws_regs() {  # the decode-partition tile's register split at block 128, as is (208 / 24 / 72) against 200 / 24 / 88
    # (offline sm_90a: the decode partition's tile loop spills 15 STL + 40 LDL as is, 1 + 26 at 88), alternating,
    # phase at T = 512, 2048 (-> $OUT/ws_regs.jsonl; timing only: adopt it only after the fp4_ws GPU tests pass with it)
    local r
    for r in "" "128:200,24,88,128" "" "128:200,24,88,128"; do
        FP4_WS_REGS=${r:-128:208,24,72,128} $PY results/probes/fused_fp8_ws_profile.py 512,2048 fp8_fp4 \
            >>"$OUT/ws_regs.jsonl" || return 1
    done
}

step_group_sync() {  # WS_GROUP_SYNC: its GPU tests (same bits on and off), then off / on / off / on at T = 512,
    # 2048, 8192, whole call with its error (-> $OUT/group_sync.jsonl), then the phase alone on / off (profile rows)
    $PY -m pytest -q -rfE tests/gpu/test_ws_launch_options_gpu.py -k GROUP_SYNC || return 1
    $PY results/probes/fp8_ws_probe.py group_sync "${GROUP_SYNC_TOKENS:-512,2048,8192}" >>"$OUT/group_sync.jsonl" || return 1
    local fmt
    for fmt in fp8 fp8_fp4; do
        WS_GROUP_SYNC=1 $PY results/probes/fused_fp8_ws_profile.py 2048,8192 $fmt >>"$OUT/group_sync.jsonl"
        WS_GROUP_SYNC=0 $PY results/probes/fused_fp8_ws_profile.py 2048,8192 $fmt >>"$OUT/group_sync.jsonl"
    done
}

step_rs_ctas() {  # the register-operand tile as is against FP4_RS_CANDIDATES: their GPU tests first, then
    # fp8_ws_probe.py rs_ctas at T = 8, 32, 128 and 512, alternating (-> $OUT/rs_ctas.jsonl)
    $PY -m pytest -q -x -rfE tests/gpu/test_fp4_rs_gpu.py -k rs_variant || return 1
    $PY results/probes/fp8_ws_probe.py rs_ctas "${RS_CTAS_TOKENS:-128}" >>"$OUT/rs_ctas.jsonl" || return 1
    cat "$OUT/rs_ctas.jsonl"
}

step_rs_variant_sweep() {  # see the header; RS_VARIANT_TOKENS overrides the T list
    local t=${RS_VARIANT_TOKENS:-256,512,1024,2048} v
    FP4_RS_MAX_EXPECTED=1000 FP4_RS_BLOCK_N=64 $PY results/probes/fused_fp8_ws_profile.py "$t" fp8_fp4 \
        >>"$OUT/rs_variant_sweep.jsonl" || return 1
    for v in $($PY -c "import megamoe.fused as mf; print(' '.join(mf.FP4_RS_CANDIDATES.get(64, {})))"); do
        FP4_RS_MAX_EXPECTED=1000 FP4_RS_BLOCK_N=64 FP4_RS_VARIANT="64:$v" \
            $PY results/probes/fused_fp8_ws_profile.py "$t" fp8_fp4 >>"$OUT/rs_variant_sweep.jsonl" || return 1
    done
    FP4_RS_MAX_EXPECTED=-1 $PY results/probes/fused_fp8_ws_profile.py "$t" fp8_fp4 >>"$OUT/rs_variant_sweep.jsonl"
    cut -c1-300 "$OUT/rs_variant_sweep.jsonl"
}

step_rs_threshold() {  # see the header
    $PY -m pytest -q -x -rfE tests/gpu/test_fp4_rs_gpu.py -k "one_ep8_rank and not variant and not wide and 1024" \
        || return 1
    $PY results/probes/fp8_ws_probe.py rs_threshold "${RS_THRESHOLD_TOKENS:-512,1024}" >>"$OUT/rs_threshold.jsonl" || return 1
    cat "$OUT/rs_threshold.jsonl"
}

step_back_programs() {  # WS_BACK_PROGRAMS_PER_SM 1 / 4: its GPU tests (same bits), then 1 / 4 / 1 / 4 whole call
    # at T = 8, 128, 512, 2048, 8192, both formats, with the error (-> $OUT/back_programs.jsonl)
    $PY -m pytest -q -rfE tests/gpu/test_ws_launch_options_gpu.py -k BACK_PROGRAMS || return 1
    $PY results/probes/fp8_ws_probe.py back_programs "${BACK_PROGRAMS_TOKENS:-8,128,512,2048,8192}" \
        >>"$OUT/back_programs.jsonl" || return 1
    cat "$OUT/back_programs.jsonl"
}

step_ncu() {  # Nsight Compute on one fused call per case (front, GEMM phase, back): speed of light, memory and
    # compute workload, scheduler and warp-state (stall) statistics, occupancy, source counters (-> $OUT/ncu_<case>.txt;
    # NCU_CASES "fmt:T ...", default the RS tile at T = 128, the decode-partition tile at 512 / 2048, FP8 at 2048)
    local ncu case fmt t
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    [ -n "$ncu" ] || { echo "no ncu"; return 1; }
    for case in ${NCU_CASES:-fp8_fp4:128 fp8_fp4:2048 fp8:2048 fp8_fp4:512}; do
        fmt=${case%%:*} t=${case##*:}
        NCU=1 timeout 240 "$ncu" --clock-control none --profile-from-start off --target-processes all \
            --kernel-name regex:"gemm_phase|fused_mega_moe" --page details --print-units base \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
            --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \
            --section SourceCounters --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
            $PY results/probes/fused_fp8_ws_profile.py "$t" "$fmt" >"$OUT/ncu_${fmt}_$t.txt" 2>&1
        echo "ncu $case rc=$?: $(grep -c "gemm_phase\|fused_mega_moe" "$OUT/ncu_${fmt}_$t.txt") kernel lines"
    done
}

step_ncu_source() {  # see the header
    local ncu case fmt t rep
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    [ -n "$ncu" ] || { echo "no ncu"; return 1; }
    for case in ${NCU_SOURCE_CASES:-fp8:8192 fp8_fp4:2048}; do
        fmt=${case%%:*} t=${case##*:} rep="$OUT/ncu_src_${fmt}_$t"
        NCU=1 timeout 300 "$ncu" --clock-control none --profile-from-start off --target-processes all \
            --kernel-name regex:"gemm_phase" --section SourceCounters --section WarpStateStats --import-source no \
            -f -o "$rep" $PY results/probes/fused_fp8_ws_profile.py "$t" "$fmt" >"$rep.log" 2>&1
        echo "ncu_source $case rc=$?: $(ls -la "$rep.ncu-rep" 2>&1)"
        "$ncu" --import "$rep.ncu-rep" --page source --print-source sass --csv 2>&1 | gzip >"$rep.sass.csv.gz"
        echo "source page: $(zcat "$rep.sass.csv.gz" | wc -l) lines; $(zcat "$rep.sass.csv.gz" | head -2 | cut -c1-600)"
        tail -3 "$rep.log"; rm -f "$rep.log"
    done
}

step_clocks() { $PY results/probes/clock_probe.py 2048,8192 fp8,fp8_fp4 >>"$OUT/clocks.jsonl"; cat "$OUT/clocks.jsonl"; }

step_ceiling() { $PY results/probes/clock_probe.py 8192 dense,dense_block,fp8 >>"$OUT/ceiling.jsonl"; cat "$OUT/ceiling.jsonl"; }

# The exact-numerics bisect: .bisect/<commit>/megamoe trees (exact_bisect.py's docstring), A B C A B C, H200 only.
step_exact_bisect() {
    case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in *H200*) ;; *) echo "not an H200: skipped"; return 0;; esac
    local round tree
    for round in 1 2; do
        for tree in ${BISECT_TREES:-9c425dd 964d386 ad53dc3}; do
            $PY results/probes/exact_bisect.py ".bisect/$tree" "$tree" ${BISECT_TOKENS:-32,128} exact,hopper \
                >>"$OUT/exact_bisect.jsonl" || return 1
        done
    done
    cat "$OUT/exact_bisect.jsonl"
}

step_halfw() {
    PROBE_MC=0 PROBE_REP_MS=3000 PROBE_CLOCKS=1 $PY results/probes/fp8_ws_probe.py phase 8192 as_is,halfw,now,nomma,noepi,nopromote,as_is,halfw \
        >>"$OUT/phase8192.jsonl" && cat "$OUT/phase8192.jsonl"
}

step_multicast() {
    local k
    for k in "4096 66" "7168 66" "384 1"; do
        # shellcheck disable=SC2086
        $PY results/probes/multicast_probe.py $k >>"$OUT/multicast.jsonl" || return 1
    done
    cat "$OUT/multicast.jsonl"
}

step_mc_tests() {  # FP8_WS_MULTICAST: the same bits on and off, small cases (one, two, many pool blocks an expert)
    timeout 300 $PY -m pytest -x -q -rfE tests/gpu/test_ws_launch_options_gpu.py -k "MULTICAST and not fp8_fp4"
}

step_mc() {  # FP8_WS_MULTICAST off / on / off / on at T = $MC_TOKENS (512,2048,8192), bits compared (-> $OUT/mc.jsonl)
    timeout "${MC_TIMEOUT:-300}" $PY results/probes/fp8_ws_probe.py multicast "${MC_TOKENS:-512,2048,8192}" \
        >>"$OUT/mc.jsonl"
    local rc=$?
    cut -c1-400 "$OUT/mc.jsonl"
    return $rc
}

step_sync_fp8() {  # the FP8 phase's group sync off / on twice at T = $SYNC_TOKENS (2048,8192) (-> $OUT/sync_fp8.jsonl)
    timeout "${SYNC_TIMEOUT:-300}" $PY results/probes/fp8_ws_probe.py sync_fp8 "${SYNC_TOKENS:-2048,8192}" \
        >>"$OUT/sync_fp8.jsonl"
    local rc=$?
    cut -c1-400 "$OUT/sync_fp8.jsonl"
    return $rc
}

step_fp4_rs() { $PY results/probes/fp4_rs_probe.py run >>"$OUT/fp4_rs.jsonl"; cat "$OUT/fp4_rs.jsonl"; }

step_gputests_fp4() { $PY -m pytest -q -rfE tests/gpu/test_cupy_prims.py tests/gpu/test_fp4_ws_gpu.py; }

step_halves() {  # FP4_WS_DECODE_HALVES: its GPU tests (same bits on and off, per-block decode and predecoded), then
    # off / on / off / on at T = 512, 1024, 2048, 8192 and the register-operand tile at T = 512 (-> $OUT/halves.jsonl)
    timeout 240 $PY -m pytest -q -rfE tests/gpu/test_ws_launch_options_gpu.py -k "DECODE_HALVES and fp8_fp4" || return 1
    timeout 300 $PY results/probes/fp8_ws_probe.py halves "${HALVES_TOKENS:-512,1024,2048,8192}" >>"$OUT/halves.jsonl"
    local rc=$?
    cut -c1-400 "$OUT/halves.jsonl"
    return $rc
}

step_fold_tests() {
    timeout 330 $PY -m pytest -q -x -rfE tests/gpu/test_fp4_ws_gpu.py || return 1
    timeout 200 $PY -m pytest -q -rfE tests/gpu/test_ws_launch_options_gpu.py -k "FOLD_ONCE and fp8_fp4"
}

step_fold_once() {
    timeout 330 $PY results/probes/fp8_ws_probe.py fold_once "${FOLD_TOKENS:-512,2048,8192}" >>"$OUT/fold_once.jsonl"
    local rc=$?
    cut -c1-330 "$OUT/fold_once.jsonl"
    mkdir -p "$OUT/thr32"
    timeout 150 $PY -c "import sys, megamoe.fused as mf, megamoe.bench as b; mf.FP4_RS_MAX_EXPECTED = 32; \
b.main(['--suite', 'layer', '--tokens', '512', '--out', sys.argv[1]])" "$OUT/thr32" | tail -12
    return $rc
}

step_direct_tests() { timeout 300 $PY -m pytest -q -x -rfE tests/gpu/test_direct_launch_gpu.py | tail -30; }

step_l2pb_tests() { timeout 560 $PY -m pytest -q -x -rfE -s tests/gpu/test_l2_per_block_gpu.py | tail -60; }

step_l2pb() {
    timeout 400 $PY results/probes/fp8_ws_probe.py l2_per_block "${L2PB_TOKENS:-128,512,2048,8192}" \
        >>"$OUT/l2_per_block.jsonl"
    local rc=$?
    cut -c1-330 "$OUT/l2_per_block.jsonl"
    return $rc
}

step_t512_ws() {
    mkdir -p "$OUT/t512_ws"
    timeout 150 $PY -c "import sys, megamoe.fused as mf, megamoe.bench as b; mf.FP4_RS_MAX_EXPECTED = 32; \
b.main(['--suite', 'layer', '--tokens', '512', '--out', sys.argv[1]])" "$OUT/t512_ws" | tail -6
}

step_idle() {  # FP4_WS_IDLE_DECODE: its GPU tests (same bits on and off, several cases), then off / on / off / on at
    # T = $IDLE_TOKENS (-> $OUT/idle_decode.jsonl) and the layer bench at T = 512 on the decode-partition tile with it
    # on (uniform and skewed; -> $OUT/t512_idle/)
    timeout 200 $PY -m pytest -q -x -rfE tests/gpu/test_ws_launch_options_gpu.py -k "IDLE_DECODE and fp8_fp4" \
        | tail -15 || return 1
    timeout 240 $PY results/probes/fp8_ws_probe.py idle_decode "${IDLE_TOKENS:-512,1024,2048}" \
        >>"$OUT/idle_decode.jsonl"
    local rc=$?
    cut -c1-330 "$OUT/idle_decode.jsonl"
    mkdir -p "$OUT/t512_idle"
    timeout 150 $PY -c "import sys, megamoe.fused as mf, megamoe.bench as b; mf.FP4_RS_MAX_EXPECTED = 32; \
mf.FP4_WS_IDLE_DECODE = {128: True, 64: False}; \
b.main(['--suite', 'layer', '--tokens', '512', '--out', sys.argv[1]])" "$OUT/t512_idle" | tail -6
    return $rc
}

step_defaults() {  # numerics="auto": its GPU tests (the layer wrapper, the interrupt repair, the live-rank wait)
    timeout 200 $PY -m pytest -q -rfE tests/gpu/test_mega_moe_gpu.py -k layer_wrapper | tail -6 || return 1
    timeout 200 $PY -m pytest -q -rfE tests/gpu/test_reliability_gpu.py \
        tests/gpu/test_fused_gpu.py::test_fused_slow_but_live_rank_is_not_named | tail -8
}

step_epilogue() {  # session 35's epilogue changes, FP8 phase: as is / guarded / L2 rows twice, alternating twice
    timeout 500 $PY results/probes/fp8_ws_probe.py phase "${EPI_TOKENS:-512,2048,8192}" \
        as_is,guarded,l2_rows_twice,as_is,guarded,l2_rows_twice >>"$OUT/epilogue.jsonl"
    local rc=$?
    cat "$OUT/epilogue.jsonl"
    return $rc
}

step_ws_tests() {  # the decode-partition tile's GPU tests at block 128 (small cases, the host's tile at T = 512 / 384
    # in both numerics with IDLE_DECODE, the CUDA graph at T = 512), one EP8 rank at T = 512 in the per-block numerics
    timeout 300 $PY -m pytest -q -x -rfE tests/gpu/test_fp4_ws_gpu.py \
        -k "(small_cases and 128) or idle or (graph and 512)" | tail -8 || return 1
    timeout 120 $PY -m pytest -q -x -rfE "tests/gpu/test_l2_per_block_gpu.py::test_l2_per_block_one_ep8_rank[512]" \
        | tail -4
}

step_fp8_profile() {
    timeout 400 $PY results/probes/stage_profile_probe.py fp8 "${FP8_PROF_TOKENS:-2048,8192}" \
        "${FP8_PROF_SETTINGS:-null}" >>"$OUT/fp8_profile.jsonl"
    local rc=$?
    cat "$OUT/fp8_profile.jsonl"
    return $rc
}

step_stage_profile() {
    timeout 400 $PY results/probes/stage_profile_probe.py "${STAGE_TOKENS:-512,2048,8192}" "${STAGE_CONFIGS:-ws128}" \
        >>"$OUT/stage_profile.jsonl"
    local rc=$?
    cat "$OUT/stage_profile.jsonl"
    return $rc
}

_ws_variants() {  # ws_variants_probe.py MODE at T = TOKENS within LIMIT s -> $OUT/FILE.jsonl (appended), its rows shown
    local mode=$1 file=$2 tokens=$3 limit=$4
    timeout "$limit" $PY results/probes/ws_variants_probe.py "$mode" "$tokens" >>"$OUT/$file.jsonl"
    local rc=$?
    cut -c1-330 "$OUT/$file.jsonl"
    return $rc
}

step_knockout() {  # session 36: the decode stage piece by piece at T = $KO_TOKENS (ws_variants_probe.py knockout)
    _ws_variants knockout knockout "${KO_TOKENS:-512,128,2048}" "${KO_TIMEOUT:-420}"
}

step_knockout2() {  # session 40: the stage's shared-memory streams one at a time (ws_variants_probe.py knockout2)
    _ws_variants knockout2 knockout2 "${KO2_TOKENS:-512,2048}" "${KO_TIMEOUT:-420}"
}

step_words() {  # session 41: the exact int32-word decode variants (ws_variants_probe.py), as is / words / lds_ahead twice
    KNOCKOUTS=as_is,words,lds_ahead,as_is,words,lds_ahead _ws_variants knockout2 words "${WORDS_TOKENS:-512,2048}" \
        "${KO_TIMEOUT:-300}"
}

step_gputests_fp4_readers() {
    $PY -m pytest -q -rfE tests/gpu/test_fp4_ws_gpu.py tests/gpu/test_fp4_rs_gpu.py -k "(test_fp4_ws_small_cases and \
        clamp) or (test_fp4_rs_small_cases and clamp) or fold_decode_on_the_gpu" | tail -4 || return 1
    $PY -m pytest -q -rfE tests/gpu/test_fused_gpu.py tests/gpu/test_mega_moe_gpu.py \
        -k "(test_fused_small_cases and hopper) or test_small_cases_local" | tail -4 || return 1
    $PY -m pytest -q -rfE tests/gpu/test_fp4_ws_gpu.py tests/gpu/test_fp4_rs_gpu.py -k "(test_fp4_ws_predecoded and 128) \
        or (test_fp4_ws_real_size and not block64) or test_fp4_rs_real_size or (test_fp4_ws_cuda_graph and 512)" | tail -4
}

step_launch_options() { $PY -m pytest -q -rfE tests/gpu/test_ws_launch_options_gpu.py; }

step_notebooks() { $PY -m megamoe.notebooks run 2>&1 | tail -20; return "${PIPESTATUS[0]}"; }

for step in "$@"; do
    echo "=== $step $(date -u +%T)"
    t0=$SECONDS
    if ! "step_$step"; then
        echo "=== $step FAILED"
        status=1
        [ "$step" = install ] && exit 1
    fi
    echo "=== $step done in $((SECONDS - t0)) s"
done
exit $status
