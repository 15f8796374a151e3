//! [`TransformerEncoder`] and [`TransformerDecoder`]: burn-nn 0.21's transformer, layer for
//! layer (norms, `norm_first`, residual order, dropout, position-wise feed-forward and records),
//! with [`MultiHeadAttention`] from this crate.

use burn::config::Config;
use burn::module::{Content, DisplaySettings, Initializer, Module, ModuleDisplay};
use burn::nn::activation::ActivationConfig;
use burn::nn::transformer::{PositionWiseFeedForward, PositionWiseFeedForwardConfig};
use burn::nn::{Dropout, DropoutConfig, LayerNorm, LayerNormConfig};
use burn::tensor::{Bool, Tensor, backend::Backend};

use super::cache::RowCache;
use super::mha::{
    MaskArgs, MhaCache, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, rows,
};
use crate::FlashBackend;

/// The configuration of a [`TransformerEncoder`]: burn-nn's `TransformerEncoderConfig`, field
/// for field, with its defaults.
#[derive(Config, Debug)]
pub struct TransformerEncoderConfig {
    /// The size of the model.
    pub d_model: usize,
    /// The size of the position-wise feed-forward network.
    pub d_ff: usize,
    /// The number of attention heads.
    pub n_heads: usize,
    /// The number of layers.
    pub n_layers: usize,
    /// The dropout rate (attention weights, residual paths, feed-forward).
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Layer norm before each sub-layer (pre-LN) instead of after the residual (post-LN).
    #[config(default = false)]
    pub norm_first: bool,
    /// Quiet softmax in the attention.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// The initializer of the linear layers.
    #[config(default = "Initializer::KaimingUniform{gain:0.5773502691896258, fan_out_only:false}")]
    pub initializer: Initializer,
    /// The feed-forward activation.
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
    /// The epsilon of the layer norms.
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
}

/// The configuration of a [`TransformerDecoder`]: burn-nn's `TransformerDecoderConfig`, field
/// for field, with its defaults.
#[derive(Config, Debug)]
pub struct TransformerDecoderConfig {
    /// The size of the model.
    pub d_model: usize,
    /// The size of the position-wise feed-forward network.
    pub d_ff: usize,
    /// The number of attention heads.
    pub n_heads: usize,
    /// The number of layers.
    pub n_layers: usize,
    /// The dropout rate (attention weights, residual paths, feed-forward).
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Layer norm before each sub-layer (pre-LN) instead of after the residual (post-LN).
    #[config(default = false)]
    pub norm_first: bool,
    /// Quiet softmax in the attention.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// The initializer of the linear layers.
    #[config(default = "Initializer::KaimingUniform{gain:0.5773502691896258, fan_out_only:false}")]
    pub initializer: Initializer,
    /// The feed-forward activation.
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
    /// The epsilon of the layer norms.
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
}

/// The parts of one layer, built alike for both stacks.
struct LayerParts<B: Backend> {
    mha: MultiHeadAttention<B>,
    pwff: PositionWiseFeedForward<B>,
    norm: LayerNorm<B>,
    dropout: Dropout,
}

#[allow(clippy::too_many_arguments)]
fn attention<B: Backend>(
    d_model: usize,
    n_heads: usize,
    dropout: f64,
    quiet: bool,
    initializer: &Initializer,
    device: &B::Device,
) -> MultiHeadAttention<B> {
    MultiHeadAttentionConfig::new(d_model, n_heads)
        .with_initializer(initializer.clone())
        .with_dropout(dropout)
        .with_quiet_softmax(quiet)
        .init(device)
}

#[allow(clippy::too_many_arguments)]
fn layer_parts<B: Backend>(
    d_model: usize,
    d_ff: usize,
    n_heads: usize,
    dropout: f64,
    quiet: bool,
    initializer: &Initializer,
    activation: &ActivationConfig,
    eps: f64,
    device: &B::Device,
) -> LayerParts<B> {
    LayerParts {
        mha: attention(d_model, n_heads, dropout, quiet, initializer, device),
        pwff: PositionWiseFeedForwardConfig::new(d_model, d_ff)
            .with_initializer(initializer.clone())
            .with_dropout(dropout)
            .with_activation(activation.clone())
            .init(device),
        norm: LayerNormConfig::new(d_model).with_epsilon(eps).init(device),
        dropout: DropoutConfig::new(dropout).init(),
    }
}

/// burn-nn's sub-layer step: `x + dropout(f(norm(x)))` with `norm_first`, else
/// `norm(x + dropout(f(x)))`. `norm` and `f` take the whole sequence (a cache computes only its
/// new rows).
fn sublayer<B: Backend>(
    x: Tensor<B, 3>,
    norm_first: bool,
    dropout: &Dropout,
    mut norm: impl FnMut(Tensor<B, 3>) -> Tensor<B, 3>,
    f: impl FnOnce(Tensor<B, 3>) -> Tensor<B, 3>,
) -> Tensor<B, 3> {
    if norm_first {
        let y = f(norm(x.clone()));
        x + dropout.forward(y)
    } else {
        let y = f(x.clone());
        norm(x + dropout.forward(y))
    }
}

// ---------------------------------------------------------------------------------------------
// Encoder

/// A stack of [`TransformerEncoderLayer`]s: burn-nn's `TransformerEncoder` (the same fields and
/// record) on [`MultiHeadAttention`].
#[derive(Module, Debug)]
#[module(custom_display)]
pub struct TransformerEncoder<B: Backend> {
    /// The layers.
    pub layers: Vec<TransformerEncoderLayer<B>>,
    /// The size of the model.
    pub d_model: usize,
    /// The size of the feed-forward network.
    pub d_ff: usize,
    /// The number of heads.
    pub n_heads: usize,
    /// The number of layers.
    pub n_layers: usize,
    /// The dropout rate.
    pub dropout: f64,
    /// Pre-LN.
    pub norm_first: bool,
    /// Quiet softmax.
    pub quiet_softmax: bool,
}

impl<B: Backend> ModuleDisplay for TransformerEncoder<B> {
    fn custom_settings(&self) -> Option<DisplaySettings> {
        DisplaySettings::new()
            .with_new_line_after_attribute(false)
            .optional()
    }

    fn custom_content(&self, content: Content) -> Option<Content> {
        content
            .add("d_model", &self.d_model)
            .add("d_ff", &self.d_ff)
            .add("n_heads", &self.n_heads)
            .add("n_layers", &self.n_layers)
            .add("dropout", &self.dropout)
            .add("norm_first", &self.norm_first)
            .add("quiet_softmax", &self.quiet_softmax)
            .optional()
    }
}

/// One encoder layer: self-attention and feed-forward sub-layers (burn-nn's
/// `TransformerEncoderLayer`).
#[derive(Module, Debug)]
pub struct TransformerEncoderLayer<B: Backend> {
    /// Self-attention.
    pub mha: MultiHeadAttention<B>,
    /// Position-wise feed-forward.
    pub pwff: PositionWiseFeedForward<B>,
    /// The norm of the feed-forward sub-layer's input (pre-LN) or the attention's residual.
    pub norm_1: LayerNorm<B>,
    /// The norm of the attention's input (pre-LN) or the feed-forward's residual.
    pub norm_2: LayerNorm<B>,
    /// Dropout of both residual paths.
    pub dropout: Dropout,
    /// Pre-LN.
    pub norm_first: bool,
}

/// The input of [`TransformerEncoder`]: burn-nn's `TransformerEncoderInput`, plus
/// [`TransformerEncoderInput::causal`].
#[derive(Debug)]
pub struct TransformerEncoderInput<B: Backend> {
    tensor: Tensor<B, 3>,
    mask_pad: Option<Tensor<B, 2, Bool>>,
    mask_attn: Option<Tensor<B, 3, Bool>>,
    causal: bool,
}

impl<B: Backend> TransformerEncoderInput<B> {
    /// The sequence `[B, S, d_model]`.
    pub fn new(tensor: Tensor<B, 3>) -> Self {
        Self {
            tensor,
            mask_pad: None,
            mask_attn: None,
            causal: false,
        }
    }

    /// Padding mask `[B, S]`, `true` = masked.
    pub fn mask_pad(mut self, mask_pad: Tensor<B, 2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// Attention mask `[B, S, S]`, `true` = masked.
    pub fn mask_attn(mut self, mask_attn: Tensor<B, 3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }

    /// Causal self-attention without a mask tensor ([`MhaInput::causal`]): what
    /// `mask_attn(generate_autoregressive_mask(..))` asks for, reading no `[B, S, S]` mask.
    pub fn causal(mut self) -> Self {
        self.causal = true;
        self
    }
}

impl TransformerEncoderConfig {
    /// An encoder with burn-nn's initialisation.
    pub fn init<B: Backend>(&self, device: &B::Device) -> TransformerEncoder<B> {
        let layers = (0..self.n_layers)
            .map(|_| {
                let parts = |d| {
                    layer_parts::<B>(
                        self.d_model,
                        self.d_ff,
                        self.n_heads,
                        self.dropout,
                        self.quiet_softmax,
                        &self.initializer,
                        &self.activation,
                        self.layer_norm_eps,
                        d,
                    )
                };
                let a = parts(device);
                let norm_2 = LayerNormConfig::new(self.d_model)
                    .with_epsilon(self.layer_norm_eps)
                    .init(device);
                TransformerEncoderLayer {
                    mha: a.mha,
                    pwff: a.pwff,
                    norm_1: a.norm,
                    norm_2,
                    dropout: a.dropout,
                    norm_first: self.norm_first,
                }
            })
            .collect();
        TransformerEncoder {
            layers,
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            dropout: self.dropout,
            norm_first: self.norm_first,
            quiet_softmax: self.quiet_softmax,
        }
    }
}

impl<B: FlashBackend> TransformerEncoderLayer<B> {
    /// The layer on the whole sequence.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        mask_pad: Option<Tensor<B, 2, Bool>>,
        mask_attn: Option<Tensor<B, 3, Bool>>,
        causal: bool,
    ) -> Tensor<B, 3> {
        let attend = |h: Tensor<B, 3>| {
            let input = mha_input(MhaInput::self_attn(h), mask_pad, mask_attn, causal);
            self.mha.forward(input).context
        };
        let x = sublayer(
            x,
            self.norm_first,
            &self.dropout,
            |t| match self.norm_first {
                true => self.norm_2.forward(t),
                false => self.norm_1.forward(t),
            },
            attend,
        );
        sublayer(
            x,
            self.norm_first,
            &self.dropout,
            |t| match self.norm_first {
                true => self.norm_1.forward(t),
                false => self.norm_2.forward(t),
            },
            |h| self.pwff.forward(h),
        )
    }

    /// [`TransformerEncoderLayer::forward`] for autoregressive inference (burn-nn's calling
    /// convention: `x` is the whole sequence so far, every position's output comes back; only
    /// the positions `cache` has not seen are computed).
    pub fn forward_autoregressive_inference(
        &self,
        x: Tensor<B, 3>,
        mask_pad: Option<Tensor<B, 2, Bool>>,
        mask_attn: Option<Tensor<B, 3, Bool>>,
        causal: bool,
        cache: &mut TransformerEncoderLayerAutoregressiveCache<B>,
    ) -> Tensor<B, 3> {
        let seq = x.dims()[1];
        let start = cache.output.len();
        assert!(
            seq >= start,
            "TransformerEncoderLayer: the input has {seq} positions, the cache already holds {start}"
        );
        if seq == start {
            return cache.output.view();
        }
        let out = self.new_rows(
            rows(x, start, seq),
            (mask_pad, mask_attn, causal),
            start..seq,
            &mut cache.mha,
        );
        cache.output.append(out)
    }

    /// The layer's output for the rows `positions` of the sequence (inputs `x`, `[B, n, d]`):
    /// every sub-layer but attention works row by row, and attention reads the earlier
    /// positions' keys and values from `cache`.
    fn new_rows(
        &self,
        x: Tensor<B, 3>,
        masks: MaskArgs<B>,
        positions: std::ops::Range<usize>,
        cache: &mut MhaCache<B>,
    ) -> Tensor<B, 3> {
        let (first, second) = match self.norm_first {
            true => (&self.norm_2, &self.norm_1),
            false => (&self.norm_1, &self.norm_2),
        };
        let x = sublayer(
            x,
            self.norm_first,
            &self.dropout,
            |t| first.forward(t),
            |h| {
                self.mha
                    .cached_rows(h.clone(), h.clone(), h, masks, positions, cache)
            },
        );
        sublayer(
            x,
            self.norm_first,
            &self.dropout,
            |t| second.forward(t),
            |h| self.pwff.forward(h),
        )
    }
}

impl<B: FlashBackend> TransformerEncoder<B> {
    /// The encoder on the whole sequence: `[B, S, d_model]`.
    pub fn forward(&self, input: TransformerEncoderInput<B>) -> Tensor<B, 3> {
        let mut x = input.tensor;
        for layer in &self.layers {
            x = layer.forward(
                x,
                input.mask_pad.clone(),
                input.mask_attn.clone(),
                input.causal,
            );
        }
        x
    }

    /// The encoder for autoregressive inference (burn-nn's calling convention: each call passes
    /// the whole sequence so far and gets every position's output). Only the positions `cache`
    /// has not seen go through the layers; each attends to the keys and values cached for the
    /// earlier ones, and the earlier outputs come from the cache.
    pub fn forward_autoregressive_inference(
        &self,
        input: TransformerEncoderInput<B>,
        cache: &mut TransformerEncoderAutoregressiveCache<B>,
    ) -> Tensor<B, 3> {
        let seq = input.tensor.dims()[1];
        let start = cache.output.len();
        assert!(
            seq >= start,
            "TransformerEncoder: the input has {seq} positions, the cache already holds {start} (a new sequence needs a new cache)"
        );
        if seq == start {
            return cache.output.view();
        }
        let mut x = rows(input.tensor, start, seq);
        for (layer, c) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let masks = (
                input.mask_pad.clone(),
                input.mask_attn.clone(),
                input.causal,
            );
            x = layer.new_rows(x, masks, start..seq, &mut c.mha);
        }
        cache.output.append(x)
    }

    /// An empty cache for [`TransformerEncoder::forward_autoregressive_inference`].
    pub fn new_autoregressive_cache(&self) -> TransformerEncoderAutoregressiveCache<B> {
        TransformerEncoderAutoregressiveCache {
            layers: self
                .layers
                .iter()
                .map(|_| TransformerEncoderLayerAutoregressiveCache::empty())
                .collect(),
            output: RowCache::new(),
        }
    }
}

/// The cache of one encoder layer: its attention's keys and values (and, for the layer's own
/// [`TransformerEncoderLayer::forward_autoregressive_inference`], its outputs).
#[derive(Debug)]
pub struct TransformerEncoderLayerAutoregressiveCache<B: Backend> {
    mha: MhaCache<B>,
    output: RowCache<B>,
}

impl<B: Backend> TransformerEncoderLayerAutoregressiveCache<B> {
    /// An empty cache.
    pub fn empty() -> Self {
        Self {
            mha: MhaCache::autoregressive(),
            output: RowCache::new(),
        }
    }
}

/// The autoregressive cache of a [`TransformerEncoder`]: each layer's keys and values, and the
/// encoder's outputs.
#[derive(Debug)]
pub struct TransformerEncoderAutoregressiveCache<B: Backend> {
    layers: Vec<TransformerEncoderLayerAutoregressiveCache<B>>,
    output: RowCache<B>,
}

fn mha_input<B: Backend>(
    input: MhaInput<B>,
    mask_pad: Option<Tensor<B, 2, Bool>>,
    mask_attn: Option<Tensor<B, 3, Bool>>,
    causal: bool,
) -> MhaInput<B> {
    let mut input = input;
    if let Some(m) = mask_pad {
        input = input.mask_pad(m);
    }
    if let Some(m) = mask_attn {
        input = input.mask_attn(m);
    }
    if causal {
        input = input.causal();
    }
    input
}

// ---------------------------------------------------------------------------------------------
// Decoder

/// A stack of [`TransformerDecoderLayer`]s: burn-nn's `TransformerDecoder` (the same fields and
/// record) on [`MultiHeadAttention`].
#[derive(Module, Debug)]
#[module(custom_display)]
pub struct TransformerDecoder<B: Backend> {
    /// The layers.
    pub layers: Vec<TransformerDecoderLayer<B>>,
    /// The size of the model.
    pub d_model: usize,
    /// The size of the feed-forward network.
    pub d_ff: usize,
    /// The number of heads.
    pub n_heads: usize,
    /// The number of layers.
    pub n_layers: usize,
    /// The dropout rate.
    pub dropout: f64,
    /// Pre-LN.
    pub norm_first: bool,
    /// Quiet softmax.
    pub quiet_softmax: bool,
}

impl<B: Backend> ModuleDisplay for TransformerDecoder<B> {
    fn custom_settings(&self) -> Option<DisplaySettings> {
        DisplaySettings::new()
            .with_new_line_after_attribute(false)
            .optional()
    }

    fn custom_content(&self, content: Content) -> Option<Content> {
        content
            .add("d_model", &self.d_model)
            .add("d_ff", &self.d_ff)
            .add("n_heads", &self.n_heads)
            .add("n_layers", &self.n_layers)
            .add("dropout", &self.dropout)
            .add("norm_first", &self.norm_first)
            .add("quiet_softmax", &self.quiet_softmax)
            .optional()
    }
}

/// One decoder layer: self-attention, cross-attention to the memory, feed-forward (burn-nn's
/// `TransformerDecoderLayer`).
#[derive(Module, Debug)]
pub struct TransformerDecoderLayer<B: Backend> {
    /// Attention to the memory.
    pub cross_attn: MultiHeadAttention<B>,
    /// Self-attention.
    pub self_attn: MultiHeadAttention<B>,
    /// Position-wise feed-forward.
    pub pwff: PositionWiseFeedForward<B>,
    /// Norm of the cross-attention sub-layer (pre-LN input, or post-LN of self-attention).
    pub norm_1: LayerNorm<B>,
    /// Norm of the feed-forward sub-layer (pre-LN input, or post-LN of cross-attention).
    pub norm_2: LayerNorm<B>,
    /// Norm of the self-attention sub-layer (pre-LN input, or post-LN of feed-forward).
    pub norm_3: LayerNorm<B>,
    /// Dropout of the residual paths.
    pub dropout: Dropout,
    /// Pre-LN.
    pub norm_first: bool,
}

/// The input of [`TransformerDecoder`]: burn-nn's `TransformerDecoderInput`, plus
/// [`TransformerDecoderInput::target_causal`].
#[derive(Debug)]
pub struct TransformerDecoderInput<B: Backend> {
    target: Tensor<B, 3>,
    target_mask_pad: Option<Tensor<B, 2, Bool>>,
    target_mask_attn: Option<Tensor<B, 3, Bool>>,
    target_causal: bool,
    memory: Tensor<B, 3>,
    memory_mask_pad: Option<Tensor<B, 2, Bool>>,
    memory_mask_attn: Option<Tensor<B, 3, Bool>>,
}

impl<B: Backend> TransformerDecoderInput<B> {
    /// The target sequence `[B, St, d_model]` and the memory `[B, Sm, d_model]`.
    pub fn new(target: Tensor<B, 3>, memory: Tensor<B, 3>) -> Self {
        Self {
            target,
            target_mask_pad: None,
            target_mask_attn: None,
            target_causal: false,
            memory,
            memory_mask_pad: None,
            memory_mask_attn: None,
        }
    }

    /// Padding mask of the memory `[B, Sm]`.
    pub fn memory_mask_pad(mut self, mask_pad: Tensor<B, 2, Bool>) -> Self {
        self.memory_mask_pad = Some(mask_pad);
        self
    }

    /// Attention mask of the memory `[B, St, Sm]`.
    pub fn memory_mask_attn(mut self, mask_attn: Tensor<B, 3, Bool>) -> Self {
        self.memory_mask_attn = Some(mask_attn);
        self
    }

    /// Padding mask of the target `[B, St]`.
    pub fn target_mask_pad(mut self, mask_pad: Tensor<B, 2, Bool>) -> Self {
        self.target_mask_pad = Some(mask_pad);
        self
    }

    /// Attention mask of the target `[B, St, St]`.
    pub fn target_mask_attn(mut self, mask_attn: Tensor<B, 3, Bool>) -> Self {
        self.target_mask_attn = Some(mask_attn);
        self
    }

    /// Causal self-attention of the target without a mask tensor ([`MhaInput::causal`]).
    pub fn target_causal(mut self) -> Self {
        self.target_causal = true;
        self
    }
}

impl TransformerDecoderConfig {
    /// A decoder with burn-nn's initialisation.
    pub fn init<B: Backend>(&self, device: &B::Device) -> TransformerDecoder<B> {
        let layers = (0..self.n_layers)
            .map(|_| {
                let self_attn = attention(
                    self.d_model,
                    self.n_heads,
                    self.dropout,
                    self.quiet_softmax,
                    &self.initializer,
                    device,
                );
                let rest = layer_parts::<B>(
                    self.d_model,
                    self.d_ff,
                    self.n_heads,
                    self.dropout,
                    self.quiet_softmax,
                    &self.initializer,
                    &self.activation,
                    self.layer_norm_eps,
                    device,
                );
                let norm = || {
                    LayerNormConfig::new(self.d_model)
                        .with_epsilon(self.layer_norm_eps)
                        .init(device)
                };
                TransformerDecoderLayer {
                    cross_attn: rest.mha,
                    self_attn,
                    pwff: rest.pwff,
                    norm_1: rest.norm,
                    norm_2: norm(),
                    norm_3: norm(),
                    dropout: rest.dropout,
                    norm_first: self.norm_first,
                }
            })
            .collect();
        TransformerDecoder {
            layers,
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            dropout: self.dropout,
            norm_first: self.norm_first,
            quiet_softmax: self.quiet_softmax,
        }
    }
}

/// The cache of one decoder layer: its self-attention's keys and values, the memory's keys
/// and values (computed once), and, for the layer's own
/// [`TransformerDecoderLayer::forward_autoregressive_inference`], its outputs.
#[derive(Debug)]
pub struct TransformerDecoderLayerAutoregressiveCache<B: Backend> {
    cross_attn: MhaCache<B>,
    self_attn: MhaCache<B>,
    output: RowCache<B>,
}

impl<B: Backend> TransformerDecoderLayerAutoregressiveCache<B> {
    /// An empty cache.
    pub fn empty() -> Self {
        Self {
            cross_attn: MhaCache::autoregressive_cross_attention(),
            self_attn: MhaCache::autoregressive(),
            output: RowCache::new(),
        }
    }
}

/// The autoregressive cache of a [`TransformerDecoder`]: each layer's caches and the decoder's
/// outputs.
#[derive(Debug)]
pub struct TransformerDecoderAutoregressiveCache<B: Backend> {
    layers: Vec<TransformerDecoderLayerAutoregressiveCache<B>>,
    output: RowCache<B>,
}

impl<B: FlashBackend> TransformerDecoderLayer<B> {
    /// The layer on the whole target sequence; returns the new target.
    pub fn forward(&self, input: &TransformerDecoderInput<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let nf = self.norm_first;
        // Norms by role: pre-LN inputs of self-attention / cross-attention / feed-forward are
        // norm_3 / norm_1 / norm_2; post-LN outputs are norm_1 / norm_2 / norm_3.
        let (n_self, n_cross, n_ff) = match nf {
            true => (&self.norm_3, &self.norm_1, &self.norm_2),
            false => (&self.norm_1, &self.norm_2, &self.norm_3),
        };
        let x = sublayer(
            x,
            nf,
            &self.dropout,
            |t| n_self.forward(t),
            |h| {
                let i = mha_input(
                    MhaInput::self_attn(h),
                    input.target_mask_pad.clone(),
                    input.target_mask_attn.clone(),
                    input.target_causal,
                );
                self.self_attn.forward(i).context
            },
        );
        let x = sublayer(
            x,
            nf,
            &self.dropout,
            |t| n_cross.forward(t),
            |h| {
                let i = mha_input(
                    MhaInput::new(h, input.memory.clone(), input.memory.clone()),
                    input.memory_mask_pad.clone(),
                    input.memory_mask_attn.clone(),
                    false,
                );
                self.cross_attn.forward(i).context
            },
        );
        sublayer(
            x,
            nf,
            &self.dropout,
            |t| n_ff.forward(t),
            |h| self.pwff.forward(h),
        )
    }

    /// [`TransformerDecoderLayer::forward`] for autoregressive inference (burn-nn's calling
    /// convention: `x` is the whole target so far; only the positions `cache` has not seen are
    /// computed).
    pub fn forward_autoregressive_inference(
        &self,
        input: &TransformerDecoderInput<B>,
        x: Tensor<B, 3>,
        cache: &mut TransformerDecoderLayerAutoregressiveCache<B>,
    ) -> Tensor<B, 3> {
        let seq = x.dims()[1];
        let start = cache.output.len();
        assert!(
            seq >= start,
            "TransformerDecoderLayer: the target has {seq} positions, the cache already holds {start}"
        );
        if seq == start {
            return cache.output.view();
        }
        let out = self.new_rows(
            input,
            rows(x, start, seq),
            start..seq,
            &mut cache.self_attn,
            &mut cache.cross_attn,
        );
        cache.output.append(out)
    }

    /// The layer's output for the target rows `positions` (inputs `x`, `[B, n, d]`).
    fn new_rows(
        &self,
        input: &TransformerDecoderInput<B>,
        x: Tensor<B, 3>,
        positions: std::ops::Range<usize>,
        self_cache: &mut MhaCache<B>,
        cross_cache: &mut MhaCache<B>,
    ) -> Tensor<B, 3> {
        let nf = self.norm_first;
        let (n_self, n_cross, n_ff) = match nf {
            true => (&self.norm_3, &self.norm_1, &self.norm_2),
            false => (&self.norm_1, &self.norm_2, &self.norm_3),
        };
        let x = sublayer(
            x,
            nf,
            &self.dropout,
            |t| n_self.forward(t),
            |h| {
                let masks = (
                    input.target_mask_pad.clone(),
                    input.target_mask_attn.clone(),
                    input.target_causal,
                );
                self.self_attn.cached_rows(
                    h.clone(),
                    h.clone(),
                    h,
                    masks,
                    positions.clone(),
                    self_cache,
                )
            },
        );
        let x = sublayer(
            x,
            nf,
            &self.dropout,
            |t| n_cross.forward(t),
            |h| {
                let masks = (
                    input.memory_mask_pad.clone(),
                    input.memory_mask_attn.clone(),
                    false,
                );
                let memory = input.memory.clone();
                self.cross_attn.cached_rows(
                    h,
                    memory.clone(),
                    memory,
                    masks,
                    positions,
                    cross_cache,
                )
            },
        );
        sublayer(
            x,
            nf,
            &self.dropout,
            |t| n_ff.forward(t),
            |h| self.pwff.forward(h),
        )
    }
}

impl<B: FlashBackend> TransformerDecoder<B> {
    /// The decoder on the whole target: `[B, St, d_model]`.
    pub fn forward(&self, input: TransformerDecoderInput<B>) -> Tensor<B, 3> {
        let mut x = input.target.clone();
        for layer in &self.layers {
            x = layer.forward(&input, x);
        }
        x
    }

    /// The decoder for autoregressive inference (burn-nn's calling convention: each call
    /// passes the whole target so far and gets every position's output). Only the positions
    /// `cache` has not seen go through the layers; the memory's keys and values are computed
    /// at the first call.
    pub fn forward_autoregressive_inference(
        &self,
        input: TransformerDecoderInput<B>,
        cache: &mut TransformerDecoderAutoregressiveCache<B>,
    ) -> Tensor<B, 3> {
        let seq = input.target.dims()[1];
        let start = cache.output.len();
        assert!(
            seq >= start,
            "TransformerDecoder: the target has {seq} positions, the cache already holds {start} (a new sequence needs a new cache)"
        );
        if seq == start {
            return cache.output.view();
        }
        let mut x = rows(input.target.clone(), start, seq);
        for (layer, c) in self.layers.iter().zip(cache.layers.iter_mut()) {
            x = layer.new_rows(&input, x, start..seq, &mut c.self_attn, &mut c.cross_attn);
        }
        cache.output.append(x)
    }

    /// An empty cache for [`TransformerDecoder::forward_autoregressive_inference`].
    pub fn new_autoregressive_cache(&self) -> TransformerDecoderAutoregressiveCache<B> {
        TransformerDecoderAutoregressiveCache {
            layers: self
                .layers
                .iter()
                .map(|_| TransformerDecoderLayerAutoregressiveCache::empty())
                .collect(),
            output: RowCache::new(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Conversions from burn-nn's modules (the same parameters, moved)

impl<B: Backend> From<burn::nn::transformer::TransformerEncoderLayer<B>>
    for TransformerEncoderLayer<B>
{
    fn from(l: burn::nn::transformer::TransformerEncoderLayer<B>) -> Self {
        Self {
            mha: l.mha.into(),
            pwff: l.pwff,
            norm_1: l.norm_1,
            norm_2: l.norm_2,
            dropout: l.dropout,
            norm_first: l.norm_first,
        }
    }
}

impl<B: Backend> From<burn::nn::transformer::TransformerEncoder<B>> for TransformerEncoder<B> {
    /// burn-nn's encoder with its parameters moved into this one.
    fn from(e: burn::nn::transformer::TransformerEncoder<B>) -> Self {
        Self {
            layers: e.layers.into_iter().map(Into::into).collect(),
            d_model: e.d_model,
            d_ff: e.d_ff,
            n_heads: e.n_heads,
            n_layers: e.n_layers,
            dropout: e.dropout,
            norm_first: e.norm_first,
            quiet_softmax: e.quiet_softmax,
        }
    }
}

impl<B: Backend> From<burn::nn::transformer::TransformerDecoderLayer<B>>
    for TransformerDecoderLayer<B>
{
    fn from(l: burn::nn::transformer::TransformerDecoderLayer<B>) -> Self {
        Self {
            cross_attn: l.cross_attn.into(),
            self_attn: l.self_attn.into(),
            pwff: l.pwff,
            norm_1: l.norm_1,
            norm_2: l.norm_2,
            norm_3: l.norm_3,
            dropout: l.dropout,
            norm_first: l.norm_first,
        }
    }
}

impl<B: Backend> From<burn::nn::transformer::TransformerDecoder<B>> for TransformerDecoder<B> {
    /// burn-nn's decoder with its parameters moved into this one.
    fn from(d: burn::nn::transformer::TransformerDecoder<B>) -> Self {
        Self {
            layers: d.layers.into_iter().map(Into::into).collect(),
            d_model: d.d_model,
            d_ff: d.d_ff,
            n_heads: d.n_heads,
            n_layers: d.n_layers,
            dropout: d.dropout,
            norm_first: d.norm_first,
            quiet_softmax: d.quiet_softmax,
        }
    }
}
