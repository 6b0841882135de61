// sym_buffer.cuh -- the symmetric buffer seen from one rank (DeepGEMM's ``SymBuffer``), for sm_90a.
//
// Every rank allocates ONE buffer of identical size and identical layout (megamoe/layout.py computes it).
// After a rendezvous (torch.distributed._symmetric_memory), each rank knows the virtual address at which every
// peer's buffer is mapped into ITS OWN address space: ``buffer_ptrs[r]``. On a single NVLink domain these are
// ordinary device pointers; a load or store through them becomes an NVLink transaction.
//
// Because the layouts are identical, "the same field on rank r" is "my address of that field + a constant":
//
//     map(ptr, r) = ptr + (buffer_ptrs[r] - buffer_ptrs[me]) = ptr + offsets[r]
//
// so a kernel computes every address against its LOCAL buffer (cheap, the layout math is written once) and
// only at the very last moment translates it to the peer it wants to touch. ``offsets[me] == 0``, so mapping to
// yourself is a no-op and needs no special case.
//
// DeepGEMM passes the struct by value as a kernel parameter (it lives in the constant/param bank: every thread
// reads offsets[r] with no memory traffic). CuPy cannot pass a C++ struct by value, so the kernels here receive
// the raw ``buffer_ptrs`` table in global memory and build the struct once per CTA in shared memory with
// ``load_from_table``. Either way ``map`` is one 64-bit add.
//
// Header-only and free of standard-library includes so that it compiles under both nvcc and NVRTC (CuPy).
#pragma once

namespace megamoe {

using u32 = unsigned int;
using u64 = unsigned long long;
using i64 = long long;

// DeepGEMM's kNumMaxRanks: one NVL72 rack.
constexpr u32 kMaxRanks = 72;

template <u32 kNumMaxRanks = kMaxRanks>
struct SymBuffer {
    i64 base;                    // address of MY buffer
    i64 offsets[kNumMaxRanks];   // offsets[r] = address of rank r's buffer - base (in my address space)
    u32 rank_idx;                // my rank
    u32 num_ranks;               // valid entries of offsets[]

    // Translate a pointer INTO MY BUFFER to the same byte of rank ``dst_rank_idx``'s buffer.
    // The result is only meaningful for ``dst_rank_idx < num_ranks`` and for ``ptr`` inside my buffer.
    template <typename T>
    __device__ __forceinline__ T* map(T* ptr, const u32 dst_rank_idx) const {
        return reinterpret_cast<T*>(reinterpret_cast<i64>(ptr) + offsets[dst_rank_idx]);
    }

    // A typed pointer to byte ``byte_offset`` of MY buffer (layout offsets come from megamoe.layout.Layout).
    template <typename T>
    __device__ __forceinline__ T* local(const u64 byte_offset) const {
        return reinterpret_cast<T*>(base + static_cast<i64>(byte_offset));
    }

    // Shorthand for map(local<T>(byte_offset), rank): byte ``byte_offset`` of rank ``rank``'s buffer.
    template <typename T>
    __device__ __forceinline__ T* remote(const u64 byte_offset, const u32 rank) const {
        return map(local<T>(byte_offset), rank);
    }

    // Fill the struct from the rendezvous table ``buffer_ptrs[0..num_ranks)`` (global memory, one i64 per rank).
    // Called by every thread of the CTA on a ``__shared__`` instance; threads stride over the ranks.
    // The caller must ``__syncthreads()`` before the first ``map``.
    __device__ __forceinline__ void load_from_table(const i64* buffer_ptrs, const u32 n, const u32 me) {
        const i64 mine = buffer_ptrs[me];
        for (u32 r = threadIdx.x; r < n; r += blockDim.x)
            offsets[r] = buffer_ptrs[r] - mine;
        if (threadIdx.x == 0) {
            base = mine;
            rank_idx = me;
            num_ranks = n;
        }
    }
};

}  // namespace megamoe
