//! RoPE on the append: the rotation tables the kernels and the fallback read.

use super::*;

/// RoPE tables for [`append_paged`]: `cos`, `sin` `[positions, R/2]` (f32) of the rotary dims
/// `R`, and the pairing.
#[derive(Debug, Clone)]
pub struct Rope<B: Backend> {
    /// `cos(p·θᵢ)`.
    pub cos: Tensor<B, 2>,
    /// `sin(p·θᵢ)`.
    pub sin: Tensor<B, 2>,
    /// Pairs `(2i, 2i + 1)` (burn-nn's `RotaryEncoding`); halves `(i, i + R/2)` otherwise
    /// (GPT-NeoX, Hugging Face's Llama).
    pub interleaved: bool,
}

impl<B: Backend> Rope<B> {
    /// The tables of `θᵢ = theta^(−2i/R)` for positions `0 .. positions`, computed in f64 on
    /// the host and stored as f32.
    pub fn new(
        theta: f64,
        rotary_dim: usize,
        positions: usize,
        interleaved: bool,
        device: &B::Device,
    ) -> Self {
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || theta <= 0.0 {
            panic!(
                "{OP}: RoPE needs an even, positive `rotary_dim` and a positive `theta`, got {rotary_dim} and {theta}"
            );
        }
        let half = rotary_dim / 2;
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for i in 0..half {
                let angle = p as f64 * theta.powf(-2.0 * i as f64 / rotary_dim as f64);
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let table = |v: Vec<f32>| {
            Tensor::from_data(TensorData::new(v, [positions, half]), (device, DType::F32))
        };
        Self {
            cos: table(cos),
            sin: table(sin),
            interleaved,
        }
    }
}

/// The RoPE arguments of [`AttentionBackend::flash_kv_append`].
#[derive(Debug)]
pub struct RopeArgs<B: Backend> {
    /// `[positions, R/2]`, f32.
    pub cos: FloatTensor<B>,
    /// As `cos`.
    pub sin: FloatTensor<B>,
    /// Pairing ([`Rope::interleaved`]).
    pub interleaved: bool,
    /// Queries `[B, Hq, S, D]` to rotate at the new tokens' positions too.
    pub query: Option<FloatTensor<B>>,
}

/// `rope`'s tables as the kernels take them (f32 primitives), no query.
pub(super) fn rope_tables<B: Backend>(rope: &Rope<B>) -> RopeArgs<B> {
    RopeArgs {
        cos: rope.cos.clone().cast(DType::F32).into_primitive().tensor(),
        sin: rope.sin.clone().cast(DType::F32).into_primitive().tensor(),
        interleaved: rope.interleaved,
        query: None,
    }
}
