//! The decoding and append ops on `Autodiff<B>`: `B`'s, on the untracked values (inference
//! ops: no gradient flows through them).

use super::*;

/// The output and the log-sum-exp.
type Pair<A> = (FloatTensor<A>, FloatTensor<A>);

fn inner<B: FlashBackend, C: CheckpointStrategy>(t: FloatTensor<Autodiff<B, C>>) -> FloatTensor<B> {
    Autodiff::<B, C>::inner(t)
}

fn untracked<B: FlashBackend, C: CheckpointStrategy>(
    t: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    Autodiff::<B, C>::from_inner(t)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn decode<B: FlashBackend, C: CheckpointStrategy>(
    query: FloatTensor<Autodiff<B, C>>,
    key: FloatTensor<Autodiff<B, C>>,
    value: FloatTensor<Autodiff<B, C>>,
    table: Option<IntTensor<B>>,
    lengths: IntTensor<B>,
    slopes: Option<FloatTensor<Autodiff<B, C>>>,
    sinks: Option<FloatTensor<Autodiff<B, C>>>,
    options: FlashAttentionOptions,
) -> Pair<Autodiff<B, C>> {
    let (out, lse) = B::flash_decode(
        inner::<B, C>(query),
        inner::<B, C>(key),
        inner::<B, C>(value),
        table,
        lengths,
        slopes.map(inner::<B, C>),
        sinks.map(inner::<B, C>),
        options,
    );
    (untracked::<B, C>(out), untracked::<B, C>(lse))
}

pub(crate) fn append<B: FlashBackend, C: CheckpointStrategy>(
    key: FloatTensor<Autodiff<B, C>>,
    value: FloatTensor<Autodiff<B, C>>,
    table: Option<IntTensor<B>>,
    lengths: IntTensor<B>,
    key_new: FloatTensor<Autodiff<B, C>>,
    value_new: FloatTensor<Autodiff<B, C>>,
    rope: Option<RopeArgs<Autodiff<B, C>>>,
) -> Appended<Autodiff<B, C>> {
    let rope = rope.map(|r| RopeArgs {
        cos: inner::<B, C>(r.cos),
        sin: inner::<B, C>(r.sin),
        interleaved: r.interleaved,
        query: r.query.map(inner::<B, C>),
    });
    let out = B::flash_kv_append(
        inner::<B, C>(key),
        inner::<B, C>(value),
        table,
        lengths,
        inner::<B, C>(key_new),
        inner::<B, C>(value_new),
        rope,
    );
    Appended {
        key: untracked::<B, C>(out.key),
        value: untracked::<B, C>(out.value),
        query: out.query.map(untracked::<B, C>),
    }
}

pub(crate) fn append_decode<B: FlashBackend, C: CheckpointStrategy>(
    (key, value, table, lengths, lengths_after): AppendCaches<Autodiff<B, C>>,
    (key_new, value_new, query, rope): AppendRows<Autodiff<B, C>>,
    slopes: Option<FloatTensor<Autodiff<B, C>>>,
    sinks: Option<FloatTensor<Autodiff<B, C>>>,
    options: FlashAttentionOptions,
) -> AppendDecoded<Autodiff<B, C>> {
    let rope = rope.map(|r| RopeArgs {
        cos: inner::<B, C>(r.cos),
        sin: inner::<B, C>(r.sin),
        interleaved: r.interleaved,
        query: None,
    });
    let (appended, out, lse) = B::flash_append_decode(
        inner::<B, C>(key),
        inner::<B, C>(value),
        table,
        lengths,
        lengths_after,
        inner::<B, C>(key_new),
        inner::<B, C>(value_new),
        inner::<B, C>(query),
        rope,
        slopes.map(inner::<B, C>),
        sinks.map(inner::<B, C>),
        options,
    );
    let appended = Appended {
        key: untracked::<B, C>(appended.key),
        value: untracked::<B, C>(appended.value),
        query: appended.query.map(untracked::<B, C>),
    };
    (appended, untracked::<B, C>(out), untracked::<B, C>(lse))
}
