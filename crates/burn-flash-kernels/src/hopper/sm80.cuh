// Ampere (sm_80 … sm_90) instruction wrappers for the hand-written `mma.sync` kernels of
// burn-flash (flash/backward/sm80.cu, sm80_given.cu): `ldmatrix` (plain and transposed),
// warp-level `mma.sync.aligned.m16n8k16` with f32 accumulators, 16-byte `cp.async` with its
// groups and the swizzled tile copies built on it, f32 reductions into global memory, and
// packing to 16-bit pairs. Inline PTX only: no CUDA header
// is included. Every name carries `sm80_`, so that this text may share a translation unit with
// sm90.cuh (the typedefs below are the same as sm90.cuh's and scores.cuh's: C++ allows a
// typedef to be repeated with the same type).
//
// The including source defines `ELEM_BF16` (0 | 1: the 16-bit element type, bf16 or f16)
// before this text.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), with g = lane / 4 and
// t = lane % 4; each 32-bit register holds two 16-bit elements, the lower-indexed one in the
// lower half:
//   A (16 × 16, row-major; four registers a0 … a3):
//     a0 = A[g][2t, 2t + 1]      a1 = A[g + 8][2t, 2t + 1]
//     a2 = A[g][2t + 8, 2t + 9]  a3 = A[g + 8][2t + 8, 2t + 9]
//   B (16 × 8, "col": indexed B[k][n]; two registers b0, b1):
//     b0 = B[2t, 2t + 1][g]      b1 = B[2t + 8, 2t + 9][g]
//   C, D (16 × 8, f32; four registers c0 … c3):
//     c0, c1 = C[g][2t, 2t + 1]  c2, c3 = C[g + 8][2t, 2t + 1]

typedef unsigned int u32;
typedef unsigned long long u64;

// The shared-window address of a generic pointer into shared memory.
__device__ __forceinline__ u32 sm80_smem(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// ---- shared-memory fragments ------------------------------------------------------------------

// Four 8 × 8 matrices of 16-bit elements from shared memory: lanes 8q … 8q + 7 give the row
// addresses (16 bytes each, 16-byte aligned) of matrix q, its rows 0 … 7; register q of a lane
// holds elements 2(lane % 4) and 2(lane % 4) + 1 of row lane / 4 of matrix q.
__device__ __forceinline__ void sm80_ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// The same four matrices transposed: register q of a lane holds elements (row 2(lane % 4),
// column lane / 4) and (row 2(lane % 4) + 1, column lane / 4) of matrix q as stored.
__device__ __forceinline__ void sm80_ldsm_x4_t(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// Stores a 32-bit word (two 16-bit elements) to shared memory at `addr`.
__device__ __forceinline__ void sm80_sts_u32(u32 addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
}

// 16 bytes of shared memory at `addr` (16-byte aligned).
__device__ __forceinline__ uint4 sm80_lds_v4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}

// ---- warp MMA -----------------------------------------------------------------------------------

// d += A·B for one 16 × 8 × 16 tile (the layouts above), f32 accumulators, in place.
__device__ __forceinline__ void sm80_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if ELEM_BF16
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two f32 as a pair of the element type, rounded to nearest: `lo` in the lower half (the
// lower address, the lower index of a fragment register).
__device__ __forceinline__ u32 sm80_pack2(float lo, float hi) {
    u32 r;
#if ELEM_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// ---- asynchronous copies ---------------------------------------------------------------------

// Copies 16 bytes from global `src` (16-byte aligned) to shared `dst` (16-byte aligned),
// bypassing L1 (`.cg`): only the first `src_bytes` (0 … 16) are read, the rest of the 16 are
// written as zeros (src_bytes 0 reads nothing; `src` should still be a valid address).
__device__ __forceinline__ void sm80_cp_async(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(reinterpret_cast<u64>(src)), "r"(src_bytes) : "memory");
}

// Closes this thread's current group of `cp.async` (an empty group is fine).
__device__ __forceinline__ void sm80_cp_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits until at most N of this thread's committed groups are pending. The copies are then
// visible to this thread only: a barrier makes them visible to the block.
template <int N> __device__ __forceinline__ void sm80_cp_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// ---- swizzled tiles ----------------------------------------------------------------------------

// The swizzled byte offset of row `row`, 16-byte chunk `chunk` in a tile of `row_bytes` (a
// multiple of 128) per row: chunk c of row r at chunk c ^ (r % 8), so that the 8 row addresses
// of an `ldmatrix` phase and the 8 rows of a fragment's 32-bit accesses hit 32 distinct banks.
__device__ __forceinline__ u32 sm80_swz(u32 row, u32 chunk, u32 row_bytes) {
    return row * row_bytes + ((chunk ^ (row & 7u)) << 4);
}

// Issues the copies of a ROWS × COLS tile (COLS elements a row, 8 per chunk) from `src` (its
// first row; row r at src + r·stride) into the swizzled tile at shared `dst`: rows at or past
// `rows` and columns at or past `cols` are zeros. All THREADS threads of the block, ROWS·COLS/8
// chunks.
template <int THREADS, int ROWS, int COLS>
__device__ __forceinline__ void sm80_load_tile(u32 dst, const unsigned short* src, u64 stride,
                                               int rows, int cols, u32 tid) {
    constexpr int CHUNKS = COLS / 8;
    static_assert((ROWS * CHUNKS) % THREADS == 0, "whole rounds of chunks");
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
        const int idx = (int)tid + THREADS * i;
        const int r = idx / CHUNKS, c = idx % CHUNKS;
        int bytes = 2 * (cols - 8 * c);
        bytes = bytes < 0 ? 0 : (bytes > 16 ? 16 : bytes);
        if (r >= rows) bytes = 0;
        // Nothing is read for 0 bytes; the tile's first row stays a valid address anyway.
        const unsigned short* from = bytes > 0 ? src + (u64)r * stride + 8 * c : src;
        sm80_cp_async(dst + sm80_swz((u32)r, (u32)c, COLS * 2), from, (u32)bytes);
    }
}

// ---- global reductions -----------------------------------------------------------------------

// `dst[0] += a`, `dst[1] += b` (relaxed, GPU scope; `dst` 8-byte aligned): one vector
// reduction `red.global.add.v2.f32` where the architecture has it (sm_90), else two scalar
// `red.global.add.f32` (sm_80 … sm_89; what `atomicAdd` on each float compiles to when its
// result is unused).
__device__ __forceinline__ void sm80_red_add2(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};"
                 :: "l"(dst), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;" :: "l"(dst), "f"(a) : "memory");
    asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;" :: "l"(dst + 1), "f"(b) : "memory");
#endif
}
