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

/// The primitives of `B` inside a bundle of `Autodiff<B, C>`'s (none is tracked here).
fn inner_cache<B: FlashBackend, C: CheckpointStrategy>(
    cache: KvCache<Autodiff<B, C>>,
) -> KvCache<B> {
    KvCache {
        key: inner::<B, C>(cache.key),
        value: inner::<B, C>(cache.value),
        table: cache.table,
        lengths: cache.lengths,
    }
}

fn inner_heads<B: FlashBackend, C: CheckpointStrategy>(
    heads: HeadOperands<Autodiff<B, C>>,
) -> HeadOperands<B> {
    HeadOperands {
        slopes: heads.slopes.map(inner::<B, C>),
        sinks: heads.sinks.map(inner::<B, C>),
    }
}

fn inner_new<B: FlashBackend, C: CheckpointStrategy>(new: NewKeys<Autodiff<B, C>>) -> NewKeys<B> {
    NewKeys {
        key: inner::<B, C>(new.key),
        value: inner::<B, C>(new.value),
    }
}

fn inner_rope<B: FlashBackend, C: CheckpointStrategy>(
    rope: Option<RopeArgs<Autodiff<B, C>>>,
) -> Option<RopeArgs<B>> {
    rope.map(|r| RopeArgs {
        cos: inner::<B, C>(r.cos),
        sin: inner::<B, C>(r.sin),
        interleaved: r.interleaved,
        query: r.query.map(inner::<B, C>),
    })
}

fn untracked_appended<B: FlashBackend, C: CheckpointStrategy>(
    appended: Appended<B>,
) -> Appended<Autodiff<B, C>> {
    Appended {
        key: untracked::<B, C>(appended.key),
        value: untracked::<B, C>(appended.value),
        query: appended.query.map(untracked::<B, C>),
    }
}

pub(crate) fn decode<B: FlashBackend, C: CheckpointStrategy>(
    query: FloatTensor<Autodiff<B, C>>,
    cache: KvCache<Autodiff<B, C>>,
    heads: HeadOperands<Autodiff<B, C>>,
    options: FlashAttentionOptions,
) -> Pair<Autodiff<B, C>> {
    let (out, lse) = B::flash_decode(
        inner::<B, C>(query),
        inner_cache::<B, C>(cache),
        inner_heads::<B, C>(heads),
        options,
    );
    (untracked::<B, C>(out), untracked::<B, C>(lse))
}

pub(crate) fn append<B: FlashBackend, C: CheckpointStrategy>(
    cache: KvCache<Autodiff<B, C>>,
    new: NewKeys<Autodiff<B, C>>,
    rope: Option<RopeArgs<Autodiff<B, C>>>,
) -> Appended<Autodiff<B, C>> {
    let out = B::flash_kv_append(
        inner_cache::<B, C>(cache),
        inner_new::<B, C>(new),
        inner_rope::<B, C>(rope),
    );
    untracked_appended::<B, C>(out)
}

pub(crate) fn append_decode<B: FlashBackend, C: CheckpointStrategy>(
    cache: KvCache<Autodiff<B, C>>,
    lengths_after: IntTensor<Autodiff<B, C>>,
    new: NewKeys<Autodiff<B, C>>,
    query: FloatTensor<Autodiff<B, C>>,
    rope: Option<RopeArgs<Autodiff<B, C>>>,
    heads: HeadOperands<Autodiff<B, C>>,
    options: FlashAttentionOptions,
) -> AppendDecoded<Autodiff<B, C>> {
    let (appended, out, lse) = B::flash_append_decode(
        inner_cache::<B, C>(cache),
        lengths_after,
        inner_new::<B, C>(new),
        inner::<B, C>(query),
        inner_rope::<B, C>(rope),
        inner_heads::<B, C>(heads),
        options,
    );
    let appended = untracked_appended::<B, C>(appended);
    (appended, untracked::<B, C>(out), untracked::<B, C>(lse))
}
