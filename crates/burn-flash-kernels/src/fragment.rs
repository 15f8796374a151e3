//! Helpers for kernels that drive the matrix units by hand (`mma` m16n8k16 on f16/bf16 with
//! f32 accumulators, PTX's register layout): the tile constants, the device check, the row
//! reductions across the 4 lanes that share a row of a fragment, and the `P·V` step from an
//! `ldmatrix.trans` operand.
//!
//! Register layout: element positions come from cubecl's `position_of_nth`; the row statistics
//! assume, as the CUDA `mma` layouts do, that a lane holds elements of rows `r` and `r + 8` only
//! (`slot = row / 8`) and that the 4 lanes sharing a row differ in their two lowest bits
//! (reduced with `plane_shuffle_xor` 1 and 2).

use cubecl::{
    cmma::MmaDefinition,
    ir::{ElemType, FloatKind, MatrixIdent},
    prelude::*,
};

/// Lanes per plane the matrix-unit kernels are written for.
pub const PLANE: u32 = 32;
/// Rows of an `mma` tile (`m`) and columns of its output tile (`n`).
pub const MMA_M: u32 = 16;
pub const MMA_N: u32 = 8;
/// Reduction depth of an f16/bf16 `mma` (`k`).
pub const MMA_K: u32 = 16;
/// Padding of a row of a shared operand tile, in elements: staggers the rows across memory
/// banks so that a fragment load is conflict-free.
pub const V_PAD: u32 = 8;

/// Whether the device has the manual `mma` (m16n8k16, f32 accumulators) and `ldmatrix` for
/// operands of `dtype`: 16-bit floats on a runtime with 32-lane planes (CUDA sm_80+). f32 never
/// takes the matrix units: their f32 mode rounds operands to TF32.
pub fn supported<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> bool {
    let props = client.properties();
    let hw = &props.hardware;
    let sixteen_bit = [FloatKind::F16, FloatKind::BF16]
        .into_iter()
        .any(|k| dtype == StorageType::Scalar(ElemType::Float(k)));
    if !sixteen_bit || hw.plane_size_min != PLANE || hw.plane_size_max != PLANE {
        return false;
    }
    let f32_acc = StorageType::Scalar(ElemType::Float(FloatKind::F32));
    let mma = props.features.matmul.mma.iter().any(|c| {
        c.a_type == dtype
            && c.b_type == dtype
            && c.cd_type == f32_acc
            && c.m == MMA_M
            && c.n == MMA_N
            && c.k == MMA_K
    });
    mma && props.features.matmul.ldmatrix.contains(&dtype)
}

/// Why the matrix-unit kernels cannot take a call: every plan asks [`unavailable`] and names
/// the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatrixUnitsUnavailable {
    /// f32 never takes the matrix units: their f32 mode rounds operands to TF32.
    F32,
    /// The device has no manual `mma` and `ldmatrix` for the element type.
    NoMma {
        /// The element type.
        dtype: StorageType,
    },
    /// The device has no asynchronous copies (`cp.async`).
    NoAsyncCopy,
    /// The rows are not 16-byte aligned (row lengths and strides multiples of 8 elements).
    Unaligned,
    /// A head dim is wider than the kernels' accumulators take.
    HeadDim {
        /// The widest they take.
        max: u32,
    },
    /// The kernels need more units or shared memory per cube than the device has.
    Resources,
}

impl core::fmt::Display for MatrixUnitsUnavailable {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32 never runs on the matrix units (their f32 mode rounds to TF32)",
            Self::NoMma { dtype } => {
                return write!(
                    f,
                    "this device has no manual mma and ldmatrix for {dtype:?}"
                );
            }
            Self::NoAsyncCopy => "this device has no asynchronous copies",
            Self::Unaligned => {
                "rows are not 16-byte aligned (row lengths and every stride multiples of 8)"
            }
            Self::HeadDim { max } => return write!(f, "head dims above {max}"),
            Self::Resources => "the kernels need more units or shared memory than the device has",
        })
    }
}

/// Why the matrix-unit kernels cannot run `dtype` on this device with rows that are
/// (`aligned`) or are not 16-byte aligned; `None` where they can.
pub fn unavailable<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    aligned: bool,
) -> Option<MatrixUnitsUnavailable> {
    if dtype.size() == 4 {
        Some(MatrixUnitsUnavailable::F32)
    } else if !supported(client, dtype) {
        Some(MatrixUnitsUnavailable::NoMma { dtype })
    } else if !client.properties().features.copy_async {
        Some(MatrixUnitsUnavailable::NoAsyncCopy)
    } else if !aligned {
        Some(MatrixUnitsUnavailable::Unaligned)
    } else {
        None
    }
}

/// Units per cube for `rows` rows: one plane per 16 rows.
pub fn units_for_rows(rows: usize) -> u32 {
    (rows as u32 / MMA_M) * PLANE
}

/// Slot (0 or 1) of a fragment element's row: the lane's rows are `r` and `r + 8`.
#[cube]
pub(crate) fn slot_of(row: u32) -> usize {
    (row / 8) as usize
}

/// Maximum over the 4 lanes that share a row.
#[cube]
pub(crate) fn quad_max(v: f32) -> f32 {
    let v = f32::max(v, plane_shuffle_xor(v, 1));
    f32::max(v, plane_shuffle_xor(v, 2))
}

/// The `B` fragments of two adjacent 8-column tiles (m16n8k16), loaded by one `ldmatrix.x4`
/// (`.trans` with `transpose`) from this lane's 16-byte row at `start` of `src`: element 0 is
/// the first tile (matrices 0, 1), element 1 the second (matrices 2, 3).
#[cube]
pub(crate) fn load_b_pair<F: Float, NV: Size>(
    src: &SharedMemory<Vector<F, NV>>,
    start: usize,
    #[comptime] transpose: bool,
) -> Sequence<Array<Vector<F, Const<2>>>> {
    let nv = NV::value();
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let regs = def.load_matrix::<Vector<F, NV>, Const<2>>(
        &src.slice(start, start + comptime!(8 / nv)),
        MatrixIdent::B,
        4usize,
        transpose,
    );
    let mut pair = Sequence::<Array<Vector<F, Const<2>>>>::new();
    #[unroll]
    for t in 0..2usize {
        let mut b = Array::<Vector<F, Const<2>>>::new(2usize);
        b[0usize] = regs[2 * t];
        b[1usize] = regs[2 * t + 1];
        pair.push(b);
    }
    pair
}

/// `acc[2·np] += a·B₀` and `acc[2·np + 1] += a·B₁` (m16n8k16), where `B₀`, `B₁` are two
/// adjacent 16 × 8 tiles of `V` loaded by one `ldmatrix.x4.trans` from this lane's row at
/// `start` (rows k and k + 8 for matrices 0/2 and 1/3, columns + 8 for matrices 2/3).
#[cube]
pub(crate) fn mma_v_pair<F: Float, NV: Size>(
    a: &Array<Vector<F, Const<2>>>,
    v_s: &SharedMemory<Vector<F, NV>>,
    start: usize,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] np: u32,
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let b = load_b_pair::<F, NV>(v_s, start, true);
    def.execute_inplace(
        a,
        b.index(0usize),
        acc.index_mut(comptime!(2 * np) as usize),
    );
    def.execute_inplace(
        a,
        b.index(1usize),
        acc.index_mut(comptime!(2 * np + 1) as usize),
    );
}

/// Zeroed f32 accumulators of `n_tiles` m16n8 output tiles: per tile, this lane's two
/// 2-vectors (rows `r` and `r + 8`).
#[cube]
pub(crate) fn zero_accumulators(
    #[comptime] n_tiles: u32,
) -> Sequence<Array<Vector<f32, Const<2>>>> {
    let mut acc = Sequence::<Array<Vector<f32, Const<2>>>>::new();
    #[unroll]
    for _ in 0..n_tiles {
        let mut frag = Array::<Vector<f32, Const<2>>>::new(2usize);
        frag[0usize] = Vector::new(0.0f32);
        frag[1usize] = Vector::new(0.0f32);
        acc.push(frag);
    }
    acc
}

/// Sum over the 4 lanes that share a row.
#[cube]
pub(crate) fn quad_sum(v: f32) -> f32 {
    let v = v + plane_shuffle_xor(v, 1);
    v + plane_shuffle_xor(v, 2)
}

/// Transposes the 4 × 4 pairs a lane quad holds, so that the quad's lanes hold whole 8-column
/// tiles of a row: on entry lane `q` of the quad holds, for tiles `t = 0..4` of a group of 4
/// adjacent m16n8 output tiles, the tile's columns `2q, 2q + 1` (`a[2t]`, `a[2t + 1]`: the
/// accumulator layout); on exit it holds the 8 columns of tile `q` (`a[i]` is column `i`).
/// Every lane of the plane must take part (plane shuffles).
#[cube]
pub(crate) fn quad_transpose(a: &mut Array<f32>) {
    let quad = UNIT_POS_PLANE % 4;
    // Lanes `q` and `q ^ 2` swap the off-diagonal 2 × 2 blocks of pairs...
    let low = (quad & 2) == 0;
    #[unroll]
    for i in 0..4usize {
        // Pair i / 2 of the block's first column against pair i / 2 + 2, element i % 2.
        let (near, far) = (comptime!(i), comptime!(i + 4));
        let recv = plane_shuffle_xor(select(low, a[far], a[near]), 2);
        a[far] = select(low, recv, a[far]);
        a[near] = select(low, a[near], recv);
    }
    // ...then lanes `q` and `q ^ 1` the off-diagonal pairs inside each block.
    let even = (quad & 1) == 0;
    #[unroll]
    for i in 0..4usize {
        // Pairs 0 / 1 and 2 / 3: element i % 2 of pair 2·(i / 2) against pair 2·(i / 2) + 1.
        let near = comptime!(4 * (i / 2) + i % 2);
        let far = comptime!(near + 2);
        let recv = plane_shuffle_xor(select(even, a[far], a[near]), 1);
        a[far] = select(even, recv, a[far]);
        a[near] = select(even, a[near], recv);
    }
}
