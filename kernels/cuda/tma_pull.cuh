// tma_pull.cuh -- 1-D bulk copies (the "TMA" of Hopper without a tensor map) and the mbarrier they complete on.
//
// The Mega MoE dispatch moves whole token rows (H bytes of FP8, 16-byte aligned) from a PEER's buffer into the
// local L1 pool. No tensor map is needed for that: sm_90 has ``cp.async.bulk``, a DMA-like copy of N contiguous
// bytes (N % 16 == 0, both addresses 16-byte aligned) executed by the TMA unit, asynchronously to the threads.
// One thread issues it; the other 31 lanes of the warp are free. Two directions are used:
//
//   global -> shared   cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [smem], [gmem], N, [bar]
//                      Completion is reported to an mbarrier in shared memory as "N transaction bytes arrived".
//   shared -> global   cp.async.bulk.global.shared::cta.bulk_group [gmem], [smem], N
//                      Completion is tracked per thread with bulk groups: commit_group, then wait_group.
//
// With ``gmem = sym.map(ptr, peer)`` the load is an NVLink read ("pull") and the store is an NVLink write ("push").
//
// The mbarrier protocol for one buffer slot (one phase per use of the slot):
//   1. mbarrier_init(bar, 1)                 once: one arrival (the issuing thread) completes a phase
//   2. mbarrier_arrive_expect_tx(bar, N)     the issuing thread arrives AND announces N bytes still to come
//   3. tma_load_1d(smem, gmem, bar, N)       the TMA unit decrements the pending count by N as bytes land
//   4. mbarrier_wait(bar, parity)            the phase completes when 1 arrival + N bytes are in; the k-th use of
//                                            the slot waits for parity k & 1
//
// Proxies: TMA reads and writes memory through the "async proxy", ordinary ld/st through the "generic proxy".
// The two are not ordered with each other unless a fence says so:
//   * after initialising an mbarrier (a generic write), ``fence_barrier_init`` makes it visible to the TMA unit;
//   * after threads WRITE shared memory that a bulk store will then READ, ``fence_proxy_async_shared`` is needed;
//   * a bulk load followed by a bulk store of the same bytes is async -> async, ordered by waiting on the mbarrier,
//     so the pull-then-store pipeline below needs no fence per row.
// Re-using a slot for a new load while an older bulk store may still be READING it is a WAR hazard across
// instructions of the async proxy: ``bulk_wait_group_read<N>`` waits until all but the newest N store groups have
// finished reading their shared-memory source.
#pragma once

#include "sym_buffer.cuh"

namespace megamoe {

// 32-bit shared-state-space address of a generic pointer into shared memory (what PTX `[smem]` operands want).
__device__ __forceinline__ u32 smem_addr(const void* ptr) {
    return static_cast<u32>(__cvta_generic_to_shared(ptr));
}

// ---------------------------------------------------------------------------------------------------- mbarrier

// Initialise an mbarrier (an opaque u64 in shared memory) whose phase completes after ``arrive_count`` arrivals
// (plus whatever transaction bytes are announced with expect_tx). One thread calls it.
__device__ __forceinline__ void mbarrier_init(u64* bar, const u32 arrive_count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(arrive_count) : "memory");
}

// Make initialised mbarriers visible to the async proxy (the TMA unit will perform complete_tx on them).
// ``fence.mbarrier_init`` is the light-weight release for mbarrier.init; the proxy fence covers the
// generic->async hand-off. Follow with __syncthreads() before other threads use the barriers.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Arrive once on ``bar`` and add ``tx_bytes`` to the bytes the current phase still waits for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u64* bar, const u32 tx_bytes) {
    asm volatile("{\n\t.reg .b64 state;\n\t"
                 "mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n\t}"
                 :: "r"(smem_addr(bar)), "r"(tx_bytes) : "memory");
}

// One non-blocking probe: true once the phase with parity ``parity`` has completed.
// (try_wait may suspend the thread for a hardware-chosen time before answering: cheaper than a hot spin.)
__device__ __forceinline__ bool mbarrier_try_wait_parity(u64* bar, const u32 parity) {
    u32 done;
    asm volatile("{\n\t.reg .pred p;\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, p;\n\t}"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return done != 0;
}

// Block until the phase with parity ``parity`` of ``bar`` has completed. After it returns, the bytes written by
// the bulk loads that completed on this phase are visible to the calling thread.
__device__ __forceinline__ void mbarrier_wait(u64* bar, const u32 parity) {
    while (!mbarrier_try_wait_parity(bar, parity)) {
    }
}

// ---------------------------------------------------------------------------------------------------- bulk copies

// Bulk copy ``bytes`` from global ``gmem_src`` (local or a peer's, via SymBuffer::map) to shared ``smem_dst``,
// completing ``bytes`` transaction bytes on ``bar``. The caller announced them with mbarrier_arrive_expect_tx.
// Requirements: bytes % 16 == 0, both addresses 16-byte aligned. ``gmem_src`` is a generic pointer to global
// memory, which on every CUDA GPU is numerically the global-state-space address.
__device__ __forceinline__ void tma_load_1d(void* smem_dst, const void* gmem_src, u64* bar, const u32 bytes) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(smem_dst)), "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// Bulk copy ``bytes`` from shared ``smem_src`` to global ``gmem_dst`` (same alignment rules). Tracked in the
// calling thread's current bulk group: close the group with bulk_commit_group().
__device__ __forceinline__ void tma_store_1d(void* gmem_dst, const void* smem_src, const u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(gmem_dst), "r"(smem_addr(smem_src)), "r"(bytes) : "memory");
}

// Close the current bulk group (every tma_store_1d since the last commit).
__device__ __forceinline__ void bulk_commit_group() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Wait until at most ``kPending`` of this thread's committed bulk groups have not finished READING shared memory:
// their source slots may be overwritten. The global writes may still be in flight.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(kPending) : "memory");
}

// Wait until at most ``kPending`` committed bulk groups are incomplete: with 0, every bulk store of this thread
// has been performed (its global writes are visible to this thread; release them with a fence or a release
// atomic before signalling a peer). A CTA must not exit while bulk stores still read its shared memory.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(kPending) : "memory");
}

// Order this thread's earlier GENERIC shared-memory accesses before later ASYNC-proxy accesses (e.g. threads
// st.shared a row, then one thread bulk-stores it). Use it with a __syncthreads() when other threads wrote.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

}  // namespace megamoe
