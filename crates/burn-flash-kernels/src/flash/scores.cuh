// Score helpers shared by the hand-written attention kernels (forward and backward): the
// element type, the base-2 exponential, and the dropout generator of dropout.rs.
//
// The including source defines ELEM_BF16 (0 | 1) before this text.

typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.4426950408889634f

// The score scalars of a call, in the order of the host's words (args.rs,
// `Scalars::hopper_words`): one struct in every kernel's parameters, so that a new scalar is
// written here and there only.
struct ScoreScalars {
    float scale_log2;    // scale · log2(e)
    float cap_inv_scale; // scale / c (SOFTCAP)
    float cap_log2;      // c · log2(e) (SOFTCAP)
    float fill_log2;     // masked_score · log2(e) (FILL)
    u32 seed_lo, seed_hi;           // DROPOUT: the seed
    u32 threshold;                  // DROPOUT: a weight is kept when its word is at least this
    float inv_keep;                 // DROPOUT: 1 / (1 − p)
    u32 window_left, window_right;  // WINDOW
};

// Threefry-2×32-20 of counter (c0, c1) under key (k0, k1), the first word (dropout.rs).
__device__ __forceinline__ u32 threefry(u32 c0, u32 c1, u32 k0, u32 k1) {
    const u32 rot[8] = {13, 15, 26, 6, 17, 29, 16, 24};
    const u32 ks[3] = {k0, k1, 0x1BD11BDAu ^ k0 ^ k1};
    u32 x0 = c0 + k0, x1 = c1 + k1;
#pragma unroll
    for (u32 round = 0; round < 20; ++round) {
        x0 += x1;
        x1 = __funnelshift_l(x1, x1, rot[round % 8]) ^ x0;
        if (round % 4 == 3) {
            const u32 s = round / 4 + 1;
            x0 += ks[s % 3];
            x1 += ks[(s + 1) % 3] + s;
        }
    }
    return x0;
}

// An element of the input type as f32.
__device__ __forceinline__ float elem_to_f32(unsigned short bits) {
#if ELEM_BF16
    return __int_as_float(((u32)bits) << 16);
#else
    float f;
    asm("{\n.reg .b16 t;\nmov.b16 t, %1;\ncvt.f32.f16 %0, t;\n}" : "=f"(f) : "h"(bits));
    return f;
#endif
}

// f32 as an element of the input type, rounded to nearest.
__device__ __forceinline__ unsigned short f32_to_elem(float x) {
    unsigned short bits;
#if ELEM_BF16
    asm("{\n.reg .b16 t;\ncvt.rn.bf16.f32 t, %1;\nmov.b16 %0, t;\n}" : "=h"(bits) : "f"(x));
#else
    asm("{\n.reg .b16 t;\ncvt.rn.f16.f32 t, %1;\nmov.b16 %0, t;\n}" : "=h"(bits) : "f"(x));
#endif
    return bits;
}

// The keys `lo .. hi` query position `pos` of a packed variable-length call sees, and its
// diagonal key `diag` (bottom-right aligned within its sequence): `seqs` holds the cumulative
// query lengths cu_q[n + 1], then the cumulative key lengths cu_k[n + 1]; the row's sequence
// is the last b < n with cu_q[b] <= pos (a binary search), its keys cu_k[b] .. cu_k[b + 1],
// narrowed by the causal mask (`causal`) and the window (`window`: `left`, `right` keys
// around the diagonal) as scores.rs's `key_range`. Empty when hi <= lo.
struct PackedRange {
    int lo, hi, diag;
};

__device__ __forceinline__ PackedRange packed_range(const u32* seqs, int n, int pos, bool causal,
                                                    bool window, u32 left, u32 right) {
    int a = 0, b = n;
    while (b - a > 1) {
        const int mid = (a + b) / 2;
        if ((int)seqs[mid] <= pos) a = mid;
        else b = mid;
    }
    const long long k0 = seqs[n + 1 + a], k1 = seqs[n + 2 + a];
    const long long diag = (long long)pos + k1 - (long long)seqs[a + 1];
    long long lo = k0, hi = k1;
    if (causal) hi = hi < diag + 1 ? hi : diag + 1;
    if (window) {
        hi = hi < diag + (long long)right + 1 ? hi : diag + (long long)right + 1;
        lo = lo > diag - (long long)left ? lo : diag - (long long)left;
    }
    PackedRange r;
    r.lo = (int)lo;
    r.hi = (int)(hi > lo ? hi : lo);
    r.diag = (int)diag;
    return r;
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
