// cupy_kernels.cu -- the translation unit CuPy compiles (megamoe.kernels.cupy_prims): extern "C" entry points for
// the bulk row copies (pull_rows, push_rows) and the cross-rank barrier, built on the headers next to it.
#include "sym_buffer.cuh"
#include "tma_pull.cuh"
#include "barrier.cuh"

namespace megamoe {

constexpr u32 kMaxStages = 8;

// Work item = one chunk of one row. Item i of the grid is copied by CTA i % gridDim.x; inside a CTA, lane 0 runs
// a software pipeline over its items j = 0, 1, ...: item j uses slot j % num_stages, and the load of item
// j + num_stages - 1 is issued right after the store of item j, into the slot whose store (item j - 1) has
// finished reading it.
template <bool kPull>
__device__ __forceinline__ void copy_rows(const i64* buffer_ptrs, const u32 num_ranks, const u32 rank,
                                          const u32 peer, const u64 src_offset, const u64 dst_offset,
                                          const u32 num_rows, const u32 row_bytes, const u32 chunk_bytes,
                                          const u32 num_stages) {
    __shared__ SymBuffer<> sym;
    __shared__ alignas(8) u64 full[kMaxStages];
    extern __shared__ __align__(128) unsigned char slots[];

    sym.load_from_table(buffer_ptrs, num_ranks, rank);
    if (threadIdx.x == 0) {
        for (u32 s = 0; s < num_stages; ++s)
            mbarrier_init(&full[s], 1);
        fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x != 0)
        return;

    // Pull: read the peer, write myself. Push: read myself, write the peer.
    const unsigned char* src = sym.local<const unsigned char>(src_offset);
    unsigned char* dst = sym.local<unsigned char>(dst_offset);
    if constexpr (kPull)
        src = sym.map(src, peer);
    else
        dst = sym.map(dst, peer);

    // 32-bit item indices (the host checks num_rows * chunks_per_row < 2^31): the issuing lane does one 32-bit
    // division per item, cheap next to a multi-kilobyte copy.
    const u32 chunks_per_row = (row_bytes + chunk_bytes - 1) / chunk_bytes;
    const u32 num_items = num_rows * chunks_per_row;
    const u32 num_local = num_items > blockIdx.x ? (num_items - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;

    // Byte offset (same in source and destination) and size of this CTA's item j.
    auto locate = [&](const u32 j, u32& bytes) -> u64 {
        const u32 item = blockIdx.x + j * gridDim.x;
        const u32 row = item / chunks_per_row;
        const u32 begin = (item - row * chunks_per_row) * chunk_bytes;
        bytes = row_bytes - begin < chunk_bytes ? row_bytes - begin : chunk_bytes;
        return static_cast<u64>(row) * row_bytes + begin;
    };
    auto issue_load = [&](const u32 j) {
        const u32 s = j % num_stages;
        u32 bytes;
        const u64 offset = locate(j, bytes);
        mbarrier_arrive_expect_tx(&full[s], bytes);
        tma_load_1d(slots + s * chunk_bytes, src + offset, &full[s], bytes);
    };

    for (u32 j = 0; j + 1 < num_stages && j < num_local; ++j)
        issue_load(j);
    for (u32 j = 0; j < num_local; ++j) {
        const u32 s = j % num_stages;
        mbarrier_wait(&full[s], (j / num_stages) & 1);
        u32 bytes;
        const u64 offset = locate(j, bytes);
        tma_store_1d(dst + offset, slots + s * chunk_bytes, bytes);
        bulk_commit_group();
        if (j + num_stages - 1 < num_local) {
            bulk_wait_group_read<1>();  // the store of item j - 1 no longer reads slot (j - 1) % num_stages
            issue_load(j + num_stages - 1);
        }
    }
    bulk_wait_group<0>();  // all stores performed before the CTA (and its shared memory) goes away
}

}  // namespace megamoe

using namespace megamoe;

extern "C" __global__ void __launch_bounds__(32)
pull_rows(const i64* buffer_ptrs, const u32 num_ranks, const u32 rank, const u32 src_rank, const u64 src_offset,
          const u64 dst_offset, const u32 num_rows, const u32 row_bytes, const u32 chunk_bytes,
          const u32 num_stages) {
    copy_rows<true>(buffer_ptrs, num_ranks, rank, src_rank, src_offset, dst_offset, num_rows, row_bytes,
                    chunk_bytes, num_stages);
}

extern "C" __global__ void __launch_bounds__(32)
push_rows(const i64* buffer_ptrs, const u32 num_ranks, const u32 rank, const u32 dst_rank, const u64 src_offset,
          const u64 dst_offset, const u32 num_rows, const u32 row_bytes, const u32 chunk_bytes,
          const u32 num_stages) {
    copy_rows<false>(buffer_ptrs, num_ranks, rank, dst_rank, src_offset, dst_offset, num_rows, row_bytes,
                     chunk_bytes, num_stages);
}

extern "C" __global__ void __launch_bounds__(96)
rank_barrier_kernel(const i64* buffer_ptrs, const u32 num_ranks, const u32 rank, const u64 signal_offset,
                    const u64 state_offset, const int tag, const u64 timeout_ns) {
    __shared__ SymBuffer<> sym;
    sym.load_from_table(buffer_ptrs, num_ranks, rank);
    __syncthreads();
    rank_barrier(sym, sym.local<int>(signal_offset), sym.local<int>(state_offset), tag, timeout_ns);
}
