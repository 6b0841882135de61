// barrier.cuh -- a cross-rank barrier over symmetric memory (NVLink), with a timeout that names the late rank.
//
// Each rank's buffer holds, in its workspace (megamoe/layout.py):
//     barrier_signal  i32[R]   slot s = how many barriers rank s has entered, as signalled to THIS rank
//     barrier_state   i32[4]   [0] epoch of this rank's last barrier, [1] tag of a timed-out barrier (0 = none),
//                              [2] the rank that did not arrive, [3] spare
// All zero at allocation.
//
// Barrier number ``epoch`` (1, 2, 3, ... per rank) is:
//     1. every thread reads state[0]; epoch = state[0] + 1; thread 0 stores it back (only this CTA touches it);
//     2. thread r (r < R) adds 1 to slot [me] of rank r's signal array with red.release.sys: after that add, the
//        slot holds my epoch. "release" at system scope orders every write this CTA made before the
//        __syncthreads() -- e.g. data just stored into the peer's buffer -- before the signal;
//     3. thread r spins with ld.acquire.sys on MY slot [r] until it is >= epoch: rank r has entered this barrier
//        (or a later one) and everything it wrote before signalling is now visible to me.
//
// Compared with DeepGEMM (one counter that phases +1/-1 between 0 and R), the per-rank epoch slots cost R words
// instead of 2, but they are just as self-resetting (they only grow; the comparison is wrap-around safe) and a
// rank that never arrives is identifiable: its slot is the one still below ``epoch``.
//
// Timeout: each waiting thread reads %globaltimer (ns, a clock shared by the whole GPU). Past ``timeout_ns`` it
// records (tag, missing rank) in state[1..2] -- the first failure wins and stays until the host clears it --
// and the barrier returns false on every thread instead of hanging the GPU.
//
// Scope: one CTA. A multi-CTA kernel first synchronises its CTAs (a grid sync, or the kernel boundary when the
// barrier is its own launch, as in megamoe's staged pipeline) so that the signalling CTA's release covers them.
#pragma once

#include "sym_buffer.cuh"

namespace megamoe {

// Atomic add at system scope with release semantics; no return value (a "reduction": fire-and-forget).
__device__ __forceinline__ void red_add_release_sys(int* ptr, const int value) {
    asm volatile("red.release.sys.global.add.s32 [%0], %1;" :: "l"(ptr), "r"(value) : "memory");
}

// Load at system scope with acquire semantics: later reads of this thread see what the releasing writer wrote
// before its release.
__device__ __forceinline__ int ld_acquire_sys(const int* ptr) {
    int value;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

// The GPU-wide nanosecond timer.
__device__ __forceinline__ u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// a >= b for counters that may wrap around (valid while they are less than 2^31 apart).
__device__ __forceinline__ bool epoch_reached(const int a, const int b) {
    return static_cast<int>(static_cast<u32>(a) - static_cast<u32>(b)) >= 0;
}

// Record the first failure: (tag, missing rank) into state[1], state[2].
__device__ __forceinline__ void record_barrier_timeout(int* state, const int tag, const u32 missing_rank) {
    if (atomicCAS(state + 1, 0, tag) == 0)
        atomicExch(state + 2, static_cast<int>(missing_rank));
}

// Cross-rank barrier, called by every thread of ONE CTA with blockDim.x >= sym.num_ranks.
//   signal: my barrier_signal slots (local pointer, R ints)     state: my barrier_state (local pointer, 4 ints)
//   tag:    non-zero label stored on timeout                    timeout_ns: per-barrier wait limit
// Returns true on every thread when all ranks arrived, false on every thread after a timeout.
template <u32 kNumMaxRanks>
__device__ __forceinline__ bool rank_barrier(const SymBuffer<kNumMaxRanks>& sym, int* signal, int* state,
                                             const int tag, const u64 timeout_ns) {
    const u32 r = threadIdx.x;
    const int epoch = *reinterpret_cast<volatile int*>(state) + 1;
    __syncthreads();  // every thread read the old epoch; the CTA's earlier writes precede the releases below
    if (r == 0)
        state[0] = epoch;

    bool timed_out = false;
    if (r < sym.num_ranks) {
        red_add_release_sys(sym.map(signal + sym.rank_idx, r), 1);
        const u64 start = globaltimer_ns();
        while (!epoch_reached(ld_acquire_sys(signal + r), epoch)) {
            if (globaltimer_ns() - start > timeout_ns) {
                record_barrier_timeout(state, tag, r);
                timed_out = true;
                break;
            }
        }
    }
    return __syncthreads_or(timed_out) == 0;
}

}  // namespace megamoe
