//! Reductions across the units that share one row of a cube.
//!
//! A cube is laid out as `CUBE_DIM_X` units per row times `CUBE_DIM_Y` rows. The units of one
//! row are consecutive in the linear unit index, so when `CUBE_DIM_X` is a power of two no larger
//! than the plane, a row lives inside one plane and a butterfly of `plane_shuffle_xor` reduces it
//! without leaving registers. Wider rows reduce per plane first and then across planes through
//! shared memory. Runtimes without plane operations use a shared-memory tree.

use cubecl::prelude::*;

/// How the units of one row are reduced: a comptime part of every row kernel's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupShape {
    /// Units per row (`CUBE_DIM_X`), a power of two.
    pub units_per_row: u32,
    /// Rows per cube (`CUBE_DIM_Y`).
    pub rows_per_cube: u32,
    /// Plane (warp) width when plane operations are used; `0` selects the shared-memory tree.
    pub plane_size: u32,
}

impl GroupShape {
    /// Shared-memory slots a reduction over this shape needs.
    pub fn shared_len(&self) -> usize {
        let per_row = if self.plane_size == 0 {
            self.units_per_row
        } else {
            self.units_per_row.div_ceil(self.plane_size)
        };
        (per_row * self.rows_per_cube).max(1) as usize
    }
}

/// `max(a, b)` (`is_max`) or `a + b`: the step of a max or sum reduction.
#[cube]
pub(crate) fn combine(a: f32, b: f32, #[comptime] is_max: bool) -> f32 {
    if comptime!(is_max) {
        f32::max(a, b)
    } else {
        a + b
    }
}

/// Reduces `value` over the units of the calling unit's row (max or sum) and returns the result
/// to every unit of the row.
///
/// Every unit of the cube must call this (it synchronises the cube). `smem` must hold
/// [`GroupShape::shared_len`] slots and must not be shared with another reduction whose results
/// are still being read.
#[cube]
pub fn group_reduce(
    value: f32,
    smem: &mut SharedMemory<f32>,
    #[comptime] is_max: bool,
    #[comptime] shape: GroupShape,
) -> f32 {
    let x = comptime!(shape.units_per_row);
    let ps = comptime!(shape.plane_size);
    let ux = UNIT_POS_X;
    let uy = UNIT_POS_Y;
    let mut v = value;
    if comptime!(ps > 0) {
        // Butterfly inside the plane over `min(x, ps)` lanes: after log2 steps every lane holds
        // the reduction of its group.
        let mut offset = comptime!(u32::min(x, ps) / 2).runtime();
        while offset > 0 {
            v = combine(v, plane_shuffle_xor(v, offset), is_max);
            offset /= 2;
        }
        if comptime!(x > ps) {
            let planes_per_row = comptime!(x / ps);
            let base = uy * planes_per_row;
            let lane = ux % ps;
            if lane == 0 {
                smem[(base + ux / ps) as usize] = v;
            }
            sync_cube();
            v = smem[base as usize];
            for p in 1..planes_per_row {
                v = combine(v, smem[(base + p) as usize], is_max);
            }
        }
    } else if comptime!(x > 1) {
        let base = uy * x;
        smem[(base + ux) as usize] = v;
        sync_cube();
        let mut active = comptime!(x / 2).runtime();
        while active > 0 {
            if ux < active {
                let merged = combine(
                    smem[(base + ux) as usize],
                    smem[(base + ux + active) as usize],
                    is_max,
                );
                smem[(base + ux) as usize] = merged;
            }
            sync_cube();
            active /= 2;
        }
        v = smem[base as usize];
    }
    v
}

/// `l · e^(m − reference)`: a partial sum `l` taken relative to `m` (or to 0 where `m` is −inf,
/// and then `l` is 0), moved to `reference ≥ m`. 0 for `m = −inf`, whatever the reference:
/// `0 · e^(0 − reference)` is NaN once `e^(−reference)` overflows (a row maximum below −88).
#[cube]
pub fn rebase(m: f32, l: f32, reference: f32, neg_inf: f32) -> f32 {
    select(m == neg_inf, 0.0f32, l * f32::exp(m - reference))
}

/// The reference a partial sum is taken relative to: `m`, or 0 when `m` is −inf (a fully
/// masked part: `x − m` would be `−inf − (−inf) = NaN`).
#[cube]
pub fn reference(m: f32, neg_inf: f32) -> f32 {
    select(m == neg_inf, 0.0f32, m)
}

/// Offset, in scalars, of the first element of `row`, where rows enumerate every index of the
/// tensor's dimensions other than `dim` (last dimension fastest).
#[cube]
pub fn row_offset<T: CubePrimitive>(tensor: &Tensor<T>, row: usize, dim: usize) -> usize {
    let rank = tensor.rank();
    let mut rem = row;
    let mut offset = 0;
    for i in 0..rank {
        let d = rank - 1 - i;
        if d != dim {
            let size = tensor.shape(d);
            offset += (rem % size) * tensor.stride(d);
            rem /= size;
        }
    }
    offset
}
