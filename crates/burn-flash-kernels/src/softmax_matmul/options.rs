//! What a `softmax(X)·V` call takes besides its tensors, what its plans say, and why a
//! launch is refused.

use core::fmt;

use crate::flash::FlashConfig;
use crate::fragment::MatrixUnitsUnavailable;
use crate::tensor::UnsupportedDType;

/// Block sizes a caller may force, for `block_1` (rows of `X` per cube) and `block_2` (columns
/// of `X` per online-softmax step).
pub const BLOCK_SIZES: [usize; 3] = [16, 32, 64];

/// Which inner-product path runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SmmPath {
    /// Plain units, f32 arithmetic: every runtime, every float type.
    Units,
    /// Matrix units (f32 accumulation): f16/bf16 where the device has them: `mma` on CUDA,
    /// cooperative matrices elsewhere (Vulkan through SPIR-V, Metal).
    MatrixUnits,
}

/// The forward kernel of a launch, chosen once by [`super::plan_softmax_matmul`]: a flash
/// forward with given scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SmmForwardKernel {
    /// [`crate::flash::forward::units::flash_forward_units()`]: plain units, `block_1 ×
    /// block_2` steps, 64 or 128 output columns per cube. Forced block sizes, outputs with at
    /// most 64 rows or columns, runtimes without the tiled kernel's 256 units or shared memory,
    /// and 16-bit rows the matrix units cannot take.
    Units,
    /// [`crate::flash::forward::tiled::flash_forward_tiled()`]: plain units, register-tiled
    /// 128 × 128 outputs, 16 columns of `X` per step.
    Tiled,
    /// [`crate::flash::forward::mma::flash_forward_mma()`]: f16/bf16 on the matrix units, `X`
    /// straight to registers, `V` by `cp.async` into two buffers (CUDA sm_80+, 16-byte aligned
    /// rows, `block_2` a multiple of 32).
    MatrixUnits,
    /// [`crate::flash::forward::cmma::flash_forward_cmma()`]: f16/bf16 on cooperative matrices
    /// (cubecl's `cmma`), the matrix-unit path where the device offers them and has no manual
    /// `mma` (Vulkan through SPIR-V, Metal); at most 64 rows per cube.
    CooperativeMatrix,
    /// [`crate::flash::forward::hopper`] with given scores: f16/bf16 on Hopper GPUs (sm_90,
    /// CUDA builds) with TMA and `wgmma`, 128 rows × 128 columns of `X` per step, 64 or 128
    /// output columns per block (16-byte aligned rows and starts; what else it needs:
    /// [`super::plan::hopper_unavailable`]).
    Hopper,
}

impl SmmForwardKernel {
    /// The inner-product path the kernel runs on.
    pub fn path(self) -> SmmPath {
        match self {
            Self::Units | Self::Tiled => SmmPath::Units,
            Self::MatrixUnits | Self::CooperativeMatrix | Self::Hopper => SmmPath::MatrixUnits,
        }
    }

    /// The `#[cube]` flash kernel that runs this one (`None`: the hand-written Hopper kernel).
    pub fn flash(self) -> Option<crate::flash::FlashKernel> {
        match self {
            Self::Units => Some(crate::flash::FlashKernel::Units),
            Self::Tiled => Some(crate::flash::FlashKernel::Tiled),
            Self::MatrixUnits => Some(crate::flash::FlashKernel::MatrixUnits),
            Self::CooperativeMatrix => Some(crate::flash::FlashKernel::CooperativeMatrix),
            Self::Hopper => None,
        }
    }
}

/// Overrides of the host heuristic. The default is what users want.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct SoftmaxMatmulOptions {
    /// Force `(block_1, block_2)`, each one of [`BLOCK_SIZES`]; an impossible choice is an
    /// error, never a silent fallback.
    pub blocks: Option<(usize, usize)>,
    /// Force an inner-product path (the default picks matrix units where they exist).
    pub path: Option<SmmPath>,
    /// Force the Hopper kernel ([`SmmForwardKernel::Hopper`]) on (an error where it cannot run
    /// this call) or off; the default takes it wherever it can run.
    pub hopper: Option<bool>,
    /// How the Hopper kernel's blocks take its tiles.
    pub schedule: crate::attention::TileSchedule,
    /// How the backward plan uses the Ampere kernels
    /// ([`SmmBackwardPath::Ampere`]): only [`AmpereUse::Always`](crate::attention::AmpereUse)
    /// takes them until a GPU run verifies them.
    pub ampere: crate::attention::AmpereUse,
}

/// Why a `softmax(X)·V` launch was refused. Nothing is launched when one is returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SoftmaxMatmulError {
    /// A tensor's shape does not fit the others.
    ShapeMismatch {
        /// Which argument.
        arg: &'static str,
        /// The shape it should have.
        expected: Vec<usize>,
        /// Its shape.
        got: Vec<usize>,
    },
    /// The element type is not f32, f16 or bf16, or the device cannot run it.
    UnsupportedDType {
        /// The element type, as cubecl names it.
        dtype: String,
    },
    /// A forced block size cannot run.
    InvalidBlocks {
        /// `(block_1, block_2)` as asked.
        blocks: (usize, usize),
        /// Why not.
        reason: String,
    },
    /// The forced path is not available for this dtype on this device.
    PathUnavailable {
        /// The forced path.
        path: SmmPath,
        /// Why not.
        reason: String,
    },
    /// More cubes along one grid axis than the device can launch.
    TooLarge {
        /// Cubes along each axis the launch would need.
        cubes: (usize, usize, usize),
    },
}

impl fmt::Display for SoftmaxMatmulError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ShapeMismatch { arg, expected, got } => {
                crate::tensor::write_shape_mismatch(f, arg, expected, got)
            }
            Self::UnsupportedDType { dtype } => crate::tensor::write_unsupported_dtype(f, dtype),
            Self::InvalidBlocks { blocks, reason } => {
                write!(f, "block sizes {blocks:?} cannot run: {reason}")
            }
            Self::PathUnavailable { path, reason } => {
                write!(f, "path {path:?} is not available: {reason}")
            }
            Self::TooLarge { cubes } => write!(
                f,
                "the launch needs {cubes:?} cubes along (x, y, z), more than the device allows"
            ),
        }
    }
}

impl core::error::Error for SoftmaxMatmulError {}

impl From<UnsupportedDType> for SoftmaxMatmulError {
    fn from(e: UnsupportedDType) -> Self {
        Self::UnsupportedDType { dtype: e.dtype }
    }
}

/// Problem sizes of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SmmDims {
    /// Batch (product of the leading dimensions).
    pub batch: usize,
    /// Rows of `X`.
    pub d1: usize,
    /// Columns of `X`, rows of `V` (the softmax dimension).
    pub d2: usize,
    /// Columns of `V`.
    pub d3: usize,
}

/// The forward launch [`super::plan_softmax_matmul`] chose: the kernel and the configuration
/// it is compiled with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SoftmaxMatmulPlan {
    /// The kernel that runs.
    pub kernel: SmmForwardKernel,
    /// Its configuration: `block_q` rows of `X` per cube (`block_1`), `block_k` columns of `X`
    /// per online-softmax step (`block_2`), `value_dim` output columns per cube (`tile_3`).
    pub config: FlashConfig,
    /// Vector width of the kernel's row loads, in elements (1: scalar loads through any
    /// strides).
    pub vector: usize,
    /// Units per cube.
    pub units: u32,
    /// Cubes: (output column tiles, row blocks, batch), the grid of the launch; the Hopper
    /// kernel's is `(blocks, 1, 1)`, blocks taking its tiles in rounds
    /// ([`crate::flash::forward::hopper::blocks`]).
    pub cubes: (usize, usize, usize),
    /// Why the matrix units do not run this call (`None`: they do, or could).
    pub matrix_units: Option<MatrixUnitsUnavailable>,
}

impl SoftmaxMatmulPlan {
    /// The inner-product path of the plan's kernel.
    pub fn path(&self) -> SmmPath {
        self.kernel.path()
    }

    /// `(block_1, block_2, tile_3)`: rows of `X` per cube, columns of `X` per step, output
    /// columns per cube.
    pub fn blocks(&self) -> (usize, usize, usize) {
        let c = &self.config;
        (c.block_q as usize, c.block_k as usize, c.value_dim as usize)
    }
}

/// Which kernels compute the gradients of `softmax(X)·V`: the flash backward core with given
/// scores (`dX` is its `dS`, `dV` its `dV`, summed over the batches of a shared `V` in the
/// kernel, as grouped-query attention sums a group's heads), on one of its inner-product paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SmmBackwardPath {
    /// The matrix units ([`crate::flash::backward::mma`]; f16/bf16 on CUDA, 16-byte aligned
    /// rows, `dO` and two steps of `V` in shared memory).
    MatrixUnits,
    /// Cooperative matrices ([`crate::flash::backward::cmma`]; f16/bf16 where cubecl's `cmma`
    /// runs and no `mma` does — Vulkan through SPIR-V, Metal — and `d3` up to 128).
    CooperativeMatrix,
    /// Plain units, register-tiled ([`crate::flash::backward::units_given`]: the core's
    /// given-score products, 128 × 128 outputs per cube; gradients of at least 65 × 65).
    Tiled,
    /// Plain units, the flash schedule ([`crate::flash::backward::units`]; every runtime and
    /// float type, f32 arithmetic).
    Units,
    /// Hopper GPUs (sm_90): `dX` and `dV` by the hand-written `wgmma` kernels of
    /// [`crate::flash::backward::hopper_given`] (what they need beyond the matrix units: 16-byte
    /// rows and starts of `dX` and `dV` too, see
    /// [`super::plan::plan_softmax_matmul_backward_for`]).
    Hopper,
    /// sm_80 and later: `dX` and `dV` by the hand-written `mma.sync` kernels of
    /// [`crate::flash::backward::sm80_given`] (16-byte rows and starts of every tensor; ahead
    /// of the Hopper kernels; only under [`AmpereUse::Always`](crate::attention::AmpereUse)
    /// until a GPU run verifies them).
    Ampere,
}

/// The backward launch [`super::plan_softmax_matmul_backward`] chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmmBackwardPlan {
    /// The kernels that run.
    pub path: SmmBackwardPath,
    /// The `dX` kernel's configuration (rows per cube, columns of `X` per step, `d3` rounded
    /// up); the `dV` kernel's follows from it. The register-tiled products take none.
    pub config: FlashConfig,
    /// Matrix units: the `dX` kernel stores `P` for the `dV` kernel (small `d2`).
    pub p_buffer: bool,
    /// Register-tiled products: the vector width (1, 2 or 4); cooperative matrices: up to 8.
    pub vector: usize,
    /// Cubes of the `dV` kernel.
    pub dv_cubes: (usize, usize, usize),
    /// Cubes of the `dX` kernel.
    pub dx_cubes: (usize, usize, usize),
    /// Why the matrix units do not run this call (`None`: they do).
    pub matrix_units: Option<MatrixUnitsUnavailable>,
}
