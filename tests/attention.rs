//! The attention suite: test bodies generic over the backend, instantiated per backend and dtype
//! at the bottom. Each case compares `burn_flash::attention` with an f64 reference of the values
//! on the device, and with Burn's `attention_fallback` in the same dtype by FlashAttention's
//! rule (at most 2× its error, plus a floor).

mod common;

use burn::tensor::{
    Bool, FloatDType, Int, Tensor, TensorData, TensorPrimitive, module, ops::AttentionModuleOptions,
};
use burn_flash::{
    AttentionKernel, BlockTable, FlashAttentionOptions, FlashBackend, HeadOperands, HeadTerms,
    KvCache, Rope, ScoreTerms, TileSchedule, VarlenBatch, attention, attention::AttentionDims,
    attention_plan, attention_plan_with, attention_varlen, attention_with_alibi,
    attention_with_heads, attention_with_lse,
};
use common::attention_ref::{EXACT, Rounding, at, naive, naive_tf32, row_sequence};
use common::*;

/// What one case's checks compare with: the exact output and log-sum-exp, and the naive
/// model's output in the call's dtype.
struct References {
    want: Vec<f64>,
    want_lse: Vec<f64>,
    naive: Vec<f64>,
    /// With TF32 products, per row the most a score can move when `Q·Kᵀ`'s operands are
    /// rounded to TF32 ([`Case::tf32_score_slack`]); empty otherwise.
    lse_slack: Vec<f64>,
}

/// Row-major f64 copies of one call's inputs, and the reference output.
struct Case {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    q_dims: [usize; 4],
    k_dims: [usize; 4],
    dv: usize,
    mask: Option<(Vec<bool>, [usize; 4])>,
    bias: Option<(Vec<f64>, [usize; 4])>,
    options: AttentionModuleOptions,
    /// The score of a masked key (`None`: masked keys leave the softmax).
    fill: Option<f64>,
    /// Quiet softmax.
    quiet: bool,
    /// Sliding window `(left, right)` around each row's bottom-right diagonal.
    window: Option<(usize, usize)>,
    /// ALiBi slopes, one per query head.
    slopes: Option<Vec<f64>>,
    /// Attention-sink logits, one per query head.
    sinks: Option<Vec<f64>>,
    /// A packed variable-length batch's cumulative query and key lengths (batch 1): each row
    /// sees its own sequence's keys, the rules aligned within the sequence.
    packed: Option<(Vec<usize>, Vec<usize>)>,
}

impl Case {
    /// f64 reference: scale → softcap → + bias → ALiBi (`−slope·|i + Sk − Sq − j|`) → mask
    /// (−inf, or the fill score) → causal and window (an explicit band: −inf) → softmax (zeros for a row without a finite score; quiet: `e^s / (1 + Σ e^s)`) → ·V;
    /// query head `h` reads key/value head `h / (Hq / Hkv)`. Packed sequences: the keys of
    /// other sequences −inf, and `Sq`, `Sk` those of the row's sequence, ending at its ends.
    ///  Returns the output and the row
    /// log-sum-exp of the scores (−inf for a row without one; quiet: `ln(1 + Σ e^s)`, 0).
    fn reference(&self) -> (Vec<f64>, Vec<f64>) {
        self.model(EXACT)
    }

    /// A hash of everything the references read: calls of one case through several kernels
    /// share one computation of them ([`Case::references`]).
    fn fingerprint(&self, dtype: FloatDType) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        let values = |h: &mut std::collections::hash_map::DefaultHasher, v: &[f64]| {
            v.iter().for_each(|x| x.to_bits().hash(h))
        };
        values(&mut h, &self.q);
        values(&mut h, &self.k);
        values(&mut h, &self.v);
        (self.q_dims, self.k_dims, self.dv, self.quiet, self.window).hash(&mut h);
        self.mask.hash(&mut h);
        if let Some((b, dims)) = &self.bias {
            values(&mut h, b);
            dims.hash(&mut h);
        }
        for v in [&self.slopes, &self.sinks].into_iter().flatten() {
            values(&mut h, v);
        }
        self.packed.hash(&mut h);
        format!("{:?} {:?} {dtype:?}", self.options, self.fill).hash(&mut h);
        h.finish()
    }

    /// The exact reference (output, log-sum-exp) and the naive model's output in `dtype` (with
    /// `tf32`, f32 with TF32 products: [`naive_tf32`]), computed once for consecutive calls of
    /// the same case (the last case's are kept).
    fn references(&self, dtype: FloatDType, tf32: bool) -> std::rc::Rc<References> {
        thread_local! {
            static LAST: std::cell::RefCell<Option<(u64, std::rc::Rc<References>)>> =
                const { std::cell::RefCell::new(None) };
        }
        let key = self.fingerprint(dtype) ^ u64::from(tf32);
        LAST.with_borrow_mut(|last| match last {
            Some((k, refs)) if *k == key => refs.clone(),
            _ => {
                let (want, want_lse) = self.reference();
                let model = if tf32 { naive_tf32() } else { naive(dtype) };
                let (naive, _) = self.model(model);
                let lse_slack = if tf32 {
                    self.tf32_score_slack()
                } else {
                    Vec::new()
                };
                let refs = std::rc::Rc::new(References {
                    want,
                    want_lse,
                    naive,
                    lse_slack,
                });
                *last = Some((key, refs.clone()));
                refs
            }
        })
    }

    /// Per row (`[B, Hq, Sq]`), the most any of its scores can move when the operands of
    /// `Q·Kᵀ` are rounded to TF32: `2⁻¹⁰ · scale · max_j Σ_c |q_c|·|k_jc|` (each rounded operand
    /// is off by at most 2⁻¹¹ of itself, so each product by 2⁻¹⁰ + 2⁻²²; softcap, bias, ALiBi and
    /// the mask do not widen it). The log-sum-exp, a softmax-weighted mean of the scores plus a
    /// constant, moves by at most as much.
    fn tf32_score_slack(&self) -> Vec<f64> {
        let [nb, hq, sq, d] = self.q_dims;
        let [_, hkv, sk, _] = self.k_dims;
        let scale = self.options.scale.unwrap_or(1.0 / (d as f64).sqrt());
        let mut slack = Vec::with_capacity(nb * hq * sq);
        for b in 0..nb {
            for h in 0..hq {
                let kh = h / (hq / hkv);
                for i in 0..sq {
                    let most = (0..sk)
                        .map(|j| {
                            (0..d)
                                .map(|c| {
                                    (self.q[at(self.q_dims, [b, h, i, c])]
                                        * self.k[at(self.k_dims, [b, kh, j, c])])
                                    .abs()
                                })
                                .sum::<f64>()
                        })
                        .fold(0.0, f64::max);
                    slack.push(1.01 * scale * most / 1024.0);
                }
            }
        }
        slack
    }

    /// [`Case::reference`] under rounding `r`: with [`naive`], what a naive implementation in
    /// the dtype computes (f32 sums, the scores, `P` and the output stored in the dtype).
    fn model(&self, r: Rounding) -> (Vec<f64>, Vec<f64>) {
        let [nb, hq, sq, d] = self.q_dims;
        let [_, hkv, sk, _] = self.k_dims;
        let dv = self.dv;
        let scale = self.options.scale.unwrap_or(1.0 / (d as f64).sqrt());
        let mut out = vec![0.0; nb * hq * sq * dv];
        let mut lse = vec![f64::NEG_INFINITY; nb * hq * sq];
        for b in 0..nb {
            for h in 0..hq {
                let kh = h / (hq / hkv);
                for i in 0..sq {
                    // The row's sequence: its keys `k0 .. k1`, its last query `q1 − 1`.
                    let (k0, k1, q1) = row_sequence(self.packed.as_ref(), i, sq, sk);
                    let mut s: Vec<f64> = (0..sk)
                        .map(|j| {
                            // Key `j`'s offset from the row's diagonal.
                            let off = j as i64 - (i as i64 + k1 as i64 - q1 as i64);
                            let outside = self
                                .window
                                .is_some_and(|(l, r)| off < -(l as i64) || off > r as i64);
                            if (self.options.is_causal && off > 0) || outside || j < k0 || j >= k1 {
                                // Hidden by the causal mask, the window or another sequence
                                // (after everything else: −inf whatever the score).
                                return f64::NEG_INFINITY;
                            }
                            let mut dot = 0.0;
                            for c in 0..d {
                                let qk = (r.operand)(self.q[at(self.q_dims, [b, h, i, c])])
                                    * (r.operand)(self.k[at(self.k_dims, [b, kh, j, c])]);
                                dot = (r.acc)(dot + qk);
                            }
                            let mut x = (r.store)((r.store)(dot) * scale);
                            if let Some(cap) = self.options.softcap {
                                x = (r.store)(cap * (r.store)((x / cap).tanh()));
                            }
                            if let Some((bias, bd)) = &self.bias {
                                x = (r.store)(x + bias[at(*bd, [b, h, i, j])]);
                            }
                            if let Some(slopes) = &self.slopes {
                                x = (r.store)(x - slopes[h] * off.abs() as f64);
                            }
                            if let Some((m, md)) = &self.mask
                                && m[at(*md, [b, h, i, j])]
                            {
                                x = self.fill.unwrap_or(f64::NEG_INFINITY);
                            }
                            x
                        })
                        .collect();
                    let m = s.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x));
                    let sink = self.sinks.as_ref().map(|sinks| sinks[h]);
                    if m == f64::NEG_INFINITY {
                        // No visible key: zeros, and the log of what the denominator holds.
                        let mut empty = f64::NEG_INFINITY;
                        if self.quiet {
                            empty = 0.0;
                        }
                        if let Some(sink) = sink {
                            empty = log_add_exp(empty, sink);
                        }
                        lse[(b * hq + h) * sq + i] = empty;
                        continue;
                    }
                    s.iter_mut().for_each(|x| *x = (*x - m).exp());
                    let mut l: f64 = s.iter().fold(0.0, |a, &x| (r.acc)(a + x));
                    lse[(b * hq + h) * sq + i] = m + l.ln();
                    if self.quiet {
                        // ln(1 + Σ e^s) = softplus(L), and the `1` of `1 + Σ e^s` against the
                        // maximum (infinite for scores far below 0: P = 0).
                        let big_l = m + l.ln();
                        lse[(b * hq + h) * sq + i] = big_l.max(0.0) + (-big_l.abs()).exp().ln_1p();
                        l = (r.acc)(l + (-m).exp());
                    }
                    if let Some(sink) = sink {
                        // The sink's `e^sink` against the maximum, in the denominator only.
                        let at = (b * hq + h) * sq + i;
                        lse[at] = log_add_exp(lse[at], sink);
                        l = (r.acc)(l + (sink - m).exp());
                    }
                    let v_dims = [nb, hkv, sk, dv];
                    // P = softmax, stored; then P·V with f32 sums, stored.
                    let p: Vec<f64> = s.iter().map(|&e| (r.store)(e / l)).collect();
                    for c in 0..dv {
                        let mut o = 0.0;
                        for (j, pj) in p.iter().enumerate() {
                            if *pj == 0.0 {
                                // Adds nothing (also under rounding): hidden keys.
                                continue;
                            }
                            o = (r.acc)(
                                o + (r.operand)(*pj)
                                    * (r.operand)(self.v[at(v_dims, [b, kh, j, c])]),
                            );
                        }
                        out[at([nb, hq, sq, dv], [b, h, i, c])] = (r.store)(o);
                    }
                }
            }
        }
        (out, lse)
    }
}

/// `ln(e^a + e^b)`, `b` for `a = −inf`.
fn log_add_exp(a: f64, b: f64) -> f64 {
    let (hi, lo) = (a.max(b), a.min(b));
    hi + (lo - hi).exp().ln_1p()
}

/// Burn's `attention_fallback` on the same inputs: it has no grouped heads and no broadcasting,
/// so keys and values are repeated per query head and masks and biases expanded first. With
/// `contiguous`, it reads fresh contiguous copies (no autodiff graph through them).
fn burn_fallback<B: burn::tensor::backend::Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
    bias: Option<Tensor<B, 4>>,
    options: AttentionModuleOptions,
    contiguous: bool,
) -> Tensor<B, 4> {
    let [nb, hq, sq, _] = q.dims();
    let [_, hkv, sk, _] = k.dims();
    let g = hq / hkv;
    let repeat = |t: Tensor<B, 4>| {
        let last = t.dims()[3];
        t.reshape([nb, hkv, 1, sk * last])
            .expand([nb, hkv, g, sk * last])
            .reshape([nb, hq, sk, last])
    };
    let full = [nb, hq, sq, sk];
    // Fresh contiguous copies: the naive reference measures the dtype's rounding, not Burn's
    // strided and expanded matmul paths (one of which failed to compile on CUDA f32 in
    // `tiled_kernel`: cubek-matmul's "Invalid vector size. Got 16 which should not be >8").
    let fresh = |t: Tensor<B, 4>| match contiguous {
        true => Tensor::<B, 4>::from_data(t.to_data(), &t.device()),
        false => t,
    };
    module::attention_fallback(
        fresh(q),
        fresh(repeat(k)),
        fresh(repeat(v)),
        mask.map(|m| match contiguous {
            true => {
                let device = m.device();
                Tensor::<B, 4, Bool>::from_data(m.expand(full).to_data(), &device)
            }
            false => m.expand(full),
        }),
        bias.map(|b| fresh(b.expand(full))),
        options,
    )
}

/// One call: inputs as given (any strides), an optional mask and bias; compares with the f64
/// reference and with Burn's fallback in the same dtype (keys and values repeated per query
/// head for it, masks and biases expanded).
#[allow(clippy::too_many_arguments)]
fn check<B: FlashBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
    bias: Option<Tensor<B, 4>>,
    options: AttentionModuleOptions,
    dtype: FloatDType,
    context: &str,
) {
    check_with(q, k, v, mask, bias, options.into(), dtype, context);
}

/// [`check`] with burn-flash's options (a forced kernel); returns the output.
#[allow(clippy::too_many_arguments)]
fn check_with<B: FlashBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
    bias: Option<Tensor<B, 4>>,
    flash_options: FlashAttentionOptions,
    dtype: FloatDType,
    context: &str,
) -> Vec<f64> {
    check_heads(
        q,
        k,
        v,
        mask,
        bias,
        HeadTerms::default(),
        flash_options,
        dtype,
        context,
    )
}

/// [`check_with`] with per-head terms (ALiBi slopes, sinks: `[Hq]`, f32).
#[allow(clippy::too_many_arguments)]
fn check_heads<B: FlashBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Option<Tensor<B, 4, Bool>>,
    bias: Option<Tensor<B, 4>>,
    heads: HeadTerms<B>,
    flash_options: FlashAttentionOptions,
    dtype: FloatDType,
    context: &str,
) -> Vec<f64> {
    let call = (q, k, v, mask, bias, heads);
    check_call(call, None, flash_options, dtype, context)
}

/// One call's tensors: `q`, `k`, `v`, the mask, the bias and the per-head terms.
type Call<B> = (
    Tensor<B, 4>,
    Tensor<B, 4>,
    Tensor<B, 4>,
    Option<Tensor<B, 4, Bool>>,
    Option<Tensor<B, 4>>,
    HeadTerms<B>,
);

/// [`check_heads`], or with `packed` the same tensors (one batch, `[1, H, T, D]`) as a packed
/// variable-length batch through [`attention_varlen`] (`[T, H, D]` views of them).
fn check_call<B: FlashBackend>(
    (q, k, v, mask, bias, heads): Call<B>,
    packed: Option<&VarlenBatch<B>>,
    flash_options: FlashAttentionOptions,
    dtype: FloatDType,
    context: &str,
) -> Vec<f64> {
    let options = flash_options.module;
    let device = q.device();
    eprintln!("case: {context}");
    let case = Case {
        q: read(q.clone()),
        k: read(k.clone()),
        v: read(v.clone()),
        q_dims: q.dims(),
        k_dims: k.dims(),
        dv: v.dims()[3],
        mask: mask.clone().map(|m| {
            let dims = m.dims();
            let values = read(m.int().float());
            (values.into_iter().map(|x| x != 0.0).collect(), dims)
        }),
        bias: bias.clone().map(|b| (read(b.clone()), b.dims())),
        options,
        fill: flash_options.masked_score,
        quiet: flash_options.quiet,
        window: flash_options.window,
        slopes: heads.alibi_slopes.clone().map(read),
        sinks: heads.sinks.clone().map(read),
        packed: packed.map(|p| (p.cu_seqlens_q().to_vec(), p.cu_seqlens_k().to_vec())),
    };
    let [nb, hq, sq, _] = case.q_dims;
    let sk = case.k_dims[2];
    let out_dims = [nb, hq, sq, case.dv];
    poison::<B, 4>(out_dims, dtype, &device);
    let options_run = forward_kernel(flash_options, dtype);
    let (out, lse) = match packed {
        None => attention_with_heads(
            q.clone(),
            k.clone(),
            v.clone(),
            mask.clone(),
            bias.clone(),
            heads,
            options_run,
        ),
        Some(batch) => {
            let tokens = |t: Tensor<B, 4>| t.swap_dims(1, 2).squeeze_dim::<3>(0);
            let (out, lse) = attention_varlen(
                tokens(q.clone()),
                tokens(k.clone()),
                tokens(v.clone()),
                batch,
                mask.clone(),
                bias.clone(),
                heads,
                options_run,
            );
            assert_eq!(
                out.dims(),
                [sq, hq, case.dv],
                "{context}: packed output shape"
            );
            assert_eq!(lse.dims(), [hq, sq], "{context}: packed lse shape");
            (
                out.unsqueeze_dim::<4>(0).swap_dims(1, 2),
                lse.unsqueeze_dim::<3>(0),
            )
        }
    };
    assert_eq!(out.dims(), out_dims, "{context}: output shape");
    assert_eq!(lse.dims(), [nb, hq, sq], "{context}: lse shape");
    sync::<B>(&device);
    let got = read(out);
    let got_lse = read(lse);
    // f32 with TF32 products where the plan takes them (`FlashAttentionOptions::tf32`, or the
    // run's `BURN_FLASH_TF32`): the naive model is TF32's.
    let dims = AttentionDims {
        batch: nb,
        heads_q: hq,
        heads_kv: case.k_dims[1],
        seq_q: sq,
        seq_k: sk,
        head_dim: case.q_dims[3],
        value_dim: case.dv,
    };
    let tf32 = tf32_forward::<B>(&device, dims, dtype, options_run);
    let refs = case.references(dtype, tf32);
    let ctx = format!(
        "{context}: q {:?} k {:?} {dtype:?} {options:?} window {:?} alibi {} sinks {} packed {:?}",
        case.q_dims,
        case.k_dims,
        case.window,
        case.slopes.is_some(),
        case.sinks.is_some(),
        case.packed
    );

    // The naive implementation in the dtype, as a CPU model (`naive`): Burn's fallback on the
    // device rounds in places a naive implementation need not (TF32 matmuls on CUDA) and not
    // in others (f32 softmax), so the 2×-naive rule measured against it could collapse to its
    // floor or widen.
    let _ = (q, k, v, mask, bias);
    // Softmax·V in f32 over Sk terms, scores rounded to the dtype: a few ulps of the largest
    // output in f32, one rounding in f16/bf16 (where the naive error is dominated by storage).
    let floor = match dtype {
        FloatDType::F32 => (sk as f64 / 16.0).max(4.0),
        _ => 1.0,
    };
    assert_within_naive(&got, &refs.naive, &refs.want, dtype, floor, &ctx);
    check_lse_within(&got_lse, &refs.want_lse, dtype, &refs.lse_slack, &ctx);
    got
}

/// The log-sum-exp: −inf exactly where the reference has no visible key; elsewhere within
/// `tol·(1 + |lse|)`. The fused kernels sum exact products of the stored inputs in f32 (a few
/// f32 ulps, plus the fast `exp`); the composed fallback rounds the scores to the dtype first,
/// so f16/bf16 get a few of their ulps.
fn check_lse(got: &[f64], want: &[f64], dtype: FloatDType, context: &str) {
    check_lse_within(got, want, dtype, &[], context);
}

/// [`check_lse`], each row also allowed `slack[row]` (where `slack` is not empty: TF32
/// products, [`Case::tf32_score_slack`]).
fn check_lse_within(got: &[f64], want: &[f64], dtype: FloatDType, slack: &[f64], context: &str) {
    let tol = match dtype {
        FloatDType::F32 => 2e-5,
        _ => 4.0 * eps(dtype),
    };
    for (n, (&g, &w)) in got.iter().zip(want).enumerate() {
        let extra = slack.get(n).copied().unwrap_or(0.0);
        if w == f64::NEG_INFINITY {
            assert!(
                g == f64::NEG_INFINITY,
                "{context}: lse[{n}] = {g}, expected −inf (no visible key)"
            );
        } else {
            assert!(
                (g - w).abs() <= tol * (1.0 + w.abs()) + extra,
                "{context}: lse[{n}] = {g}, expected {w} (tolerance {tol:e}·(1 + |lse|) + {extra:e})"
            );
        }
    }
}

/// Odd sizes, `Sq ≠ Sk`, `Dv ≠ D`, head dims 32…128, custom scale and softcap.
fn shapes_and_options<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let plain = AttentionModuleOptions::default();
    for (sq, sk, d, dv) in [
        (1, 17, 32, 32),
        (17, 97, 64, 48),
        (97, 17, 80, 96),
        (33, 128, 128, 64),
    ] {
        let q = rand4::<B>([2, 3, sq, d], 1.0, dtype, device);
        let k = rand4::<B>([2, 3, sk, d], 1.0, dtype, device);
        let v = rand4::<B>([2, 3, sk, dv], 1.0, dtype, device);
        check(
            q,
            k,
            v,
            None,
            None,
            plain,
            dtype,
            &format!("Sq {sq} Sk {sk} D {d} Dv {dv}"),
        );
    }
    let options = AttentionModuleOptions {
        scale: Some(0.3),
        softcap: Some(5.0),
        is_causal: false,
    };
    let q = rand4::<B>([1, 2, 19, 64], 3.0, dtype, device);
    let k = rand4::<B>([1, 2, 40, 64], 3.0, dtype, device);
    let v = rand4::<B>([1, 2, 40, 32], 1.0, dtype, device);
    check(q, k, v, None, None, options, dtype, "scale and softcap");
}

/// Causal masks, bottom-right aligned: `Sq < Sk` (every row sees keys), `Sq > Sk` (the first
/// `Sq − Sk` rows see nothing: zeros).
fn causal<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let options = AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    };
    for (sq, sk) in [(17, 17), (9, 40), (40, 9)] {
        let q = rand4::<B>([2, 2, sq, 32], 1.0, dtype, device);
        let k = rand4::<B>([2, 2, sk, 32], 1.0, dtype, device);
        let v = rand4::<B>([2, 2, sk, 32], 1.0, dtype, device);
        check(
            q,
            k,
            v,
            None,
            None,
            options,
            dtype,
            &format!("causal Sq {sq} Sk {sk}"),
        );
    }
}

/// Grouped-query heads (8:1 = multi-query, 4:1, 4:2) with a causal mask.
fn grouped_query_heads<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    for (hq, hkv, causal) in [(8, 1, false), (4, 1, true), (4, 2, false)] {
        let options = AttentionModuleOptions {
            is_causal: causal,
            ..Default::default()
        };
        let q = rand4::<B>([2, hq, 13, 32], 1.0, dtype, device);
        let k = rand4::<B>([2, hkv, 21, 32], 1.0, dtype, device);
        let v = rand4::<B>([2, hkv, 21, 40], 1.0, dtype, device);
        check(
            q,
            k,
            v,
            None,
            None,
            options,
            dtype,
            &format!("GQA {hq}:{hkv}"),
        );
    }
}

/// Padding masks `[B, 1, 1, Sk]`, full masks, ALiBi-like and random biases, all combined with
/// softcap and causal; fully masked rows give zeros.
fn masks_and_biases<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (nb, hq, sq, sk) = (2, 4, 11, 23);
    let q = rand4::<B>([nb, hq, sq, 32], 1.0, dtype, device);
    let k = rand4::<B>([nb, 2, sk, 32], 1.0, dtype, device);
    let v = rand4::<B>([nb, 2, sk, 16], 1.0, dtype, device);
    let plain = AttentionModuleOptions::default();
    // Batch b pads its last 5·b + 3 keys.
    let padding = bool_mask::<B, 4>([nb, 1, 1, sk], device, |[b, _, _, j]| j + 5 * b + 3 >= sk);
    let args = (q.clone(), k.clone(), v.clone());
    check(
        args.0,
        args.1,
        args.2,
        Some(padding.clone()),
        None,
        plain,
        dtype,
        "padding mask",
    );
    // Full mask with two fully masked rows per head.
    let full = bool_mask::<B, 4>([nb, hq, sq, sk], device, |[b, h, i, j]| {
        i == 3 || i == sq - 1 || (b + h + i + j) % 3 == 0
    });
    let (q2, k2, v2) = (q.clone(), k.clone(), v.clone());
    check(q2, k2, v2, Some(full), None, plain, dtype, "full mask");
    // ALiBi-like: slope per head times the distance.
    let alibi: Vec<f32> = (0..hq * sq * sk)
        .map(|n| {
            let (h, i, j) = (n / (sq * sk), (n / sk) % sq, n % sk);
            -0.25 * (h + 1) as f32 * (i as f32 - j as f32).abs()
        })
        .collect();
    let alibi = tensor::<B, 4>(alibi, [1, hq, sq, sk], dtype, device);
    let (q2, k2, v2) = (q.clone(), k.clone(), v.clone());
    check(q2, k2, v2, None, Some(alibi), plain, dtype, "ALiBi bias");
    let bias = rand4::<B>([nb, 1, sq, sk], 2.0, dtype, device);
    let options = AttentionModuleOptions {
        scale: Some(0.2),
        softcap: Some(4.0),
        is_causal: true,
    };
    check(
        q,
        k,
        v,
        Some(padding),
        Some(bias),
        options,
        dtype,
        "everything combined",
    );
}

/// Logits of ±50 and inputs read in place from `[B, S, H, D]` layouts.
fn large_logits_and_strided_inputs<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let options = AttentionModuleOptions {
        scale: Some(1.0),
        ..Default::default()
    };
    // q·k up to ±50 with D = 32 and entries up to 1.25.
    let q = rand4::<B>([1, 2, 15, 32], 1.25, dtype, device);
    let k = rand4::<B>([1, 2, 30, 32], 1.25, dtype, device);
    let v = rand4::<B>([1, 2, 30, 32], 1.0, dtype, device);
    check(q, k, v, None, None, options, dtype, "±50 logits");
    let q = rand4::<B>([2, 19, 4, 64], 1.0, dtype, device).swap_dims(1, 2);
    let k = rand4::<B>([2, 27, 2, 64], 1.0, dtype, device).swap_dims(1, 2);
    let v = rand4::<B>([2, 27, 2, 48], 1.0, dtype, device).swap_dims(1, 2);
    let plain = AttentionModuleOptions::default();
    check(q, k, v, None, None, plain, dtype, "[B, S, H, D] inputs");
}

/// The register-tiled plain-unit kernel, forced (the plan's choice on plain units for outputs
/// of at least 65 × 65): row blocks that cross query heads (GQA 4:2), two column tiles of `Dv`
/// with the last partial, causal with `Sq > Sk` (rows that see nothing), a padding mask, fully
/// masked rows, a random bias, softcap and scale, head dims 32…256 and `D ≠ Dv`,
/// `[B, S, H, D]` inputs with logits of ±20, and partial 16-key steps everywhere. Where it
/// cannot run (units or shared memory), the plan says so and the default on plain units is the
/// small-tile kernel; where the device has cooperative matrices (and no `mma`), 16-bit calls
/// default to those.
fn tiled_kernel<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let dims = AttentionDims {
        batch: 2,
        heads_q: 4,
        heads_kv: 2,
        seq_q: 130,
        seq_k: 97,
        head_dim: 80,
        value_dim: 200,
    };
    let forced = |causal: bool| FlashAttentionOptions {
        kernel: Some(AttentionKernel::Tiled),
        module: AttentionModuleOptions {
            is_causal: causal,
            ..Default::default()
        },
        ..Default::default()
    };
    let Some(plan) = attention_plan::<B>(device, dims, dtype.into(), forced(false)) else {
        // No fused kernels (NdArray, Autodiff).
        return;
    };
    let default = attention_plan::<B>(device, dims, dtype.into(), Default::default())
        .and_then(Result::ok)
        .expect("default plan");
    let plan = match plan {
        Ok(plan) => plan,
        Err(err) => {
            assert!(err.to_string().contains("Tiled is not available"), "{err}");
            assert_eq!(default.kernel, AttentionKernel::Units, "{default:?}");
            return;
        }
    };
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    // Plain units take the tiled kernel; a device with cooperative matrices and no `mma`
    // (Vulkan through SPIR-V) takes those for 16-bit types, CUDA for f32 with TF32.
    let cooperative = default.kernel == AttentionKernel::CooperativeMatrix;
    assert!(
        !cooperative || (!cuda && dtype != FloatDType::F32) || tf32_by_default(device, dtype),
        "{default:?}"
    );
    if (!cuda || dtype == FloatDType::F32) && !cooperative {
        assert_eq!(default.kernel, AttentionKernel::Tiled, "{default:?}");
    }
    // Dv 200: 2 column tiles of 128; 2·4·130 rows over 2 kv heads: 260 rows each, 3 blocks of
    // 128; 2·2 (batch, kv head) pairs.
    assert_eq!(
        (
            plan.config.block_q,
            plan.config.block_k,
            plan.config.value_dim,
            plan.cubes
        ),
        (128, 16, 128, (2, 3, 4)),
        "{plan:?}"
    );

    let q = rand4::<B>([2, 4, 130, 80], 1.0, dtype, device);
    let k = rand4::<B>([2, 2, 97, 80], 1.0, dtype, device);
    let v = rand4::<B>([2, 2, 97, 200], 1.0, dtype, device);
    check_with(
        q,
        k,
        v,
        None,
        None,
        forced(true),
        dtype,
        "tiled, GQA, causal Sq > Sk",
    );

    // A padding mask (the last 20 keys of batch 1), fully masked rows (query 5 of every head of
    // batch 0) through a full mask, a random bias, softcap and scale.
    let (sq, sk) = (70, 150);
    let q = rand4::<B>([2, 2, sq, 64], 2.0, dtype, device);
    let k = rand4::<B>([2, 2, sk, 64], 2.0, dtype, device);
    let v = rand4::<B>([2, 2, sk, 96], 1.0, dtype, device);
    let mask = bool_mask::<B, 4>([2, 2, sq, sk], device, |[b, _, i, j]| {
        (b == 1 && j >= sk - 20) || (b == 0 && i == 5) || (i + j) % 11 == 0
    });
    let bias = rand4::<B>([2, 1, sq, sk], 2.0, dtype, device);
    let mut options = forced(false);
    options.module.scale = Some(0.2);
    options.module.softcap = Some(4.0);
    check_with(
        q,
        k,
        v,
        Some(mask),
        Some(bias),
        options,
        dtype,
        "tiled, mask, masked rows, bias, softcap",
    );

    // Every head dim of the issue's list, and D ≠ Dv.
    for (n, (d, dv)) in [(32, 32), (96, 96), (192, 192), (256, 256), (40, 24)]
        .into_iter()
        .enumerate()
    {
        let q = rand4::<B>([1, 2, 70, d], 1.0, dtype, device);
        let k = rand4::<B>([1, 2, 45, d], 1.0, dtype, device);
        let v = rand4::<B>([1, 2, 45, dv], 1.0, dtype, device);
        let options = forced(n % 2 == 1);
        check_with(
            q,
            k,
            v,
            None,
            None,
            options,
            dtype,
            &format!("tiled, D {d} Dv {dv}"),
        );
    }

    // `[B, S, H, D]` inputs read in place, logits of ±20 (D = Dv = 128).
    let q = rand4::<B>([1, 129, 2, 128], 1.1, dtype, device).swap_dims(1, 2);
    let k = rand4::<B>([1, 129, 2, 128], 1.1, dtype, device).swap_dims(1, 2);
    let v = rand4::<B>([1, 129, 2, 128], 1.0, dtype, device).swap_dims(1, 2);
    let mut options = forced(false);
    options.module.scale = Some(1.0);
    check_with(
        q,
        k,
        v,
        None,
        None,
        options,
        dtype,
        "tiled, [B, S, H, D], large logits",
    );
    sync::<B>(device);
}

/// f32 with TF32 allowed ([`FlashAttentionOptions::tf32`]): on CUDA (sm_80+) the plan runs
/// the cooperative-matrix forward on TF32 fragments (`wmma` m16n16k8, no kernel forced), and
/// the output stays within twice the error of a naive TF32 implementation (every product's
/// operands rounded to TF32, f32 sums; `check_call` takes that model where the plan says TF32)
/// — plain, causal with GQA, a mask, bias and softcap, D 128 over several key steps, `D ≠ Dv`;
/// elsewhere (wgpu, NdArray) and for 16-bit calls the option changes nothing: the same plan as
/// without it, the same bound.
fn tf32_products<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let dims = AttentionDims {
        batch: 2,
        heads_q: 4,
        heads_kv: 2,
        seq_q: 70,
        seq_k: 90,
        head_dim: 64,
        value_dim: 48,
    };
    let tf32 = |module: AttentionModuleOptions| FlashAttentionOptions {
        tf32: Some(true),
        module,
        ..Default::default()
    };
    let Some(plan) = attention_plan::<B>(device, dims, dtype.into(), tf32(Default::default()))
    else {
        return;
    };
    let plan = plan.expect("plan");
    let exact_options = FlashAttentionOptions {
        tf32: Some(false),
        ..Default::default()
    };
    let exact = attention_plan::<B>(device, dims, dtype.into(), exact_options)
        .expect("a planner")
        .expect("plan");
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    if cuda && dtype == FloatDType::F32 {
        assert_eq!(plan.kernel, AttentionKernel::CooperativeMatrix, "{plan:?}");
        assert!(plan.config.tf32, "{plan:?}");
        assert!(!exact.config.tf32, "{exact:?}");
    } else {
        assert!(!plan.config.tf32, "{plan:?}");
        assert_eq!(plan.kernel, exact.kernel);
    }
    let [b, hq, hkv, sq, sk] = [2, 4, 2, 70, 90];
    let q = rand4::<B>([b, hq, sq, 64], 1.0, dtype, device);
    let k = rand4::<B>([b, hkv, sk, 64], 1.0, dtype, device);
    let v = rand4::<B>([b, hkv, sk, 48], 1.0, dtype, device);
    check_with(
        q.clone(),
        k.clone(),
        v.clone(),
        None,
        None,
        tf32(Default::default()),
        dtype,
        "TF32 plain, D 64, Dv 48",
    );
    let causal = AttentionModuleOptions {
        is_causal: true,
        scale: Some(0.3),
        softcap: Some(5.0),
    };
    let mask = bool_mask::<B, 4>([b, 1, 1, sk], device, |[b, _, _, j]| j + 7 * b + 5 >= 90);
    let bias = rand4::<B>([1, hq, sq, sk], 1.0, dtype, device);
    check_with(
        q,
        k,
        v,
        Some(mask),
        Some(bias),
        tf32(causal),
        dtype,
        "TF32 causal, GQA, mask, bias, softcap",
    );
    let q = rand4::<B>([1, 2, 130, 128], 1.0, dtype, device);
    let k = rand4::<B>([1, 2, 150, 128], 1.0, dtype, device);
    let v = rand4::<B>([1, 2, 150, 128], 1.0, dtype, device);
    check_with(
        q,
        k,
        v,
        None,
        None,
        tf32(AttentionModuleOptions {
            is_causal: true,
            ..Default::default()
        }),
        dtype,
        "TF32 causal, D 128, several steps",
    );
}

/// The cooperative-matrix forward, forced (the plan's choice for f16/bf16 on Vulkan through
/// SPIR-V; offered on CUDA as `wmma`): row blocks that cross query heads (GQA 4:2, 8:1),
/// causal with `Sq > Sk` and `Sq < Sk`, a padding mask, fully masked rows, a random bias,
/// softcap and scale, head dims 16…256 and `D ≠ Dv` (odd ones: `D` 40, `Dv` 24, rounded up to
/// the fragment), `[B, S, H, D]` inputs with logits of ±20, scores that grow along the keys
/// (the output fragments' rescale), 16 keys per step, and partial steps everywhere. Where the
/// device offers no cooperative matrix for the dtype (f32, WGSL, lavapipe), forcing it is
/// refused before any launch.
fn cooperative_matrix_kernel<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let dims = AttentionDims {
        batch: 2,
        heads_q: 4,
        heads_kv: 2,
        seq_q: 130,
        seq_k: 97,
        head_dim: 80,
        value_dim: 200,
    };
    let forced = |causal: bool| FlashAttentionOptions {
        kernel: Some(AttentionKernel::CooperativeMatrix),
        module: AttentionModuleOptions {
            is_causal: causal,
            ..Default::default()
        },
        ..Default::default()
    };
    let Some(plan) = attention_plan::<B>(device, dims, dtype.into(), forced(false)) else {
        // No fused kernels (NdArray, Autodiff).
        return;
    };
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    let plan = match plan {
        Ok(plan) => plan,
        Err(err) => {
            assert!(
                !cuda || dtype == FloatDType::F32,
                "CUDA offers wmma for {dtype:?}: {err}"
            );
            assert!(
                err.to_string()
                    .contains("CooperativeMatrix is not available"),
                "{err}"
            );
            let q = rand4::<B>([1, 1, 16, 16], 1.0, dtype, device);
            let msg = panic_message(|| {
                attention_with_lse(q.clone(), q.clone(), q, None, None, forced(false));
            });
            assert!(msg.contains("no cooperative matrix"), "{msg}");
            return;
        }
    };
    assert!(
        dtype != FloatDType::F32 || tf32_by_default(device, dtype),
        "exact f32 never runs on the matrix units"
    );
    // 128 rows per cube (64 where shared memory is short) over 2·4·130 / 2 = 260 rows per kv
    // head; one column tile holds all of Dv (rounded up to the fragment); 2·2 (batch, kv head)
    // pairs.
    let block_q = plan.config.block_q as usize;
    assert!([64, 128].contains(&block_q), "{plan:?}");
    assert_eq!(
        (plan.config.block_k, plan.config.value_dim, plan.cubes),
        (32, 208, (1, 260usize.div_ceil(block_q), 4)),
        "{plan:?}"
    );

    let q = rand4::<B>([2, 4, 130, 80], 1.0, dtype, device);
    let k = rand4::<B>([2, 2, 97, 80], 1.0, dtype, device);
    let v = rand4::<B>([2, 2, 97, 200], 1.0, dtype, device);
    let label = "cooperative, GQA 4:2, causal Sq > Sk, Dv 200";
    check_with(q, k, v, None, None, forced(true), dtype, label);
    let q = rand4::<B>([1, 8, 9, 64], 1.0, dtype, device);
    let k = rand4::<B>([1, 1, 75, 64], 1.0, dtype, device);
    let v = rand4::<B>([1, 1, 75, 64], 1.0, dtype, device);
    let label = "cooperative, GQA 8:1, causal Sq < Sk";
    check_with(q, k, v, None, None, forced(true), dtype, label);

    // A padding mask (the last 20 keys of batch 1), fully masked rows (query 5 of every head of
    // batch 0) through a full mask, a random bias, softcap and scale.
    let (sq, sk) = (70, 150);
    let q = rand4::<B>([2, 2, sq, 64], 2.0, dtype, device);
    let k = rand4::<B>([2, 2, sk, 64], 2.0, dtype, device);
    let v = rand4::<B>([2, 2, sk, 96], 1.0, dtype, device);
    let mask = bool_mask::<B, 4>([2, 2, sq, sk], device, |[b, _, i, j]| {
        (b == 1 && j >= sk - 20) || (b == 0 && i == 5) || (i + j) % 11 == 0
    });
    let bias = rand4::<B>([2, 1, sq, sk], 2.0, dtype, device);
    let mut options = forced(false);
    options.module.scale = Some(0.2);
    options.module.softcap = Some(4.0);
    let label = "cooperative, mask, masked rows, bias, softcap";
    check_with(q, k, v, Some(mask), Some(bias), options, dtype, label);

    // Head dims 16…256, D ≠ Dv, odd ones; 16 keys per step on every other one.
    for (n, (d, dv)) in [
        (16, 16),
        (32, 32),
        (96, 96),
        (192, 192),
        (256, 256),
        (40, 24),
    ]
    .into_iter()
    .enumerate()
    {
        let q = rand4::<B>([1, 2, 70, d], 1.0, dtype, device);
        let k = rand4::<B>([1, 2, 45, d], 1.0, dtype, device);
        let v = rand4::<B>([1, 2, 45, dv], 1.0, dtype, device);
        let mut options = forced(n % 2 == 1);
        options.block_k = (n % 2 == 0).then_some(16);
        let label = format!("cooperative, D {d} Dv {dv}, block_k {:?}", options.block_k);
        check_with(q, k, v, None, None, options, dtype, &label);
    }

    // Scores that grow along the keys (key j scaled by 1 + j/8: scores about 2 + j/4, up to
    // ~42): each row's maximum rises by about 8 per 32-key step, past the lazy rescale's
    // margin, so the output fragments are rescaled through shared memory again and again.
    let sk = 160;
    let ramp: Vec<f32> = (0..sk).map(|j| 1.0 + j as f32 / 8.0).collect();
    let ramp = tensor::<B, 4>(ramp, [1, 1, sk, 1], dtype, device);
    let q = rand4::<B>([2, 2, 40, 64], 0.5, dtype, device) + 0.25;
    let k = (rand4::<B>([2, 2, sk, 64], 0.5, dtype, device) + 0.25) * ramp;
    let v = rand4::<B>([2, 2, sk, 64], 1.0, dtype, device);
    let mut options = forced(false);
    options.module.scale = Some(0.5);
    let label = "cooperative, scores growing along the keys (rescales)";
    check_with(q, k, v, None, None, options, dtype, label);

    // `[B, S, H, D]` inputs read in place, logits of ±20 (D = Dv = 128).
    let q = rand4::<B>([1, 129, 2, 128], 1.1, dtype, device).swap_dims(1, 2);
    let k = rand4::<B>([1, 129, 2, 128], 1.1, dtype, device).swap_dims(1, 2);
    let v = rand4::<B>([1, 129, 2, 128], 1.0, dtype, device).swap_dims(1, 2);
    let mut options = forced(false);
    options.module.scale = Some(1.0);
    let label = "cooperative, [B, S, H, D], large logits";
    check_with(q, k, v, None, None, options, dtype, label);
    sync::<B>(device);
}

/// Gradients of every input through `Autodiff` (the composition's backward, with the fused
/// `softmax(S)·V` backward in it) against Burn's autodiff of its own fallback in the same dtype,
/// GQA 4:2 with everything on: within `64·ε` of each gradient's largest value in f32 (both are
/// f32 sums of a few hundred terms; `16·2^-11` where Burn's f32 matmul is TF32-class), `8ε` in
/// f16/bf16.
fn gradients_match_burns_fallback<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    type A<B> = burn::backend::Autodiff<B>;
    let (nb, hq, hkv, sq, sk, d, dv) = (2, 4, 2, 9, 21, 32, 16);
    let options = AttentionModuleOptions {
        scale: Some(0.3),
        softcap: Some(6.0),
        is_causal: true,
    };
    let q = rand4::<A<B>>([nb, hq, sq, d], 1.0, dtype, device).require_grad();
    let k = rand4::<A<B>>([nb, hkv, sk, d], 1.0, dtype, device).require_grad();
    let v = rand4::<A<B>>([nb, hkv, sk, dv], 1.0, dtype, device).require_grad();
    let bias = rand4::<A<B>>([1, hq, sq, sk], 1.0, dtype, device).require_grad();
    let mask = bool_mask::<A<B>, 4>([nb, 1, 1, sk], device, |[b, _, _, j]| j + 4 * b + 2 >= sk);
    let w = rand4::<A<B>>([nb, hq, sq, dv], 1.0, dtype, device);
    let inputs = [&q, &k, &v, &bias];

    let out = attention(
        q.clone(),
        k.clone(),
        v.clone(),
        Some(mask.clone()),
        Some(bias.clone()),
        options,
    );
    let grads = (out * w.clone()).sum().backward();
    let got: Vec<Vec<f64>> = inputs
        .iter()
        .map(|t| read(t.grad(&grads).expect("grad")))
        .collect();

    let naive = burn_fallback(
        q.clone(),
        k.clone(),
        v.clone(),
        Some(mask),
        Some(bias.clone()),
        options,
        false,
    );
    let grads = (naive * w).sum().backward();
    let want: Vec<Vec<f64>> = inputs
        .iter()
        .map(|t| read(t.grad(&grads).expect("grad")))
        .collect();
    sync::<B>(device);
    // Both sides run Burn's matmul for Q·Kᵀ and the score gradients; on CUDA its f32 matmul
    // rounds operands to TF32 (2^-11), so f32 there is held to TF32's bound.
    let rel = match dtype {
        FloatDType::F32 if f32_matmul_is_tf32::<B>(device) => 16.0 * 2f64.powi(-11),
        FloatDType::F32 => 64.0 * eps(dtype),
        _ => 8.0 * eps(dtype),
    };
    for ((name, got), want) in ["dq", "dk", "dv", "dbias"].iter().zip(&got).zip(&want) {
        let scale = max_abs(want);
        let err = max_err(got, want);
        assert!(
            err <= rel * scale,
            "{name} {dtype:?}: error {err:e} against Burn's fallback > {rel:e} × max |grad| {scale:e}"
        );
    }
}

/// Every head dim of the issue's list (`Dv = D`, and one `Dv ≠ D`), causal and not; a head
/// dim above [`burn_flash::attention::MAX_HEAD_DIM`] is refused before any launch where the
/// fused kernels run (the composed fallback takes any).
fn head_dims<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    for (d, dv, causal) in [
        (32, 32, false),
        (64, 64, true),
        (80, 80, false),
        (96, 96, true),
        (128, 128, false),
        (192, 192, true),
        (256, 256, false),
        (192, 64, false),
        (40, 24, true),
    ] {
        let options = AttentionModuleOptions {
            is_causal: causal,
            ..Default::default()
        };
        let q = rand4::<B>([1, 2, 37, d], 1.0, dtype, device);
        let k = rand4::<B>([1, 2, 70, d], 1.0, dtype, device);
        let v = rand4::<B>([1, 2, 70, dv], 1.0, dtype, device);
        check(
            q,
            k,
            v,
            None,
            None,
            options,
            dtype,
            &format!("D {d} Dv {dv}"),
        );
    }
    let d = burn_flash::attention::MAX_HEAD_DIM + 32;
    let dims = dense_dims([1, 1, 1, 4, 4, d]);
    let fused = attention_plan::<B>(device, dims, dtype.into(), Default::default()).is_some();
    if fused {
        let q = rand4::<B>([1, 1, 4, d], 1.0, dtype, device);
        let k = rand4::<B>([1, 1, 4, d], 1.0, dtype, device);
        let v = rand4::<B>([1, 1, 4, d], 1.0, dtype, device);
        let msg = panic_message(|| {
            attention(q, k, v, None, None, Default::default());
        });
        assert!(
            msg.contains(&format!("head dims D = {d}, Dv = {d} are not supported")),
            "{msg}"
        );
    }
    sync::<B>(device);
}

/// Query and key lengths from the issue's list {1, 17, 97, 128, 1025, 1500}, paired so that
/// each appears on both sides, causal for the long pairs (bottom-right aligned).
fn sequence_lengths<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    for (sq, sk, causal) in [
        (1, 1500, false),
        (1500, 1, false),
        (17, 1025, true),
        (1025, 17, false),
        (97, 128, true),
        (128, 97, true),
        (1025, 1500, true),
        (1500, 1025, true),
        (128, 128, false),
    ] {
        let options = AttentionModuleOptions {
            is_causal: causal,
            ..Default::default()
        };
        let q = rand4::<B>([1, 1, sq, 64], 1.0, dtype, device);
        let k = rand4::<B>([1, 1, sk, 64], 1.0, dtype, device);
        let v = rand4::<B>([1, 1, sk, 64], 1.0, dtype, device);
        check(
            q,
            k,
            v,
            None,
            None,
            options,
            dtype,
            &format!("Sq {sq} Sk {sk} causal {causal}"),
        );
    }
}

/// Empty batch, heads or positions give empty outputs; no keys gives zeros and lse −inf.
fn empty_dims<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    for (nb, sq, sk) in [(0, 5, 7), (2, 0, 7)] {
        let q = rand4::<B>([nb, 2, sq, 32], 1.0, dtype, device);
        let k = rand4::<B>([nb, 1, sk, 32], 1.0, dtype, device);
        let v = rand4::<B>([nb, 1, sk, 16], 1.0, dtype, device);
        let out = attention(q, k, v, None, None, Default::default());
        assert_eq!(out.dims(), [nb, 2, sq, 16]);
    }
    // No keys (Burn's fallback cannot reshape an empty key axis: checked directly).
    let q = rand4::<B>([1, 2, 5, 32], 1.0, dtype, device);
    let k = rand4::<B>([1, 2, 0, 32], 1.0, dtype, device);
    let v = rand4::<B>([1, 2, 0, 16], 1.0, dtype, device);
    poison::<B, 4>([1, 2, 5, 16], dtype, device);
    let (out, lse) = attention_with_lse(q, k, v, None, None, Default::default());
    assert!(
        read(out).iter().all(|&x| x == 0.0),
        "no keys: output not all zeros"
    );
    assert!(
        read(lse).iter().all(|&x| x == f64::NEG_INFINITY),
        "no keys: lse not all −inf"
    );
}

/// The plan names the kernel the heuristic picks, and each kernel that can run, forced, gives
/// the reference's values (and, where two ran, not the same bits: two kernels did run).
/// The `mma` kernel for f16/bf16 on CUDA with 16-byte aligned rows, cooperative matrices for
/// f16/bf16 where the device offers them and has no `mma` (Vulkan through SPIR-V), plain units
/// elsewhere; a forced matrix-unit kernel where it cannot run is refused before any launch,
/// naming the reason.
fn planned_kernels<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let dims = |d: usize| dense_dims([2, 4, 2, 70, 90, d]);
    let plan = |d: usize, kernel: Option<AttentionKernel>| {
        let options = FlashAttentionOptions {
            kernel,
            ..Default::default()
        };
        attention_plan::<B>(device, dims(d), dtype.into(), options)
    };
    let Some(default) = plan(64, None) else {
        // No fused kernels (NdArray, Autodiff): the composed fallback; nothing to plan.
        return;
    };
    let default = default.expect("default plan");
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    let matrix_units = cuda && dtype != FloatDType::F32;
    // f32 with TF32 by the run's plan inputs (`BURN_FLASH_TF32=1`): cooperative matrices.
    let tf32 = tf32_by_default(device, dtype);
    // Cooperative matrices: offered on CUDA (wmma) for 16-bit types (and f32 with TF32), and
    // wherever the device registers them (NVIDIA's Vulkan driver through SPIR-V; never WGSL or
    // lavapipe).
    let cooperative = plan(64, Some(AttentionKernel::CooperativeMatrix))
        .unwrap()
        .is_ok();
    if cuda {
        assert_eq!(cooperative, dtype != FloatDType::F32 || tf32);
    }
    if dtype == FloatDType::F32 && !tf32 {
        assert!(!cooperative, "exact f32 never runs on the matrix units");
    }
    // The Hopper forward: planned on sm_90 GPUs for 16-bit calls it takes, refused elsewhere.
    let hopper = match plan(64, Some(AttentionKernel::Hopper)).unwrap() {
        Ok(_) => true,
        Err(err) => {
            let reason = err.to_string();
            assert!(
                reason.contains("not a Hopper GPU")
                    || reason.contains("takes f16 and bf16")
                    || reason.contains("switched off"),
                "{dtype:?}: {reason}"
            );
            false
        }
    };
    assert!(!hopper || matrix_units, "Hopper only for 16-bit CUDA calls");
    let expected = if hopper {
        AttentionKernel::Hopper
    } else if matrix_units {
        AttentionKernel::MatrixUnits
    } else if cooperative {
        AttentionKernel::CooperativeMatrix
    } else {
        AttentionKernel::Units
    };
    assert_eq!(default.kernel, expected, "{dtype:?} D 64: {default:?}");
    // D = 36: rows not 16-byte aligned → plain units on CUDA; cooperative matrices, which read
    // through any strides, elsewhere.
    let unaligned = if cooperative && (!cuda || tf32) {
        AttentionKernel::CooperativeMatrix
    } else {
        AttentionKernel::Units
    };
    assert_eq!(plan(36, None).unwrap().unwrap().kernel, unaligned);
    // A plan without score terms is `attention_plan`'s; with a mask or a bias the plan keeps
    // the `mma` kernel on Hopper (it reads them per element), unless the run forces Hopper.
    let with = |terms| {
        attention_plan_with::<B>(device, dims(64), dtype.into(), Default::default(), terms)
            .unwrap()
            .unwrap()
    };
    assert_eq!(with(ScoreTerms::default()).kernel, default.kernel);
    let masked = with(ScoreTerms {
        mask: true,
        ..Default::default()
    });
    assert!(masked.config.rules.mask);
    // The plan inputs are options: the planner checks them (an out-of-range decoding schedule
    // is refused on every device), and a call's own win over the process defaults.
    let bad = FlashAttentionOptions {
        decode: Some(burn_flash::DecodeSchedule {
            keys_per_step: 5,
            cubes_per_sm: 16,
        }),
        ..Default::default()
    };
    let refused =
        attention_plan_with::<B>(device, dims(64), dtype.into(), bad, ScoreTerms::default())
            .unwrap()
            .unwrap_err()
            .to_string();
    assert!(
        refused.contains("keys_per_step must be 4, 8 or 16"),
        "{refused}"
    );
    if hopper {
        let off = FlashAttentionOptions {
            hopper: Some(burn_flash::HopperUse::Off),
            ..Default::default()
        };
        let kernel =
            attention_plan_with::<B>(device, dims(64), dtype.into(), off, ScoreTerms::default())
                .unwrap()
                .unwrap()
                .kernel;
        assert_eq!(kernel, AttentionKernel::MatrixUnits, "HopperUse::Off");
    }
    if hopper {
        let always = common::plan_inputs().hopper == burn_flash::HopperUse::Always;
        let want = if always {
            AttentionKernel::Hopper
        } else {
            AttentionKernel::MatrixUnits
        };
        assert_eq!(masked.kernel, want);
        // A bias whose rows TMA loads as tiles (`Sk` a multiple of 8) takes the Hopper kernel
        // and two slots of shared memory beside `K`; one read per element keeps the `mma`
        // kernel unless the run forces Hopper.
        let biased_rows = |seq_k, kernel, bias_rows_broadcast| {
            let dims = AttentionDims { seq_k, ..dims(64) };
            let terms = ScoreTerms {
                bias: true,
                bias_rows_broadcast,
                ..Default::default()
            };
            let options = FlashAttentionOptions {
                kernel,
                ..Default::default()
            };
            attention_plan_with::<B>(device, dims, dtype.into(), options, terms)
                .unwrap()
                .unwrap()
        };
        let biased = |seq_k, kernel| biased_rows(seq_k, kernel, false);
        // A bias broadcast along the rows (`[·, ·, 1, Sk]`) is loaded one row per step where
        // TMA can (`Sk` a multiple of 8), else read per element.
        assert_eq!(
            biased_rows(328, None, true).kernel,
            AttentionKernel::Hopper,
            "row bias by TMA"
        );
        assert_eq!(
            biased_rows(330, None, true).kernel,
            want,
            "row bias per element"
        );
        assert_eq!(
            biased(328, None).kernel,
            AttentionKernel::Hopper,
            "bias as tiles"
        );
        assert_eq!(biased(330, None).kernel, want, "bias read per element");
        let (tiles, per_element) = (
            biased(328, Some(AttentionKernel::Hopper)),
            biased(330, Some(AttentionKernel::Hopper)),
        );
        assert!(tiles.config.rules.bias && per_element.config.rules.bias);
        // D 64: 192-row blocks, 2 slots of 192 rows × 128 keys × 2 bytes.
        assert_eq!(tiles.shared_bytes, per_element.shared_bytes + 2 * 192 * 256);
        // D 64 on Hopper: three consumer warpgroups of 64 rows and the producer.
        assert_eq!((default.config.block_q, default.units), (192, 512));
        // Head dims over 128 on Hopper: rounded up to 256, 64 keys per step.
        for d in [192, 256] {
            let wide = plan(d, None).unwrap().unwrap();
            let c = wide.config;
            assert_eq!(wide.kernel, AttentionKernel::Hopper, "D {d}");
            assert_eq!(
                (c.head_dim, c.value_dim, c.block_k),
                (256, 256, 64),
                "D {d}"
            );
        }
    }
    let mut outputs = Vec::new();
    for kernel in [
        AttentionKernel::Units,
        AttentionKernel::MatrixUnits,
        AttentionKernel::CooperativeMatrix,
        AttentionKernel::Hopper,
    ] {
        let q = rand4::<B>([2, 4, 70, 64], 1.0, dtype, device);
        let k = rand4::<B>([2, 2, 90, 64], 1.0, dtype, device);
        let v = rand4::<B>([2, 2, 90, 64], 1.0, dtype, device);
        let options = FlashAttentionOptions {
            kernel: Some(kernel),
            module: AttentionModuleOptions {
                is_causal: true,
                ..Default::default()
            },
            ..Default::default()
        };
        match plan(64, Some(kernel)).unwrap() {
            Ok(p) => {
                assert_eq!(p.kernel, kernel);
                let got = check_with(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    None,
                    None,
                    options,
                    dtype,
                    &format!("forced {kernel:?}"),
                );
                outputs.push((got, (q, k, v)));
            }
            Err(err) => {
                assert!(
                    (kernel == AttentionKernel::MatrixUnits && !matrix_units)
                        || (kernel == AttentionKernel::CooperativeMatrix && !cooperative)
                        || (kernel == AttentionKernel::Hopper && !hopper),
                    "{kernel:?} refused on {device:?} {dtype:?}: {err}"
                );
                let msg = panic_message(|| {
                    attention_with_lse(q, k, v, None, None, options);
                });
                assert!(
                    msg.contains(&format!("{kernel:?} is not available")),
                    "{msg}"
                );
            }
        }
    }
    assert_eq!(
        outputs.len(),
        1 + matrix_units as usize + cooperative as usize + hopper as usize
    );
    for (_, inputs) in outputs.iter().skip(1) {
        // The same inputs through plain units and a matrix-unit kernel: their roundings
        // differ somewhere.
        let (q, k, v) = inputs.clone();
        let run = |kernel| {
            let options = FlashAttentionOptions {
                kernel: Some(kernel),
                module: AttentionModuleOptions {
                    is_causal: true,
                    ..Default::default()
                },
                ..Default::default()
            };
            read(attention_with_lse(q.clone(), k.clone(), v.clone(), None, None, options).0)
        };
        let a = run(AttentionKernel::Units);
        for kernel in [
            AttentionKernel::MatrixUnits,
            AttentionKernel::CooperativeMatrix,
            AttentionKernel::Hopper,
        ] {
            if plan(64, Some(kernel)).unwrap().is_ok() {
                assert!(
                    a != run(kernel),
                    "plain units and {kernel:?} gave identical bits: did both run?"
                );
            }
        }
    }
    sync::<B>(device);
}

/// Every forward kernel the device runs for `dims` under `options` (each forced), or `[None]`
/// where the backend has no kernels (the composed fallback).
fn runnable_kernels<B: FlashBackend>(
    device: &B::Device,
    dims: AttentionDims,
    dtype: FloatDType,
    options: FlashAttentionOptions,
) -> Vec<Option<AttentionKernel>> {
    runnable_kernels_with::<B>(device, dims, dtype, options, ScoreTerms::default())
}

/// [`runnable_kernels`] of a call with the score terms `terms`.
fn runnable_kernels_with<B: FlashBackend>(
    device: &B::Device,
    dims: AttentionDims,
    dtype: FloatDType,
    options: FlashAttentionOptions,
    terms: ScoreTerms,
) -> Vec<Option<AttentionKernel>> {
    let all = [
        AttentionKernel::Units,
        AttentionKernel::Tiled,
        AttentionKernel::MatrixUnits,
        AttentionKernel::CooperativeMatrix,
        AttentionKernel::Hopper,
    ];
    let forced = |kernel| FlashAttentionOptions {
        kernel: Some(kernel),
        ..options
    };
    let plan = |options| attention_plan_with::<B>(device, dims, dtype.into(), options, terms);
    match plan(forced(AttentionKernel::Units)) {
        None => vec![None],
        Some(_) => all
            .into_iter()
            .filter(|&k| plan(forced(k)).is_some_and(|p| p.is_ok()))
            .map(Some)
            .collect(),
    }
}

/// One call of `dims` with `options` through every kernel the device runs
/// ([`runnable_kernels`]), checked by [`check_heads`]; `context` names the case.
#[allow(clippy::too_many_arguments)]
fn on_every_kernel<B: FlashBackend>(
    device: &B::Device,
    dims: AttentionDims,
    (q, k, v): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>),
    mask: Option<Tensor<B, 4, Bool>>,
    bias: Option<Tensor<B, 4>>,
    heads: HeadTerms<B>,
    options: FlashAttentionOptions,
    dtype: FloatDType,
    context: &str,
) {
    for kernel in runnable_kernels::<B>(device, dims, dtype, options) {
        check_heads(
            q.clone(),
            k.clone(),
            v.clone(),
            mask.clone(),
            bias.clone(),
            heads.clone(),
            FlashAttentionOptions { kernel, ..options },
            dtype,
            &format!("{context} {kernel:?}"),
        );
    }
}

/// `q`, `k`, `v` of one call.
type Qkv<B> = (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>);

/// The sizes of a dense call of `[B, Hq, Hkv, Sq, Sk, D]` (`Dv = D`).
fn dense_dims([nb, hq, hkv, sq, sk, d]: [usize; 6]) -> AttentionDims {
    AttentionDims {
        batch: nb,
        heads_q: hq,
        heads_kv: hkv,
        seq_q: sq,
        seq_k: sk,
        head_dim: d,
        value_dim: d,
    }
}

/// [`dense_dims`] of a dense call, and its `q`, `k`, `v` drawn fresh.
fn dense_inputs<B: FlashBackend>(
    sizes: [usize; 6],
    dtype: FloatDType,
    device: &B::Device,
) -> (AttentionDims, Qkv<B>) {
    let [nb, hq, hkv, sq, sk, d] = sizes;
    let dims = dense_dims(sizes);
    let q = rand4::<B>([nb, hq, sq, d], 1.0, dtype, device);
    let k = rand4::<B>([nb, hkv, sk, d], 1.0, dtype, device);
    let v = rand4::<B>([nb, hkv, sk, d], 1.0, dtype, device);
    (dims, (q, k, v))
}

/// Sliding windows (against an explicit band in the reference) and ALiBi from slopes (against
/// the materialised term), through every kernel the device runs: windows on both sides, causal
/// windows with `Sq < Sk` and `Sq > Sk` (rows that see nothing give zeros), a window wider than
/// the sequence, long enough rows that whole key blocks are skipped on both sides, with GQA, a
/// padding mask and a bias.
fn windows_and_alibi<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    let (nb, hq, hkv, d) = (2, 4, 2, 32);
    // (Sq, Sk, causal, window, ALiBi, mask and bias)
    let cases = [
        (70, 70, false, Some((3, 5)), false, false),
        (70, 70, false, Some((0, 0)), false, false),
        (300, 300, true, Some((40, 0)), false, false),
        (260, 300, false, Some((20, 70)), true, false),
        (97, 130, true, Some((16, 7)), false, true),
        (130, 70, true, Some((9, 0)), true, false),
        (40, 33, false, Some((1000, 1000)), false, false),
        (150, 150, true, None, true, true),
        (37, 80, false, None, true, false),
    ];
    // Off CUDA (lavapipe in CI, where every new rule set compiles slowly) the cases that skip
    // key blocks on both sides and combine the rules; all of them on the GPU run.
    let cases = match cuda {
        true => &cases[..],
        false => &cases[2..5],
    };
    for &(sq, sk, causal, window, alibi, terms) in cases {
        let options = FlashAttentionOptions {
            window,
            ..AttentionModuleOptions {
                is_causal: causal,
                ..Default::default()
            }
            .into()
        };
        let (dims, (q, k, v)) = dense_inputs::<B>([nb, hq, hkv, sq, sk, d], dtype, device);
        let kernels = runnable_kernels::<B>(device, dims, dtype, options);
        if cuda && dtype != FloatDType::F32 {
            assert!(kernels.contains(&Some(AttentionKernel::MatrixUnits)));
            assert!(kernels.contains(&Some(AttentionKernel::CooperativeMatrix)));
        }
        let slopes = alibi.then(|| random::<B, 1>([hq], 0.02, 0.5, FloatDType::F32, device));
        let mask = terms
            .then(|| bool_mask::<B, 4>([nb, 1, 1, sk], device, |[b, _, _, j]| j + 7 * b + 3 >= sk));
        let bias = terms.then(|| rand4::<B>([1, hq, sq, sk], 1.0, dtype, device));
        let heads = HeadTerms {
            alibi_slopes: slopes,
            sinks: None,
        };
        on_every_kernel(
            device,
            dims,
            (q, k, v),
            mask,
            bias,
            heads,
            options,
            dtype,
            &format!(
                "Sq {sq} Sk {sk} causal {causal} window {window:?} alibi {alibi} mask+bias {terms}"
            ),
        );
    }
}

/// Biases the Hopper forward loads by TMA as tiles (unit key stride, rows of whole 16 bytes of
/// their own) through every kernel the device runs: `[1, H, Sq, Sk]`, `[B, 1, Sq, Sk]` and
/// `[B, H, Sq, Sk]`, several key blocks with the last one partial and row blocks past `Sq`
/// (read as zeros), with causal, softcap, ALiBi and a padding mask; and biases broadcast along
/// the rows, which it loads as one row of keys per step (`[B, 1, 1, Sk]` causal over a partial
/// last key block, `[1, H, 1, Sk]` with ALiBi).
fn bias_tiles<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    let (nb, hq, hkv, d) = (2, 4, 2, 64);
    // (Sq, Sk, bias batches, bias heads, bias rows, causal, softcap, ALiBi, padding mask)
    let cases = [
        (200, 328, false, true, true, false, false, false, false),
        (130, 264, true, false, true, true, true, false, true),
        (70, 136, true, true, true, false, false, true, false),
        (150, 200, true, false, false, true, false, false, false),
        (90, 264, false, true, false, false, true, true, true),
    ];
    // Off CUDA (lavapipe in CI) the first case only: the rules of the others run there in
    // `masks_and_biases` and `windows_and_alibi`.
    let cases = match cuda {
        true => &cases[..],
        false => &cases[..1],
    };
    for &(sq, sk, batches, heads, rows, causal, softcap, alibi, padding) in cases {
        let options: FlashAttentionOptions = AttentionModuleOptions {
            is_causal: causal,
            softcap: softcap.then_some(6.0),
            ..Default::default()
        }
        .into();
        let (dims, (q, k, v)) = dense_inputs::<B>([nb, hq, hkv, sq, sk, d], dtype, device);
        let shape = [
            if batches { nb } else { 1 },
            if heads { hq } else { 1 },
            if rows { sq } else { 1 },
            sk,
        ];
        let bias = rand4::<B>(shape, 2.0, dtype, device);
        let mask = padding
            .then(|| bool_mask::<B, 4>([nb, 1, 1, sk], device, |[b, _, _, j]| j + 9 * b + 5 >= sk));
        let slopes = alibi.then(|| random::<B, 1>([hq], 0.02, 0.5, FloatDType::F32, device));
        let heads_terms = HeadTerms {
            alibi_slopes: slopes,
            sinks: None,
        };
        on_every_kernel(
            device,
            dims,
            (q, k, v),
            mask,
            Some(bias),
            heads_terms,
            options,
            dtype,
            &format!(
                "bias {shape:?}: causal {causal} softcap {softcap} alibi {alibi} mask {padding}"
            ),
        );
    }
}

/// The Hopper forward's tile schedules ([`TileSchedule`]): one block per tile, persistent (one
/// block per SM), and 1, 3 and 7 persistent blocks taking many tiles each in rounds, in static
/// rounds and from the dynamic counter (its first round the blocks' own tiles) — every
/// output checked against the reference and bit-identical to one block per tile (a tile's
/// arithmetic does not depend on the block that runs it): D 64 (192-row tiles), causal with
/// `Sq > Sk` (tiles without keys, whose `Q` still comes) under GQA (6 heads: under `Blocks`,
/// 3 chunks of the causal order), D 256 (64 keys per step)
/// with a bias loaded by TMA. Where the Hopper forward cannot run, the schedule leaves the plan
/// as it was.
fn tile_schedules<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let schedules = [
        TileSchedule::PerTile,
        TileSchedule::Persistent,
        TileSchedule::Blocks(1),
        TileSchedule::Blocks(3),
        TileSchedule::Blocks(7),
        TileSchedule::Dynamic,
        TileSchedule::DynamicBlocks(1),
        TileSchedule::DynamicBlocks(3),
        TileSchedule::DynamicBlocks(7),
    ];
    // ([B, Hq, Hkv, Sq, Sk, D], causal, bias)
    let cases = [
        ([2, 4, 2, 300, 260, 64], false, false),
        ([2, 3, 1, 400, 200, 128], true, false),
        ([1, 2, 1, 200, 264, 256], false, true),
    ];
    for (sizes, causal, biased) in cases {
        let [nb, hq, _, sq, sk, _] = sizes;
        let base: FlashAttentionOptions = AttentionModuleOptions {
            is_causal: causal,
            ..Default::default()
        }
        .into();
        let dims = dense_dims(sizes);
        let terms = ScoreTerms {
            bias: biased,
            ..Default::default()
        };
        let plan = |options: FlashAttentionOptions| {
            attention_plan_with::<B>(device, dims, dtype.into(), options, terms)
        };
        let hopper = FlashAttentionOptions {
            kernel: Some(AttentionKernel::Hopper),
            ..base
        };
        if plan(hopper).is_none_or(|p| p.is_err()) {
            let planned = plan(base).map(|p| p.map_err(|e| e.to_string()));
            for schedule in schedules {
                let options = FlashAttentionOptions {
                    schedule: Some(schedule),
                    ..base
                };
                let with = plan(options).map(|p| p.map_err(|e| e.to_string()));
                assert_eq!(with, planned, "{sizes:?}: {schedule:?} changed the plan");
            }
            continue;
        }
        let (_, (q, k, v)) = dense_inputs::<B>(sizes, dtype, device);
        let bias = biased.then(|| rand4::<B>([1, hq, sq, sk], 2.0, dtype, device));
        let mut per_tile: Option<Vec<f64>> = None;
        for schedule in schedules {
            let options = FlashAttentionOptions {
                schedule: Some(schedule),
                ..hopper
            };
            let p = plan(options).expect("fused").expect("plans");
            let tiles = sq.div_ceil(p.config.block_q as usize) * hq * nb;
            let blocks = p.cubes.0;
            let context = format!(
                "{sizes:?} causal {causal} bias {biased}: {schedule:?}, {blocks} of {tiles} tiles"
            );
            assert_eq!(p.cubes, (blocks, 1, 1), "{context}");
            match schedule {
                TileSchedule::PerTile => assert_eq!(blocks, tiles, "{context}"),
                TileSchedule::Blocks(b) | TileSchedule::DynamicBlocks(b) => {
                    assert_eq!(blocks, b.min(tiles), "{context}")
                }
                _ => assert!((1..=tiles).contains(&blocks), "{context}"),
            }
            let out = check_with(
                q.clone(),
                k.clone(),
                v.clone(),
                None,
                bias.clone(),
                options,
                dtype,
                &context,
            );
            match &per_tile {
                None => per_tile = Some(out),
                Some(want) => assert!(
                    want.iter()
                        .zip(&out)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{context}: not the bits of one block per tile"
                ),
            }
        }
    }
}

/// Attention sinks (gpt-oss's per-head logit in every row's denominator) against the composed
/// reference, through every kernel the device runs: with a causal window (gpt-oss's local
/// layers), with quiet softmax, with a padding mask that hides whole rows (zeros, lse = the
/// sink), and sinks far above and below the scores.
fn attention_sinks<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (nb, hq, hkv, d) = (2, 4, 2, 32);
    // (Sq, Sk, causal, window, quiet, mask, sink range)
    let cases = [
        (45, 70, false, None, false, false, (-1.0, 1.0)),
        (130, 130, true, Some((31, 0)), false, false, (-2.0, 2.0)),
        (37, 60, false, None, true, true, (-1.0, 1.0)),
        (20, 20, true, None, false, false, (4.0, 8.0)),
        (20, 33, false, None, false, false, (-30.0, -20.0)),
    ];
    // Off CUDA (lavapipe in CI, where every new rule set compiles slowly) the window and the
    // quiet, masked cases; all of them on the GPU run.
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    let cases = match cuda {
        true => &cases[..],
        false => &cases[1..3],
    };
    for &(sq, sk, causal, window, quiet, masked, (lo, hi)) in cases {
        let options = FlashAttentionOptions {
            window,
            quiet,
            ..AttentionModuleOptions {
                is_causal: causal,
                ..Default::default()
            }
            .into()
        };
        let (dims, (q, k, v)) = dense_inputs::<B>([nb, hq, hkv, sq, sk, d], dtype, device);
        let sinks = random::<B, 1>([hq], lo, hi, FloatDType::F32, device);
        // Batch 1 masks every key of rows 3 and 5.
        let mask = masked.then(|| {
            bool_mask::<B, 4>([nb, 1, sq, sk], device, |[b, _, i, j]| {
                (b == 1 && (i == 3 || i == 5)) || j + 4 >= sk
            })
        });
        let heads = HeadTerms {
            alibi_slopes: None,
            sinks: Some(sinks),
        };
        on_every_kernel(
            device,
            dims,
            (q, k, v),
            mask,
            None,
            heads,
            options,
            dtype,
            &format!(
                "sinks in [{lo}, {hi}] Sq {sq} Sk {sk} causal {causal} window {window:?} quiet {quiet} mask {masked}"
            ),
        );
    }
}

/// Packed variable-length batches ([`attention_varlen`]) against the f64 reference of the
/// dense op on each sequence (the rules aligned within each sequence, no key of another), by
/// the 2×-naive rule, through every kernel the device runs: empty and one-token sequences,
/// sequences without keys (zeros, lse −inf), causal with `Sq < Sk` and `Sq > Sk` per sequence,
/// a window, ALiBi from each sequence's diagonal, sinks, a key padding mask and a bias in
/// packed coordinates, GQA, softcap and quiet softmax; on the GPU a sequence of 5000 tokens
/// beside short ones.
fn varlen<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    let (hq, hkv, d) = (4, 2, 32);
    struct Packed {
        lengths_q: Vec<usize>,
        lengths_k: Vec<usize>,
        causal: bool,
        window: Option<(usize, usize)>,
        /// ALiBi, sinks, a key padding mask and a bias.
        terms: bool,
        softcap: bool,
        quiet: bool,
    }
    let case = |lengths_q: &[usize], lengths_k: &[usize]| Packed {
        lengths_q: lengths_q.to_vec(),
        lengths_k: lengths_k.to_vec(),
        causal: false,
        window: None,
        terms: false,
        softcap: false,
        quiet: false,
    };
    let mut cases = vec![
        case(&[37, 0, 1, 130, 64, 5], &[37, 0, 1, 130, 64, 5]),
        Packed {
            causal: true,
            ..case(&[3, 0, 70, 20, 90], &[50, 9, 70, 0, 40])
        },
        Packed {
            window: Some((20, 5)),
            terms: true,
            ..case(&[100, 33, 150], &[100, 33, 150])
        },
        Packed {
            causal: true,
            softcap: true,
            quiet: true,
            ..case(&[129, 1, 64], &[129, 1, 64])
        },
    ];
    if cuda {
        cases.push(Packed {
            causal: true,
            ..case(&[700, 1, 5000, 0, 333], &[700, 1, 5000, 12, 333])
        });
    } else {
        // Off CUDA (lavapipe in CI, where every rule set compiles slowly) the combining cases.
        cases.drain(0..1);
    }
    for p in cases {
        let (tq, tk) = (p.lengths_q.iter().sum(), p.lengths_k.iter().sum());
        let batch = VarlenBatch::<B>::from_lengths(&p.lengths_q, &p.lengths_k, device);
        let options = FlashAttentionOptions {
            window: p.window,
            quiet: p.quiet,
            ..AttentionModuleOptions {
                is_causal: p.causal,
                softcap: p.softcap.then_some(2.0),
                ..Default::default()
            }
            .into()
        };
        let dims = dense_dims([1, hq, hkv, tq, tk, d]);
        let terms = ScoreTerms {
            varlen: true,
            ..Default::default()
        };
        let q = rand4::<B>([1, hq, tq, d], 1.0, dtype, device);
        let k = rand4::<B>([1, hkv, tk, d], 1.0, dtype, device);
        let v = rand4::<B>([1, hkv, tk, d], 1.0, dtype, device);
        let mask = p
            .terms
            .then(|| bool_mask::<B, 4>([1, 1, 1, tk], device, |[_, _, _, j]| j % 11 == 3));
        let bias = p
            .terms
            .then(|| rand4::<B>([1, hq, tq, tk], 1.0, dtype, device));
        let heads = HeadTerms {
            alibi_slopes: p
                .terms
                .then(|| random::<B, 1>([hq], 0.02, 0.5, FloatDType::F32, device)),
            sinks: p
                .terms
                .then(|| random::<B, 1>([hq], -1.0, 1.0, FloatDType::F32, device)),
        };
        for kernel in runnable_kernels_with::<B>(device, dims, dtype, options, terms) {
            let call = (
                q.clone(),
                k.clone(),
                v.clone(),
                mask.clone(),
                bias.clone(),
                heads.clone(),
            );
            check_call(
                call,
                Some(&batch),
                FlashAttentionOptions { kernel, ..options },
                dtype,
                &format!(
                    "varlen q {:?} k {:?} causal {} window {:?} terms {} {kernel:?}",
                    p.lengths_q, p.lengths_k, p.causal, p.window, p.terms
                ),
            );
        }
    }
}

/// A call that must panic, and what its message must say.
type Refusal<'a> = (&'static str, Box<dyn Fn() + 'a>);

/// Bad packed batches are refused before any launch, one case each: lengths that decrease,
/// that do not start at 0, query and key lists of different lengths, no sequence, a sequence
/// longer than `max_seqlen`, token counts of `q` and `k`/`v` other than the batch's totals, and
/// (the dense checks still apply) heads that do not group.
fn varlen_bad_input<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let int = |values: &[i64]| {
        Tensor::<B, 1, burn::tensor::Int>::from_data(
            TensorData::new(values.to_vec(), [values.len()]),
            device,
        )
    };
    let cases: [Refusal<'_>; 5] = [
        (
            "`cu_seqlens_q` must not decrease: entry 2 is 3 after 5",
            Box::new(|| {
                VarlenBatch::<B>::from_cu_seqlens(int(&[0, 5, 3]), int(&[0, 5, 8]), 5, 5);
            }),
        ),
        (
            "`cu_seqlens_k` must start at 0, got 1",
            Box::new(|| {
                VarlenBatch::<B>::from_cu_seqlens(int(&[0, 5, 8]), int(&[1, 5, 8]), 5, 5);
            }),
        ),
        (
            "2 query lengths but 3 key lengths",
            Box::new(|| {
                VarlenBatch::<B>::from_lengths(&[3, 4], &[3, 4, 5], device);
            }),
        ),
        (
            "a packed batch needs at least one sequence",
            Box::new(|| {
                VarlenBatch::<B>::from_lengths(&[], &[], device);
            }),
        ),
        (
            "a sequence has 5 tokens, more than `max_seqlen_q` = 4",
            Box::new(|| {
                VarlenBatch::<B>::from_cu_seqlens(int(&[0, 5, 8]), int(&[0, 5, 8]), 4, 5);
            }),
        ),
    ];
    for (want, call) in cases {
        let msg = panic_message(call);
        assert!(msg.contains(want), "expected `{want}`, got: {msg}");
    }
    let batch = VarlenBatch::<B>::from_lengths(&[3, 4], &[3, 5], device);
    let options = FlashAttentionOptions::from(AttentionModuleOptions::default());
    let tokens = |t: usize, h: usize| random::<B, 3>([t, h, 16], -1.0, 1.0, dtype, device);
    let run = |q, k, v| {
        panic_message(|| {
            attention_varlen(q, k, v, &batch, None, None, HeadTerms::default(), options);
        })
    };
    let msg = run(tokens(6, 2), tokens(8, 2), tokens(8, 2));
    assert!(
        msg.contains("`query` has 6 tokens, but `cu_seqlens_q` ends at 7"),
        "{msg}"
    );
    let msg = run(tokens(7, 2), tokens(8, 2), tokens(9, 2));
    assert!(
        msg.contains("`value` has 9 tokens, but `cu_seqlens_k` ends at 8"),
        "{msg}"
    );
    let msg = run(tokens(7, 3), tokens(8, 2), tokens(8, 2));
    assert!(msg.contains("`query` has 3 heads, not a multiple"), "{msg}");
    // The batch's own totals run.
    let (out, lse) = attention_varlen(
        tokens(7, 2),
        tokens(8, 2),
        tokens(8, 2),
        &batch,
        None,
        None,
        HeadTerms::default(),
        options,
    );
    assert_eq!((out.dims(), lse.dims()), ([7, 2, 16], [2, 7]));
}

/// burn-nn's mask semantics (`masked_score`: a masked key takes a fill score and stays in the
/// softmax, so a fully masked row is uniform) and quiet softmax, through every kernel the
/// device can run (the composed fallback on NdArray). A fill score of 0.5 lies among the real
/// scores, so partly masked rows see it too; burn-nn's −1e4 matters in fully masked rows.
fn masked_score_and_quiet<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (nb, hq, hkv, sq, sk, d) = (2, 4, 2, 37, 70, 32);
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    let dims = dense_dims([nb, hq, hkv, sq, sk, d]);
    let kernels = runnable_kernels::<B>(device, dims, dtype, Default::default());
    if cuda && dtype != FloatDType::F32 {
        assert!(kernels.contains(&Some(AttentionKernel::MatrixUnits)));
    }
    // Batch b pads its last 9·b + 5 keys; the full mask hides two whole rows per head.
    let padding = |[b, _, _, j]: [usize; 4]| j + 9 * b + 5 >= sk;
    let full = |[b, h, i, j]: [usize; 4]| i == 3 || i == sq - 1 || (b + h + i + j) % 3 == 0;
    for kernel in kernels {
        let cases = [
            (
                "burn-nn fill, fully masked rows",
                Some([nb, hq, sq, sk]),
                false,
                Some(-1e4),
                false,
                false,
            ),
            (
                "fill 0.5, padding, bias, softcap, causal",
                Some([nb, 1, 1, sk]),
                true,
                Some(0.5),
                false,
                true,
            ),
            ("quiet", None, false, None, true, false),
            (
                "quiet, padding, causal",
                Some([nb, 1, 1, sk]),
                false,
                None,
                true,
                true,
            ),
            (
                "quiet, fill -1e4, fully masked rows",
                Some([nb, hq, sq, sk]),
                false,
                Some(-1e4),
                true,
                false,
            ),
            (
                "quiet, fill 0.5, full mask, bias",
                Some([nb, hq, sq, sk]),
                true,
                Some(0.5),
                true,
                false,
            ),
        ];
        for (name, mask_dims, with_bias, fill, quiet, causal) in cases {
            let q = rand4::<B>([nb, hq, sq, d], 1.0, dtype, device);
            let k = rand4::<B>([nb, hkv, sk, d], 1.0, dtype, device);
            let v = rand4::<B>([nb, hkv, sk, d], 1.0, dtype, device);
            let mask = mask_dims.map(|dims| match dims[1] {
                1 => bool_mask::<B, 4>(dims, device, padding),
                _ => bool_mask::<B, 4>(dims, device, full),
            });
            let bias = with_bias.then(|| rand4::<B>([1, hq, sq, sk], 1.0, dtype, device));
            let options = FlashAttentionOptions {
                kernel,
                masked_score: fill,
                quiet,
                module: AttentionModuleOptions {
                    is_causal: causal,
                    softcap: with_bias.then_some(5.0),
                    ..Default::default()
                },
                ..Default::default()
            };
            let got = check_with(
                q,
                k,
                v.clone(),
                mask,
                bias,
                options,
                dtype,
                &format!("{name} ({kernel:?})"),
            );
            if fill == Some(-1e4) && !quiet {
                // burn-nn's uniform weights: a fully masked row (row 3) is the mean of V.
                let v = read(v);
                for (b, h, c) in [(0, 0, 0), (1, 3, 5)] {
                    let kh = h / (hq / hkv);
                    let mean = (0..sk)
                        .map(|j| v[((b * hkv + kh) * sk + j) * d + c])
                        .sum::<f64>()
                        / sk as f64;
                    // With TF32 products (the run's `BURN_FLASH_TF32=1`) each `P·V` term is
                    // off by up to 2⁻¹⁰ of itself: the mean of |V| bounds their sum's error.
                    let tf32 = match tf32_by_default(device, dtype) {
                        true => {
                            (0..sk)
                                .map(|j| v[((b * hkv + kh) * sk + j) * d + c].abs())
                                .sum::<f64>()
                                / sk as f64
                                / 1024.0
                        }
                        false => 0.0,
                    };
                    let o = got[((b * hq + h) * sq + 3) * d + c];
                    assert!(
                        (o - mean).abs() <= 4.0 * eps(dtype) * (1.0 + mean.abs()) + 1e-6 + tf32,
                        "{name}: fully masked row gives {o}, the mean of V is {mean}"
                    );
                }
            }
        }
    }
}

/// Bad input panics before anything runs, naming the argument.
fn bad_input_is_refused<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let plain = AttentionModuleOptions::default();
    let q = rand4::<B>([2, 4, 8, 32], 1.0, dtype, device);
    let k = rand4::<B>([2, 2, 8, 32], 1.0, dtype, device);
    let v = rand4::<B>([2, 2, 8, 16], 1.0, dtype, device);
    let refused = |q: Tensor<B, 4>,
                   k: Tensor<B, 4>,
                   v: Tensor<B, 4>,
                   mask: Option<Tensor<B, 4, Bool>>,
                   bias: Option<Tensor<B, 4>>,
                   options: AttentionModuleOptions| {
        panic_message(|| {
            attention(q, k, v, mask, bias, options);
        })
    };
    let msg = refused(
        q.clone(),
        rand4::<B>([2, 2, 8, 48], 1.0, dtype, device),
        v.clone(),
        None,
        None,
        plain,
    );
    assert!(
        msg.contains("`key` has head dim 48, `query` has 32"),
        "{msg}"
    );
    let msg = refused(
        q.clone(),
        rand4::<B>([2, 3, 8, 32], 1.0, dtype, device),
        rand4::<B>([2, 3, 8, 16], 1.0, dtype, device),
        None,
        None,
        plain,
    );
    assert!(
        msg.contains("`query` has 4 heads, not a multiple of the 3 heads"),
        "{msg}"
    );
    let msg = refused(
        q.clone(),
        k.clone(),
        rand4::<B>([2, 2, 9, 16], 1.0, dtype, device),
        None,
        None,
        plain,
    );
    assert!(
        msg.contains("`value` [2, 2, 9, 16] must have the batch, heads and positions"),
        "{msg}"
    );
    let mask = bool_mask::<B, 4>([2, 4, 8, 7], device, |_| false);
    let msg = refused(q.clone(), k.clone(), v.clone(), Some(mask), None, plain);
    assert!(msg.contains("`mask` has shape [2, 4, 8, 7]"), "{msg}");
    let bias = rand4::<B>([3, 1, 1, 8], 1.0, dtype, device);
    let msg = refused(q.clone(), k.clone(), v.clone(), None, Some(bias), plain);
    assert!(msg.contains("`attn_bias` has shape [3, 1, 1, 8]"), "{msg}");
    let capped = AttentionModuleOptions {
        softcap: Some(0.0),
        ..Default::default()
    };
    let msg = refused(q.clone(), k.clone(), v.clone(), None, None, capped);
    assert!(msg.contains("`softcap` must be positive"), "{msg}");
    let filled = FlashAttentionOptions {
        masked_score: Some(f64::NAN),
        ..Default::default()
    };
    let msg = panic_message(|| {
        attention_with_lse(q.clone(), k.clone(), v.clone(), None, None, filled);
    });
    assert!(msg.contains("`masked_score` must be finite"), "{msg}");
    let slopes = random::<B, 1>([3], 0.1, 0.5, FloatDType::F32, device);
    let msg = panic_message(|| {
        attention_with_alibi(
            q.clone(),
            k.clone(),
            v.clone(),
            None,
            None,
            Some(slopes),
            Default::default(),
        );
    });
    assert!(
        msg.contains("`alibi_slopes` has shape [3], expected [4]"),
        "{msg}"
    );
    let sinks = random::<B, 1>([5], 0.1, 0.5, FloatDType::F32, device);
    let msg = panic_message(|| {
        let heads = HeadTerms {
            alibi_slopes: None,
            sinks: Some(sinks),
        };
        attention_with_heads(
            q.clone(),
            k.clone(),
            v.clone(),
            None,
            None,
            heads,
            Default::default(),
        );
    });
    assert!(msg.contains("`sinks` has shape [5], expected [4]"), "{msg}");
    sync::<B>(device);
}

/// The value tests over many random inputs: `BURN_FLASH_SEEDS` rounds (default 1; the GPU run
/// sets a few hundred) of the shape, causal, GQA, mask and bias, and logit cases, in one
/// process (the kernels compile once).
fn many_seeds<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let rounds: usize = std::env::var("BURN_FLASH_SEEDS")
        .ok()
        .map(|s| s.parse().expect("BURN_FLASH_SEEDS: a count"))
        .unwrap_or(1);
    for round in 0..rounds {
        eprintln!("round {round} of {rounds}");
        causal::<B>(device, dtype);
        grouped_query_heads::<B>(device, dtype);
        masks_and_biases::<B>(device, dtype);
        large_logits_and_strided_inputs::<B>(device, dtype);
    }
}

/// The split-KV decoding kernel ([`AttentionKernel::SplitDecode`]), planned and forced: the
/// plan takes it unasked for few rows per key/value head against long contexts and not
/// otherwise; GQA 4:1 with one query against 1 000 keys (several splits and their merge);
/// three causal rows under a window with a softcap, `D 128 ≠ Dv 64`; ALiBi, sinks and quiet
/// softmax on `[B, S, H, D]` inputs in one split.
fn split_decode<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let forced = |causal: bool| FlashAttentionOptions {
        kernel: Some(AttentionKernel::SplitDecode),
        module: AttentionModuleOptions {
            is_causal: causal,
            ..Default::default()
        },
        ..Default::default()
    };
    let dims = |seq_q, seq_k| AttentionDims {
        batch: 2,
        heads_q: 8,
        heads_kv: 2,
        seq_q,
        seq_k,
        head_dim: 64,
        value_dim: 64,
    };
    let plan = |sq, sk, options| {
        attention_plan::<B>(device, dims(sq, sk), dtype.into(), options).map(|p| p.expect("plan"))
    };
    if let Some(long) = plan(1, 1000, Default::default()) {
        assert_eq!(long.kernel, AttentionKernel::SplitDecode, "{long:?}");
        assert!(long.cubes.0 > 1, "several splits at Sk 1000: {long:?}");
        let short = plan(1, 100, Default::default()).expect("plan");
        assert_ne!(short.kernel, AttentionKernel::SplitDecode, "{short:?}");
        let rows = plan(8, 1000, Default::default()).expect("plan");
        assert_ne!(
            rows.kernel,
            AttentionKernel::SplitDecode,
            "G·Sq 32: {rows:?}"
        );
        let forced_short = plan(1, 100, forced(false)).expect("plan");
        assert_eq!(
            forced_short.cubes.0, 1,
            "one split at Sk 100: {forced_short:?}"
        );
    }

    let q = rand4::<B>([2, 8, 1, 64], 1.0, dtype, device);
    let k = rand4::<B>([2, 2, 1000, 64], 1.0, dtype, device);
    let v = rand4::<B>([2, 2, 1000, 64], 1.0, dtype, device);
    let options = forced(false);
    check_with(
        q,
        k,
        v,
        None,
        None,
        options,
        dtype,
        "decode, GQA 4:1, Sq 1, Sk 1000",
    );

    let q = rand4::<B>([1, 4, 3, 128], 1.0, dtype, device);
    let k = rand4::<B>([1, 4, 700, 128], 1.0, dtype, device);
    let v = rand4::<B>([1, 4, 700, 64], 1.0, dtype, device);
    let mut options = forced(true);
    options.window = Some((200, 0));
    options.module.softcap = Some(5.0);
    check_with(
        q,
        k,
        v,
        None,
        None,
        options,
        dtype,
        "decode, causal, window, softcap",
    );

    let q = rand4::<B>([2, 1, 6, 32], 2.0, dtype, device).swap_dims(1, 2);
    let k = rand4::<B>([2, 90, 2, 32], 2.0, dtype, device).swap_dims(1, 2);
    let v = rand4::<B>([2, 90, 2, 32], 1.0, dtype, device).swap_dims(1, 2);
    let heads = HeadTerms {
        alibi_slopes: Some(random::<B, 1>([6], 0.05, 0.5, FloatDType::F32, device)),
        sinks: Some(random::<B, 1>([6], -1.0, 1.0, FloatDType::F32, device)),
    };
    let mut options = forced(false);
    options.quiet = true;
    check_heads(
        q,
        k,
        v,
        None,
        None,
        heads,
        options,
        dtype,
        "decode, ALiBi, sinks, quiet",
    );
    sync::<B>(device);
}

/// A pool of `blocks` blocks and a table over it: sequence `b` holds `lengths[b]` keys and
/// room for `extra` more, its blocks drawn from a shuffled pool.
fn shuffled_table<B: FlashBackend>(
    lengths: &[usize],
    extra: usize,
    block_size: usize,
    pool_blocks: usize,
    device: &B::Device,
) -> BlockTable<B> {
    use rand::{SeedableRng, seq::SliceRandom};
    let mut order: Vec<usize> = (0..pool_blocks).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(fresh_seed()));
    let mut free = order.into_iter();
    let blocks = lengths
        .iter()
        .map(|l| {
            let n = (l + extra).div_ceil(block_size);
            free.by_ref().take(n).collect()
        })
        .collect();
    BlockTable::new(blocks, lengths.to_vec(), block_size, pool_blocks, device)
}

/// Sequence `b`'s keys (or values) of a pool read to the host, `[1, H, len, D]` in `dtype`.
fn gathered<B: FlashBackend>(
    pool: &[f64],
    dims: [usize; 4],
    table: &BlockTable<B>,
    b: usize,
    dtype: FloatDType,
    device: &B::Device,
) -> Tensor<B, 4> {
    let [_, bs, heads, cols] = dims;
    let len = table.lengths()[b];
    let mut out = Vec::with_capacity(heads * len * cols);
    for h in 0..heads {
        for j in 0..len {
            let block = table.blocks()[b][j / bs];
            let at = ((block * bs + j % bs) * heads + h) * cols;
            out.extend(pool[at..at + cols].iter().map(|&x| x as f32));
        }
    }
    tensor::<B, 4>(out, [1, heads, len, cols], dtype, device)
}

/// Paged attention against the f64 reference of each sequence's keys gathered (2×-naive rule),
/// and bit for bit against the same kernel on a contiguous cache of the same capacity and
/// lengths: shuffled block tables, lengths 1–700 (blocks of 16, partial last blocks), GQA 4:1,
/// causal rows at each sequence's end, ALiBi.
fn paged<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (hq, hkv, d, bs, pool_blocks) = (8, 2, 64, 16, 70);
    let lengths = [1usize, 77, 700, 0];
    let table = shuffled_table::<B>(&lengths, 0, bs, pool_blocks, device);
    let k_pool = rand4::<B>([pool_blocks, bs, hkv, d], 1.0, dtype, device);
    let v_pool = rand4::<B>([pool_blocks, bs, hkv, d], 1.0, dtype, device);
    let q = rand4::<B>([4, hq, 2, d], 1.0, dtype, device);
    let slopes = random::<B, 1>([hq], 0.01, 0.2, FloatDType::F32, device);
    let options = FlashAttentionOptions {
        module: AttentionModuleOptions {
            is_causal: true,
            ..Default::default()
        },
        ..Default::default()
    };
    let heads = HeadTerms {
        alibi_slopes: Some(slopes.clone()),
        sinks: None,
    };
    poison::<B, 4>([4, hq, 2, d], dtype, device);
    let (out, lse) = burn_flash::attention_paged(
        q.clone(),
        k_pool.clone(),
        v_pool.clone(),
        &table,
        heads,
        options,
    );
    sync::<B>(device);
    let (got, got_lse) = (read(out.clone()), read(lse));
    let (k_host, v_host) = (read(k_pool.clone()), read(v_pool.clone()));
    let pool_dims = [pool_blocks, bs, hkv, d];
    let per_seq = hq * 2 * d;
    for (b, &len) in lengths.iter().enumerate() {
        let ctx = format!("paged, sequence {b} of {len} keys, {dtype:?}");
        let q_b = q.clone().narrow(0, b, 1);
        // No zero-element tensor on the device (Burn 0.21 cannot make one on CUDA): a sequence
        // without keys has an empty reference.
        let keys = |host: &[f64]| match len {
            0 => Vec::new(),
            _ => read(gathered(host, pool_dims, &table, b, dtype, device)),
        };
        let case = Case {
            q: read(q_b),
            k: keys(&k_host),
            v: keys(&v_host),
            q_dims: [1, hq, 2, d],
            k_dims: [1, hkv, len, d],
            dv: d,
            mask: None,
            bias: None,
            options: options.module,
            fill: None,
            quiet: false,
            window: None,
            slopes: Some(read(slopes.clone())),
            sinks: None,
            packed: None,
        };
        let (want, want_lse) = case.reference();
        let (naive, _) = case.model(naive(dtype));
        let got_b = &got[b * per_seq..(b + 1) * per_seq];
        let floor = if dtype == FloatDType::F32 { 8.0 } else { 1.0 };
        assert_within_naive(got_b, &naive, &want, dtype, floor, &ctx);
        check_lse(
            &got_lse[b * hq * 2..(b + 1) * hq * 2],
            &want_lse,
            dtype,
            &ctx,
        );
    }

    // The same keys in a contiguous cache of the table's capacity: the same schedule, so the
    // same bits.
    let cap = table.blocks().iter().map(Vec::len).max().unwrap() * bs;
    let contiguous = |host: &[f64]| {
        let parts: Vec<Tensor<B, 4>> = (0..lengths.len())
            .map(|b| {
                let pad = rand4::<B>([1, hkv, cap - lengths[b], d], 1.0, dtype, device);
                match lengths[b] {
                    0 => pad,
                    _ => {
                        let keys = gathered(host, pool_dims, &table, b, dtype, device);
                        Tensor::cat(vec![keys, pad], 2)
                    }
                }
            })
            .collect();
        Tensor::cat(parts, 0)
    };
    let lens = Tensor::<B, 1, Int>::from_data(
        TensorData::new(lengths.iter().map(|&l| l as i32).collect(), [lengths.len()]),
        device,
    );
    let cache = KvCache {
        key: contiguous(&k_host).into_primitive().tensor(),
        value: contiguous(&v_host).into_primitive().tensor(),
        table: None,
        lengths: lens.into_primitive(),
    };
    let heads = HeadOperands {
        slopes: Some(slopes.into_primitive().tensor()),
        sinks: None,
    };
    let (flat, _) = B::flash_decode(q.into_primitive().tensor(), cache, heads, options);
    let flat = read(Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(flat)));
    assert_eq!(got, flat, "paged and contiguous caches differ ({dtype:?})");
}

/// Appends across block boundaries (lengths 5, 16, 30 + 20 keys in blocks of 16) write exactly
/// the new rows into their blocks and nothing else; with RoPE (interleaved and halves, all or
/// half of the dims) the keys and queries match rotating them in f64 and then rounding, and
/// burn-nn's `RotaryEncoding` (interleaved).
fn paged_append<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (hq, hkv, d, bs, pool_blocks, new) = (4, 2, 32, 16, 12, 20);
    let lengths = [5usize, 16, 30];
    let pool_dims = [pool_blocks, bs, hkv, d];
    for (rope, interleaved, rotary) in [(false, true, d), (true, true, d), (true, false, d / 2)] {
        let ctx = format!("append, RoPE {rope} interleaved {interleaved} R {rotary}, {dtype:?}");
        let table = shuffled_table::<B>(&lengths, new, bs, pool_blocks, device);
        let k_pool = rand4::<B>(pool_dims, 1.0, dtype, device);
        let v_pool = rand4::<B>(pool_dims, 1.0, dtype, device);
        let k_new = rand4::<B>([3, hkv, new, d], 1.0, dtype, device);
        let v_new = rand4::<B>([3, hkv, new, d], 1.0, dtype, device);
        let q = rand4::<B>([3, hq, new, d], 1.0, dtype, device);
        let tables = Rope::<B>::new(10_000.0, rotary, 64, interleaved, device);
        let (k_old, v_old) = (read(k_pool.clone()), read(v_pool.clone()));
        let (k_in, v_in, q_in) = (read(k_new.clone()), read(v_new.clone()), read(q.clone()));
        let out = burn_flash::append_paged(
            k_pool,
            v_pool,
            &table,
            k_new.clone(),
            v_new,
            rope.then_some(&tables),
            rope.then(|| q.clone()),
        );
        assert_eq!(out.table.lengths(), [25, 36, 50], "{ctx}");
        sync::<B>(device);
        let (cos, sin) = (read(tables.cos.clone()), read(tables.sin.clone()));
        let half = rotary / 2;
        // The row `x` (d values) at position `p`, rotated in f64 and rounded to the dtype.
        let rotated = |x: &[f64], p: usize| -> Vec<f64> {
            let mut y = x.to_vec();
            if rope {
                for i in 0..half {
                    let (e0, e1) = if interleaved {
                        (2 * i, 2 * i + 1)
                    } else {
                        (i, i + half)
                    };
                    let (c, s) = (cos[p * half + i], sin[p * half + i]);
                    y[e0] = x[e0] * c - x[e1] * s;
                    y[e1] = x[e0] * s + x[e1] * c;
                }
            }
            y
        };
        let mut k_want = k_old.clone();
        let mut v_want = v_old.clone();
        for (b, &len) in lengths.iter().enumerate() {
            for h in 0..hkv {
                for s in 0..new {
                    let pos = len + s;
                    let slot = table.blocks()[b][pos / bs] * bs + pos % bs;
                    let dst = (slot * hkv + h) * d;
                    let src = ((b * hkv + h) * new + s) * d;
                    k_want[dst..dst + d].copy_from_slice(&rotated(&k_in[src..src + d], pos));
                    v_want[dst..dst + d].copy_from_slice(&v_in[src..src + d]);
                }
            }
        }
        let (k_got, v_got) = (read(out.key), read(out.value));
        assert_eq!(v_got, v_want, "{ctx}: the value pool");
        // One ulp of the dtype: the kernel rounds its f32 products to the dtype, so a value
        // within f32's rounding of a midpoint may land on either neighbour (s47: 0.99 of half
        // an ulp in f16 on lavapipe, with `BURN_FLASH_MARGINS`).
        let t = Tol {
            atol: 1e-6,
            rtol: 2.0 * eps(dtype),
        };
        if rope {
            assert_close(&k_got, &k_want, t, &format!("{ctx}: the key pool"));
            let q_got = read(out.query.expect("rotated queries"));
            let mut q_want = q_in.clone();
            for (b, &len) in lengths.iter().enumerate() {
                for h in 0..hq {
                    for s in 0..new {
                        let at = ((b * hq + h) * new + s) * d;
                        q_want[at..at + d].copy_from_slice(&rotated(&q_in[at..at + d], len + s));
                    }
                }
            }
            assert_close(&q_got, &q_want, t, &format!("{ctx}: the queries"));
            if interleaved && rotary == d {
                // burn-nn's RotaryEncoding (its frequencies computed in f32 on the device).
                let enc = burn::nn::RotaryEncodingConfig::new(64, d).init::<B>(device);
                for (b, &len) in lengths.iter().enumerate() {
                    let x = k_new.clone().narrow(0, b, 1).reshape([hkv, new, d]);
                    let theirs = read(enc.apply(x.cast(FloatDType::F32), len));
                    let blocks = &table.blocks()[b];
                    let mut ours = Vec::with_capacity(hkv * new * d);
                    for h in 0..hkv {
                        for s in 0..new {
                            let slot = blocks[(len + s) / bs] * bs + (len + s) % bs;
                            let at = (slot * hkv + h) * d;
                            ours.extend_from_slice(&k_got[at..at + d]);
                        }
                    }
                    // burn-nn rotates through Burn ops, whose f32 products are TF32-class
                    // on CUDA (2⁻¹⁰ of the inputs, which are of order 1, so absolute too).
                    let t = Tol {
                        atol: 2.0 * 2f64.powi(-10),
                        rtol: 2.0 * eps(dtype).max(2f64.powi(-10)),
                    };
                    assert_close(&ours, &theirs, t, &format!("{ctx}: burn-nn, sequence {b}"));
                }
            }
        } else {
            assert_eq!(k_got, k_want, "{ctx}: the key pool");
        }
    }
}

/// Every rejected paged call panics with a message naming the problem, before any launch.
fn paged_bad_input<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let table = |blocks: Vec<Vec<usize>>, lengths: Vec<usize>| {
        BlockTable::<B>::new(blocks, lengths, 16, 8, device)
    };
    let refused = |f: &dyn Fn(), what: &str| {
        let msg = panic_message(f);
        assert!(
            msg.contains(what),
            "expected a panic about `{what}`, got: {msg}"
        );
    };
    refused(&|| drop(table(vec![vec![8]], vec![1])), "outside the pool");
    refused(
        &|| drop(table(vec![vec![1], vec![1]], vec![1, 1])),
        "listed twice",
    );
    refused(
        &|| drop(table(vec![vec![1]], vec![17])),
        "blocks of 16 hold 16",
    );
    refused(
        &|| drop(table(vec![vec![1]], vec![1, 2])),
        "one of each per sequence",
    );
    let ok = table(vec![vec![0, 3], vec![5, 6]], vec![20, 16]);
    let pool = rand4::<B>([8, 16, 2, 32], 1.0, dtype, device);
    let q = rand4::<B>([2, 4, 1, 32], 1.0, dtype, device);
    let options = FlashAttentionOptions::default();
    let attend = |q: Tensor<B, 4>, k: Tensor<B, 4>| {
        let _ = burn_flash::attention_paged(q, k, pool.clone(), &ok, HeadTerms::default(), options);
    };
    let narrow = rand4::<B>([8, 8, 2, 32], 1.0, dtype, device);
    refused(&|| attend(q.clone(), narrow.clone()), "the table's pool");
    let three = rand4::<B>([3, 4, 1, 32], 1.0, dtype, device);
    refused(
        &|| attend(three.clone(), pool.clone()),
        "the table 2 sequences",
    );
    let heads3 = rand4::<B>([2, 3, 1, 32], 1.0, dtype, device);
    refused(&|| attend(heads3.clone(), pool.clone()), "not a multiple");
    let other = if dtype == FloatDType::F32 {
        FloatDType::F16
    } else {
        FloatDType::F32
    };
    refused(&|| attend(q.clone().cast(other), pool.clone()), "dtype");
    let new = |s| rand4::<B>([2, 2, s, 32], 1.0, dtype, device);
    let append = |s: usize, rope: Option<&Rope<B>>, q: Option<Tensor<B, 4>>| {
        let _ = burn_flash::append_paged(pool.clone(), pool.clone(), &ok, new(s), new(s), rope, q);
    };
    refused(&|| append(13, None, None), "blocks of 16 hold");
    let short = Rope::<B>::new(10_000.0, 32, 24, true, device);
    refused(&|| append(8, Some(&short), None), "RoPE tables hold 24");
    let wide = Rope::<B>::new(10_000.0, 64, 64, true, device);
    refused(&|| append(1, Some(&wide), None), "R ≤ D");
    let q1 = rand4::<B>([2, 4, 1, 32], 1.0, dtype, device);
    refused(&|| append(1, None, Some(q1.clone())), "pass RoPE tables");
    // The append and the attention as one op refuse what either refuses, before either runs.
    let both = |s: usize, q: Tensor<B, 4>| {
        let (k, v) = (pool.clone(), pool.clone());
        let h = HeadTerms::default();
        let _ = burn_flash::append_attention_paged(k, v, &ok, new(s), new(s), q, None, h, options);
    };
    refused(
        &|| both(13, rand4::<B>([2, 4, 13, 32], 1.0, dtype, device)),
        "blocks of 16 hold",
    );
    refused(&|| both(2, q1.clone()), "expected [2, Hq, 2, 32]");
    refused(&|| both(1, heads3.clone()), "not a multiple");
    refused(&|| both(1, q1.clone().cast(other)), "dtype");
}

macro_rules! attention_suite {
    ($module:ident, $backend:ty, $dtype:expr) => {
        suite!(
            $module,
            $backend,
            $dtype,
            [
                shapes_and_options,
                causal,
                grouped_query_heads,
                masks_and_biases,
                large_logits_and_strided_inputs,
                gradients_match_burns_fallback,
                bad_input_is_refused,
                head_dims,
                sequence_lengths,
                planned_kernels,
                tiled_kernel,
                cooperative_matrix_kernel,
                tf32_products,
                masked_score_and_quiet,
                windows_and_alibi,
                bias_tiles,
                tile_schedules,
                attention_sinks,
                varlen,
                varlen_bad_input,
                split_decode,
                paged,
                paged_append,
                paged_bad_input,
                many_seeds,
            ]
        );
    };
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    type W = burn::backend::Wgpu;
    attention_suite!(f32, W, FloatDType::F32);
    attention_suite!(f16, W, FloatDType::F16);
    // Burn 0.21 cannot create zero-element tensors on CUDA: empty dims run here and on NdArray.
    suite!(empty, W, FloatDType::F32, [empty_dims]);
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    type C = burn::backend::Cuda;
    attention_suite!(f32, C, FloatDType::F32);
    attention_suite!(f16, C, FloatDType::F16);
    attention_suite!(bf16, C, FloatDType::BF16);
}

#[cfg(feature = "ndarray")]
mod ndarray {
    use super::*;
    type N = burn::backend::NdArray;
    attention_suite!(f32, N, FloatDType::F32);
    suite!(empty, N, FloatDType::F32, [empty_dims]);
}
