//! [`AttentionBackend`](crate::AttentionBackend): fused attention as a Burn backend extension,
//! and its implementations for CubeCL backends (fused kernels), `Fusion` and `Autodiff`
//! ([`crate::FlashBackend`] lists the backends).

use burn::backend::{Autodiff, autodiff::checkpoint::strategy::CheckpointStrategy};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::{Fusion, FusionBackend};

use super::operands::{AttentionInputs, HeadOperands, KvCache, NewKeys};
use super::paged::{AppendDecoded, Appended, RopeArgs};
use super::paged::{autodiff as paged_autodiff, composed as paged_composed};
use super::{AttentionGrads, FlashAttentionOptions};
use super::{autodiff, composed, cube, fusion};
use crate::{FlashBackend, SoftmaxMatmulBackend};

/// The methods an implementation passes on, written once (the trait's provided bodies are
/// written with it too). `ops: m::<G, …>` forwards [`AttentionBackend::flash_attention`] and its
/// backward to `m::{forward, backward}` (`m`: `composed`, `cube`, `fusion`, `autodiff`) with the
/// generic arguments `G, …`; `forward: m::<G, …>` the forward alone; `paged: m::<G, …>`
/// decoding and the append to `m::{decode, append}`; `append_decode: m::<G, …>` the two as one
/// op to `m::append_decode`. The plans are [`crate::planner::Planner`]'s.
macro_rules! delegate {
    (ops: $m:ident::<$($g:ty),+>) => {
        delegate!(forward: $m::<$($g),+>);

        /// Gradients of [`AttentionBackend::flash_attention`] (same inputs and options) from
        /// its output `out`, its `lse` and the output gradient `d_out`; the score gradient
        /// `ds` only when `want_ds` (a tracked bias). Arguments are checked by the caller.
        fn flash_attention_backward(
            inputs: AttentionInputs<Self>,
            out: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            d_out: FloatTensor<Self>,
            options: FlashAttentionOptions,
            want_ds: bool,
        ) -> AttentionGrads<Self> {
            $m::backward::<$($g),+>(inputs, out, lse, d_out, options, want_ds)
        }
    };
    (forward: $m:ident::<$($g:ty),+>) => {
        /// `(out, lse)` of attention (see [`crate::attention()`]) over `inputs`
        /// ([`AttentionInputs`]: `query` `[B, Hq, Sq, D]`, `key` `[B, Hkv, Sk, D]`, `value`
        /// `[B, Hkv, Sk, Dv]`, the mask and bias broadcasting to `[B, Hq, Sq, Sk]`, ALiBi
        /// slopes ([`crate::attention_with_alibi`]) and attention sinks, a packed batch's
        /// sequences ([`crate::VarlenBatch`])); `lse` (`[B, Hq, Sq]`, f32) is the row
        /// log-sum-exp of the scores. Arguments are checked by the caller.
        fn flash_attention(
            inputs: AttentionInputs<Self>,
            options: FlashAttentionOptions,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            $m::forward::<$($g),+>(inputs, options)
        }
    };
    (paged: $m:ident::<$($g:ty),+>) => {
        /// `(out, lse)` of `query` `[B, Hq, Sq, D]` against the first `lengths[b]` keys of each
        /// batch of `cache` ([`crate::attention_paged`]); the queries are each batch's last
        /// `Sq` positions. Inference only. Arguments are checked by the caller (table entries
        /// inside the pool, lengths inside the cache).
        fn flash_decode(
            query: FloatTensor<Self>,
            cache: KvCache<Self>,
            heads: HeadOperands<Self>,
            options: FlashAttentionOptions,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            $m::decode::<$($g),+>(query, cache, heads, options)
        }

        /// `new` keys `[B, Hkv, S, D]` and values written into `cache` at positions
        /// `lengths[b] ..`, keys (and the queries given with `rope`) rotated by RoPE
        /// ([`crate::append_paged`]). Inference only. Arguments are checked by the caller.
        fn flash_kv_append(
            cache: KvCache<Self>,
            new: NewKeys<Self>,
            rope: Option<RopeArgs<Self>>,
        ) -> Appended<Self> {
            $m::append::<$($g),+>(cache, new, rope)
        }
    };
    (append_decode: $m:ident::<$($g:ty),+>) => {
        /// [`AttentionBackend::flash_kv_append`] then [`AttentionBackend::flash_decode`] as one
        /// op ([`crate::append_attention_paged`]): the `new` keys and values written at
        /// positions `lengths[b] ..`, then `query` (rotated by `rope` where given, at the same
        /// positions) attends to the first `lengths_after[b]` keys. Returns the caches (with the
        /// rotated query where rotated), the output and the log-sum-exp. Inference only.
        /// Arguments are checked by the caller.
        fn flash_append_decode(
            cache: KvCache<Self>,
            lengths_after: IntTensor<Self>,
            new: NewKeys<Self>,
            query: FloatTensor<Self>,
            rope: Option<RopeArgs<Self>>,
            heads: HeadOperands<Self>,
            options: FlashAttentionOptions,
        ) -> AppendDecoded<Self> {
            $m::append_decode::<$($g),+>(
                cache,
                lengths_after,
                new,
                query,
                rope,
                heads,
                options,
            )
        }
    };
}

/// Fused attention ([`crate::attention()`]); provided bodies as
/// [`SoftmaxBackend`](crate::SoftmaxBackend)'s: the composed attention
/// ([`super::composed`]) and its paged fallback.
pub trait AttentionBackend: SoftmaxMatmulBackend {
    delegate!(ops: composed::<Self>);
    delegate!(paged: paged_composed::<Self>);
    delegate!(append_decode: paged_composed::<Self>);
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> AttentionBackend
    for CubeBackend<R, F, I, BT>
{
    delegate!(ops: cube::<R, F, I, BT>);
    delegate!(paged: cube::<R, F, I, BT>);
}

impl<B: FusionBackend + FlashBackend> AttentionBackend for Fusion<B> {
    delegate!(ops: fusion::<B>);
    delegate!(paged: fusion::<B>);
    delegate!(append_decode: fusion::<B>);
}

/// The forward runs `B`'s attention and keeps its inputs, output and `lse`; the backward
/// runs `B`'s attention backward (fused kernels on CubeCL backends, the composed gradient
/// on the fallback).
impl<B: FlashBackend, C: CheckpointStrategy> AttentionBackend for Autodiff<B, C> {
    delegate!(forward: autodiff::<B, C>);
    delegate!(paged: paged_autodiff::<B, C>);
    delegate!(append_decode: paged_autodiff::<B, C>);
}
