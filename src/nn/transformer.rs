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
use super::mha::{MaskArgs, MhaCache, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use super::{display_settings, rows};
use crate::FlashBackend;

/// What the encoder and the decoder have alike, as burn-nn has them: the configuration (the
/// same fields and defaults), the stack of layers (the same fields besides the layers' type)
/// with its display and its conversion from burn-nn's, and the autoregressive cache (a cache
/// per layer and the stack's outputs).
macro_rules! stack {
    (
        $what:literal,
        $config:ident,
        $stack:ident,
        $layer:ident,
        $cache:ident,
        $layer_cache:ident $(,)?
    ) => {
        #[doc = concat!(
                                    "The configuration of a [`",
                                    stringify!($stack),
                                    "`]: burn-nn's `",
                                    stringify!($config),
                                    "`, field for field, with its defaults."
                                )]
        #[derive(Config, Debug)]
        pub struct $config {
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
            #[config(
                default = "Initializer::KaimingUniform{gain:0.5773502691896258, fan_out_only:false}"
            )]
            pub initializer: Initializer,
            /// The feed-forward activation.
            #[config(default = "ActivationConfig::Gelu")]
            pub activation: ActivationConfig,
            /// The epsilon of the layer norms.
            #[config(default = 1e-5)]
            pub layer_norm_eps: f64,
        }

        #[doc = concat!(
                                    "A stack of [`",
                                    stringify!($layer),
                                    "`]s: burn-nn's `",
                                    stringify!($stack),
                                    "` (the same fields and record) on [`MultiHeadAttention`]."
                                )]
        #[derive(Module, Debug)]
        #[module(custom_display)]
        pub struct $stack<B: Backend> {
            /// The layers.
            pub layers: Vec<$layer<B>>,
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

        impl<B: Backend> ModuleDisplay for $stack<B> {
            fn custom_settings(&self) -> Option<DisplaySettings> {
                display_settings()
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

        impl $config {
            /// An attention of a layer, with burn-nn's initialisation.
            fn attention<B: Backend>(&self, device: &B::Device) -> MultiHeadAttention<B> {
                MultiHeadAttentionConfig::new(self.d_model, self.n_heads)
                    .with_initializer(self.initializer.clone())
                    .with_dropout(self.dropout)
                    .with_quiet_softmax(self.quiet_softmax)
                    .init(device)
            }

            /// A layer norm.
            fn norm<B: Backend>(&self, device: &B::Device) -> LayerNorm<B> {
                LayerNormConfig::new(self.d_model)
                    .with_epsilon(self.layer_norm_eps)
                    .init(device)
            }

            /// The parts every layer has, made in burn-nn's order.
            fn layer_parts<B: Backend>(&self, device: &B::Device) -> LayerParts<B> {
                LayerParts {
                    mha: self.attention(device),
                    pwff: PositionWiseFeedForwardConfig::new(self.d_model, self.d_ff)
                        .with_initializer(self.initializer.clone())
                        .with_dropout(self.dropout)
                        .with_activation(self.activation.clone())
                        .init(device),
                    norm: self.norm(device),
                    dropout: DropoutConfig::new(self.dropout).init(),
                }
            }

            /// The stack of `layers` with this configuration's sizes.
            fn stack<B: Backend>(&self, layers: Vec<$layer<B>>) -> $stack<B> {
                $stack {
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

        impl<B: Backend> From<burn::nn::transformer::$stack<B>> for $stack<B> {
            #[doc = concat!("burn-nn's ", $what, " with its parameters moved into this one.")]
            fn from(s: burn::nn::transformer::$stack<B>) -> Self {
                Self {
                    layers: s.layers.into_iter().map(Into::into).collect(),
                    d_model: s.d_model,
                    d_ff: s.d_ff,
                    n_heads: s.n_heads,
                    n_layers: s.n_layers,
                    dropout: s.dropout,
                    norm_first: s.norm_first,
                    quiet_softmax: s.quiet_softmax,
                }
            }
        }

        #[doc = concat!(
                                    "The autoregressive cache of a [`",
                                    stringify!($stack),
                                    "`]: each layer's cache and the stack's outputs."
                                )]
        #[derive(Debug)]
        pub struct $cache<B: Backend> {
            layers: Vec<$layer_cache<B>>,
            output: RowCache<B>,
        }

        impl<B: FlashBackend> $stack<B> {
            #[doc = concat!(
                                        "An empty cache for [`",
                                        stringify!($stack),
                                        "::forward_autoregressive_inference`]."
                                    )]
            pub fn new_autoregressive_cache(&self) -> $cache<B> {
                $cache {
                    layers: self.layers.iter().map(|_| $layer_cache::empty()).collect(),
                    output: RowCache::new(),
                }
            }
        }
    };
}

stack!(
    "encoder",
    TransformerEncoderConfig,
    TransformerEncoder,
    TransformerEncoderLayer,
    TransformerEncoderAutoregressiveCache,
    TransformerEncoderLayerAutoregressiveCache,
);

stack!(
    "decoder",
    TransformerDecoderConfig,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerDecoderAutoregressiveCache,
    TransformerDecoderLayerAutoregressiveCache,
);

/// The parts of one layer, built alike for both stacks.
struct LayerParts<B: Backend> {
    mha: MultiHeadAttention<B>,
    pwff: PositionWiseFeedForward<B>,
    norm: LayerNorm<B>,
    dropout: Dropout,
}

/// burn-nn's sub-layer step: `x + dropout(f(norm(x)))` with `norm_first`, else
/// `norm(x + dropout(f(x)))`. `f` takes the whole sequence (a cache computes only its new
/// rows).
fn sublayer<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    norm_first: bool,
    dropout: &Dropout,
    norm: impl FnOnce(Tensor<B, D>) -> Tensor<B, D>,
    f: impl FnOnce(Tensor<B, D>) -> Tensor<B, D>,
) -> Tensor<B, D> {
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

    /// The masks and causal flag of every layer's attention.
    fn masks(&self) -> MaskArgs<B> {
        (self.mask_pad.clone(), self.mask_attn.clone(), self.causal)
    }
}

impl TransformerEncoderConfig {
    /// An encoder with burn-nn's initialisation.
    pub fn init<B: Backend>(&self, device: &B::Device) -> TransformerEncoder<B> {
        let layers = (0..self.n_layers)
            .map(|_| {
                let parts = self.layer_parts::<B>(device);
                TransformerEncoderLayer {
                    mha: parts.mha,
                    pwff: parts.pwff,
                    norm_1: parts.norm,
                    norm_2: self.norm(device),
                    dropout: parts.dropout,
                    norm_first: self.norm_first,
                }
            })
            .collect();
        self.stack(layers)
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
        self.sublayers(x, |h| {
            let input = MhaInput::self_attn(h).with_masks((mask_pad, mask_attn, causal));
            self.mha.forward(input).context
        })
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
        let (mha, output) = (&mut cache.mha, &mut cache.output);
        output.extend("TransformerEncoderLayer", "input", seq, |positions| {
            let x = rows(x, positions.clone());
            self.new_rows(x, (mask_pad, mask_attn, causal), positions, mha)
        })
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
        self.sublayers(x, |h| {
            self.mha
                .cached_rows(h.clone(), h.clone(), h, masks, None, positions, cache)
        })
    }

    /// The attention sub-layer (`attend`, on the sub-layer's input), then the feed-forward
    /// (on `[B, S, d_model]`, or a packed batch's `[T, d_model]`).
    fn sublayers<const D: usize>(
        &self,
        x: Tensor<B, D>,
        attend: impl FnOnce(Tensor<B, D>) -> Tensor<B, D>,
    ) -> Tensor<B, D> {
        self.sublayers_normed(x, |n, t| n.forward(t), attend, |h| self.pwff.forward(h))
    }

    /// [`TransformerEncoderLayer::sublayers`] with the norms computed by `norm` (the module and
    /// its input) and the feed-forward by `ffn`.
    pub(crate) fn sublayers_normed<const D: usize>(
        &self,
        x: Tensor<B, D>,
        norm: impl Fn(&LayerNorm<B>, Tensor<B, D>) -> Tensor<B, D>,
        attend: impl FnOnce(Tensor<B, D>) -> Tensor<B, D>,
        ffn: impl FnOnce(Tensor<B, D>) -> Tensor<B, D>,
    ) -> Tensor<B, D> {
        let (nf, dropout) = (self.norm_first, &self.dropout);
        let (first, second) = match nf {
            true => (&self.norm_2, &self.norm_1),
            false => (&self.norm_1, &self.norm_2),
        };
        let x = sublayer(x, nf, dropout, |t| norm(first, t), attend);
        sublayer(x, nf, dropout, |t| norm(second, t), ffn)
    }
}

impl<B: FlashBackend> TransformerEncoder<B> {
    /// The encoder on the whole sequence: `[B, S, d_model]`.
    pub fn forward(&self, input: TransformerEncoderInput<B>) -> Tensor<B, 3> {
        let mut x = input.tensor.clone();
        for layer in &self.layers {
            let (mask_pad, mask_attn, causal) = input.masks();
            x = layer.forward(x, mask_pad, mask_attn, causal);
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
        let (layers, output) = (&mut cache.layers, &mut cache.output);
        output.extend("TransformerEncoder", "input", seq, |positions| {
            let mut x = rows(input.tensor.clone(), positions.clone());
            for (layer, c) in self.layers.iter().zip(layers) {
                x = layer.new_rows(x, input.masks(), positions.clone(), &mut c.mha);
            }
            x
        })
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

// ---------------------------------------------------------------------------------------------
// Decoder

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

    /// The masks and causal flag of every layer's self-attention.
    fn target_masks(&self) -> MaskArgs<B> {
        let (pad, attn) = (&self.target_mask_pad, &self.target_mask_attn);
        (pad.clone(), attn.clone(), self.target_causal)
    }

    /// The masks of every layer's cross-attention.
    fn memory_masks(&self) -> MaskArgs<B> {
        let (pad, attn) = (&self.memory_mask_pad, &self.memory_mask_attn);
        (pad.clone(), attn.clone(), false)
    }
}

impl TransformerDecoderConfig {
    /// A decoder with burn-nn's initialisation.
    pub fn init<B: Backend>(&self, device: &B::Device) -> TransformerDecoder<B> {
        let layers = (0..self.n_layers)
            .map(|_| {
                let self_attn = self.attention(device);
                let rest = self.layer_parts::<B>(device);
                TransformerDecoderLayer {
                    cross_attn: rest.mha,
                    self_attn,
                    pwff: rest.pwff,
                    norm_1: rest.norm,
                    norm_2: self.norm(device),
                    norm_3: self.norm(device),
                    dropout: rest.dropout,
                    norm_first: self.norm_first,
                }
            })
            .collect();
        self.stack(layers)
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

impl<B: FlashBackend> TransformerDecoderLayer<B> {
    /// The layer on the whole target sequence; returns the new target.
    pub fn forward(&self, input: &TransformerDecoderInput<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.sublayers(
            x,
            |h| {
                let i = MhaInput::self_attn(h).with_masks(input.target_masks());
                self.self_attn.forward(i).context
            },
            |h| {
                let memory = input.memory.clone();
                let i = MhaInput::new(h, memory.clone(), memory).with_masks(input.memory_masks());
                self.cross_attn.forward(i).context
            },
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
        let output = &mut cache.output;
        let (self_cache, cross_cache) = (&mut cache.self_attn, &mut cache.cross_attn);
        output.extend("TransformerDecoderLayer", "target", seq, |positions| {
            let x = rows(x, positions.clone());
            self.new_rows(input, x, positions, self_cache, cross_cache)
        })
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
        let self_positions = positions.clone();
        self.sublayers(
            x,
            |h| {
                let (masks, attn) = (input.target_masks(), &self.self_attn);
                attn.cached_rows(
                    h.clone(),
                    h.clone(),
                    h,
                    masks,
                    None,
                    self_positions,
                    self_cache,
                )
            },
            |h| {
                let (masks, memory) = (input.memory_masks(), input.memory.clone());
                let attn = &self.cross_attn;
                attn.cached_rows(
                    h,
                    memory.clone(),
                    memory,
                    masks,
                    None,
                    positions,
                    cross_cache,
                )
            },
        )
    }

    /// The self-attention sub-layer (`attend`), the cross-attention sub-layer (`cross`), each
    /// on its sub-layer's input, then the feed-forward.
    fn sublayers(
        &self,
        x: Tensor<B, 3>,
        attend: impl FnOnce(Tensor<B, 3>) -> Tensor<B, 3>,
        cross: impl FnOnce(Tensor<B, 3>) -> Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        let (nf, dropout) = (self.norm_first, &self.dropout);
        // Norms by role: pre-LN inputs of self-attention / cross-attention / feed-forward are
        // norm_3 / norm_1 / norm_2; post-LN outputs are norm_1 / norm_2 / norm_3.
        let (n_self, n_cross, n_ff) = match nf {
            true => (&self.norm_3, &self.norm_1, &self.norm_2),
            false => (&self.norm_1, &self.norm_2, &self.norm_3),
        };
        let x = sublayer(x, nf, dropout, |t| n_self.forward(t), attend);
        let x = sublayer(x, nf, dropout, |t| n_cross.forward(t), cross);
        sublayer(
            x,
            nf,
            dropout,
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
        let (layers, output) = (&mut cache.layers, &mut cache.output);
        output.extend("TransformerDecoder", "target", seq, |positions| {
            let mut x = rows(input.target.clone(), positions.clone());
            for (layer, c) in self.layers.iter().zip(layers) {
                let (self_cache, cross_cache) = (&mut c.self_attn, &mut c.cross_attn);
                x = layer.new_rows(&input, x, positions.clone(), self_cache, cross_cache);
            }
            x
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Conversions from burn-nn's layers (the same parameters, moved)

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
