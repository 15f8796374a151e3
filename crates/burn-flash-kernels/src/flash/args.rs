//! The arguments every flash kernel of a direction takes (FlashAttention-2's `flash.h`
//! params), as `CubeLaunch` bundles: the scalars [`ScoreArgs`] (scale, softcap, dropout), the
//! score operands [`ScoreInputs`] (`q`, `k`, `v`, mask, bias) that both directions read, the
//! forward's outputs [`ForwardOutputs`] and the backward's extra inputs [`GradInputs`]. On the
//! host, a forward launch's tensors are [`FlashTensors`] and a backward's
//! [`BackwardOperands`]. A new kernel family takes the same bundles.
//!
//! The bundles are generic over the element type `E` the kernel reads the operands as (`F`, or
//! a vector of `F`); the mask and bias are always read one element at a time.

use cubecl::prelude::*;

use crate::dropout::DropoutParams;

/// The dropout scalars of a launch ([`crate::dropout::DropoutParams`] on the device).
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub struct Dropout {
    /// Low word of the seed.
    pub seed_lo: u32,
    /// High word of the seed.
    pub seed_hi: u32,
    /// A weight is kept when the generator's word is at least this.
    pub threshold: u32,
    /// `1 / (1 − p)`.
    pub inv_keep: f32,
}

/// The runtime scalars of a flash kernel, forward and backward: the factor of `Q·Kᵀ`, the
/// softcap and the dropout (each read only where the kernel's configuration says so).
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub struct ScoreArgs {
    /// Factor of `Q·Kᵀ` (1 for given scores).
    pub scale: f32,
    /// Softcap `c` of `c·tanh(s / c)` (1 without one).
    pub softcap: f32,
    /// The dropout.
    pub dropout: Dropout,
    /// Keys a row sees before its diagonal under a sliding window (read only with
    /// [`crate::flash::ScoreRules::window`]; at most `Sq + Sk`).
    pub window_left: u32,
    /// Keys a row sees after its diagonal under a sliding window (as `window_left`).
    pub window_right: u32,
}

/// The score operands of a flash kernel, forward and backward (given scores: `x` as `q` and
/// `k`; stand-ins for the tensors the configuration never reads).
#[derive(CubeLaunch, CubeType)]
pub struct ScoreInputs<E: CubePrimitive, F: CubePrimitive> {
    /// Queries `[B, Hq, Sq, D]`, or the given scores `X`.
    pub q: Tensor<E>,
    /// Keys `[B, Hkv, Sk, D]`.
    pub k: Tensor<E>,
    /// Values `[B, Hkv, Sk, Dv]`.
    pub v: Tensor<E>,
    /// The bool mask in the element type (1 = masked out), broadcast to `[B, Hq, Sq, Sk]`.
    pub mask: Tensor<F>,
    /// The additive bias, broadcast to `[B, Hq, Sq, Sk]`.
    pub bias: Tensor<F>,
    /// ALiBi slopes `[Hq]` (f32).
    pub slopes: Tensor<f32>,
    /// Attention-sink logits `[Hq]` (f32).
    pub sinks: Tensor<f32>,
    /// The sequences of a packed variable-length call, `[2·(n + 1)]` (u32): the cumulative
    /// query lengths `cu_q` (`0, …, Sq`), then the cumulative key lengths `cu_k` (`0, …, Sk`)
    /// ([`crate::flash::keys::packed_seq()`]).
    pub seqs: Tensor<u32>,
}

/// What a forward kernel writes.
#[derive(CubeLaunch, CubeType)]
pub struct ForwardOutputs<E: CubePrimitive> {
    /// The output `[B, Hq, Sq, Dv]`.
    pub out: Tensor<E>,
    /// The row log-sum-exp `[B, Hq, Sq]` (f32).
    pub lse: Tensor<f32>,
}

/// What a backward kernel reads beside the [`ScoreInputs`].
#[derive(CubeLaunch, CubeType)]
pub struct GradInputs<E: CubePrimitive> {
    /// The output's gradient `[B, Hq, Sq, Dv]`.
    pub d_out: Tensor<E>,
    /// The forward's row log-sum-exp `[B, Hq, Sq]` (f32).
    pub lse: Tensor<f32>,
    /// `δ = rowsum(dO ⊙ O)` `[B, Hq, Sq]` (f32).
    pub delta: Tensor<f32>,
}

/// The widest side of a sliding window the kernels read (2³⁰; sequences are shorter).
pub const WINDOW_MAX: usize = 1 << 30;

/// The host side of [`ScoreArgs`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scalars {
    /// Factor of `Q·Kᵀ`.
    pub scale: f32,
    /// Softcap (`None`: none).
    pub softcap: Option<f32>,
    /// Dropout (`None`: none).
    pub dropout: Option<DropoutParams>,
    /// Sliding window `(left, right)` (`None`: none; [`Scalars::window_args`]).
    pub window: Option<(usize, usize)>,
}

impl Scalars {
    /// Given scores: no scale, softcap or dropout.
    pub const GIVEN: Self = Self {
        scale: 1.0,
        softcap: None,
        dropout: None,
        window: None,
    };

    /// The launch argument.
    pub fn arg<R: Runtime>(&self) -> ScoreArgsLaunch<R> {
        let d = self.dropout.unwrap_or(DropoutParams::new(0.0, 0));
        let (left, right) = self.window_args();
        ScoreArgsLaunch::new(
            self.scale,
            self.softcap.unwrap_or(1.0),
            DropoutLaunch::new(d.seed_lo, d.seed_hi, d.threshold, d.inv_keep()),
            left,
            right,
        )
    }

    /// The words of the hand-written kernels' `ScoreScalars` (`flash/scores.cuh`), in its
    /// order: the scale and softcap in base 2, the fill score of masked keys (`fill`, which
    /// only `FILL` variants read), the dropout's seed, threshold and `1 / (1 − p)`, the window.
    #[cfg(feature = "cuda")]
    pub fn hopper_words(&self, fill: Option<f32>) -> [u64; 5] {
        let words = crate::hopper::words;
        let log2e = core::f32::consts::LOG2_E;
        let cap = self.softcap.unwrap_or(1.0);
        let d = self.dropout.unwrap_or(DropoutParams::new(0.0, 0));
        let (left, right) = self.window_args();
        [
            words((self.scale * log2e).to_bits(), (self.scale / cap).to_bits()),
            words(
                (cap * log2e).to_bits(),
                (fill.unwrap_or(0.0) * log2e).to_bits(),
            ),
            words(d.seed_lo, d.seed_hi),
            words(d.threshold, d.inv_keep_bits),
            words(left, right),
        ]
    }

    /// The window's `(left, right)` as the kernels read them: each clamped to
    /// [`WINDOW_MAX`] (wider sees every key of any sequence a kernel takes, and the kernels'
    /// `pos + Sk + right + 1` stays within 32 bits); `(0, 0)` without a window (never read).
    pub fn window_args(&self) -> (u32, u32) {
        let (left, right) = self.window.unwrap_or((0, 0));
        (left.min(WINDOW_MAX) as u32, right.min(WINDOW_MAX) as u32)
    }
}

/// The tensors of a forward launch (shapes and strides in
/// [`crate::flash::forward::mma::flash_forward_mma()`]'s terms; stand-ins for the ones the
/// configuration never reads).
pub struct FlashTensors<R: Runtime> {
    /// Queries, or the given scores `X`.
    pub q: TensorArg<R>,
    /// Keys.
    pub k: TensorArg<R>,
    /// Values.
    pub v: TensorArg<R>,
    /// The bool mask, in the element type (1 = masked out).
    pub mask: TensorArg<R>,
    /// The additive bias.
    pub bias: TensorArg<R>,
    /// The ALiBi slopes (f32).
    pub slopes: TensorArg<R>,
    /// The attention-sink logits (f32).
    pub sinks: TensorArg<R>,
    /// The packed sequences' cumulative lengths (u32).
    pub seqs: TensorArg<R>,
    /// The output.
    pub out: TensorArg<R>,
    /// The row log-sum-exp (f32).
    pub lse: TensorArg<R>,
}

/// A tensor of a backward launch, as the kernels index it: its buffer, shape and strides
/// (zeros along broadcast dimensions).
#[derive(Debug, Clone)]
pub struct Operand {
    /// The buffer.
    pub handle: cubecl::server::Handle,
    /// The shape the kernels see.
    pub shape: Vec<usize>,
    /// The strides the kernels use.
    pub strides: Vec<usize>,
}

impl Operand {
    /// The launch argument.
    pub fn arg<R: Runtime>(&self) -> TensorArg<R> {
        // SAFETY: the shape and strides describe the buffer (the launcher's caller's contract);
        // zero strides only make every index along them read the same element.
        unsafe {
            TensorArg::from_raw_parts(
                self.handle.clone(),
                self.strides.clone().into(),
                self.shape.clone().into(),
            )
        }
    }

    /// Whether its rows are whole, aligned vectors of `n` elements: a contiguous last
    /// dimension of a multiple of `n`, and every other stride a multiple of `n`.
    pub fn rows_of_vectors(&self, n: usize) -> bool {
        let d = self.shape.len();
        d > 0
            && self.strides[d - 1] == 1
            && self.shape[d - 1].is_multiple_of(n)
            && self.strides[..d - 1].iter().all(|s| s.is_multiple_of(n))
    }
}

impl BackwardOperands {
    /// The [`ScoreInputs`] launch argument, reading `q` from `q` (the operands' own, or a
    /// buffer standing in for it).
    pub fn score_inputs<E: CubePrimitive, F: CubePrimitive, R: Runtime>(
        &self,
        q: &Operand,
    ) -> ScoreInputsLaunch<E, F, R> {
        ScoreInputsLaunch::new(
            q.arg(),
            self.k.arg(),
            self.v.arg(),
            self.mask.arg(),
            self.bias.arg(),
            self.slopes.arg(),
            self.sinks.arg(),
            self.seqs.arg(),
        )
    }

    /// The [`GradInputs`] launch argument, with `δ` from `delta`.
    pub fn grad_inputs<E: CubePrimitive, R: Runtime>(
        &self,
        delta: &Operand,
    ) -> GradInputsLaunch<E, R> {
        GradInputsLaunch::new(self.d_out.arg(), self.lse.arg(), delta.arg())
    }
}

/// A backward launch as every schedule's launcher takes it: the operands, `δ` (`delta`, one
/// f32 per query row, from the prepass), the grids of the dK/dV kernel (`dV` for given scores)
/// and of the dQ kernel (`dX`), `None` for one not launched, and the element type.
pub struct BackwardLaunch<'a, R: Runtime> {
    /// The client the kernels launch on.
    pub client: &'a ComputeClient<R>,
    /// The operands.
    pub t: &'a BackwardOperands,
    /// `δ = rowsum(dO ∘ O)`.
    pub delta: &'a Operand,
    /// The dK/dV kernel's grid.
    pub dkv_cubes: Option<(usize, usize, usize)>,
    /// The dQ kernel's grid.
    pub dq_cubes: Option<(usize, usize, usize)>,
    /// The element type.
    pub dtype: StorageType,
}

/// The tensors of a backward launch, 4-D in attention's terms (given scores: `x` as `q` and
/// `k`, `dX` as `ds`; stand-ins for what the configuration never reads or writes).
#[derive(Debug, Clone)]
pub struct BackwardOperands {
    /// Queries, or the given scores `X`.
    pub q: Operand,
    /// Keys.
    pub k: Operand,
    /// Values.
    pub v: Operand,
    /// The bool mask (1 = masked out).
    pub mask: Operand,
    /// The additive bias.
    pub bias: Operand,
    /// The ALiBi slopes `[Hq]` (f32).
    pub slopes: Operand,
    /// The attention-sink logits `[Hq]` (f32).
    pub sinks: Operand,
    /// The packed sequences' cumulative lengths (u32, [`ScoreInputs::seqs`]).
    pub seqs: Operand,
    /// The forward's output.
    pub out: Operand,
    /// The output's gradient.
    pub d_out: Operand,
    /// The forward's row log-sum-exp (f32).
    pub lse: Operand,
    /// `dQ` (written).
    pub dq: Operand,
    /// `dK` (written).
    pub dk: Operand,
    /// `dV` (written).
    pub dv: Operand,
    /// `dS` (written where asked; `dX` for given scores).
    pub ds: Operand,
}
