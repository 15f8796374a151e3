//! Attention on `Fusion<B>`: one opaque custom operation (two outputs forward, three or four
//! gradients backward) that runs `B`'s kernels ([`crate::fusion`]).

use core::marker::PhantomData;

use burn::backend::ir::{OperationOutput, TensorId, TensorIr};
use burn::tensor::{
    Shape,
    ops::{FloatTensor, IntTensor},
};
use burn_fusion::{Fusion, FusionBackend, stream::Operation};

use super::operands::{AttentionInputs, HeadOperands, KvCache, NewKeys, ScoreOperands};
use super::paged::{AppendDecoded, Appended, RopeArgs};
use super::{AttentionGrads, FlashAttentionOptions, ScoreTerms};
use crate::FlashBackend;
use crate::fusion::{Handles, out_and_lse, uninit};

/// Attention or its backward.
#[derive(Debug)]
struct AttentionOp<B> {
    /// [`AttentionInputs`] (the score operands `terms` names), then, for the backward, `out`,
    /// `lse`, `d_out`.
    inputs: Vec<TensorIr>,
    terms: ScoreTerms,
    /// `out`, `lse`; for the backward `dq`, `dk`, `dv`, then `ds` where asked for.
    outputs: Vec<TensorId>,
    backward: bool,
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for AttentionOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let mut inputs = self.inputs.iter();
        let mut next = || inputs.next().expect("recorded input");
        let [query, key, value] =
            [next(), next(), next()].map(|t| handles.get_float_tensor::<B>(t));
        let terms = self.terms;
        let mask = terms.mask.then(|| handles.get_bool_tensor::<B>(next()));
        let bias = terms.bias.then(|| handles.get_float_tensor::<B>(next()));
        let slopes = terms.alibi.then(|| handles.get_float_tensor::<B>(next()));
        let sinks = terms.sinks.then(|| handles.get_float_tensor::<B>(next()));
        let seqs = terms.varlen.then(|| handles.get_int_tensor::<B>(next()));
        let inputs = AttentionInputs {
            query,
            key,
            value,
            scores: ScoreOperands {
                mask,
                bias,
                heads: HeadOperands { slopes, sinks },
                seqs,
            },
        };
        let outputs = if self.backward {
            let [out, lse, d_out] =
                [next(), next(), next()].map(|t| handles.get_float_tensor::<B>(t));
            let want_ds = self.outputs.len() == 4;
            let g = B::flash_attention_backward(inputs, out, lse, d_out, self.options, want_ds);
            [g.dq, g.dk, g.dv].into_iter().chain(g.ds).collect()
        } else {
            let (out, lse) = B::flash_attention(inputs, self.options);
            vec![out, lse]
        };
        for (id, t) in self.outputs.iter().zip(outputs) {
            handles.register_float_tensor::<B>(id, t);
        }
    }
}

/// Records the op `name` on `inputs` (then, for the `backward`, `out`, `lse`, `d_out` in
/// `rest`), writing `outputs`.
fn record<B: FusionBackend + FlashBackend>(
    name: &'static str,
    inputs: AttentionInputs<Fusion<B>>,
    rest: Vec<FloatTensor<Fusion<B>>>,
    outputs: Vec<TensorIr>,
    backward: bool,
    options: FlashAttentionOptions,
) -> Vec<FloatTensor<Fusion<B>>> {
    let terms = inputs.scores.terms();
    let scores = inputs.scores;
    let mut tensors = vec![inputs.query, inputs.key, inputs.value];
    tensors.extend(scores.mask);
    tensors.extend(scores.bias);
    tensors.extend(scores.heads.slopes);
    tensors.extend(scores.heads.sinks);
    tensors.extend(scores.seqs);
    tensors.extend(rest);
    let op = |inputs, outputs| AttentionOp::<B> {
        inputs,
        terms,
        outputs,
        backward,
        options,
        _backend: PhantomData,
    };
    crate::fusion::record(name, tensors, outputs, op)
}

pub(crate) fn forward<B: FusionBackend + FlashBackend>(
    inputs: AttentionInputs<Fusion<B>>,
    options: FlashAttentionOptions,
) -> (FloatTensor<Fusion<B>>, FloatTensor<Fusion<B>>) {
    let (query, value) = (&inputs.query, &inputs.value);
    let (b, hq, sq) = (query.shape[0], query.shape[1], query.shape[2]);
    let dv = value.shape[3];
    let outputs = out_and_lse(query, &[b, hq, sq], dv).to_vec();
    let name = "burn_flash::attention";
    let [out, lse] = record::<B>(name, inputs, vec![], outputs, false, options).outputs();
    (out, lse)
}

pub(crate) fn backward<B: FusionBackend + FlashBackend>(
    inputs: AttentionInputs<Fusion<B>>,
    out: FloatTensor<Fusion<B>>,
    lse: FloatTensor<Fusion<B>>,
    d_out: FloatTensor<Fusion<B>>,
    options: FlashAttentionOptions,
    want_ds: bool,
) -> AttentionGrads<Fusion<B>> {
    let (query, key, value) = (&inputs.query, &inputs.key, &inputs.value);
    let dtype = query.dtype;
    let full = Shape::from([query.shape[0], query.shape[1], query.shape[2], key.shape[2]]);
    let mut outputs = vec![
        uninit(query, query.shape.clone(), dtype),
        uninit(key, key.shape.clone(), dtype),
        uninit(value, value.shape.clone(), dtype),
    ];
    if want_ds {
        outputs.push(uninit(query, full, dtype));
    }
    let name = "burn_flash::attention_backward";
    let grads = record::<B>(name, inputs, vec![out, lse, d_out], outputs, true, options);
    let mut grads = grads.into_iter();
    let mut next = || grads.next().expect("registered output");
    let (dq, dk, dv) = (next(), next(), next());
    AttentionGrads {
        dq,
        dk,
        dv,
        ds: want_ds.then(next),
    }
}

/// The tensors of a [`KvCache`] in a record: key, value, the table where `paged`, the lengths.
fn push_cache<B: FusionBackend>(
    tensors: &mut Vec<FloatTensor<Fusion<B>>>,
    cache: KvCache<Fusion<B>>,
) -> bool {
    let paged = cache.table.is_some();
    tensors.extend([cache.key, cache.value]);
    tensors.extend(cache.table);
    tensors.push(cache.lengths);
    paged
}

/// The tensors of [`HeadOperands`] in a record, each where given: `(slopes, sinks)` given.
fn push_heads<B: FusionBackend>(
    tensors: &mut Vec<FloatTensor<Fusion<B>>>,
    heads: HeadOperands<Fusion<B>>,
) -> (bool, bool) {
    let given = (heads.slopes.is_some(), heads.sinks.is_some());
    tensors.extend(heads.slopes);
    tensors.extend(heads.sinks);
    given
}

/// Reads back what [`push_cache`] recorded.
fn read_cache<'a, B: FusionBackend>(
    handles: &mut Handles<B>,
    next: &mut impl FnMut() -> &'a TensorIr,
    paged: bool,
) -> KvCache<B> {
    let [key, value] = [next(), next()].map(|t| handles.get_float_tensor::<B>(t));
    KvCache {
        key,
        value,
        table: paged.then(|| handles.get_int_tensor::<B>(next())),
        lengths: handles.get_int_tensor::<B>(next()),
    }
}

/// Reads back what [`push_heads`] recorded.
fn read_heads<'a, B: FusionBackend>(
    handles: &mut Handles<B>,
    next: &mut impl FnMut() -> &'a TensorIr,
    (slopes, sinks): (bool, bool),
) -> HeadOperands<B> {
    HeadOperands {
        slopes: slopes.then(|| handles.get_float_tensor::<B>(next())),
        sinks: sinks.then(|| handles.get_float_tensor::<B>(next())),
    }
}

/// Paged (or contiguous) decoding: `q`, the cache ([`push_cache`]), the per-head terms
/// ([`push_heads`]).
#[derive(Debug)]
struct DecodeOp<B> {
    inputs: Vec<TensorIr>,
    paged: bool,
    heads: (bool, bool),
    /// `out`, `lse`.
    outputs: Vec<TensorId>,
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for DecodeOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let mut inputs = self.inputs.iter();
        let mut next = || inputs.next().expect("recorded input");
        let q = handles.get_float_tensor::<B>(next());
        let cache = read_cache(handles, &mut next, self.paged);
        let heads = read_heads(handles, &mut next, self.heads);
        let (out, lse) = B::flash_decode(q, cache, heads, self.options);
        for (id, t) in self.outputs.iter().zip([out, lse]) {
            handles.register_float_tensor::<B>(id, t);
        }
    }
}

pub(crate) fn decode<B: FusionBackend + FlashBackend>(
    query: FloatTensor<Fusion<B>>,
    cache: KvCache<Fusion<B>>,
    heads: HeadOperands<Fusion<B>>,
    options: FlashAttentionOptions,
) -> (FloatTensor<Fusion<B>>, FloatTensor<Fusion<B>>) {
    let (b, hq, sq) = (query.shape[0], query.shape[1], query.shape[2]);
    let outputs = out_and_lse(&query, &[b, hq, sq], cache.value.shape[3]).to_vec();
    let mut tensors = vec![query];
    let paged = push_cache::<B>(&mut tensors, cache);
    let heads = push_heads::<B>(&mut tensors, heads);
    let op = |inputs, outputs| DecodeOp::<B> {
        inputs,
        paged,
        heads,
        outputs,
        options,
        _backend: PhantomData,
    };
    let [out, lse] = crate::fusion::record("burn_flash::decode", tensors, outputs, op)
        .try_into()
        .expect("two outputs");
    (out, lse)
}

/// The tensors of the rows an append writes: the new keys and values, then with RoPE its
/// tables and the queries where given; `Some(interleaved)` with RoPE.
fn push_rows<B: FusionBackend>(
    tensors: &mut Vec<FloatTensor<Fusion<B>>>,
    new: NewKeys<Fusion<B>>,
    rope: Option<RopeArgs<Fusion<B>>>,
) -> Option<bool> {
    tensors.extend([new.key, new.value]);
    let interleaved = rope.as_ref().map(|r| r.interleaved);
    if let Some(r) = rope {
        tensors.extend([r.cos, r.sin]);
        tensors.extend(r.query);
    }
    interleaved
}

/// Reads back what [`push_rows`] recorded (`query`: the RoPE query was recorded).
fn read_rows<'a, B: FusionBackend>(
    handles: &mut Handles<B>,
    next: &mut impl FnMut() -> &'a TensorIr,
    rope: Option<bool>,
    query: bool,
) -> (NewKeys<B>, Option<RopeArgs<B>>) {
    let [key, value] = [next(), next()].map(|t| handles.get_float_tensor::<B>(t));
    let rope = rope.map(|interleaved| {
        let [cos, sin] = [next(), next()].map(|t| handles.get_float_tensor::<B>(t));
        RopeArgs {
            cos,
            sin,
            interleaved,
            query: query.then(|| handles.get_float_tensor::<B>(next())),
        }
    });
    (NewKeys { key, value }, rope)
}

/// The caches' outputs of an append: tensors like the cache's key and value.
fn cache_outputs<B: FusionBackend>(cache: &KvCache<Fusion<B>>) -> Vec<TensorIr> {
    let (key, value) = (&cache.key, &cache.value);
    vec![
        uninit(key, key.shape.clone(), key.dtype),
        uninit(value, value.shape.clone(), value.dtype),
    ]
}

/// The append: the cache ([`push_cache`]), the rows ([`push_rows`]).
#[derive(Debug)]
struct AppendOp<B> {
    inputs: Vec<TensorIr>,
    paged: bool,
    rope: Option<bool>,
    has_query: bool,
    /// The caches, then the rotated queries where asked.
    outputs: Vec<TensorId>,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for AppendOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let mut inputs = self.inputs.iter();
        let mut next = || inputs.next().expect("recorded input");
        let cache = read_cache(handles, &mut next, self.paged);
        let (new, rope) = read_rows(handles, &mut next, self.rope, self.has_query);
        let out = B::flash_kv_append(cache, new, rope);
        let results = [out.key, out.value].into_iter().chain(out.query);
        for (id, t) in self.outputs.iter().zip(results) {
            handles.register_float_tensor::<B>(id, t);
        }
    }
}

pub(crate) fn append<B: FusionBackend + FlashBackend>(
    cache: KvCache<Fusion<B>>,
    new: NewKeys<Fusion<B>>,
    rope: Option<RopeArgs<Fusion<B>>>,
) -> Appended<Fusion<B>> {
    let mut outputs = cache_outputs::<B>(&cache);
    let query = rope.as_ref().and_then(|r| r.query.as_ref());
    outputs.extend(query.map(|q| uninit(q, q.shape.clone(), q.dtype)));
    let has_query = query.is_some();
    let mut tensors = vec![];
    let paged = push_cache::<B>(&mut tensors, cache);
    let rope = push_rows::<B>(&mut tensors, new, rope);
    let op = |inputs, outputs| AppendOp::<B> {
        inputs,
        paged,
        rope,
        has_query,
        outputs,
        _backend: PhantomData,
    };
    let mut results =
        crate::fusion::record("burn_flash::kv_append", tensors, outputs, op).into_iter();
    let mut next = || results.next().expect("registered output");
    let (key, value) = (next(), next());
    Appended {
        key,
        value,
        query: has_query.then(next),
    }
}

/// The append and the decoding as one op ([`crate::AttentionBackend::flash_append_decode`]):
/// the cache ([`push_cache`]), the lengths after, the query, the rows ([`push_rows`], no RoPE
/// query), the per-head terms ([`push_heads`]).
#[derive(Debug)]
struct AppendDecodeOp<B> {
    inputs: Vec<TensorIr>,
    paged: bool,
    rope: Option<bool>,
    heads: (bool, bool),
    /// The caches, the rotated query where rotated, `out`, `lse`.
    outputs: Vec<TensorId>,
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for AppendDecodeOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let mut inputs = self.inputs.iter();
        let mut next = || inputs.next().expect("recorded input");
        let cache = read_cache(handles, &mut next, self.paged);
        let after = handles.get_int_tensor::<B>(next());
        let q = handles.get_float_tensor::<B>(next());
        let (new, rope) = read_rows(handles, &mut next, self.rope, false);
        let heads = read_heads(handles, &mut next, self.heads);
        let (appended, out, lse) =
            B::flash_append_decode(cache, after, new, q, rope, heads, self.options);
        let results = [appended.key, appended.value]
            .into_iter()
            .chain(appended.query)
            .chain([out, lse]);
        for (id, t) in self.outputs.iter().zip(results) {
            handles.register_float_tensor::<B>(id, t);
        }
    }
}

pub(crate) fn append_decode<B: FusionBackend + FlashBackend>(
    cache: KvCache<Fusion<B>>,
    lengths_after: IntTensor<Fusion<B>>,
    new: NewKeys<Fusion<B>>,
    query: FloatTensor<Fusion<B>>,
    rope: Option<RopeArgs<Fusion<B>>>,
    heads: HeadOperands<Fusion<B>>,
    options: FlashAttentionOptions,
) -> AppendDecoded<Fusion<B>> {
    let (b, hq, sq) = (query.shape[0], query.shape[1], query.shape[2]);
    let mut outputs = cache_outputs::<B>(&cache);
    if rope.is_some() {
        outputs.push(uninit(&query, query.shape.clone(), query.dtype));
    }
    outputs.extend(out_and_lse(&query, &[b, hq, sq], cache.value.shape[3]));
    let mut tensors = vec![];
    let paged = push_cache::<B>(&mut tensors, cache);
    tensors.extend([lengths_after, query]);
    // The rotated query is the op's own (the RoPE tables carry none).
    let rope = rope.map(|r| RopeArgs { query: None, ..r });
    let rope = push_rows::<B>(&mut tensors, new, rope);
    let heads = push_heads::<B>(&mut tensors, heads);
    let op = |inputs, outputs| AppendDecodeOp::<B> {
        inputs,
        paged,
        rope,
        heads,
        outputs,
        options,
        _backend: PhantomData,
    };
    let mut results =
        crate::fusion::record("burn_flash::append_decode", tensors, outputs, op).into_iter();
    let mut next = || results.next().expect("registered output");
    let (key, value) = (next(), next());
    let query = rope.map(|_| next());
    let (out, lse) = (next(), next());
    (Appended { key, value, query }, out, lse)
}
