//! The attention backward suite: gradients of `burn_flash::attention` under `Autodiff<B>` for
//! every input (queries, keys, values, a tracked bias) against an f64 CPU reference, by
//! FlashAttention's rule: each gradient's error is at most twice that of a naive
//! implementation in the same dtype (a CPU model that rounds where a same-dtype composition
//! rounds: every stored score, `P`, `dP`, `dS` and output, with f32 accumulation), plus a floor.
//! Test bodies are generic over the backend and instantiated per backend and dtype at the
//! bottom.

mod common;

use burn::backend::Autodiff;
use burn::tensor::{FloatDType, Tensor, ops::AttentionModuleOptions};
use burn_flash::{
    AttentionBackwardKernel, AttentionDropout, AttentionKernel, BackwardOverlap,
    FlashAttentionOptions, FlashBackend, HeadTerms, ScoreTerms, VarlenBatch,
    attention::{AttentionDims, recent_backward_launches},
    attention_backward_plan, attention_backward_plan_with, attention_varlen, attention_with_heads,
    attention_with_lse,
    kernels::dropout::{DropoutParams, keep},
};
use common::attention_ref::{EXACT, Rounding, at, naive, naive_tf32, row_sequence};
use common::*;

type A<B> = Autodiff<B>;

/// One call's inputs (row-major f64 copies of the device values) and options.
struct Case {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    /// The output gradient.
    g: Vec<f64>,
    q_dims: [usize; 4],
    k_dims: [usize; 4],
    dv: usize,
    mask: Option<(Vec<bool>, [usize; 4])>,
    bias: Option<(Vec<f64>, [usize; 4])>,
    options: AttentionModuleOptions,
    /// Dropout, its mask drawn by the kernels' generator on the host.
    dropout: Option<DropoutParams>,
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

/// `dq`, `dk`, `dv`, `dbias` (at the bias's own shape), `dsinks`.
type Grads = [Vec<f64>; 5];

/// The relative error of a weight `e^(x − lse)` a backward rebuilds, in roundings of f32 (its
/// unit roundoff): the f32 lse it reads carries a few roundings of `|lse|` (max, log, sum, and
/// the log-add-exps of quiet softmax and a sink: 4 of them), which the weight takes as
/// relative error; and a GPU `exp` may be off by `3 + 2·|x − lse|` ulp (Vulkan's precision
/// rule; 2 roundings per ulp). The naive model rounds the lse once and takes an exact `exp`.
/// s46's landing CI: wgpu f32, quiet + sinks + mask + bias, `|lse|` 4.3, dSinks 7.1e-8 off
/// against 2 × naive 1.2e-8 + a floor of 4.2e-8 that followed the result, not the weights.
fn weight_rel(lse: f64, x: f64) -> f64 {
    4.0 * lse.abs() + 6.0 + 4.0 * (x - lse).abs()
}

/// What the rounding of the weights adds to the floors ([`weight_rel`]), in roundings of f32.
struct WeightBudget {
    /// Per head, `dSinks`'s: `√Σ (term · rel)²` over the head's rows, `term = p_sink·δ`.
    sinks: Vec<f64>,
    /// Every other gradient's: the largest `rel` of a row's largest weight (`x` its maximum
    /// score), over the rows; each gradient is a sum of terms that carry their row's weights.
    rows: f64,
}

impl Case {
    /// Forward and backward of attention under rounding `r`: scale, softcap, mask, causal, plus
    /// the bias, softmax (zeros for a row without a visible key), times `V`; then the gradients
    /// of `Σ out ⊙ g`. Query head `h` reads key/value head `h / (Hq / Hkv)`.
    ///
    /// Also returns what the weights' rounding adds to the floors ([`WeightBudget`]).
    fn grads(&self, r: Rounding) -> (Grads, WeightBudget) {
        let [nb, hq, sq, d] = self.q_dims;
        let [_, hkv, sk, _] = self.k_dims;
        let dv = self.dv;
        let group = hq / hkv;
        let scale = self.options.scale.unwrap_or(1.0 / (d as f64).sqrt());
        let v_dims = [nb, hkv, sk, dv];
        let o_dims = [nb, hq, sq, dv];
        // A sum of products: `mm` a matrix product's (operands rounded by `r.operand`), `dot`
        // an elementwise one's (δ).
        let sum =
            |a: &dyn Fn(usize) -> f64, b: &dyn Fn(usize) -> f64, n: usize, op: fn(f64) -> f64| {
                let mut s = 0.0;
                for c in 0..n {
                    s = (r.acc)(s + op(a(c)) * op(b(c)));
                }
                (r.store)(s)
            };
        let mm =
            |a: &dyn Fn(usize) -> f64, b: &dyn Fn(usize) -> f64, n: usize| sum(a, b, n, r.operand);
        let dot =
            |a: &dyn Fn(usize) -> f64, b: &dyn Fn(usize) -> f64, n: usize| sum(a, b, n, |x| x);
        let op = r.operand;
        let mut dq = vec![0.0; self.q.len()];
        let mut dk = vec![0.0; self.k.len()];
        let mut dvv = vec![0.0; self.v.len()];
        let bias_len = self.bias.as_ref().map_or(0, |(b, _)| b.len());
        let mut dbias = vec![0.0; bias_len];
        let mut dsinks = vec![0.0; self.sinks.as_ref().map_or(0, |s| s.len())];
        let mut sink_budget = vec![0.0; dsinks.len()];
        let mut row_budget = 0.0f64;
        for b in 0..nb {
            for h in 0..hq {
                let kh = h / group;
                for i in 0..sq {
                    // The row's sequence: its keys `k0 .. k1`, its last query `q1 − 1`.
                    let (k0, k1, q1) = row_sequence(self.packed.as_ref(), i, sq, sk);
                    let qi = |c: usize| self.q[at(self.q_dims, [b, h, i, c])];
                    let gi = |c: usize| self.g[at(o_dims, [b, h, i, c])];
                    // Scores, their softcap factor, visibility.
                    let mut s = vec![f64::NEG_INFINITY; sk];
                    let mut fac = vec![1.0; sk];
                    let mut vis = vec![false; sk];
                    let mut filled = vec![false; sk];
                    for j in 0..sk {
                        let kj = |c: usize| self.k[at(self.k_dims, [b, kh, j, c])];
                        let mut x = (r.store)(mm(&qi, &kj, d) * scale);
                        if let Some(cap) = self.options.softcap {
                            let t = (r.store)((x / cap).tanh());
                            fac[j] = 1.0 - t * t;
                            x = (r.store)(cap * t);
                        }
                        let masked = self
                            .mask
                            .as_ref()
                            .is_some_and(|(m, md)| m[at(*md, [b, h, i, j])]);
                        // Key `j`'s offset from the row's diagonal; the causal mask and the
                        // window as an explicit band.
                        let off = j as i64 - (i as i64 + k1 as i64 - q1 as i64);
                        let causal = self.options.is_causal && off > 0;
                        let outside = self
                            .window
                            .is_some_and(|(l, r)| off < -(l as i64) || off > r as i64)
                            || j < k0
                            || j >= k1;
                        let hidden = masked && self.fill.is_none();
                        vis[j] = !hidden && !causal && !outside;
                        if let Some((bias, bd)) = &self.bias {
                            x = (r.store)(x + bias[at(*bd, [b, h, i, j])]);
                        }
                        if let Some(slopes) = &self.slopes {
                            x = (r.store)(x - slopes[h] * off.abs() as f64);
                        }
                        if masked && let Some(fill) = self.fill {
                            // A constant: no gradient reaches the inputs or the bias.
                            x = fill;
                            filled[j] = true;
                        }
                        s[j] = x;
                    }
                    let m = (0..sk)
                        .filter(|&j| vis[j])
                        .fold(f64::NEG_INFINITY, |a, j| a.max(s[j]));
                    if m == f64::NEG_INFINITY {
                        continue;
                    }
                    let mut l = 0.0;
                    for j in 0..sk {
                        if vis[j] {
                            l = (r.acc)(l + (s[j] - m).exp());
                        }
                    }
                    if self.quiet {
                        // The `1` of `1 + Σ e^s` against the maximum.
                        l = (r.acc)(l + (-m).exp());
                    }
                    let sink = self.sinks.as_ref().map(|sinks| sinks[h]);
                    if let Some(sink) = sink {
                        l = (r.acc)(l + (sink - m).exp());
                    }
                    // A row whose weights all vanish (quiet softmax over only a fill score far
                    // below 0: `l` overflows, lse is +∞) adds no weight error to any sum.
                    let lse = (r.lse)(m + l.ln());
                    if lse.is_finite() {
                        row_budget = row_budget.max(weight_rel(lse, m));
                    }
                    let p: Vec<f64> = (0..sk)
                        .map(|j| match vis[j] {
                            true => (r.store)((s[j] - (r.lse)(m + l.ln())).exp()),
                            false => 0.0,
                        })
                        .collect();
                    // Dropout: the output takes the kept weights, scaled; dP flows back
                    // through the same mask.
                    let z: Vec<f64> = (0..sk)
                        .map(|j| match &self.dropout {
                            Some(d) if !keep(d, b * hq + h, i, j) => 0.0,
                            Some(d) => d.inv_keep() as f64,
                            None => 1.0,
                        })
                        .collect();
                    let pj = |j: usize| (r.store)(p[j] * z[j]);
                    let out: Vec<f64> = (0..dv)
                        .map(|c| mm(&pj, &|j| self.v[at(v_dims, [b, kh, j, c])], sk))
                        .collect();
                    let delta = dot(&gi, &|c| out[c], dv);
                    if let Some(sink) = sink {
                        // The sink's weight, without a value: dSink = −p_sink·δ.
                        let lse = (r.lse)(m + l.ln());
                        let p_sink = (sink - lse).exp();
                        dsinks[h] = (r.acc)(dsinks[h] - p_sink * delta);
                        sink_budget[h] += (p_sink * delta * weight_rel(lse, sink)).powi(2);
                    }
                    for j in 0..sk {
                        if p[j] == 0.0 {
                            continue;
                        }
                        let vj = |c: usize| self.v[at(v_dims, [b, kh, j, c])];
                        let dp = (r.store)(mm(&gi, &vj, dv) * z[j]);
                        let mut ds = (r.store)(p[j] * (r.store)(dp - delta));
                        if filled[j] {
                            ds = 0.0;
                        }
                        if let Some((_, bd)) = &self.bias {
                            let n = at(*bd, [b, h, i, j]);
                            dbias[n] = (r.acc)(dbias[n] + ds);
                        }
                        let dr = (r.store)(ds * fac[j] * scale);
                        for c in 0..d {
                            let n = at(self.q_dims, [b, h, i, c]);
                            dq[n] = (r.acc)(
                                dq[n] + op(dr) * op(self.k[at(self.k_dims, [b, kh, j, c])]),
                            );
                            let n = at(self.k_dims, [b, kh, j, c]);
                            dk[n] = (r.acc)(dk[n] + op(dr) * op(qi(c)));
                        }
                        for c in 0..dv {
                            let n = at(v_dims, [b, kh, j, c]);
                            dvv[n] = (r.acc)(dvv[n] + op(pj(j)) * op(gi(c)));
                        }
                    }
                }
            }
        }
        let grads = [dq, dk, dvv, dbias, dsinks].map(|g| g.into_iter().map(r.store).collect());
        let budget = WeightBudget {
            sinks: sink_budget.into_iter().map(f64::sqrt).collect(),
            rows: row_budget,
        };
        (grads, budget)
    }
}

/// Whether element `[b, h, i, j]` of a mask is masked out.
type MaskFn = fn([usize; 4]) -> bool;

/// Inputs of one gradient check; `strided` takes `q`, `k`, `v` as `[B, S, H, D]` tensors
/// swapped to `[B, H, S, D]` (the layout of an attention layer).
struct Setup {
    q: [usize; 4],
    kv_heads: usize,
    seq_k: usize,
    dv: usize,
    mask: Option<([usize; 4], MaskFn)>,
    /// The bias's shape.
    bias: Option<[usize; 4]>,
    /// The bias is tracked (its gradient is checked, and the backward writes `dS` for it).
    bias_tracked: bool,
    /// The bias is the swap of a `[.., Sk, Sq]` tensor: keys strided, rows that TMA cannot
    /// load (the Hopper kernels read it per element).
    bias_transposed: bool,
    options: AttentionModuleOptions,
    strided: bool,
    dropout: Option<AttentionDropout>,
    /// [`FlashAttentionOptions::masked_score`].
    fill: Option<f64>,
    /// [`FlashAttentionOptions::quiet`].
    quiet: bool,
    /// [`FlashAttentionOptions::kernel`] (the plan's where `None`).
    kernel: Option<AttentionKernel>,
    /// [`FlashAttentionOptions::window`].
    window: Option<(usize, usize)>,
    /// Random ALiBi slopes (`[Hq]`, f32) through [`attention_with_heads`].
    alibi: bool,
    /// Random attention sinks (`[Hq]`, f32, tracked: their gradient is checked).
    sinks: bool,
    /// Query and key lengths of a packed variable-length batch through [`attention_varlen`]
    /// (`q` then `[1, Hq, Σ lengths_q, D]`).
    packed: Option<(Vec<usize>, Vec<usize>)>,
    /// [`FlashAttentionOptions::deterministic`] set (else the plan defaults').
    deterministic: bool,
    /// [`FlashAttentionOptions::backward_overlap`] (the plan defaults' where `None`).
    overlap: Option<BackwardOverlap>,
    /// [`FlashAttentionOptions::tf32`] set (else the plan defaults').
    tf32: bool,
    /// [`FlashAttentionOptions::ampere_backward`] `Always` (else the plan defaults').
    ampere: bool,
}

impl Setup {
    fn new(q: [usize; 4], kv_heads: usize, seq_k: usize, dv: usize) -> Self {
        Self {
            q,
            kv_heads,
            seq_k,
            dv,
            mask: None,
            bias: None,
            bias_tracked: true,
            bias_transposed: false,
            options: AttentionModuleOptions::default(),
            strided: false,
            dropout: None,
            fill: None,
            quiet: false,
            kernel: None,
            window: None,
            alibi: false,
            sinks: false,
            packed: None,
            deterministic: false,
            overlap: None,
            tf32: false,
            ampere: false,
        }
    }

    /// The call's sizes, as the backward launches record them.
    fn dims(&self) -> AttentionDims {
        AttentionDims {
            batch: self.q[0],
            heads_q: self.q[1],
            heads_kv: self.kv_heads,
            seq_q: self.q[2],
            seq_k: self.seq_k,
            head_dim: self.q[3],
            value_dim: self.dv,
        }
    }
}

/// A random `[B, H, S, D]` tensor of `dtype`, as given or as the swap of a `[B, S, H, D]` one.
fn input<B: FlashBackend>(
    dims: [usize; 4],
    strided: bool,
    dtype: FloatDType,
    device: &B::Device,
) -> Tensor<B, 4> {
    match strided {
        false => random::<B, 4>(dims, -1.0, 1.0, dtype, device),
        true => {
            let [b, h, s, d] = dims;
            random::<B, 4>([b, s, h, d], -1.0, 1.0, dtype, device).swap_dims(1, 2)
        }
    }
}

/// Runs `setup` through `Autodiff<B>` and checks every gradient (module docs). Returns the
/// gradients (dq, dk, dv, dbias).
fn check<B: FlashBackend>(setup: &Setup, dtype: FloatDType, context: &str) -> Grads {
    let device: B::Device = Default::default();
    eprintln!("case: {context}");
    let [nb, hq, sq, d] = setup.q;
    let (hkv, sk, dv) = (setup.kv_heads, setup.seq_k, setup.dv);
    let k_dims = [nb, hkv, sk, d];
    let v_dims = [nb, hkv, sk, dv];
    let q = input::<A<B>>(setup.q, setup.strided, dtype, &device).require_grad();
    let k = input::<A<B>>(k_dims, setup.strided, dtype, &device).require_grad();
    let v = input::<A<B>>(v_dims, setup.strided, dtype, &device).require_grad();
    let g = random::<A<B>, 4>([nb, hq, sq, dv], -1.0, 1.0, dtype, &device);
    let mask = setup
        .mask
        .map(|(dims, f)| bool_mask::<A<B>, 4>(dims, &device, f));
    let bias = setup.bias.map(|[b, h, sq, sk]| {
        let bias = match setup.bias_transposed {
            true => random::<A<B>, 4>([b, h, sk, sq], -1.0, 1.0, dtype, &device).swap_dims(2, 3),
            false => random::<A<B>, 4>([b, h, sq, sk], -1.0, 1.0, dtype, &device),
        };
        if setup.bias_tracked {
            bias.require_grad()
        } else {
            bias
        }
    });
    let slopes = setup
        .alibi
        .then(|| random::<A<B>, 1>([hq], 0.02, 0.5, FloatDType::F32, &device));
    let sinks = setup
        .sinks
        .then(|| random::<A<B>, 1>([hq], -1.0, 1.0, FloatDType::F32, &device).require_grad());
    let case = Case {
        q: read(q.clone()),
        k: read(k.clone()),
        v: read(v.clone()),
        g: read(g.clone()),
        q_dims: setup.q,
        k_dims,
        dv,
        mask: mask.clone().map(|m| {
            let dims = m.dims();
            let values = read(m.int().float());
            (values.into_iter().map(|x| x != 0.0).collect(), dims)
        }),
        bias: bias.clone().map(|b| (read(b.clone()), b.dims())),
        options: setup.options,
        dropout: setup.dropout.and_then(|d| d.params()),
        fill: setup.fill,
        quiet: setup.quiet,
        window: setup.window,
        slopes: slopes.clone().map(read),
        sinks: sinks.clone().map(read),
        packed: setup.packed.as_ref().map(|(lq, lk)| {
            let cu = |l: &[usize]| {
                let mut cu = vec![0];
                l.iter().for_each(|&x| cu.push(cu[cu.len() - 1] + x));
                cu
            };
            (cu(lq), cu(lk))
        }),
    };
    for dims in [setup.q, k_dims, v_dims] {
        poison::<B, 4>(dims, dtype, &device);
    }
    let heads = HeadTerms {
        alibi_slopes: slopes,
        sinks: sinks.clone(),
    };
    let options = forward_kernel(
        FlashAttentionOptions {
            dropout: setup.dropout,
            masked_score: setup.fill,
            quiet: setup.quiet,
            kernel: setup.kernel,
            window: setup.window,
            deterministic: setup.deterministic.then_some(true),
            backward_overlap: setup.overlap,
            tf32: setup.tf32.then_some(true),
            ampere_backward: setup.ampere.then_some(burn_flash::AmpereUse::Always),
            ..setup.options.into()
        },
        dtype,
    );
    let out = match &setup.packed {
        None => {
            let (q, k, v, bias) = (q.clone(), k.clone(), v.clone(), bias.clone());
            attention_with_heads(q, k, v, mask, bias, heads, options).0
        }
        Some((lengths_q, lengths_k)) => {
            let batch = VarlenBatch::<A<B>>::from_lengths(lengths_q, lengths_k, &device);
            let tokens = |t: &Tensor<A<B>, 4>| t.clone().swap_dims(1, 2).squeeze_dim::<3>(0);
            let (out, _) = attention_varlen(
                tokens(&q),
                tokens(&k),
                tokens(&v),
                &batch,
                mask,
                bias.clone(),
                heads,
                options,
            );
            out.unsqueeze_dim::<4>(0).swap_dims(1, 2)
        }
    };
    let grads = (out * g).sum().backward();
    let mut got: Vec<Vec<f64>> = [&q, &k, &v]
        .iter()
        .map(|t| read(t.grad(&grads).expect("gradient")))
        .collect();
    got.push(match &bias {
        Some(b) if setup.bias_tracked => read(b.grad(&grads).expect("bias gradient")),
        Some(b) => {
            assert!(
                b.grad(&grads).is_none(),
                "an untracked bias has no gradient"
            );
            vec![]
        }
        None => vec![],
    });
    got.push(match &sinks {
        Some(s) => read(s.grad(&grads).expect("sinks gradient")),
        None => vec![],
    });
    sync::<B>(&device);
    let (mut want, budget) = case.grads(EXACT);
    // f32 with TF32 products where the plans take them (the setup's option, or the run's
    // `BURN_FLASH_TF32`): the naive model is TF32's.
    let dims = AttentionDims {
        batch: nb,
        heads_q: hq,
        heads_kv: hkv,
        seq_q: sq,
        seq_k: sk,
        head_dim: d,
        value_dim: dv,
    };
    // Either pass on TF32 (the forward takes head dims the TF32 backward does not: its `P`
    // and output then carry TF32's rounding into an exact backward).
    let tf32 = tf32_forward::<A<B>>(&device, dims, dtype, options)
        || dtype == FloatDType::F32
            && attention_backward_plan::<A<B>>(
                &device,
                dims,
                dtype.into(),
                options,
                setup.mask.is_some(),
                setup.bias.is_some(),
            )
            .and_then(Result::ok)
            .is_some_and(|p| p.config.tf32);
    let model = if tf32 { naive_tf32() } else { naive(dtype) };
    let (mut naive, _) = case.grads(model);
    if !setup.bias_tracked {
        // No bias gradient to check.
        want[3].clear();
        naive[3].clear();
    }
    let ctx = format!(
        "{context}: q {:?} k {k_dims:?} Dv {dv} {dtype:?} window {:?} alibi {} sinks {} packed {:?}",
        setup.q, setup.window, setup.alibi, setup.sinks, setup.packed
    );
    // f32: a few roundings of the largest gradient per `√n` of the longest sum — over the rows
    // of a group, the keys, or the head dims (`dS` takes `dO·Vᵀ − δ`, two sums over `Dv` that
    // cancel, so its error follows their terms; s29's CI: dK at Sq 1, Sk 17, D 32 was 11.4
    // roundings against a bound of 10.7 with the head dims left out); 16-bit: one.
    let floor = match dtype {
        FloatDType::F32 => ((hq / hkv * sq).max(sk).max(d).max(dv) as f64)
            .sqrt()
            .max(4.0),
        _ => 1.0,
    };
    for (n, name) in ["dq", "dk", "dv", "dbias", "dsinks"].iter().enumerate() {
        // dSinks sums B·Sq row terms `p_sink·δ` per head, each δ carrying the stored output's
        // rounding (one of the dtype's): its floor grows as √(B·Sq) roundings of the largest
        // (the naive model's own error is one sample of that sum; s34 c5: bf16 9.7e-5 against
        // 2 × 1.8e-5 + one rounding 5.4e-5, at B·Sq 74).
        // The weights' own error ([`WeightBudget`]) adds its budget, in roundings of f32,
        // converted to the floor's unit (roundings of the dtype's largest reference value; for
        // 16-bit dtypes it is a small share of one). s47: wgpu f32, quiet + fill + full mask +
        // bias, `dbias` 2.25e-7 off against 2 × naive 5.2e-8 + 1.41e-7 (0.92 of the bound, seed
        // 9802109583501754038; `|lse|` ≈ 3.7, the weights' error 4× the naive model's).
        let to_floor = eps(FloatDType::F32) / eps(dtype);
        let floor = match n {
            4 => {
                let sinks = budget.sinks.iter().fold(0.0f64, |a, &b| a.max(b));
                let unit = eps(dtype) * max_abs(&want[4]);
                let weights = match unit > 0.0 {
                    true => sinks * eps(FloatDType::F32) / unit,
                    false => 0.0,
                };
                floor.max(((nb * sq) as f64).sqrt()) + weights
            }
            _ => floor + budget.rows * to_floor,
        };
        assert_within_naive(
            &got[n],
            &naive[n],
            &want[n],
            dtype,
            floor,
            &format!("{ctx} {name}"),
        );
    }
    [
        got[0].clone(),
        got[1].clone(),
        got[2].clone(),
        got[3].clone(),
        got[4].clone(),
    ]
}

/// f32 with TF32 allowed ([`FlashAttentionOptions::tf32`]): on CUDA (sm_80+) the backward plan
/// runs the cooperative-matrix kernels on TF32 fragments, and the gradients stay within twice
/// a naive TF32 implementation's error (`check` takes that model where the plan says TF32) —
/// plain with `D ≠ Dv`, causal GQA with a mask, tracked bias and softcap, dropout, D 128;
/// elsewhere (wgpu, NdArray) and for 16-bit calls the option changes nothing.
fn tf32_training<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let dims = AttentionDims {
        batch: 2,
        heads_q: 4,
        heads_kv: 2,
        seq_q: 37,
        seq_k: 70,
        head_dim: 64,
        value_dim: 32,
    };
    let tf32 = FlashAttentionOptions {
        tf32: Some(true),
        ..Default::default()
    };
    let Some(plan) =
        attention_backward_plan::<A<B>>(device, dims, dtype.into(), tf32, false, false)
    else {
        return;
    };
    let plan = plan.expect("plan");
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    if cuda && dtype == FloatDType::F32 {
        assert_eq!(
            plan.kernel,
            AttentionBackwardKernel::CooperativeMatrix,
            "{plan:?}"
        );
        assert!(plan.config.tf32, "{plan:?}");
    } else {
        assert!(!plan.config.tf32, "{plan:?}");
    }
    let mut setup = Setup::new([2, 4, 37, 64], 2, 70, 32);
    setup.tf32 = true;
    check::<B>(&setup, dtype, "TF32: D 64, Dv 32, GQA");
    if cuda && dtype == FloatDType::F32 {
        let ran: Vec<_> = recent_backward_launches()
            .into_iter()
            .filter(|l| l.dims == dims)
            .map(|l| l.kernel)
            .collect();
        assert_launched(&ran, AttentionBackwardKernel::CooperativeMatrix, "TF32");
    }
    setup.mask = Some(([2, 1, 1, 70], |[b, _, _, j]| j + 9 * b + 5 >= 70));
    setup.bias = Some([1, 4, 37, 70]);
    setup.options = AttentionModuleOptions {
        scale: Some(0.3),
        softcap: Some(5.0),
        is_causal: true,
    };
    check::<B>(&setup, dtype, "TF32: causal, mask, tracked bias, softcap");
    setup.dropout = Some(AttentionDropout {
        prob: 0.2,
        seed: fresh_seed(),
    });
    check::<B>(&setup, dtype, "TF32: and dropout");
    let mut setup = Setup::new([1, 2, 130, 128], 2, 150, 128);
    setup.tf32 = true;
    setup.options.is_causal = true;
    check::<B>(&setup, dtype, "TF32: D 128, several blocks");
}

/// Odd sizes, several key and row blocks, `Sq ≠ Sk`, `Dv ≠ D`, custom scale and softcap.
fn shapes_and_options<B: FlashBackend>(_: &B::Device, dtype: FloatDType) {
    for (sq, sk, d, dv) in [(1, 17, 32, 32), (17, 45, 64, 48), (45, 17, 40, 24)] {
        let setup = Setup::new([2, 3, sq, d], 3, sk, dv);
        check::<B>(&setup, dtype, &format!("Sq {sq} Sk {sk} D {d} Dv {dv}"));
    }
    let mut setup = Setup::new([1, 2, 19, 64], 2, 40, 32);
    setup.options = AttentionModuleOptions {
        scale: Some(0.5),
        softcap: Some(3.0),
        is_causal: false,
    };
    check::<B>(&setup, dtype, "scale and softcap");
}

/// Causal, bottom-right aligned: `Sq = Sk`, `Sq < Sk`, `Sq > Sk` (the first rows see no key:
/// zero gradients), with blocks above the diagonal skipped.
fn causal<B: FlashBackend>(_: &B::Device, dtype: FloatDType) {
    for (sq, sk) in [(40, 40), (9, 70), (70, 9)] {
        let mut setup = Setup::new([2, 2, sq, 32], 2, sk, 32);
        setup.options.is_causal = true;
        check::<B>(&setup, dtype, &format!("causal Sq {sq} Sk {sk}"));
    }
}

/// Grouped-query heads (multi-query 8:1, 4:2 causal): `dK`, `dV` summed over each group.
fn grouped_query_heads<B: FlashBackend>(_: &B::Device, dtype: FloatDType) {
    for (hq, hkv, causal) in [(8, 1, false), (4, 2, true)] {
        let mut setup = Setup::new([2, hq, 13, 32], hkv, 37, 40);
        setup.options.is_causal = causal;
        check::<B>(&setup, dtype, &format!("GQA {hq}:{hkv}"));
    }
}

/// Padding and full masks (with fully masked rows), tracked biases broadcast over batch or
/// heads, softcap and causal together.
fn masks_and_biases<B: FlashBackend>(_: &B::Device, dtype: FloatDType) {
    let (nb, hq, sq, sk) = (2, 4, 11, 37);
    let mut setup = Setup::new([nb, hq, sq, 32], 2, sk, 16);
    setup.mask = Some(([nb, 1, 1, sk], |[b, _, _, j]| j + 5 * b + 3 >= 37));
    check::<B>(&setup, dtype, "padding mask");
    setup.mask = Some(([nb, hq, sq, sk], |[b, h, i, j]| {
        i == 3 || i == 10 || (b + h + i + j) % 3 == 0
    }));
    check::<B>(&setup, dtype, "full mask, fully masked rows");
    setup.mask = None;
    setup.bias = Some([1, hq, sq, sk]);
    check::<B>(&setup, dtype, "bias [1, H, Sq, Sk]");
    setup.bias = Some([nb, hq, sq, sk]);
    check::<B>(&setup, dtype, "bias [B, H, Sq, Sk]");
    setup.bias_tracked = false;
    check::<B>(&setup, dtype, "untracked bias [B, H, Sq, Sk]");
    setup.bias_tracked = true;
    setup.bias = Some([nb, 1, 1, sk]);
    setup.mask = Some(([nb, 1, 1, sk], |[b, _, _, j]| j + 5 * b + 3 >= 37));
    setup.options = AttentionModuleOptions {
        scale: Some(0.3),
        softcap: Some(4.0),
        is_causal: true,
    };
    check::<B>(&setup, dtype, "everything combined, bias [B, 1, 1, Sk]");
    // Several key blocks and query steps: a padding mask and a tracked [1, H, Sq, Sk] bias,
    // causal with Sq < Sk, grouped heads.
    let mut setup = Setup::new([2, 4, 70, 64], 2, 150, 64);
    setup.mask = Some(([2, 1, 1, 150], |[b, _, _, j]| j + 20 * b >= 140));
    setup.bias = Some([1, 4, 70, 150]);
    setup.options.is_causal = true;
    check::<B>(&setup, dtype, "mask and bias, Sq 70 Sk 150, causal");
    setup.bias_tracked = false;
    check::<B>(
        &setup,
        dtype,
        "mask and untracked bias, Sq 70 Sk 150, causal",
    );
}

/// burn-nn's mask semantics (a masked key takes a fill score and stays in the softmax, with no
/// gradient through it) and quiet softmax: fully masked rows, a fill score among the real ones
/// (0.5), tracked biases, several key blocks.
fn masked_score_and_quiet<B: FlashBackend>(_: &B::Device, dtype: FloatDType) {
    let (nb, hq, sq, sk) = (2, 4, 11, 37);
    let full: MaskFn = |[b, h, i, j]| i == 3 || i == 10 || (b + h + i + j) % 3 == 0;
    let padding: MaskFn = |[b, _, _, j]| j + 5 * b + 3 >= 37;
    let mut setup = Setup::new([nb, hq, sq, 32], 2, sk, 16);
    setup.mask = Some(([nb, hq, sq, sk], full));
    setup.fill = Some(-1e4);
    check::<B>(&setup, dtype, "burn-nn fill, fully masked rows");
    setup.fill = Some(0.5);
    setup.mask = Some(([nb, 1, 1, sk], padding));
    setup.bias = Some([nb, 1, 1, sk]);
    setup.options = AttentionModuleOptions {
        scale: Some(0.3),
        softcap: Some(4.0),
        is_causal: true,
    };
    check::<B>(&setup, dtype, "fill 0.5, padding, bias, softcap, causal");
    setup.bias_tracked = false;
    check::<B>(
        &setup,
        dtype,
        "fill 0.5, padding, untracked bias, softcap, causal",
    );
    let mut setup = Setup::new([nb, hq, sq, 32], 2, sk, 16);
    setup.quiet = true;
    setup.options.is_causal = true;
    check::<B>(&setup, dtype, "quiet, causal");
    setup.options.is_causal = false;
    setup.mask = Some(([nb, hq, sq, sk], full));
    setup.fill = Some(0.5);
    setup.bias = Some([1, hq, sq, sk]);
    check::<B>(&setup, dtype, "quiet, fill 0.5, full mask, bias");
    let mut setup = Setup::new([2, 4, 70, 64], 2, 150, 64);
    setup.mask = Some(([2, 1, 1, 150], |[b, _, _, j]| j + 20 * b >= 140));
    setup.fill = Some(0.5);
    setup.quiet = true;
    check::<B>(&setup, dtype, "quiet, fill 0.5, padding, Sq 70 Sk 150");
}

/// Head dims from 8 to 256, `Dv ≠ D`, and `[B, S, H, D]` inputs read through their strides.
fn head_dims_and_strides<B: FlashBackend>(_: &B::Device, dtype: FloatDType) {
    for (d, dv) in [(8, 8), (80, 96), (96, 64), (256, 256), (192, 136)] {
        let setup = Setup::new([1, 2, 21, d], 1, 34, dv);
        check::<B>(&setup, dtype, &format!("D {d} Dv {dv}"));
    }
    // A head dim over 128 over several key blocks and query steps, grouped and causal with
    // Sq ≠ Sk, Dv ≠ D (on Hopper: the wide backward, 64 keys per block, Dv in halves of 64).
    let mut setup = Setup::new([1, 4, 70, 256], 2, 150, 64);
    setup.options.is_causal = true;
    check::<B>(&setup, dtype, "D 256 Dv 64, Sq 70 Sk 150, causal, grouped");
    // D 128 over several key blocks and query steps, grouped and causal with Sq ≠ Sk (on
    // CUDA f16/bf16: the fused dQ's 2 × 2 split of a step over the planes, atomics from
    // three key blocks).
    let mut setup = Setup::new([1, 4, 70, 128], 2, 150, 64);
    setup.options.is_causal = true;
    check::<B>(&setup, dtype, "D 128, GQA 4:2, causal Sq 70 Sk 150");
    let mut setup = Setup::new([2, 4, 19, 32], 2, 35, 32);
    setup.strided = true;
    setup.options.is_causal = true;
    check::<B>(&setup, dtype, "[B, S, H, D] strides");
}

/// More (batch, head) pairs than a grid axis holds (65 535): `B·H = 70 400` runs forward and
/// backward (the grids fold the pairs over two axes).
fn many_heads<B: FlashBackend>(_: &B::Device, dtype: FloatDType) {
    let mut setup = Setup::new([1100, 64, 2, 8], 64, 3, 8);
    setup.options.is_causal = true;
    check::<B>(&setup, dtype, "B 1100 H 64");
}

/// Only some inputs tracked: the others get no gradient, the tracked ones the right one.
fn partly_tracked<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let q = random::<A<B>, 4>([1, 2, 9, 32], -1.0, 1.0, dtype, device);
    let k = random::<A<B>, 4>([1, 2, 20, 32], -1.0, 1.0, dtype, device);
    let v = random::<A<B>, 4>([1, 2, 20, 16], -1.0, 1.0, dtype, device).require_grad();
    let out = burn_flash::attention(q, k.clone(), v.clone(), None, None, Default::default());
    let grads = out.sum().backward();
    assert!(k.grad(&grads).is_none(), "untracked keys got a gradient");
    // d(Σ out)/dV[j] = Σ_i P[i, j]: every column of a key's gradient is the same, and the
    // gradient sums to the number of query rows (each row of P sums to 1).
    let dv = read(v.grad(&grads).expect("dv"));
    let total: f64 = dv.iter().sum::<f64>() / 16.0;
    assert!(
        (total - 18.0).abs() < 18.0 * 8.0 * eps(dtype),
        "Σ dV / Dv = {total}, expected 18 (2 heads × 9 rows)"
    );
}

/// The plan of each backward kernel, and that the planned kernels are the ones that ran: a
/// real backward of the plan's sizes (with and without a mask) leaves a launch record naming
/// them, and no other.
fn planned_kernels<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let dims = AttentionDims {
        batch: 3,
        heads_q: 8,
        heads_kv: 2,
        seq_q: 100,
        seq_k: 70,
        head_dim: 72,
        value_dim: 40,
    };
    // The options `check` runs with (the forward forced onto cooperative matrices, and the
    // backward with it, where the run asks).
    let options = forward_kernel(FlashAttentionOptions::default(), dtype);
    let plan = |mask: bool| {
        attention_backward_plan::<A<B>>(device, dims, dtype.into(), options, mask, false)
    };
    let Some(plain) = plan(false) else {
        // Only the stock-ops fallback has no plan, and it launches no backward kernel.
        let inner = attention_backward_plan::<B>(
            device,
            dims,
            dtype.into(),
            Default::default(),
            false,
            false,
        );
        assert!(inner.is_none());
        return;
    };
    let plain = plain.expect("plan");
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    let sixteen = dtype != FloatDType::F32;
    // The matrix units: `mma` on CUDA (cooperative matrices where the run forces them), the
    // cooperative matrices where the device has them and no `mma` (Vulkan through SPIR-V).
    let matrix = plain.kernel != AttentionBackwardKernel::Units;
    // The Hopper backward: where the forward's Hopper kernel is available (sm_90, 16-bit,
    // not switched off) and no other forward kernel is forced, for calls that write no `dS`
    // (no tracked bias).
    let hopper = options.kernel.is_none()
        && burn_flash::attention_plan::<B>(
            device,
            dims,
            dtype.into(),
            FlashAttentionOptions {
                kernel: Some(AttentionKernel::Hopper),
                ..options
            },
        )
        .is_some_and(|p| p.is_ok());
    // The Ampere backward: 16-bit CUDA calls with head dims up to 128, unless a forward kernel
    // is forced; by default where the Hopper backward does not take the call on the GPUs where
    // it has run (sm_90), for causal and grouped-query calls (the rule sets a GPU has verified
    // in it), or anywhere and with every score rule, ahead of the Hopper backward, where the
    // run asks (`BURN_FLASH_AMPERE_BWD=always`).
    let ampere_always = common::plan_inputs().ampere_backward == burn_flash::AmpereUse::Always;
    let ampere = cuda
        && sixteen
        && !cooperative_forced()
        && match common::plan_inputs().ampere_backward {
            burn_flash::AmpereUse::Always => true,
            burn_flash::AmpereUse::Faster => !hopper && cuda_sm90(),
            burn_flash::AmpereUse::Off => false,
        };
    if cuda && sixteen {
        let want = if cooperative_forced() {
            AttentionBackwardKernel::CooperativeMatrix
        } else if ampere {
            AttentionBackwardKernel::Ampere
        } else if hopper {
            AttentionBackwardKernel::Hopper
        } else {
            AttentionBackwardKernel::MatrixUnits
        };
        assert_eq!(plain.kernel, want);
    }
    if !cuda && matrix {
        assert!(sixteen, "{plain:?}");
        assert_eq!(plain.kernel, AttentionBackwardKernel::CooperativeMatrix);
    }
    if ampere {
        // Ampere: D 72 and Dv 40 rounded up to 128 and 64; blocks of 128 keys (64 where shared
        // memory is 99 KiB), 64 query rows per step; one block row per (key/value head, batch);
        // the Hopper backward's per-row kernels over 3 · 8 heads of 128 padded rows.
        let c = plain.config;
        assert_eq!((c.head_dim, c.value_dim, c.block_q), (128, 64, 64));
        assert!(matches!(plain.block_keys, 64 | 128), "{plain:?}");
        assert_eq!(c.block_k as usize, plain.block_keys);
        assert_eq!(plain.dkv_cubes, (70usize.div_ceil(plain.block_keys), 2, 3));
        assert_eq!(plain.dq_cubes, (3 * 8 * 128 / 8, 1, 1));
    } else if hopper {
        // Hopper: D 72 and Dv 40 rounded up to 128 and 64; blocks of 128 keys (1), 64 query
        // rows per step; one block row per (key/value head, batch); the per-row kernels over
        // 3 · 8 heads of 128 padded rows, 8 rows per block.
        let c = plain.config;
        assert_eq!(
            (c.head_dim, c.value_dim, c.block_q, c.block_k),
            (128, 64, 64, 128)
        );
        assert_eq!(plain.dkv_cubes, (1, 2, 3));
        assert_eq!(plain.dq_cubes, (3 * 8 * 128 / 8, 1, 1));
        // A head dim over 128: 64 keys per block (2), both head dims rounded up to 128 or 256.
        let wide = attention_backward_plan::<A<B>>(
            device,
            AttentionDims {
                head_dim: 192,
                ..dims
            },
            dtype.into(),
            options,
            false,
            false,
        )
        .expect("plan")
        .expect("plan");
        let c = wide.config;
        assert_eq!(wide.kernel, AttentionBackwardKernel::Hopper);
        assert_eq!(
            (c.head_dim, c.value_dim, c.block_k, wide.block_keys),
            (256, 128, 64, 64)
        );
        assert_eq!(wide.dkv_cubes, (2, 2, 3));
    } else if matrix {
        // f16/bf16 on the matrix units (either kind): D and Dv rounded up to 16; 64 query rows
        // per dQ cube (400 rows of a key/value head: 7 cubes), 64 keys per dK/dV cube (2
        // cubes), 32 per step; B·Hkv = 6.
        let c = plain.config;
        assert_eq!((c.head_dim, c.value_dim, c.block_k), (80, 48, 32));
        assert_eq!(plain.dkv_cubes, (2, 6, 1));
        assert_eq!(plain.dq_cubes, (7, 6, 1));
    } else {
        assert_eq!(plain.kernel, AttentionBackwardKernel::Units);
    }
    // A mask (or a bias) takes the plan of the same call without one: the matrix units on
    // CUDA f16/bf16; elsewhere the plain units, D and Dv in chunks of 64, 70 keys in blocks of
    // 64 (one column tile of 128: 2 cubes), 4·100 rows of a key/value head in blocks of 64
    // (7 cubes), keys in steps of 32.
    let masked = plan(true).expect("plan").expect("plan");
    // The plan carries the kernels' configuration: the mask is in it, the rest as without.
    assert!(masked.config.rules.mask && !plain.config.rules.mask);
    let launch = |p: &burn_flash::kernels::attention::AttentionBackwardPlan| {
        (p.kernel, p.config.tile(), p.dkv_cubes, p.dq_cubes)
    };
    if hopper {
        // A mask takes the Hopper backward too, or the Ampere one where the run forces it.
        if ampere {
            assert_eq!(masked.kernel, AttentionBackwardKernel::Ampere);
        } else {
            assert_eq!(launch(&masked), launch(&plain));
        }
        // A bias, tracked (`dS` written for its gradient) or not: the Hopper backward where TMA
        // loads its rows as tiles (Sk 72: rows of 144 bytes) or where the rows are broadcast
        // (read per element from cache), else the `mma.sync` one (a full bias read per element
        // measured slower; Sk 70: rows of 140 bytes), unless the run forces Hopper.
        let always = common::plan_inputs().hopper == burn_flash::HopperUse::Always;
        for (seq_k, broadcast, tracked) in [
            (70, false, true),
            (70, false, false),
            (72, false, true),
            (72, false, false),
            (70, true, true),
            (70, true, false),
        ] {
            let biased = attention_backward_plan_with::<A<B>>(
                device,
                AttentionDims { seq_k, ..dims },
                dtype.into(),
                options,
                ScoreTerms {
                    bias: true,
                    bias_tracked: tracked,
                    bias_rows_broadcast: broadcast,
                    ..Default::default()
                },
            )
            .expect("plan")
            .expect("plan");
            assert!(biased.config.rules.bias);
            assert_eq!(
                biased.kernel,
                if ampere {
                    AttentionBackwardKernel::Ampere
                } else if always || seq_k == 72 || broadcast {
                    AttentionBackwardKernel::Hopper
                } else {
                    AttentionBackwardKernel::MatrixUnits
                },
                "Sk {seq_k}, rows broadcast: {broadcast}, bias tracked: {tracked}"
            );
        }
    } else if ampere {
        // A mask leaves the Ampere backward for the `mma.sync` one unless the run forces it.
        let want = if ampere_always {
            AttentionBackwardKernel::Ampere
        } else {
            AttentionBackwardKernel::MatrixUnits
        };
        assert_eq!(masked.kernel, want);
    } else if matrix {
        assert_eq!(launch(&masked), launch(&plain));
    }
    if matrix {
        // Dropout takes the plan of the same call without it (Hopper's or the matrix units'),
        // or under the Ampere backward the masked call's kernels (the Ampere backward's where
        // the run forces it, else the `mma.sync` one's: a rule set no GPU has verified there).
        let dropout = FlashAttentionOptions {
            dropout: Some(AttentionDropout { prob: 0.1, seed: 7 }),
            ..options
        };
        let dropped =
            attention_backward_plan::<A<B>>(device, dims, dtype.into(), dropout, false, false)
                .expect("plan")
                .expect("plan");
        assert!(dropped.config.rules.dropout);
        if ampere {
            assert_eq!(dropped.kernel, masked.kernel);
        } else {
            assert_eq!(launch(&dropped), launch(&plain));
        }
    } else {
        assert_eq!(masked.kernel, AttentionBackwardKernel::Units);
        let c = masked.config;
        assert_eq!((c.head_dim, c.value_dim), (128, 64));
        assert_eq!((masked.block_keys, c.block_q, c.block_k), (64, 64, 32));
        assert_eq!(masked.dkv_cubes, (2, 6, 1));
        assert_eq!(masked.dq_cubes, (7, 6, 1));
    }
    let too_wide = AttentionDims {
        head_dim: 320,
        ..dims
    };
    let err = attention_backward_plan::<A<B>>(
        device,
        too_wide,
        dtype.into(),
        Default::default(),
        false,
        false,
    );
    assert!(matches!(err, Some(Err(_))), "head dim 320 must be refused");

    // Run both: the launch record must name the planned kernels (no other test has these
    // sizes; the record is per process, so only launches of exactly `dims` are looked at).
    let mut setup = Setup::new([3, 8, 100, 72], 2, 70, 40);
    check::<B>(&setup, dtype, "planned kernels, no mask");
    // Dropout's launches are among the unmasked ones: they must take the same kernels.
    setup.dropout = Some(AttentionDropout {
        prob: 0.2,
        seed: fresh_seed(),
    });
    check::<B>(&setup, dtype, "planned kernels, dropout");
    setup.dropout = None;
    setup.mask = Some(([3, 1, 1, 70], |[b, _, _, j]| j + 7 * b >= 66));
    check::<B>(&setup, dtype, "planned kernels, padding mask");
    let ran: Vec<_> = recent_backward_launches()
        .into_iter()
        .filter(|l| l.dims == dims)
        .collect();
    for (mask, want) in [(false, plain.kernel), (true, masked.kernel)] {
        let kernels: Vec<_> = ran
            .iter()
            .filter(|l| l.mask == mask)
            .map(|l| l.kernel)
            // Under the Ampere backward by default, dropout's launches (unmasked) take the
            // masked call's kernels.
            .filter(|&k| !(ampere && !mask && k == masked.kernel && k != plain.kernel))
            .collect();
        assert_launched(&kernels, want, &format!("mask {mask}"));
    }
    // A tracked bias broadcast along the rows (Sq 99: sizes of their own): the kernel the plan
    // names for it (the Hopper backward on sm_90, reading it per element).
    let rows = AttentionDims { seq_q: 99, ..dims };
    let terms = ScoreTerms {
        bias: true,
        bias_tracked: true,
        bias_rows_broadcast: true,
        ..Default::default()
    };
    let want = attention_backward_plan_with::<A<B>>(device, rows, dtype.into(), options, terms)
        .expect("plan")
        .expect("plan");
    let mut setup = Setup::new([3, 8, 99, 72], 2, 70, 40);
    setup.bias = Some([3, 1, 1, 70]);
    check::<B>(&setup, dtype, "planned kernels, bias [B, 1, 1, Sk]");
    let kernels: Vec<_> = recent_backward_launches()
        .into_iter()
        .filter(|l| l.dims == rows)
        .map(|l| l.kernel)
        .collect();
    assert_launched(&kernels, want.kernel, "bias [B, 1, 1, Sk]");

    // f16/bf16 at head dim 64 on the matrix units: the same kernels.
    if matrix {
        let even = AttentionDims {
            head_dim: 64,
            ..dims
        };
        let planned =
            attention_backward_plan::<A<B>>(device, even, dtype.into(), options, false, false)
                .expect("plan")
                .expect("plan");
        assert_eq!(planned.kernel, plain.kernel);
        if planned.kernel == AttentionBackwardKernel::MatrixUnits {
            assert_eq!(planned.matrix_units, None);
        }
        check::<B>(
            &Setup::new([3, 8, 100, 64], 2, 70, 40),
            dtype,
            "planned kernels, D 64",
        );
        let kernels: Vec<_> = recent_backward_launches()
            .into_iter()
            .filter(|l| l.dims == even)
            .map(|l| l.kernel)
            .collect();
        assert!(
            !kernels.is_empty() && kernels.iter().all(|&k| k == planned.kernel),
            "D 64: planned {:?}, launched {kernels:?}",
            planned.kernel
        );
    }
}

/// Dropout's forward and backward against the reference with the mask materialised from the
/// kernels' generator on the host: the backward sees exactly the forward's mask.
fn dropout_gradients<B: FlashBackend>(_: &B::Device, dtype: FloatDType) {
    let mut setup = Setup::new([2, 4, 23, 32], 2, 41, 24);
    setup.dropout = Some(AttentionDropout {
        prob: 0.3,
        seed: fresh_seed(),
    });
    check::<B>(&setup, dtype, "dropout 0.3");
    setup.mask = Some(([2, 1, 1, 41], |[b, _, _, j]| j + 5 * b + 3 >= 41));
    setup.bias = Some([1, 4, 23, 41]);
    setup.options = AttentionModuleOptions {
        scale: Some(0.3),
        softcap: Some(4.0),
        is_causal: true,
    };
    setup.dropout = Some(AttentionDropout {
        prob: 0.1,
        seed: fresh_seed(),
    });
    check::<B>(&setup, dtype, "dropout 0.1, everything combined");
    setup.bias_tracked = false;
    check::<B>(
        &setup,
        dtype,
        "dropout 0.1, everything combined, untracked bias",
    );
}

/// The weights `P̃` of one call, read as the output of `V = I` (`Dv = Sk`).
fn dropped_weights<B: FlashBackend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    dropout: Option<AttentionDropout>,
) -> Vec<f64> {
    let [nb, hkv, sk, _] = k.dims();
    let mut eye = vec![0.0f32; nb * hkv * sk * sk];
    for n in 0..nb * hkv {
        for j in 0..sk {
            eye[(n * sk + j) * sk + j] = 1.0;
        }
    }
    let v = tensor::<B, 4>(eye, [nb, hkv, sk, sk], q.dtype().into(), &q.device());
    let options = FlashAttentionOptions {
        dropout,
        ..Default::default()
    };
    let options = forward_kernel(options, q.dtype().into());
    let (out, _) = attention_with_lse(q.clone(), k.clone(), v, None, None, options);
    read(out)
}

/// The keep rate is `1 − p` within five binomial standard deviations, the kept weights are
/// exactly those the host generator keeps, scaled by `1 / (1 − p)`; other seeds draw other
/// masks, the same seed the same one; `p = 0` is bit-identical to no dropout.
fn dropout_mask<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (nb, h, sq, sk) = (2, 2, 64, 64);
    // With TF32 products (the run's `BURN_FLASH_TF32=1`) each weight is rounded to TF32 as
    // `P·V`'s operand: 2⁻¹¹ of it.
    let rel = match tf32_by_default(device, dtype) {
        true => 2.0f64.powi(-10),
        false => 4.0 * eps(dtype),
    };
    let q = random::<B, 4>([nb, h, sq, 32], -1.0, 1.0, dtype, device);
    let k = random::<B, 4>([nb, h, sk, 32], -1.0, 1.0, dtype, device);
    let plain = dropped_weights::<B>(&q, &k, None);
    for prob in [0.2, 0.5] {
        let seed = fresh_seed();
        let dropout = Some(AttentionDropout { prob, seed });
        let params = DropoutParams::new(prob, seed);
        let got = dropped_weights::<B>(&q, &k, dropout);
        let mut kept = 0usize;
        for pair in 0..nb * h {
            for i in 0..sq {
                for j in 0..sk {
                    let n = (pair * sq + i) * sk + j;
                    let want_keep = keep(&params, pair, i, j);
                    let want = if want_keep {
                        plain[n] / (1.0 - prob)
                    } else {
                        0.0
                    };
                    assert!(
                        (got[n] - want).abs() <= rel * want.abs() + 1e-7,
                        "p {prob}: weight ({pair}, {i}, {j}) = {}, want {want} (kept: {want_keep})",
                        got[n]
                    );
                    kept += want_keep as usize;
                }
            }
        }
        let n = (nb * h * sq * sk) as f64;
        let rate = kept as f64 / n;
        let sigma = (prob * (1.0 - prob) / n).sqrt();
        assert!(
            (rate - (1.0 - prob)).abs() <= 5.0 * sigma,
            "p {prob}: keep rate {rate}, expected {} ± {}",
            1.0 - prob,
            5.0 * sigma
        );
        let again = dropped_weights::<B>(&q, &k, dropout);
        assert_eq!(
            got, again,
            "p {prob}: the same seed must draw the same mask"
        );
        let other = dropped_weights::<B>(
            &q,
            &k,
            Some(AttentionDropout {
                prob,
                seed: seed ^ 1,
            }),
        );
        let differ = got
            .iter()
            .zip(&other)
            .filter(|(a, b)| (**a == 0.0) != (**b == 0.0))
            .count();
        assert!(
            differ as f64 > 0.25 * n * prob * (1.0 - prob),
            "p {prob}: seeds {seed} and {} drew masks differing at only {differ} weights",
            seed ^ 1
        );
    }
    let zero = dropped_weights::<B>(&q, &k, Some(AttentionDropout { prob: 0.0, seed: 7 }));
    assert_eq!(zero, plain, "p = 0 must be bit-identical to no dropout");
    // Out-of-range probabilities are refused before anything runs.
    for prob in [1.0, -0.1, f64::NAN] {
        let msg = panic_message(|| {
            dropped_weights::<B>(&q, &k, Some(AttentionDropout { prob, seed: 1 }));
        });
        assert!(
            msg.contains("dropout probability must be in [0, 1)"),
            "p {prob}: {msg}"
        );
    }
    // Dropout runs on the matrix-unit and plain-unit forwards: forcing the tiled kernel is
    // refused.
    let dims = AttentionDims {
        batch: nb,
        heads_q: h,
        heads_kv: h,
        seq_q: sq,
        seq_k: sk,
        head_dim: 32,
        value_dim: sk,
    };
    let options = FlashAttentionOptions {
        kernel: Some(AttentionKernel::Tiled),
        dropout: Some(AttentionDropout { prob: 0.1, seed: 1 }),
        ..Default::default()
    };
    if let Some(plan) = burn_flash::attention_plan::<B>(device, dims, dtype.into(), options) {
        let err = plan.expect_err("tiled kernel with dropout");
        assert!(err.to_string().contains("dropout"), "{err}");
    }
    sync::<B>(device);
}

/// The rule over many random inputs: `BURN_FLASH_SEEDS` draws (default 1; the GPU run sets a
/// few hundred) of a GQA case with a padding mask, a tracked bias, softcap, causal and dropout,
/// all in one process (the kernels compile once).
fn many_seeds<B: FlashBackend>(_: &B::Device, dtype: FloatDType) {
    let draws: usize = std::env::var("BURN_FLASH_SEEDS")
        .ok()
        .map(|s| s.parse().expect("BURN_FLASH_SEEDS: a count"))
        .unwrap_or(1);
    for n in 0..draws {
        let mut setup = Setup::new([2, 4, 21, 32], 2, 45, 24);
        setup.mask = Some(([2, 1, 1, 45], |[b, _, _, j]| j + 7 * b + 2 >= 45));
        setup.bias = Some([2, 1, 21, 45]);
        setup.options = AttentionModuleOptions {
            scale: Some(0.4),
            softcap: Some(5.0),
            is_causal: n % 2 == 0,
        };
        setup.dropout = (n % 3 == 0).then(|| AttentionDropout {
            prob: 0.2,
            seed: fresh_seed(),
        });
        check::<B>(&setup, dtype, &format!("draw {n} of {draws}"));
    }
}

/// The cooperative-matrix backward, with the forward forced onto cooperative matrices (the
/// plan's choice for f16/bf16 on Vulkan through SPIR-V; offered on CUDA as `wmma`): GQA 4:2
/// with causal `Sq ≠ Sk`, a padding mask, a tracked bias, softcap and scale; dropout; burn-nn's
/// fill score and quiet softmax with fully masked rows; `[B, S, H, D]` inputs with odd head
/// dims (`D` 40, `Dv` 24); `D = Dv = 128` over several key blocks and row steps. The backward
/// plan names the cooperative kernels and they are the ones that ran. Where the device offers
/// no cooperative matrix for the dtype, forcing the forward is refused before any launch.
fn cooperative_backward<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let forced = FlashAttentionOptions {
        kernel: Some(AttentionKernel::CooperativeMatrix),
        ..Default::default()
    };
    let dims = AttentionDims {
        batch: 2,
        heads_q: 4,
        heads_kv: 2,
        seq_q: 37,
        seq_k: 70,
        head_dim: 64,
        value_dim: 32,
    };
    let Some(forward) = burn_flash::attention_plan::<B>(device, dims, dtype.into(), forced) else {
        return;
    };
    if let Err(err) = forward {
        assert!(
            err.to_string()
                .contains("CooperativeMatrix is not available"),
            "{err}"
        );
        return;
    }
    let planned = attention_backward_plan::<A<B>>(device, dims, dtype.into(), forced, true, true)
        .expect("plan")
        .expect("plan");
    assert_eq!(planned.kernel, AttentionBackwardKernel::CooperativeMatrix);

    let mut setup = Setup::new([2, 4, 37, 64], 2, 70, 32);
    setup.kernel = Some(AttentionKernel::CooperativeMatrix);
    setup.mask = Some(([2, 1, 1, 70], |[b, _, _, j]| j + 9 * b + 5 >= 70));
    setup.bias = Some([1, 4, 37, 70]);
    setup.options = AttentionModuleOptions {
        scale: Some(0.3),
        softcap: Some(5.0),
        is_causal: true,
    };
    check::<B>(
        &setup,
        dtype,
        "cooperative: GQA, causal, mask, bias, softcap",
    );
    let ran: Vec<_> = recent_backward_launches()
        .into_iter()
        .filter(|l| l.dims == dims)
        .map(|l| l.kernel)
        .collect();
    assert!(
        !ran.is_empty()
            && ran
                .iter()
                .all(|&k| k == AttentionBackwardKernel::CooperativeMatrix),
        "launched {ran:?}"
    );
    setup.dropout = Some(AttentionDropout {
        prob: 0.2,
        seed: fresh_seed(),
    });
    check::<B>(&setup, dtype, "cooperative: everything and dropout");

    let mut setup = Setup::new([2, 2, 23, 32], 2, 41, 32);
    setup.kernel = Some(AttentionKernel::CooperativeMatrix);
    setup.mask = Some(([2, 2, 23, 41], |[b, h, i, j]| {
        i == 4 || (b + h + i + j) % 3 == 0
    }));
    setup.fill = Some(-1e4);
    setup.quiet = true;
    check::<B>(
        &setup,
        dtype,
        "cooperative: fill score, quiet, fully masked rows",
    );

    let mut setup = Setup::new([1, 2, 45, 40], 1, 33, 24);
    setup.kernel = Some(AttentionKernel::CooperativeMatrix);
    setup.strided = true;
    check::<B>(&setup, dtype, "cooperative: [B, S, H, D], D 40, Dv 24");

    let mut setup = Setup::new([1, 2, 130, 128], 2, 150, 128);
    setup.kernel = Some(AttentionKernel::CooperativeMatrix);
    setup.options.is_causal = true;
    check::<B>(&setup, dtype, "cooperative: D 128, several blocks");
}

/// Whether the Hopper kernels can be forced on this device for `dtype`; where they cannot,
/// that forcing them is refused with an error before any launch.
#[cfg(feature = "cuda")]
fn hopper_forced_available<B: FlashBackend>(device: &B::Device, dtype: FloatDType) -> bool {
    let probe = AttentionDims {
        batch: 2,
        heads_q: 4,
        heads_kv: 2,
        seq_q: 200,
        seq_k: 150,
        head_dim: 64,
        value_dim: 64,
    };
    let forced = FlashAttentionOptions {
        kernel: Some(AttentionKernel::Hopper),
        ..Default::default()
    };
    let available = burn_flash::attention_plan::<B>(device, probe, dtype.into(), forced)
        .expect("a CUDA backend plans attention");
    if let Err(err) = available {
        let text = err.to_string();
        assert!(text.contains("Hopper") || text.contains("sm_90"), "{text}");
        eprintln!("no Hopper kernels on this device: {text}");
        return false;
    }
    true
}

/// Checks `setup`'s gradients with the forward's kernel forced onto Hopper (the backward
/// follows it), then that every backward launch of its sizes ran `want` (with a tracked bias,
/// the launches that wrote `dS`), with the bias loaded by TMA as tiles where `tiles` says so.
#[cfg(feature = "cuda")]
fn check_forced<B: FlashBackend>(
    setup: &mut Setup,
    dtype: FloatDType,
    context: &str,
    want: AttentionBackwardKernel,
    tiles: Option<bool>,
) {
    setup.kernel = Some(AttentionKernel::Hopper);
    let dims = setup.dims();
    check::<B>(setup, dtype, context);
    let ds = setup.bias.is_some() && setup.bias_tracked;
    let ran: Vec<_> = recent_backward_launches()
        .into_iter()
        .filter(|l| l.dims == dims && l.ds == ds)
        .collect();
    assert!(
        !ran.is_empty()
            && ran
                .iter()
                .all(|l| l.kernel == want && tiles.is_none_or(|t| l.bias_tiles == t)),
        "{context}: want {want:?} (bias tiles {tiles:?}), launched {ran:?}"
    );
}

/// The Hopper backward writing `dS` for a tracked bias, with the forward's kernel forced onto
/// Hopper (the plan takes it only for biases TMA loads as tiles): several key blocks and query
/// steps; causal with `Sq > Sk`, whose second key block skips the first two query blocks (their
/// `dS` rows are written as zeros); GQA with a padding mask; burn-nn's fill score with dropout;
/// D 192 (rounded up to 256: the wide kernel, 64 keys per block). Each call's launch is checked:
/// the Hopper backward writing `dS`, and the `mma.sync` one under a softcap. Where the device
/// has no Hopper kernels, the forced kernel must be refused with an error before any launch.
/// (CUDA's suites only.)
#[cfg(feature = "cuda")]
fn hopper_tracked_bias<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    if !hopper_forced_available::<B>(device, dtype) {
        return;
    }
    let hopper = AttentionBackwardKernel::Hopper;
    let mut setup = Setup::new([2, 4, 200, 64], 2, 150, 64);
    setup.bias = Some([1, 4, 200, 150]);
    setup.options.is_causal = true;
    let context = "Hopper dS: causal Sq 200 Sk 150, bias [1, H, Sq, Sk]";
    check_forced::<B>(&mut setup, dtype, context, hopper, None);
    let mut setup = Setup::new([2, 4, 70, 128], 2, 300, 96);
    setup.mask = Some(([2, 1, 1, 300], |[b, _, _, j]| j + 40 * b >= 290));
    setup.bias = Some([2, 4, 70, 300]);
    let context = "Hopper dS: GQA, padding mask, D 128 Dv 96";
    check_forced::<B>(&mut setup, dtype, context, hopper, None);
    setup.mask = Some(([2, 4, 70, 300], |[b, h, i, j]| {
        i == 3 || (b + h + i + j) % 3 == 0
    }));
    setup.fill = Some(0.5);
    setup.dropout = Some(AttentionDropout {
        prob: 0.2,
        seed: 11,
    });
    let context = "Hopper dS: fill 0.5, dropout";
    check_forced::<B>(&mut setup, dtype, context, hopper, None);
    let mut setup = Setup::new([1, 2, 90, 192], 2, 140, 128);
    setup.bias = Some([1, 2, 90, 140]);
    setup.options.is_causal = true;
    let context = "Hopper dS: wide, D 192, causal";
    check_forced::<B>(&mut setup, dtype, context, hopper, None);
    // Sizes of its own (the launches are told apart by their dims), D ≤ 128 for `mma.sync`.
    let mut setup = Setup::new([1, 2, 90, 64], 2, 140, 64);
    setup.bias = Some([1, 2, 90, 140]);
    setup.options.is_causal = true;
    setup.options.softcap = Some(5.0);
    let context = "Hopper forced, dS under a softcap: mma.sync";
    let mma = AttentionBackwardKernel::MatrixUnits;
    check_forced::<B>(&mut setup, dtype, context, mma, None);
}

/// The Ampere backward (`flash/backward/sm80.cu`, forced: `AmpereUse::Always`) with every score
/// rule it takes, each call against the f64 reference and its launch checked (the Ampere
/// backward, writing `dS` where the bias is tracked): softcap with causal GQA; a padding mask
/// (hidden keys) with dropout; an element mask with burn-nn's fill score, quiet softmax and
/// `Dv ≠ D`; a tracked `[1, H, Sq, Sk]` bias, causal with `Sq > Sk` (the rows a key block skips
/// get zero `dS`); a bias broadcast along the rows with ALiBi and a window; a causal window with
/// sinks; a tracked bias read through swapped strides with a mask and dropout (`dS` under
/// dropout); packed sequences, causal, with ALiBi. Several key blocks and row steps each; D 64
/// and 128. Where the device has no Ampere backward (before sm_80) the values alone are checked.
/// (CUDA's 16-bit suites only.)
#[cfg(feature = "cuda")]
fn ampere_backward_rules<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let ampere = AttentionBackwardKernel::Ampere;
    let forced = FlashAttentionOptions {
        ampere_backward: Some(burn_flash::AmpereUse::Always),
        ..Default::default()
    };
    let probe = Setup::new([1, 2, 64, 64], 2, 64, 64);
    let available =
        attention_backward_plan::<A<B>>(device, probe.dims(), dtype.into(), forced, false, false)
            .and_then(Result::ok)
            .is_some_and(|p| p.kernel == ampere);
    if !available {
        eprintln!("no Ampere backward on {device:?}: values only");
    }
    let seed = fresh_seed();
    let dropout = Some(AttentionDropout { prob: 0.2, seed });
    let mut cases = Vec::new();
    let mut setup = Setup::new([2, 4, 150, 64], 2, 300, 64);
    setup.options.softcap = Some(5.0);
    setup.options.is_causal = true;
    cases.push((setup, "softcap, causal, GQA"));
    let mut setup = Setup::new([2, 2, 130, 128], 2, 260, 128);
    setup.mask = Some(([2, 1, 1, 260], |[b, _, _, j]| j + 40 * b >= 250));
    setup.dropout = dropout;
    cases.push((setup, "padding mask, dropout"));
    let mut setup = Setup::new([2, 4, 70, 128], 2, 300, 96);
    setup.mask = Some(([2, 4, 70, 300], |[b, h, i, j]| {
        i == 3 || (b + h + i + j) % 3 == 0
    }));
    setup.fill = Some(0.5);
    setup.quiet = true;
    cases.push((setup, "element mask, fill 0.5, quiet, Dv 96"));
    let mut setup = Setup::new([2, 4, 200, 64], 2, 150, 64);
    setup.bias = Some([1, 4, 200, 150]);
    setup.options.is_causal = true;
    cases.push((setup, "tracked bias, causal Sq 200 > Sk 150"));
    let mut setup = Setup::new([1, 4, 180, 64], 2, 333, 64);
    setup.bias = Some([1, 1, 1, 333]);
    setup.bias_tracked = false;
    setup.alibi = true;
    setup.window = Some((40, 10));
    cases.push((setup, "bias [1, 1, 1, Sk], ALiBi, window (40, 10)"));
    let mut setup = Setup::new([1, 2, 257, 128], 1, 257, 128);
    setup.options.is_causal = true;
    setup.window = Some((64, 0));
    setup.sinks = true;
    cases.push((setup, "causal window (64, 0), sinks"));
    let mut setup = Setup::new([2, 2, 100, 64], 1, 200, 64);
    setup.bias = Some([2, 2, 100, 200]);
    setup.bias_transposed = true;
    setup.mask = Some(([2, 1, 1, 200], |[b, _, _, j]| j + 30 * b >= 185));
    setup.dropout = dropout;
    cases.push((setup, "tracked bias (swapped strides), mask, dropout"));
    let (lengths_q, lengths_k) = (vec![70usize, 130, 33], vec![90usize, 130, 200]);
    let mut setup = Setup::new([1, 4, 233, 64], 2, 420, 64);
    setup.options.is_causal = true;
    setup.alibi = true;
    setup.packed = Some((lengths_q, lengths_k));
    cases.push((setup, "packed sequences, causal, ALiBi"));
    for (mut setup, what) in cases {
        setup.ampere = true;
        let context = format!("Ampere backward (seed {seed}): {what}");
        check::<B>(&setup, dtype, &context);
        if available {
            let ds = setup.bias.is_some() && setup.bias_tracked;
            let ran: Vec<_> = recent_backward_launches()
                .into_iter()
                .filter(|l| l.dims == setup.dims())
                .collect();
            assert!(
                !ran.is_empty() && ran.iter().all(|l| l.kernel == ampere && l.ds == ds),
                "{context}: want the Ampere backward (dS written: {ds}), launched {ran:?}"
            );
        }
    }
}

/// Biases through the Hopper backward (forced, so that every case runs it whichever kernel the
/// plan would take): rows of whole 16 bytes load by TMA per step into the `dSᵀ` buffer of the step's
/// parity — `[1, H, Sq, Sk]` tracked at D 64 over three key blocks, the last of 8 keys (its
/// second 64-key atom wholly past `Sk`, read as zeros) and rows past `Sq`; `[B, 1, Sq, Sk]`
/// untracked at D 128, causal, with a padding mask; `[B, H, Sq, Sk]` tracked with ALiBi and
/// dropout; the wide kernel (D 192: both consumers read one 64-key tile) causal — and a bias
/// with strided keys, read per element. Each launch is checked: the Hopper backward, the bias
/// by TMA or not as said. (CUDA's suites only.)
#[cfg(feature = "cuda")]
fn hopper_bias_tiles<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    if !hopper_forced_available::<B>(device, dtype) {
        return;
    }
    let hopper = AttentionBackwardKernel::Hopper;
    let mut setup = Setup::new([2, 4, 200, 64], 2, 264, 64);
    setup.bias = Some([1, 4, 200, 264]);
    let context = "bias tiles: D 64, [1, H, Sq, Sk] tracked, Sk 264";
    check_forced::<B>(&mut setup, dtype, context, hopper, Some(true));
    let mut setup = Setup::new([2, 4, 130, 128], 2, 136, 128);
    setup.bias = Some([2, 1, 130, 136]);
    setup.bias_tracked = false;
    setup.options.is_causal = true;
    setup.mask = Some(([2, 1, 1, 136], |[b, _, _, j]| j + 9 * b + 5 >= 136));
    let context = "bias tiles: D 128 causal, [B, 1, Sq, Sk] untracked, padding mask";
    check_forced::<B>(&mut setup, dtype, context, hopper, Some(true));
    let mut setup = Setup::new([2, 4, 70, 128], 2, 200, 128);
    setup.bias = Some([2, 4, 70, 200]);
    setup.alibi = true;
    setup.dropout = Some(AttentionDropout { prob: 0.2, seed: 5 });
    let context = "bias tiles: D 128, [B, H, Sq, Sk] tracked, ALiBi, dropout";
    check_forced::<B>(&mut setup, dtype, context, hopper, Some(true));
    let mut setup = Setup::new([1, 2, 90, 192], 2, 144, 128);
    setup.bias = Some([1, 2, 90, 144]);
    setup.options.is_causal = true;
    let context = "bias tiles: wide D 192 causal, tracked";
    check_forced::<B>(&mut setup, dtype, context, hopper, Some(true));
    let mut setup = Setup::new([2, 4, 100, 64], 2, 136, 64);
    setup.bias = Some([1, 4, 100, 136]);
    setup.bias_transposed = true;
    let context = "bias per element: D 64, keys strided, tracked";
    check_forced::<B>(&mut setup, dtype, context, hopper, Some(false));
}

/// The backward suite; `[extra]` replaces the default extra test, the 70 400-head case.
/// Sliding windows (an explicit band in the reference) and ALiBi from slopes (the term
/// materialised in the reference; no gradient to the slopes), through the plan's backward and,
/// where the device has them, the cooperative-matrix one: windows on both sides, causal windows
/// with `Sq ≠ Sk` (rows that see nothing), rows long enough that the dK/dV kernels skip whole
/// query blocks on both sides of a key block, with GQA, a padding mask and a tracked bias
/// (whose `dS` is zero outside every row's window).
fn windows_and_alibi<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    // (Sq, Sk, causal, window, ALiBi, mask and tracked bias)
    let cases = [
        (70, 70, false, Some((3, 5)), false, false),
        (160, 160, true, Some((24, 0)), true, false),
        (120, 150, false, Some((10, 40)), false, true),
        (97, 130, true, Some((16, 7)), true, true),
        (130, 70, true, Some((9, 0)), false, false),
        (64, 64, true, None, true, false),
    ];
    let mut kernels = vec![None];
    if cuda && dtype != FloatDType::F32 {
        kernels.push(Some(AttentionKernel::CooperativeMatrix));
    }
    // Off CUDA (lavapipe in CI, where every new rule set compiles slowly) the cases that skip
    // query blocks on both sides and combine the rules; all of them on the GPU run.
    let cases = match cuda {
        true => &cases[..],
        false => &cases[1..4],
    };
    for &(sq, sk, causal, window, alibi, terms) in cases {
        for &kernel in &kernels {
            let mut setup = Setup::new([2, 4, sq, 32], 2, sk, 32);
            setup.options.is_causal = causal;
            setup.window = window;
            setup.alibi = alibi;
            setup.kernel = kernel;
            if terms {
                setup.mask = Some(([2, 1, 1, sk], |[b, _, _, j]| j + 7 * b + 3 >= 130));
                setup.bias = Some([1, 4, sq, sk]);
            }
            check::<B>(
                &setup,
                dtype,
                &format!(
                    "Sq {sq} Sk {sk} causal {causal} window {window:?} alibi {alibi} mask+bias {terms} {kernel:?}"
                ),
            );
        }
    }
    let _ = device;
}

/// Attention sinks' gradients (the sinks tracked: `dSinks` checked, with `dQ`, `dK`, `dV`)
/// through the plan's backward: plain, causal with a window (gpt-oss's local layers), quiet
/// with a padding mask and a tracked bias.
fn attention_sinks<B: FlashBackend>(_: &B::Device, dtype: FloatDType) {
    for (sq, sk, causal, window, quiet, terms) in [
        (45, 70, false, None, false, false),
        (96, 96, true, Some((31, 0)), false, false),
        (37, 60, false, None, true, true),
    ] {
        let mut setup = Setup::new([2, 4, sq, 32], 2, sk, 32);
        setup.options.is_causal = causal;
        setup.window = window;
        setup.quiet = quiet;
        setup.sinks = true;
        if terms {
            setup.mask = Some(([2, 1, 1, sk], |[b, _, _, j]| j + 5 * b + 3 >= 60));
            setup.bias = Some([1, 4, sq, sk]);
        }
        check::<B>(
            &setup,
            dtype,
            &format!(
                "sinks Sq {sq} Sk {sk} causal {causal} window {window:?} quiet {quiet} mask+bias {terms}"
            ),
        );
    }
}

/// Gradients of packed variable-length batches ([`attention_varlen`]) against the f64
/// reference of the dense op on each sequence, through the plan's backward and, where the
/// device has them, the cooperative-matrix one: empty and one-token sequences, a sequence
/// without keys, causal with `Sq ≠ Sk` per sequence, GQA, and (combined) a window, ALiBi,
/// tracked sinks, a key padding mask and a tracked bias; on the GPU also one query head per
/// key/value head, where the matrix-unit dK/dV kernel skips the query blocks of other
/// sequences, and a sequence of 2000 tokens.
fn varlen<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    // (query lengths, key lengths, heads (q, kv), causal, window + ALiBi + sinks + terms)
    type Packed = (
        &'static [usize],
        &'static [usize],
        (usize, usize),
        bool,
        bool,
    );
    let mut cases: Vec<Packed> = vec![
        (&[37, 0, 1, 90, 5], &[37, 0, 1, 90, 5], (4, 2), false, false),
        (
            &[3, 0, 70, 20, 60],
            &[50, 9, 70, 0, 40],
            (4, 2),
            true,
            false,
        ),
        (&[100, 33, 70], &[100, 33, 70], (4, 2), false, true),
    ];
    if cuda {
        cases.push((
            &[300, 1, 2000, 129],
            &[300, 1, 2000, 129],
            (2, 2),
            true,
            false,
        ));
    } else {
        // Off CUDA (lavapipe in CI, where every rule set compiles slowly) the combining cases.
        cases.remove(0);
    }
    let mut kernels = vec![None];
    if cuda && dtype != FloatDType::F32 {
        kernels.push(Some(AttentionKernel::CooperativeMatrix));
    }
    for (lengths_q, lengths_k, (hq, hkv), causal, terms) in cases {
        let (tq, tk) = (lengths_q.iter().sum(), lengths_k.iter().sum());
        for &kernel in &kernels {
            let mut setup = Setup::new([1, hq, tq, 32], hkv, tk, 32);
            setup.options.is_causal = causal;
            setup.kernel = kernel;
            setup.packed = Some((lengths_q.to_vec(), lengths_k.to_vec()));
            if terms {
                setup.window = Some((20, 5));
                setup.alibi = true;
                setup.sinks = true;
                setup.mask = Some(([1, 1, 1, tk], |[_, _, _, j]| j % 11 == 3));
                setup.bias = Some([1, hq, tq, tk]);
            }
            check::<B>(
                &setup,
                dtype,
                &format!(
                    "varlen q {lengths_q:?} k {lengths_k:?} causal {causal} terms {terms} {kernel:?}"
                ),
            );
        }
    }
    let _ = device;
}

/// Asserts that `ran` (the backward launches of one call shape) is not empty and all `want`.
/// Whether the default CUDA device is a Hopper GPU (sm_90), whatever the plan inputs say.
fn cuda_sm90() -> bool {
    #[cfg(feature = "cuda")]
    {
        let client = <cubecl::cuda::CudaRuntime as cubecl::Runtime>::client(&Default::default());
        burn_flash::kernels::hopper::sm90(&client)
    }
    #[cfg(not(feature = "cuda"))]
    false
}

fn assert_launched(ran: &[AttentionBackwardKernel], want: AttentionBackwardKernel, context: &str) {
    assert!(
        !ran.is_empty() && ran.iter().all(|&k| k == want),
        "{context}: planned {want:?}, launched {ran:?}"
    );
}

/// The bytes of `dQ`, `dK`, `dV` of `Σ attention(q, k, v) ⊙ g` under `options`.
fn gradient_bytes<B: FlashBackend>(
    [q, k, v, g]: [&Tensor<B, 4>; 4],
    options: FlashAttentionOptions,
) -> [Vec<u8>; 3] {
    let [q, k, v] = [q, k, v].map(|t| Tensor::<A<B>, 4>::from_inner(t.clone()).require_grad());
    let g = Tensor::<A<B>, 4>::from_inner(g.clone());
    let (out, _) = attention_with_lse(q.clone(), k.clone(), v.clone(), None, None, options);
    let grads = (out * g).sum().backward();
    [&q, &k, &v].map(|t| {
        let grad = t.grad(&grads).expect("gradient");
        grad.into_data().as_bytes().to_vec()
    })
}

/// The Hopper backward's consumer overlaps ([`BackwardOverlap`]): each step's `dQ` issued in the
/// next step, and the consumers staggered half a step, checked against the reference like the
/// lockstep schedule, at head dim 128 (the calls that take them): GQA with rows past the last
/// full block, causal with `Sq > Sk` (key blocks whose first row blocks see none of their
/// keys), a padding mask with dropout. The Hopper backward runs them on sm_90 (the plan does not
/// change with the option); elsewhere the option changes nothing and one small call checks so.
fn backward_overlaps<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    #[cfg(feature = "cuda")]
    let hopper = cuda && dtype != FloatDType::F32 && hopper_forced_available::<B>(device, dtype);
    #[cfg(not(feature = "cuda"))]
    let hopper = false;
    let overlaps = [
        BackwardOverlap::Lockstep,
        BackwardOverlap::Deferred,
        BackwardOverlap::Staggered,
    ];
    for overlap in overlaps {
        let mut cases = vec![Setup::new([1, 2, 70, 32], 1, 90, 32)];
        if cuda {
            let mut causal = Setup::new([1, 4, 700, 128], 1, 520, 128);
            causal.options.is_causal = true;
            let mut masked = Setup::new([2, 2, 300, 128], 2, 330, 128);
            masked.mask = Some(([2, 1, 1, 330], |[b, _, _, j]| j + 40 * b + 7 >= 330));
            masked.dropout = Some(AttentionDropout {
                prob: 0.2,
                seed: fresh_seed(),
            });
            cases = vec![Setup::new([2, 4, 300, 128], 2, 520, 128), causal, masked];
        }
        for mut setup in cases {
            setup.overlap = Some(overlap);
            let context = format!(
                "{overlap:?}: q {:?} Sk {} causal {} mask {} dropout {}",
                setup.q,
                setup.seq_k,
                setup.options.is_causal,
                setup.mask.is_some(),
                setup.dropout.is_some()
            );
            check::<B>(&setup, dtype, &context);
            if hopper && setup.q[3] == 128 {
                let dims = setup.dims();
                let ran: Vec<_> = recent_backward_launches()
                    .into_iter()
                    .filter(|l| l.dims == dims)
                    .map(|l| l.kernel)
                    .collect();
                assert_launched(&ran, AttentionBackwardKernel::Hopper, &context);
            }
        }
    }
}

/// The deterministic backward ([`FlashAttentionOptions::deterministic`]): gradients within the
/// f64 rule, and the same inputs twice give the same bits of `dQ`, `dK` and `dV`. On CUDA the
/// calls put many key blocks' `dQ` adds into each row block (the Hopper backward orders them
/// where the device has it; the plan keeps the deterministic call on the backward it takes
/// without the option): D 64 (whose two consumer warpgroups add into one tile), D 128 causal
/// with `Sq < Sk`, a window with GQA; at D 256 the Hopper backward is not taken. Elsewhere
/// every backward is deterministic by construction, and the bits are compared all the same.
fn deterministic_backward<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let cuda = format!("{device:?}").to_lowercase().contains("cuda");
    // (q, key/value heads, Sk, causal, window)
    type Call = ([usize; 4], usize, usize, bool, Option<(usize, usize)>);
    let calls: Vec<Call> = if cuda {
        vec![
            ([2, 4, 700, 64], 2, 1300, false, None),
            ([1, 4, 900, 128], 2, 1000, true, None),
            ([2, 4, 1000, 128], 1, 1000, false, Some((300, 100))),
        ]
    } else {
        vec![([1, 2, 70, 32], 1, 150, true, None)]
    };
    for (q, kv_heads, seq_k, causal, window) in calls {
        let context = format!("deterministic q {q:?} Sk {seq_k} causal {causal} {window:?}");
        let mut setup = Setup::new(q, kv_heads, seq_k, q[3]);
        setup.options.is_causal = causal;
        setup.window = window;
        setup.deterministic = true;
        check::<B>(&setup, dtype, &context);

        let dims = AttentionDims {
            batch: q[0],
            heads_q: q[1],
            heads_kv: kv_heads,
            seq_q: q[2],
            seq_k,
            head_dim: q[3],
            value_dim: q[3],
        };
        let options = |deterministic| {
            forward_kernel(
                FlashAttentionOptions {
                    window,
                    deterministic: Some(deterministic),
                    ..setup.options.into()
                },
                dtype,
            )
        };
        let plan = |deterministic| {
            attention_backward_plan::<B>(
                device,
                dims,
                dtype.into(),
                options(deterministic),
                false,
                false,
            )
            .map(|p| p.expect("the call plans").kernel)
        };
        // The Ampere backward (opt-in) adds dQ by atomics: a deterministic call takes the `mma`
        // backward instead.
        let want = match plan(false) {
            Some(AttentionBackwardKernel::Ampere) => Some(AttentionBackwardKernel::MatrixUnits),
            other => other,
        };
        assert_eq!(
            plan(true),
            want,
            "{context}: the same backward with the option"
        );

        let [b, hq, sq, d] = q;
        let inputs = [
            random::<B, 4>(q, -1.0, 1.0, dtype, device),
            random::<B, 4>([b, kv_heads, seq_k, d], -1.0, 1.0, dtype, device),
            random::<B, 4>([b, kv_heads, seq_k, d], -1.0, 1.0, dtype, device),
            random::<B, 4>([b, hq, sq, d], -1.0, 1.0, dtype, device),
        ];
        let [q_in, k_in, v_in, g_in] = &inputs;
        let first = gradient_bytes([q_in, k_in, v_in, g_in], options(true));
        let second = gradient_bytes([q_in, k_in, v_in, g_in], options(true));
        sync::<B>(device);
        for (n, name) in ["dq", "dk", "dv"].iter().enumerate() {
            let differ = first[n]
                .iter()
                .zip(&second[n])
                .filter(|(x, y)| x != y)
                .count();
            assert_eq!(
                differ, 0,
                "{context}: {name} differs in {differ} bytes between runs"
            );
        }
        if let Some(kernel) = plan(true) {
            let ran: Vec<_> = recent_backward_launches()
                .into_iter()
                .filter(|l| l.dims == dims)
                .map(|l| l.kernel)
                .collect();
            assert_launched(&ran, kernel, &context);
        }
    }
    if cuda && dtype != FloatDType::F32 {
        // D 256: the Hopper backward adds dQ per thread there, so the option leaves it.
        let dims = AttentionDims {
            batch: 1,
            heads_q: 2,
            heads_kv: 2,
            seq_q: 300,
            seq_k: 300,
            head_dim: 256,
            value_dim: 256,
        };
        let options = FlashAttentionOptions {
            deterministic: Some(true),
            ..Default::default()
        };
        let plan = attention_backward_plan::<B>(device, dims, dtype.into(), options, false, false)
            .expect("a CUDA backend plans")
            .expect("the call plans");
        assert_ne!(
            plan.kernel,
            AttentionBackwardKernel::Hopper,
            "deterministic D 256: not the Hopper backward"
        );
    }
}

macro_rules! backward_suite {
    ($module:ident, $backend:ty, $dtype:expr) => {
        backward_suite!($module, $backend, $dtype, [many_heads]);
    };
    ($module:ident, $backend:ty, $dtype:expr, [$($extra:ident),*]) => {
        suite!(
            $module,
            $backend,
            $dtype,
            [
                shapes_and_options,
                causal,
                grouped_query_heads,
                masks_and_biases,
                masked_score_and_quiet,
                head_dims_and_strides,
                partly_tracked,
                planned_kernels,
                dropout_gradients,
                dropout_mask,
                cooperative_backward,
                tf32_training,
                windows_and_alibi,
                attention_sinks,
                varlen,
                many_seeds,
                deterministic_backward,
                backward_overlaps
                $(, $extra)*
            ]
        );
    };
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    type W = burn::backend::Wgpu;
    // Lavapipe runs every test but the 70 400-head case (`many_heads`: one 256-unit cube per
    // pair, most of this binary's CI time). CUDA runs it in every dtype, and in f32 on the
    // plain-unit backward kernels that wgpu runs.
    backward_suite!(f32, W, FloatDType::F32, []);
    suite!(
        f16,
        W,
        FloatDType::F16,
        [
            shapes_and_options,
            causal,
            grouped_query_heads,
            masks_and_biases,
            head_dims_and_strides,
            partly_tracked,
            planned_kernels,
            dropout_gradients,
            dropout_mask,
            cooperative_backward,
            many_seeds,
            deterministic_backward,
        ]
    );
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    type C = burn::backend::Cuda;
    backward_suite!(f32, C, FloatDType::F32);
    backward_suite!(
        f16,
        C,
        FloatDType::F16,
        [
            many_heads,
            hopper_tracked_bias,
            hopper_bias_tiles,
            ampere_backward_rules
        ]
    );
    backward_suite!(
        bf16,
        C,
        FloatDType::BF16,
        [
            many_heads,
            hopper_tracked_bias,
            hopper_bias_tiles,
            ampere_backward_rules
        ]
    );
}

#[cfg(feature = "ndarray")]
mod ndarray {
    use super::*;
    type N = burn::backend::NdArray;
    backward_suite!(f32, N, FloatDType::F32);
}
