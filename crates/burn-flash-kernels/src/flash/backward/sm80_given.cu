// The backward of softmax(X)·V on Ampere and later (sm_80 … sm_90): two GEMM kernels on
// warp-level `mma.sync.aligned.m16n8k16` (16-bit inputs, f32 accumulators), `ldmatrix` and
// double-buffered `cp.async` (sm80_given.rs launches them; the Hopper pair, hopper_dx.cu and
// hopper_dv.cu, computes the same on `wgmma`):
//
//     dX = P ⊙ (dO·Vᵀ − δ)      burn_flash_sm80_smm_dx: a GEMM over d3, the softmax's
//                               gradient as its epilogue
//     dV = Pᵀ·dO                burn_flash_sm80_smm_dv: a GEMM over the rows, Pᵀ built in
//                               registers from the transposed X fragments
//     P = e^(X − lse),  δ = rowsum(dO ⊙ O)
//
// X `[batch or 1, d1, d2]`, V `[batch or 1, d2, d3]`, dO `[batch, d1, d3]`, dX like X but
// batched, dV `[batch or 1, d2, d3]` (one dV for all batches sums them: a shared V). lse is the
// forward's (natural log, f32, −inf for a row without a finite score: its P is 0), δ one f32 per
// row (`batch · d1 + row`). Every tensor is read and written through its strides (a shared
// tensor has batch stride 0); rows are 16-byte aligned with unit stride along them (the host
// checks it), so that a row's 8-element chunks are 16-byte `cp.async` copies; a last partial
// chunk is read with a short source size and the rest of the 16 bytes zero-filled.
//
// The source NVRTC gets is ../../hopper/sm80.cuh, ../scores.cuh and this file, concatenated in
// that order after the host's defines (ELEM_BF16, 0 | 1). Tiles in shared memory are rows of
// 16-bit elements, row r's 16-byte chunk c stored at chunk c ^ (r % 8) (the XOR swizzle of
// sm80.cuh's `sm80_swz`, copied in by its `sm80_load_tile`): the 8 row addresses of an
// `ldmatrix` phase and the 8 rows × 4 words of a pair read hit 32 distinct banks.

#define SMG_THREADS 256

// The scalars, in the order of the host's words (sm80_given.rs, `params`): batch and row strides
// in elements of X, V, dO, the gradient written (dX or dV) and lse.
struct SmgParams {
    u64 x_sb, x_ss;
    u64 v_sb, v_ss;
    u64 do_sb, do_ss;
    u64 g_sb, g_ss;
    u64 lse_sb, lse_ss;
    u32 d1, d2;
    u32 d3, batches; // batches (dV): how many batches feed one dV (1, or all of them)
};
static_assert(sizeof(SmgParams) == 96, "the host's twelve words (sm80_given.rs, PARAM_WORDS)");

// A row's base-2 lse: +inf where the row has no finite score (every weight 0).
__device__ __forceinline__ float smg_lse2(float l) {
    return l == NEG_INF ? __int_as_float(0x7f800000) : l * LOG2E;
}

// ---- dX ----------------------------------------------------------------------------------------
//
// One block of 256 threads (8 warps: 2 along the rows × 4 along the keys, 64 × 32 each) computes
// dX for 128 rows × 128 keys of one batch: dP = dO·Vᵀ over d3 in chunks of 64 columns (two
// slots, the next chunk's copies under this chunk's products), then per element
// P = 2^(x·log₂e − lse₂) from the X tile (copied with the last chunk) and dX = P·(dP − δ).
// Grid: x = ⌈d2 / 128⌉ (adjacent blocks read the same dO rows through L2), y = ⌈d1 / 128⌉,
// z = batch. Shared memory (dynamic, DX_SMEM):
//   per slot s < 2: dO chunk 128 × 64, V chunk 128 × 64     at s · DX_SLOT
//   X tile 128 × 128                                        at DX_OFF_X
//   lse₂, δ of the 128 rows (f32)                           at DX_OFF_LSE, DX_OFF_DELTA

#define DX_SLOT (2 * 128 * 128)
#define DX_OFF_X (2 * DX_SLOT)
#define DX_OFF_LSE (DX_OFF_X + 128 * 256)
#define DX_OFF_DELTA (DX_OFF_LSE + 128 * 4)
#define DX_SMEM (DX_OFF_DELTA + 128 * 4)

extern "C" __global__ void __launch_bounds__(SMG_THREADS, 1)
burn_flash_sm80_smm_dx(const unsigned short* __restrict__ x,
                       const unsigned short* __restrict__ v,
                       const unsigned short* __restrict__ d_out,
                       const float* __restrict__ lse,
                       const float* __restrict__ delta,
                       unsigned short* __restrict__ dx,
                       const __grid_constant__ SmgParams p)
{
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(128) unsigned char smg_smem[];
    const u32 base = sm80_smem(smg_smem);
    const u32 tid = threadIdx.x, warp = tid / 32u, lane = tid % 32u;
    const int g = (int)(lane / 4u), t = (int)(lane % 4u);
    // The lane address patterns of sm80.cu: X (row + lane % 16, chunk + lane / 16) for A
    // fragments of a row-major [m][k] tile, Y (row + lane % 8 + 8·(lane / 16), chunk +
    // (lane / 8) % 2) for the B fragments of two n-tiles of an [n][k] tile.
    const u32 x7 = lane % 8u;
    const u32 row_x = lane % 16u, row_y = lane % 8u + 8u * (lane / 16u);
    const u32 cx = ((lane / 16u) ^ x7) << 4, cy = (((lane / 8u) % 2u) ^ x7) << 4;

    const int n0 = (int)blockIdx.x * 128, m0 = (int)blockIdx.y * 128;
    const u32 batch = blockIdx.z;
    const int d1 = (int)p.d1, d2 = (int)p.d2, d3 = (int)p.d3;
    const int chunks = (d3 + 63) / 64;
    const unsigned short* do_rows = d_out + (u64)batch * p.do_sb + (u64)m0 * p.do_ss;
    const unsigned short* v_keys = v + (u64)batch * p.v_sb + (u64)n0 * p.v_ss;
    const unsigned short* x_tile = x + (u64)batch * p.x_sb + (u64)m0 * p.x_ss + n0;

    // The rows' lse₂ and δ (+inf and 0 past d1), read by the epilogue after the loop's barriers.
    float* s_lse = reinterpret_cast<float*>(smg_smem + DX_OFF_LSE);
    float* s_delta = reinterpret_cast<float*>(smg_smem + DX_OFF_DELTA);
    if (tid < 128u) {
        const int row = m0 + (int)tid;
        s_lse[tid] = row < d1 ? smg_lse2(lse[(u64)batch * p.lse_sb + (u64)row * p.lse_ss])
                              : __int_as_float(0x7f800000);
    } else {
        const int row = m0 + (int)tid - 128;
        s_delta[tid - 128u] = row < d1 ? delta[(u64)batch * d1 + (u64)row] : 0.0f;
    }

    // Chunk `ch` into slot ch % 2; the X tile rides with the last chunk (the epilogue's only).
    auto issue = [&](int ch) {
        const u32 slot = base + (u32)(ch % 2) * DX_SLOT;
        sm80_load_tile<SMG_THREADS, 128, 64>(slot, do_rows + 64 * ch, p.do_ss, d1 - m0, d3 - 64 * ch, tid);
        sm80_load_tile<SMG_THREADS, 128, 64>(slot + 128u * 128u, v_keys + 64 * ch, p.v_ss, d2 - n0, d3 - 64 * ch, tid);
        if (ch == chunks - 1) sm80_load_tile<SMG_THREADS, 128, 128>(base + DX_OFF_X, x_tile, p.x_ss, d1 - m0, d2 - n0, tid);
        sm80_cp_commit();
    };

    const u32 wm = warp / 4u, wn = warp % 4u;
    const u32 row0 = 64u * wm, key0 = 32u * wn;
    float acc[4][4][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;

    issue(0);
    for (int ch = 0; ch < chunks; ++ch) {
        if (ch + 1 < chunks) {
            issue(ch + 1);
            sm80_cp_wait<1>();
        } else {
            sm80_cp_wait<0>();
        }
        __syncthreads();
        const u32 sa = base + (u32)(ch % 2) * DX_SLOT, sb = sa + 128u * 128u;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            u32 a[4][4];
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                sm80_ldsm_x4(a[mt], sa + (row0 + 16u * mt + row_x) * 128u + (cx ^ (32u * kk)));
            }
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                u32 b[4];
                sm80_ldsm_x4(b, sb + (key0 + 16u * np + row_y) * 128u + (cy ^ (32u * kk)));
#pragma unroll
                for (int mt = 0; mt < 4; ++mt) {
                    sm80_mma(acc[mt][2 * np], a[mt], b[0], b[1]);
                    sm80_mma(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }
        // The next iteration's copies go to this slot.
        __syncthreads();
    }

    // Epilogue: dX = P·(dP − δ) for this thread's pairs (the C layout), X read from the tile.
    unsigned short* dx_rows = dx + (u64)batch * p.g_sb;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 r = row0 + 16u * mt + (u32)g + 8u * h;
            const int row = m0 + (int)r;
            const float l2 = s_lse[r];
            const float dl = s_delta[r];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const u32 kl = key0 + 8u * nt + 2u * (u32)t;
                const u32 xs = *reinterpret_cast<const u32*>(
                    smg_smem + DX_OFF_X + sm80_swz(r, kl / 8u, 256u) + 2u * (kl % 8u));
                const float p0 = ex2(fmaf(elem_to_f32((unsigned short)(xs & 0xffffu)), LOG2E, -l2));
                const float p1 = ex2(fmaf(elem_to_f32((unsigned short)(xs >> 16)), LOG2E, -l2));
                const float g0 = p0 * (acc[mt][nt][2 * h] - dl);
                const float g1 = p1 * (acc[mt][nt][2 * h + 1] - dl);
                const int key = n0 + (int)kl;
                if (row < d1 && key < d2) {
                    *reinterpret_cast<u32*>(dx_rows + (u64)row * p.g_ss + key) = sm80_pack2(g0, g1);
                }
            }
        }
    }
#endif
}

// ---- dV ----------------------------------------------------------------------------------------
//
// One block of 256 threads (8 warps: 4 along the keys × 2 along the columns, 32 × 64 each)
// computes dV for 128 keys × 128 columns of one dV batch, walking the rows of every batch that
// feeds it 64 at a time (two slots, the next step's copies under this step's products): the
// X tile's transposed fragments (`ldmatrix.trans`, the A layout of Pᵀ) become
// P = 2^(x·log₂e − lse₂) in registers, then dV += Pᵀ·dO. Grid: x = ⌈d3 / 128⌉, y = ⌈d2 / 128⌉,
// z = dV's batches. Shared memory (dynamic, DV_SMEM), per slot s < 2 at s · DV_SLOT:
//   X 64 rows × 128 keys, dO 64 rows × 128 columns, lse₂ of the 64 rows (f32)

#define DV_TILE (64 * 256)
#define DV_SLOT (2 * DV_TILE + 64 * 4)
#define DV_SMEM (2 * DV_SLOT)

extern "C" __global__ void __launch_bounds__(SMG_THREADS, 1)
burn_flash_sm80_smm_dv(const unsigned short* __restrict__ x,
                       const unsigned short* __restrict__ d_out,
                       const float* __restrict__ lse,
                       unsigned short* __restrict__ dv,
                       const __grid_constant__ SmgParams p)
{
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(128) unsigned char smg_smem[];
    const u32 base = sm80_smem(smg_smem);
    const u32 tid = threadIdx.x, warp = tid / 32u, lane = tid % 32u;
    const int g = (int)(lane / 4u), t = (int)(lane % 4u);
    // Transposed `ldmatrix` patterns (sm80.cu): Y for the A fragment of the transpose of the
    // stored [row][key] X tile, X for the B fragments of two n-tiles of the [row][column] dO
    // tile.
    const u32 x7 = lane % 8u;
    const u32 row_x = lane % 16u, row_y = lane % 8u + 8u * (lane / 16u);
    const u32 cx = ((lane / 16u) ^ x7) << 4, cy = (((lane / 8u) % 2u) ^ x7) << 4;

    const int c0 = (int)blockIdx.x * 128, n0 = (int)blockIdx.y * 128;
    const u32 dv_batch = blockIdx.z;
    const int d1 = (int)p.d1, d2 = (int)p.d2, d3 = (int)p.d3;
    const int per_batch = (d1 + 63) / 64;
    const int steps = per_batch * (int)p.batches;

    // Step `it` into slot it % 2: rows m0 … m0 + 63 of batch b (zeros past d1), their lse₂
    // (+inf past d1: P = 0 there).
    auto issue = [&](int it) {
        const u32 slot = base + (u32)(it % 2) * DV_SLOT;
        const u32 b = p.batches == 1u ? dv_batch : (u32)(it / per_batch);
        const int m0 = (it % per_batch) * 64;
        sm80_load_tile<SMG_THREADS, 64, 128>(slot, x + (u64)b * p.x_sb + (u64)m0 * p.x_ss + n0, p.x_ss, d1 - m0,
                          d2 - n0, tid);
        sm80_load_tile<SMG_THREADS, 64, 128>(slot + DV_TILE, d_out + (u64)b * p.do_sb + (u64)m0 * p.do_ss + c0,
                          p.do_ss, d1 - m0, d3 - c0, tid);
        sm80_cp_commit();
        if (tid < 64u) {
            const int row = m0 + (int)tid;
            reinterpret_cast<float*>(smg_smem + (it % 2) * DV_SLOT + 2 * DV_TILE)[tid] =
                row < d1 ? smg_lse2(lse[(u64)b * p.lse_sb + (u64)row * p.lse_ss])
                         : __int_as_float(0x7f800000);
        }
    };

    const u32 wk = warp % 4u, wc = warp / 4u;
    const u32 key0 = 32u * wk, col0 = 64u * wc;
    float acc[2][8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;

    if (steps > 0) issue(0);
    for (int it = 0; it < steps; ++it) {
        if (it + 1 < steps) {
            issue(it + 1);
            sm80_cp_wait<1>();
        } else {
            sm80_cp_wait<0>();
        }
        __syncthreads();
        const u32 sx = base + (u32)(it % 2) * DV_SLOT, sd = sx + DV_TILE;
        const float* s_lse = reinterpret_cast<const float*>(smg_smem + (it % 2) * DV_SLOT + 2 * DV_TILE);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            // This thread's rows of the k16 step: 2t, 2t + 1 (registers 0, 1) and + 8 (2, 3).
            const float2 la = *reinterpret_cast<const float2*>(s_lse + 16 * kk + 2 * t);
            const float2 lb = *reinterpret_cast<const float2*>(s_lse + 16 * kk + 8 + 2 * t);
            u32 a[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                u32 r[4];
                sm80_ldsm_x4_t(r, sx + (16u * kk + row_y) * 256u + (cy ^ ((key0 / 8u + 2u * mt) << 4)));
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float2 l = q < 2 ? la : lb;
                    const float p0 = ex2(fmaf(elem_to_f32((unsigned short)(r[q] & 0xffffu)), LOG2E, -l.x));
                    const float p1 = ex2(fmaf(elem_to_f32((unsigned short)(r[q] >> 16)), LOG2E, -l.y));
                    a[mt][q] = sm80_pack2(p0, p1);
                }
            }
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                u32 b[4];
                sm80_ldsm_x4_t(b, sd + (16u * kk + row_x) * 256u + (cx ^ ((col0 / 8u + 2u * np) << 4)));
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    sm80_mma(acc[mt][2 * np], a[mt], b[0], b[1]);
                    sm80_mma(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }
        // The next iteration's copies go to this slot.
        __syncthreads();
    }

    unsigned short* out = dv + (u64)dv_batch * p.g_sb;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = n0 + (int)key0 + 16 * mt + g + 8 * h;
            if (key >= d2) continue;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                const int col = c0 + (int)col0 + 8 * nt + 2 * t;
                if (col < d3) {
                    *reinterpret_cast<u32*>(out + (u64)key * p.g_ss + col) =
                        sm80_pack2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
                }
            }
        }
    }
#endif
}
