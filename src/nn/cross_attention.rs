//! [`CrossAttention`]: burn-nn 0.21's cross-attention (with grouped-query heads) on the fused
//! kernels.

use burn::config::Config;
use burn::module::{Initializer, Module};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::tensor::{Bool, Tensor, backend::Backend};

use super::{attention_mask, check_divides, merge_heads, module_options, project_heads};
use crate::FlashBackend;

const WHO: &str = "burn_flash::nn::CrossAttention";

/// The configuration of a [`CrossAttention`]: burn-nn's `CrossAttentionConfig`, field for
/// field, with its defaults.
#[derive(Config, Debug)]
pub struct CrossAttentionConfig {
    /// The width of the queries' input (and of the output).
    pub d_model: usize,
    /// The width of the context (keys' and values' input).
    pub d_context: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (divides `n_heads`; fewer is grouped-query attention).
    pub n_heads_kv: usize,
    /// The size of each head.
    pub d_head: usize,
    /// The dropout probability of the attention weights.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// The score a masked key takes.
    #[config(default = -1.0e4)]
    pub min_float: f64,
    /// Quiet softmax, `e^s / (1 + Σ e^s)`.
    #[config(default = false)]
    pub quiet_softmax: bool,
}

/// Cross-attention as burn-nn 0.21's `CrossAttention` (the same fields, so the same record),
/// computed by [`crate::attention()`]. With `n_heads_kv < n_heads` the kernel reads each
/// key/value head for its group of query heads: nothing is repeated in memory (burn-nn
/// repeats them).
#[derive(Module, Debug)]
pub struct CrossAttention<B: Backend> {
    query: Linear<B>,
    key: Linear<B>,
    value: Linear<B>,
    output: Linear<B>,
    dropout: Dropout,
    n_heads: usize,
    n_heads_kv: usize,
    d_head: usize,
    scale: f64,
    min_float: f64,
    quiet_softmax: bool,
}

/// The keys and values of [`CrossAttention::forward_cache`], computed once from the first
/// call's context (burn-nn's `CrossAttentionCache`).
#[derive(Debug)]
pub struct CrossAttentionCache<B: Backend> {
    kv: Option<(Tensor<B, 4>, Tensor<B, 4>)>,
}

impl<B: Backend> CrossAttentionCache<B> {
    /// An empty cache.
    pub fn new() -> Self {
        Self { kv: None }
    }
}

impl<B: Backend> Default for CrossAttentionCache<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl CrossAttentionConfig {
    /// A module with burn-nn's initialisation (Kaiming uniform, gain `1/√d_head`). Panics when
    /// `n_heads_kv` does not divide `n_heads`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> CrossAttention<B> {
        check_divides(
            WHO,
            ("n_heads_kv", self.n_heads_kv),
            ("n_heads", self.n_heads),
        );
        let linear = |d_in, d_out| {
            LinearConfig::new(d_in, d_out)
                .with_initializer(Initializer::KaimingUniform {
                    gain: 1.0 / (self.d_head as f64).sqrt(),
                    fan_out_only: false,
                })
                .init(device)
        };
        CrossAttention {
            query: linear(self.d_model, self.n_heads * self.d_head),
            key: linear(self.d_context, self.n_heads_kv * self.d_head),
            value: linear(self.d_context, self.n_heads_kv * self.d_head),
            output: linear(self.n_heads * self.d_head, self.d_model),
            dropout: DropoutConfig::new(self.dropout).init(),
            n_heads: self.n_heads,
            n_heads_kv: self.n_heads_kv,
            d_head: self.d_head,
            scale: (self.d_head as f64).sqrt().recip(),
            min_float: self.min_float,
            quiet_softmax: self.quiet_softmax,
        }
    }
}

impl<B: FlashBackend> CrossAttention<B> {
    /// `query` `[B, Lq, d_model]` attending to `context` `[B, Lk, d_context]`, with an optional
    /// padding mask of the context `[B, Lk]` (`true` = masked): `[B, Lq, d_model]`.
    pub fn forward(
        &self,
        query: Tensor<B, 3>,
        context: Tensor<B, 3>,
        mask: Option<Tensor<B, 2, Bool>>,
    ) -> Tensor<B, 3> {
        self.check(&query, &context);
        let (k, v) = self.keys_values(context);
        self.attend(query, k, v, mask)
    }

    /// [`CrossAttention::forward`] with the context's keys and values computed at the first
    /// call and reused after (the context must not change while the cache lives).
    pub fn forward_cache(
        &self,
        query: Tensor<B, 3>,
        context: Tensor<B, 3>,
        mask: Option<Tensor<B, 2, Bool>>,
        cache: &mut CrossAttentionCache<B>,
    ) -> Tensor<B, 3> {
        self.check(&query, &context);
        let (k, v) = cache
            .kv
            .get_or_insert_with(|| self.keys_values(context))
            .clone();
        self.attend(query, k, v, mask)
    }

    /// The keys and values of `context`, `[B, n_heads_kv, Lk, d_head]` each.
    fn keys_values(&self, context: Tensor<B, 3>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let k = project_heads(&self.key, context.clone(), self.n_heads_kv);
        let v = project_heads(&self.value, context, self.n_heads_kv);
        (k, v)
    }

    fn attend(
        &self,
        query: Tensor<B, 3>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        mask: Option<Tensor<B, 2, Bool>>,
    ) -> Tensor<B, 3> {
        let [batch, seq_q, _] = query.dims();
        let seq_k = k.dims()[2];
        let q = project_heads(&self.query, query, self.n_heads);
        let mask = attention_mask(WHO, mask, None, batch, 0..seq_q, seq_q, seq_k);
        let mut options = module_options::<B>(
            self.d_head,
            self.min_float,
            self.quiet_softmax,
            false,
            self.dropout.prob,
            &q.device(),
        );
        options.module.scale = Some(self.scale);
        let out = crate::attention_with_lse(q, k, v, mask, None, options).0;
        self.output.forward(merge_heads(out))
    }

    fn check(&self, query: &Tensor<B, 3>, context: &Tensor<B, 3>) {
        let [bq, _, dq] = query.dims();
        let [bc, _, dc] = context.dims();
        let d_model = self.query.weight.dims()[0];
        let d_context = self.key.weight.dims()[0];
        if dq != d_model {
            panic!("{WHO}: `query` has width {dq}, d_model is {d_model}");
        }
        if dc != d_context {
            panic!("{WHO}: `context` has width {dc}, d_context is {d_context}");
        }
        if bq != bc {
            panic!("{WHO}: `query` has batch {bq}, `context` {bc}");
        }
    }
}
