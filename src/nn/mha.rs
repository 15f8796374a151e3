//! [`MultiHeadAttention`]: burn-nn 0.21's multi-head attention on the fused kernels.

use burn::config::Config;
use burn::module::{Content, DisplaySettings, Initializer, Module, ModuleDisplay};
use burn::nn::{Dropout, DropoutConfig, Gelu, Linear, LinearConfig};
use burn::tensor::{Bool, Tensor, activation, backend::Backend};

use super::cache::{KvCache, RowCache};
use super::{
    attention_mask, check_divides, display_settings, merge_heads, module_options, project_heads,
    rows,
};
use crate::FlashBackend;

const WHO: &str = "burn_flash::nn::MultiHeadAttention";

/// The configuration of a [`MultiHeadAttention`]: burn-nn's `MultiHeadAttentionConfig`, field
/// for field, with its defaults (a saved burn-nn config loads as this one).
#[derive(Config, Debug)]
pub struct MultiHeadAttentionConfig {
    /// The size of each linear layer.
    pub d_model: usize,
    /// The number of heads.
    pub n_heads: usize,
    /// The dropout probability of the attention weights (module docs: burn-nn drops the raw
    /// scores instead).
    #[config(default = 0.1)]
    pub dropout: f64,
    /// The score a masked key takes (burn-nn's `mask_fill` value): the key stays in the softmax,
    /// so a fully masked row is uniform.
    #[config(default = -1.0e4)]
    pub min_float: f64,
    /// Quiet softmax, `e^s / (1 + Σ e^s)`: a head may attend to nothing.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// The initializer of the linear layers' weights (burn-nn's: Kaiming uniform, gain 1/√3).
    #[config(default = "Initializer::KaimingUniform{gain:0.5773502691896258, fan_out_only:false}")]
    pub initializer: Initializer,
}

/// Multi-head attention as burn-nn 0.21's `MultiHeadAttention` (the same fields, so the same
/// record), computed by [`crate::attention()`]: the scores and weights stay on chip
/// ([module docs](super)).
#[derive(Module, Debug)]
#[module(custom_display)]
pub struct MultiHeadAttention<B: Backend> {
    /// Linear layer transforming the input to queries.
    pub query: Linear<B>,
    /// Linear layer transforming the input to keys.
    pub key: Linear<B>,
    /// Linear layer transforming the input to values.
    pub value: Linear<B>,
    /// Linear layer transforming the context to the output.
    pub output: Linear<B>,
    /// Its probability is the attention weights' dropout (drawn inside the kernel).
    pub dropout: Dropout,
    /// Unused, as in burn-nn; kept for its place in the record.
    pub activation: Gelu,
    /// The size of each linear layer.
    pub d_model: usize,
    /// The number of heads.
    pub n_heads: usize,
    /// The size of each head, `d_model / n_heads`.
    pub d_k: usize,
    /// The score of a masked key.
    pub min_float: f64,
    /// Quiet softmax.
    pub quiet_softmax: bool,
}

impl<B: Backend> ModuleDisplay for MultiHeadAttention<B> {
    fn custom_settings(&self) -> Option<DisplaySettings> {
        display_settings()
    }

    fn custom_content(&self, content: Content) -> Option<Content> {
        content
            .add("d_model", &self.d_model)
            .add("n_heads", &self.n_heads)
            .add("d_k", &self.d_k)
            .add("dropout", &self.dropout.prob)
            .add("min_float", &self.min_float)
            .add("quiet_softmax", &self.quiet_softmax)
            .optional()
    }
}

impl MultiHeadAttentionConfig {
    /// A module with burn-nn's initialisation. Panics when `n_heads` does not divide `d_model`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> MultiHeadAttention<B> {
        check_divides(WHO, ("n_heads", self.n_heads), ("d_model", self.d_model));
        let linear = || {
            LinearConfig::new(self.d_model, self.d_model)
                .with_initializer(self.initializer.clone())
                .init(device)
        };
        MultiHeadAttention {
            query: linear(),
            key: linear(),
            value: linear(),
            output: linear(),
            dropout: DropoutConfig::new(self.dropout).init(),
            activation: Gelu::new(),
            d_model: self.d_model,
            n_heads: self.n_heads,
            d_k: self.d_model / self.n_heads,
            min_float: self.min_float,
            quiet_softmax: self.quiet_softmax,
        }
    }
}

/// burn-nn's `MultiHeadAttention` and this one have the same fields: `Self` with each of
/// `$m`'s moved in.
macro_rules! moved_fields {
    ($m:ident) => {
        Self {
            query: $m.query,
            key: $m.key,
            value: $m.value,
            output: $m.output,
            dropout: $m.dropout,
            activation: $m.activation,
            d_model: $m.d_model,
            n_heads: $m.n_heads,
            d_k: $m.d_k,
            min_float: $m.min_float,
            quiet_softmax: $m.quiet_softmax,
        }
    };
}

impl<B: Backend> From<burn::nn::attention::MultiHeadAttention<B>> for MultiHeadAttention<B> {
    /// The same parameters, moved.
    fn from(m: burn::nn::attention::MultiHeadAttention<B>) -> Self {
        moved_fields!(m)
    }
}

impl<B: Backend> From<MultiHeadAttention<B>> for burn::nn::attention::MultiHeadAttention<B> {
    /// The same parameters, moved.
    fn from(m: MultiHeadAttention<B>) -> Self {
        moved_fields!(m)
    }
}

/// The input of [`MultiHeadAttention`]: burn-nn's `MhaInput`, plus [`MhaInput::causal`].
#[derive(Debug, Clone)]
pub struct MhaInput<B: Backend> {
    pub(crate) query: Tensor<B, 3>,
    pub(crate) key: Tensor<B, 3>,
    pub(crate) value: Tensor<B, 3>,
    pub(crate) mask_pad: Option<Tensor<B, 2, Bool>>,
    pub(crate) mask_attn: Option<Tensor<B, 3, Bool>>,
    pub(crate) causal: bool,
    pub(crate) window: Option<(usize, usize)>,
}

impl<B: Backend> MhaInput<B> {
    /// Self-attention: `tensor` `[B, S, d_model]` is the query, key and value.
    pub fn self_attn(tensor: Tensor<B, 3>) -> Self {
        Self::new(tensor.clone(), tensor.clone(), tensor)
    }

    /// Queries `[B, Sq, d_model]` attending to keys and values `[B, Sk, d_model]`.
    pub fn new(query: Tensor<B, 3>, key: Tensor<B, 3>, value: Tensor<B, 3>) -> Self {
        Self {
            query,
            key,
            value,
            mask_pad: None,
            mask_attn: None,
            causal: false,
            window: None,
        }
    }

    /// Padding mask `[B, Sk]`, `true` = masked.
    pub fn mask_pad(mut self, mask_pad: Tensor<B, 2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// Attention mask `[B, Sq, Sk]`, `true` = masked.
    pub fn mask_attn(mut self, mask_attn: Tensor<B, 3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }

    /// A new input's masks and causal flag, at once.
    pub(crate) fn with_masks(self, (mask_pad, mask_attn, causal): MaskArgs<B>) -> Self {
        Self {
            mask_pad,
            mask_attn,
            causal,
            ..self
        }
    }

    /// Causal attention, query `i` seeing keys `j ≤ i + Sk − Sq` (bottom-right aligned, which
    /// for `Sq = Sk` is burn-nn's `generate_autoregressive_mask`), with no mask tensor: nothing
    /// `S × S` is read and the blocks above the diagonal are skipped. Masked keys leave the
    /// softmax rather than taking `min_float`; a causal row always sees its own key, so that
    /// changes nothing unless every score a row sees is within ~100 of `min_float`.
    pub fn causal(mut self) -> Self {
        self.causal = true;
        self
    }

    /// Sliding-window (local) attention: query `i` sees keys from `a − left` to `a + right`
    /// inclusive, `a = i + Sk − Sq` ([`crate::FlashAttentionOptions::window`]); with
    /// [`MhaInput::causal`],
    /// `.window(w − 1, 0)` is Mistral's window of `w` keys. Key blocks outside every row's
    /// window are skipped. With [`MhaCache::sliding_window`] the cache keeps only the keys a
    /// window can still reach.
    pub fn window(mut self, left: usize, right: usize) -> Self {
        self.window = Some((left, right));
        self
    }
}

/// The output of [`MultiHeadAttention`]: the context. Unlike burn-nn's `MhaOutput` there is no
/// `weights` field: the `[B, H, Sq, Sk]` weights are never made unless asked for
/// ([`MultiHeadAttention::attention_weights`]).
#[derive(Debug, Clone)]
pub struct MhaOutput<B: Backend> {
    /// The context, `[B, Sq, d_model]`.
    pub context: Tensor<B, 3>,
}

/// A call's masks and causal flag: `mask_pad`, `mask_attn`, `causal`.
pub(crate) type MaskArgs<B> = (Option<Tensor<B, 2, Bool>>, Option<Tensor<B, 3, Bool>>, bool);

impl<B: FlashBackend> MultiHeadAttention<B> {
    /// Attention of `input`'s queries to its keys and values: the context `[B, Sq, d_model]`.
    ///
    /// # Panics
    /// When the inputs' widths are not `d_model`, their batches differ, key and value lengths
    /// differ, or a mask's shape is not `[B, Sk]` / `[B, Sq, Sk]`.
    pub fn forward(&self, mut input: MhaInput<B>) -> MhaOutput<B> {
        let (mask, _) = self.checked_mask(&mut input);
        let q = project_heads(&self.query, input.query, self.n_heads);
        let (k, v) = self.keys_values(input.key, input.value);
        let context = self.attend(q, k, v, mask, input.causal, input.window);
        MhaOutput {
            context: self.output.forward(merge_heads(context)),
        }
    }

    /// [`MultiHeadAttention::forward`] for autoregressive inference, burn-nn's calling
    /// convention: each call passes the whole sequence so far and gets the context of every
    /// position. Only the positions the cache has not seen are computed: their projections are
    /// appended to `cache` (in place), and their query rows attend to every cached key.
    /// Earlier positions' contexts come from the cache (as in burn-nn, which caches the output
    /// projection). With a cross-attention cache
    /// ([`MhaCache::autoregressive_cross_attention`]) the keys and values are computed once,
    /// from the first call's `key` and `value`.
    pub fn forward_cache(&self, input: MhaInput<B>, cache: &mut MhaCache<B>) -> MhaOutput<B> {
        let (_, seq_q, seq_k) = self.check(&input);
        let start = cache.output.len();
        assert!(
            seq_q >= start,
            "{WHO}: the input has {seq_q} positions, the cache already holds {start} (a new sequence needs a new cache)"
        );
        if seq_q == start && start > 0 {
            return MhaOutput {
                context: cache.output.view(),
            };
        }
        if let Some(keep) = cache.window {
            match input.window {
                Some((left, _)) if left <= keep => {}
                _ => panic!(
                    "{WHO}: a sliding-window cache keeps the last {keep} keys: the input's window must be set, its left side at most {keep} (got {:?})",
                    input.window
                ),
            }
        }
        let done = cache.keys.seen();
        let (k_new, v_new) = if cache.cross {
            (input.key, input.value)
        } else {
            assert!(
                seq_k >= done,
                "{WHO}: the keys have {seq_k} positions, the cache already holds {done}"
            );
            (rows(input.key, done..seq_k), rows(input.value, done..seq_k))
        };
        let context = self.cached_rows(
            rows(input.query, start..seq_q),
            k_new,
            v_new,
            (input.mask_pad, input.mask_attn, input.causal),
            input.window,
            start..seq_q,
            cache,
        );
        MhaOutput {
            context: cache.output.append(context),
        }
    }

    /// The context of query rows `rows` (of `seq_q = rows.end` positions) given their inputs
    /// `query` `[B, n, d_model]`: the keys' and values' inputs `key`, `value` (the positions the
    /// cache has not seen; with a cross-attention cache, all of them, read at the first call)
    /// are projected and appended, and the rows attend to everything cached. The cache's
    /// output rows are left alone: the transformers' caches keep their own.
    pub(crate) fn cached_rows(
        &self,
        query: Tensor<B, 3>,
        key: Tensor<B, 3>,
        value: Tensor<B, 3>,
        (mask_pad, mask_attn, causal): MaskArgs<B>,
        window: Option<(usize, usize)>,
        rows: std::ops::Range<usize>,
        cache: &mut MhaCache<B>,
    ) -> Tensor<B, 3> {
        let batch = query.dims()[0];
        let q = project_heads(&self.query, query, self.n_heads);
        let (k, v) = if cache.cross {
            if cache.keys.is_empty() {
                let (k, v) = self.keys_values(key, value);
                cache.keys.append(k);
                cache.values.append(v);
            }
            (cache.keys.view(), cache.values.view())
        } else {
            let (k, v) = self.keys_values(key, value);
            (cache.keys.append(k), cache.values.append(v))
        };
        // A sliding-window cache holds the last keys only: the masks' columns of the
        // forgotten ones are dropped (bottom-right alignment keeps the rows' windows).
        let forgotten = cache.keys.forgotten();
        let seq_k = k.dims()[2] + forgotten;
        let seq_q = rows.end;
        let mut mask = attention_mask(WHO, mask_pad, mask_attn, batch, rows, seq_q, seq_k);
        if forgotten > 0 {
            mask = mask.map(|m| {
                let [b, h, r, _] = m.dims();
                m.slice([0..b, 0..h, 0..r, forgotten..seq_k])
            });
        }
        let context = self.attend(q, k, v, mask, causal, window);
        if let Some(keep) = cache.window {
            cache.keys.forget_before(keep);
            cache.values.forget_before(keep);
        }
        self.output.forward(merge_heads(context))
    }

    /// The attention weights `[B, H, Sq, Sk]` burn-nn's `MhaOutput.weights` holds: the softmax
    /// of the masked scores, from stock ops (it writes `Sq × Sk` per head; no dropout). For
    /// inspection: [`MultiHeadAttention::forward`] never makes them.
    pub fn attention_weights(&self, mut input: MhaInput<B>) -> Tensor<B, 4> {
        let (mask, [batch, seq_q, seq_k]) = self.checked_mask(&mut input);
        let q = project_heads(&self.query, input.query, self.n_heads);
        let k = project_heads(&self.key, input.key, self.n_heads);
        let mut scores = q.matmul(k.transpose()).div_scalar((self.d_k as f32).sqrt());
        let full = [batch, self.n_heads, seq_q, seq_k];
        if let Some(mask) = mask {
            scores = scores.mask_fill(mask.expand(full), self.min_float);
        }
        if input.causal {
            let causal = crate::attention::composed::causal_mask::<B>(full, &scores.device());
            scores = scores.mask_fill(causal, f32::NEG_INFINITY);
        }
        match self.quiet_softmax {
            true => activation::quiet_softmax(scores, 3),
            false => activation::softmax(scores, 3),
        }
    }

    /// The keys and values of the inputs `key` and `value`, `[B, H, Sk, d_k]` each.
    fn keys_values(&self, key: Tensor<B, 3>, value: Tensor<B, 3>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        (
            project_heads(&self.key, key, self.n_heads),
            project_heads(&self.value, value, self.n_heads),
        )
    }

    /// `softmax(Q·Kᵀ/√d_k)·V` per head, `[B, H, Sq, d_k]`.
    fn attend(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        mask: Option<Tensor<B, 4, Bool>>,
        causal: bool,
        window: Option<(usize, usize)>,
    ) -> Tensor<B, 4> {
        let options = module_options::<B>(
            self.d_k,
            self.min_float,
            self.quiet_softmax,
            causal,
            self.dropout.prob,
            &q.device(),
        );
        let options = crate::FlashAttentionOptions { window, ..options };
        crate::attention_with_lse(q, k, v, mask, None, options).0
    }

    /// Checks `input`'s shapes and takes its masks, as one mask of every query row
    /// ([`attention_mask`]); returns it and `[B, Sq, Sk]`.
    fn checked_mask(&self, input: &mut MhaInput<B>) -> (Option<Tensor<B, 4, Bool>>, [usize; 3]) {
        let (batch, seq_q, seq_k) = self.check(input);
        let (pad, attn) = (input.mask_pad.take(), input.mask_attn.take());
        let mask = attention_mask(WHO, pad, attn, batch, 0..seq_q, seq_q, seq_k);
        (mask, [batch, seq_q, seq_k])
    }

    /// Checks the input's shapes; returns `(B, Sq, Sk)`.
    fn check(&self, input: &MhaInput<B>) -> (usize, usize, usize) {
        let [batch, seq_q, dq] = input.query.dims();
        let [kb, seq_k, dk] = input.key.dims();
        let [vb, seq_v, dv] = input.value.dims();
        for (name, width) in [("query", dq), ("key", dk), ("value", dv)] {
            if width != self.d_model {
                panic!(
                    "{WHO}: `{name}` has width {width}, d_model is {}",
                    self.d_model
                );
            }
        }
        if kb != batch || vb != batch {
            panic!("{WHO}: batches differ: query {batch}, key {kb}, value {vb}");
        }
        if seq_v != seq_k {
            panic!("{WHO}: `key` has {seq_k} positions, `value` {seq_v}");
        }
        (batch, seq_q, seq_k)
    }
}

/// The autoregressive cache of [`MultiHeadAttention::forward_cache`]: burn-nn's `MhaCache`, with
/// keys and values in buffers that grow in place ([`KvCache`]).
#[derive(Debug)]
pub struct MhaCache<B: Backend> {
    pub(crate) keys: KvCache<B>,
    pub(crate) values: KvCache<B>,
    pub(crate) output: RowCache<B>,
    /// Keys and values computed once (cross-attention) rather than per position.
    pub(crate) cross: bool,
    /// A sliding-window cache: the keys kept for windows reaching this far back.
    pub(crate) window: Option<usize>,
}

impl<B: Backend> MhaCache<B> {
    /// The cache of self-attention: keys and values grow with the sequence.
    pub fn autoregressive() -> Self {
        Self::autoregressive_with_capacity(0)
    }

    /// [`MhaCache::autoregressive`] with room for `positions` allocated at the first call.
    pub fn autoregressive_with_capacity(positions: usize) -> Self {
        Self {
            keys: KvCache::with_capacity(positions),
            values: KvCache::with_capacity(positions),
            output: RowCache::with_capacity(positions),
            cross: false,
            window: None,
        }
    }

    /// The rolling cache of a sliding-window model whose windows reach `left` keys back
    /// ([`MhaInput::window`]`(left′, _)` with `left′ ≤ left`): keys and values older than that
    /// are dropped (at least the last `left`, at most `2·left` plus a step's are held), so
    /// memory stays bounded however long the sequence. The context rows are still kept (the
    /// calling convention returns every position's).
    pub fn sliding_window(left: usize) -> Self {
        Self {
            window: Some(left),
            ..Self::autoregressive()
        }
    }

    /// The cache of cross-attention: keys and values computed once, from the first call's.
    pub fn autoregressive_cross_attention() -> Self {
        Self {
            keys: KvCache::new(),
            values: KvCache::new(),
            output: RowCache::new(),
            cross: true,
            window: None,
        }
    }

    /// Positions whose context the cache holds.
    pub fn len(&self) -> usize {
        self.output.len()
    }

    /// Positions of keys (and values) held: every one seen, but for a sliding-window cache
    /// ([`MhaCache::sliding_window`]), which forgets the old ones.
    pub fn keys_held(&self) -> usize {
        self.keys.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.output.is_empty()
    }
}
