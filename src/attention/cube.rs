//! Attention on `CubeBackend`: validate, convert the mask, allocate, launch.

use burn::tensor::{
    DType, FloatDType, IntDType,
    ops::{BoolTensorOps, IntTensorOps},
};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor,
};
use burn_flash_kernels::attention::{
    AttentionBackwardPlan, AttentionDims, AttentionError, AttentionFeatures, AttentionOptions,
    AttentionPlan, BackwardTensors, launch_attention, launch_attention_backward, plan_attention,
    plan_attention_backward_writing,
};
use burn_flash_kernels::decode::{
    AppendTensors, DecodeTensors, Paged, Rope, launch_append, launch_decode,
};
use cubecl::prelude::ComputeClient;

use super::operands::{AttentionInputs, HeadOperands, KvCache, NewKeys};
use super::paged::{Appended, RopeArgs};
use super::{AttentionGrads, FlashAttentionOptions, OP, ScoreTerms, scale_of};
use crate::cube::{empty, tensor_ref};

/// The kernels crate's options for a call with head dim `head_dim`.
pub(crate) fn kernel_options(options: FlashAttentionOptions, head_dim: usize) -> AttentionOptions {
    let module = options.module;
    let defaults = crate::plan_defaults();
    AttentionOptions {
        scale: scale_of(&module, head_dim) as f32,
        softcap: module.softcap.map(|c| c as f32),
        causal: module.is_causal,
        kernel: options.kernel,
        block_k: options.block_k,
        dropout: options.dropout.and_then(|d| d.params()),
        masked_score: options.masked_score.map(|f| f as f32),
        quiet: options.quiet,
        window: options.window,
        hopper: options.hopper.unwrap_or(defaults.hopper),
        schedule: options.schedule.unwrap_or(defaults.schedule),
        decode: options.decode.unwrap_or(defaults.decode),
        deterministic: options.deterministic.unwrap_or(defaults.deterministic),
        backward_overlap: options
            .backward_overlap
            .unwrap_or(defaults.backward_overlap),
        ampere_backward: options.ampere_backward.unwrap_or(defaults.ampere_backward),
        ampere_tile: options.ampere_tile.unwrap_or(defaults.ampere_tile),
        tf32: options.tf32.unwrap_or(defaults.tf32),
    }
}

/// Contiguous tensors of `dims` with the score terms `terms`.
fn features(dims: AttentionDims, terms: ScoreTerms) -> AttentionFeatures {
    let broadcast = terms.bias && terms.bias_rows_broadcast;
    AttentionFeatures {
        aligned: dims.head_dim.is_multiple_of(8) && dims.value_dim.is_multiple_of(8),
        mask: terms.mask,
        bias: terms.bias,
        // A contiguous bias with rows of its own: TMA loads it where its rows are 16 bytes.
        bias_tiles: terms.bias && !broadcast && dims.seq_k.is_multiple_of(8),
        bias_rows_broadcast: broadcast,
        bias_row_tiles: broadcast && dims.seq_k.is_multiple_of(8),
        alibi: terms.alibi,
        sinks: terms.sinks,
        varlen: terms.varlen,
    }
}

/// The plan for contiguous tensors of `dims` with the score terms `terms`.
pub(crate) fn plan<R: CubeRuntime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: DType,
    options: FlashAttentionOptions,
    terms: ScoreTerms,
) -> Result<AttentionPlan, AttentionError> {
    plan_attention(
        client,
        dims,
        dtype.into(),
        features(dims, terms),
        &kernel_options(options, dims.head_dim),
    )
}

/// A bool mask as the kernels read it: 1 / 0 in the queries' float type `dtype`.
fn float_mask<R, F, I, BT>(mask: Option<CubeTensor<R>>, dtype: DType) -> Option<CubeTensor<R>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    mask.map(|m| CubeBackend::<R, F, I, BT>::bool_into_float(m, FloatDType::from(dtype)))
}

/// Index tensors as the kernels read them — a packed batch's sequences, a block table, the
/// sequences' lengths: 32-bit integers (the kernels read u32; the values are non-negative),
/// cast where the backend's integers are wider.
fn indices_u32<R, F, I, BT>(seqs: Option<CubeTensor<R>>) -> Option<CubeTensor<R>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    seqs.map(|s| match s.dtype {
        DType::I32 | DType::U32 => s,
        _ => CubeBackend::<R, F, I, BT>::int_cast(s, IntDType::U32),
    })
}

/// The tensors a forward writes: the output `[B, Hq, Sq, Dv]` in the queries' dtype and the
/// row log-sum-exp `[B, Hq, Sq]` (f32).
fn out_and_lse<R: CubeRuntime>(
    query: &CubeTensor<R>,
    value: &CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let q = query.meta.shape();
    let rows = [q[0], q[1], q[2]];
    let out = empty(
        query,
        [q[0], q[1], q[2], value.meta.shape()[3]],
        query.dtype,
    );
    (out, empty(query, rows, DType::F32))
}

pub(crate) fn forward<R, F, I, BT>(
    inputs: AttentionInputs<CubeBackend<R, F, I, BT>>,
    options: FlashAttentionOptions,
) -> (CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let (query, scores) = (inputs.query, inputs.scores);
    let dtype = query.dtype;
    let mask = float_mask::<R, F, I, BT>(scores.mask, dtype);
    let seqs = indices_u32::<R, F, I, BT>(scores.seqs);
    let [_, _, _, head_dim]: [usize; 4] = query
        .meta
        .shape()
        .to_vec()
        .try_into()
        .unwrap_or_else(|_| panic!("{OP}: `query` must be 4-D"));
    let (out, lse) = out_and_lse(&query, &inputs.value);
    let heads = &scores.heads;
    launch_attention::<R>(
        &query.client,
        tensor_ref(&query),
        tensor_ref(&inputs.key),
        tensor_ref(&inputs.value),
        mask.as_ref().map(tensor_ref),
        scores.bias.as_ref().map(tensor_ref),
        heads.slopes.as_ref().map(tensor_ref),
        heads.sinks.as_ref().map(tensor_ref),
        seqs.as_ref().map(tensor_ref),
        tensor_ref(&out),
        tensor_ref(&lse),
        dtype.into(),
        &kernel_options(options, head_dim),
    )
    .unwrap_or_else(|err| panic!("{OP}: {err}"));
    (out, lse)
}

/// The backward plan for contiguous tensors of `dims`.
pub(crate) fn backward_plan<R: CubeRuntime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
    dtype: DType,
    options: FlashAttentionOptions,
    terms: ScoreTerms,
) -> Result<AttentionBackwardPlan, AttentionError> {
    // A tracked bias's gradient sums the `dS` the backward writes.
    plan_attention_backward_writing(
        client,
        dims,
        dtype.into(),
        features(dims, terms),
        &kernel_options(options, dims.head_dim),
        terms.bias && terms.bias_tracked,
    )
}

pub(crate) fn backward<R, F, I, BT>(
    inputs: AttentionInputs<CubeBackend<R, F, I, BT>>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_out: CubeTensor<R>,
    options: FlashAttentionOptions,
    want_ds: bool,
) -> AttentionGrads<CubeBackend<R, F, I, BT>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let (query, key, value, scores) = (inputs.query, inputs.key, inputs.value, inputs.scores);
    let dtype = query.dtype;
    let mask = float_mask::<R, F, I, BT>(scores.mask, dtype);
    let seqs = indices_u32::<R, F, I, BT>(scores.seqs);
    let dq = empty(&query, query.meta.shape(), dtype);
    let dk = empty(&query, key.meta.shape(), dtype);
    let dv = empty(&query, value.meta.shape(), dtype);
    let q_shape = query.meta.shape();
    let full = [q_shape[0], q_shape[1], q_shape[2], key.meta.shape()[2]];
    let ds = want_ds.then(|| empty(&query, full, dtype));
    let head_dim = q_shape[3];
    launch_attention_backward::<R>(
        &query.client,
        BackwardTensors {
            q: tensor_ref(&query),
            k: tensor_ref(&key),
            v: tensor_ref(&value),
            mask: mask.as_ref().map(tensor_ref),
            bias: scores.bias.as_ref().map(tensor_ref),
            // The sinks are in `lse` (the backward kernels read it): not read again.
            slopes: scores.heads.slopes.as_ref().map(tensor_ref),
            seqs: seqs.as_ref().map(tensor_ref),
            out: tensor_ref(&out),
            lse: tensor_ref(&lse),
            d_out: tensor_ref(&d_out),
            dq: tensor_ref(&dq),
            dk: tensor_ref(&dk),
            dv: tensor_ref(&dv),
            ds: ds.as_ref().map(tensor_ref),
        },
        dtype.into(),
        &kernel_options(options, head_dim),
    )
    .unwrap_or_else(|err| panic!("{OP}: backward: {err}"));
    AttentionGrads { dq, dk, dv, ds }
}

/// Paged or contiguous decoding on `CubeBackend` ([`crate::AttentionBackend::flash_decode`]).
pub(crate) fn decode<R, F, I, BT>(
    query: CubeTensor<R>,
    cache: KvCache<CubeBackend<R, F, I, BT>>,
    heads: HeadOperands<CubeBackend<R, F, I, BT>>,
    options: FlashAttentionOptions,
) -> (CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let dtype = query.dtype;
    let table = indices_u32::<R, F, I, BT>(cache.table);
    let lengths = indices_u32::<R, F, I, BT>(Some(cache.lengths)).expect("given");
    let head_dim = query.meta.shape()[3];
    let (out, lse) = out_and_lse(&query, &cache.value);
    launch_decode::<R>(
        &query.client,
        DecodeTensors {
            q: tensor_ref(&query),
            k: tensor_ref(&cache.key),
            v: tensor_ref(&cache.value),
            paged: table.as_ref().map(|t| Paged {
                table: tensor_ref(t),
            }),
            lengths: Some(tensor_ref(&lengths)),
            slopes: heads.slopes.as_ref().map(tensor_ref),
            sinks: heads.sinks.as_ref().map(tensor_ref),
            out: tensor_ref(&out),
            lse: tensor_ref(&lse),
        },
        dtype.into(),
        &kernel_options(options, head_dim),
    )
    .unwrap_or_else(|err| panic!("{OP}: decode: {err}"));
    (out, lse)
}

/// `t` itself where no other tensor shares its buffer, else a copy: the append writes into it.
fn owned<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    if t.can_mut() { t } else { t.copy() }
}

/// The append on `CubeBackend` ([`crate::AttentionBackend::flash_kv_append`]).
pub(crate) fn append<R, F, I, BT>(
    cache: KvCache<CubeBackend<R, F, I, BT>>,
    new: NewKeys<CubeBackend<R, F, I, BT>>,
    rope: Option<RopeArgs<CubeBackend<R, F, I, BT>>>,
) -> Appended<CubeBackend<R, F, I, BT>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let dtype = cache.key.dtype;
    let table = indices_u32::<R, F, I, BT>(cache.table);
    let lengths = indices_u32::<R, F, I, BT>(Some(cache.lengths)).expect("given");
    let (key, value) = (owned(cache.key), owned(cache.value));
    let q_out = rope
        .as_ref()
        .and_then(|r| r.query.as_ref())
        .map(|q| empty(q, q.meta.shape(), dtype));
    let rope_refs = rope.as_ref().map(|r| Rope {
        cos: tensor_ref(&r.cos),
        sin: tensor_ref(&r.sin),
        interleaved: r.interleaved,
        q: r.query
            .as_ref()
            .zip(q_out.as_ref())
            .map(|(q, o)| (tensor_ref(q), tensor_ref(o))),
    });
    launch_append::<R>(
        &key.client,
        AppendTensors {
            k_new: tensor_ref(&new.key),
            v_new: tensor_ref(&new.value),
            k: tensor_ref(&key),
            v: tensor_ref(&value),
            paged: table.as_ref().map(|t| Paged {
                table: tensor_ref(t),
            }),
            lengths: tensor_ref(&lengths),
            rope: rope_refs,
        },
        dtype.into(),
    )
    .unwrap_or_else(|err| panic!("{OP}: append: {err}"));
    Appended {
        key,
        value,
        query: q_out,
    }
}
