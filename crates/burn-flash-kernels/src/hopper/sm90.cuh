// Hopper (sm_90a) instruction wrappers shared by every hand-written kernel of burn-flash:
// mbarriers, TMA tensor loads, warpgroup MMA (`wgmma`) with its fences, register reallocation,
// and packing to 16-bit pairs. Inline PTX only: no CUDA header is included.
//
// The including source defines `WG_ELEM` ("f16" or "bf16"), the element type of the `wgmma`
// operands, before this text.

typedef unsigned int u32;
typedef unsigned long long u64;

// A `CUtensorMap` as the driver encodes it (cuTensorMapEncodeTiled): 128 opaque bytes, passed
// by value as a `const __grid_constant__` kernel parameter.
struct __align__(64) TmaMap { u64 opaque[16]; };

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// ---- mbarrier --------------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

// Makes the barriers' initialisation visible to the async proxy (TMA) and to the other threads.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrives once and announces `bytes` of transactions (TMA writes) the phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred r;\nmbarrier.try_wait.parity.shared::cta.b64 r, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, r;\n}"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}

// A 32-bit word of shared memory at `addr`; volatile, so that it stays after the barrier wait
// that made a TMA write of it visible.
__device__ __forceinline__ u32 lds_u32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

// Stores a 32-bit word to shared memory at `addr`.
__device__ __forceinline__ void sts_u32(u32 addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
}

// A 16-bit element of shared memory at `addr` (volatile, as `lds_u32`).
__device__ __forceinline__ unsigned short lds_u16(u32 addr) {
    unsigned short v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
    return v;
}

// ---- named barriers ----------------------------------------------------------------------

__device__ __forceinline__ void named_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_arrive(u32 id, u32 threads) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

// One arrival per warp on an "empty" barrier, once the warp's products have read the
// slot.
__device__ __forceinline__ void release(u32 bar, u32 lane) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
}

// ---- TMA -------------------------------------------------------------------------------------

// Loads the box of `map` at coordinates (c0 innermost … c3) into shared memory at `dst`,
// completing `bytes` transactions on `bar`. Out-of-bounds elements are written as zeros.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaMap* map, u32 bar, int c0, int c1,
                                            int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];"
        :: "r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to shared
// `dst`, completing `bytes` transactions on `bar`.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        :: "r"(dst), "l"(reinterpret_cast<u64>(src)), "r"(bytes), "r"(bar) : "memory");
}

// Makes this thread's shared-memory stores visible to the async proxy (`wgmma` operands
// read from shared memory, TMA), before a barrier.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- global reductions -----------------------------------------------------------------------

// `dst[0] += a`, `dst[1] += b` (relaxed, GPU scope; `dst` 8-byte aligned).
__device__ __forceinline__ void red_add_v2(float* dst, float a, float b) {
    asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};"
                 :: "l"(dst), "f"(a), "f"(b) : "memory");
}

// Adds `bytes` of f32 (a multiple of 16, both addresses 16-byte aligned) from shared `src` to
// global `dst` element by element (TMA bulk reduce, relaxed, GPU scope), in this thread's
// current bulk group. The writer threads' stores to `src` must be fenced (`fence_proxy_async`)
// and synchronised with the issuing thread first.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}

// Closes this thread's current bulk group.
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until at most N of this thread's bulk groups still read their shared-memory sources.
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}

// Waits until at most N of this thread's bulk groups are incomplete (writes performed).
template <int N> __device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}

// Orders this thread's async-proxy (TMA) global accesses with its generic ones: after a
// completed bulk group and before a release, or after an acquire and before a bulk op.
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

// ---- ordering between blocks -------------------------------------------------------------------

// Waits until the counter at `p` (GPU scope, acquire) equals `value`.
__device__ __forceinline__ void wait_count(const u32* p, u32 value) {
    u32 seen;
    while (true) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(p) : "memory");
        if (seen == value) break;
        __nanosleep(32);
    }
}

// Adds 1 to the counter at `p` (GPU scope, release: what this thread wrote before is seen by
// whoever acquires the new value).
__device__ __forceinline__ void count_release(u32* p) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(p) : "memory");
}

__device__ __forceinline__ void tma_prefetch_map(const TmaMap* map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<u64>(map)) : "memory");
}

// ---- shared-memory fragments ------------------------------------------------------------------

// Four 8 × 8 matrices of 16-bit elements from shared memory: lanes 8q … 8q + 7 give the row
// addresses (16 bytes each) of matrix q; register q of a lane holds elements 2(lane % 4) and
// 2(lane % 4) + 1 of row lane / 4 of matrix q.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// The same four matrices transposed: register q of a lane holds elements (2(lane % 4), lane / 4)
// and (2(lane % 4) + 1, lane / 4) of matrix q.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// ---- register reallocation -------------------------------------------------------------------

template <u32 N> __device__ __forceinline__ void regs_release() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N));
}

template <u32 N> __device__ __forceinline__ void regs_claim() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N));
}

// ---- wgmma -----------------------------------------------------------------------------------

// A shared-memory matrix descriptor with 128-byte swizzling. The tile is made of swizzle atoms
// of 8 rows × 128 bytes (1024-byte aligned). K-major operands: `sbo` = 1024 (between groups of
// 8 rows), `lbo` unused (16). N-major operands: `lbo` = bytes between 64-element column
// blocks, `sbo` = 1024 (between groups of 8 rows along K).
__device__ __forceinline__ u64 desc_sw128(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32)
         | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across a `wgmma` in flight.
template <int R> __device__ __forceinline__ void wgmma_hold(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// ---- 16-bit pairs ----------------------------------------------------------------------------

// `lo` in the low half, `hi` in the high half, each rounded to the nearest WG_ELEM.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    asm("cvt.rn." WG_ELEM "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The `wgmma` accumulator `d` as in/out operands `%0 ..`: 8, 32 or 64 registers.
#define WG_ACC8(d, i)                                                                          \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),    \
        "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_ACC32(d) WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24)
#define WG_ACC64(d) WG_ACC32(d), WG_ACC8(d, 32), WG_ACC8(d, 40), WG_ACC8(d, 48), WG_ACC8(d, 56)

// D (+)= A·B for a 64 × 64 × 16 step: A and B in shared memory (descriptors, K-major);
// `accumulate` 0 overwrites D.
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], u64 da, u64 db, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_ELEM "." WG_ELEM " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}"
        : WG_ACC32(d)
        : "l"(da), "l"(db), "r"(accumulate));
}

// D (+)= A·B for a 64 × 64 × 16 step: A and B in shared memory, both MN-major (`imm-trans-a`
// and `imm-trans-b` 1: A stored K rows of M, B stored K rows of N).
__device__ __forceinline__ void wgmma_ss_n64_tt(float (&d)[32], u64 da, u64 db, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_ELEM "." WG_ELEM " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}"
        : WG_ACC32(d)
        : "l"(da), "l"(db), "r"(accumulate));
}

// D (+)= A·B for a 64 × 64 × 16 step: A in registers (four pairs, the layout of a 64 × 16 slice
// of an accumulator), B in shared memory, N-major (`imm-trans-b` 1).
__device__ __forceinline__ void wgmma_rs_n64_tb(float (&d)[32], const u32 (&a)[4], u64 db,
                                                 u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_ELEM "." WG_ELEM " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}"
        : WG_ACC32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}

// D (+)= A·B for a 64 × 128 × 16 step: A and B in shared memory (descriptors, K-major);
// `accumulate` 0 overwrites D.
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], u64 da, u64 db, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_ELEM "." WG_ELEM " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}"
        : WG_ACC64(d)
        : "l"(da), "l"(db), "r"(accumulate));
}

// D (+)= A·B for a 64 × 128 × 16 step: A in registers (four pairs, the layout of a 64 × 16 slice
// of an accumulator), B in shared memory, N-major (`imm-trans-b` 1).
__device__ __forceinline__ void wgmma_rs_n128_tb(float (&d)[64], const u32 (&a)[4], u64 db,
                                                 u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_ELEM "." WG_ELEM " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}"
        : WG_ACC64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}

