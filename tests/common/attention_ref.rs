//! What the attention suites' f64 references share: broadcast indexing, a packed row's
//! sequence and the rounding models (exact, and a naive implementation's in a dtype).

use burn::tensor::{FloatDType, bf16, f16};

/// The keys `k0 .. k1` query row `i` sees before the causal mask and the window, and its
/// sequence's end `q1` (the row's diagonal key is `i + k1 − q1`): with packed sequences
/// (cumulative query and key lengths) its own sequence's, else `0 .. sk` and `sq`.
pub fn row_sequence(
    packed: Option<&(Vec<usize>, Vec<usize>)>,
    i: usize,
    sq: usize,
    sk: usize,
) -> (usize, usize, usize) {
    match packed {
        Some((cu_q, cu_k)) => {
            let s = (cu_q.partition_point(|&x| x <= i) - 1).min(cu_q.len() - 2);
            (cu_k[s], cu_k[s + 1], cu_q[s + 1])
        }
        None => (0, sk, sq),
    }
}

/// Index of `(b, h, i, j)` in a row-major tensor of `dims`, broadcasting dims of size 1.
pub fn at(dims: [usize; 4], [b, h, i, j]: [usize; 4]) -> usize {
    let pick = |x: usize, d: usize| if dims[d] == 1 { 0 } else { x };
    ((pick(b, 0) * dims[1] + pick(h, 1)) * dims[2] + pick(i, 2)) * dims[3] + pick(j, 3)
}

/// Rounding of a model: `acc` after every addition (or multiply-add) of a sum, `store` after
/// every stored intermediate and output, `lse` of the row log-sum-exp a backward rebuilds `P`
/// from, `operand` of each operand of a matrix product (`Q·Kᵀ`, `P·V`, `dO·Vᵀ`, `dS·K`, …).
#[derive(Clone, Copy)]
pub struct Rounding {
    pub acc: fn(f64) -> f64,
    pub store: fn(f64) -> f64,
    pub lse: fn(f64) -> f64,
    pub operand: fn(f64) -> f64,
}

/// No rounding: the f64 reference.
pub const EXACT: Rounding = Rounding {
    acc: |x| x,
    store: |x| x,
    lse: |x| x,
    operand: |x| x,
};

/// `x` as f32, rounded to TF32 (10 mantissa bits) to nearest, ties away from zero: what
/// `cvt.rna.tf32.f32` (`wmma::__float_to_tf32`) gives.
pub fn tf32(x: f64) -> f64 {
    let bits = (x as f32).to_bits();
    if !(x as f32).is_finite() {
        return x as f32 as f64;
    }
    f32::from_bits(bits.wrapping_add(0x1000) & !0x1fff) as f64
}

/// The naive implementation of f32 attention with TF32 products (torch's `allow_tf32`): f32
/// sums and storage, every matrix product's operands rounded to TF32.
pub fn naive_tf32() -> Rounding {
    Rounding {
        acc: to_f32,
        store: to_f32,
        lse: to_f32,
        operand: tf32,
    }
}

fn to_f32(x: f64) -> f64 {
    x as f32 as f64
}

/// The naive implementation of `dtype`: f32 sums, storage in `dtype` (the rounding a
/// composition of Burn ops in that dtype has, on any backend and matmul), and `P` rebuilt from
/// an f32 log-sum-exp as every attention backward that keeps no `Sq × Sk` state does (it
/// matters only where `|lse|` is large: a row of burn-nn's −1e4 fill scores has an lse ulp of
/// 2⁻¹⁰).
pub fn naive(dtype: FloatDType) -> Rounding {
    Rounding {
        acc: to_f32,
        lse: to_f32,
        operand: |x| x,
        store: match dtype {
            FloatDType::F16 => |x| f16::from_f64(x).to_f64(),
            FloatDType::BF16 => |x| bf16::from_f64(x).to_f64(),
            _ => to_f32,
        },
    }
}
