//! The register-tiled inner loop of the plain-unit kernels (any runtime; f32 arithmetic): an
//! SGEMM-style product `acc += A·B` of 4-vector tiles in shared memory, 128 × 128 outputs per
//! cube of 256 units, 8 × 8 per unit.
//!
//! Unit `(ty, tx)` of a 16 × 16 grid owns rows `4·ty .. +4` and `64 + 4·ty .. +4` and columns
//! `4·tx .. +4` and `64 + 4·tx .. +4` (64 f32 accumulators). Per reduction index it reads two
//! `A` 4-vectors and two `B` 4-vectors (a plane covers 4 × 8 units: 4 distinct `A` and 8
//! distinct `B` vectors, one shared-memory wavefront each) for 64 FMAs. `A` is stored `[k][row
//! 4-vector]` with its 4-vector index XOR-swizzled by `2·(k / 4)`, so that writers holding a
//! 4 × 4 block (transposed into place) hit every bank once while the product's reads stay one
//! wavefront.
//!
//! User: the register-tiled flash forward ([`crate::flash::forward::tiled`]: `A = P`ᵀ, `B = V`).

use cubecl::prelude::*;

/// Units per cube.
pub const UNITS: u32 = 256;
/// Rows of `A` (of the output) per cube.
pub const TILE_M: u32 = 128;
/// Columns of `B` (of the output) per cube.
pub const TILE_N: u32 = 128;
/// Reduction indices per step.
pub const STEP: u32 = 16;

/// Units that stage `A` (the others stage `B`) where the two are staged apart.
pub const SCORE_UNITS: u32 = 128;
/// 4-vectors per row (one `k`) of an `A` or `B` tile.
pub const VECS: u32 = TILE_M / 4;
/// 4-vectors of one buffer of an `A` or `B` tile.
pub const BUF: u32 = STEP * VECS;

/// Element `c` (0..4) of 4-vector `g` of `pre`, as f32.
#[cube]
pub fn pre_at<F: Float, NV: Size>(
    pre: &Array<Vector<F, NV>>,
    g: usize,
    #[comptime] c: usize,
) -> f32 {
    let nv = NV::value();
    let per4 = comptime!(4 / nv);
    let vec = pre[g * per4 + comptime!(c / nv)];
    f32::cast_from(vec[comptime!(c % nv)])
}

/// One step of the product: with `rescale`, rescale the rows whose scale in `a_s` (at `abuf`,
/// one 4-vector per 4 rows) is not 1; then `acc += A·B` over the step's `STEP` reduction
/// indices, from `A` and `B` tiles stored `[k][4-vector]` at `pbuf` in `p_s` and `v_s`; the
/// 4-vector index of `A`, and of `B` with `swizzle_b`, is XOR-swizzled by `2·(k / 4)`.
/// `acc[(4·h + i)·2 + g]` holds row `64·h + 4·ty + i`, columns `64·g + 4·tx ..`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn product_step(
    acc: &mut Array<Vector<f32, Const<4>>>,
    p_s: &SharedMemory<Vector<f32, Const<4>>>,
    v_s: &SharedMemory<Vector<f32, Const<4>>>,
    a_s: &SharedMemory<Vector<f32, Const<4>>>,
    pbuf: usize,
    abuf: usize,
    ty: u32,
    tx: u32,
    #[comptime] rescale: bool,
    #[comptime] swizzle_b: bool,
) {
    // acc[(4·h + i)·2 + g]: row 64·h + 4·ty + i, columns 64·g + 4·tx ..
    #[unroll]
    for h in 0..comptime!(if rescale { 2u32 } else { 0u32 }) {
        let alpha = a_s[abuf + (16 * h + ty) as usize];
        if alpha[0usize] != 1.0f32
            || alpha[1usize] != 1.0f32
            || alpha[2usize] != 1.0f32
            || alpha[3usize] != 1.0f32
        {
            #[unroll]
            for i in 0..4u32 {
                #[unroll]
                for g in 0..2u32 {
                    let at = ((4 * h + i) * 2 + g) as usize;
                    acc[at] = acc[at] * Vector::new(alpha[i as usize]);
                }
            }
        }
    }
    #[unroll]
    for k in 0..STEP {
        let swz = comptime!(2 * (k / 4));
        let row = pbuf + (k * VECS) as usize;
        let mut pa = Array::<Vector<f32, Const<4>>>::new(2usize);
        let mut vb = Array::<Vector<f32, Const<4>>>::new(2usize);
        #[unroll]
        for h in 0..2u32 {
            pa[h as usize] = p_s[row + (16 * h + (ty ^ swz)) as usize];
            let mut bx = tx;
            if comptime!(swizzle_b) {
                bx = tx ^ swz;
            }
            vb[h as usize] = v_s[row + (16 * h + bx) as usize];
        }
        #[unroll]
        for h in 0..2u32 {
            #[unroll]
            for i in 0..4u32 {
                let a = Vector::<f32, Const<4>>::new(pa[h as usize][i as usize]);
                #[unroll]
                for g in 0..2u32 {
                    let at = ((4 * h + i) * 2 + g) as usize;
                    acc[at] += a * vb[g as usize];
                }
            }
        }
    }
}
