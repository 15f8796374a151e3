//! Attention on `Fusion<B>`: one opaque custom operation (two outputs forward, three or four
//! gradients backward) that runs `B`'s kernels ([`crate::fusion`]).

use core::marker::PhantomData;

use burn::backend::ir::{OperationOutput, TensorId, TensorIr};
use burn::tensor::{
    Shape,
    ops::{FloatTensor, IntTensor},
};
use burn_fusion::{Fusion, FusionBackend, stream::Operation};

use super::paged::{AppendDecoded, Appended, RopeArgs};
use super::{AppendCaches, AppendRows};
use super::{AttentionGrads, FlashAttentionOptions, Inputs};
use crate::FlashBackend;
use crate::fusion::{Handles, out_and_lse, uninit};

/// Attention or its backward.
#[derive(Debug)]
struct AttentionOp<B> {
    /// [`Inputs`] (the mask, the bias, the slopes, the sinks and the sequences where given),
    /// then, for the backward, `out`, `lse`, `d_out`.
    inputs: Vec<TensorIr>,
    has_mask: bool,
    has_bias: bool,
    has_slopes: bool,
    has_sinks: bool,
    has_seqs: bool,
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
        let [q, k, v] = [next(), next(), next()].map(|t| handles.get_float_tensor::<B>(t));
        let mask = self.has_mask.then(|| handles.get_bool_tensor::<B>(next()));
        let bias = self.has_bias.then(|| handles.get_float_tensor::<B>(next()));
        let slopes = self
            .has_slopes
            .then(|| handles.get_float_tensor::<B>(next()));
        let sinks = self
            .has_sinks
            .then(|| handles.get_float_tensor::<B>(next()));
        let seqs = self.has_seqs.then(|| handles.get_int_tensor::<B>(next()));
        let outputs = if self.backward {
            let [out, lse, d_out] =
                [next(), next(), next()].map(|t| handles.get_float_tensor::<B>(t));
            let want_ds = self.outputs.len() == 4;
            let g = B::flash_attention_backward(
                q,
                k,
                v,
                mask,
                bias,
                slopes,
                sinks,
                seqs,
                out,
                lse,
                d_out,
                self.options,
                want_ds,
            );
            [g.dq, g.dk, g.dv].into_iter().chain(g.ds).collect()
        } else {
            let (out, lse) =
                B::flash_attention(q, k, v, mask, bias, slopes, sinks, seqs, self.options);
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
    (query, key, value, mask, bias, slopes, sinks, seqs): Inputs<Fusion<B>>,
    rest: Vec<FloatTensor<Fusion<B>>>,
    outputs: Vec<TensorIr>,
    backward: bool,
    options: FlashAttentionOptions,
) -> Vec<FloatTensor<Fusion<B>>> {
    let (has_mask, has_bias) = (mask.is_some(), bias.is_some());
    let (has_slopes, has_sinks, has_seqs) = (slopes.is_some(), sinks.is_some(), seqs.is_some());
    let mut tensors = vec![query, key, value];
    tensors.extend(mask);
    tensors.extend(bias);
    tensors.extend(slopes);
    tensors.extend(sinks);
    tensors.extend(seqs);
    tensors.extend(rest);
    let op = |inputs, outputs| AttentionOp::<B> {
        inputs,
        has_mask,
        has_bias,
        has_slopes,
        has_sinks,
        has_seqs,
        outputs,
        backward,
        options,
        _backend: PhantomData,
    };
    crate::fusion::record(name, tensors, outputs, op)
}

pub(crate) fn forward<B: FusionBackend + FlashBackend>(
    inputs: Inputs<Fusion<B>>,
    options: FlashAttentionOptions,
) -> (FloatTensor<Fusion<B>>, FloatTensor<Fusion<B>>) {
    let (query, value) = (&inputs.0, &inputs.2);
    let (b, hq, sq) = (query.shape[0], query.shape[1], query.shape[2]);
    let dv = value.shape[3];
    let outputs = out_and_lse(query, &[b, hq, sq], dv).to_vec();
    let name = "burn_flash::attention";
    let [out, lse] = record::<B>(name, inputs, vec![], outputs, false, options).outputs();
    (out, lse)
}

pub(crate) fn backward<B: FusionBackend + FlashBackend>(
    inputs: Inputs<Fusion<B>>,
    out: FloatTensor<Fusion<B>>,
    lse: FloatTensor<Fusion<B>>,
    d_out: FloatTensor<Fusion<B>>,
    options: FlashAttentionOptions,
    want_ds: bool,
) -> AttentionGrads<Fusion<B>> {
    let (query, key, value) = (&inputs.0, &inputs.1, &inputs.2);
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

/// Paged (or contiguous) decoding: `q`, `k`, `v`, the table where paged, the lengths, the
/// slopes and sinks where given.
#[derive(Debug)]
struct DecodeOp<B> {
    inputs: Vec<TensorIr>,
    has_table: bool,
    has_slopes: bool,
    has_sinks: bool,
    /// `out`, `lse`.
    outputs: Vec<TensorId>,
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for DecodeOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let mut inputs = self.inputs.iter();
        let mut next = || inputs.next().expect("recorded input");
        let [q, k, v] = [next(), next(), next()].map(|t| handles.get_float_tensor::<B>(t));
        let table = self.has_table.then(|| handles.get_int_tensor::<B>(next()));
        let lengths = handles.get_int_tensor::<B>(next());
        let slopes = self
            .has_slopes
            .then(|| handles.get_float_tensor::<B>(next()));
        let sinks = self
            .has_sinks
            .then(|| handles.get_float_tensor::<B>(next()));
        let (out, lse) = B::flash_decode(q, k, v, table, lengths, slopes, sinks, self.options);
        for (id, t) in self.outputs.iter().zip([out, lse]) {
            handles.register_float_tensor::<B>(id, t);
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn decode<B: FusionBackend + FlashBackend>(
    query: FloatTensor<Fusion<B>>,
    key: FloatTensor<Fusion<B>>,
    value: FloatTensor<Fusion<B>>,
    table: Option<IntTensor<Fusion<B>>>,
    lengths: IntTensor<Fusion<B>>,
    slopes: Option<FloatTensor<Fusion<B>>>,
    sinks: Option<FloatTensor<Fusion<B>>>,
    options: FlashAttentionOptions,
) -> (FloatTensor<Fusion<B>>, FloatTensor<Fusion<B>>) {
    let (b, hq, sq) = (query.shape[0], query.shape[1], query.shape[2]);
    let outputs = out_and_lse(&query, &[b, hq, sq], value.shape[3]).to_vec();
    let (has_table, has_slopes, has_sinks) = (table.is_some(), slopes.is_some(), sinks.is_some());
    let mut tensors = vec![query, key, value];
    tensors.extend(table);
    tensors.push(lengths);
    tensors.extend(slopes);
    tensors.extend(sinks);
    let op = |inputs, outputs| DecodeOp::<B> {
        inputs,
        has_table,
        has_slopes,
        has_sinks,
        outputs,
        options,
        _backend: PhantomData,
    };
    let [out, lse] = crate::fusion::record("burn_flash::decode", tensors, outputs, op)
        .try_into()
        .expect("two outputs");
    (out, lse)
}

/// The append: the caches, the table where paged, the lengths, the new keys and values, then
/// with RoPE its tables and the queries where given.
#[derive(Debug)]
struct AppendOp<B> {
    inputs: Vec<TensorIr>,
    has_table: bool,
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
        let [k, v] = [next(), next()].map(|t| handles.get_float_tensor::<B>(t));
        let table = self.has_table.then(|| handles.get_int_tensor::<B>(next()));
        let lengths = handles.get_int_tensor::<B>(next());
        let [k_new, v_new] = [next(), next()].map(|t| handles.get_float_tensor::<B>(t));
        let rope = self.rope.map(|interleaved| {
            let [cos, sin] = [next(), next()].map(|t| handles.get_float_tensor::<B>(t));
            let query = self
                .has_query
                .then(|| handles.get_float_tensor::<B>(next()));
            RopeArgs {
                cos,
                sin,
                interleaved,
                query,
            }
        });
        let out = B::flash_kv_append(k, v, table, lengths, k_new, v_new, rope);
        let results = [out.key, out.value].into_iter().chain(out.query);
        for (id, t) in self.outputs.iter().zip(results) {
            handles.register_float_tensor::<B>(id, t);
        }
    }
}

pub(crate) fn append<B: FusionBackend + FlashBackend>(
    key: FloatTensor<Fusion<B>>,
    value: FloatTensor<Fusion<B>>,
    table: Option<IntTensor<Fusion<B>>>,
    lengths: IntTensor<Fusion<B>>,
    key_new: FloatTensor<Fusion<B>>,
    value_new: FloatTensor<Fusion<B>>,
    rope: Option<RopeArgs<Fusion<B>>>,
) -> Appended<Fusion<B>> {
    let mut outputs = vec![
        uninit(&key, key.shape.clone(), key.dtype),
        uninit(&value, value.shape.clone(), value.dtype),
    ];
    let has_table = table.is_some();
    let rope_flag = rope.as_ref().map(|r| r.interleaved);
    let has_query = rope.as_ref().is_some_and(|r| r.query.is_some());
    let mut tensors = vec![key, value];
    tensors.extend(table);
    tensors.extend([lengths, key_new, value_new]);
    if let Some(r) = rope {
        if let Some(q) = &r.query {
            outputs.push(uninit(q, q.shape.clone(), q.dtype));
        }
        tensors.extend([r.cos, r.sin]);
        tensors.extend(r.query);
    }
    let op = |inputs, outputs| AppendOp::<B> {
        inputs,
        has_table,
        rope: rope_flag,
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
/// the caches, the table where paged, the lengths before and after, the new keys and values,
/// the query, then the RoPE tables, the slopes and the sinks where given.
#[derive(Debug)]
struct AppendDecodeOp<B> {
    inputs: Vec<TensorIr>,
    has_table: bool,
    rope: Option<bool>,
    has_slopes: bool,
    has_sinks: bool,
    /// The caches, the rotated query where rotated, `out`, `lse`.
    outputs: Vec<TensorId>,
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for AppendDecodeOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let mut inputs = self.inputs.iter();
        let mut next = || inputs.next().expect("recorded input");
        let [k, v] = [next(), next()].map(|t| handles.get_float_tensor::<B>(t));
        let table = self.has_table.then(|| handles.get_int_tensor::<B>(next()));
        let [lengths, after] = [next(), next()].map(|t| handles.get_int_tensor::<B>(t));
        let [k_new, v_new, q] = [next(), next(), next()].map(|t| handles.get_float_tensor::<B>(t));
        let rope = self.rope.map(|interleaved| {
            let [cos, sin] = [next(), next()].map(|t| handles.get_float_tensor::<B>(t));
            RopeArgs {
                cos,
                sin,
                interleaved,
                query: None,
            }
        });
        let slopes = self
            .has_slopes
            .then(|| handles.get_float_tensor::<B>(next()));
        let sinks = self
            .has_sinks
            .then(|| handles.get_float_tensor::<B>(next()));
        let (appended, out, lse) = B::flash_append_decode(
            k,
            v,
            table,
            lengths,
            after,
            k_new,
            v_new,
            q,
            rope,
            slopes,
            sinks,
            self.options,
        );
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
    (key, value, table, lengths, lengths_after): AppendCaches<Fusion<B>>,
    (key_new, value_new, query, rope): AppendRows<Fusion<B>>,
    slopes: Option<FloatTensor<Fusion<B>>>,
    sinks: Option<FloatTensor<Fusion<B>>>,
    options: FlashAttentionOptions,
) -> AppendDecoded<Fusion<B>> {
    let (b, hq, sq) = (query.shape[0], query.shape[1], query.shape[2]);
    let mut outputs = vec![
        uninit(&key, key.shape.clone(), key.dtype),
        uninit(&value, value.shape.clone(), value.dtype),
    ];
    if rope.is_some() {
        outputs.push(uninit(&query, query.shape.clone(), query.dtype));
    }
    outputs.extend(out_and_lse(&query, &[b, hq, sq], value.shape[3]));
    let (has_table, has_slopes, has_sinks) = (table.is_some(), slopes.is_some(), sinks.is_some());
    let rope_flag = rope.as_ref().map(|r| r.interleaved);
    let mut tensors = vec![key, value];
    tensors.extend(table);
    tensors.extend([lengths, lengths_after, key_new, value_new, query]);
    if let Some(r) = rope {
        tensors.extend([r.cos, r.sin]);
    }
    tensors.extend(slopes);
    tensors.extend(sinks);
    let op = |inputs, outputs| AppendDecodeOp::<B> {
        inputs,
        has_table,
        rope: rope_flag,
        has_slopes,
        has_sinks,
        outputs,
        options,
        _backend: PhantomData,
    };
    let mut results =
        crate::fusion::record("burn_flash::append_decode", tensors, outputs, op).into_iter();
    let mut next = || results.next().expect("registered output");
    let (key, value) = (next(), next());
    let query = rope_flag.map(|_| next());
    let (out, lse) = (next(), next());
    (Appended { key, value, query }, out, lse)
}
