// The per-row kernels around the Hopper backward (hopper.cu): the prepass before it and the dQ
// conversion after it. Plain CUDA, blocks of 256 threads (8 and 16 rows); rows are
// numbered (batch · Hq + head) · rows_pad + position, positions padded up to the backward's
// 64-row steps.
//
// The host prepends ELEM_BF16 (0 | 1), ACC_DIM (64 | 128 | 256: the accumulator's columns, the
// head dim rounded up), DQ_TILED (0 | 1: the layout below) and DETERMINISTIC (0 | 1: the
// prepass zeroes the backward's counter of each 64-row block, `dq_lock`).
//
// The accumulator is f32, ACC_DIM columns per row. DQ_TILED (the backward's DQ_BULK): each
// block of 64 rows is ACC_DIM / 64 tiles of 64 × 64 in the order the backward's consumers
// store them for one bulk reduce (hopper.cu, `store_dq`): element (r, c) of a tile is
// register 4j + k of consumer thread t, with j = c / 8, t = 32·(r / 16) + 4·(r % 8) +
// (c % 8) / 2 and k = 2·((r % 16) / 8) + c % 2 (the `wgmma` accumulator's layout), at float
// 4·(128j + t) + k (so a row's columns c, c + 1 and the same columns of the row 8 below are one
// aligned float4). Otherwise rows are row-major.

// The scalars, in the order of the host's words (hopper.rs, `rows_params`).
struct RowsParams {
    u64 out_stride_b, out_stride_h, out_stride_s, out_stride_d;
    u64 do_stride_b, do_stride_h, do_stride_s, do_stride_d;
    u64 lse_stride_b, lse_stride_h, lse_stride_s;
    u64 dq_stride_b, dq_stride_h, dq_stride_s, dq_stride_d;
    u64 rows; // batch · Hq · rows_pad
    u32 heads_q, seq_q;
    u32 rows_pad, head_dim;
    u32 value_dim;
    float scale; // dQ = scale · accumulator
};

// Per row: δ = Σ dO ⊙ O (f32), lse₂ = lse · log2(e) (+inf for a row without a visible key or
// past Sq: its weights are 0), and the row's ACC_DIM floats of the dQ accumulator zeroed (in
// either layout, the rows of a block zero the block); DETERMINISTIC: the first row of a 64-row
// block zeroes the block's counter. One warp per row, 8 rows per block. Where both rows are
// contiguous and 8-byte aligned and Dv is a multiple of 4, a lane loads 4 elements of each per
// instruction (a row of 128 in one warp load); otherwise one element (any strides).
extern "C" __global__ void __launch_bounds__(256, 8)
burn_flash_hopper_backward_rows(const unsigned short* __restrict__ out,
                                const unsigned short* __restrict__ d_out,
                                const float* __restrict__ lse, float* __restrict__ lse2,
                                float* __restrict__ delta, float* __restrict__ dq_acc,
                                u32* __restrict__ dq_lock,
                                const __grid_constant__ RowsParams p)
{
    const u64 r = (u64)blockIdx.x * 8u + threadIdx.x / 32u;
    const u32 lane = threadIdx.x % 32u;
    if (r >= p.rows) return;
    const u64 pair = r / p.rows_pad;
    const u32 s = (u32)(r % p.rows_pad);
    const u64 b = pair / p.heads_q, h = pair % p.heads_q;
    float sum = 0.0f;
    if (s < p.seq_q) {
        const unsigned short* o = out + b * p.out_stride_b + h * p.out_stride_h + s * p.out_stride_s;
        const unsigned short* g = d_out + b * p.do_stride_b + h * p.do_stride_h + s * p.do_stride_s;
        const bool wide = p.out_stride_d == 1u && p.do_stride_d == 1u && p.value_dim % 4u == 0u
            && ((reinterpret_cast<u64>(o) | reinterpret_cast<u64>(g)) & 7u) == 0u;
        if (wide) {
            const uint2* o4 = reinterpret_cast<const uint2*>(o);
            const uint2* g4 = reinterpret_cast<const uint2*>(g);
            for (u32 q = lane; q < p.value_dim / 4u; q += 32u) {
                const uint2 ov = __ldg(o4 + q), gv = __ldg(g4 + q);
                sum += elem_to_f32((unsigned short)(ov.x & 0xffffu)) * elem_to_f32((unsigned short)(gv.x & 0xffffu));
                sum += elem_to_f32((unsigned short)(ov.x >> 16)) * elem_to_f32((unsigned short)(gv.x >> 16));
                sum += elem_to_f32((unsigned short)(ov.y & 0xffffu)) * elem_to_f32((unsigned short)(gv.y & 0xffffu));
                sum += elem_to_f32((unsigned short)(ov.y >> 16)) * elem_to_f32((unsigned short)(gv.y >> 16));
            }
        } else {
#pragma unroll 1
            for (u32 col = lane; col < p.value_dim; col += 32u) {
                sum += elem_to_f32(o[col * p.out_stride_d]) * elem_to_f32(g[col * p.do_stride_d]);
            }
        }
    }
#pragma unroll
    for (u32 k = 16; k > 0; k /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, k);
    if (lane == 0) {
        float l2 = __int_as_float(0x7f800000);
        if (s < p.seq_q) {
            const float l = lse[b * p.lse_stride_b + h * p.lse_stride_h + s * p.lse_stride_s];
            if (l != NEG_INF) l2 = l * LOG2E;
        }
        delta[r] = sum;
        lse2[r] = l2;
#if DETERMINISTIC
        if (s % 64u == 0u) dq_lock[r / 64u] = 0u;
#endif
    }
    // ACC_DIM is a multiple of 64: 16-byte stores, a row of 128 floats in one warp store.
    float4* acc = reinterpret_cast<float4*>(dq_acc + r * ACC_DIM);
#pragma unroll
    for (u32 q = lane; q < ACC_DIM / 4u; q += 32u) acc[q] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// Columns `col`, `col + 1` of dQ row `dst` (a position below Sq) from two f32 values, scaled:
// one 4-byte store where the row is contiguous and the pair aligned, else one element each
// (the second only below D).
__device__ __forceinline__ void store_dq_pair(unsigned short* dst, u32 col, float a, float b,
                                              const RowsParams& p) {
    if (col >= p.head_dim) return;
    if (p.dq_stride_d == 1u && col + 1u < p.head_dim && (reinterpret_cast<u64>(dst + col) & 3u) == 0u) {
        *reinterpret_cast<u32*>(dst + col) = (u32)f32_to_elem(a) | ((u32)f32_to_elem(b) << 16);
    } else {
        dst[(u64)col * p.dq_stride_d] = f32_to_elem(a);
        if (col + 1u < p.head_dim) dst[(u64)(col + 1u) * p.dq_stride_d] = f32_to_elem(b);
    }
}

// dQ[b, h, s, :] = scale · accumulator row, in the element type, for positions below Sq. Block
// n takes the 16 rows 16n .. 16n + 16, warp w rows 16n + w and 16n + w + 8, a lane two
// adjacent columns of both: in the tiled layout those four floats are one aligned float4 (k =
// 0, 1 for the first row, 2, 3 for the second), and a warp reads 64 contiguous bytes per 8
// lanes; in the row-major layout a lane reads a float2 of each row. Rows come in 64-row
// blocks, so both rows are in the same (batch, head) pair and `rows` is a multiple of 16.
extern "C" __global__ void __launch_bounds__(256)
burn_flash_hopper_backward_dq(const float* __restrict__ dq_acc, unsigned short* __restrict__ dq,
                              const __grid_constant__ RowsParams p)
{
    const u32 w = threadIdx.x / 32u, lane = threadIdx.x % 32u;
    const u64 r0 = (u64)blockIdx.x * 16u + w;
    if (r0 >= p.rows) return;
    const u64 pair = r0 / p.rows_pad;
    const u32 s0 = (u32)(r0 % p.rows_pad), s1 = s0 + 8u;
    if (s0 >= p.seq_q) return;
    const u64 b = pair / p.heads_q, h = pair % p.heads_q;
    unsigned short* dst0 = dq + b * p.dq_stride_b + h * p.dq_stride_h + (u64)s0 * p.dq_stride_s;
    unsigned short* dst1 = dq + b * p.dq_stride_b + h * p.dq_stride_h + (u64)s1 * p.dq_stride_s;
    const bool second = s1 < p.seq_q;
    const float scale = p.scale;
#if DQ_TILED
    // Row r0 % 64 = 16·m + w (w < 8): thread t = 32·m + 4·w + lane % 4 of the tile's layout,
    // columns 8·(lane / 4) + 2·(lane % 4) and the next.
    const u32 m = (u32)(r0 % 64u) / 16u;
    const u32 j = lane / 4u, t = 32u * m + 4u * w + lane % 4u;
    const float* block = dq_acc + (r0 - r0 % 64u) * ACC_DIM;
#pragma unroll
    for (u32 a = 0; a < ACC_DIM / 64u; ++a) {
        const u32 col = 64u * a + 8u * j + 2u * (lane % 4u);
        const float4 v = __ldg(reinterpret_cast<const float4*>(block + 4096u * a + 4u * (128u * j + t)));
        store_dq_pair(dst0, col, v.x * scale, v.y * scale, p);
        if (second) store_dq_pair(dst1, col, v.z * scale, v.w * scale, p);
    }
#else
#pragma unroll
    for (u32 col = 2u * lane; col < ACC_DIM; col += 64u) {
        const float2 v0 = __ldg(reinterpret_cast<const float2*>(dq_acc + r0 * ACC_DIM + col));
        store_dq_pair(dst0, col, v0.x * scale, v0.y * scale, p);
        if (second) {
            const float2 v1 = __ldg(reinterpret_cast<const float2*>(dq_acc + (r0 + 8u) * ACC_DIM + col));
            store_dq_pair(dst1, col, v1.x * scale, v1.y * scale, p);
        }
    }
#endif
}
