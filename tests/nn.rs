//! The drop-in modules (`burn_flash::nn`) against burn-nn 0.21's, on every backend. A module is
//! initialised with burn-nn's type, saved with a Burn recorder (`NamedMpkFileRecorder`) and
//! loaded into ours, and ours are saved and loaded into burn-nn's. Outputs and gradients are
//! compared by FlashAttention's rule: our error against burn-nn's module run in f64 (NdArray
//! f64, the same record) is at most twice the error of burn-nn's module in the dtype, plus a
//! floor. Dropout is off except in the dropout test.

mod common;

use burn::backend::{Autodiff, NdArray};
use burn::module::{AutodiffModule, Module, ModuleMapper, Param};
use burn::nn::attention::{
    CrossAttentionConfig as BurnCrossConfig, MhaInput as BurnMhaInput,
    MultiHeadAttentionConfig as BurnMhaConfig, generate_autoregressive_mask,
};
use burn::nn::transformer::{
    TransformerDecoderConfig as BurnDecoderConfig, TransformerDecoderInput as BurnDecoderInput,
    TransformerEncoderConfig as BurnEncoderConfig, TransformerEncoderInput as BurnEncoderInput,
};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::{
    Bool, DType, FloatDType, Tensor, TensorData, backend::Backend, ops::AttentionModuleOptions,
};
use burn_flash::nn::{
    CrossAttentionConfig, KvCache, MhaCache, MhaInput, MultiHeadAttentionConfig, PagedKvCache,
    TransformerDecoderConfig, TransformerDecoderInput, TransformerEncoderConfig,
    TransformerEncoderInput,
};
use burn_flash::{BlockTable, FlashAttentionOptions, FlashBackend, Rope};
use common::*;

/// The f64 reference backend: burn-nn's modules, same record.
type R = NdArray<f64>;

/// `module`'s record, through a file, loaded into `into` on `device`.
fn transfer<B1: Backend, B2: Backend, M1: Module<B1>, M2: Module<B2>>(
    from: M1,
    into: M2,
    device: &B2::Device,
) -> M2 {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("burn-flash-nn-{}-{n}", std::process::id()));
    let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    from.save_file(path.clone(), &recorder).expect("save");
    let loaded = into
        .load_file(path.clone(), &recorder, device)
        .expect("load");
    let _ = std::fs::remove_file(path.with_extension("mpk"));
    loaded
}

/// `module` with its parameters initialised. Burn initialises parameters lazily, and each clone
/// of an uninitialised module draws its own values: a module is fixed before it is cloned.
fn fixed<B: Backend, M: Module<B>>(module: M) -> M {
    let record = module.clone().into_record();
    module.load_record(record)
}

/// The same values on the reference backend, in f64.
fn to_ref<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Tensor<R, D> {
    Tensor::from_data(
        TensorData::new(read(t.clone()), t.dims()),
        (&Default::default(), DType::F64),
    )
}

/// Every float parameter of a reference module cast to f64 (tracked where it was). Burn 0.21
/// keeps one default float dtype per device, and `NdArray<f32>` and `NdArray<f64>` share the
/// CPU device: the first tensor a process makes on it fixes that default for both (f32 in this
/// suite), so a reference loaded from a record or made from data without a dtype computes in
/// f32 and equals burn-nn's f32 run bit for bit.
fn in_f64<B: Backend, M: Module<B>>(module: M) -> M {
    struct ToF64;
    impl<B: Backend> ModuleMapper<B> for ToF64 {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            param.map(|t| {
                let tracked = t.is_require_grad();
                let t = Tensor::from_data(t.to_data().convert::<f64>(), (&t.device(), DType::F64));
                if tracked { t.require_grad() } else { t }
            })
        }
    }
    module.map(&mut ToF64)
}

fn bool_ref<B: Backend, const D: usize>(t: &Tensor<B, D, Bool>) -> Tensor<R, D, Bool> {
    let values: Vec<bool> = read(t.clone().int().float())
        .into_iter()
        .map(|x| x != 0.0)
        .collect();
    Tensor::from_data(TensorData::new(values, t.dims()), &Default::default())
}

/// Ours (`got`) against burn-nn in the dtype (`naive`) and burn-nn in f64 (`want`).
fn compare<B: Backend, const D: usize>(
    got: Tensor<B, D>,
    naive: Tensor<B, D>,
    want: Tensor<R, D>,
    dtype: FloatDType,
    context: &str,
) {
    assert_eq!(
        want.dtype(),
        DType::F64,
        "{context}: the reference ran in {:?}",
        want.dtype()
    );
    let want: Vec<f64> = want
        .into_data()
        .convert::<f64>()
        .to_vec()
        .expect("f64 data");
    let (got, naive) = (read(got), read(naive));
    assert!(got.iter().all(|x| x.is_finite()), "{context}: not finite");
    // The rule is only as strict as burn-nn's own error: it must be that of rounding (TF32
    // matmuls on CUDA included), not of different parameters or semantics.
    let e_naive = max_err(&naive, &want);
    let bound = 2e-3 * max_abs(&want);
    assert!(
        e_naive <= bound,
        "{context}: burn-nn's own error {e_naive:e} > {bound:e}: the comparison is void"
    );
    // A few roundings of the largest value: the linear layers' sums of d_model terms.
    assert_within_naive(&got, &naive, &want, dtype, 8.0, context);
}

/// `MultiHeadAttention` loads burn-nn's record and gives burn-nn's outputs: masks (padding,
/// attention, both, fully masked rows), quiet softmax, `Sq ≠ Sk`, `causal()` against burn-nn's
/// autoregressive mask, and the weights on request. Ours saves records burn-nn loads.
fn mha_equals_burn_nn<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (nb, s, d_model, heads) = (2, 19, 32, 4);
    let cpu = Default::default();
    for quiet in [false, true] {
        let theirs = fixed(
            BurnMhaConfig::new(d_model, heads)
                .with_dropout(0.0)
                .with_quiet_softmax(quiet)
                .init::<B>(device),
        );
        let config = MultiHeadAttentionConfig::new(d_model, heads)
            .with_dropout(0.0)
            .with_quiet_softmax(quiet);
        let ours = transfer(theirs.clone(), config.init::<B>(device), device);
        let reference = in_f64(transfer(
            theirs.clone(),
            BurnMhaConfig::new(d_model, heads)
                .with_dropout(0.0)
                .with_quiet_softmax(quiet)
                .init::<R>(&cpu),
            &cpu,
        ));
        let x = rand3::<B>([nb, s, d_model], 1.0, dtype, device);
        let kv = rand3::<B>([nb, s + 7, d_model], 1.0, dtype, device);
        // Batch 1 pads its last 6 keys; rows 4 and 11 of the attention mask are fully masked.
        let pad = bool_mask::<B, 2>([nb, s], device, |i| i[0] == 1 && i[1] >= s - 6);
        let attn = bool_mask::<B, 3>([nb, s, s], device, |i| {
            i[1] == 4 || i[1] == 11 || (i[0] + i[1] * 3 + i[2]) % 5 == 0
        });
        type Masks<B> = (Option<Tensor<B, 2, Bool>>, Option<Tensor<B, 3, Bool>>);
        let cases: [(&str, Masks<B>); 4] = [
            ("no mask", (None, None)),
            ("padding", (Some(pad.clone()), None)),
            (
                "attention mask, fully masked rows",
                (None, Some(attn.clone())),
            ),
            ("both masks", (Some(pad.clone()), Some(attn.clone()))),
        ];
        for (name, (mask_pad, mask_attn)) in cases {
            let mut a = MhaInput::self_attn(x.clone());
            let mut b = BurnMhaInput::self_attn(x.clone());
            let mut r = BurnMhaInput::self_attn(to_ref(&x));
            if let Some(m) = &mask_pad {
                a = a.mask_pad(m.clone());
                b = b.mask_pad(m.clone());
                r = r.mask_pad(bool_ref(m));
            }
            if let Some(m) = &mask_attn {
                a = a.mask_attn(m.clone());
                b = b.mask_attn(m.clone());
                r = r.mask_attn(bool_ref(m));
            }
            let ctx = format!("MHA {name}, quiet {quiet}, {dtype:?}");
            let burn_out = theirs.forward(b.clone());
            let ref_out = reference.forward(r);
            compare(
                ours.forward(a.clone()).context,
                burn_out.context,
                ref_out.context,
                dtype,
                &ctx,
            );
            compare(
                ours.attention_weights(a),
                burn_out.weights,
                ref_out.weights,
                dtype,
                &format!("{ctx}: weights"),
            );
        }
        // Sq ≠ Sk, padding of the keys.
        let pad_k = bool_mask::<B, 2>([nb, s + 7], device, |i| i[1] + 3 * i[0] >= s + 4);
        let a = MhaInput::new(x.clone(), kv.clone(), kv.clone()).mask_pad(pad_k.clone());
        let b = BurnMhaInput::new(x.clone(), kv.clone(), kv.clone()).mask_pad(pad_k.clone());
        let r = BurnMhaInput::new(to_ref(&x), to_ref(&kv), to_ref(&kv)).mask_pad(bool_ref(&pad_k));
        compare(
            ours.forward(a).context,
            theirs.forward(b).context,
            reference.forward(r).context,
            dtype,
            &format!("MHA Sq 19 Sk 26, quiet {quiet}"),
        );
        // causal() against burn-nn's autoregressive mask, with padding.
        let causal = generate_autoregressive_mask::<B>(nb, s, device);
        let a = MhaInput::self_attn(x.clone())
            .causal()
            .mask_pad(pad.clone());
        let b = BurnMhaInput::self_attn(x.clone())
            .mask_attn(causal.clone())
            .mask_pad(pad.clone());
        let r = BurnMhaInput::self_attn(to_ref(&x))
            .mask_attn(bool_ref(&causal))
            .mask_pad(bool_ref(&pad));
        compare(
            ours.forward(a).context,
            theirs.forward(b.clone()).context,
            reference.forward(r).context,
            dtype,
            &format!("MHA causal() vs autoregressive mask, quiet {quiet}"),
        );
        // Ours saves what burn-nn loads: the same parameters, so the same bits.
        let back = transfer(
            ours.clone(),
            BurnMhaConfig::new(d_model, heads)
                .with_dropout(0.0)
                .with_quiet_softmax(quiet)
                .init::<B>(device),
            device,
        );
        assert_eq!(
            read(back.forward(b.clone()).context),
            read(theirs.forward(b).context),
            "burn-nn loading our record"
        );
    }
    sync::<B>(device);
}

/// Training through `MultiHeadAttention` gives burn-nn's gradients (parameters and input),
/// with padding and attention masks and causal.
fn mha_gradients_equal_burn_nn<B: FlashBackend>(_: &B::Device, dtype: FloatDType) {
    type A<B> = Autodiff<B>;
    type AR = Autodiff<R>;
    let device: B::Device = Default::default();
    let cpu = Default::default();
    let (nb, s, d_model, heads) = (2, 23, 32, 4);
    let theirs = fixed(
        BurnMhaConfig::new(d_model, heads)
            .with_dropout(0.0)
            .init::<A<B>>(&device),
    );
    let ours = transfer(
        theirs.clone(),
        MultiHeadAttentionConfig::new(d_model, heads)
            .with_dropout(0.0)
            .init::<A<B>>(&device),
        &device,
    );
    let reference = in_f64(transfer(
        theirs.clone(),
        BurnMhaConfig::new(d_model, heads)
            .with_dropout(0.0)
            .init::<AR>(&cpu),
        &cpu,
    ));
    let x = rand3::<A<B>>([nb, s, d_model], 1.0, dtype, &device);
    let g = rand3::<A<B>>([nb, s, d_model], 1.0, dtype, &device);
    // No fully masked row: there the f32 log-sum-exp of −1e4 scores rounds (see
    // `FlashAttentionOptions::masked_score`).
    let pad = bool_mask::<A<B>, 2>([nb, s], &device, |i| i[0] == 1 && i[1] >= s - 5);
    let attn = bool_mask::<A<B>, 3>([nb, s, s], &device, |i| (i[1] + i[2] * 2) % 7 == 3);
    for causal in [false, true] {
        let x_ours = x.clone().detach().require_grad();
        let x_theirs = x.clone().detach().require_grad();
        let x_ref = Tensor::<AR, 3>::from_inner(to_ref(&x.clone().inner())).require_grad();
        let mut a = MhaInput::self_attn(x_ours.clone())
            .mask_pad(pad.clone())
            .mask_attn(attn.clone());
        let mut b = BurnMhaInput::self_attn(x_theirs.clone())
            .mask_pad(pad.clone())
            .mask_attn(attn.clone());
        let mut r = BurnMhaInput::self_attn(x_ref.clone())
            .mask_pad(Tensor::from_inner(bool_ref(&pad.clone().inner())))
            .mask_attn(Tensor::from_inner(bool_ref(&attn.clone().inner())));
        if causal {
            let m = generate_autoregressive_mask::<A<B>>(nb, s, &device);
            a = a.causal();
            b = b.mask_attn(m.clone().bool_or(attn.clone()));
            r = r.mask_attn(Tensor::from_inner(bool_ref(
                &m.bool_or(attn.clone()).inner(),
            )));
        }
        let g_ref = Tensor::<AR, 3>::from_inner(to_ref(&g.clone().inner()));
        let ga = (ours.forward(a).context * g.clone()).sum().backward();
        let gb = (theirs.forward(b).context * g.clone()).sum().backward();
        let gr = (reference.forward(r).context * g_ref).sum().backward();
        let ctx = format!("MHA gradients, causal {causal}, {dtype:?}");
        let pairs = [
            (
                "query.weight",
                &ours.query.weight,
                &theirs.query.weight,
                &reference.query.weight,
            ),
            (
                "key.weight",
                &ours.key.weight,
                &theirs.key.weight,
                &reference.key.weight,
            ),
            (
                "value.weight",
                &ours.value.weight,
                &theirs.value.weight,
                &reference.value.weight,
            ),
            (
                "output.weight",
                &ours.output.weight,
                &theirs.output.weight,
                &reference.output.weight,
            ),
        ];
        for (name, o, t, rf) in pairs {
            compare(
                o.grad(&ga).expect("grad"),
                t.grad(&gb).expect("grad"),
                rf.grad(&gr).expect("grad"),
                dtype,
                &format!("{ctx}: {name}"),
            );
        }
        let qb = |m: &burn_flash::nn::MultiHeadAttention<A<B>>| m.query.bias.clone().unwrap();
        compare(
            qb(&ours).grad(&ga).expect("grad"),
            theirs.query.bias.clone().unwrap().grad(&gb).expect("grad"),
            reference
                .query
                .bias
                .clone()
                .unwrap()
                .grad(&gr)
                .expect("grad"),
            dtype,
            &format!("{ctx}: query.bias"),
        );
        compare(
            x_ours.grad(&ga).expect("grad"),
            x_theirs.grad(&gb).expect("grad"),
            x_ref.grad(&gr).expect("grad"),
            dtype,
            &format!("{ctx}: input"),
        );
    }
    sync::<B>(&Default::default());
}

/// `CrossAttention` with grouped-query heads (4 query heads, 2 key/value heads, never
/// repeated): burn-nn's record and outputs, padding of the context with one batch fully
/// masked, quiet softmax, and the cache computing the context's keys and values once.
fn cross_attention_equals_burn_nn<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let cpu = Default::default();
    let (nb, lq, lk, d_model, d_context) = (2, 13, 21, 24, 20);
    for quiet in [false, true] {
        let config = BurnCrossConfig {
            d_model,
            d_context,
            n_heads: 4,
            n_heads_kv: 2,
            d_head: 8,
            dropout: 0.0,
            min_float: -1.0e4,
            quiet_softmax: quiet,
        };
        let theirs = fixed(config.init::<B>(device));
        let ours = transfer(
            theirs.clone(),
            CrossAttentionConfig::new(d_model, d_context, 4, 2, 8)
                .with_dropout(0.0)
                .with_quiet_softmax(quiet)
                .init::<B>(device),
            device,
        );
        let reference = in_f64(transfer(theirs.clone(), config.init::<R>(&cpu), &cpu));
        let q = rand3::<B>([nb, lq, d_model], 1.0, dtype, device);
        let c = rand3::<B>([nb, lk, d_context], 1.0, dtype, device);
        // Batch 0: the last 5 positions padded; batch 1: everything (uniform weights).
        let mask = bool_mask::<B, 2>([nb, lk], device, |i| i[0] == 1 || i[1] >= lk - 5);
        let ctx = format!("cross-attention GQA 4:2, quiet {quiet}, {dtype:?}");
        let want = reference.forward(to_ref(&q), to_ref(&c), Some(bool_ref(&mask)));
        let naive = theirs.forward(q.clone(), c.clone(), Some(mask.clone()));
        compare(
            ours.forward(q.clone(), c.clone(), Some(mask.clone())),
            naive.clone(),
            want.clone(),
            dtype,
            &ctx,
        );
        let mut cache = burn_flash::nn::CrossAttentionCache::new();
        let first = ours.forward_cache(q.clone(), c.clone(), Some(mask.clone()), &mut cache);
        // The second call reads the cached keys and values: a different context changes
        // nothing.
        let other = rand3::<B>([nb, lk, d_context], 1.0, dtype, device);
        let second = ours.forward_cache(q.clone(), other, Some(mask.clone()), &mut cache);
        assert_eq!(read(first.clone()), read(second), "{ctx}: cached keys");
        compare(first, naive, want, dtype, &format!("{ctx}: cache"));
    }
    sync::<B>(device);
}

/// burn-nn's encoder without dropout (`(d_model, d_ff, heads, layers)`), ours from its record,
/// and burn-nn's on the f64 reference backend from the same record.
fn encoders<B: FlashBackend>(
    (d_model, d_ff, heads, layers): (usize, usize, usize, usize),
    norm_first: bool,
    device: &B::Device,
) -> (
    burn::nn::transformer::TransformerEncoder<B>,
    burn_flash::nn::TransformerEncoder<B>,
    burn::nn::transformer::TransformerEncoder<R>,
) {
    let cpu = Default::default();
    let enc = BurnEncoderConfig::new(d_model, d_ff, heads, layers)
        .with_dropout(0.0)
        .with_norm_first(norm_first);
    let theirs = fixed(enc.init::<B>(device));
    let ours = transfer(
        theirs.clone(),
        TransformerEncoderConfig::new(d_model, d_ff, heads, layers)
            .with_dropout(0.0)
            .with_norm_first(norm_first)
            .init::<B>(device),
        device,
    );
    let reference = in_f64(transfer(theirs.clone(), enc.init::<R>(&cpu), &cpu));
    (theirs, ours, reference)
}

/// `TransformerEncoder` and `TransformerDecoder` (post-LN and pre-LN) load burn-nn's records
/// and give burn-nn's outputs, with padding masks and burn-nn's autoregressive mask (and
/// ours, `causal()`).
fn transformer_equals_burn_nn<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let cpu = Default::default();
    let (nb, s, sm, d_model, d_ff, heads, layers) = (2, 17, 11, 32, 48, 4, 2);
    let x = rand3::<B>([nb, s, d_model], 1.0, dtype, device);
    let memory = rand3::<B>([nb, sm, d_model], 1.0, dtype, device);
    let pad = bool_mask::<B, 2>([nb, s], device, |i| i[0] == 0 && i[1] >= s - 4);
    let mem_pad = bool_mask::<B, 2>([nb, sm], device, |i| i[0] == 1 && i[1] >= sm - 3);
    let causal = generate_autoregressive_mask::<B>(nb, s, device);
    for norm_first in [false, true] {
        let ctx = format!("norm_first {norm_first}, {dtype:?}");
        let sizes = (d_model, d_ff, heads, layers);
        let (theirs, ours, reference) = encoders::<B>(sizes, norm_first, device);
        let want = reference.forward(
            BurnEncoderInput::new(to_ref(&x))
                .mask_pad(bool_ref(&pad))
                .mask_attn(bool_ref(&causal)),
        );
        let naive = theirs.forward(
            BurnEncoderInput::new(x.clone())
                .mask_pad(pad.clone())
                .mask_attn(causal.clone()),
        );
        let with_mask = ours.forward(
            TransformerEncoderInput::new(x.clone())
                .mask_pad(pad.clone())
                .mask_attn(causal.clone()),
        );
        compare(
            with_mask,
            naive.clone(),
            want.clone(),
            dtype,
            &format!("encoder, {ctx}"),
        );
        let with_causal = ours.forward(
            TransformerEncoderInput::new(x.clone())
                .mask_pad(pad.clone())
                .causal(),
        );
        compare(
            with_causal,
            naive,
            want,
            dtype,
            &format!("encoder causal(), {ctx}"),
        );

        let dec = BurnDecoderConfig::new(d_model, d_ff, heads, layers)
            .with_dropout(0.0)
            .with_norm_first(norm_first);
        let theirs = fixed(dec.init::<B>(device));
        let ours = transfer(
            theirs.clone(),
            TransformerDecoderConfig::new(d_model, d_ff, heads, layers)
                .with_dropout(0.0)
                .with_norm_first(norm_first)
                .init::<B>(device),
            device,
        );
        let reference = in_f64(transfer(theirs.clone(), dec.init::<R>(&cpu), &cpu));
        let want = reference.forward(
            BurnDecoderInput::new(to_ref(&x), to_ref(&memory))
                .target_mask_attn(bool_ref(&causal))
                .memory_mask_pad(bool_ref(&mem_pad)),
        );
        let naive = theirs.forward(
            BurnDecoderInput::new(x.clone(), memory.clone())
                .target_mask_attn(causal.clone())
                .memory_mask_pad(mem_pad.clone()),
        );
        let got = ours.forward(
            TransformerDecoderInput::new(x.clone(), memory.clone())
                .target_causal()
                .memory_mask_pad(mem_pad.clone()),
        );
        compare(got, naive, want, dtype, &format!("decoder, {ctx}"));
    }
    sync::<B>(device);
}

/// The unit roundoff of the projections' matmuls in `dtype`: TF32's (2⁻¹¹) for f32 where
/// Burn's f32 matmul rounds its operands to TF32 (CUDA), else the dtype's. A cached step's
/// projections (a few rows) and the full forward's (every row) may take matmul kernels that
/// round differently, so the comparison of the two is held to the coarser one.
fn matmul_eps<B: FlashBackend>(dtype: FloatDType, device: &B::Device) -> f64 {
    match dtype {
        FloatDType::F32 if f32_matmul_is_tf32::<B>(device) => 2f64.powi(-11),
        _ => eps(dtype),
    }
}

/// Decoding token by token with the KV cache equals the full causal forward: `MhaCache` (a
/// prompt, single tokens, a step of three), with `causal()` and with burn-nn's per-step
/// autoregressive mask (rows sliced from it), against burn-nn's own `forward_cache`; the
/// decoder's autoregressive inference against its full forward; `KvCache` growing past its
/// first capacity.
fn kv_cache_decoding<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (nb, s, d_model, heads) = (2, 14, 32, 4);
    let theirs = fixed(
        BurnMhaConfig::new(d_model, heads)
            .with_dropout(0.0)
            .init::<B>(device),
    );
    let ours = transfer(
        theirs.clone(),
        MultiHeadAttentionConfig::new(d_model, heads)
            .with_dropout(0.0)
            .init::<B>(device),
        device,
    );
    let x = rand3::<B>([nb, s, d_model], 1.0, dtype, device);
    let full = read(
        ours.forward(MhaInput::self_attn(x.clone()).causal())
            .context,
    );
    let tol = 16.0 * matmul_eps::<B>(dtype, device) * max_abs(&full);
    let close = |got: Vec<f64>, want: &[f64], what: &str| {
        let err = max_err(&got, want);
        assert!(err <= tol, "{what}: error {err:e} > {tol:e}");
    };
    let mut cache = MhaCache::autoregressive();
    let mut len = 0;
    for step in [5, 1, 1, 3, 1, 1, 1, 1] {
        len += step;
        let prefix = x.clone().slice([0..nb, 0..len, 0..d_model]);
        let got = ours.forward_cache(MhaInput::self_attn(prefix).causal(), &mut cache);
        assert_eq!(got.context.dims(), [nb, len, d_model]);
        let want: Vec<f64> = (0..nb)
            .flat_map(|b| full[b * s * d_model..(b * s + len) * d_model].to_vec())
            .collect();
        close(read(got.context), &want, &format!("cache at {len}"));
    }
    // burn-nn's own cache (one new token per call, its mask over the whole prefix each step)
    // gives the same.
    let mut burn_cache = burn::nn::attention::MhaCache::autoregressive();
    for len in 5..=s {
        let prefix = x.clone().slice([0..nb, 0..len, 0..d_model]);
        let mask = generate_autoregressive_mask::<B>(nb, len, device);
        let burn = theirs.forward_cache(
            BurnMhaInput::self_attn(prefix).mask_attn(mask),
            &mut burn_cache,
        );
        let want: Vec<f64> = (0..nb)
            .flat_map(|b| full[b * s * d_model..(b * s + len) * d_model].to_vec())
            .collect();
        // burn-nn's matmuls round to TF32 on CUDA: its own error bounds this comparison.
        let got = read(burn.context);
        let err = max_err(&got, &want);
        let loose = 2e-3 * max_abs(&want);
        assert!(
            err <= loose,
            "burn-nn cache at {len}: error {err:e} > {loose:e}"
        );
    }
    assert_eq!(cache.len(), s);
    // The same decode with burn-nn's mask tensor instead of causal(): its new rows are sliced.
    let mut cache = MhaCache::autoregressive();
    for len in [6, 7, 10, 14] {
        let prefix = x.clone().slice([0..nb, 0..len, 0..d_model]);
        let mask = generate_autoregressive_mask::<B>(nb, len, device);
        let got = ours.forward_cache(MhaInput::self_attn(prefix).mask_attn(mask), &mut cache);
        let want: Vec<f64> = (0..nb)
            .flat_map(|b| full[b * s * d_model..(b * s + len) * d_model].to_vec())
            .collect();
        close(read(got.context), &want, &format!("masked cache at {len}"));
    }
    // The decoder, token by token, against its full forward.
    let dec = fixed(
        TransformerDecoderConfig::new(d_model, 48, heads, 2)
            .with_dropout(0.0)
            .with_norm_first(true)
            .init::<B>(device),
    );
    let memory = rand3::<B>([nb, 9, d_model], 1.0, dtype, device);
    let full =
        read(dec.forward(TransformerDecoderInput::new(x.clone(), memory.clone()).target_causal()));
    let tol = 64.0 * eps(dtype) * max_abs(&full);
    let mut cache = dec.new_autoregressive_cache();
    for len in [4, 5, 6, 9, 14] {
        let prefix = x.clone().slice([0..nb, 0..len, 0..d_model]);
        let got = read(dec.forward_autoregressive_inference(
            TransformerDecoderInput::new(prefix, memory.clone()).target_causal(),
            &mut cache,
        ));
        let want: Vec<f64> = (0..nb)
            .flat_map(|b| full[b * s * d_model..(b * s + len) * d_model].to_vec())
            .collect();
        let err = max_err(&got, &want);
        assert!(
            err <= tol,
            "decoder cache at {len}: error {err:e} > {tol:e}"
        );
    }
    // The encoder (pre-LN, as a GPT stack), several positions per call, against its full
    // causal forward.
    let enc = fixed(
        TransformerEncoderConfig::new(d_model, 48, heads, 2)
            .with_dropout(0.0)
            .with_norm_first(true)
            .init::<B>(device),
    );
    let full = read(enc.forward(TransformerEncoderInput::new(x.clone()).causal()));
    let tol = 64.0 * eps(dtype) * max_abs(&full);
    let mut cache = enc.new_autoregressive_cache();
    for len in [3, 4, 8, 9, 14] {
        let prefix = x.clone().slice([0..nb, 0..len, 0..d_model]);
        let got = read(enc.forward_autoregressive_inference(
            TransformerEncoderInput::new(prefix).causal(),
            &mut cache,
        ));
        let want: Vec<f64> = (0..nb)
            .flat_map(|b| full[b * s * d_model..(b * s + len) * d_model].to_vec())
            .collect();
        let err = max_err(&got, &want);
        assert!(
            err <= tol,
            "encoder cache at {len}: error {err:e} > {tol:e}"
        );
    }
    // KvCache: 70 single positions (past the first capacity of 64) equal their concatenation.
    let mut kv = KvCache::<B>::new();
    let rows: Vec<Tensor<B, 4>> = (0..70)
        .map(|_| random::<B, 4>([1, 2, 1, 8], -1.0, 1.0, dtype, device))
        .collect();
    for r in &rows {
        kv.append(r.clone());
    }
    assert_eq!(kv.len(), 70);
    assert!(kv.capacity() >= 70);
    assert_eq!(
        read(kv.view()),
        read(Tensor::cat(rows, 2)),
        "KvCache contents"
    );
    sync::<B>(device);
}

/// Dropout of the attention weights under autodiff: the mean over draws is the output without
/// dropout (unbiased, `P ⊙ keep / (1 − p)`), draws differ, `nn::seed` replays them, and without
/// autodiff nothing is dropped.
fn dropout_statistics<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    type A<B> = Autodiff<B>;
    let (nb, s, d_model, heads, p) = (1, 12, 16, 2, 0.3);
    let ad: B::Device = Default::default();
    let plain = MultiHeadAttentionConfig::new(d_model, heads).with_dropout(0.0);
    let dropping = MultiHeadAttentionConfig::new(d_model, heads).with_dropout(p);
    let base = fixed(plain.init::<A<B>>(&ad));
    let module = transfer(base.clone(), dropping.init::<A<B>>(&ad), &ad);
    let x = rand3::<A<B>>([nb, s, d_model], 1.0, dtype, &ad);
    let input = || MhaInput::self_attn(x.clone());
    let want = read(base.forward(input()).context);
    let draws = 200;
    let outs: Vec<Vec<f64>> = (0..draws)
        .map(|_| read(module.forward(input()).context))
        .collect();
    assert_ne!(
        outs[0], outs[1],
        "two training calls drew the same dropout mask"
    );
    let n = want.len();
    for (i, w) in want.iter().enumerate() {
        let mean = outs.iter().map(|o| o[i]).sum::<f64>() / draws as f64;
        let var = outs.iter().map(|o| (o[i] - mean).powi(2)).sum::<f64>() / (draws - 1) as f64;
        let se = (var / draws as f64).sqrt();
        // 5 standard errors over n elements: a false alarm is far below 1e-4.
        assert!(
            (mean - w).abs() <= 5.0 * se + 1e-5,
            "element {i} of {n}: mean over {draws} draws {mean}, without dropout {w} (se {se})"
        );
    }
    burn_flash::nn::seed(7);
    let a = read(module.forward(input()).context);
    burn_flash::nn::seed(7);
    let b = read(module.forward(input()).context);
    assert_eq!(a, b, "nn::seed replays the masks");
    // Inference (no autodiff): no dropout.
    let inner = module.valid();
    let got = read(
        inner
            .forward(MhaInput::self_attn(x.clone().inner()))
            .context,
    );
    let err = max_err(&got, &want);
    assert!(err <= 1e-5, "inference dropped weights: error {err:e}");
    let _ = device;
    sync::<B>(device);
}

/// Sliding-window attention in the module: `causal().window(w − 1, 0)` equals burn-nn with the
/// band as its attention mask; decoding token by token (and a step of several) with
/// `MhaCache::sliding_window` equals the full windowed forward while the cache forgets old keys
/// and stays bounded; a window cache without a window on the input is refused.
fn sliding_window_decoding<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (nb, s, d_model, heads, w) = (2, 150, 32, 4, 16);
    let theirs = fixed(
        BurnMhaConfig::new(d_model, heads)
            .with_dropout(0.0)
            .init::<B>(device),
    );
    let ours = transfer(
        theirs.clone(),
        MultiHeadAttentionConfig::new(d_model, heads)
            .with_dropout(0.0)
            .init::<B>(device),
        device,
    );
    let x = rand3::<B>([nb, s, d_model], 1.0, dtype, device);
    let input = || MhaInput::self_attn(x.clone()).causal().window(w - 1, 0);
    let got = ours.forward(input()).context;
    let cpu = Default::default();
    let reference = in_f64(transfer(
        theirs.clone(),
        BurnMhaConfig::new(d_model, heads)
            .with_dropout(0.0)
            .init::<R>(&cpu),
        &cpu,
    ));
    let band = bool_mask::<B, 3>([nb, s, s], device, |[_, i, j]| j > i || j + w <= i);
    let naive = theirs
        .forward(BurnMhaInput::self_attn(x.clone()).mask_attn(band.clone()))
        .context;
    let want = reference
        .forward(BurnMhaInput::self_attn(to_ref(&x)).mask_attn(bool_ref(&band)))
        .context;
    compare(
        got.clone(),
        naive,
        want,
        dtype,
        "window (15, 0) against burn-nn's band mask",
    );
    let full = read(got);
    let tol = 16.0 * matmul_eps::<B>(dtype, device) * max_abs(&full);
    let mut cache = MhaCache::sliding_window(w - 1);
    let mut len = 0;
    let mut steps = vec![20, 1, 1, 5];
    steps.extend(std::iter::repeat_n(1, s - 27));
    for step in steps {
        len += step;
        let prefix = x.clone().slice([0..nb, 0..len, 0..d_model]);
        let got = ours.forward_cache(
            MhaInput::self_attn(prefix).causal().window(w - 1, 0),
            &mut cache,
        );
        if len % 16 == 0 || len == s {
            let want: Vec<f64> = (0..nb)
                .flat_map(|b| full[b * s * d_model..(b * s + len) * d_model].to_vec())
                .collect();
            let err = max_err(&read(got.context), &want);
            assert!(err <= tol, "window cache at {len}: error {err:e} > {tol:e}");
        }
        let held = cache.keys_held();
        assert!(held <= 64 + step, "window cache holds {held} keys at {len}");
    }
    assert!(cache.keys_held() < s, "the window cache forgot nothing");
    let msg = panic_message(|| {
        let mut cache = MhaCache::<B>::sliding_window(w - 1);
        ours.forward_cache(MhaInput::self_attn(x.clone()).causal(), &mut cache);
    });
    assert!(
        msg.contains("a sliding-window cache keeps the last 15 keys"),
        "{msg}"
    );
    sync::<B>(device);
}

/// [`PagedKvCache`] against attention over each sequence's keys and values held
/// contiguously: three sequences prefilled one at a time with prompts of 5, 17 and 9 tokens,
/// then 12 decoding steps of all three together (appends crossing blocks of 8), two layers,
/// GQA 4:2, causal; then a released sequence's blocks go back to the free list and are reused,
/// and an exhausted pool is refused. A twin cache runs every step through `append_attend`
/// (the append and the attention as one op) and must agree bit for bit, with RoPE as well
/// (`append` rotating, then `attend` with the rotated queries).
fn paged_kv_cache<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (layers, hq, hkv, d, bs, blocks) = (2, 4, 2, 32, 8, 14);
    let new_cache = || {
        let mut cache = PagedKvCache::<B>::new(layers, blocks, bs, hkv, d, dtype.into(), device);
        for _ in 0..3 {
            cache.add_sequence();
        }
        cache
    };
    let (mut cache, mut twin) = (new_cache(), new_cache());
    let ids = [0, 1, 2];
    let causal = FlashAttentionOptions::from(AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    });
    // Each layer's keys and values of each sequence so far, `[1, Hkv, len, D]` (unrotated
    // runs only).
    type Held<B> = Option<(Tensor<B, 4>, Tensor<B, 4>)>;
    let mut held: Vec<Vec<Held<B>>> = vec![vec![None; 3]; layers];
    let check = |got: Tensor<B, 4>, q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>, what| {
        let want = read(burn_flash::attention(q, k, v, None, None, causal.module));
        let got = read(got);
        let tol = 16.0 * eps(dtype) * max_abs(&want).max(1.0);
        let err = max_err(&got, &want);
        assert!(err <= tol, "{what}: error {err:e} > {tol:e}");
    };
    // One step of `new` tokens for `ids` in `cache` (append, then attend) and in `twin`
    // (`append_attend`); with `held`, every output against the contiguous reference.
    let step_on = |cache: &mut PagedKvCache<B>,
                   twin: &mut PagedKvCache<B>,
                   mut held: Option<&mut Vec<Vec<Held<B>>>>,
                   rope: Option<&Rope<B>>,
                   ids: &[usize],
                   new: usize,
                   what: &str| {
        let n = ids.len();
        let step = cache.reserve(ids, new, device);
        let twin_step = twin.reserve(ids, new, device);
        for layer in 0..layers {
            let k = rand4::<B>([n, hkv, new, d], 1.0, dtype, device);
            let v = rand4::<B>([n, hkv, new, d], 1.0, dtype, device);
            let q = rand4::<B>([n, hq, new, d], 1.0, dtype, device);
            let rotated = cache.append(
                layer,
                &step,
                k.clone(),
                v.clone(),
                rope.map(|r| (r, q.clone())),
            );
            assert_eq!(rotated.is_some(), rope.is_some(), "{what}: rotated queries");
            let out = cache.attend(layer, &step, rotated.unwrap_or_else(|| q.clone()), causal);
            let (k2, v2, q2) = (k.clone(), v.clone(), q.clone());
            let fused = twin.append_attend(layer, &twin_step, k2, v2, q2, rope, causal);
            assert_eq!(
                read(fused),
                read(out.clone()),
                "{what}, layer {layer}: append_attend against append, then attend"
            );
            let Some(held) = held.as_deref_mut() else {
                continue;
            };
            for (b, &id) in ids.iter().enumerate() {
                let (kb, vb) = (k.clone().narrow(0, b, 1), v.clone().narrow(0, b, 1));
                let (k_all, v_all) = match held[layer][id].take() {
                    Some((hk, hv)) => (Tensor::cat(vec![hk, kb], 2), Tensor::cat(vec![hv, vb], 2)),
                    None => (kb, vb),
                };
                check(
                    out.clone().narrow(0, b, 1),
                    q.clone().narrow(0, b, 1),
                    k_all.clone(),
                    v_all.clone(),
                    format!("{what}, layer {layer}, sequence {id}"),
                );
                held[layer][id] = Some((k_all, v_all));
            }
        }
        cache.commit(step);
        twin.commit(twin_step);
    };
    for (&id, prompt) in ids.iter().zip([5, 17, 9]) {
        step_on(
            &mut cache,
            &mut twin,
            Some(&mut held),
            None,
            &[id],
            prompt,
            "prefill",
        );
    }
    for t in 0..12 {
        let what = format!("decoding step {t}");
        step_on(&mut cache, &mut twin, Some(&mut held), None, &ids, 1, &what);
    }
    assert_eq!(ids.map(|id| cache.len(id)), [17, 29, 21]);
    // 3 + 4 + 3 blocks held of 14.
    assert_eq!(cache.free_blocks(), 4);
    cache.release(ids[1]);
    assert_eq!(cache.free_blocks(), 8);
    assert_eq!(
        cache.add_sequence(),
        ids[1],
        "a released id is given out again"
    );
    let msg = panic_message(|| {
        let _ = cache.reserve(&[ids[1]], 9 * bs, device);
    });
    assert!(msg.contains("exhausted"), "{msg}");
    // With RoPE (half-split pairs over 24 of the 32 columns): prompts crossing a block, then
    // steps of one and of two tokens.
    let rope = Rope::new(10_000.0, 24, 64, false, device);
    let (mut cache, mut twin) = (new_cache(), new_cache());
    for (&id, prompt) in ids.iter().zip([11, 3, 8]) {
        step_on(
            &mut cache,
            &mut twin,
            None,
            Some(&rope),
            &[id],
            prompt,
            "RoPE prefill",
        );
    }
    for (t, new) in [1, 1, 2, 1].into_iter().enumerate() {
        let what = format!("RoPE step {t}");
        step_on(&mut cache, &mut twin, None, Some(&rope), &ids, new, &what);
    }
    sync::<B>(device);
}

/// A rolling [`PagedKvCache`] (`with_window`) against windowed attention over each sequence's
/// keys held contiguously (the band as an explicit mask): prompts shorter and longer than the
/// window of 12 (left 11), prefilled one at a time, then 30 decoding steps of all three and a
/// step of three tokens, blocks of 8. The cache gives blocks back as the window moves on: it
/// never holds more than 3 blocks a sequence, in a pool of 10 that the whole sequences (18
/// blocks) would exhaust. Attention through it without the window, and a rolling table that
/// gave back keys it does not hold, are refused.
fn rolling_paged_cache<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (hq, hkv, d, bs, left, blocks) = (4, 2, 32, 8, 11, 10);
    let mut cache =
        PagedKvCache::<B>::new(1, blocks, bs, hkv, d, dtype.into(), device).with_window(left);
    let ids: Vec<usize> = (0..3).map(|_| cache.add_sequence()).collect();
    let causal = FlashAttentionOptions::from(AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    });
    let windowed = FlashAttentionOptions {
        window: Some((left, 0)),
        ..causal
    };
    type Held<B> = Option<(Tensor<B, 4>, Tensor<B, 4>)>;
    let mut held: Vec<Held<B>> = vec![None; 3];
    let mut most = 0;
    let mut step_on = |cache: &mut PagedKvCache<B>, ids: &[usize], new: usize, what: &str| {
        let n = ids.len();
        let step = cache.reserve(ids, new, device);
        let k = rand4::<B>([n, hkv, new, d], 1.0, dtype, device);
        let v = rand4::<B>([n, hkv, new, d], 1.0, dtype, device);
        let q = rand4::<B>([n, hq, new, d], 1.0, dtype, device);
        assert!(cache.append(0, &step, k.clone(), v.clone(), None).is_none());
        let out = cache.attend(0, &step, q.clone(), windowed);
        for (b, &id) in ids.iter().enumerate() {
            let (kb, vb) = (k.clone().narrow(0, b, 1), v.clone().narrow(0, b, 1));
            let (k_all, v_all) = match held[id].take() {
                Some((hk, hv)) => (Tensor::cat(vec![hk, kb], 2), Tensor::cat(vec![hv, vb], 2)),
                None => (kb, vb),
            };
            let len = k_all.dims()[2];
            // Query `i` sits at `len − new + i` and sees keys `p − left ..= p`.
            let band = bool_mask::<B, 4>([1, 1, new, len], device, |[_, _, i, j]| {
                let p = len - new + i;
                j > p || j + left < p
            });
            let qb = q.clone().narrow(0, b, 1);
            let want = burn_flash::attention(
                qb,
                k_all.clone(),
                v_all.clone(),
                Some(band),
                None,
                Default::default(),
            );
            let want = read(want);
            let got = read(out.clone().narrow(0, b, 1));
            let tol = 16.0 * eps(dtype) * max_abs(&want).max(1.0);
            let err = max_err(&got, &want);
            assert!(
                err <= tol,
                "{what}, sequence {id} at {len}: error {err:e} > {tol:e}"
            );
            held[id] = Some((k_all, v_all));
        }
        cache.commit(step);
        for &id in ids {
            most = most.max(cache.held_blocks(id));
        }
    };
    for (&id, prompt) in ids.iter().zip([5, 20, 13]) {
        step_on(&mut cache, &[id], prompt, "prefill");
    }
    for t in 0..30 {
        step_on(&mut cache, &ids, 1, &format!("decoding step {t}"));
    }
    step_on(&mut cache, &ids, 3, "a step of 3 tokens");
    assert_eq!(
        ids.iter().map(|&id| cache.len(id)).collect::<Vec<_>>(),
        [38, 53, 46]
    );
    assert!(most <= 3, "a sequence held {most} blocks");
    let held_now: usize = ids.iter().map(|&id| cache.held_blocks(id)).sum();
    assert_eq!(
        cache.free_blocks() + held_now,
        blocks,
        "blocks lost or doubled"
    );
    // Attending without the window would read keys the cache gave back.
    let step = cache.reserve(&ids, 1, device);
    let k = rand4::<B>([3, hkv, 1, d], 1.0, dtype, device);
    let q = rand4::<B>([3, hq, 1, d], 1.0, dtype, device);
    cache.append(0, &step, k.clone(), k, None);
    for options in [
        causal,
        FlashAttentionOptions {
            window: Some((left + 8, 0)),
            ..causal
        },
    ] {
        let msg = panic_message(|| {
            cache.attend(0, &step, q.clone(), options);
        });
        assert!(msg.contains("a rolling cache gave back its first"), "{msg}");
    }
    cache.commit(step);
    let before = cache.free_blocks();
    let gone = cache.held_blocks(ids[0]);
    cache.release(ids[0]);
    assert_eq!(cache.free_blocks(), before + gone);
    let msg = panic_message(|| {
        let _ = BlockTable::<B>::rolling(vec![vec![0]], vec![2], vec![10], bs, 4, device);
    });
    assert!(
        msg.contains("gave back 2 blocks (16 keys) but holds only 10 keys"),
        "{msg}"
    );
    sync::<B>(device);
}

/// `ServingEncoder`: prompts of different lengths prefilled as one packed batch, then decoding
/// steps (one token for every sequence, two for some, a sequence released in between) through
/// the paged cache (blocks of 8: prompts and steps cross block boundaries), every output row
/// against burn-nn's encoder on the whole sequence with the causal mask (f64 reference, twice
/// the naive error), pre-LN and post-LN.
fn serving_encoder<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (d_model, d_ff, heads, layers) = (32, 48, 4, 2);
    let prompts = [5, 17, 9];
    // The steps after the prefill: the sequences of each and their new tokens.
    let steps: [(&[usize], usize); 6] = [
        (&[0, 1, 2], 1),
        (&[0, 1, 2], 1),
        (&[0, 1, 2], 1),
        (&[0, 2], 2),
        (&[2], 1),
        (&[0, 2], 1),
    ];
    let mut lengths = prompts.to_vec();
    for (ids, new) in steps {
        for &i in ids {
            lengths[i] += new;
        }
    }
    // Each sequence's inputs, `[1, L, d_model]`.
    let xs: Vec<Tensor<B, 3>> = lengths
        .iter()
        .map(|&l| rand3::<B>([1, l, d_model], 1.0, dtype, device))
        .collect();
    for norm_first in [true, false] {
        let ctx = format!("norm_first {norm_first}, {dtype:?}");
        let sizes = (d_model, d_ff, heads, layers);
        let (theirs, ours, reference) = encoders::<B>(sizes, norm_first, device);
        let serving = ours.serving();
        assert_eq!(serving.layers(), layers);
        let mut cache = serving.new_paged_cache(16, 8, device);
        let ids: Vec<usize> = (0..3).map(|_| cache.add_sequence()).collect();
        let rows = |i: usize, from: usize, n: usize| xs[i].clone().narrow(1, from, n);
        // Every output row of each sequence, in order.
        let mut got: Vec<Vec<Tensor<B, 3>>> = vec![Vec::new(); 3];
        let packed = Tensor::cat((0..3).map(|i| rows(i, 0, prompts[i])).collect(), 1);
        let total: usize = prompts.iter().sum();
        let out = serving.prefill(packed.reshape([total, d_model]), &ids, &prompts, &mut cache);
        assert_eq!(out.dims(), [total, d_model]);
        let mut start = 0;
        for i in 0..3 {
            got[i].push(out.clone().narrow(0, start, prompts[i]).unsqueeze_dim(0));
            start += prompts[i];
            assert_eq!(cache.len(ids[i]), prompts[i]);
        }
        let mut held = prompts.to_vec();
        for (step, (which, new)) in steps.iter().enumerate() {
            if step == 3 {
                // Sequence 1 is done: its blocks go back and the batch shrinks.
                let free = cache.free_blocks();
                cache.release(ids[1]);
                assert_eq!(cache.free_blocks(), free + held[1].div_ceil(8));
            }
            let x = Tensor::cat(which.iter().map(|&i| rows(i, held[i], *new)).collect(), 0);
            let step_ids: Vec<usize> = which.iter().map(|&i| ids[i]).collect();
            let out = serving.decode(x, &step_ids, &mut cache);
            assert_eq!(out.dims(), [which.len(), *new, d_model]);
            for (b, &i) in which.iter().enumerate() {
                got[i].push(out.clone().narrow(0, b, 1));
                held[i] += new;
            }
        }
        assert_eq!(held, lengths);
        for i in 0..3 {
            let l = lengths[i];
            let mask = generate_autoregressive_mask::<B>(1, l, device);
            let want =
                reference.forward(BurnEncoderInput::new(to_ref(&xs[i])).mask_attn(bool_ref(&mask)));
            let naive = theirs.forward(BurnEncoderInput::new(xs[i].clone()).mask_attn(mask));
            let got = Tensor::cat(std::mem::take(&mut got[i]), 1);
            compare(got, naive, want, dtype, &format!("{ctx}, sequence {i}"));
        }
    }
    sync::<B>(device);
}

/// `burn_flash::layer_norm` (one kernel on CubeCL backends) against burn-nn's `LayerNorm` in f64
/// (twice the naive error of burn-nn's in the dtype): rows narrower and wider than a cube's
/// units, a width that is no power of two, a strided input (the normalised dimension not
/// contiguous), with and without β, random γ and β, inputs off zero mean; and its refusals.
fn fused_layer_norm<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let cpu = Default::default();
    for (shape, bias, strided) in [
        ([2, 7, 64], true, false),
        ([1, 3, 512], true, false),
        ([3, 2, 1000], false, false),
        ([1, 5, 24], true, true),
        ([1, 40, 3], true, false),
    ] {
        let ctx = format!("{shape:?}, bias {bias}, strided {strided}, {dtype:?}");
        let width = shape[2];
        let x = rand3::<B>(shape, 3.0, dtype, device).add_scalar(1.5);
        // The same values with the normalised dimension strided: made `[.., width, rows]` and
        // swapped (a view).
        let x = match strided {
            true => x.swap_dims(1, 2).into_data().convert::<f32>(),
            false => x.into_data().convert::<f32>(),
        };
        let x = Tensor::<B, 3>::from_data(x, (device, dtype.into()));
        let x = match strided {
            true => x.swap_dims(1, 2),
            false => x,
        };
        let norm = fixed(
            burn::nn::LayerNormConfig::new(width)
                .with_bias(bias)
                .init::<B>(device),
        );
        // Parameters off their initial ones (γ = 1, β = 0).
        let gamma = rand3::<B>([1, 1, width], 1.0, dtype, device).reshape([width]);
        let beta = rand3::<B>([1, 1, width], 1.0, dtype, device).reshape([width]);
        let mut norm = norm;
        norm.gamma = burn::module::Param::from_tensor(gamma);
        norm.beta = bias.then(|| burn::module::Param::from_tensor(beta));
        let reference = in_f64(transfer(
            norm.clone(),
            burn::nn::LayerNormConfig::new(width)
                .with_bias(bias)
                .init::<R>(&cpu),
            &cpu,
        ));
        let want = reference.forward(to_ref(&x));
        let naive = norm.forward(x.clone());
        let got = burn_flash::layer_norm(
            x.clone(),
            norm.gamma.val(),
            norm.beta.as_ref().map(|b| b.val()),
            1e-5,
        );
        assert_eq!(got.dims(), shape, "{ctx}");
        assert_eq!(want.dtype(), DType::F64, "{ctx}: the reference's dtype");
        let want: Vec<f64> = want.into_data().convert::<f64>().to_vec().expect("f64");
        let got = read(got);
        assert!(got.iter().all(|x| x.is_finite()), "{ctx}: not finite");
        // The floor's scale: `x − μ` carries a rounding of `μ`, which `/σ` and `γ` amplify by
        // `|μ|·|γ| / σ`. Narrow rows can have a small σ (width 3, seed 5373700181749776822:
        // 10 roundings of max |y|), beside which max |y| alone is too small a scale.
        let xs = read(x.clone());
        let gamma_max = max_abs(&read(norm.gamma.val()));
        let amplified = xs
            .chunks(width)
            .map(|row| {
                let n = row.len() as f64;
                let mean = row.iter().sum::<f64>() / n;
                let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
                mean.abs() * gamma_max / (var + 1e-5).sqrt()
            })
            .fold(0.0f64, f64::max);
        let ulps = 8.0 * (1.0 + amplified / max_abs(&want));
        assert_within_naive(&got, &read(naive), &want, dtype, ulps, &ctx);
    }
    let x = rand3::<B>([2, 3, 8], 1.0, dtype, device);
    let msg = panic_message(|| {
        let gamma = rand3::<B>([1, 1, 7], 1.0, dtype, device).reshape([7]);
        let _ = burn_flash::layer_norm(x.clone(), gamma, None, 1e-5);
    });
    assert!(msg.contains("`gamma` has shape [7], expected [8]"), "{msg}");
    sync::<B>(device);
}

/// `burn_flash::linear` (the few-rows kernel on CubeCL backends up to 16 rows, Burn's matmul
/// beyond) against burn-nn's `Linear` in f64 (twice the naive error of burn-nn's in the
/// dtype): 1, 3, 5 and 16 rows (one and several row chunks per cube), 40 rows (Burn's matmul),
/// reduction dims that are and are not multiples of the kernel's lanes and unrolling, output
/// widths of whole vectors, of a vector and a half-width one (vectors of 2) and of an odd count
/// (scalars), with and without bias, a strided input and a transposed weight; and its refusals.
fn fused_linear<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let cpu = Default::default();
    for (rows, k, n, bias, strided) in [
        (1, 512, 1536, true, false),
        (3, 200, 96, true, false),
        (5, 64, 36, false, true),
        (16, 300, 130, true, false),
        (2, 17, 7, true, true),
        (40, 64, 48, true, false),
    ] {
        let ctx = format!("[{rows}, {k}] · [{k}, {n}], bias {bias}, strided {strided}, {dtype:?}");
        let layer = fixed(
            burn::nn::LinearConfig::new(k, n)
                .with_bias(bias)
                .init::<B>(device),
        );
        let mut layer = layer;
        // Weights (and the input) drawn fresh, the weight transposed in memory when `strided`.
        let w = rand3::<B>([1, k, n], 1.0, dtype, device).reshape([k, n]);
        let w = match strided {
            true => Tensor::<B, 2>::from_data(
                w.transpose().into_data().convert::<f32>(),
                (device, dtype.into()),
            )
            .transpose(),
            false => w,
        };
        layer.weight = burn::module::Param::from_tensor(w);
        let b = rand3::<B>([1, 1, n], 1.0, dtype, device).reshape([n]);
        layer.bias = bias.then(|| burn::module::Param::from_tensor(b));
        let x = rand3::<B>([1, rows, k], 1.0, dtype, device);
        let x = match strided {
            true => Tensor::<B, 3>::from_data(
                x.swap_dims(1, 2).into_data().convert::<f32>(),
                (device, dtype.into()),
            )
            .swap_dims(1, 2),
            false => x,
        };
        let reference = in_f64(transfer(
            layer.clone(),
            burn::nn::LinearConfig::new(k, n)
                .with_bias(bias)
                .init::<R>(&cpu),
            &cpu,
        ));
        let want = reference.forward(to_ref(&x));
        let naive = layer.forward(x.clone());
        let got = burn_flash::linear(
            x.clone(),
            layer.weight.val(),
            layer.bias.as_ref().map(|b| b.val()),
        );
        assert_eq!(got.dims(), [1, rows, n], "{ctx}");
        assert_eq!(want.dtype(), DType::F64, "{ctx}: the reference's dtype");
        let want: Vec<f64> = want.into_data().convert::<f64>().to_vec().expect("f64");
        let got = read(got);
        assert!(got.iter().all(|x| x.is_finite()), "{ctx}: not finite");
        assert_within_naive(&got, &read(naive), &want, dtype, 8.0, &ctx);
    }
    let x = rand3::<B>([2, 3, 8], 1.0, dtype, device);
    let w7 = || rand3::<B>([1, 7, 4], 1.0, dtype, device).reshape([7, 4]);
    let w8 = || rand3::<B>([1, 8, 4], 1.0, dtype, device).reshape([8, 4]);
    let b3 = || rand3::<B>([1, 1, 3], 1.0, dtype, device).reshape([3]);
    for (want, w, b) in [
        ("`weight` has shape [7, 4], expected [8, N]", w7(), None),
        ("`bias` has shape [3], expected [4]", w8(), Some(b3())),
    ] {
        let msg = panic_message(|| {
            let _ = burn_flash::linear(x.clone(), w, b);
        });
        assert!(msg.contains(want), "expected `{want}`, got `{msg}`");
    }
    sync::<B>(device);
}

/// `ServingEncoder` refuses bad calls before anything runs, one case each: prompts that are
/// not `[Σ lengths, d_model]`, as many lengths as sequences, an empty prompt, a prefill of a
/// sequence that holds positions, a decoding step of the wrong shape.
fn serving_bad_input<B: FlashBackend>(device: &B::Device, dtype: FloatDType) {
    let (d_model, heads) = (16, 2);
    let ours = TransformerEncoderConfig::new(d_model, 32, heads, 1)
        .with_dropout(0.0)
        .with_norm_first(true)
        .init::<B>(device);
    let serving = ours.serving();
    let mut cache = serving.new_paged_cache(8, 4, device);
    let a = cache.add_sequence();
    let b = cache.add_sequence();
    let x =
        |rows: usize| rand3::<B>([1, rows, d_model], 1.0, dtype, device).reshape([rows, d_model]);
    type Case<'a, B> = Box<dyn FnOnce(&mut burn_flash::nn::PagedKvCache<B>) + 'a>;
    let cases: [(&str, Case<B>); 4] = [
        (
            "expected [7 tokens, d_model 16]",
            Box::new(|c| {
                serving.prefill(x(6), &[a, b], &[3, 4], c);
            }),
        ),
        (
            "2 sequences for 1 prompt lengths",
            Box::new(|c| {
                serving.prefill(x(3), &[a, b], &[3], c);
            }),
        ),
        (
            "has an empty prompt",
            Box::new(|c| {
                serving.prefill(x(3), &[a, b], &[3, 0], c);
            }),
        ),
        (
            "expected [1 sequences, S ≥ 1, d_model 16]",
            Box::new(|c| {
                let x = rand3::<B>([2, 1, d_model], 1.0, dtype, device);
                serving.decode(x, &[a], c);
            }),
        ),
    ];
    for (want, case) in cases {
        let msg = panic_message(|| case(&mut cache));
        assert!(msg.contains(want), "expected `{want}`, got `{msg}`");
    }
    // Nothing was taken by the refused calls; a prefill then works, and a second one of the
    // same sequence is refused.
    assert_eq!(cache.free_blocks(), 8);
    serving.prefill(x(5), &[a], &[5], &mut cache);
    assert_eq!(cache.len(a), 5);
    let msg = panic_message(|| {
        serving.prefill(x(2), &[a], &[2], &mut cache);
    });
    assert!(msg.contains("already holds 5 positions"), "{msg}");
    sync::<B>(device);
}

macro_rules! nn_suite {
    ($module:ident, $backend:ty, $dtype:expr) => {
        suite!(
            $module,
            $backend,
            $dtype,
            [
                mha_equals_burn_nn,
                mha_gradients_equal_burn_nn,
                cross_attention_equals_burn_nn,
                transformer_equals_burn_nn,
                kv_cache_decoding,
                sliding_window_decoding,
                paged_kv_cache,
                rolling_paged_cache,
                fused_layer_norm,
                fused_linear,
                serving_encoder,
                serving_bad_input,
                dropout_statistics,
            ]
        );
    };
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    nn_suite!(f32, burn::backend::Wgpu, FloatDType::F32);
    suite!(
        f16,
        burn::backend::Wgpu,
        FloatDType::F16,
        [fused_layer_norm, fused_linear]
    );
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    nn_suite!(f32, burn::backend::Cuda, FloatDType::F32);
    suite!(
        bf16,
        burn::backend::Cuda,
        FloatDType::BF16,
        [fused_layer_norm, fused_linear, rolling_paged_cache]
    );
    suite!(
        f16,
        burn::backend::Cuda,
        FloatDType::F16,
        [fused_layer_norm, fused_linear]
    );
}

#[cfg(feature = "ndarray")]
mod ndarray {
    use super::*;
    nn_suite!(f32, burn::backend::NdArray, FloatDType::F32);
}
