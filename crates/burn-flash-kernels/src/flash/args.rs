//! The arguments every flash kernel of a direction takes (FlashAttention-2's `flash.h`
//! params): the scalar bundle [`ScoreArgs`] (scale, softcap, dropout) as a `CubeLaunch` type,
//! and the tensor views of a forward ([`FlashTensors`]) and of a backward
//! ([`BackwardOperands`]) launch. A new kernel family takes the same bundles.

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
}

/// The host side of [`ScoreArgs`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scalars {
    /// Factor of `Q·Kᵀ`.
    pub scale: f32,
    /// Softcap (`None`: none).
    pub softcap: Option<f32>,
    /// Dropout (`None`: none).
    pub dropout: Option<DropoutParams>,
}

impl Scalars {
    /// Given scores: no scale, softcap or dropout.
    pub const GIVEN: Self = Self {
        scale: 1.0,
        softcap: None,
        dropout: None,
    };

    /// The launch argument.
    pub fn arg<R: Runtime>(&self) -> ScoreArgsLaunch<R> {
        let d = self.dropout.unwrap_or(DropoutParams::new(0.0, 0));
        ScoreArgsLaunch::new(
            self.scale,
            self.softcap.unwrap_or(1.0),
            DropoutLaunch::new(d.seed_lo, d.seed_hi, d.threshold, d.inv_keep()),
        )
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
