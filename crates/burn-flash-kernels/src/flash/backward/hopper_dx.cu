// dX of softmax(X)·V on Hopper (sm_90a), launched through cubecl's client (hopper_dx.rs):
//
//     dX = P ⊙ (dO·Vᵀ − δ),   P = e^(X − lse),   δ = rowsum(dO ⊙ O)
//
// X `[batch or 1, d1, d2]`, dO `[batch, d1, d3]`, V `[batch or 1, d2, d3]`; lse is the forward's
// (natural log, f32, −inf for a row without a finite score: its P is 0), δ one f32 per row
// (`batch · d1 + row`). A GEMM with K = d3 and the softmax's gradient as its epilogue:
//
// One block of 384 threads computes dX for 128 rows × 256 columns of one batch:
// - warpgroup 0 is the producer: it gives its registers back and one thread issues TMA loads:
//   the X tile (128 × 256) once, then per 64-column chunk of d3 the chunk of dO (128 rows) and
//   of V (256 keys) into a ring of STAGES slots (full/empty mbarriers);
// - warpgroups 1 and 2 are the consumers, 64 rows each: dP = dO·Vᵀ on `wgmma` with both
//   operands in shared memory (two products of 128 keys per k16 step, one accumulator each),
//   keeping one chunk's products in flight while the next is issued; then per 128 keys the X
//   values in the accumulator layout (`ldmatrix`), P, dX, and 4-byte stores.
// Tiles are stored as the TMA writes them with 128-byte swizzling (64-column atoms of 128 or 256
// rows × 128 bytes).
//
// The host prepends WG_ELEM ("f16" | "bf16") and ELEM_BF16.

#define BLOCK_M 128
#define BLOCK_N 256
#define STAGES 3
#define ROW_ATOM (BLOCK_M * 128)
#define KEY_ATOM (BLOCK_N * 128)
#define X_BYTES (BLOCK_N / 64 * ROW_ATOM)
#define SLOT_BYTES (ROW_ATOM + KEY_ATOM)

// The scalars, in the order of the host's words (hopper_dx.rs, `params`).
struct DxParams {
    u64 dx_stride_b, dx_stride_s;
    u64 lse_stride_b, lse_stride_s;
    u32 d1, d2;
    u32 chunks, unused;
    u32 x_batch, v_batch; // 1, or 0 where X or V has one batch for all
};

// Consumer rows row_base … row_base + 63 (16 per warp) and columns col0 … col0 + 127 of a tile
// of `rows` rows (atoms of 64 columns, rows · 128 bytes apart) in the accumulator layout of a
// 64 × 128 `wgmma` result: per 16 columns one `ldmatrix` of four 8 × 8 matrices (rows 0–7 and
// 8–15 of the warp's 16, columns 0–7 and 8–15), registers 8kk … 8kk + 7 in that order. The 8
// rows a phase reads lie in 8 different 16-byte columns of the swizzle: no bank conflicts.
__device__ __forceinline__ void load_x(float (&d)[64], u32 tile, u32 rows, u32 row_base, u32 col0,
                                       u32 warp, u32 lane) {
    const u32 quad = lane / 8u;
    const u32 row = row_base + warp * 16u + (quad % 2u) * 8u + lane % 8u;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        const u32 col = col0 + 16u * kk + (quad / 2u) * 8u;
        const u32 chunk = (col % 64u) / 8u;
        u32 r[4];
        ldmatrix_x4(r, tile + (col / 64u) * rows * 128u + row * 128u + ((chunk ^ (row % 8u)) << 4));
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            d[8 * kk + 2 * m] = elem_to_f32((unsigned short)(r[m] & 0xffffu));
            d[8 * kk + 2 * m + 1] = elem_to_f32((unsigned short)(r[m] >> 16));
        }
    }
}

// dX for 128 keys (key0 …) of this thread's rows from dP (`dp`), the X values (`xs`), and the
// rows' base-2 lse and δ; stored as pairs where the row and keys are inside dX.
__device__ __forceinline__ void store_dx(unsigned short* dx_rows, const float (&dp)[64],
                                         const float (&xs)[64], const float (&lse2)[2],
                                         const float (&delta)[2], const int (&row)[2], int key0,
                                         const DxParams& p, u32 lane) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const int key = key0 + 8 * i + 2 * (int)(lane % 4u);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float g[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int k = 4 * i + 2 * r + e;
                const float pv = ex2(fmaf(xs[k], LOG2E, -lse2[r]));
                g[e] = pv * (dp[k] - delta[r]);
            }
            if (row[r] < (int)p.d1 && key < (int)p.d2) {
                *reinterpret_cast<u32*>(dx_rows + (u64)row[r] * p.dx_stride_s + key) =
                    pack2(g[0], g[1]);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(384, 1)
burn_flash_hopper_smm_dx(const __grid_constant__ TmaMap tx, const __grid_constant__ TmaMap tdo,
                         const __grid_constant__ TmaMap tv, const unsigned short* x_buffer,
                         const unsigned short* do_buffer, const unsigned short* v_buffer,
                         const float* __restrict__ lse, const float* __restrict__ delta,
                         unsigned short* __restrict__ dx, const __grid_constant__ DxParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char smem_raw[];
    // Swizzle atoms are 1024-byte aligned (the swizzle pattern follows address bits 4..9).
    const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const u32 sx = base;
    const u32 ring = sx + X_BYTES;
    const u32 bars = ring + STAGES * SLOT_BYTES;
    const u32 x_full = bars;
#define FULL(s) (bars + 8u + 8u * (s))
#define EMPTY(s) (bars + 8u + 8u * STAGES + 8u * (s))

    const u32 tid = threadIdx.x;
    // Key blocks of one row block are adjacent blocks: they read the same dO through L2.
    const u32 batch = blockIdx.z;
    const int n0 = (int)blockIdx.x * BLOCK_N, m0 = (int)blockIdx.y * BLOCK_M;
    const int chunks = (int)p.chunks;

    if (tid == 0) {
        mbar_init(x_full, 1);
#pragma unroll
        for (u32 s = 0; s < STAGES; ++s) {
            mbar_init(FULL(s), 1);
            // One arrival per consumer warp.
            mbar_init(EMPTY(s), 8);
        }
        mbar_init_fence();
    }
    __syncthreads();

    const u32 wg = tid / 128u;
    if (wg == 0) {
        // ---- producer ----
        regs_release<24>();
        if (tid == 0) {
            tma_prefetch_map(&tx);
            tma_prefetch_map(&tdo);
            tma_prefetch_map(&tv);
            const int xb = (int)(batch * p.x_batch), vb = (int)(batch * p.v_batch);
            mbar_arrive_expect_tx(x_full, X_BYTES);
#pragma unroll
            for (int a = 0; a < BLOCK_N / 64; ++a) {
                tma_load_4d(sx + a * ROW_ATOM, &tx, x_full, n0 + 64 * a, m0, 0, xb);
            }
            for (int ch = 0; ch < chunks; ++ch) {
                const u32 s = ch % STAGES, use = ch / STAGES;
                if (ch >= STAGES) mbar_wait(EMPTY(s), (use - 1u) & 1u);
                mbar_arrive_expect_tx(FULL(s), SLOT_BYTES);
                const u32 slot = ring + s * SLOT_BYTES;
                tma_load_4d(slot, &tdo, FULL(s), 64 * ch, m0, 0, (int)batch);
                tma_load_4d(slot + ROW_ATOM, &tv, FULL(s), 64 * ch, n0, 0, vb);
            }
        }
        return;
    }

    // ---- consumers ----
    regs_claim<240>();
    const u32 c = wg - 1u;
    const u32 t = tid % 128u, warp = t / 32u, lane = t % 32u;
    // This thread's rows: row0 and row0 + 8 (the accumulator layout of `wgmma`); their lse and
    // δ are read before the products, so that the epilogue does not wait on them.
    const int row0 = m0 + 64 * (int)c + 16 * (int)warp + (int)(lane / 4u);
    const int row[2] = {row0, row0 + 8};
    float lse2[2], dlt[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        lse2[r] = __int_as_float(0x7f800000);
        dlt[r] = 0.0f;
        if (row[r] < (int)p.d1) {
            const float l = lse[(u64)batch * p.lse_stride_b + (u64)row[r] * p.lse_stride_s];
            // A row without a finite score has P = 0: +inf makes every e^(x − lse) 0.
            if (l != NEG_INF) lse2[r] = l * LOG2E;
            dlt[r] = delta[(u64)batch * p.d1 + (u64)row[r]];
        }
    }
    float dp0[64], dp1[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        dp0[i] = 0.0f;
        dp1[i] = 0.0f;
    }
    // dP = dO·Vᵀ: per chunk 4 steps of k16 (32 bytes further into the swizzled rows), each two
    // products of 128 keys; chunk ch − 1's slot is released once chunk ch is issued and the
    // products before it have landed.
    for (int ch = 0; ch < chunks; ++ch) {
        const u32 s = ch % STAGES, phase = (ch / STAGES) & 1;
        const u32 slot = ring + s * SLOT_BYTES;
        mbar_wait(FULL(s), phase);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const u64 da = desc_sw128(slot + c * 64u * 128u + kk * 32u, 16, 1024);
            const u32 keys = slot + ROW_ATOM + kk * 32u;
            const u32 acc = (ch > 0 || kk > 0) ? 1u : 0u;
            wgmma_ss_n128(dp0, da, desc_sw128(keys, 16, 1024), acc);
            wgmma_ss_n128(dp1, da, desc_sw128(keys + 128u * 128u, 16, 1024), acc);
        }
        wgmma_commit();
        if (ch > 0) {
            wgmma_wait<1>();
            release(EMPTY((ch - 1) % STAGES), lane);
        }
    }
    wgmma_wait<0>();
    wgmma_hold(dp0);
    wgmma_hold(dp1);
    if (chunks > 0) release(EMPTY((chunks - 1) % STAGES), lane);

    unsigned short* dx_rows = dx + (u64)batch * p.dx_stride_b;
    mbar_wait(x_full, 0);
    float xs[64];
    load_x(xs, sx, BLOCK_M, 64u * c, 0u, warp, lane);
    store_dx(dx_rows, dp0, xs, lse2, dlt, row, n0, p, lane);
    load_x(xs, sx, BLOCK_M, 64u * c, 128u, warp, lane);
    store_dx(dx_rows, dp1, xs, lse2, dlt, row, n0 + 128, p, lane);
#endif
}
