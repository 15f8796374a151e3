//! The composed fallback of the paged ops (NdArray and every backend without the kernels):
//! each sequence's keys gathered through the table on the host, then the composed attention;
//! the append as an indexed write, RoPE by stock ops.

use super::*;

/// Reads an integer tensor to the host.
pub(super) fn host_ints<B: Backend, const D: usize>(t: IntTensor<B>) -> Vec<usize> {
    let t = Tensor::<B, D, Int>::from_primitive(t);
    t.into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .unwrap_or_else(|e| panic!("{OP}: could not read an index tensor: {e:?}"))
        .into_iter()
        .map(|x| x.max(0) as usize)
        .collect()
}

/// The pool rows (`[blocks·block_size]` flattened) of keys `0 .. len` of sequence `b`.
pub(super) fn slots(
    table: &[usize],
    width: usize,
    b: usize,
    block_size: usize,
    len: usize,
) -> Vec<i64> {
    (0..len)
        .map(|j| (table[b * width + j / block_size] * block_size + j % block_size) as i64)
        .collect()
}

/// The composed decoding: each sequence's keys gathered (lengths and table read to the host),
/// then the composed attention per sequence ([`AttentionBackend::flash_decode`]'s provided
/// body).
pub(crate) fn decode<B: AttentionBackend>(
    query: FloatTensor<B>,
    cache: KvCache<B>,
    heads: HeadOperands<B>,
    options: FlashAttentionOptions,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let float4 = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    let (query, key, value) = (float4(query), float4(cache.key), float4(cache.value));
    let lengths = host_ints::<B, 1>(cache.lengths);
    let batch = query.dims()[0];
    let device = query.device();
    let gather = |pool: &Tensor<B, 4>,
                  b: usize,
                  len: usize,
                  table: &Option<(Vec<usize>, usize)>| {
        match table {
            Some((entries, width)) => {
                let [blocks, block_size, heads, cols] = pool.dims();
                let idx = slots(entries, *width, b, block_size, len);
                let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [len]), &device);
                pool.clone()
                    .reshape([blocks * block_size, heads, cols])
                    .select(0, idx)
                    .swap_dims(0, 1)
                    .unsqueeze_dim::<4>(0)
            }
            None => pool.clone().slice([b..b + 1, 0..pool.dims()[1], 0..len]),
        }
    };
    let table = cache.table.map(|t| {
        let width = Tensor::<B, 2, Int>::from_primitive(t.clone()).dims()[1];
        (host_ints::<B, 2>(t), width)
    });
    let mut outs = Vec::with_capacity(batch);
    let mut lses = Vec::with_capacity(batch);
    let [_, heads_q, seq_q, _] = query.dims();
    let value_dim = value.dims()[3];
    for (b, &len) in lengths.iter().enumerate().take(batch) {
        if len == 0 {
            // No key: zeros and lse = −inf (gathering nothing is not every backend's op).
            let dtype = query.dtype();
            outs.push(Tensor::zeros(
                [1, heads_q, seq_q, value_dim],
                (&device, dtype),
            ));
            lses.push(Tensor::full(
                [1, heads_q, seq_q],
                f32::NEG_INFINITY,
                (&device, DType::F32),
            ));
            continue;
        }
        let q = query.clone().narrow(0, b, 1);
        let k = gather(&key, b, len, &table);
        let v = gather(&value, b, len, &table);
        let inputs = AttentionInputs {
            query: q.into_primitive().tensor(),
            key: k.into_primitive().tensor(),
            value: v.into_primitive().tensor(),
            scores: ScoreOperands {
                heads: heads.clone(),
                ..ScoreOperands::default()
            },
        };
        let (out, lse) = B::flash_attention(inputs, options);
        outs.push(Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(out)));
        lses.push(Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(lse)));
    }
    (
        Tensor::cat(outs, 0).into_primitive().tensor(),
        Tensor::cat(lses, 0).into_primitive().tensor(),
    )
}

/// `x` `[B, H, S, D]` rotated by RoPE at positions `positions[b] + s`, in f32, back in `x`'s
/// dtype.
pub(super) fn rotate<B: Backend>(
    x: Tensor<B, 4>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    positions: &[usize],
    interleaved: bool,
) -> Tensor<B, 4> {
    let [batch, heads, new, dim] = x.dims();
    let half = cos.dims()[1];
    let dtype = x.dtype();
    let device = x.device();
    let idx: Vec<i64> = positions
        .iter()
        .flat_map(|&p| (0..new).map(move |s| (p + s) as i64))
        .collect();
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [batch * new]), &device);
    let angles = |t: &Tensor<B, 2>| {
        t.clone()
            .select(0, idx.clone())
            .reshape([batch, 1, new, half])
    };
    let (c, s) = (angles(cos), angles(sin));
    let x = x.cast(DType::F32);
    let rot = x.clone().slice([0..batch, 0..heads, 0..new, 0..2 * half]);
    let (x0, x1) = if interleaved {
        let pairs = rot.reshape([batch, heads, new, half, 2]);
        let x0 = pairs
            .clone()
            .slice([0..batch, 0..heads, 0..new, 0..half, 0..1]);
        let x1 = pairs.slice([0..batch, 0..heads, 0..new, 0..half, 1..2]);
        (
            x0.reshape([batch, heads, new, half]),
            x1.reshape([batch, heads, new, half]),
        )
    } else {
        (
            rot.clone().slice([0..batch, 0..heads, 0..new, 0..half]),
            rot.slice([0..batch, 0..heads, 0..new, half..2 * half]),
        )
    };
    let y0 = x0.clone() * c.clone() - x1.clone() * s.clone();
    let y1 = x0 * s + x1 * c;
    let rotated = if interleaved {
        Tensor::stack::<5>(vec![y0, y1], 4).reshape([batch, heads, new, 2 * half])
    } else {
        Tensor::cat(vec![y0, y1], 3)
    };
    let rest = x.slice([0..batch, 0..heads, 0..new, 2 * half..dim]);
    Tensor::cat(vec![rotated, rest], 3).cast(dtype)
}

/// The composed append: the lengths (and table) read to the host, RoPE from stock ops, the rows
/// written with `select_assign` (pools) or `slice_assign` (contiguous caches)
/// ([`AttentionBackend::flash_kv_append`]'s provided body).
pub(crate) fn append<B: Backend>(
    cache: KvCache<B>,
    new: NewKeys<B>,
    rope: Option<RopeArgs<B>>,
) -> Appended<B> {
    let float4 = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    let (key, value) = (float4(cache.key), float4(cache.value));
    let (mut key_new, value_new) = (float4(new.key), float4(new.value));
    let lengths = host_ints::<B, 1>(cache.lengths);
    let table = cache.table;
    let mut query = None;
    if let Some(r) = rope {
        let float2 = |t| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
        let (cos, sin) = (float2(r.cos), float2(r.sin));
        key_new = rotate(key_new, &cos, &sin, &lengths, r.interleaved);
        query = r
            .query
            .map(|q| rotate(float4(q), &cos, &sin, &lengths, r.interleaved));
    }
    let [batch, heads, new, _] = key_new.dims();
    let device = key.device();
    let write = |cache: Tensor<B, 4>, rows: Tensor<B, 4>| -> Tensor<B, 4> {
        let cols = rows.dims()[3];
        match &table {
            Some(t) => {
                let width = Tensor::<B, 2, Int>::from_primitive(t.clone()).dims()[1];
                let entries = host_ints::<B, 2>(t.clone());
                let [blocks, block_size, _, _] = cache.dims();
                let idx: Vec<i64> = (0..batch)
                    .flat_map(|b| {
                        let all = slots(&entries, width, b, block_size, lengths[b] + new);
                        all[lengths[b]..].to_vec()
                    })
                    .collect();
                let idx =
                    Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [batch * new]), &device);
                let rows = rows.swap_dims(1, 2).reshape([batch * new, heads, cols]);
                // Added to the rows' negation: exactly the new values (`x + (−x) = 0`), with
                // the `Add` update every backend implements.
                let flat = cache.reshape([blocks * block_size, heads, cols]);
                let old = flat.clone().select(0, idx.clone()).neg();
                flat.select_assign(0, idx.clone(), old, IndexingUpdateOp::Add)
                    .select_assign(0, idx, rows, IndexingUpdateOp::Add)
                    .reshape([blocks, block_size, heads, cols])
            }
            None => {
                let mut cache = cache;
                for (b, &len) in lengths.iter().enumerate().take(batch) {
                    let row = rows.clone().narrow(0, b, 1);
                    cache = cache.slice_assign([b..b + 1, 0..heads, len..len + new, 0..cols], row);
                }
                cache
            }
        }
    };
    Appended {
        key: write(key, key_new).into_primitive().tensor(),
        value: write(value, value_new).into_primitive().tensor(),
        query: query.map(|q| q.into_primitive().tensor()),
    }
}

/// The append, then decoding the appended caches ([`AttentionBackend::flash_append_decode`]'s
/// provided body): `B`'s two ops, the query rotated by the append where `rope` is given.
pub(crate) fn append_decode<B: AttentionBackend>(
    cache: KvCache<B>,
    lengths_after: IntTensor<B>,
    new: NewKeys<B>,
    query: FloatTensor<B>,
    rope: Option<RopeArgs<B>>,
    heads: HeadOperands<B>,
    options: FlashAttentionOptions,
) -> AppendDecoded<B> {
    // With RoPE the append rotates the query too, and the rotated one attends.
    let (rope, plain) = match rope {
        Some(r) => (
            Some(RopeArgs {
                query: Some(query),
                ..r
            }),
            None,
        ),
        None => (None, Some(query)),
    };
    let table = cache.table.clone();
    let appended = B::flash_kv_append(cache, new, rope);
    let query = plain
        .or_else(|| appended.query.clone())
        .expect("the append returns the rotated query");
    let cache = KvCache {
        key: appended.key.clone(),
        value: appended.value.clone(),
        table,
        lengths: lengths_after,
    };
    let (out, lse) = B::flash_decode(query, cache, heads, options);
    (appended, out, lse)
}
