// The per-row kernels around the Hopper backward (hopper.cu): the prepass before it and the dQ
// conversion after it. Plain CUDA, one warp per row, 8 rows per block of 256 threads; rows are
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
// 4·(128j + t) + k. Otherwise rows are row-major.

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

// Where column `col` of accumulator row `row` (rows counted as above) lies.
__device__ __forceinline__ u64 dq_offset(u64 row, u32 col) {
#if DQ_TILED
    const u32 r = (u32)(row % 64u), a = col / 64u, c = col % 64u;
    const u32 t = 32u * (r / 16u) + 4u * (r % 8u) + (c % 8u) / 2u;
    const u32 k = 2u * ((r % 16u) / 8u) + c % 2u;
    return (row - r) * ACC_DIM + 4096u * a + 4u * (128u * (c / 8u) + t) + k;
#else
    return row * ACC_DIM + col;
#endif
}

// Per row: δ = Σ dO ⊙ O (f32), lse₂ = lse · log2(e) (+inf for a row without a visible key or
// past Sq: its weights are 0), and the row's ACC_DIM floats of the dQ accumulator zeroed (in
// either layout, the rows of a block zero the block); DETERMINISTIC: the first row of a 64-row
// block zeroes the block's counter.
extern "C" __global__ void __launch_bounds__(256)
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
        for (u32 col = lane; col < p.value_dim; col += 32u) {
            sum += elem_to_f32(o[col * p.out_stride_d]) * elem_to_f32(g[col * p.do_stride_d]);
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
    float2* acc = reinterpret_cast<float2*>(dq_acc + r * ACC_DIM);
#pragma unroll
    for (u32 col = lane; col < ACC_DIM / 2; col += 32u) acc[col] = make_float2(0.0f, 0.0f);
}

// dQ[b, h, s, :] = scale · accumulator row, in the element type, for positions below Sq.
extern "C" __global__ void __launch_bounds__(256)
burn_flash_hopper_backward_dq(const float* __restrict__ dq_acc, unsigned short* __restrict__ dq,
                              const __grid_constant__ RowsParams p)
{
    const u64 r = (u64)blockIdx.x * 8u + threadIdx.x / 32u;
    const u32 lane = threadIdx.x % 32u;
    if (r >= p.rows) return;
    const u64 pair = r / p.rows_pad;
    const u32 s = (u32)(r % p.rows_pad);
    if (s >= p.seq_q) return;
    const u64 b = pair / p.heads_q, h = pair % p.heads_q;
    unsigned short* dst = dq + b * p.dq_stride_b + h * p.dq_stride_h + s * p.dq_stride_s;
    for (u32 col = lane; col < p.head_dim; col += 32u) {
        dst[col * p.dq_stride_d] = f32_to_elem(dq_acc[dq_offset(r, col)] * p.scale);
    }
}
