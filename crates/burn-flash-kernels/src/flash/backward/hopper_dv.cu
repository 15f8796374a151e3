// dV of softmax(X)·V on Hopper (sm_90a), launched through cubecl's client (hopper_given.rs):
//
//     dV = Pᵀ·dO,   P = e^(X − lse)
//
// X `[batch, d1, d2]`, dO `[batch, d1, d3]`, dV `[batch or 1, d2, d3]` (one dV for all batches
// sums them: a shared V); lse is the forward's (natural log, f32, −inf for a row without a
// finite score: its P is 0). A GEMM over the rows, with Pᵀ built in registers as its A operand:
//
// One block of 384 threads computes dV for 128 keys × 256 columns of one dV batch, walking the
// rows of every batch that feeds it, 64 per step:
// - warpgroup 0 is the producer: it gives its registers back and one thread issues TMA loads
//   per step (the X tile, 64 rows × 128 keys, and the dO tile, 64 rows × 256 columns) into a
//   ring of STAGES slots (full/empty mbarriers);
// - warpgroups 1 and 2 are the consumers, 64 keys each: Xᵀ from the slot in the A-operand
//   layout (`ldmatrix.trans`), P = 2^(x·log2 e − lse₂) per element, packed, then dV += Pᵀ·dO on
//   `wgmma` (A from registers, dO read N-major; two products of 128 columns per k16 step, one
//   accumulator each). A step's P is built while the step before's products run.
// Tiles are stored as the TMA writes them with 128-byte swizzling (64-column atoms of 64 rows ×
// 128 bytes).
//
// The host prepends WG_ELEM ("f16" | "bf16") and ELEM_BF16.

#define BLOCK_M 64
#define BLOCK_N 128
#define BLOCK_C 256
#define STAGES 3
#define ROW_ATOM (BLOCK_M * 128)
#define X_TILE (BLOCK_N / 64 * ROW_ATOM)
#define DO_TILE (BLOCK_C / 64 * ROW_ATOM)
#define SLOT_BYTES (X_TILE + DO_TILE)

// The scalars, in the order of the host's words (hopper_given.rs, `dv_params`).
struct DvParams {
    u64 dv_stride_b, dv_stride_s;
    u64 lse_stride_b, lse_stride_s;
    u32 d1, d2;
    u32 d3, batches; // batches: how many batches feed one dV (1, or all of them: a shared V)
    u32 x_batch, unused; // 1, or 0 where X has one batch for all
};

// Pᵀ for consumer `c`'s 64 keys and the slot's 64 rows as four k16 A operands: per 16 rows one
// `ldmatrix.trans` of four 8 × 8 matrices of X (rows 0–7 / 8–15 × keys 0–7 / 8–15 of the warp's
// 16), which land as (key, row pair) — the A layout — then e^(x − lse) per element.
__device__ __forceinline__ void weights_t(u32 (&pa)[4][4], u32 xt, const float (&lse2)[4][4],
                                          u32 c, u32 warp, u32 lane) {
    const u32 quad = lane / 8u;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const u32 row = 16u * kk + (quad / 2u) * 8u + lane % 8u;
        const u32 chunk = 2u * warp + quad % 2u;
        u32 r[4];
        ldmatrix_x4_trans(r, xt + c * ROW_ATOM + row * 128u + ((chunk ^ (row % 8u)) << 4));
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            // Register m holds rows 2(lane % 4) + {0, 1} (+ 8 for m ≥ 2) of key lane / 4
            // (+ 8 for odd m).
            const float x0 = elem_to_f32((unsigned short)(r[m] & 0xffffu));
            const float x1 = elem_to_f32((unsigned short)(r[m] >> 16));
            const int h = m / 2;
            pa[kk][m] = pack2(ex2(fmaf(x0, LOG2E, -lse2[kk][2 * h])),
                              ex2(fmaf(x1, LOG2E, -lse2[kk][2 * h + 1])));
        }
    }
}

// The base-2 lse of the rows a thread's A operands hold at step row m0 of batch b: rows
// m0 + 16kk + 2(lane % 4) + {0, 1} and + 8; +inf past d1 or for a row without a finite score.
__device__ __forceinline__ void step_lse(float (&lse2)[4][4], const float* lse, u32 b, int m0,
                                         const DvParams& p, u32 lane) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = m0 + 16 * kk + 2 * (int)(lane % 4u) + (e % 2) + 8 * (e / 2);
            float l2 = __int_as_float(0x7f800000);
            if (row < (int)p.d1) {
                const float l = lse[(u64)b * p.lse_stride_b + (u64)row * p.lse_stride_s];
                if (l != NEG_INF) l2 = l * LOG2E;
            }
            lse2[kk][e] = l2;
        }
    }
}

extern "C" __global__ void __launch_bounds__(384, 1)
burn_flash_hopper_smm_dv(const __grid_constant__ TmaMap tx, const __grid_constant__ TmaMap tdo,
                         const unsigned short* x_buffer, const unsigned short* do_buffer,
                         const float* __restrict__ lse, unsigned short* __restrict__ dv,
                         const __grid_constant__ DvParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char smem_raw[];
    // Swizzle atoms are 1024-byte aligned (the swizzle pattern follows address bits 4..9).
    const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const u32 ring = base;
    const u32 bars = ring + STAGES * SLOT_BYTES;
#define FULL(s) (bars + 8u * (s))
#define EMPTY(s) (bars + 8u * STAGES + 8u * (s))

    const u32 tid = threadIdx.x;
    // Column tiles of one key block are adjacent blocks: they read the same X through L2.
    const u32 col0 = blockIdx.x * BLOCK_C;
    const int n0 = (int)blockIdx.y * BLOCK_N;
    const u32 dv_batch = blockIdx.z;
    const int per_batch = ((int)p.d1 + BLOCK_M - 1) / BLOCK_M;
    const int steps = per_batch * (int)p.batches;

    if (tid == 0) {
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
            for (int it = 0; it < steps; ++it) {
                const u32 s = it % STAGES, use = it / STAGES;
                const int b = p.batches == 1 ? (int)dv_batch : it / per_batch;
                const int m0 = (it % per_batch) * BLOCK_M;
                if (it >= STAGES) mbar_wait(EMPTY(s), (use - 1u) & 1u);
                mbar_arrive_expect_tx(FULL(s), SLOT_BYTES);
                const u32 slot = ring + s * SLOT_BYTES;
#pragma unroll
                for (int a = 0; a < BLOCK_N / 64; ++a) {
                    tma_load_4d(slot + a * ROW_ATOM, &tx, FULL(s), n0 + 64 * a, m0, 0,
                                b * (int)p.x_batch);
                }
#pragma unroll
                for (int a = 0; a < BLOCK_C / 64; ++a) {
                    tma_load_4d(slot + X_TILE + a * ROW_ATOM, &tdo, FULL(s),
                                (int)col0 + 64 * a, m0, 0, b);
                }
            }
        }
        return;
    }

    // ---- consumers ----
    regs_claim<240>();
    const u32 c = wg - 1u;
    const u32 t = tid % 128u, warp = t / 32u, lane = t % 32u;
    float dv0[64], dv1[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        dv0[i] = 0.0f;
        dv1[i] = 0.0f;
    }
    u32 pa[4][4];
    float lse2[4][4];
    for (int it = 0; it < steps; ++it) {
        const u32 s = it % STAGES, phase = (it / STAGES) & 1;
        const u32 b = p.batches == 1 ? dv_batch : (u32)(it / per_batch);
        const int m0 = (it % per_batch) * BLOCK_M;
        const u32 slot = ring + s * SLOT_BYTES;
        step_lse(lse2, lse, b, m0, p, lane);
        mbar_wait(FULL(s), phase);
        weights_t(pa, slot, lse2, c, warp, lane);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const u32 rows = slot + X_TILE + kk * 16u * 128u;
            wgmma_rs_n128_tb(dv0, pa[kk], desc_sw128(rows, ROW_ATOM, 1024), 1u);
            wgmma_rs_n128_tb(dv1, pa[kk], desc_sw128(rows + 2u * ROW_ATOM, ROW_ATOM, 1024), 1u);
        }
        wgmma_commit();
        // The products of the step before have landed: its slot goes back to the producer.
        if (it > 0) {
            wgmma_wait<1>();
            release(EMPTY((it - 1) % STAGES), lane);
        }
    }
    wgmma_wait<0>();
    wgmma_hold(dv0);
    wgmma_hold(dv1);
    if (steps > 0) release(EMPTY((steps - 1) % STAGES), lane);

    // This thread's keys: key0 and key0 + 8 (the accumulator layout), pairs of columns.
    const int key0 = n0 + 64 * (int)c + 16 * (int)warp + (int)(lane / 4u);
    unsigned short* out = dv + (u64)dv_batch * p.dv_stride_b;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + 8 * r;
        if (key >= (int)p.d2) continue;
        unsigned short* row = out + (u64)key * p.dv_stride_s + col0;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const u32 col = 8u * i + 2u * (lane % 4u);
            const float* acc = i < 16 ? dv0 : dv1;
            const int k = 4 * (i % 16) + 2 * r;
            if (col0 + col < p.d3) {
                *reinterpret_cast<u32*>(row + col) = pack2(acc[k], acc[k + 1]);
            }
        }
    }
#endif
}
