//! burn-flash quick start on the best device available — CUDA when built with `--features cuda`
//! and an NVIDIA GPU is present, else wgpu on a Vulkan GPU, else Mesa's lavapipe on the CPU
//! (prints which one it used):
//! - fused attention (grouped-query heads, causal) against Burn's own, and a training step
//!   through its fused backward kernels against Burn's autodiff, with the kernels each planned;
//! - dropout on the attention weights, drawn in the kernel and redrawn by the backward;
//! - long context: a sliding window (key blocks outside it skipped), ALiBi computed in the
//!   kernel from per-head slopes, and attention sinks, each against Burn's attention with the
//!   same rule materialised; a packed batch of prompts of different lengths against Burn's
//!   attention on each prompt;
//! - the drop-in modules: burn-nn's `MultiHeadAttention` swapped for `burn_flash::nn`'s with
//!   the same weights (masks, a fully masked row, a training step), decoding with the KV cache,
//!   and a transformer stack served to several sequences at once (packed prefill, paged
//!   decoding; `examples/gpt.rs` trains, decodes and serves a whole model with them);
//! - the fused softmax family, forward and backward, and `softmax(X)·V` with the kernel an f16
//!   call takes (the hand-written Hopper kernel on H100/H200).
//!
//! `cargo run --release --example quickstart` (or `cargo xtask demo`, which also installs a
//! Vulkan driver if none is there); `-- --wgpu` takes wgpu even where CUDA runs. With
//! `--features vulkan` on a GPU whose Vulkan driver has cooperative matrices, the f16 line names
//! the cooperative-matrix kernel.

use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module};
use burn::tensor::{
    Bool, DType, Distribution, ElementConversion, Int, Tensor, TensorData, activation, module,
    ops::AttentionModuleOptions,
};
use burn_flash::kernels::fragment::MatrixUnitsUnavailable;
use burn_flash::{
    AttentionBackwardKernel, AttentionDropout, AttentionKernel, BlockTable, FlashAttentionOptions,
    FlashBackend, HeadTerms, Rope, ScoreTerms, VarlenBatch, append_paged, attention::AttentionDims,
    attention_paged, attention_varlen,
};

/// Largest |a − b|.
fn max_diff<B: burn::tensor::backend::Backend, const D: usize>(
    a: Tensor<B, D>,
    b: Tensor<B, D>,
) -> f32 {
    (a - b).abs().max().into_scalar().elem::<f32>()
}

/// Attention as a Burn model calls it, and one training step through it.
fn attention<B: FlashBackend>(device: &B::Device) {
    type A<B> = Autodiff<B>;
    let (b, hq, hkv, s, d) = (2, 8, 2, 256, 64);
    let normal = Distribution::Normal(0.0, 1.0);
    let q = Tensor::<A<B>, 4>::random([b, hq, s, d], normal, device).require_grad();
    let k = Tensor::<A<B>, 4>::random([b, hkv, s, d], normal, device).require_grad();
    let v = Tensor::<A<B>, 4>::random([b, hkv, s, d], normal, device).require_grad();
    let causal = AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    };
    let dims = AttentionDims {
        batch: b,
        heads_q: hq,
        heads_kv: hkv,
        seq_q: s,
        seq_k: s,
        head_dim: d,
        value_dim: d,
    };
    let dtype = q.dtype();
    let forward = burn_flash::attention_plan::<B>(device, dims, dtype, causal.into());
    let backward =
        burn_flash::attention_backward_plan::<B>(device, dims, dtype, causal.into(), false, false);
    let kernel = |plan: Option<Result<String, String>>| {
        plan.map_or("composed fallback".into(), |p| p.unwrap_or_else(|e| e))
    };
    println!(
        "attention    q [{b}, {hq}, {s}, {d}], k/v [{b}, {hkv}, {s}, {d}] (GQA {}:1), causal",
        hq / hkv
    );
    println!(
        "             kernels: forward {}, backward {}",
        kernel(forward.map(|p| {
            p.map(|p| format!("{:?}", p.kernel))
                .map_err(|e| e.to_string())
        })),
        kernel(backward.map(|p| {
            p.map(|p| format!("{:?}", p.kernel))
                .map_err(|e| e.to_string())
        }))
    );

    // The same call in f16: the matrix units where the device has them (CUDA's `mma`, the
    // Hopper kernel on H100/H200, or cooperative matrices through Vulkan's SPIR-V or Metal),
    // and why not where it has not.
    let half = burn_flash::attention_plan::<B>(device, dims, DType::F16, causal.into());
    println!(
        "             in f16 the forward would run: {}",
        kernel(half.map(|p| {
            p.map(|p| match p.matrix_units {
                _ if p.kernel == AttentionKernel::CooperativeMatrix => {
                    format!("{:?} (cubecl's cmma)", p.kernel)
                }
                _ if p.kernel == AttentionKernel::Hopper => format!(
                    "{:?} (hand-written CUDA for sm_90: TMA, wgmma, warp specialisation)",
                    p.kernel
                ),
                Some(MatrixUnitsUnavailable::NoMma { .. }) => format!(
                    "{:?} (no matrix units for f16 here: neither CUDA's mma nor cooperative \
                     matrices; WGSL has none, `--features vulkan` compiles SPIR-V)",
                    p.kernel
                ),
                Some(why) => format!("{:?} ({why})", p.kernel),
                None => format!("{:?}", p.kernel),
            })
            .map_err(|e| e.to_string())
        }))
    );
    let half_backward = burn_flash::attention_backward_plan::<B>(
        device,
        dims,
        DType::F16,
        causal.into(),
        false,
        false,
    );
    println!(
        "             and the backward: {}",
        kernel(half_backward.map(|p| {
            p.map(|p| match p.kernel {
                AttentionBackwardKernel::Hopper => format!(
                    "{:?} (hand-written CUDA for sm_90: dQ by f32 reductions)",
                    p.kernel
                ),
                AttentionBackwardKernel::Ampere => format!(
                    "{:?} (hand-written CUDA for sm_80+: FlashAttention-2's data flow)",
                    p.kernel
                ),
                _ => format!("{:?}", p.kernel),
            })
            .map_err(|e| e.to_string())
        }))
    );

    // Forward and gradients through burn-flash's fused kernels.
    let g = Tensor::<A<B>, 4>::random([b, hq, s, d], normal, device);
    let ours = burn_flash::attention(q.clone(), k.clone(), v.clone(), None, None, causal);
    let grads = (ours.clone() * g.clone()).sum().backward();
    let ours_grads = [&q, &k, &v].map(|t| t.grad(&grads).expect("gradient"));

    // Burn's own attention has no grouped heads: repeat K/V, then its autodiff.
    let (q2, k2, v2) = (
        q.clone().detach().require_grad(),
        k.clone().detach().require_grad(),
        v.clone().detach().require_grad(),
    );
    let repeat = |t: Tensor<A<B>, 4>| {
        t.reshape([b, hkv, 1, s * d])
            .expand([b, hkv, hq / hkv, s * d])
            .reshape([b, hq, s, d])
    };
    let burns = module::attention_fallback(
        q2.clone(),
        repeat(k2.clone()),
        repeat(v2.clone()),
        None,
        None,
        causal,
    );
    println!(
        "             output:    max |burn-flash − burn| = {:.2e} (burn-flash keeps one f32 per row, \
         Burn the {}×{} scores of every head)",
        max_diff(ours.clone().inner(), burns.clone().inner()),
        s,
        s
    );
    let grads = (burns * g).sum().backward();
    for (name, (ours, t)) in ["dq", "dk", "dv"]
        .iter()
        .zip(ours_grads.into_iter().zip([&q2, &k2, &v2]))
    {
        let theirs = t.grad(&grads).expect("gradient");
        println!(
            "             {name}:        max |burn-flash − burn| = {:.2e}",
            max_diff(ours, theirs)
        );
    }

    // Dropout on the weights: drawn in the kernel from (seed, batch, head, row, key), the same
    // mask again in the backward; the same seed reproduces it, another seed draws another.
    let dropout = |seed| FlashAttentionOptions {
        dropout: Some(AttentionDropout { prob: 0.1, seed }),
        ..causal.into()
    };
    let run = |seed| {
        burn_flash::attention_with_lse(q.clone(), k.clone(), v.clone(), None, None, dropout(seed)).0
    };
    let (a, a2, c) = (run(7), run(7), run(8));
    println!(
        "             dropout 0.1: same seed max diff {:.1e}, other seed {:.2e}",
        max_diff(a.clone().inner(), a2.inner()),
        max_diff(a.inner(), c.inner())
    );
}

fn demo<B: FlashBackend>(device: &B::Device) {
    let x = Tensor::<B, 3>::random([8, 128, 1000], Distribution::Normal(0.0, 3.0), device);

    // Same signature as `burn::tensor::activation::softmax`: swap one import.
    let ours = burn_flash::softmax(x.clone(), 2);
    let burns = activation::softmax(x.clone(), 2);
    let diff = (ours.clone() - burns)
        .abs()
        .max()
        .into_scalar()
        .elem::<f32>();
    let row_sum = ours.sum_dim(2).mean().into_scalar().elem::<f32>();
    println!(
        "softmax      [8, 128, 1000]: max |burn-flash − burn| = {diff:.2e}, mean row sum = {row_sum:.6}"
    );

    let log = burn_flash::log_softmax(x.clone(), 1);
    let log_ref = activation::log_softmax(x.clone(), 1);
    let diff = (log - log_ref).abs().max().into_scalar().elem::<f32>();
    println!("log_softmax  over dim 1:     max |burn-flash − burn| = {diff:.2e}");

    // softmax(X)·V without the softmax matrix, against Burn's composition, and the kernel an
    // f16 call of the same shape takes.
    let (x, v) = (
        Tensor::<B, 3>::random([4, 256, 512], Distribution::Normal(0.0, 3.0), device),
        Tensor::<B, 3>::random([4, 512, 64], Distribution::Normal(0.0, 1.0), device),
    );
    let diff = max_diff(
        burn_flash::softmax_matmul(x.clone(), v.clone()),
        activation::softmax(x, 2).matmul(v),
    );
    let dims = burn_flash::kernels::softmax_matmul::SmmDims {
        batch: 4,
        d1: 256,
        d2: 512,
        d3: 64,
    };
    let half = burn_flash::softmax_matmul_plan::<B>(device, dims, DType::F16, Default::default());
    println!(
        "softmax(X)·V [4, 256, 512]·[4, 512, 64]: max |burn-flash − burn| = {diff:.2e}; in f16: {}",
        half.map_or("composed fallback".into(), |p| p
            .map(|p| format!("{:?}", p.kernel))
            .unwrap_or_else(|e| e.to_string()))
    );

    // A fully masked row gives zeros, not NaN.
    let masked = Tensor::<B, 2>::full([2, 4], f32::NEG_INFINITY, device);
    let y = burn_flash::softmax(masked, 1);
    println!(
        "softmax of an all −inf row:  {:?}",
        y.into_data().to_vec::<f32>().unwrap()
    );
}

/// burn-nn's `MultiHeadAttention` and the drop-in one, same weights: outputs with padding and
/// attention masks, one training step, and decoding with the KV cache.
fn modules<B: FlashBackend>(device: &B::Device) {
    use burn::nn::attention::{MhaInput as BurnInput, MultiHeadAttentionConfig};
    use burn_flash::nn::{MhaCache, MhaInput, MultiHeadAttention};
    type A<B> = Autodiff<B>;
    let (b, s, d_model, heads) = (2, 128, 256, 8);
    let burns = MultiHeadAttentionConfig::new(d_model, heads)
        .with_dropout(0.0)
        .init::<A<B>>(device);
    // Parameters are created lazily: fix them before the module is shared.
    let burns = burns.clone().load_record(burns.into_record());
    let ours: MultiHeadAttention<A<B>> = burns.clone().into();
    let x = Tensor::<A<B>, 3>::random([b, s, d_model], Distribution::Default, device);
    // Batch 1 pads its last 28 positions; row 5 of the attention mask is fully masked.
    let pad = Tensor::<A<B>, 1, burn::tensor::Int>::arange(0..s as i64, device)
        .reshape([1, s])
        .expand([b, s])
        .greater_equal_elem(100)
        .bool_and(
            Tensor::<A<B>, 1, burn::tensor::Int>::arange(0..b as i64, device)
                .reshape([b, 1])
                .expand([b, s])
                .equal_elem(1),
        );
    let rows = Tensor::<A<B>, 1, burn::tensor::Int>::arange(0..s as i64, device)
        .reshape([1, s, 1])
        .expand([b, s, s]);
    let attn = burn::nn::attention::generate_autoregressive_mask::<A<B>>(b, s, device)
        .bool_or(rows.equal_elem(5));
    let theirs = burns.forward(
        BurnInput::self_attn(x.clone())
            .mask_pad(pad.clone())
            .mask_attn(attn.clone()),
    );
    let mine = ours.forward(
        MhaInput::self_attn(x.clone())
            .mask_pad(pad.clone())
            .mask_attn(attn),
    );
    println!(
        "nn::MultiHeadAttention [{b}, {s}, {d_model}], {heads} heads, burn-nn's weights, masks with a fully masked row:"
    );
    println!(
        "  context:                    max |burn-flash − burn-nn| = {:.2e} (no [B, H, S, S] weights made)",
        max_diff(mine.context.clone(), theirs.context.clone())
    );
    let w = Tensor::<A<B>, 3>::random([b, s, d_model], Distribution::Default, device);
    let g_ours = (mine.context * w.clone()).sum().backward();
    let g_burn = (theirs.context * w).sum().backward();
    let dq = max_diff(
        ours.query.weight.grad(&g_ours).unwrap(),
        burns.query.weight.grad(&g_burn).unwrap(),
    );
    println!("  training step, d query.weight: max |burn-flash − burn-nn| = {dq:.2e}");
    // Decoding: a prompt of 96 positions, then one token at a time with the KV cache.
    let inner = ours.valid();
    let x = x.inner();
    let full = inner
        .forward(MhaInput::self_attn(x.clone()).causal())
        .context;
    let mut cache = MhaCache::autoregressive();
    let mut last = None;
    for len in (96..=s).step_by(8) {
        let prefix = x.clone().slice([0..b, 0..len, 0..d_model]);
        last = Some(inner.forward_cache(MhaInput::self_attn(prefix).causal(), &mut cache));
    }
    let decoded = last.unwrap().context;
    println!(
        "  KV-cache decoding to {s}:     max |cached − full causal| = {:.2e} ({} positions cached)",
        max_diff(decoded, full),
        cache.len()
    );
    serving::<B>(device);
}

/// A causal `TransformerEncoder` served to three sequences at once (`ServingEncoder`): the
/// prompts prefilled as one packed batch into a paged KV cache, then decoding steps for all of
/// them (one fused projection, one append + attention op and fused layer norms per layer),
/// against the stack's own forward on each whole sequence.
fn serving<B: FlashBackend>(device: &B::Device) {
    use burn_flash::nn::{TransformerEncoderConfig, TransformerEncoderInput};
    let (d_model, heads, layers, steps) = (128, 4, 2, 6);
    let prompts = [7usize, 40, 19];
    let stack = TransformerEncoderConfig::new(d_model, 4 * d_model, heads, layers)
        .with_dropout(0.0)
        .with_norm_first(true)
        .init::<B>(device);
    let stack = stack.clone().load_record(stack.into_record());
    let normal = Distribution::Normal(0.0, 1.0);
    let xs: Vec<Tensor<B, 3>> = prompts
        .iter()
        .map(|&p| Tensor::random([1, p + steps, d_model], normal, device))
        .collect();
    let serving = stack.serving();
    let mut cache = serving.new_paged_cache(16, 16, device);
    let ids: Vec<usize> = prompts.iter().map(|_| cache.add_sequence()).collect();
    let total: usize = prompts.iter().sum();
    let packed = Tensor::cat(
        xs.iter()
            .zip(prompts)
            .map(|(x, p)| x.clone().narrow(1, 0, p).reshape([p, d_model]))
            .collect(),
        0,
    );
    serving.prefill(packed.reshape([total, d_model]), &ids, &prompts, &mut cache);
    let mut last = None;
    for t in 0..steps {
        let x = Tensor::cat(
            xs.iter()
                .zip(prompts)
                .map(|(x, p)| x.clone().narrow(1, p + t, 1))
                .collect(),
            0,
        );
        last = Some(serving.decode(x, &ids, &mut cache));
    }
    let last = last.expect("a step");
    let diff = xs
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let full = stack.forward(TransformerEncoderInput::new(x.clone()).causal());
            let end = full.dims()[1];
            max_diff(last.clone().narrow(0, i, 1), full.narrow(1, end - 1, 1))
        })
        .fold(0.0f32, f32::max);
    println!(
        "  serving {layers} layers to {} sequences: prompts {prompts:?} prefilled as one packed batch, {steps} paged decoding steps for all, blocks of 16 (fused QKV, norms and few-row projections): max |served − full causal forward| = {diff:.2e}",
        prompts.len()
    );
    // A decoding step's projection: 3 rows through the few-rows kernel against Burn's matmul.
    let x = Tensor::<B, 2>::random([3, 512], Distribution::Normal(0.0, 1.0), device);
    let w = Tensor::<B, 2>::random([512, 1536], Distribution::Normal(0.0, 0.044), device);
    let b = Tensor::<B, 1>::random([1536], Distribution::Normal(0.0, 1.0), device);
    let ours = burn_flash::linear(x.clone(), w.clone(), Some(b.clone()));
    let diff = max_diff(ours, x.matmul(w) + b.unsqueeze());
    println!(
        "  linear [3, 512]·[512, 1536] + b (kernel `linear_rows`): max |burn-flash − burn| = {diff:.2e}"
    );
}

fn gradients<B: FlashBackend>(device: &B::Device) {
    type A<B> = Autodiff<B>;
    let x =
        Tensor::<A<B>, 2>::random([64, 512], Distribution::Normal(0.0, 2.0), device).require_grad();
    let w = Tensor::<A<B>, 2>::random([64, 512], Distribution::Default, device);
    let grads = (burn_flash::softmax(x.clone(), 1) * w.clone())
        .sum()
        .backward();
    let ours = x.grad(&grads).unwrap();
    let x2 = x.detach().require_grad();
    let grads = (activation::softmax(x2.clone(), 1) * w).sum().backward();
    let burns = x2.grad(&grads).unwrap();
    let diff = (ours - burns).abs().max().into_scalar().elem::<f32>();
    println!(
        "gradient     [64, 512]:      max |burn-flash − burn| = {diff:.2e} (fused backward kernel)"
    );
}

/// Sliding windows, ALiBi from slopes and attention sinks, each against Burn's attention with
/// the same rule materialised: a band mask, the `[1, H, S, S]` ALiBi bias, and for the sinks a
/// key of zeros whose bias column is the sink logit (its value row 0).
fn long_context<B: FlashBackend>(device: &B::Device) {
    let (b, h, s, d, w) = (1, 4, 512, 64, 64);
    let normal = Distribution::Normal(0.0, 1.0);
    let q = Tensor::<B, 4>::random([b, h, s, d], normal, device);
    let k = Tensor::<B, 4>::random([b, h, s, d], normal, device);
    let v = Tensor::<B, 4>::random([b, h, s, d], normal, device);
    let plain = AttentionModuleOptions::default();
    let causal = AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    };
    let dims = AttentionDims {
        batch: b,
        heads_q: h,
        heads_kv: h,
        seq_q: s,
        seq_k: s,
        head_dim: d,
        value_dim: d,
    };
    let dtype = q.dtype();
    let kernel = |options: FlashAttentionOptions, terms: ScoreTerms| {
        match burn_flash::attention_plan_with::<B>(device, dims, dtype, options, terms) {
            Some(Ok(p)) => format!("{:?}", p.kernel),
            Some(Err(e)) => e.to_string(),
            None => "composed fallback".into(),
        }
    };
    let grid = |f: &dyn Fn(usize, usize) -> bool| {
        let values: Vec<bool> = (0..s * s).map(|n| f(n / s, n % s)).collect();
        Tensor::<B, 4, Bool>::from_data(TensorData::new(values, [1, 1, s, s]), device)
    };
    println!("long context q/k/v [{b}, {h}, {s}, {d}]");

    // A causal window of w keys (Mistral's): key blocks outside every row's window are skipped.
    let windowed = FlashAttentionOptions {
        window: Some((w - 1, 0)),
        ..causal.into()
    };
    let ours =
        burn_flash::attention_with_lse(q.clone(), k.clone(), v.clone(), None, None, windowed).0;
    let band = grid(&|i, j| j > i || j + w <= i).expand([b, h, s, s]);
    let burns =
        module::attention_fallback(q.clone(), k.clone(), v.clone(), Some(band), None, plain);
    println!(
        "             window ({}, 0), causal: kernel {}, max |burn-flash − burn (band mask)| = {:.2e}",
        w - 1,
        kernel(windowed, ScoreTerms::default()),
        max_diff(ours, burns)
    );

    // ALiBi from the slopes 2^(−8(i+1)/H), computed in the kernel: no [B, H, S, S] tensor.
    let slopes: Vec<f32> = (0..h)
        .map(|i| 2f32.powf(-8.0 * (i + 1) as f32 / h as f32))
        .collect();
    let bias: Vec<f32> = (0..h * s * s)
        .map(|n| -slopes[n / (s * s)] * ((n / s) % s).abs_diff(n % s) as f32)
        .collect();
    let bias = Tensor::<B, 4>::from_data(TensorData::new(bias, [1, h, s, s]), device);
    let slopes = Tensor::<B, 1>::from_data(TensorData::new(slopes, [h]), device);
    let ours = burn_flash::attention_with_alibi(
        q.clone(),
        k.clone(),
        v.clone(),
        None,
        None,
        Some(slopes.clone()),
        plain.into(),
    )
    .0;
    let burns =
        module::attention_fallback(q.clone(), k.clone(), v.clone(), None, Some(bias), plain);
    let alibi = ScoreTerms {
        alibi: true,
        ..Default::default()
    };
    println!(
        "             ALiBi from slopes [{h}]: kernel {}, max |burn-flash − burn (bias [1, {h}, {s}, {s}])| = {:.2e}",
        kernel(plain.into(), alibi),
        max_diff(ours, burns)
    );

    // Attention sinks (gpt-oss): one logit per head in every row's denominator.
    let sinks =
        Tensor::<B, 1>::from_data(TensorData::new(vec![0.5f32, -1.0, 2.0, 0.0], [h]), device);
    let heads = HeadTerms {
        alibi_slopes: None,
        sinks: Some(sinks.clone()),
    };
    let ours = burn_flash::attention_with_heads(
        q.clone(),
        k.clone(),
        v.clone(),
        None,
        None,
        heads,
        plain.into(),
    )
    .0;
    let zeros = Tensor::<B, 4>::zeros([b, h, 1, d], device);
    let sink_bias = Tensor::cat(
        vec![
            Tensor::<B, 4>::zeros([1, h, s, s], device),
            sinks.reshape([1, h, 1, 1]).expand([1, h, s, 1]),
        ],
        3,
    );
    let burns = module::attention_fallback(
        q,
        Tensor::cat(vec![k, zeros.clone()], 2),
        Tensor::cat(vec![v, zeros], 2),
        None,
        Some(sink_bias),
        plain,
    );
    let sunk = ScoreTerms {
        sinks: true,
        ..Default::default()
    };
    println!(
        "             sinks [{h}]: kernel {}, max |burn-flash − burn (a zero key, the sink as its bias)| = {:.2e}",
        kernel(plain.into(), sunk),
        max_diff(ours, burns)
    );
    varlen::<B>(device);
    paged::<B>(device);
}

/// A paged KV cache: three sequences in shuffled blocks of a pool, one new token each appended
/// (keys and queries rotated by RoPE on the way), then decoded against the blocks, compared
/// with Burn's attention on each sequence's keys gathered and rotated by burn-nn's RoPE.
fn paged<B: FlashBackend>(device: &B::Device) {
    let (hq, hkv, d, bs) = (8, 2, 64, 16);
    let lengths = [5usize, 300, 1000];
    let per: Vec<usize> = lengths.iter().map(|l| (l + 1).div_ceil(bs)).collect();
    let pool: usize = per.iter().sum();
    // Each sequence's blocks spread over the pool (a fixed shuffle).
    let mut order: Vec<usize> = (0..pool).collect();
    order.sort_by_key(|&i| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut next = order.into_iter();
    let blocks: Vec<Vec<usize>> = per
        .iter()
        .map(|&n| next.by_ref().take(n).collect())
        .collect();
    let table = BlockTable::<B>::new(blocks.clone(), lengths.to_vec(), bs, pool, device);
    let normal = Distribution::Normal(0.0, 1.0);
    let k_pool = Tensor::<B, 4>::random([pool, bs, hkv, d], normal, device);
    let v_pool = Tensor::<B, 4>::random([pool, bs, hkv, d], normal, device);
    let q = Tensor::<B, 4>::random([3, hq, 1, d], normal, device);
    let k_new = Tensor::<B, 4>::random([3, hkv, 1, d], normal, device);
    let v_new = Tensor::<B, 4>::random([3, hkv, 1, d], normal, device);
    let rope = Rope::<B>::new(10_000.0, d, 2048, true, device);
    let appended = append_paged(
        k_pool,
        v_pool,
        &table,
        k_new.clone(),
        v_new,
        Some(&rope),
        Some(q.clone()),
    );
    let causal = AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    };
    let (out, _) = attention_paged(
        appended.query.expect("rotated queries"),
        appended.key.clone(),
        appended.value.clone(),
        &appended.table,
        HeadTerms::default(),
        causal.into(),
    );
    // Burn: each sequence's keys gathered from the pool, the new key and the query rotated by
    // burn-nn's RotaryEncoding, the key/value heads repeated per query head.
    let enc = burn::nn::RotaryEncodingConfig::new(2048, d).init::<B>(device);
    let mut diff = 0f32;
    for (b, &len) in lengths.iter().enumerate() {
        let slots: Vec<i64> = (0..=len)
            .map(|j| (blocks[b][j / bs] * bs + j % bs) as i64)
            .collect();
        let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(slots, [len + 1]), device);
        let gather = |pool: &Tensor<B, 4>| {
            pool.clone()
                .reshape([pool.dims()[0] * bs, hkv, d])
                .select(0, idx.clone())
                .swap_dims(0, 1)
                .unsqueeze_dim::<4>(0)
        };
        // Query head h reads key/value head h / (Hq / Hkv): each head repeated in place.
        let per_query_head = |t: Tensor<B, 4>| {
            t.unsqueeze_dim::<5>(2)
                .repeat_dim(2, hq / hkv)
                .reshape([1, hq, len + 1, d])
        };
        let ours_k = gather(&appended.key);
        let theirs_new = enc.apply(k_new.clone().narrow(0, b, 1), len);
        let key_diff = max_diff(ours_k.clone().narrow(2, len, 1), theirs_new);
        let q_b = enc.apply(q.clone().narrow(0, b, 1), len);
        let burns = module::attention(
            q_b,
            per_query_head(ours_k),
            per_query_head(gather(&appended.value)),
            None,
            None,
            causal,
        );
        diff = diff
            .max(max_diff(out.clone().narrow(0, b, 1), burns))
            .max(key_diff);
    }
    let dims = AttentionDims {
        batch: 3,
        heads_q: hq,
        heads_kv: hkv,
        seq_q: 1,
        seq_k: 1001,
        head_dim: d,
        value_dim: d,
    };
    let kernel = match burn_flash::attention_plan::<B>(device, dims, q.dtype(), causal.into()) {
        Some(Ok(p)) => format!("{:?} ({} splits)", p.kernel, p.cubes.0),
        Some(Err(e)) => e.to_string(),
        None => "composed fallback".into(),
    };
    println!(
        "             paged KV: {lengths:?} keys + 1 appended with RoPE, blocks of {bs} (shuffled), GQA {hq}:{hkv}, one query each: kernel {kernel}, max |burn-flash − burn (gathered keys, burn-nn RoPE)| = {diff:.2e}"
    );
}

/// A packed variable-length batch (three causal prompts of different lengths end to end)
/// against Burn's attention on each prompt alone.
fn varlen<B: FlashBackend>(device: &B::Device) {
    let (h, d, lengths) = (4, 64, [5usize, 300, 17]);
    let total: usize = lengths.iter().sum();
    let normal = Distribution::Normal(0.0, 1.0);
    let q = Tensor::<B, 3>::random([total, h, d], normal, device);
    let k = Tensor::<B, 3>::random([total, h, d], normal, device);
    let v = Tensor::<B, 3>::random([total, h, d], normal, device);
    let causal = AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    };
    let batch = VarlenBatch::<B>::self_attention(&lengths, device);
    let (out, _) = attention_varlen(
        q.clone(),
        k.clone(),
        v.clone(),
        &batch,
        None,
        None,
        HeadTerms::default(),
        causal.into(),
    );
    // Burn's attention on each prompt alone, `[1, H, l, D]`.
    let mut diff = 0f32;
    let mut start = 0;
    for &l in &lengths {
        let one = |t: &Tensor<B, 3>| {
            t.clone()
                .slice(start..start + l)
                .swap_dims(0, 1)
                .unsqueeze()
        };
        let burns = module::attention(one(&q), one(&k), one(&v), None, None, causal);
        let ours = out
            .clone()
            .slice(start..start + l)
            .swap_dims(0, 1)
            .unsqueeze();
        diff = diff.max(max_diff(ours, burns));
        start += l;
    }
    let dims = AttentionDims {
        batch: 1,
        heads_q: h,
        heads_kv: h,
        seq_q: total,
        seq_k: total,
        head_dim: d,
        value_dim: d,
    };
    let terms = ScoreTerms {
        varlen: true,
        ..Default::default()
    };
    let plan = burn_flash::attention_plan_with::<B>(device, dims, q.dtype(), causal.into(), terms);
    let kernel = match plan {
        Some(Ok(p)) => format!("{:?}", p.kernel),
        Some(Err(e)) => e.to_string(),
        None => "composed fallback".into(),
    };
    println!(
        "             varlen: prompts {lengths:?} packed as [{total}, {h}, {d}], causal: kernel {kernel}, max |burn-flash − burn (each prompt alone)| = {diff:.2e}"
    );
}

fn run<B: FlashBackend>(device: B::Device) {
    attention::<B>(&device);
    long_context::<B>(&device);
    modules::<B>(&device);
    demo::<B>(&device);
    gradients::<B>(&device);
    B::sync(&device).expect("device sync");
}

#[cfg(feature = "cuda")]
fn try_cuda() -> bool {
    use burn::backend::{Cuda, cuda::CudaDevice};
    if !std::path::Path::new("/dev/nvidiactl").exists() {
        println!("no NVIDIA device node: skipping CUDA");
        return false;
    }
    let probe = std::panic::catch_unwind(|| {
        let device = CudaDevice::default();
        Tensor::<Cuda, 1>::ones([4], &device)
            .sum()
            .into_scalar()
            .elem::<f32>()
    });
    match probe {
        Ok(_) => {
            println!("device: CUDA (NVIDIA GPU 0)");
            run::<Cuda>(CudaDevice::default());
            true
        }
        Err(_) => {
            println!("CUDA did not start: falling back to wgpu");
            false
        }
    }
}

#[cfg(feature = "wgpu")]
fn run_wgpu() {
    use burn::backend::{Wgpu, wgpu::WgpuDevice};
    use cubecl::{
        Runtime,
        wgpu::{AutoGraphicsApi, WgpuRuntime, init_setup},
    };
    let device = WgpuDevice::DefaultDevice;
    let setup = init_setup::<AutoGraphicsApi>(&device, Default::default());
    let info = setup.adapter.get_info();
    let kind = format!("{:?}", info.device_type);
    let what = if kind == "Cpu" {
        "Mesa lavapipe on the CPU"
    } else {
        "a GPU"
    };
    // The compiler the wgpu runtime picked for this adapter: SPIR-V on Vulkan with the
    // `vulkan` feature, MSL on Metal with `metal`, WGSL otherwise.
    let compiler = WgpuRuntime::name(&WgpuRuntime::client(&device));
    println!(
        "device: wgpu on {} ({kind}, {:?}) — {what}; kernels compiled by {compiler}",
        info.name, info.backend
    );
    run::<Wgpu>(device);
}

fn main() {
    // `--wgpu`: wgpu even where CUDA runs (a binary built with both shows the Vulkan path).
    #[cfg(feature = "cuda")]
    if !std::env::args().any(|a| a == "--wgpu") && try_cuda() {
        return;
    }
    #[cfg(feature = "wgpu")]
    {
        run_wgpu();
        return;
    }
    #[allow(unreachable_code)]
    {
        println!("built without `wgpu` or `cuda`: nothing to run on");
    }
}
