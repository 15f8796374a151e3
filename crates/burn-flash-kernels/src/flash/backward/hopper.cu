// The main Hopper backward kernel, `burn_flash_hopper_backward`: its design, tile, parameters
// and helpers are in hopper.cuh, which precedes this file in the source NVRTC gets (hopper.rs).

extern "C" __global__ void __launch_bounds__(384, 1)
burn_flash_hopper_backward(const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,
                           const __grid_constant__ TmaMap tv, const __grid_constant__ TmaMap tdo,
#if BIAS_TILES
                           const __grid_constant__ TmaMap tb,
#endif
                           // The maps' buffers (the launch binds one per map; not read).
                           const unsigned short* q_buffer, const unsigned short* k_buffer,
                           const unsigned short* v_buffer, const unsigned short* do_buffer,
#if BIAS_TILES
                           const unsigned short* b_buffer,
#endif
                           const float* __restrict__ lse2, const float* __restrict__ delta,
                           float* __restrict__ dq_acc, unsigned short* __restrict__ dk,
                           unsigned short* __restrict__ dv,
                           const unsigned short* __restrict__ mask,
                           const unsigned short* __restrict__ bias,
                           unsigned short* __restrict__ ds,
                           const float* __restrict__ slopes,
                           const u32* __restrict__ seqs,
                           u32* __restrict__ dq_lock,
                           const __grid_constant__ BwdParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char smem_raw[];
    const u32 raw = smem_u32(smem_raw);
    // Swizzle atoms are 1024-byte aligned (the swizzle pattern follows address bits 4..9).
    const u32 base = (raw + 1023u) & ~1023u;
    const u32 sk = base;
    const u32 sv = sk + K_BYTES;
    const u32 sds = sv + V_BYTES;
    const u32 tiles = sds + 2 * DS_BYTES;
    const u32 rows_area = tiles + STAGES * (Q_BYTES + DO_BYTES);
    const u32 sdq = rows_area + STAGES * 2 * ROWS_BYTES;
    const u32 bars = sdq + DQ_BYTES;
    const u32 kv_full = bars;
#define SQ(s) (tiles + (s) * (Q_BYTES + DO_BYTES))
#define SDO(s) (SQ(s) + Q_BYTES)
#define SLSE(s) (rows_area + (s) * 2 * ROWS_BYTES)
#define SDELTA(s) (SLSE(s) + ROWS_BYTES)
#define FULL(s) (bars + 8u + 8u * (s))
#define EMPTY(s) (bars + 8u + 8u * STAGES + 8u * (s))
// DQ_BULK: consumer c's dQ tile of step parity `slot`, and its barriers.
#define SDQ(slot, c) (sdq + (slot) * 2u * DQ_TILE_BYTES + (c) * DQ_TILE_BYTES)
#define DQ_FULL(slot, c) (bars + 8u + 16u * STAGES + 16u * (slot) + 8u * (c))
#define DQ_EMPTY(slot, c) (bars + 40u + 16u * STAGES + 16u * (slot) + 8u * (c))
// PERSISTENT: the consumers are done with a tile's K and V (one arrival per consumer warp).
#define KV_EMPTY (bars + 104u)

    const u32 tid = threadIdx.x;
    // Key j is visible to query i when j <= i + diag (bottom-right aligned causal mask).
    const int diag = (int)p.seq_k - (int)p.seq_q;

    if (tid == 0) {
        mbar_init(kv_full, 1);
#if PERSISTENT
        mbar_init(KV_EMPTY, 8);
#endif
#pragma unroll
        for (u32 s = 0; s < STAGES; ++s) {
            mbar_init(FULL(s), 1);
            // One arrival per consumer warp.
            mbar_init(EMPTY(s), 8);
        }
#if DQ_BULK
#pragma unroll
        for (u32 slot = 0; slot < 2; ++slot) {
#pragma unroll
            for (u32 c = 0; c < 2; ++c) {
                // Every thread of the consumer, once its part of the tile is stored; the writer.
                mbar_init(DQ_FULL(slot, c), 128);
                mbar_init(DQ_EMPTY(slot, c), 1);
            }
        }
#endif
        mbar_init_fence();
    }
    __syncthreads();

    const u32 wg = tid / 128u;
    if (wg == 0) {
        // ---- producer ----
        regs_release<24>();
        if (tid == 0) {
            tma_prefetch_map(&tq);
            tma_prefetch_map(&tk);
            tma_prefetch_map(&tv);
            tma_prefetch_map(&tdo);
#if BIAS_TILES
            tma_prefetch_map(&tb);
#endif
            // g: the block's steps so far (the ring's and the parities' count, across tiles);
            // kv_use: its tiles with steps so far (K/V loads).
            int g = 0;
            u32 kv_use = 0;
            for (u32 tile = FIRST_TILE; tile < TILE_END; tile += TILE_STEP) {
                const TileWork w = tile_work(seqs, p, tile);
                const u32 head_kv = w.head_kv, batch = w.batch;
                const int n0 = w.n0, m_first = w.m_first, m_end = w.m_end, per_head = w.per_head;
                if (w.steps == 0) continue;
#if BIAS_TILES
                const int bias_batch = (p.bias_planes & 1u) ? (int)batch : 0;
#endif
#if PERSISTENT
                // The consumers have finished the last tile's products (the K/V buffers' readers).
                if (kv_use > 0) mbar_wait(KV_EMPTY, (kv_use - 1u) & 1u);
#endif
                mbar_arrive_expect_tx(kv_full, K_BYTES + V_BYTES);
#pragma unroll
                for (int a = 0; a < D_ATOMS; ++a) {
                    tma_load_4d(sk + a * KV_ATOM, &tk, kv_full, 64 * a, n0, head_kv, batch);
                }
#pragma unroll
                for (int a = 0; a < V_ATOMS; ++a) {
                    tma_load_4d(sv + a * KV_ATOM, &tv, kv_full, 64 * a, n0, head_kv, batch);
                }
                for (int it = 0; it < w.steps; ++it, ++g) {
                    const int m = step_row_block(it, m_first, m_end, per_head);
                    const u32 head = head_kv * p.group + (u32)(it / per_head);
                    const u32 s = g % STAGES, use = g / STAGES;
                    if (g >= STAGES) mbar_wait(EMPTY(s), (use - 1u) & 1u);
                    mbar_arrive_expect_tx(FULL(s), Q_BYTES + DO_BYTES + 2 * ROWS_BYTES + B_BYTES);
#pragma unroll
                    for (int a = 0; a < D_ATOMS; ++a) {
                        tma_load_4d(SQ(s) + a * ROW_ATOM, &tq, FULL(s), 64 * a, m * BLOCK_M, head,
                                    batch);
                    }
#pragma unroll
                    for (int a = 0; a < V_ATOMS; ++a) {
                        tma_load_4d(SDO(s) + a * ROW_ATOM, &tdo, FULL(s), 64 * a, m * BLOCK_M, head,
                                    batch);
                    }
                    const u64 row = ((u64)batch * p.heads_q + head) * p.rows_pad + (u64)m * BLOCK_M;
                    bulk_load(SLSE(s), lse2 + row, ROWS_BYTES, FULL(s));
                    bulk_load(SDELTA(s), delta + row, ROWS_BYTES, FULL(s));
#if BIAS_TILES
                    // The bias of the step's rows and the block's keys, into the dSᵀ buffer of the
                    // step's parity (free: step it − 2's consumers released slot s after their dQ
                    // products and dS copies read it).
                    const int bias_head = (p.bias_planes & 2u) ? (int)head : 0;
#pragma unroll
                    for (int a = 0; a < BLOCK_N / 64; ++a) {
                        tma_load_4d(sds + (u32)(g % 2) * DS_BYTES + a * ROW_ATOM, &tb, FULL(s),
                                    n0 + 64 * a, m * BLOCK_M, bias_head, bias_batch);
                    }
#endif
                }
                ++kv_use;
            }
        }
#if DQ_WRITER
        else if (tid / 32u == 1u) {
            // ---- dQ writer: lane 0 (and, summing two tiles, the whole warp) ----
            const u32 lane = tid % 32u;
            int g = 0;
            for (u32 tile = FIRST_TILE; tile < TILE_END; tile += TILE_STEP) {
                const TileWork w = tile_work(seqs, p, tile);
                const u32 head_kv = w.head_kv, batch = w.batch;
                const int m_first = w.m_first, m_end = w.m_end, per_head = w.per_head;
                for (int it = 0; it < w.steps; ++it, ++g) {
                    const int m = step_row_block(it, m_first, m_end, per_head);
                    const u32 head = head_kv * p.group + (u32)(it / per_head);
                    const u32 slot = (u32)g % 2u, phase = ((u32)g / 2u) & 1u;
                    const u64 row = ((u64)batch * p.heads_q + head) * p.rows_pad + (u64)m * BLOCK_M;
                    float* dq_rows = dq_acc + row * HEAD_DIM;
#if DETERMINISTIC && HEAD_DIM == 64
                    // Both consumers' tiles hold the same rows and columns: the warp adds the
                    // second into the first in shared memory (one order, before the turn is
                    // waited for), and one reduce adds the sum.
                    mbar_wait(DQ_FULL(slot, 0), phase);
                    mbar_wait(DQ_FULL(slot, 1), phase);
#pragma unroll 1
                    for (u32 i = lane; i < DQ_TILE_BYTES / 16u; i += 32u) {
                        const u32 a = SDQ(slot, 0) + 16u * i, b = SDQ(slot, 1) + 16u * i;
                        float x0, x1, x2, x3, y0, y1, y2, y3;
                        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                                     : "=f"(x0), "=f"(x1), "=f"(x2), "=f"(x3) : "r"(a) : "memory");
                        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                                     : "=f"(y0), "=f"(y1), "=f"(y2), "=f"(y3) : "r"(b) : "memory");
                        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};"
                                     :: "r"(a), "f"(x0 + y0), "f"(x1 + y1), "f"(x2 + y2), "f"(x3 + y3)
                                     : "memory");
                    }
                    fence_proxy_async();
                    __syncwarp();
                    if (lane == 0u) {
                        u32* lock = dq_lock + row / BLOCK_M;
                        wait_count(lock, visitors_before(seqs, p, m, (int)blockIdx.x));
                        fence_proxy_async_global();
                        bulk_reduce_add_f32(dq_rows, SDQ(slot, 0), DQ_TILE_BYTES);
                        bulk_commit();
                        bulk_wait<0>();
                        fence_proxy_async_global();
                        count_release(lock);
                        mbar_arrive(DQ_EMPTY(slot, 0));
                        mbar_arrive(DQ_EMPTY(slot, 1));
                    }
                    __syncwarp();
#else
                    if (lane == 0u) {
#if DETERMINISTIC
                        u32* lock = dq_lock + row / BLOCK_M;
                        wait_count(lock, visitors_before(seqs, p, m, (int)blockIdx.x));
                        fence_proxy_async_global();
#endif
#pragma unroll
                        for (u32 c = 0; c < 2; ++c) {
                            mbar_wait(DQ_FULL(slot, c), phase);
                            // Rows past Sq add zeros to the accumulator's padding (their weights
                            // are 0).
                            bulk_reduce_add_f32(dq_rows + (HEAD_DIM == 128 ? 4096u * c : 0u),
                                                SDQ(slot, c), DQ_TILE_BYTES);
                            bulk_commit();
                        }
#if DETERMINISTIC
                        bulk_wait<0>();
                        fence_proxy_async_global();
                        count_release(lock);
#else
                        bulk_wait_read<0>();
#endif
                        mbar_arrive(DQ_EMPTY(slot, 0));
                        mbar_arrive(DQ_EMPTY(slot, 1));
                    }
#endif
                }
            }
            // Every reduce performed before the block ends (the conversion reads the
            // accumulator).
            if (lane == 0u) bulk_wait<0>();
        }
#endif
        return;
    }

    // ---- consumers ----
    regs_claim<240>();
    const u32 c = wg - 1u;
    const u32 t = tid % 128u, warp = t / 32u, lane = t % 32u;
    float dk_acc[DK_REGS], dv_acc[DV_REGS];
    float st[32], dpt[32], dq[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        st[i] = 0.0f;
        dpt[i] = 0.0f;
        dq[i] = 0.0f;
    }
    u32 pp[4][4], pds[4][4];
    // g: the block's steps so far (across tiles, as the producer counts them); kv_use: its
    // tiles with steps so far.
    int g = 0;
    u32 kv_use = 0;
    for (u32 tile = FIRST_TILE; tile < TILE_END; tile += TILE_STEP) {
        const TileWork w = tile_work(seqs, p, tile);
        const u32 head_kv = w.head_kv, batch = w.batch;
        const int n0 = w.n0, m_first = w.m_first, m_end = w.m_end, per_head = w.per_head;
        const int steps = w.steps;
        // This thread's keys (rows of the transposed products): key0 and key0 + 8.
        const int keys_c = n0 + (int)KEY_OFF(c);
        const int key0 = keys_c + 16 * (int)warp + (int)(lane / 4u);
        // The dropout key's second word: the seed's high word mixed with (batch, query head).
        const u32 seed_base = batch * p.heads_q;
#pragma unroll
        for (int i = 0; i < DK_REGS; ++i) dk_acc[i] = 0.0f;
#pragma unroll
        for (int i = 0; i < DV_REGS; ++i) dv_acc[i] = 0.0f;
#if WRITE_DS
        const u32 ds_t = tid - 128u;
        const int ds_keys = (int)p.seq_k - n0;
#if CAUSAL || WINDOW || VARLEN
        // The rows outside the visited blocks see none of this block's keys: dS = 0.
        {
            const int skipped = per_head > 0 ? min(m_first * BLOCK_M, (int)p.seq_q) : (int)p.seq_q;
            const int resumed = per_head > 0 ? min(m_end * BLOCK_M, (int)p.seq_q) : (int)p.seq_q;
            const u32 key = ds_t % BLOCK_N;
            if ((int)key < ds_keys) {
                for (u32 h = 0; h < p.group; ++h) {
                    unsigned short* dst = ds + (u64)batch * p.ds_stride_b
                                          + (u64)(head_kv * p.group + h) * p.ds_stride_h
                                          + (u64)(n0 + (int)key) * p.ds_stride_k;
                    for (int r = (int)(ds_t / BLOCK_N); r < (int)p.seq_q; r += 256 / BLOCK_N) {
                        if (r < skipped || r >= resumed) dst[(u64)r * p.ds_stride_s] = 0;
                    }
                }
            }
        }
#endif
#endif

        if (steps > 0) mbar_wait(kv_full, kv_use & 1u);
#if STAGGER
        // Consumer 1 starts half a step behind consumer 0 (which arrives after its first dV).
        if (steps > 0 && c == 1u) named_sync(STAGGER_BAR, 256);
#endif
        for (int it = 0; it < steps; ++it, ++g) {
            const int m0 = step_row_block(it, m_first, m_end, per_head) * BLOCK_M;
            const u32 head = head_kv * p.group + (u32)(it / per_head);
            const u32 s = g % STAGES, phase = (g / STAGES) & 1;
            mbar_wait(FULL(s), phase);
#if DQ_WRITER
            // The dQ tile this step stores (step it's; with DEFER_DQ step it − 1's), once the
            // writer's reduce of the tile two steps before has read it (waited here, where few
            // registers are live, rather than before the store).
            {
                const int q = DEFER_DQ ? g - 1 : g;
                dq_tile_wait(DQ_EMPTY((u32)q % 2u, c), q);
            }
#endif
            wgmma_fence();
            issue_keys_rows<HEAD_DIM>(st, sk, SQ(s), c);
            wgmma_commit();
            issue_keys_rows<VALUE_DIM>(dpt, sv, SDO(s), c);
            wgmma_commit();

            // Sᵀ has landed (dPᵀ may still run): the weights Pᵀ, packed (after dropout) as the A
            // operand of dV += (Pᵀ ⊙ Z)·dO, which is issued at once; `st` keeps what dSᵀ needs of
            // them: P ⊙ (1 − tanh²) under a softcap, with the sign bit set where dropout dropped.
            wgmma_wait<1>();
            wgmma_hold(st);
            const float* lse_s = reinterpret_cast<const float*>(smem_raw + (SLSE(s) - raw));
            const float* delta_s = reinterpret_cast<const float*>(smem_raw + (SDELTA(s) - raw));
            bool edge = keys_c + 63 >= (int)p.seq_k;
#if CAUSAL
            edge = edge || keys_c + 63 > m0 + diag;
#endif
#if WINDOW
            edge = edge || keys_c + 63 > m0 + diag + (int)p.s.window_right
                   || keys_c < m0 + BLOCK_M - 1 + diag - (int)p.s.window_left;
#endif
#if VARLEN
            // Some row of the step does not see all of the consumer's 64 keys: its last row's
            // first key is after the first, or its first row's last before the last.
            edge = keys_c < row_keys(seqs, p, min(m0 + BLOCK_M, (int)p.seq_q) - 1).lo
                   || keys_c + 64 > row_keys(seqs, p, m0).hi;
#endif
#if ALIBI
            const float slope_log2 = -LOG2E * slopes[head];
#endif
#if DROPOUT
            const u32 seed_key1 = p.s.seed_hi ^ ((seed_base + head) * 0x9E3779B9u);
#endif
#if MASK
            const unsigned short* mask_h =
                mask + (u64)batch * p.mask_stride_b + (u64)head * p.mask_stride_h;
#endif
#if BIAS_TILES
            // The step's bias tile (the dSᵀ buffer of its parity): this consumer's 64 keys' atom.
            const u32 sb = sds + (u32)(g % 2) * DS_BYTES + (KEY_OFF(c) / 64u) * ROW_ATOM;
#elif BIAS
            const unsigned short* bias_h =
                bias + (u64)batch * p.bias_stride_b + (u64)head * p.bias_stride_h;
#endif
#if ALIBI && !VARLEN
            // The thread's first score's `row + diag − key`, as f32: register i's is a constant
            // 8·(i / 4) + i % 2 − 8·((i / 2) % 2) further (exact below 2²⁴), so each score's
            // distance is one FADD rather than an integer-to-float conversion.
            const float dist0 = (float)(m0 + diag - key0 + 2 * (int)(lane % 4u));
#endif
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                // Register i: key key0 + 8·((i / 2) % 2), query row m0 + col.
                const int col = 8 * (i / 4) + 2 * (int)(lane % 4u) + (i % 2);
                const int key = key0 + 8 * ((i / 2) % 2);
#if SOFTCAP
                const float th = tanhf(st[i] * p.s.cap_inv_scale);
#endif
                // Whether the score depends on q·k (not a masked key's fill score).
                bool live = true;
#if MASK || BIAS || ALIBI
#if SOFTCAP
                float x = p.s.cap_log2 * th;
#else
                float x = st[i] * p.s.scale_log2;
#endif
#if BIAS_TILES
                // Row `col` of the tile, key 16·warp + lane / 4 + 8·((i / 2) % 2) of the atom: 16-byte
                // chunk 2·warp + (i / 2) % 2, swizzled by the row (zeros past Sq and Sk).
                {
                    const u32 chunk = 2u * warp + (u32)((i / 2) % 2);
                    x += LOG2E * elem_to_f32(lds_u16(sb + (u32)col * 128u
                                                     + ((chunk ^ ((u32)col % 8u)) << 4)
                                                     + 2u * (lane / 4u)));
                }
#endif
                {
                    const int row = m0 + col;
                    if (row < (int)p.seq_q && key < (int)p.seq_k) {
#if BIAS && !BIAS_TILES
                        x += LOG2E * elem_to_f32(bias_h[(u64)row * p.bias_stride_s
                                                        + (u64)key * p.bias_stride_k]);
#endif
#if ALIBI && VARLEN
                        x += slope_log2 * fabsf((float)(row_keys(seqs, p, row).diag - key));
#elif ALIBI
                        x += slope_log2
                             * fabsf(dist0 + (float)(8 * (i / 4) + (i % 2) - 8 * ((i / 2) % 2)));
#endif
#if MASK
                        if (mask_h[(u64)row * p.mask_stride_s + (u64)key * p.mask_stride_k]
                            & 0x7fffu) {
                            live = false;
                            x = FILL ? p.s.fill_log2 : NEG_INF;
                        }
#endif
                    }
                }
                float pv = ex2(x - lse_s[col]);
#elif SOFTCAP
                float pv = ex2(fmaf(p.s.cap_log2, th, -lse_s[col]));
#else
                float pv = ex2(fmaf(st[i], p.s.scale_log2, -lse_s[col]));
#endif
                if (edge) {
#if VARLEN
                    const PackedRange r = row_keys(seqs, p, min(m0 + col, (int)p.seq_q - 1));
                    const bool hidden = key < r.lo || key >= r.hi;
#else
                    bool hidden = key >= (int)p.seq_k;
#if CAUSAL
                    hidden = hidden || key > m0 + col + diag;
#endif
#if WINDOW
                    hidden = hidden || key > m0 + col + diag + (int)p.s.window_right
                             || key < m0 + col + diag - (int)p.s.window_left;
#endif
#endif
                    if (hidden) pv = 0.0f;
                }
#if SOFTCAP
                float keep_factor = live ? pv * (1.0f - th * th) : 0.0f;
#else
                float keep_factor = live ? pv : 0.0f;
#endif
#if DROPOUT
                const u32 word = threefry((u32)key, (u32)(m0 + col), p.s.seed_lo, seed_key1);
                const bool kept = word >= p.s.threshold;
                dq[i] = kept ? pv * p.s.inv_keep : 0.0f;
                if (!kept) keep_factor = -keep_factor;
#else
                dq[i] = pv;
#endif
                st[i] = keep_factor;
            }
            // (dq holds the dropped weights until they are packed: its registers are free here.)
            pack_slices(pp, dq);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                WGMMA_DV(dv_acc, pp[kk],
                         desc_sw128(SDO(s) + DV_ATOM0(c) * ROW_ATOM + kk * 2048u, ROW_ATOM, 1024),
                         1u);
            }
            wgmma_commit();
#if STAGGER
            if (it == 0 && c == 0u) named_arrive(STAGGER_BAR, 256);
#endif

            // dPᵀ has landed (dV may still run): dSᵀ = Pᵀ ⊙ (dPᵀ ⊙ Z − δ), packed, stored for dQ,
            // and dK += dSᵀ·Q issued.
            wgmma_wait<1>();
            wgmma_hold(dpt);
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int col = 8 * (i / 4) + 2 * (int)(lane % 4u) + (i % 2);
#if DROPOUT
                const bool kept = !(__float_as_uint(st[i]) >> 31);
                dpt[i] = fabsf(st[i]) * (kept ? dpt[i] * p.s.inv_keep - delta_s[col] : -delta_s[col]);
#else
                dpt[i] = st[i] * (dpt[i] - delta_s[col]);
#endif
            }
            pack_slices(pds, dpt);
            const u32 buf = sds + (u32)(g % 2) * DS_BYTES;
#if BIAS_TILES && WIDE
            // Every thread of both consumers has read the bias tile that dSᵀ overwrites (each
            // stores half of the query columns of all 64 keys).
            named_sync(1, 256);
#elif BIAS_TILES
            // Every thread of this consumer has read its keys' bias atom, which its dSᵀ rows
            // overwrite (the same 64 keys: the same 8 KiB of the buffer).
            named_sync(2u + c, 128);
#endif
#if DEFER_DQ
            // The other consumer has finished step it − 1: its dSᵀ(it − 1) is stored, and its
            // dQ(it − 2), the last read of this buffer, has landed.
            if (it >= 1) named_sync(DONE_BAR(1u - c, (u32)(g - 1) % 2u), 256);
#endif
            store_ds(buf, pds, c, warp, lane);
            fence_proxy_async();
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                WGMMA_DK(dk_acc, pds[kk],
                         desc_sw128(SQ(s) + DK_ATOM0(c) * ROW_ATOM + kk * 2048u, ROW_ATOM, 1024),
                         1u);
            }
            wgmma_commit();
#if !DEFER_DQ
            // Both consumers' dSᵀ are in shared memory (the buffer of this step's parity: the one
            // of the step before last was read before either consumer arrived here last step).
            named_sync(1, 256);
#endif
#if !DQ_WRITER
            float* dq_rows = dq_acc + (((u64)batch * p.heads_q + head) * p.rows_pad + (u64)m0) * HEAD_DIM;
#endif
#if WRITE_DS
            unsigned short* ds_rows = ds + (u64)batch * p.ds_stride_b + (u64)head * p.ds_stride_h
                                      + (u64)m0 * p.ds_stride_s + (u64)n0 * p.ds_stride_k;
#endif
#if WIDE
#if WRITE_DS
            copy_ds(ds_rows, buf, (int)p.seq_q - m0, ds_keys, p.ds_stride_s, p.ds_stride_k, ds_t);
#endif
            // dQ[:, atom a] = dS·K[:, atom a] for consumer c's atoms, one at a time: all 64 keys.
#pragma unroll
            for (u32 h = 0; h < D_ATOMS / 2; ++h) {
                const u32 a = DK_ATOM0(c) + h;
                if (h > 0) wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                    const u64 da = desc_sw128(buf + kk * 2048u, DS_BYTES, 1024);
                    const u64 db = desc_sw128(sk + a * KV_ATOM + kk * 2048u, KV_ATOM, 1024);
                    wgmma_ss_n64_tt(dq, da, db, kk > 0 ? 1u : 0u);
                }
                wgmma_commit();
                wgmma_wait<0>();
                wgmma_hold(dv_acc);
                wgmma_hold(dk_acc);
                wgmma_hold(dq);
                if (h == D_ATOMS / 2 - 1) release(EMPTY(s), lane);
                add_dq(dq_rows, dq, (int)p.seq_q - m0, 64u * a, warp, lane);
            }
#elif DEFER_DQ
            // dQ of step it − 1 (its buffer, the other parity's: both halves stored).
            if (it >= 1) issue_dq_128(dq, sds + (u32)((g - 1) % 2) * DS_BYTES, sk, c);
#elif HEAD_DIM == 128
            issue_dq_128(dq, buf, sk, c);
#else
            // dQ (+)= dS[:, keys of c]·K[keys of c, :]: this consumer's 64 keys.
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const u64 da = desc_sw128(buf + c * 8192u + kk * 2048u, DS_BYTES, 1024);
                const u64 db = desc_sw128(sk + c * 8192u + kk * 2048u, KV_ATOM, 1024);
                wgmma_ss_n64_tt(dq, da, db, kk > 0 ? 1u : 0u);
            }
#endif
#if !WIDE
            wgmma_commit();
#if WRITE_DS
            // (While dQ's products run: they read the same tile.)
            copy_ds(ds_rows, buf, (int)p.seq_q - m0, ds_keys, p.ds_stride_s, p.ds_stride_k, ds_t);
#endif
            wgmma_wait<0>();
            wgmma_hold(dv_acc);
            wgmma_hold(dk_acc);
            wgmma_hold(dq);
            release(EMPTY(s), lane);
#if DEFER_DQ
            // Step it − 1's tile (its parity's, free since the step began), then the writer's turn;
            // then the other consumer may store into the buffer this step's dQ read.
            if (it >= 1) {
                dq_tile_give(SDQ((u32)(g - 1) % 2u, c), DQ_FULL((u32)(g - 1) % 2u, c), dq, t);
            }
            named_arrive(DONE_BAR(c, (u32)g % 2u), 256);
#elif DQ_WRITER
            // The tile of this step's parity (free since the step began), then the writer's turn.
            dq_tile_give(SDQ((u32)g % 2u, c), DQ_FULL((u32)g % 2u, c), dq, t);
#elif DQ_BULK
            // The tile of this step's parity: the reduce that read it two steps ago finished
            // reading before its issuing thread reached this step's named barrier 1.
            store_dq(SDQ((u32)g % 2u, c), dq, t);
            fence_proxy_async();
            named_sync(2u + c, 128);
            if (t == 0u) {
                // Rows past Sq add zeros to the accumulator's padding (their weights are 0).
                bulk_reduce_add_f32(dq_rows + (HEAD_DIM == 128 ? 4096u * c : 0u), SDQ((u32)g % 2u, c),
                                    DQ_TILE_BYTES);
                bulk_commit();
                bulk_wait_read<1>();
            }
#else
            add_dq(dq_rows, dq, (int)p.seq_q - m0, HEAD_DIM == 128 ? 64u * c : 0u, warp, lane);
#endif
#endif
        }

#if DEFER_DQ
        // The last step's dQ, once the other consumer's half of its dSᵀ is stored.
        if (steps > 0) {
            const int last = g - 1;
            named_sync(DONE_BAR(1u - c, (u32)last % 2u), 256);
            wgmma_fence();
            issue_dq_128(dq, sds + (u32)(last % 2) * DS_BYTES, sk, c);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_hold(dv_acc);
            wgmma_hold(dk_acc);
            wgmma_hold(dq);
            dq_tile_wait(DQ_EMPTY((u32)last % 2u, c), last);
            dq_tile_give(SDQ((u32)last % 2u, c), DQ_FULL((u32)last % 2u, c), dq, t);
        }
#endif

#if PERSISTENT
        // The tile's last products have read K and V: the producer may load the next tile's
        // under this epilogue.
        if (steps > 0) release(KV_EMPTY, lane);
#endif
        if (steps > 0) ++kv_use;

        // dK (scaled: the scores are scale·q·k) and dV of this thread's keys, from the consumer's
        // first column.
        const u32 dk_col0 = 64u * DK_ATOM0(c), dv_col0 = 64u * DV_ATOM0(c);
        write_keys(dk + (u64)batch * p.dk_stride_b + (u64)head_kv * p.dk_stride_h
                       + (u64)dk_col0 * p.dk_stride_d,
                   dk_acc, p.scale, key0, (int)p.seq_k, p.head_dim > dk_col0 ? p.head_dim - dk_col0 : 0u,
                   p.dk_stride_s, p.dk_stride_d, lane);
        write_keys(dv + (u64)batch * p.dv_stride_b + (u64)head_kv * p.dv_stride_h
                       + (u64)dv_col0 * p.dv_stride_d,
                   dv_acc, 1.0f, key0, (int)p.seq_k,
                   p.value_dim > dv_col0 ? p.value_dim - dv_col0 : 0u, p.dv_stride_s, p.dv_stride_d,
                   lane);
    }

#if DQ_BULK && !DQ_WRITER
    // Every reduce performed before the block ends (the conversion reads the accumulator).
    if (t == 0u) bulk_wait<0>();
#endif
#endif
}
