// Attention backward on Hopper (sm_90a): FlashAttention-3's backward, written as CUDA C++ with
// inline PTX (../../hopper/sm90.cuh) and launched through cubecl's client (hopper.rs). Three
// kernels run in order on the same stream:
//
// 1. `burn_flash_hopper_backward_rows` (hopper_rows.cu): per query row, δ = rowsum(dO ⊙ O), the
//    log-sum-exp in base 2 (+inf for rows without a visible key, so that their weights are 0)
//    and a zeroed f32 row of the dQ accumulator; rows padded to BLOCK_M with δ 0 and +inf.
// 2. `burn_flash_hopper_backward` (hopper.cu; its tile, parameters and helpers here): one
//    block of 384 threads per 128 keys of one (batch, key/value head). It keeps K and V of its
//    keys in shared memory and dK, dV in registers, and walks the query rows that see those
//    keys — every query head of the group, 64 rows per step:
//    - warpgroup 0 is the producer: it gives its registers back and one thread issues TMA loads
//      (K and V once; then Q, dO, and the rows' base-2 log-sum-exp and δ per step into a ring of
//      STAGES slots with full/empty mbarriers);
//    - warpgroups 1 and 2 are the consumers, 64 keys each. Per step, with the products
//      transposed so that the keys are the M dimension of `wgmma`:
//        Sᵀ  = K·Qᵀ, dPᵀ = V·dOᵀ               (both operands in shared memory)
//        Pᵀ  = 2^(Sᵀ·scale·log2 e − lse₂)      (registers; softcap, causal, dropout applied)
//        dSᵀ = Pᵀ ⊙ (dPᵀ ⊙ Z − δ)              (⊙ (1 − tanh²) through a softcap)
//        dV += (Pᵀ ⊙ Z)·dO, dK += dSᵀ·Q         (A from registers, B = dO, Q N-major)
//        dQ  = dS·K                              (dSᵀ through shared memory; A and B MN-major)
//      With D = 128 each consumer computes 64 of dQ's columns from all 128 keys; with D = 64
//      each computes all columns from its own 64 keys (both add into the accumulator).
//      DQ_BULK (a host define; head dims up to 128): each consumer stores its 64 × 64 f32
//      tile of dQ to shared memory in its threads' order (`store_dq`: conflict-free 16-byte
//      stores) and arrives on the tile's "full" mbarrier; the producer's second warp, the dQ
//      writer (DQ_WRITER: head dim 128, or DETERMINISTIC; at head dim 64 each consumer's first
//      thread issues its own reduce after a named barrier), adds each tile to the accumulator
//      with one TMA bulk reduce
//      (`cp.reduce.async.bulk .add.f32`) and, once the reduce has read it, arrives on its
//      "empty" mbarrier: FlashAttention-3's dQ path, with no reduce issued or waited for by
//      the consumers. The accumulator holds each 64-row block as tiles in that order
//      (hopper_rows.cu, its header). Two tiles per consumer alternate by step parity.
//      DETERMINISTIC (with DQ_BULK): the adds into each 64-row block of dQ happen in the order
//      of the key blocks, so that every run sums in the same order (the same bits): the
//      writer of key block n waits until the block's counter (`dq_lock`, zeroed by the
//      prepass) has counted the key blocks before n that visit those rows, adds its
//      consumers' tiles (at D = 64, where both hold the same rows and columns, summed in shared
//      memory first), waits until the adds are performed, and counts one more
//      (FlashAttention-3's deterministic mode); causal calls walk the row blocks from the last
//      (REVERSE). A block waits only on blocks of lower index (key blocks are the grid's x),
//      which start earlier.
//      Otherwise (WIDE always): the consumers add dQ with vector reductions
//      (`red.add.v2.f32`) per thread, into a row-major accumulator.
//    - WIDE (a head dim of 256): a block holds 64 keys, and both consumers compute Sᵀ and dPᵀ
//      of all of them (the same values; wgmma's M is 64), then each takes half of the columns:
//      dV[:, half c], dK[:, half c] and dQ[:, half c] — the registers of the 128-column case.
//      The duplicated Sᵀ and dPᵀ are 2 of the step's 7 products.
// 3. `burn_flash_hopper_backward_dq` (hopper_rows.cu): dQ = scale · accumulator, in the element
//    type, through dQ's strides.
//
// Tiles are stored as the TMA writes them with 128-byte swizzling: 64-column atoms of 128 key
// rows (K, V) or 64 query rows (Q, dO) × 128 bytes. dSᵀ is stored by the consumers in the same
// swizzle: 128 key rows × 64 query columns (one atom column), double-buffered by step parity.
//
// The host prepends WG_ELEM ("f16" | "bf16"), ELEM_BF16, HEAD_DIM and VALUE_DIM (64 | 128, the
// head dims rounded up; or 128 | 256 with one of them 256, WIDE; the columns past the real ones
// are read as zeros and never written),
// and CAUSAL, SOFTCAP, MASK, FILL, BIAS, ALIBI, WINDOW, VARLEN, DROPOUT (0 | 1), the score rules
// of the forward (forward/hopper.cu) in its order: scale, softcap, bias and ALiBi, then a
// masked key hidden or given the fill score; a window or packed sequences also narrow the row
// blocks a key block visits. A key that took the fill score has a constant score: its weight reaches dV,
// its dS reaches neither dQ nor dK.
//
// BIAS_TILES (0 | 1, with BIAS; the host sets it where TMA can load the bias's rows): the
// producer loads each step's bias, BLOCK_M query rows × BLOCK_N keys in 64-key atoms with the
// 128-byte swizzle (rows past Sq and keys past Sk read as zeros), on the step's full barrier
// into the dSᵀ buffer of the step's parity — free by then: the stage's empty barrier, which the
// producer waited for, completes after step it − 2's dQ products and dS copies read that
// buffer. The consumers read it in the P loop (a warp's 32 loads of a register touch 16
// distinct banks: no conflict) instead of one global load per score, and a named barrier per
// consumer (both consumers when WIDE, whose dSᵀ halves interleave) separates its last bias
// read from its first dSᵀ store over the same bytes (the tile's rows are query rows, dSᵀ's
// keys). Without it a bias is read from global memory per element.
//
// WRITE_DS (0 | 1; never with SOFTCAP): dS = Pᵀ ⊙ (dPᵀ ⊙ Z − δ), a tracked bias's gradient, is
// also written to `ds` [B, Hq, Sq, Sk] through its strides. Without a softcap the dSᵀ tile the
// consumers store for dQ is exactly that (in the element type, 0 for a hidden key and for a
// key that took the fill score), so after the step's named barrier both consumers copy it out,
// key-contiguous, while dQ's products run; the rows of the query blocks a causal block skips
// see none of its keys and get zeros before the loop. (Under a softcap the tile holds dS times
// the softcap's derivative, which the consumers do not keep: the plan sends that call to the
// `mma.sync` backward.)

#define BLOCK_M 64
#if HEAD_DIM > 128 || VALUE_DIM > 128
#define WIDE 1
#define BLOCK_N 64
#else
#define WIDE 0
#define BLOCK_N 128
#endif
#define STAGES 2
#define D_ATOMS (HEAD_DIM / 64)
#define V_ATOMS (VALUE_DIM / 64)
#define KV_ATOM (BLOCK_N * 128)
#define ROW_ATOM (BLOCK_M * 128)
#define K_BYTES (D_ATOMS * KV_ATOM)
#define V_BYTES (V_ATOMS * KV_ATOM)
#define Q_BYTES (D_ATOMS * ROW_ATOM)
#define DO_BYTES (V_ATOMS * ROW_ATOM)
#define ROWS_BYTES (BLOCK_M * 4)
#define DS_BYTES (BLOCK_N * BLOCK_M * 2)
// BIAS_TILES (from the host, with BIAS): the step's bias tile by TMA into the dSᵀ buffer of
// the step's parity, which is the Q/dO stage's (two stages).
#if BIAS_TILES
#if !BIAS || STAGES != 2
#error "BIAS_TILES reads a bias into the dS buffer of the step's stage (two stages)"
#endif
#define B_BYTES DS_BYTES
#else
#define B_BYTES 0
#endif
// DQ_BULK (from the host, never with WIDE): dQ through shared memory and TMA bulk reduces, a
// consumer's 64 × 64 f32 tile, two per consumer (step parity).
#if DQ_BULK && WIDE
#error "DQ_BULK needs 128 keys per block (not WIDE)"
#endif
#define DQ_TILE_BYTES (BLOCK_M * 64 * 4)
#if DQ_BULK
#define DQ_BYTES (4 * DQ_TILE_BYTES)
#else
#define DQ_BYTES 0
#endif
#if DETERMINISTIC && !DQ_BULK
#error "DETERMINISTIC orders the bulk reduces of DQ_BULK"
#endif
// DQ_WRITER: the producer's second warp issues the reduces (head dim 128, or deterministic);
// at head dim 64 without order each consumer's first thread issues its own, which measured
// faster there (the writer cost 6–12 % of the causal backward, RESULTS §5.0).
#define DQ_WRITER (DQ_BULK && (HEAD_DIM == 128 || DETERMINISTIC))
// DEFER_DQ (0 | 1, from the host; with the dQ writer at head dim 128, without BIAS_TILES,
// WRITE_DS or DETERMINISTIC): step it's dQ products are issued in step it + 1, after that
// step's dK, so that the consumers no longer meet at a named barrier in every step. Before
// storing dSᵀ(it) a consumer waits (bar.sync) for the other to have finished step it − 1 —
// which stored dSᵀ(it − 1), the other half of what dQ(it − 1) reads, and last read the buffer
// dSᵀ(it) overwrites (dQ(it − 2)) — and at the end of each step it arrives (bar.arrive) on its
// own barrier of the step's parity (DONE_BAR): the consumers may run up to a step apart, one's
// elementwise work under the other's products. After the loop each consumer issues the last
// step's dQ. STAGGER (0 | 1, with DEFER_DQ): consumer 1 starts once consumer 0 has issued its
// first dV, half a step behind (FlashAttention-3's forward staggers its consumers so).
#if DEFER_DQ && (!DQ_WRITER || HEAD_DIM != 128 || WIDE || BIAS_TILES || WRITE_DS || DETERMINISTIC)
#error "DEFER_DQ: the dQ writer at head dim 128, without BIAS_TILES, WRITE_DS or DETERMINISTIC"
#endif
#if STAGGER && !DEFER_DQ
#error "STAGGER needs DEFER_DQ"
#endif
// Consumer c's end-of-step barrier of parity p (named barriers 4 … 7; 1 is the dSᵀ exchange,
// 2 + c a consumer's own, 8 the stagger).
#define DONE_BAR(c, p) (4u + 2u * (c) + (p))
#define STAGGER_BAR 8u
// The columns of dK and dV a consumer accumulates (WIDE: half of each), and the first
// 64-column atom of consumer c's; the first of the keys it computes with.
#if WIDE
#define DK_COLS (HEAD_DIM / 2)
#define DV_COLS (VALUE_DIM / 2)
#define DK_ATOM0(c) ((c) * (D_ATOMS / 2))
#define DV_ATOM0(c) ((c) * (V_ATOMS / 2))
#define KEY_OFF(c) 0u
#else
#define DK_COLS HEAD_DIM
#define DV_COLS VALUE_DIM
#define DK_ATOM0(c) 0u
#define DV_ATOM0(c) 0u
#define KEY_OFF(c) (64u * (c))
#endif
#define DK_REGS (DK_COLS / 2)
#define DV_REGS (DV_COLS / 2)

#if DK_COLS == 128
#define WGMMA_DK wgmma_rs_n128_tb
#else
#define WGMMA_DK wgmma_rs_n64_tb
#endif
#if DV_COLS == 128
#define WGMMA_DV wgmma_rs_n128_tb
#else
#define WGMMA_DV wgmma_rs_n64_tb
#endif

// The scalars, in the order of the host's words (hopper.rs, `params`).
struct BwdParams {
    u64 dk_stride_b, dk_stride_h, dk_stride_s, dk_stride_d;
    u64 dv_stride_b, dv_stride_h, dv_stride_s, dv_stride_d;
    u32 seq_q, seq_k;
    u32 rows_pad, heads_q; // rows_pad: Sq rounded up to BLOCK_M, the row count of lse₂, δ, dQ
    u32 group, head_dim;
    u32 value_dim;
    float scale;         // dK = scale · dSᵀ·Q
    ScoreScalars s;
    u64 mask_stride_b, mask_stride_h, mask_stride_s, mask_stride_k;
    u64 bias_stride_b, bias_stride_h, bias_stride_s, bias_stride_k;
    u64 ds_stride_b, ds_stride_h, ds_stride_s, ds_stride_k; // WRITE_DS
    u32 n_seqs;                                             // VARLEN: packed sequences
    u32 bias_planes; // BIAS_TILES: bit 0 the bias has batches, bit 1 heads (else coordinate 0)
    u32 tiles, tiles_pad; // PERSISTENT: key blocks · Hkv · B
};
static_assert(sizeof(BwdParams) == 8 * PARAM_WORDS, "the host's words (hopper.rs, PARAM_WORDS)");

#if VARLEN
// The keys of query row `row` of a packed call (scores.cuh's packed_range under this call's
// causal mask and window).
__device__ __forceinline__ PackedRange row_keys(const u32* seqs, const BwdParams& p, int row) {
    return packed_range(seqs, (int)p.n_seqs, row, CAUSAL, WINDOW, p.s.window_left, p.s.window_right);
}

// The first query row (or Sq) whose key range ends after `key` (`by_end`), or starts after it
// (both ends grow with the row).
__device__ __forceinline__ int first_row_past(const u32* seqs, const BwdParams& p, int key,
                                              bool by_end) {
    int lo = 0, hi = (int)p.seq_q;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        const PackedRange r = row_keys(seqs, p, mid);
        if ((by_end ? r.hi : r.lo) > key) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}
#endif

// The row blocks first … end − 1 with a row that sees a key of key block `n` (both ends grow
// with n).
struct RowBlocks {
    int first, end;
};

__device__ __forceinline__ RowBlocks row_blocks(const u32* seqs, const BwdParams& p, int n) {
    const int n0 = n * BLOCK_N;
    const int diag = (int)p.seq_k - (int)p.seq_q;
    RowBlocks r;
    r.first = 0;
    r.end = ((int)p.seq_q + BLOCK_M - 1) / BLOCK_M;
#if CAUSAL
    // The first row block with a row that sees key n0.
    r.first = max(0, n0 - diag) / BLOCK_M;
#endif
#if WINDOW
    // Rows i see keys i + diag − left ..= i + diag + right: from the first row whose window
    // reaches key n0 to the last whose window starts at or before the block's last key.
    r.first = max(r.first, max(0, n0 - diag - (int)p.s.window_right) / BLOCK_M);
    {
        const int last_row = min(n0 + BLOCK_N, (int)p.seq_k) - 1 - diag + (int)p.s.window_left;
        r.end = last_row < 0 ? 0 : min(r.end, last_row / BLOCK_M + 1);
    }
#endif
#if VARLEN
    // The rows that see one of the block's keys: from the first whose range ends after n0 to
    // the last whose range starts at or before the block's last key.
    {
        const int last_key = min(n0 + BLOCK_N, (int)p.seq_k) - 1;
        r.first = first_row_past(seqs, p, n0, true) / BLOCK_M;
        r.end = (first_row_past(seqs, p, last_key, false) + BLOCK_M - 1) / BLOCK_M;
    }
#endif
    return r;
}

// The tiles a block runs: with PERSISTENT the tiles blockIdx.x, + gridDim.x, … below p.tiles
// (numbered key block fastest, then key/value head, then batch: each head's longest causal
// tiles first), otherwise its own (blockIdx.x, y, z). The roles loop over the same tiles and
// count their steps across them (g), so the ring's stages and the step parities (dSᵀ buffer,
// dQ tile, bias tile) run on from one tile to the next; K and V are loaded once the consumers
// have released the last tile's (KV_EMPTY), under that tile's epilogue.
#if PERSISTENT
#if DETERMINISTIC || DEFER_DQ
#error "PERSISTENT: not with DETERMINISTIC or DEFER_DQ"
#endif
#define FIRST_TILE blockIdx.x
#define TILE_END p.tiles
#define TILE_STEP gridDim.x
#else
#define FIRST_TILE 0u
#define TILE_END 1u
#define TILE_STEP 1u
#endif

// A tile's key block n (its first key n0), heads and batch, and the steps it walks: the row
// blocks first … end − 1 of each of the group's query heads.
struct TileWork {
    int n0, m_first, m_end, per_head, steps;
    u32 head_kv, batch;
};

__device__ __forceinline__ TileWork tile_work(const u32* seqs, const BwdParams& p, u32 tile) {
    int n;
    TileWork w;
#if PERSISTENT
    const u32 blocks = (p.seq_k + BLOCK_N - 1u) / BLOCK_N, heads_kv = p.heads_q / p.group;
    n = (int)(tile % blocks);
    w.head_kv = (tile / blocks) % heads_kv;
    w.batch = tile / blocks / heads_kv;
#else
    n = (int)blockIdx.x;
    w.head_kv = blockIdx.y;
    w.batch = blockIdx.z;
#endif
    w.n0 = n * BLOCK_N;
    const RowBlocks visited = row_blocks(seqs, p, n);
    w.m_first = visited.first;
    w.m_end = visited.end;
    w.per_head = max(0, w.m_end - w.m_first);
    w.steps = w.per_head * (int)p.group;
    return w;
}

// The row block of step `it` (of `per_head` per query head, from `m_first` to `m_end` − 1).
// REVERSE walks each head's row blocks from the last: deterministic causal calls, where every
// key block's last row block is the same one (the last), so that the blocks adding in turn
// reach each row block at the same step instead of each waiting for its predecessor to walk
// down to its first (the diagonal's) row block.
#if DETERMINISTIC && CAUSAL && !WINDOW && !VARLEN
#define REVERSE 1
#else
#define REVERSE 0
#endif
__device__ __forceinline__ int step_row_block(int it, int m_first, int m_end, int per_head) {
    return REVERSE ? m_end - 1 - it % per_head : m_first + it % per_head;
}

#if DETERMINISTIC
// How many key blocks before `n` visit row block `m`, which `n` visits: those from the first
// whose row blocks end after m (the ends grow with the block, and every block before n starts
// at or before n's first row block).
__device__ __forceinline__ u32 visitors_before(const u32* seqs, const BwdParams& p, int m, int n) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (row_blocks(seqs, p, mid).end > m) hi = mid;
        else lo = mid + 1;
    }
    return (u32)(n - lo);
}
#endif

// Sᵀ (or dPᵀ) = A·Bᵀ for consumer `c`'s 64 keys (A: K or V, BLOCK_N key rows) and the step's
// 64 query rows (B: Q or dO), DIM / 16 steps of k16, 32 bytes further into a swizzled row each.
template <int DIM>
__device__ __forceinline__ void issue_keys_rows(float (&d)[32], u32 keys, u32 rows, u32 c) {
#pragma unroll
    for (int kk = 0; kk < DIM / 16; ++kk) {
        const u32 atom = kk / 4, within = (kk % 4) * 32;
        const u64 da = desc_sw128(keys + atom * KV_ATOM + KEY_OFF(c) * 128u + within, 16, 1024);
        const u64 db = desc_sw128(rows + atom * ROW_ATOM + within, 16, 1024);
        wgmma_ss_n64(d, da, db, kk > 0 ? 1u : 0u);
    }
}

// The 64 × 16 slices of a 64 × 64 accumulator as A operands (pairs of 16-bit values).
__device__ __forceinline__ void pack_slices(u32 (&a)[4][4], const float (&x)[32]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int j = 0; j < 4; ++j) a[kk][j] = pack2(x[8 * kk + 2 * j], x[8 * kk + 2 * j + 1]);
    }
}

// Stores consumer `c`'s 64 keys × 64 query columns of 16-bit pairs into a buffer of `BLOCK_N`
// key rows × 64 query columns with the 128-byte swizzle (16-byte chunk index XOR key row % 8).
// WIDE: both consumers hold the same values, and each stores half of the columns.
__device__ __forceinline__ void store_ds(u32 buf, const u32 (&a)[4][4], u32 c, u32 warp,
                                         u32 lane) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#if WIDE
        if ((u32)kk / 2u != c) continue;
#endif
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 key = KEY_OFF(c) + 16u * warp + lane / 4u + 8u * (j % 2);
            const u32 col = 8u * (2 * kk + j / 2) + 2u * (lane % 4u);
            const u32 off = key * 128u + col * 2u;
            const u32 addr = buf + (off ^ ((key % 8u) << 4));
            asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(a[kk][j]) : "memory");
        }
    }
}

// Writes a 64-key accumulator (`regs` per thread, scaled by `factor`) to rows `key0`, `key0 + 8`
// of a `[B, H, S, D]` tensor through its strides: columns below `cols`, keys below `seq_k`.
template <int REGS>
__device__ __forceinline__ void write_keys(unsigned short* dst, const float (&acc)[REGS],
                                           float factor, int key0, int seq_k, u32 cols,
                                           u64 stride_s, u64 stride_d, u32 lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + 8 * r;
        if (key >= seq_k) continue;
        unsigned short* row = dst + (u64)key * stride_s;
#pragma unroll
        for (int i = 0; i < REGS / 4; ++i) {
            const u32 col = 8u * i + 2u * (lane % 4u);
            if (col < cols) row[(u64)col * stride_d] = f32_to_elem(acc[4 * i + 2 * r] * factor);
            if (col + 1 < cols) {
                row[(u64)(col + 1) * stride_d] = f32_to_elem(acc[4 * i + 2 * r + 1] * factor);
            }
        }
    }
}

// Adds 64 columns of a step's dQ, from `col0`, to the accumulator rows at `acc` (the step's
// first row; `rows` of them below Sq).
__device__ __forceinline__ void add_dq(float* acc, const float (&dq)[32], int rows, u32 col0,
                                       u32 warp, u32 lane) {
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
        const int row = 16 * (int)warp + (int)(lane / 4u) + 8 * ((i / 2) % 2);
        const u32 col = col0 + 8u * (i / 4) + 2u * (lane % 4u);
        if (row < rows) red_add_v2(acc + (u64)row * HEAD_DIM + col, dq[i], dq[i + 1]);
    }
}

// Stores a consumer's 64 × 64 f32 tile of dQ at `buf` in thread order: registers 4j … 4j + 3 of
// thread `t` at byte 16·(128j + t). Consecutive threads fill consecutive 16 bytes (no bank
// conflict), and the tile is the accumulator's (hopper_rows.cu, its header).
// Issues dQ[:, 64c .. 64c + 63] = dS·K[:, 64c ..] at head dim 128: the dSᵀ tile in `buf` (all
// 128 keys, read MN-major) against consumer c's 64-column atom of K, 16 keys per product.
__device__ __forceinline__ void issue_dq_128(float (&dq)[32], u32 buf, u32 sk, u32 c) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        const u64 da = desc_sw128(buf + kk * 2048u, DS_BYTES, 1024);
        const u64 db = desc_sw128(sk + c * KV_ATOM + kk * 2048u, KV_ATOM, 1024);
        wgmma_ss_n64_tt(dq, da, db, kk > 0 ? 1u : 0u);
    }
}

__device__ __forceinline__ void store_dq(u32 buf, const float (&dq)[32], u32 t) {
#pragma unroll
    for (u32 j = 0; j < 8; ++j) {
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};"
                     :: "r"(buf + 16u * (128u * j + t)), "f"(dq[4 * j]), "f"(dq[4 * j + 1]),
                        "f"(dq[4 * j + 2]), "f"(dq[4 * j + 3])
                     : "memory");
    }
}

// DQ_WRITER: waits until the writer's reduce has read the dQ tile of step q − 2, whose slot
// (`empty`, the step parity's) step q's tile takes (steps 0 and 1 find their slots free).
__device__ __forceinline__ void dq_tile_wait(u32 empty, int q) {
    if (q >= 2) mbar_wait(empty, ((u32)q / 2u - 1u) & 1u);
}

// DQ_WRITER: stores this consumer's dQ tile into `buf`, makes it visible to the async proxy
// and hands it to the writer (`full`, 128 arrivals).
__device__ __forceinline__ void dq_tile_give(u32 buf, u32 full, const float (&dq)[32], u32 t) {
    store_dq(buf, dq, t);
    fence_proxy_async();
    mbar_arrive(full);
}

#if WRITE_DS
// Copies a step's dSᵀ tile (BLOCK_N keys × BLOCK_M query rows in `buf`, as store_ds wrote it)
// to `dst` (dS at the step's first row and the block's first key): rows below `rows`, keys
// below `keys`. Thread `t` of the consumers' 256: consecutive threads on consecutive keys.
__device__ __forceinline__ void copy_ds(unsigned short* dst, u32 buf, int rows, int keys,
                                        u64 stride_s, u64 stride_k, u32 t) {
#pragma unroll 4
    for (u32 e = t; e < BLOCK_N * BLOCK_M; e += 256u) {
        const u32 key = e % BLOCK_N, row = e / BLOCK_N;
        if ((int)row < rows && (int)key < keys) {
            const u32 off = key * 128u + row * 2u;
            unsigned short x;
            asm volatile("ld.shared.u16 %0, [%1];" : "=h"(x) : "r"(buf + (off ^ ((key % 8u) << 4))));
            dst[(u64)row * stride_s + (u64)key * stride_k] = x;
        }
    }
}
#endif

