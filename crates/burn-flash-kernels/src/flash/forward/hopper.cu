// Attention forward on Hopper (sm_90a): FlashAttention-3's schedule, written as CUDA C++ with
// inline PTX (../../hopper/sm90.cuh) and launched through cubecl's client (hopper.rs).
//
// A tile is BLOCK_M query rows of one (batch, query head), 64 per consumer warpgroup (128: two
// consumers, 384 threads; 192 at head dims of 64: three, 512 threads). The grid is 1-D and its
// blocks take the tiles in rounds (`round_tile`, `tile_place`): one round where the host launches
// a block per tile, several where it launches one block per SM (persistent), so that a tile's
// epilogue runs while the producer already loads the next tile's Q, K and V; the pipeline's
// barriers, slots and product turns run on from tile to tile. With DYNAMIC (persistent causal
// calls) a block's tiles after its first come from a counter as it finishes them, so that the
// blocks end together whatever the tiles' lengths. Per tile:
// - warpgroup 0 is the producer: it gives its registers back (setmaxnreg) and one thread issues
//   TMA loads: Q once, then K and V blocks of 128 keys into a ring of STAGES slots, each slot
//   guarded by a "full" barrier (TMA transactions) and an "empty" barrier (the consumers);
// - warpgroups 1 … CONSUMERS are the consumers, 64 rows each: S = Q·Kᵀ on `wgmma` with both operands
//   in shared memory, the online softmax in registers, then O += P·V on `wgmma` with P taken
//   from the registers that held S (the accumulator layout of a 64 × 16 slice is the A-operand
//   layout of the next product) and V read N-major from shared memory;
// - overlap, as FlashAttention-3: each consumer issues S for block j before O += P·V of block
//   j − 1 and computes block j's softmax while that product runs (intra-warpgroup), and the
//   consumers take turns issuing their products (PINGPONG, named barrier 1 + c is consumer c's
//   turn), so that one warpgroup's softmax runs while another's products hold the tensor cores.
//   At D 64 the products are short against the softmax: a third consumer keeps the tensor
//   cores fed (FlashAttention-3's 192-row tile); its registers (160 per thread) hold S, P and
//   O of 64 columns.
// Tiles are stored as the TMA writes them with 128-byte swizzling: 64-column atoms of 128 rows ×
// 128 bytes, so D = 128 is two atoms, D = 256 four, and D ≤ 64 one.
//
// The host prepends: WG_ELEM ("f16" | "bf16") and ELEM_BF16, BLOCK_M (128 | 192, query rows per
// block; 128 with given scores), BLOCK_N (keys per step: 128, or 64
// where a head dim is 256: O's 128 accumulator registers per thread leave room for 64 columns
// of scores, and 2 slots of K and V fit beside Q), HEAD_DIM and VALUE_DIM (64 | 128 | 256, the
// head dims rounded up; the columns past the real ones are read as zeros and never written; with given scores
// HEAD_DIM is BLOCK_N, the columns of X per step, and VALUE_DIM may be 256), and the score rules CAUSAL, SOFTCAP, MASK, FILL (masked keys take a fill score),
// BIAS, ALIBI (−slope·|i + Sk − Sq − j| from the head's slope), VARLEN (packed sequences:
// each row sees its own sequence's keys, the rules aligned within it, scores.cuh's
// packed_range; key blocks outside every row's range skipped), WINDOW (keys outside
// i + Sk − Sq − left ..= i + Sk − Sq + right hidden, key blocks outside every row's window
// skipped), QUIET (0 | 1), applied in the order of the #[cube] kernels (scores.rs): scale,
// softcap, bias and ALiBi, then a masked key hidden or given the fill score, then causal, the
// window and keys past the end hidden; DROPOUT multiplies each weight by 0 or 1/(1 − p) after the row sums took it, with
// the keep decisions of dropout.rs (Threefry-2×32-20 keyed by the seed and (batch, head),
// counter (key, query position)).
// BIAS_TILES (with BIAS): the producer loads the bias of each step's BLOCK_M rows × BLOCK_N keys
// by TMA into the step's slot beside K (64-key atoms, 128-byte swizzled, rows past Sq and keys
// past Sk read as zeros), and the consumers read it from shared memory in the accumulator
// layout (a 16-byte chunk per 8 keys, 8 rows of a warp's load in 8 different chunks: no bank
// conflicts); the K slot is released after the softmax has read the bias. Without it the bias
// is read from global memory per element (biases whose rows TMA cannot load).
// BIAS_ROW (with BIAS_TILES): the bias is broadcast along the rows (`[·, ·, 1, Sk]`): each step
// loads one 128-byte row per 64-key atom (its map's box is one row high), which every row of
// the block reads at tile row 0 (unswizzled: row 0 of an atom).
//
// GIVEN (1) is softmax(X)·V, the given-score case: X `[batch, d1, d2]` takes the place of the
// scores, so there is no Q and no Q·Kᵀ. The slots that hold K hold a 128-row × BLOCK_N-column
// tile of X instead (HEAD_DIM = BLOCK_N), which each consumer reads into the accumulator layout
// of S with `ldmatrix` (load_scores) while its previous P·V runs; V `[batch or 1, d2, d3]` is
// read VALUE_DIM columns at a time: block (t, m, b) computes rows 128m … 128m + 127 and columns
// VALUE_DIM·t … of the output of batch b, and only t = 0 writes the log-sum-exp. Each column
// tile computes the weights again, one `exp` per score for 2·VALUE_DIM products: VALUE_DIM 256
// (64 keys per step, so that O's 128 registers fit) halves that work against 128. The score
// rules are all off and the scale is 1.

#define PINGPONG 1
#define CONSUMERS (BLOCK_M / 64)
#define STAGES 2
#define D_ATOMS (HEAD_DIM / 64)
#define V_ATOMS (VALUE_DIM / 64)
#define ATOM_BYTES (BLOCK_M * 128)
#define KV_ATOM (BLOCK_N * 128)
#if GIVEN
#define Q_BYTES 0
#define K_BYTES (D_ATOMS * ATOM_BYTES)
#else
#define Q_BYTES (D_ATOMS * ATOM_BYTES)
#define K_BYTES (D_ATOMS * KV_ATOM)
#endif
#define V_BYTES (V_ATOMS * KV_ATOM)
// The host sets BIAS_TILES only with BIAS and without GIVEN; the kernel's parameters follow it
// alone (a bias map and its buffer), so that `cargo xtask cuda-check` can count them.
#if BIAS_TILES
#define B_BYTES ((BLOCK_N / 64) * ATOM_BYTES)
#else
#define B_BYTES 0
#endif
// The bytes a step's bias load brings (the slot holds B_BYTES).
#if BIAS_ROW
#define B_TX ((BLOCK_N / 64) * 128)
#else
#define B_TX B_BYTES
#endif
#define S_REGS (BLOCK_N / 2)
#define O_REGS (VALUE_DIM / 2)
// DYNAMIC: the blocks take their tiles after the first from a counter (`tile_counter`), handed
// to the consumers with each round's Q; given scores have no Q and keep the static rounds.
#if DYNAMIC && GIVEN
#error "DYNAMIC tiles come with Q: not with given scores"
#endif


// The scalars, in the order of the host's words (hopper.rs, `params`).
struct FwdParams {
    u64 out_stride_b, out_stride_h, out_stride_s;
    u64 lse_stride_b, lse_stride_h, lse_stride_s;
    u32 seq_q, seq_k;
    u32 group, value_dim;
    ScoreScalars s;
    u64 mask_stride_b, mask_stride_h, mask_stride_s, mask_stride_k;
    u64 bias_stride_b, bias_stride_h, bias_stride_s, bias_stride_k;
    u32 x_batch, v_batch;            // GIVEN: 1, or 0 where X or V has one batch for all
    u32 n_seqs;                      // VARLEN: packed sequences
    u32 bias_planes;                 // BIAS_TILES: bit 0 the bias has batches, bit 1 heads
    u32 tiles_x, tiles_y;            // the tiles (see `fwd_tile`): row blocks × heads × batches,
    u32 tiles_z;                     // or column tiles × row blocks × batches (GIVEN)
    u32 chunk;                       // CAUSAL: (batch, head) planes per chunk (`tile_place`)
};
static_assert(sizeof(FwdParams) == 8 * PARAM_WORDS, "the host's words (hopper.rs, PARAM_WORDS)");

// Consumer `c` waits for its turn to issue products, and passes the turn on once issued.
__device__ __forceinline__ void turn_begin(u32 c) {
#if PINGPONG
    named_sync(1 + c, 256);
#endif
}

__device__ __forceinline__ void turn_end(u32 c) {
#if PINGPONG
    named_arrive(1 + (c + 1) % CONSUMERS, 256);
#endif
}

#if !GIVEN
// S = Q·Kᵀ for consumer `c`'s 64 rows and the slot's BLOCK_N keys: HEAD_DIM / 16 steps of k16,
// each 32 bytes further into a 128-byte swizzled row (a new atom every 64 columns).
__device__ __forceinline__ void issue_qk(float (&sc)[S_REGS], u32 sq, u32 sk, u32 c) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const u32 atom = kk / 4, within = (kk % 4) * 32;
        const u64 da = desc_sw128(sq + atom * ATOM_BYTES + c * 64u * 128u + within, 16, 1024);
        const u64 db = desc_sw128(sk + atom * KV_ATOM + within, 16, 1024);
#if BLOCK_N == 128
        wgmma_ss_n128(sc, da, db, kk > 0 ? 1u : 0u);
#else
        wgmma_ss_n64(sc, da, db, kk > 0 ? 1u : 0u);
#endif
    }
}
#endif

// O += P·V: BLOCK_N / 16 steps of 16 keys (2048 bytes of the slot each), V read N-major with
// 64-column atoms KV_ATOM apart. VALUE_DIM 256 is two products of 128 columns per step (atoms
// 0–1 into O's registers 0–63, atoms 2–3 into 64–127: the accumulator layout of 256 columns)
// sharing the A fragment.
__device__ __forceinline__ void issue_pv(float (&o)[O_REGS], const u32 (&pa)[BLOCK_N / 16][4],
                                         u32 sv) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        const u64 db = desc_sw128(sv + kk * 16u * 128u, KV_ATOM, 1024);
#if VALUE_DIM == 256
        float(&lo)[64] = *reinterpret_cast<float(*)[64]>(&o[0]);
        float(&hi)[64] = *reinterpret_cast<float(*)[64]>(&o[64]);
        wgmma_rs_n128_tb(lo, pa[kk], db, 1u);
        wgmma_rs_n128_tb(hi, pa[kk], desc_sw128(sv + 2u * KV_ATOM + kk * 16u * 128u, KV_ATOM, 1024),
                         1u);
#elif VALUE_DIM == 128
        wgmma_rs_n128_tb(o, pa[kk], db, 1u);
#else
        wgmma_rs_n64_tb(o, pa[kk], db, 1u);
#endif
    }
}

#if GIVEN
// The given scores of consumer `c`'s 64 rows of the X tile at `sx` (128 rows × 128 columns as
// the TMA wrote them: two atoms, 128-byte swizzled) in the accumulator layout of S: per 16
// columns one `ldmatrix` of four 8 × 8 matrices (rows 0–7 and 8–15 of the warp's 16, columns
// 0–7 and 8–15), which are registers 8kk … 8kk + 7 of S in that order. The 8 rows a phase
// reads lie in 8 different 16-byte columns of the swizzle: no bank conflicts.
__device__ __forceinline__ void load_scores(float (&sc)[S_REGS], u32 sx, u32 c, u32 warp,
                                            u32 lane) {
    const u32 quad = lane / 8u;
    const u32 row = c * 64u + warp * 16u + (quad % 2u) * 8u + lane % 8u;
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        const u32 col = 16u * kk + (quad / 2u) * 8u;
        const u32 chunk = (col % 64u) / 8u;
        u32 r[4];
        ldmatrix_x4(r, sx + (col / 64u) * ATOM_BYTES + row * 128u + ((chunk ^ (row % 8u)) << 4));
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            sc[8 * kk + 2 * m] = elem_to_f32((unsigned short)(r[m] & 0xffffu));
            sc[8 * kk + 2 * m + 1] = elem_to_f32((unsigned short)(r[m] >> 16));
        }
    }
}
#endif

// What the score rules of a thread's two rows need: positions, scalars, and the mask and bias
// of its (batch, head), whose dimensions of size 1 have stride 0.
struct ScoreRows {
    int first_row, row0, diag, seq_q, seq_k;
    int left, right;   // WINDOW
    int lo[2], hi[2];      // VARLEN: each row's keys
    int full_lo, full_hi;  // VARLEN: the keys all the consumer's rows see
    int dk[2];             // each row's diagonal key (ALIBI)
    u32 tile_row;          // BIAS_TILES: the thread's first row within the block
    float slope_log2;  // ALIBI: −slope · log2(e)
    u32 lane;
    ScoreScalars s;    // the call's, the dropout seed's high word mixed with the (batch, head)
    const unsigned short* mask;
    const unsigned short* bias;
    u64 mask_stride_s, mask_stride_k, bias_stride_s, bias_stride_k;
};

// Weight `w` of register i of block key0 after dropout: 0, or w / (1 − p) where kept.
__device__ __forceinline__ float dropped(float w, const ScoreRows& rows, int key0, int i) {
#if DROPOUT
    const int key = key0 + 8 * (i / 4) + 2 * (int)(rows.lane % 4u) + (i % 2);
    const int row = rows.row0 + 8 * ((i / 2) % 2);
    const u32 word = threefry((u32)key, (u32)row, rows.s.seed_lo, rows.s.seed_hi);
    return word >= rows.s.threshold ? w * rows.s.inv_keep : 0.0f;
#else
    return w;
#endif
}

// Whether some row of the consumer's 64 does not see every key of the block at key0 (keys past
// the end, the causal mask, the window, packed sequences): its scores are then tested one by
// one (`hidden`).
__device__ __forceinline__ bool edge_block(const ScoreRows& rows, int key0) {
#if VARLEN
    return key0 < rows.full_lo || key0 + BLOCK_N > rows.full_hi;
#else
    bool edge = key0 + BLOCK_N > rows.seq_k;
#if CAUSAL
    edge = edge || key0 + BLOCK_N - 1 > rows.first_row + rows.diag;
#endif
#if WINDOW
    // Some row's window ends before the block's last key or starts after its first.
    edge = edge || key0 + BLOCK_N - 1 > rows.first_row + rows.diag + rows.right
           || key0 < rows.first_row + 63 + rows.diag - rows.left;
#endif
    return edge;
#endif
}

// Whether the thread's row r (row0 + 8r) does not see key `key`.
__device__ __forceinline__ bool hidden_key(const ScoreRows& rows, int key, int r) {
#if VARLEN
    return key < rows.lo[r] || key >= rows.hi[r];
#else
    bool hidden = key >= rows.seq_k;
    const int row = rows.row0 + 8 * r;
#if CAUSAL
    hidden = hidden || key > row + rows.diag;
#endif
#if WINDOW
    hidden = hidden || key > row + rows.diag + rows.right || key < row + rows.diag - rows.left;
#endif
    return hidden;
#endif
}

// Block j's scores into weights: the log2-domain scores (scale, softcap, keys past the end and
// the causal mask at -inf), the new row maxima (4 lanes share a row), the factor `corr` that
// rescales what came before (applied here to the row sums, by the caller to O), the weights.
__device__ __forceinline__ void online_softmax(float (&sc)[S_REGS], float (&m_r)[2],
                                               float (&l_r)[2], float (&corr)[2],
                                               const ScoreRows& rows, int j, u32 sb) {
    const int key0 = j * BLOCK_N;
    const bool edge = edge_block(rows, key0);
#if !SOFTCAP && !MASK && !BIAS && !ALIBI
    if (rows.s.scale_log2 > 0.0f) {
        // A positive scale keeps the order of the scores: the maximum is taken on the raw
        // products and the scale folded into the exponent's FMA.
        if (edge) {
#pragma unroll
            for (int i = 0; i < S_REGS; ++i) {
                const int key = key0 + 8 * (i / 4) + 2 * (int)(rows.lane % 4u) + (i % 2);
                if (hidden_key(rows, key, (i / 2) % 2)) sc[i] = NEG_INF;
            }
        }
        float raw[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) raw[(i / 2) % 2] = fmaxf(raw[(i / 2) % 2], sc[i]);
        float shift[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            raw[r] = fmaxf(raw[r], __shfl_xor_sync(0xffffffffu, raw[r], 1));
            raw[r] = fmaxf(raw[r], __shfl_xor_sync(0xffffffffu, raw[r], 2));
            const float mx = fmaxf(m_r[r], raw[r] * rows.s.scale_log2);
            shift[r] = mx == NEG_INF ? 0.0f : mx;
            corr[r] = ex2(m_r[r] - shift[r]);
            m_r[r] = mx;
            l_r[r] *= corr[r];
        }
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) {
            const float w = ex2(fmaf(sc[i], rows.s.scale_log2, -shift[(i / 2) % 2]));
            l_r[(i / 2) % 2] += w;
            sc[i] = dropped(w, rows, key0, i);
        }
        return;
    }
#endif
#if ALIBI
    // Each of the thread's rows' distance to its first key of the block, as f32: register i's
    // key is a constant 8·(i / 4) + i % 2 further, so its |distance| is one FADD (and an FFMA
    // with the slope) per score.
    float dist0[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        dist0[r] = (float)(rows.dk[r] - key0 - 2 * (int)(rows.lane % 4u));
    }
#endif
#pragma unroll
    for (int i = 0; i < S_REGS; ++i) {
#if SOFTCAP
        float x = rows.s.cap_log2 * tanhf(sc[i] * rows.s.cap_inv_scale);
#else
        float x = sc[i] * rows.s.scale_log2;
#endif
#if ALIBI
        x = fmaf(rows.slope_log2, fabsf(dist0[(i / 2) % 2] - (float)(8 * (i / 4) + (i % 2))), x);
#endif
#if B_BYTES
        {
            // Registers i and i + 1 are two adjacent keys of one row: one 32-bit word.
#if BIAS_ROW
            const u32 row = 0u;
#else
            const u32 row = rows.tile_row + 8u * (u32)((i / 2) % 2);
#endif
            const u32 chunk = (u32)(i / 4) % 8u;
            const u32 word = lds_u32(sb + (u32)(i / 32) * ATOM_BYTES + row * 128u
                                     + ((chunk ^ (row % 8u)) << 4) + 4u * (rows.lane % 4u));
            x += LOG2E * elem_to_f32((unsigned short)(i % 2 ? word >> 16 : word & 0xffffu));
        }
#endif
#if MASK || (BIAS && !B_BYTES)
        {
            const int key = key0 + 8 * (i / 4) + 2 * (int)(rows.lane % 4u) + (i % 2);
            const int row = rows.row0 + 8 * ((i / 2) % 2);
            if (row < rows.seq_q && key < rows.seq_k) {
#if BIAS && !B_BYTES
                x += LOG2E * elem_to_f32(rows.bias[(u64)row * rows.bias_stride_s
                                                   + (u64)key * rows.bias_stride_k]);
#endif
#if MASK
                const unsigned short m =
                    rows.mask[(u64)row * rows.mask_stride_s + (u64)key * rows.mask_stride_k];
                if (m & 0x7fffu) x = FILL ? rows.s.fill_log2 : NEG_INF;
#endif
            }
        }
#endif
        if (edge) {
            const int key = key0 + 8 * (i / 4) + 2 * (int)(rows.lane % 4u) + (i % 2);
            if (hidden_key(rows, key, (i / 2) % 2)) x = NEG_INF;
        }
        sc[i] = x;
    }
    float mx[2] = {m_r[0], m_r[1]};
#pragma unroll
    for (int i = 0; i < S_REGS; ++i) mx[(i / 2) % 2] = fmaxf(mx[(i / 2) % 2], sc[i]);
    float shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        // A row without a visible key so far keeps m = -inf and weights 0.
        shift[r] = mx[r] == NEG_INF ? 0.0f : mx[r];
        corr[r] = ex2(m_r[r] - shift[r]);
        m_r[r] = mx[r];
        l_r[r] *= corr[r];
    }
#pragma unroll
    for (int i = 0; i < S_REGS; ++i) {
        const float w = ex2(sc[i] - shift[(i / 2) % 2]);
        l_r[(i / 2) % 2] += w;
        sc[i] = dropped(w, rows, key0, i);
    }
}

__device__ __forceinline__ void rescale(float (&o)[O_REGS], const float (&corr)[2]) {
#pragma unroll
    for (int i = 0; i < O_REGS / 4; ++i) {
        o[4 * i] *= corr[0];
        o[4 * i + 1] *= corr[0];
        o[4 * i + 2] *= corr[1];
        o[4 * i + 3] *= corr[1];
    }
}

// The weights as the A operand of P·V: the accumulator registers of 16 keys, in pairs.
__device__ __forceinline__ void pack_weights(u32 (&pa)[BLOCK_N / 16][4], const float (&sc)[S_REGS]) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        pa[kk][0] = pack2(sc[8 * kk + 0], sc[8 * kk + 1]);
        pa[kk][1] = pack2(sc[8 * kk + 2], sc[8 * kk + 3]);
        pa[kk][2] = pack2(sc[8 * kk + 4], sc[8 * kk + 5]);
        pa[kk][3] = pack2(sc[8 * kk + 6], sc[8 * kk + 7]);
    }
}

// One tile of the launch: a block of BLOCK_M query rows of one (batch, head) — or with GIVEN, a
// block of rows and VALUE_DIM output columns of one batch — and its key blocks j0 … j0 + steps − 1.
struct FwdTile {
    u32 head, batch, head_kv, col0;
    int m0, j0, steps;
};

// Where tile `t` of the tiles_x × tiles_y × tiles_z the host counts: (row block, head, batch), row
// blocks fastest (the blocks running at once share their heads' keys and values through L2), or
// with CAUSAL the row blocks longest (last) first within chunks of heads, so that blocks taken in
// order (by the hardware, or by a persistent block's rounds) run the longest rows first; with GIVEN (column tile, row block, batch), the column tiles of one row block
// adjacent (they read the same X through L2).
struct TilePlace {
    u32 m_block, head, batch, col0;
};

__device__ __forceinline__ TilePlace tile_place(u32 t, const FwdParams& p) {
    TilePlace at;
#if GIVEN
    at.m_block = (t / p.tiles_x) % p.tiles_y;
    at.head = 0u;
    at.batch = t / (p.tiles_x * p.tiles_y);
    at.col0 = (t % p.tiles_x) * VALUE_DIM;
#elif CAUSAL
    // Chunks of `chunk` (batch, head) planes, chunk after chunk; in a chunk the row blocks
    // outermost, longest first. The blocks running at once then read the keys and values of
    // about one chunk's planes, which the host sizes to fit in L2.
    const u32 per_chunk = p.chunk * p.tiles_x;
    const u32 first = t / per_chunk * p.chunk;
    const u32 width = min(p.chunk, p.tiles_y * p.tiles_z - first);
    const u32 r = t % per_chunk;
    const u32 plane = first + r % width;
    at.m_block = p.tiles_x - 1u - r / width;
    at.head = plane % p.tiles_y;
    at.batch = plane / p.tiles_y;
    at.col0 = 0u;
#else
    at.m_block = t % p.tiles_x;
    at.head = (t / p.tiles_x) % p.tiles_y;
    at.batch = t / (p.tiles_x * p.tiles_y);
    at.col0 = 0u;
#endif
    return at;
}

// Tile `t`'s place and its key blocks.
__device__ __forceinline__ FwdTile fwd_tile(u32 t, const FwdParams& p, const u32* seqs) {
    FwdTile f;
    const TilePlace at = tile_place(t, p);
    f.head = at.head;
    f.batch = at.batch;
    f.col0 = at.col0;
    f.head_kv = f.head / p.group;
    const int m0 = (int)(at.m_block * BLOCK_M);
    f.m0 = m0;
    // Key j is visible to query i when j <= i + diag (bottom-right aligned causal mask).
    const int diag = (int)p.seq_k - (int)p.seq_q;
    // Key blocks j0 … n_blocks − 1: all of them, but up to the last row's diagonal (causal)
    // or window end, and from the first row's window start.
    int n_blocks = ((int)p.seq_k + BLOCK_N - 1) / BLOCK_N;
    int j0 = 0;
#if VARLEN
    {
        // From the first row's first key to the last row's last (both grow with the row).
        const int last_row = min(m0 + BLOCK_M, (int)p.seq_q) - 1;
        const PackedRange first = packed_range(seqs, (int)p.n_seqs, m0, CAUSAL, WINDOW,
                                               p.s.window_left, p.s.window_right);
        const PackedRange last = packed_range(seqs, (int)p.n_seqs, last_row, CAUSAL, WINDOW,
                                              p.s.window_left, p.s.window_right);
        j0 = first.lo / BLOCK_N;
        n_blocks = max((last.hi + BLOCK_N - 1) / BLOCK_N, j0);
    }
#elif CAUSAL || WINDOW
    {
        const int last_row = min(m0 + BLOCK_M, (int)p.seq_q) - 1;
        int last_key = (int)p.seq_k - 1;
#if CAUSAL
        last_key = min(last_key, last_row + diag);
#endif
#if WINDOW
        last_key = min(last_key, last_row + diag + (int)p.s.window_right);
        j0 = max(m0 + diag - (int)p.s.window_left, 0) / BLOCK_N;
#endif
        n_blocks = last_key < 0 ? 0 : min(n_blocks, last_key / BLOCK_N + 1);
        n_blocks = max(n_blocks, j0);
    }
#endif
    f.j0 = j0;
    // Steps of the pipeline: block j0 + i at step i.
    f.steps = n_blocks - j0;
    return f;
}

// The tile a block runs in its round `r`: the grid's blocks take the tiles in order, round
// after round (one round where the grid is every tile; a persistent grid, one block per SM,
// strides over them). With CAUSAL, odd rounds run backwards over the grid, so that a block that
// took a long tile takes a short one next (the tiles come longest first).
__device__ __forceinline__ u32 round_tile(u32 r) {
    const u32 b = CAUSAL && (r & 1u) ? gridDim.x - 1u - blockIdx.x : blockIdx.x;
    return r * gridDim.x + b;
}

extern "C" __global__ void __launch_bounds__(128 * (CONSUMERS + 1), 1)
burn_flash_hopper_forward(const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,
                          const __grid_constant__ TmaMap tv,
#if BIAS_TILES
                          const __grid_constant__ TmaMap tb,
#endif
                          // The maps' buffers (the launch binds one per map; not read).
                          const unsigned short* q_buffer,
                          const unsigned short* k_buffer,
                          const unsigned short* v_buffer,
#if BIAS_TILES
                          const unsigned short* b_buffer,
#endif
                          unsigned short* __restrict__ out, float* __restrict__ lse,
                          const unsigned short* __restrict__ mask,
                          const unsigned short* __restrict__ bias,
                          const float* __restrict__ slopes,
                          const float* __restrict__ sinks,
                          const u32* __restrict__ seqs,
                          u32* __restrict__ tile_counter,
                          const __grid_constant__ FwdParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char smem_raw[];
    // Swizzle atoms are 1024-byte aligned (the swizzle pattern follows address bits 4..9).
    const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const u32 sq = base;
    const u32 sk = sq + Q_BYTES;
    const u32 sv = sk + STAGES * K_BYTES;
    const u32 sb = sv + STAGES * V_BYTES;
    const u32 bars = sb + STAGES * B_BYTES;
    const u32 q_full = bars;
#define K_FULL(s) (bars + 8u + 8u * (s))
#define V_FULL(s) (bars + 8u + 8u * STAGES + 8u * (s))
#define K_EMPTY(s) (bars + 8u + 16u * STAGES + 8u * (s))
#define V_EMPTY(s) (bars + 8u + 24u * STAGES + 8u * (s))
    // The consumers have issued and completed their last Q·Kᵀ of a tile: Q may be refilled.
    const u32 q_empty = bars + 8u + 32u * STAGES;
    // DYNAMIC: the tile of round r (slot r % 2), written by the producer before it arrives on
    // Q's barrier of that round (the arrival releases it; the consumers' wait acquires it).
#define TILE_SLOT(r) (bars + 96u + 4u * ((r) & 1u))

    const u32 tid = threadIdx.x;
    const u32 n_tiles = p.tiles_x * p.tiles_y * p.tiles_z;
    // Key j is visible to query i when j <= i + diag (bottom-right aligned causal mask).
    const int diag = (int)p.seq_k - (int)p.seq_q;

    if (tid == 0) {
        mbar_init(q_full, 1);
#pragma unroll
        for (u32 s = 0; s < STAGES; ++s) {
            mbar_init(K_FULL(s), 1);
            mbar_init(V_FULL(s), 1);
            // One arrival per consumer warp.
            mbar_init(K_EMPTY(s), 4 * CONSUMERS);
            mbar_init(V_EMPTY(s), 4 * CONSUMERS);
        }
        mbar_init(q_empty, 4 * CONSUMERS);
        mbar_init_fence();
    }
    __syncthreads();

    const u32 wg = tid / 128u;
    if (wg == 0) {
        // ---- producer ----
        regs_release<24>();
        if (tid == 0) {
            tma_prefetch_map(&tk);
            tma_prefetch_map(&tv);
#if B_BYTES
            tma_prefetch_map(&tb);
#endif
#if !GIVEN
            tma_prefetch_map(&tq);
#endif
            // Steps issued so far: the ring's slot and phase continue from tile to tile.
            u32 g = 0u;
#if DYNAMIC
            u32 tile = blockIdx.x;
#endif
            for (u32 round = 0u;; ++round) {
#if DYNAMIC
                // The first round's tiles are the blocks' own; each later tile is the next of
                // the launch's counter (zeroed by the host), so blocks that finish early take
                // more. The slot written here was read two rounds ago: the consumers read it
                // before they released that round's Q, which this thread waited for last round.
                if (round > 0u) tile = gridDim.x + atomicAdd(tile_counter, 1u);
                sts_u32(TILE_SLOT(round), tile);
#else
                const u32 tile = round_tile(round);
#endif
#if !GIVEN
                // Q of the previous round's tile is free once every consumer's last Q·Kᵀ on it
                // landed. Every round loads one (a tile without keys too: its consumers wait for
                // it and release it at once), so that the round's parity is Q's phase.
                if (round > 0u) mbar_wait(q_empty, (round - 1u) & 1u);
#endif
                if (tile >= n_tiles) {
#if DYNAMIC
                    // None left: the consumers read that from the slot, on Q's barrier.
                    mbar_arrive(q_full);
#endif
                    break;
                }
                const FwdTile f = fwd_tile(tile, p, seqs);
#if B_BYTES
                const int bias_batch = (p.bias_planes & 1u) ? (int)f.batch : 0;
                const int bias_head = (p.bias_planes & 2u) ? (int)f.head : 0;
                // The bias's row coordinate: the block's first row, or the one row (BIAS_ROW).
                const int bias_m = BIAS_ROW ? 0 : f.m0;
#endif
#if GIVEN
                const u32 k_batch = f.batch * p.x_batch, v_batch = f.batch * p.v_batch;
#else
                const u32 k_batch = f.batch, v_batch = f.batch;
                mbar_arrive_expect_tx(q_full, Q_BYTES);
#pragma unroll
                for (int a = 0; a < D_ATOMS; ++a) {
                    tma_load_4d(sq + a * ATOM_BYTES, &tq, q_full, 64 * a, f.m0, f.head, f.batch);
                }
#endif
                for (int i = 0; i < f.steps; ++i, ++g) {
                    const int j = f.j0 + i;
                    const u32 s = g % STAGES;
                    const u32 use = g / STAGES;
                    if (g >= STAGES) mbar_wait(K_EMPTY(s), (use - 1u) & 1u);
                    mbar_arrive_expect_tx(K_FULL(s), K_BYTES + B_TX);
#pragma unroll
                    for (int a = 0; a < D_ATOMS; ++a) {
#if GIVEN
                        // X rows m0 …, columns of block j.
                        tma_load_4d(sk + s * K_BYTES + a * ATOM_BYTES, &tk, K_FULL(s),
                                    j * BLOCK_N + 64 * a, f.m0, 0, k_batch);
#else
                        tma_load_4d(sk + s * K_BYTES + a * KV_ATOM, &tk, K_FULL(s), 64 * a,
                                    j * BLOCK_N, f.head_kv, k_batch);
#endif
                    }
#if B_BYTES
                    // The bias of rows m0 … (or its one row) and block j's keys, beside K (same
                    // barriers).
#pragma unroll
                    for (int a = 0; a < BLOCK_N / 64; ++a) {
                        tma_load_4d(sb + s * B_BYTES + a * ATOM_BYTES, &tb, K_FULL(s),
                                    j * BLOCK_N + 64 * a, bias_m, bias_head, bias_batch);
                    }
#endif
                    if (g >= STAGES) mbar_wait(V_EMPTY(s), (use - 1u) & 1u);
                    mbar_arrive_expect_tx(V_FULL(s), V_BYTES);
#pragma unroll
                    for (int a = 0; a < V_ATOMS; ++a) {
                        tma_load_4d(sv + s * V_BYTES + a * KV_ATOM, &tv, V_FULL(s),
                                    (int)f.col0 + 64 * a, j * BLOCK_N, f.head_kv, v_batch);
                    }
                }
            }
        }
        return;
    }

    // ---- consumers ----
#if CONSUMERS == 3
    regs_claim<160>();
#else
    regs_claim<240>();
#endif
    const u32 c = wg - 1u;
    const u32 t = tid % 128u, warp = t / 32u, lane = t % 32u;
#if PINGPONG
    // The consumers take turns issuing their products (consumer c waits on named barrier
    // 1 + c, which its predecessor arrives at), so that one warpgroup's softmax runs while
    // another's products occupy the tensor cores. The last consumer opens the first turn; the
    // turns run on from tile to tile.
    if (c == CONSUMERS - 1) named_arrive(1, 256);
#endif
    // Steps consumed so far: the ring's slot and phase continue from tile to tile.
    u32 g = 0u;
    for (u32 round = 0u;; ++round) {
#if DYNAMIC
        // The round's tile comes with its Q.
        mbar_wait(q_full, round & 1u);
        const u32 tile = lds_u32(TILE_SLOT(round));
#else
        const u32 tile = round_tile(round);
#endif
        if (tile >= n_tiles) break;
        const FwdTile f = fwd_tile(tile, p, seqs);
        const u32 head = f.head, batch = f.batch, col0 = f.col0;
        const int m0 = f.m0, j0 = f.j0, steps = f.steps;
        // This thread's rows: row0 and row0 + 8 (the accumulator layout of `wgmma`).
        const int first_row = m0 + 64 * (int)c;
        const int row0 = first_row + 16 * (int)warp + (int)(lane / 4u);
        ScoreRows rows;
        rows.first_row = first_row;
        rows.row0 = row0;
        rows.lane = lane;
        rows.tile_row = 64u * c + 16u * warp + lane / 4u;
        rows.diag = diag;
        rows.seq_k = (int)p.seq_k;
        rows.s = p.s;
        rows.seq_q = (int)p.seq_q;
        rows.mask = mask + (u64)batch * p.mask_stride_b + (u64)head * p.mask_stride_h;
        rows.bias = bias + (u64)batch * p.bias_stride_b + (u64)head * p.bias_stride_h;
        rows.mask_stride_s = p.mask_stride_s;
        rows.mask_stride_k = p.mask_stride_k;
        rows.bias_stride_s = p.bias_stride_s;
        rows.bias_stride_k = p.bias_stride_k;
        rows.left = (int)p.s.window_left;
        rows.right = (int)p.s.window_right;
#pragma unroll
        for (int r = 0; r < 2; ++r) rows.dk[r] = row0 + 8 * r + diag;
#if VARLEN
        {
            const int last = (int)p.seq_q - 1;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const PackedRange k = packed_range(seqs, (int)p.n_seqs, min(row0 + 8 * r, last),
                                                   CAUSAL, WINDOW, p.s.window_left, p.s.window_right);
                rows.lo[r] = k.lo;
                rows.hi[r] = k.hi;
                rows.dk[r] = k.diag;
            }
            // Every row of the consumer sees the keys from its last row's first to its first
            // row's last.
            rows.full_lo = packed_range(seqs, (int)p.n_seqs, min(first_row + 63, last), CAUSAL,
                                        WINDOW, p.s.window_left, p.s.window_right).lo;
            rows.full_hi = packed_range(seqs, (int)p.n_seqs, min(first_row, last), CAUSAL, WINDOW,
                                        p.s.window_left, p.s.window_right).hi;
        }
#endif
        rows.slope_log2 = ALIBI ? -LOG2E * slopes[head] : 0.0f;
        // The second key word: the seed's high word mixed with the (batch, head) pair.
        rows.s.seed_hi = p.s.seed_hi ^ ((batch * p.tiles_y + head) * 0x9E3779B9u);

        float o[O_REGS];
#pragma unroll
        for (int i = 0; i < O_REGS; ++i) o[i] = 0.0f;
        float sc[S_REGS];
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) sc[i] = 0.0f;
        u32 pa[BLOCK_N / 16][4];
        float m_r[2] = {NEG_INF, NEG_INF};
        float l_r[2] = {0.0f, 0.0f};
        float corr[2];

        if (steps > 0) {
#if GIVEN
            // Block 0's scores and weights; then per block j, O += P·V of block j − 1 is issued
            // and block j's scores are read and turned into weights while it runs.
            mbar_wait(K_FULL(g % STAGES), (g / STAGES) & 1u);
            load_scores(sc, sk + (g % STAGES) * K_BYTES, c, warp, lane);
            release(K_EMPTY(g % STAGES), lane);
            online_softmax(sc, m_r, l_r, corr, rows, j0, 0u);
            pack_weights(pa, sc);
            for (int i = 1; i < steps; ++i) {
                const u32 gi = g + (u32)i, s = gi % STAGES, phase = (gi / STAGES) & 1u;
                const u32 sp = (gi - 1u) % STAGES, phase_p = ((gi - 1u) / STAGES) & 1u;
                mbar_wait(V_FULL(sp), phase_p);
                turn_begin(c);
                wgmma_fence();
                issue_pv(o, pa, sv + sp * V_BYTES);
                wgmma_commit();
                turn_end(c);
                mbar_wait(K_FULL(s), phase);
                load_scores(sc, sk + s * K_BYTES, c, warp, lane);
                release(K_EMPTY(s), lane);
                online_softmax(sc, m_r, l_r, corr, rows, j0 + i, 0u);
                wgmma_wait<0>();
                wgmma_hold(o);
                release(V_EMPTY(sp), lane);
                rescale(o, corr);
                pack_weights(pa, sc);
            }
#else
            if (!DYNAMIC) mbar_wait(q_full, round & 1u);
            // Block 0: S = Q·K₀ᵀ, then its weights.
            const u32 s0 = g % STAGES;
            mbar_wait(K_FULL(s0), (g / STAGES) & 1u);
            turn_begin(c);
            wgmma_fence();
            issue_qk(sc, sq, sk + s0 * K_BYTES, c);
            wgmma_commit();
            turn_end(c);
            wgmma_wait<0>();
            wgmma_hold(sc);
            // The tile's last Q·Kᵀ has landed: Q may be refilled with the next tile's.
            if (steps == 1) release(q_empty, lane);
#if !B_BYTES
            release(K_EMPTY(s0), lane);
#endif
            online_softmax(sc, m_r, l_r, corr, rows, j0, sb + s0 * B_BYTES);
#if B_BYTES
            // The bias was read from the slot: it may be refilled.
            release(K_EMPTY(s0), lane);
#endif
            pack_weights(pa, sc);
            // Step i: S = Q·Kᵀ of its block is issued before O += P·V of step i − 1's, and the
            // softmax of step i runs while that product is in flight (FlashAttention-3's
            // intra-warpgroup overlap); O is rescaled once the product has landed.
            for (int i = 1; i < steps; ++i) {
                const u32 gi = g + (u32)i, s = gi % STAGES, phase = (gi / STAGES) & 1u;
                const u32 sp = (gi - 1u) % STAGES, phase_p = ((gi - 1u) / STAGES) & 1u;
                mbar_wait(K_FULL(s), phase);
                turn_begin(c);
                wgmma_fence();
                issue_qk(sc, sq, sk + s * K_BYTES, c);
                wgmma_commit();
                mbar_wait(V_FULL(sp), phase_p);
                issue_pv(o, pa, sv + sp * V_BYTES);
                wgmma_commit();
                turn_end(c);
                wgmma_wait<1>();
                wgmma_hold(sc);
                if (i == steps - 1) release(q_empty, lane);
#if !B_BYTES
                release(K_EMPTY(s), lane);
#endif
                online_softmax(sc, m_r, l_r, corr, rows, j0 + i, sb + s * B_BYTES);
#if B_BYTES
                release(K_EMPTY(s), lane);
#endif
                wgmma_wait<0>();
                wgmma_hold(o);
                release(V_EMPTY(sp), lane);
                rescale(o, corr);
                pack_weights(pa, sc);
            }
#endif
            // The last block's O += P·V.
            const u32 gl = g + (u32)steps - 1u;
            const u32 sl = gl % STAGES, phase_l = (gl / STAGES) & 1u;
            mbar_wait(V_FULL(sl), phase_l);
            turn_begin(c);
            wgmma_fence();
            issue_pv(o, pa, sv + sl * V_BYTES);
            wgmma_commit();
            turn_end(c);
            wgmma_wait<0>();
            wgmma_hold(o);
            release(V_EMPTY(sl), lane);
            g += (u32)steps;
        }
#if !GIVEN
        else {
            // No keys: the round's Q came all the same.
            if (!DYNAMIC) mbar_wait(q_full, round & 1u);
            release(q_empty, lane);
        }
#endif

        // The row sums (4 lanes per row), the output and the log-sum-exp.
        const u64 out_base = (u64)batch * p.out_stride_b + (u64)head * p.out_stride_h;
        const u64 lse_base = (u64)batch * p.lse_stride_b + (u64)head * p.lse_stride_h;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_r[r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int row = row0 + 8 * r;
            if (row < (int)p.seq_q) {
#if QUIET
                // Quiet softmax divides by 1 + Σ e^s: the 1 is e^(−m) against the row's reference.
                float total = l + ex2(-m_r[r]);
#else
                float total = l;
#endif
#if SINKS
                // The head's sink logit joins the denominator: e^sink against the reference.
                const float sink_log2 = LOG2E * sinks[head];
                total += ex2(sink_log2 - m_r[r]);
#endif
                const float inv = total > 0.0f ? 1.0f / total : 0.0f;
                unsigned short* dst = out + out_base + (u64)row * p.out_stride_s + col0;
#pragma unroll
                for (int i = 0; i < O_REGS / 4; ++i) {
                    const u32 col = 8u * i + 2u * (lane % 4u);
                    if (col0 + col < p.value_dim) {
                        *reinterpret_cast<u32*>(dst + col) =
                            pack2(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
                    }
                }
                if (lane % 4u == 0u && col0 == 0u) {
                    float row_lse = l > 0.0f ? (m_r[r] + log2f(l)) * 0.6931471805599453f : NEG_INF;
#if QUIET
                    // ln(1 + Σ e^s) = softplus(lse), without overflow.
                    row_lse = fmaxf(row_lse, 0.0f) + log1pf(expf(-fabsf(row_lse)));
#endif
#if SINKS
                    {
                        // ln(e^lse + e^sink), without overflow.
                        const float sink = sinks[head];
                        const float hi = fmaxf(row_lse, sink), lo = fminf(row_lse, sink);
                        row_lse = hi + log1pf(expf(lo - hi));
                    }
#endif
                    lse[lse_base + (u64)row * p.lse_stride_s] = row_lse;
                }
            }
        }
    }
#if PINGPONG
    // Consumes the last consumer's last arrival.
    if (c == 0) named_sync(1, 256);
#endif
#endif
}
