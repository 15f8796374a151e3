// Attention backward on Ampere and later (sm_80 … sm_90): FlashAttention-2's main backward
// kernel, `burn_flash_sm80_backward`, with warp-level `mma.sync.aligned.m16n8k16` (16-bit
// inputs, f32 accumulators), `ldmatrix` (`.trans` for the transposed operands) and `cp.async`
// (NOTES.md, "Issue 56's design"). The source NVRTC gets is ../../hopper/sm80.cuh, ../scores.cuh
// and this file, concatenated in that order after the host's defines: nothing is included here.
//
// It runs between the Hopper backward's per-row kernels (hopper_rows.cu) on the same stream:
// the prepass writes lse₂ (the base-2 log-sum-exp; +inf past Sq and for rows without a visible
// key, so that their weights are 0) and δ = rowsum(dO ⊙ O) per row, and zeroes the f32 dQ
// accumulator, here row-major (DQ_TILED 0, ACC_DIM = HEAD_DIM floats a row); rows are numbered
// (b·Hq + h)·rows_pad + i, rows_pad = Sq rounded up to 64, so a 64-row step never leaves its
// head's rows. The conversion afterwards writes dQ = scale · accumulator.
//
// One block of 256 threads (8 warps) per BLOCK_N keys of one (batch, key/value head): grid
// x = ⌈Sk / BLOCK_N⌉, y = Hkv, z = B. It loads K and V of its keys into shared memory once
// and keeps dK, dV in registers, and walks every query row that sees those keys — each query
// head h = head_kv·group + i of the group (i < group), 64 rows a step, the row blocks in order
// (causal: from the first that sees the block's first key) — so dK, dV are plain stores at
// the end and dQ is the only cross-block sum. Per step (rows m0 … m0 + 63 of head h):
//   S  = Q·Kᵀ, dP = dO·Vᵀ             64 × BLOCK_N: warps 2 along rows × 4 along keys
//   P  = 2^(S·scale·log₂e − lse₂)      registers (0 for hidden keys: causal, ≥ Sk)
//   dS = P ⊙ (dP − δ)                  registers; P, dS stored to shared memory (16-bit)
//   dV += Pᵀ·dO, dK += dSᵀ·Q           BLOCK_N × Dv, BLOCK_N × D: warps BLOCK_N/32 along the
//                                      keys × 8/(BLOCK_N/32) along the columns
//   dQ_acc += dS·K                     64 × D: warps 2 along rows × 4 along columns,
//                                      `red.global.add` of pairs (sm80.cuh, sm80_red_add2)
// At the end dK = scale · dK (the scores are scale·q·k) and dV in the element type, keys below
// Sk and columns below head_dim / value_dim only.
//
// The host prepends ELEM_BF16 (0 | 1), HEAD_DIM and VALUE_DIM (64 | 128: the head dims rounded
// up; the columns past p.head_dim / p.value_dim are read as zeros and never written), CAUSAL
// (0 | 1: key j is visible to query i when j ≤ i + Sk − Sq, bottom-right aligned as the Hopper
// backward), BLOCK_N (128 where ~160 KiB of shared memory can be opted into — sm_80, sm_90 —,
// 64 on sm_86 / sm_89 with 99 KiB, or 64 for two blocks a SM), STAGES (Q/dO slots: 2, the
// next step's copies under this step's products, or 1), PAIRED (0: one block a SM, up to 255
// registers a thread; 1: two blocks a SM, 128 registers, entry burn_flash_sm80_backward_paired —
// the `__launch_bounds__` minimum; the host's `sm80::Shape`) and PARAM_WORDS
// (sizeof(Sm80BwdParams) / 8), and the score rules of the forward (forward/hopper.cu, the Hopper
// backward's order): SOFTCAP, MASK, FILL, BIAS, ALIBI, WINDOW, VARLEN, DROPOUT (0 | 1) — scale,
// softcap, + bias and ALiBi, then a masked key hidden or given the fill score (a constant score:
// its weight reaches dV, its dS nothing); causal, a window and packed sequences hide keys and
// narrow the row blocks a key block visits; dropout regenerates the forward's mask (threefry of
// (key, row) under the seed and the (batch, query head)), keeps P ⊙ Z / (1 − p) for dV and
// dS = P ⊙ (dP ⊙ Z / (1 − p) − δ). The mask and bias are read per element through their
// broadcast strides, for rows below Sq and keys below Sk.
// WRITE_DS (0 | 1; never with SOFTCAP, whose dS tile holds dS ⊙ (1 − tanh²)): the dS tile the
// block stores for its products is exactly dS (element type, 0 for hidden and filled keys), so
// after the step's barrier it is copied out to `ds` [B, Hq, Sq, Sk] (a tracked bias's gradient)
// through ds's strides; the rows of the row blocks a key block does not visit get zeros first.
//
// Inputs: rows 16-byte aligned and the innermost (d) stride 1 (the host checks it and otherwise
// uses another kernel), so that a row's 8-element chunks are 16-byte `cp.async` copies; a
// last partial chunk (a head dim not a multiple of 8) is read with a short source size, the
// rest zero-filled.
//
// Shared memory (dynamic, SMEM_BYTES; every tile is rows of 16-bit elements, row r's 16-byte
// chunk c stored at chunk c ^ (r % 8) of the row — the XOR swizzle of 16-byte chunks within
// each 128 bytes, so that the 8 row addresses of every `ldmatrix` phase (8 consecutive rows,
// one logical chunk), every `cp.async` (a row's chunks) and every 32-bit store of P/dS (8 rows ×
// 4 words of one logical chunk) hit 32 distinct banks):
//   K      BLOCK_N × HEAD_DIM          at 0
//   V      BLOCK_N × VALUE_DIM         after K
//   P, dS  64 × BLOCK_N each           after V
//   per stage s < STAGES: Q 64 × HEAD_DIM, dO 64 × VALUE_DIM, lse₂ 64 f32, δ 64 f32
// SMEM_BYTES = 2·BLOCK_N·(HEAD_DIM + VALUE_DIM) + 2·2·64·BLOCK_N
//            + STAGES·(2·64·(HEAD_DIM + VALUE_DIM) + 2·4·64)
// e.g. D = Dv = 128: 164864 bytes (161 KiB) at BLOCK_N 128 / STAGES 2, 82432 (80.5 KiB) at
// BLOCK_N 64 / STAGES 1; D = Dv = 64: 99328 and 49664.

#if WRITE_DS && SOFTCAP
#error "burn_flash_sm80_backward: WRITE_DS under a softcap (the dS tile holds dS ⊙ (1 − tanh²))"
#endif
#if (HEAD_DIM != 64 && HEAD_DIM != 128) || (VALUE_DIM != 64 && VALUE_DIM != 128)
#error "burn_flash_sm80_backward: HEAD_DIM and VALUE_DIM are 64 or 128"
#endif
#if BLOCK_N != 64 && BLOCK_N != 128
#error "burn_flash_sm80_backward: BLOCK_N is 64 or 128"
#endif
#if STAGES != 1 && STAGES != 2
#error "burn_flash_sm80_backward: STAGES is 1 or 2"
#endif

#define SM80_BLOCK_M 64
#define SM80_THREADS 256

// Row bytes of the tiles.
#define SM80_QK_ROW (HEAD_DIM * 2)
#define SM80_VDO_ROW (VALUE_DIM * 2)
#define SM80_PS_ROW (BLOCK_N * 2)
// Tile bytes.
#define SM80_K_BYTES (BLOCK_N * SM80_QK_ROW)
#define SM80_V_BYTES (BLOCK_N * SM80_VDO_ROW)
#define SM80_PS_BYTES (SM80_BLOCK_M * SM80_PS_ROW)
#define SM80_Q_BYTES (SM80_BLOCK_M * SM80_QK_ROW)
#define SM80_DO_BYTES (SM80_BLOCK_M * SM80_VDO_ROW)
#define SM80_ROWS_BYTES (SM80_BLOCK_M * 4)
#define SM80_STAGE_BYTES (SM80_Q_BYTES + SM80_DO_BYTES + 2 * SM80_ROWS_BYTES)
// Offsets from the dynamic shared memory's start.
#define SM80_OFF_K 0u
#define SM80_OFF_V (SM80_OFF_K + SM80_K_BYTES)
#define SM80_OFF_P (SM80_OFF_V + SM80_V_BYTES)
#define SM80_OFF_DS (SM80_OFF_P + SM80_PS_BYTES)
#define SM80_OFF_STAGE(s) (SM80_OFF_DS + SM80_PS_BYTES + (s) * SM80_STAGE_BYTES)
#define SM80_OFF_Q(s) SM80_OFF_STAGE(s)
#define SM80_OFF_DO(s) (SM80_OFF_Q(s) + SM80_Q_BYTES)
#define SM80_OFF_LSE(s) (SM80_OFF_DO(s) + SM80_DO_BYTES)
#define SM80_OFF_DELTA(s) (SM80_OFF_LSE(s) + SM80_ROWS_BYTES)
// The dynamic shared memory the launch gives (the formula in the header comment).
#define SMEM_BYTES (SM80_OFF_STAGE(STAGES))

// Warp tiles (w = warp index 0 … 7):
// - S, dP: rows 32·(w / 4) …, keys P1_KEYS·(w % 4) …; 2 m-tiles × P1_NT n-tiles of 8 keys.
#define P1_KEYS (BLOCK_N / 4)
#define P1_NT (P1_KEYS / 8)
// - dV, dK: keys 32·(w % P2_KW) …, columns P2_VCOLS·(w / P2_KW) … (dV) and P2_KCOLS·(w / P2_KW)
//   … (dK); 2 m-tiles (16 keys each) × P2_VNT / P2_KNT n-tiles of 8 columns.
#define P2_KW (BLOCK_N / 32)
#define P2_CW (8 / P2_KW)
#define P2_VCOLS (VALUE_DIM / P2_CW)
#define P2_KCOLS (HEAD_DIM / P2_CW)
#define P2_VNT (P2_VCOLS / 8)
#define P2_KNT (P2_KCOLS / 8)
// - dQ: rows 32·(w / 4) …, columns P3_COLS·(w % 4) …; 2 m-tiles × P3_NT n-tiles.
#define P3_COLS (HEAD_DIM / 4)
#define P3_NT (P3_COLS / 8)

// The scalars, in the order of the host's words (PARAM_WORDS of them, 8 bytes each): strides
// in elements.
struct Sm80BwdParams {
    u64 q_stride_b, q_stride_h, q_stride_s, q_stride_d;
    u64 k_stride_b, k_stride_h, k_stride_s, k_stride_d;
    u64 v_stride_b, v_stride_h, v_stride_s, v_stride_d;
    u64 do_stride_b, do_stride_h, do_stride_s, do_stride_d;
    u64 dk_stride_b, dk_stride_h, dk_stride_s, dk_stride_d;
    u64 dv_stride_b, dv_stride_h, dv_stride_s, dv_stride_d;
    u32 seq_q, seq_k;
    u32 rows_pad, heads_q; // rows_pad: Sq rounded up to 64, the row count of lse₂, δ, dQ_acc
    u32 group, head_dim;   // group = Hq / Hkv
    u32 value_dim;
    float scale;           // dK = scale · dSᵀ·Q
    ScoreScalars s;        // s.scale_log2 = scale · log₂e; the rest as the rules say
    u64 mask_stride_b, mask_stride_h, mask_stride_s, mask_stride_k; // MASK (0 where broadcast)
    u64 bias_stride_b, bias_stride_h, bias_stride_s, bias_stride_k; // BIAS (0 where broadcast)
    u64 ds_stride_b, ds_stride_h, ds_stride_s, ds_stride_k;         // WRITE_DS
    u32 n_seqs, unused;                                             // VARLEN: packed sequences
};
static_assert(sizeof(Sm80BwdParams) == 8 * PARAM_WORDS, "the host's words (PARAM_WORDS)");

#if VARLEN
// The keys of query row `row` of a packed call (scores.cuh's packed_range under this call's
// causal mask and window).
__device__ __forceinline__ PackedRange sm80_row_keys(const u32* seqs, const Sm80BwdParams& p,
                                                     int row) {
    return packed_range(seqs, (int)p.n_seqs, row, CAUSAL, WINDOW, p.s.window_left,
                        p.s.window_right);
}

// The first query row (or Sq) whose key range ends after `key` (`by_end`), or starts after it
// (both ends grow with the row).
__device__ __forceinline__ int sm80_first_row_past(const u32* seqs, const Sm80BwdParams& p,
                                                   int key, bool by_end) {
    int lo = 0, hi = (int)p.seq_q;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        const PackedRange r = sm80_row_keys(seqs, p, mid);
        if ((by_end ? r.hi : r.lo) > key) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}
#endif

// Writes a key-major accumulator (2 m-tiles of 16 keys × NT n-tiles of 8 columns, the C
// layout), scaled by `factor`, to a [B, H, S, D] tensor's rows `key0` … (the warp's first key;
// keys below `seq_k`) and columns `col0` … (the warp's first; columns below `cols`).
template <int NT>
__device__ __forceinline__ void sm80_write_keys(unsigned short* dst, const float (&acc)[2][NT][4],
                                                float factor, int key0, int seq_k, int col0,
                                                int cols, u64 stride_s, u64 stride_d, u32 lane) {
    const int g = (int)(lane / 4u), t = (int)(lane % 4u);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = key0 + 16 * mt + g + 8 * h;
            if (key >= seq_k) continue;
            unsigned short* row = dst + (u64)key * stride_s;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int col = col0 + 8 * nt + 2 * t;
                const float a = acc[mt][nt][2 * h] * factor, b = acc[mt][nt][2 * h + 1] * factor;
                unsigned short* at = row + (u64)col * stride_d;
                if (col + 1 < cols && stride_d == 1u && (reinterpret_cast<u64>(at) & 3u) == 0u) {
                    *reinterpret_cast<u32*>(at) = sm80_pack2(a, b);
                } else {
                    if (col < cols) *at = f32_to_elem(a);
                    if (col + 1 < cols) row[(u64)(col + 1) * stride_d] = f32_to_elem(b);
                }
            }
        }
    }
}

// acc += A·Bᵀ for the first layout (S = Q·Kᵀ, dP = dO·Vᵀ): the warp's 32 rows (`row0`, of the
// row-major A tile at shared `sa`) by its P1_KEYS keys (`key0`, of the [key][DIM] B tile at `sb`),
// over DIM columns. A by pattern X, B by pattern Y, both plain (the lane address terms of the
// kernel: `row_x`, `row_y`, `cx`, `cy`); each B fragment feeds the 2 m-tiles, each A the
// P1_NT n-tiles.
template <int DIM>
__device__ __forceinline__ void sm80_rows_by_keys(float (&acc)[2][P1_NT][4], u32 sa, u32 sb,
                                                  u32 row0, u32 key0, u32 row_x, u32 row_y,
                                                  u32 cx, u32 cy) {
#pragma unroll
    for (int kk = 0; kk < DIM / 16; ++kk) {
        u32 a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            sm80_ldsm_x4(a[mt], sa + (row0 + 16u * mt + row_x) * (DIM * 2) + (cx ^ (32u * kk)));
        }
#pragma unroll
        for (int np = 0; np < P1_NT / 2; ++np) {
            u32 b[4];
            sm80_ldsm_x4(b, sb + (key0 + 16u * np + row_y) * (DIM * 2) + (cy ^ (32u * kk)));
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                sm80_mma(acc[mt][2 * np], a[mt], b[0], b[1]);
                sm80_mma(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// acc += Aᵀ·B for the second layout (dV += Pᵀ·dO, dK += dSᵀ·Q): the warp's 32 keys (`key0`,
// columns of the [row][key] tile at shared `sa`: P or dS) by its NT·8 columns (`col0`, of the
// [row][DIM] tile at `sb`: dO or Q), over the step's 64 rows. A by pattern Y transposed, B by
// pattern X transposed; each A fragment feeds the NT n-tiles.
template <int DIM, int NT>
__device__ __forceinline__ void sm80_keys_by_cols(float (&acc)[2][NT][4], u32 sa, u32 sb,
                                                  u32 key0, u32 col0, u32 row_x, u32 row_y,
                                                  u32 cx, u32 cy) {
#pragma unroll
    for (int kk = 0; kk < SM80_BLOCK_M / 16; ++kk) {
        u32 a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            sm80_ldsm_x4_t(a[mt], sa + (16u * kk + row_y) * SM80_PS_ROW
                                      + (cy ^ ((key0 / 8u + 2u * mt) << 4)));
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 b[4];
            sm80_ldsm_x4_t(b, sb + (16u * kk + row_x) * (DIM * 2)
                                  + (cx ^ ((col0 / 8u + 2u * np) << 4)));
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                sm80_mma(acc[mt][2 * np], a[mt], b[0], b[1]);
                sm80_mma(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// Two entry names, one per PAIRED, so that each variant's register budget is its own.
#if PAIRED
extern "C" __global__ void __launch_bounds__(SM80_THREADS, 2)
burn_flash_sm80_backward_paired(
#else
extern "C" __global__ void __launch_bounds__(SM80_THREADS, 1)
burn_flash_sm80_backward(
#endif
                         const unsigned short* __restrict__ q,
                         const unsigned short* __restrict__ k,
                         const unsigned short* __restrict__ v,
                         const unsigned short* __restrict__ d_o,
                         const float* __restrict__ lse2, const float* __restrict__ delta,
                         float* __restrict__ dq_acc, unsigned short* __restrict__ dk,
                         unsigned short* __restrict__ dv,
                         // MASK, BIAS, WRITE_DS, ALIBI (f32 per query head), VARLEN (the
                         // cumulative lengths): stand-ins, never touched, where absent.
                         const unsigned short* __restrict__ mask,
                         const unsigned short* __restrict__ bias,
                         unsigned short* __restrict__ ds, const float* __restrict__ slopes,
                         const u32* __restrict__ seqs,
                         const __grid_constant__ Sm80BwdParams p)
{
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = sm80_smem(smem_raw);
    const u32 sk = base + SM80_OFF_K, sv = base + SM80_OFF_V;
    const u32 sp = base + SM80_OFF_P, sds = base + SM80_OFF_DS;

    const u32 tid = threadIdx.x, warp = tid / 32u, lane = tid % 32u;
    const int g = (int)(lane / 4u), t = (int)(lane % 4u);
    // ldmatrix row addresses. Every 8-row group a lane addresses starts at a multiple of 8, so
    // the lane's row % 8 is lane % 8 and its swizzle XOR is `x7`. Two patterns:
    // - X: row + lane % 16, chunk + lane / 16 — matrices (rows 0–7, chunk 0), (rows 8–15,
    //   chunk 0), (rows 0–7, chunk 1), (rows 8–15, chunk 1): plain, the A fragment a0 … a3 of
    //   a row-major 16 × 16 tile; transposed, the B fragments (b0, b1) of two 8-column
    //   n-tiles of a 16 × 16 [k][n] tile (rows = k, chunks = n).
    // - Y: row + lane % 8 + 8·(lane / 16), chunk + (lane / 8) % 2 — matrices (rows 0–7,
    //   chunk 0), (rows 0–7, chunk 1), (rows 8–15, chunk 0), (rows 8–15, chunk 1): plain, the
    //   B fragments of two n-tiles from an [n][k] tile (rows = n, chunks = k); transposed, the
    //   A fragment of the transpose of a stored [k][m] tile (rows = k, chunks = m).
    const u32 x7 = lane % 8u;
    const u32 row_x = lane % 16u, chunk_x = lane / 16u;
    const u32 row_y = lane % 8u + 8u * (lane / 16u), chunk_y = (lane / 8u) % 2u;
    // The byte offset in its row of a lane's chunk `2c + chunk_x` (`chunk_y`) is cx ^ 32c
    // (cy ^ 32c): 2c is even, so (2c + chunk) ^ x7 = (chunk ^ x7) ^ 2c.
    const u32 cx = (chunk_x ^ x7) << 4, cy = (chunk_y ^ x7) << 4;

    const int n0 = (int)blockIdx.x * BLOCK_N;
    const u32 head_kv = blockIdx.y, batch = blockIdx.z;
    const int seq_q = (int)p.seq_q, seq_k = (int)p.seq_k;
    // Query i's diagonal key (bottom-right aligned: causal shows keys j <= i + diag, a window
    // i + diag − left ..= i + diag + right, ALiBi adds −slope·|i + diag − j|).
    const int diag = seq_k - seq_q;
    // The row blocks m_first … m_end − 1 with a row that sees one of the block's keys (both
    // ends grow with the key block): causal, from the first row block holding a row
    // i >= n0 − diag (the first that sees key n0); a window also ends at the last row whose
    // window starts at or before the block's last key; packed sequences, the rows whose key
    // ranges meet the block's.
    int m_first = 0, m_end = (seq_q + SM80_BLOCK_M - 1) / SM80_BLOCK_M;
#if CAUSAL
    m_first = max(0, n0 - diag) / SM80_BLOCK_M;
#endif
#if WINDOW
    m_first = max(m_first, max(0, n0 - diag - (int)p.s.window_right) / SM80_BLOCK_M);
    {
        const int last_row = min(n0 + BLOCK_N, seq_k) - 1 - diag + (int)p.s.window_left;
        m_end = last_row < 0 ? 0 : min(m_end, last_row / SM80_BLOCK_M + 1);
    }
#endif
#if VARLEN
    {
        const int last_key = min(n0 + BLOCK_N, seq_k) - 1;
        m_first = sm80_first_row_past(seqs, p, n0, true) / SM80_BLOCK_M;
        m_end = (sm80_first_row_past(seqs, p, last_key, false) + SM80_BLOCK_M - 1) / SM80_BLOCK_M;
    }
#endif
    const int per_head = max(0, m_end - m_first);
    const int steps = per_head * (int)p.group;

    const unsigned short* k_blk = k + (u64)batch * p.k_stride_b + (u64)head_kv * p.k_stride_h
                                  + (u64)n0 * p.k_stride_s;
    const unsigned short* v_blk = v + (u64)batch * p.v_stride_b + (u64)head_kv * p.v_stride_h
                                  + (u64)n0 * p.v_stride_s;

    // The copies of step `it` into stage `s`: Q, dO rows m0 … m0 + 63 of its head (zeros past
    // Sq), and those rows' lse₂ and δ (the prepass's rows are padded to 64: always in bounds).
    auto issue_step = [&](int it, u32 s) {
        const int m0 = (m_first + it % per_head) * SM80_BLOCK_M;
        const u32 head = head_kv * p.group + (u32)(it / per_head);
        const unsigned short* q_rows = q + (u64)batch * p.q_stride_b + (u64)head * p.q_stride_h
                                       + (u64)m0 * p.q_stride_s;
        const unsigned short* do_rows = d_o + (u64)batch * p.do_stride_b
                                        + (u64)head * p.do_stride_h + (u64)m0 * p.do_stride_s;
        sm80_load_tile<SM80_THREADS, SM80_BLOCK_M, HEAD_DIM>(base + SM80_OFF_Q(s), q_rows, p.q_stride_s,
                                               seq_q - m0, (int)p.head_dim, tid);
        sm80_load_tile<SM80_THREADS, SM80_BLOCK_M, VALUE_DIM>(base + SM80_OFF_DO(s), do_rows, p.do_stride_s,
                                                seq_q - m0, (int)p.value_dim, tid);
        if (tid < 32u) {
            const u64 row = ((u64)batch * p.heads_q + head) * p.rows_pad + (u64)m0;
            const float* src = (tid < 16u ? lse2 : delta) + row + 4u * (tid % 16u);
            sm80_cp_async(base + SM80_OFF_LSE(s) + 16u * tid, src, 16u);
        }
    };

    // dV and dK of the warp's keys and columns (the C layout: rows are keys).
    float dv_acc[2][P2_VNT][4], dk_acc[2][P2_KNT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int nt = 0; nt < P2_VNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dv_acc[mt][nt][e] = 0.0f;
        }
#pragma unroll
        for (int nt = 0; nt < P2_KNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dk_acc[mt][nt][e] = 0.0f;
        }
    }

#if WRITE_DS && (CAUSAL || WINDOW || VARLEN)
    // The rows outside the visited row blocks see none of the block's keys: dS = 0 there, for
    // each query head of the group (the visited rows' dS comes from the steps' tiles).
    {
        const int skipped = per_head > 0 ? min(m_first * SM80_BLOCK_M, seq_q) : seq_q;
        const int resumed = per_head > 0 ? min(m_end * SM80_BLOCK_M, seq_q) : seq_q;
        const int key = (int)(tid % (u32)BLOCK_N);
        if (key < seq_k - n0) {
            for (u32 h = 0; h < p.group; ++h) {
                unsigned short* dst = ds + (u64)batch * p.ds_stride_b
                                      + (u64)(head_kv * p.group + h) * p.ds_stride_h
                                      + (u64)(n0 + key) * p.ds_stride_k;
                for (int r = (int)(tid / (u32)BLOCK_N); r < seq_q; r += SM80_THREADS / BLOCK_N) {
                    if (r < skipped || r >= resumed) dst[(u64)r * p.ds_stride_s] = 0;
                }
            }
        }
    }
#endif

    if (steps > 0) {
        // K and V of the block's keys (zeros past Sk and past the head dims), with step 0's tiles
        // in the first group.
        sm80_load_tile<SM80_THREADS, BLOCK_N, HEAD_DIM>(sk, k_blk, p.k_stride_s, seq_k - n0, (int)p.head_dim, tid);
        sm80_load_tile<SM80_THREADS, BLOCK_N, VALUE_DIM>(sv, v_blk, p.v_stride_s, seq_k - n0, (int)p.value_dim,
                                           tid);
        issue_step(0, 0u);
    }
    sm80_cp_commit();

    // Warp tiles of the three layouts.
    const u32 w1_row = 32u * (warp / 4u), w1_key = P1_KEYS * (warp % 4u);
    const u32 w2_key = 32u * (warp % P2_KW), w2_c = warp / P2_KW;
    const u32 w3_row = 32u * (warp / 4u), w3_col = P3_COLS * (warp % 4u);

    for (int it = 0; it < steps; ++it) {
        const u32 s = STAGES == 2 ? (u32)it % 2u : 0u;
        const int m0 = (m_first + it % per_head) * SM80_BLOCK_M;
        const u32 head = head_kv * p.group + (u32)(it / per_head);
        const u32 sq = base + SM80_OFF_Q(s), sdo = base + SM80_OFF_DO(s);

        // This step's copies (issued one step ahead) are visible to the block; every warp is
        // done with the last step (its dQ read dS, its dK/dV read the other stage's Q/dO).
        sm80_cp_wait<0>();
        __syncthreads();
#if STAGES == 2
        // The next step's tiles into the other stage, under this step's products.
        if (it + 1 < steps) issue_step(it + 1, s ^ 1u);
        sm80_cp_commit();
#endif

        // ---- S, dP: the warp's 32 rows × P1_KEYS keys ------------------------------------------
        // acc[mt][nt][e]: row w1_row + 16·mt + g + 8·(e / 2), key w1_key + 8·nt + 2t + e % 2.
        float s_acc[2][P1_NT][4], dp_acc[2][P1_NT][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
            for (int nt = 0; nt < P1_NT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s_acc[mt][nt][e] = 0.0f;
                    dp_acc[mt][nt][e] = 0.0f;
                }
            }
        }
        // The warp's tile: its first row and key (absolute); whether some of its scores are
        // hidden (the causal diagonal crosses it, or keys past Sk), or all are (products skipped).
        // (Every tile with `none` is an `edge` one: its scores are all hidden below.)
        const int k0w = n0 + (int)w1_key, r0w = m0 + (int)w1_row;
        bool edge = k0w + P1_KEYS > seq_k;
        bool none = k0w >= seq_k;
#if CAUSAL
        edge = edge || k0w + P1_KEYS - 1 > r0w + diag;
        none = none || k0w > r0w + 31 + diag;
#endif
#if WINDOW
        edge = edge || k0w + P1_KEYS - 1 > r0w + diag + (int)p.s.window_right
               || k0w < r0w + 31 + diag - (int)p.s.window_left;
        none = none || k0w > r0w + 31 + diag + (int)p.s.window_right
               || k0w + P1_KEYS - 1 < r0w + diag - (int)p.s.window_left;
#endif
#if VARLEN
        // Some row of the tile does not see all of its keys: the last row's first key is after
        // the tile's first, or the first row's last before the tile's last (both ends grow with
        // the row); none sees any: the first row's range starts after the tile, or the last's
        // ends before it.
        {
            const PackedRange first = sm80_row_keys(seqs, p, min(r0w, seq_q - 1));
            const PackedRange last = sm80_row_keys(seqs, p, min(r0w + 31, seq_q - 1));
            edge = edge || k0w < last.lo || k0w + P1_KEYS > first.hi;
            none = none || k0w >= last.hi || k0w + P1_KEYS <= first.lo;
        }
#endif
        // The thread's rows (in the step's 64) are w1_row + 16·mt + g + 8·h, its keys (in the
        // block's) w1_key + 8·nt + 2t + e; the P/dS tiles' word of (mt, h, nt) at `ps_off`.
        const float* lse_s = reinterpret_cast<const float*>(smem_raw + SM80_OFF_LSE(s));
        const float* delta_s = reinterpret_cast<const float*>(smem_raw + SM80_OFF_DELTA(s));
#define PS_ROW_OF(mt, h) (w1_row + 16u * (mt) + (u32)g + 8u * (h))
#define PS_KEY_OF(nt) (w1_key + 8u * (nt) + 2u * (u32)t)
#define PS_OFF(mt, h, nt) \
    (sm80_swz(PS_ROW_OF(mt, h), PS_KEY_OF(nt) / 8u, SM80_PS_ROW) + 2u * (PS_KEY_OF(nt) % 8u))

        // ---- S = Q·Kᵀ --------------------------------------------------------------------------
        // A = Q (rows × d, row-major), B = Kᵀ (K stored [key][d]): `sm80_rows_by_keys`.
        if (!none) {
            sm80_rows_by_keys<HEAD_DIM>(s_acc, sq, sk, w1_row, w1_key, row_x, row_y, cx, cy);
        }

        // ---- P = 2^(score·log₂e − lse₂), stored as 16-bit; s_acc keeps what dS needs ---------
        // Done before dP's products so that lse₂ and the rules' terms are dead by then. The
        // stored weights are P (P ⊙ Z / (1 − p) under dropout: dV's operand); s_acc keeps P
        // (P ⊙ (1 − tanh²) under a softcap; 0 where a masked key took the fill score; its sign
        // set where dropout dropped the weight). (If a later rule runs out of registers: keep P
        // as its 16 packed pairs instead of 32 f32 — measured 16–18 fewer — at the cost of dS
        // using the rounded P.)
        {
            // Key `key` (in the block's) is below Sk when key < keys_left, and its distance
            // from row `row`'s (in the step's) diagonal key is key − row − diag_rel.
            const int keys_left = seq_k - n0;
            const int diag_rel = m0 + diag - n0;
#if ALIBI
            const float slope_log2 = -LOG2E * slopes[head];
#endif
#if DROPOUT
            // The dropout key's second word: the seed's high word mixed with (batch, query head).
            const u32 seed_key1 = p.s.seed_hi ^ ((batch * p.heads_q + head) * 0x9E3779B9u);
#endif
#if MASK
            const unsigned short* mask_h =
                mask + (u64)batch * p.mask_stride_b + (u64)head * p.mask_stride_h;
#endif
#if BIAS
            const unsigned short* bias_h =
                bias + (u64)batch * p.bias_stride_b + (u64)head * p.bias_stride_h;
#endif
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = (int)PS_ROW_OF(mt, h);
                    const int q_row = m0 + row;
                    const float l = lse_s[row];
#if VARLEN
                    const PackedRange keys = sm80_row_keys(seqs, p, min(q_row, seq_q - 1));
#endif
#pragma unroll
                    for (int nt = 0; nt < P1_NT; ++nt) {
                        const int key = (int)PS_KEY_OF(nt);
                        float weight[2];
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float sv = s_acc[mt][nt][2 * h + e];
#if SOFTCAP
                            const float th = tanhf(sv * p.s.cap_inv_scale);
#endif
                            // Whether the score depends on q·k (not a masked key's fill score).
                            bool live = true;
#if MASK || BIAS || ALIBI
#if SOFTCAP
                            float x = p.s.cap_log2 * th;
#else
                            float x = sv * p.s.scale_log2;
#endif
                            if (q_row < seq_q && key + e < keys_left) {
                                const u64 k_abs = (u64)(n0 + key + e);
#if BIAS
                                x += LOG2E * elem_to_f32(bias_h[(u64)q_row * p.bias_stride_s
                                                                + k_abs * p.bias_stride_k]);
#endif
#if ALIBI && VARLEN
                                x += slope_log2 * fabsf((float)(keys.diag - (int)k_abs));
#elif ALIBI
                                x += slope_log2 * fabsf((float)(row + diag_rel - key - e));
#endif
#if MASK
                                if (mask_h[(u64)q_row * p.mask_stride_s + k_abs * p.mask_stride_k]
                                    & 0x7fffu) {
                                    live = false;
                                    x = FILL ? p.s.fill_log2 : NEG_INF;
                                }
#endif
                            }
                            // +inf lse₂ (a row past Sq or without a visible key) gives 0.
                            float pv = ex2(x - l);
#elif SOFTCAP
                            float pv = ex2(fmaf(p.s.cap_log2, th, -l));
#else
                            float pv = ex2(fmaf(sv, p.s.scale_log2, -l));
#endif
                            if (edge) {
#if VARLEN
                                const bool hidden = n0 + key + e < keys.lo || n0 + key + e >= keys.hi;
#else
                                bool hidden = key + e >= keys_left;
#if CAUSAL
                                hidden = hidden || key + e > row + diag_rel;
#endif
#if WINDOW
                                hidden = hidden || key + e > row + diag_rel + (int)p.s.window_right
                                         || key + e < row + diag_rel - (int)p.s.window_left;
#endif
#endif
                                // (A select: a hidden score's 2^x may be +inf.)
                                if (hidden) pv = 0.0f;
                            }
#if SOFTCAP
                            float keep = live ? pv * (1.0f - th * th) : 0.0f;
#else
                            float keep = live ? pv : 0.0f;
#endif
#if DROPOUT
                            const u32 word = threefry((u32)(n0 + key + e), (u32)q_row, p.s.seed_lo,
                                                      seed_key1);
                            const bool kept = word >= p.s.threshold;
                            weight[e] = kept ? pv * p.s.inv_keep : 0.0f;
                            if (!kept) keep = -keep;
#else
                            weight[e] = pv;
#endif
                            s_acc[mt][nt][2 * h + e] = keep;
                        }
                        sm80_sts_u32(sp + PS_OFF(mt, h, nt), sm80_pack2(weight[0], weight[1]));
                    }
                }
            }
        }

        // ---- dP = dO·Vᵀ (the same patterns over Dv) -------------------------------------------
        if (!none) {
            sm80_rows_by_keys<VALUE_DIM>(dp_acc, sdo, sv, w1_row, w1_key, row_x, row_y, cx, cy);
        }

        // ---- dS = P ⊙ (dP − δ), stored as 16-bit -----------------------------------------------
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float d = delta_s[PS_ROW_OF(mt, h)];
#pragma unroll
                for (int nt = 0; nt < P1_NT; ++nt) {
                    float dsv[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float keep = s_acc[mt][nt][2 * h + e];
                        const float dp = dp_acc[mt][nt][2 * h + e];
#if DROPOUT
                        // A dropped weight's dP is 0: dS = P ⊙ (0 − δ).
                        const bool kept = !(__float_as_uint(keep) >> 31);
                        dsv[e] = fabsf(keep) * (kept ? dp * p.s.inv_keep - d : -d);
#else
                        dsv[e] = keep * (dp - d);
#endif
                    }
                    sm80_sts_u32(sds + PS_OFF(mt, h, nt), sm80_pack2(dsv[0], dsv[1]));
                }
            }
        }
#undef PS_ROW_OF
#undef PS_KEY_OF
#undef PS_OFF
        // P and dS of the step are in shared memory.
        __syncthreads();
#if WRITE_DS
        // dS of the step's rows below Sq and the block's keys below Sk, 16-byte chunks of the
        // tile (8 keys) through ds's strides: one 16-byte store where the keys are contiguous
        // and the chunk whole and aligned, single elements otherwise.
        {
            unsigned short* ds_rows = ds + (u64)batch * p.ds_stride_b + (u64)head * p.ds_stride_h
                                      + (u64)m0 * p.ds_stride_s + (u64)n0 * p.ds_stride_k;
            const int rows = seq_q - m0, keys = seq_k - n0;
            constexpr int CHUNKS = BLOCK_N / 8;
#pragma unroll
            for (int i = 0; i < SM80_BLOCK_M * CHUNKS / SM80_THREADS; ++i) {
                const int idx = (int)tid + SM80_THREADS * i;
                const int r = idx / CHUNKS, c = idx % CHUNKS;
                if (r >= rows || 8 * c >= keys) continue;
                const uint4 v = sm80_lds_v4(sds + sm80_swz((u32)r, (u32)c, SM80_PS_ROW));
                unsigned short* at = ds_rows + (u64)r * p.ds_stride_s + (u64)(8 * c) * p.ds_stride_k;
                if (8 * c + 8 <= keys && p.ds_stride_k == 1u && (reinterpret_cast<u64>(at) & 15u) == 0u) {
                    *reinterpret_cast<uint4*>(at) = v;
                } else {
                    const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        if (8 * c + j < keys) {
                            at[(u64)j * p.ds_stride_k] = (unsigned short)(words[j / 2] >> (16 * (j % 2)));
                        }
                    }
                }
            }
        }
#endif

        // ---- dV += Pᵀ·dO, dK += dSᵀ·Q: the warp's 32 keys × its columns, over the 64 rows ------
        // A = Pᵀ / dSᵀ (P stored [row][key]: pattern Y, transposed), B = dO / Q (stored
        // [row][col] = [k][n]: pattern X, transposed); each A fragment feeds the n-tiles.
        sm80_keys_by_cols<VALUE_DIM, P2_VNT>(dv_acc, sp, sdo, w2_key, w2_c * P2_VCOLS, row_x,
                                             row_y, cx, cy);
        sm80_keys_by_cols<HEAD_DIM, P2_KNT>(dk_acc, sds, sq, w2_key, w2_c * P2_KCOLS, row_x,
                                            row_y, cx, cy);

#if STAGES == 1
        // Every warp is done with this stage's Q and dO: the next step's copies go under dQ.
        __syncthreads();
        if (it + 1 < steps) issue_step(it + 1, 0u);
        sm80_cp_commit();
#endif

        // ---- dQ_acc += dS·K: the warp's 32 rows × P3_COLS columns, over the block's keys -------
        // A = dS (stored [row][key], row-major: pattern X, plain), B = K (stored [key][d] =
        // [k][n]: pattern X, transposed).
        {
            float dq[2][P3_NT][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
                for (int nt = 0; nt < P3_NT; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) dq[mt][nt][e] = 0.0f;
                }
            }
            // (Unrolled by 2 only: fully unrolled, ptxas hoisted the loads of every key step
            // and spilled at head dim 128 on sm_90a.)
#pragma unroll 2
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                u32 a[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    sm80_ldsm_x4(a[mt], sds + (w3_row + 16u * mt + row_x) * SM80_PS_ROW
                                             + (cx ^ (32u * kk)));
                }
#pragma unroll
                for (int np = 0; np < P3_NT / 2; ++np) {
                    u32 b[4];
                    sm80_ldsm_x4_t(b, sk + (16u * kk + row_x) * SM80_QK_ROW
                                          + (cx ^ ((w3_col / 8u + 2u * np) << 4)));
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        sm80_mma(dq[mt][2 * np], a[mt], b[0], b[1]);
                        sm80_mma(dq[mt][2 * np + 1], a[mt], b[2], b[3]);
                    }
                }
            }
            // Rows past Sq add nothing (their dS is 0): skipped.
            float* dq_rows = dq_acc + (((u64)batch * p.heads_q + head) * p.rows_pad + (u64)m0)
                                      * HEAD_DIM;
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = (int)w3_row + 16 * mt + g + 8 * h;
                    if (m0 + row >= seq_q) continue;
#pragma unroll
                    for (int nt = 0; nt < P3_NT; ++nt) {
                        const int col = (int)w3_col + 8 * nt + 2 * t;
                        sm80_red_add2(dq_rows + (u64)row * HEAD_DIM + col, dq[mt][nt][2 * h],
                                      dq[mt][nt][2 * h + 1]);
                    }
                }
            }
        }
    }

    // dK (scaled: the scores are scale·q·k) and dV of the warp's keys and columns; blocks (or
    // keys) no row sees write zeros.
    const int key0 = n0 + (int)w2_key;
    sm80_write_keys<P2_KNT>(dk + (u64)batch * p.dk_stride_b + (u64)head_kv * p.dk_stride_h,
                            dk_acc, p.scale, key0, seq_k, (int)(w2_c * P2_KCOLS),
                            (int)p.head_dim, p.dk_stride_s, p.dk_stride_d, lane);
    sm80_write_keys<P2_VNT>(dv + (u64)batch * p.dv_stride_b + (u64)head_kv * p.dv_stride_h,
                            dv_acc, 1.0f, key0, seq_k, (int)(w2_c * P2_VCOLS),
                            (int)p.value_dim, p.dv_stride_s, p.dv_stride_d, lane);
#endif
}
