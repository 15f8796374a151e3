//! [`AttentionBackend`](crate::AttentionBackend): fused attention as a Burn backend extension,
//! and its implementations for CubeCL backends (fused kernels), `Fusion` and `Autodiff`
//! ([`crate::FlashBackend`] lists the backends).

use burn::backend::{Autodiff, autodiff::checkpoint::strategy::CheckpointStrategy};
use burn::tensor::{
    DType,
    ops::{BoolTensor, FloatTensor, IntTensor},
};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_flash_kernels::attention::{
    AttentionBackwardPlan, AttentionDims, AttentionError, AttentionPlan,
};
use burn_fusion::{Fusion, FusionBackend};

use super::paged::{AppendDecoded, Appended, RopeArgs};
use super::{AttentionGrads, FlashAttentionOptions, ScoreTerms};
use crate::{FlashBackend, SoftmaxMatmulBackend};

/// Fused attention ([`crate::attention()`]); provided bodies as
/// [`SoftmaxBackend`](crate::SoftmaxBackend)'s.
pub trait AttentionBackend: SoftmaxMatmulBackend {
    /// `(out, lse)` of attention (see [`crate::attention()`]) over `query` `[B, Hq, Sq, D]`,
    /// `key` `[B, Hkv, Sk, D]`, `value` `[B, Hkv, Sk, Dv]`, with `mask`/`bias` broadcasting
    /// to `[B, Hq, Sq, Sk]`, ALiBi `slopes` `[Hq]` (f32; [`crate::attention_with_alibi`]),
    /// attention `sinks` `[Hq]` (f32) and, for a packed variable-length batch (`B = 1`), its
    /// sequences `seqs` (`[2·(n + 1)]`: cumulative query lengths, then key lengths;
    /// [`crate::VarlenBatch`]); `lse` (`[B, Hq, Sq]`, f32) is the row log-sum-exp of the
    /// scores. Arguments are checked by the caller.
    fn flash_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: Option<BoolTensor<Self>>,
        bias: Option<FloatTensor<Self>>,
        slopes: Option<FloatTensor<Self>>,
        sinks: Option<FloatTensor<Self>>,
        seqs: Option<IntTensor<Self>>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inputs = (query, key, value, mask, bias, slopes, sinks, seqs);
        super::composed::forward::<Self>(inputs, options)
    }

    /// Gradients of [`AttentionBackend::flash_attention`] (same arguments and options) from
    /// its output `out`, its `lse` and the output gradient `d_out`; the score gradient `ds`
    /// only when `want_ds` (a tracked bias). Arguments are checked by the caller.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: Option<BoolTensor<Self>>,
        bias: Option<FloatTensor<Self>>,
        slopes: Option<FloatTensor<Self>>,
        sinks: Option<FloatTensor<Self>>,
        seqs: Option<IntTensor<Self>>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        options: FlashAttentionOptions,
        want_ds: bool,
    ) -> AttentionGrads<Self> {
        let inputs = (query, key, value, mask, bias, slopes, sinks, seqs);
        super::composed::backward::<Self>(inputs, out, lse, d_out, options, want_ds)
    }

    /// `(out, lse)` of `query` `[B, Hq, Sq, D]` against the first `lengths[b]` keys of each
    /// batch ([`crate::attention_paged`]): `key`/`value` contiguous caches `[B, Hkv, S_max, ·]`,
    /// or with `table` (`[B, max_blocks]`) block pools `[blocks, block_size, Hkv, ·]`; the
    /// queries are each batch's last `Sq` positions. Inference only. Arguments are checked by
    /// the caller (table entries inside the pool, lengths inside the cache).
    #[allow(clippy::too_many_arguments)]
    fn flash_decode(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        table: Option<IntTensor<Self>>,
        lengths: IntTensor<Self>,
        slopes: Option<FloatTensor<Self>>,
        sinks: Option<FloatTensor<Self>>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        super::paged::composed_decode::<Self>(
            query, key, value, table, lengths, slopes, sinks, options,
        )
    }

    /// `key_new` `[B, Hkv, S, D]`, `value_new` written into the caches (as
    /// [`AttentionBackend::flash_decode`]'s) at positions `lengths[b] ..`, keys (and the
    /// queries given with `rope`) rotated by RoPE ([`crate::append_paged`]). Inference only.
    /// Arguments are checked by the caller.
    fn flash_kv_append(
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        table: Option<IntTensor<Self>>,
        lengths: IntTensor<Self>,
        key_new: FloatTensor<Self>,
        value_new: FloatTensor<Self>,
        rope: Option<RopeArgs<Self>>,
    ) -> Appended<Self> {
        super::paged::composed_append::<Self>(key, value, table, lengths, key_new, value_new, rope)
    }

    /// [`AttentionBackend::flash_kv_append`] then [`AttentionBackend::flash_decode`] as one op
    /// ([`crate::append_attention_paged`]): the new keys and values written at positions
    /// `lengths[b] ..`, then `query` (rotated by `rope` where given, at the same positions)
    /// attends to the first `lengths_after[b]` keys. Returns the caches (with the rotated
    /// query where rotated), the output and the log-sum-exp. Inference only. Arguments are
    /// checked by the caller.
    #[allow(clippy::too_many_arguments)]
    fn flash_append_decode(
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        table: Option<IntTensor<Self>>,
        lengths: IntTensor<Self>,
        lengths_after: IntTensor<Self>,
        key_new: FloatTensor<Self>,
        value_new: FloatTensor<Self>,
        query: FloatTensor<Self>,
        rope: Option<RopeArgs<Self>>,
        slopes: Option<FloatTensor<Self>>,
        sinks: Option<FloatTensor<Self>>,
        options: FlashAttentionOptions,
    ) -> AppendDecoded<Self> {
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
        let appended =
            Self::flash_kv_append(key, value, table.clone(), lengths, key_new, value_new, rope);
        let query = plain
            .or_else(|| appended.query.clone())
            .expect("the append returns the rotated query");
        let (out, lse) = Self::flash_decode(
            query,
            appended.key.clone(),
            appended.value.clone(),
            table,
            lengths_after,
            slopes,
            sinks,
            options,
        );
        (appended, out, lse)
    }

    /// The launch the fused attention backward would make for contiguous tensors, with or
    /// without a `mask` and a `bias`, tracked or not (`None`: composed fallback).
    fn flash_attention_backward_plan(
        device: &Self::Device,
        dims: AttentionDims,
        dtype: DType,
        options: FlashAttentionOptions,
        terms: ScoreTerms,
    ) -> Option<Result<AttentionBackwardPlan, AttentionError>> {
        let _ = (device, dims, dtype, options, terms);
        None
    }

    /// The launch the fused attention would make for contiguous tensors, with or without a
    /// mask and a bias (`None`: this backend uses the composed fallback).
    fn flash_attention_plan(
        device: &Self::Device,
        dims: AttentionDims,
        dtype: DType,
        options: FlashAttentionOptions,
        terms: ScoreTerms,
    ) -> Option<Result<AttentionPlan, AttentionError>> {
        let _ = (device, dims, dtype, options, terms);
        None
    }
}

/// The methods an implementation passes on, written once. `forward: m::<G, …>` forwards
/// [`AttentionBackend::flash_attention`] to `super::m::forward` (`m`: `cube`, `fusion`,
/// `autodiff`) with the generic arguments `G, …` and the call's tensors as one
/// [`Inputs`](super::Inputs), `backward: m::<G, …>` its backward to `super::m::backward`
/// likewise, `ops: m::<G, …>` both; `planning: B` forwards a wrapper's (`Fusion`, `Autodiff`)
/// planning methods to its inner backend `B` unchanged.
macro_rules! delegate {
    (ops: $module:ident::<$($g:ident),+>) => {
        delegate!(forward: $module::<$($g),+>);
        delegate!(backward: $module::<$($g),+>);
    };
    (forward: $module:ident::<$($g:ident),+>) => {
        fn flash_attention(
            query: FloatTensor<Self>,
            key: FloatTensor<Self>,
            value: FloatTensor<Self>,
            mask: Option<BoolTensor<Self>>,
            bias: Option<FloatTensor<Self>>,
            slopes: Option<FloatTensor<Self>>,
            sinks: Option<FloatTensor<Self>>,
            seqs: Option<IntTensor<Self>>,
            options: FlashAttentionOptions,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            let inputs = (query, key, value, mask, bias, slopes, sinks, seqs);
            super::$module::forward::<$($g),+>(inputs, options)
        }
    };
    (backward: $module:ident::<$($g:ident),+>) => {
        fn flash_attention_backward(
            query: FloatTensor<Self>,
            key: FloatTensor<Self>,
            value: FloatTensor<Self>,
            mask: Option<BoolTensor<Self>>,
            bias: Option<FloatTensor<Self>>,
            slopes: Option<FloatTensor<Self>>,
            sinks: Option<FloatTensor<Self>>,
            seqs: Option<IntTensor<Self>>,
            out: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            d_out: FloatTensor<Self>,
            options: FlashAttentionOptions,
            want_ds: bool,
        ) -> AttentionGrads<Self> {
            let inputs = (query, key, value, mask, bias, slopes, sinks, seqs);
            super::$module::backward::<$($g),+>(inputs, out, lse, d_out, options, want_ds)
        }
    };
    (paged: $decode:path, $append:path) => {
        fn flash_decode(
            query: FloatTensor<Self>,
            key: FloatTensor<Self>,
            value: FloatTensor<Self>,
            table: Option<IntTensor<Self>>,
            lengths: IntTensor<Self>,
            slopes: Option<FloatTensor<Self>>,
            sinks: Option<FloatTensor<Self>>,
            options: FlashAttentionOptions,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            $decode(query, key, value, table, lengths, slopes, sinks, options)
        }

        fn flash_kv_append(
            key: FloatTensor<Self>,
            value: FloatTensor<Self>,
            table: Option<IntTensor<Self>>,
            lengths: IntTensor<Self>,
            key_new: FloatTensor<Self>,
            value_new: FloatTensor<Self>,
            rope: Option<RopeArgs<Self>>,
        ) -> Appended<Self> {
            $append(key, value, table, lengths, key_new, value_new, rope)
        }
    };
    (append_decode: $op:path) => {
        fn flash_append_decode(
            key: FloatTensor<Self>,
            value: FloatTensor<Self>,
            table: Option<IntTensor<Self>>,
            lengths: IntTensor<Self>,
            lengths_after: IntTensor<Self>,
            key_new: FloatTensor<Self>,
            value_new: FloatTensor<Self>,
            query: FloatTensor<Self>,
            rope: Option<RopeArgs<Self>>,
            slopes: Option<FloatTensor<Self>>,
            sinks: Option<FloatTensor<Self>>,
            options: FlashAttentionOptions,
        ) -> AppendDecoded<Self> {
            let caches = (key, value, table, lengths, lengths_after);
            let new = (key_new, value_new, query, rope);
            $op(caches, new, slopes, sinks, options)
        }
    };
    (planning: $inner:ty) => {
        fn flash_attention_plan(
            device: &Self::Device,
            dims: AttentionDims,
            dtype: DType,
            options: FlashAttentionOptions,
            terms: ScoreTerms,
        ) -> Option<Result<AttentionPlan, AttentionError>> {
            <$inner>::flash_attention_plan(device, dims, dtype, options, terms)
        }

        fn flash_attention_backward_plan(
            device: &Self::Device,
            dims: AttentionDims,
            dtype: DType,
            options: FlashAttentionOptions,
            terms: ScoreTerms,
        ) -> Option<Result<AttentionBackwardPlan, AttentionError>> {
            <$inner>::flash_attention_backward_plan(device, dims, dtype, options, terms)
        }
    };
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> AttentionBackend
    for CubeBackend<R, F, I, BT>
{
    delegate!(ops: cube::<R, F, I, BT>);
    delegate!(paged: super::cube::decode::<R, F, I, BT>, super::cube::append::<R, F, I, BT>);

    fn flash_attention_backward_plan(
        device: &Self::Device,
        dims: AttentionDims,
        dtype: DType,
        options: FlashAttentionOptions,
        terms: ScoreTerms,
    ) -> Option<Result<AttentionBackwardPlan, AttentionError>> {
        let client = R::client(device);
        Some(super::cube::backward_plan(
            &client, dims, dtype, options, terms,
        ))
    }

    fn flash_attention_plan(
        device: &Self::Device,
        dims: AttentionDims,
        dtype: DType,
        options: FlashAttentionOptions,
        terms: ScoreTerms,
    ) -> Option<Result<AttentionPlan, AttentionError>> {
        let client = R::client(device);
        Some(super::cube::plan(&client, dims, dtype, options, terms))
    }
}

impl<B: FusionBackend + FlashBackend> AttentionBackend for Fusion<B> {
    delegate!(ops: fusion::<B>);
    delegate!(paged: super::fusion::decode::<B>, super::fusion::append::<B>);
    delegate!(append_decode: super::fusion::append_decode::<B>);
    delegate!(planning: B);
}

/// The forward runs `B`'s attention and keeps its inputs, output and `lse`; the backward
/// runs `B`'s attention backward (fused kernels on CubeCL backends, the composed gradient
/// on the fallback).
impl<B: FlashBackend, C: CheckpointStrategy> AttentionBackend for Autodiff<B, C> {
    delegate!(forward: autodiff::<B, C>);
    delegate!(
        paged: super::paged::autodiff::decode::<B, C>,
        super::paged::autodiff::append::<B, C>
    );
    delegate!(append_decode: super::paged::autodiff::append_decode::<B, C>);
    delegate!(planning: B);
}
