//! The forward of `softmax(X)·V` with `P·V` on the matrix units (manual `mma`, f32
//! accumulators), FlashAttention-2 style: each plane owns 16 rows, builds its `P` operand in
//! registers straight from `X` (no shared memory for `P`), rescales its accumulators in
//! registers, and reads `V` from a shared-memory tile.
//!
//! Register layout: element positions come from cubecl's `position_of_nth`; the row statistics
//! assume, as the CUDA (and HIP) `mma` layouts do, that a lane holds elements of rows `r` and
//! `r + 8` only (`slot = row / 8`) and that the 4 lanes sharing a row differ in their two lowest
//! bits (reduced with `plane_shuffle_xor` 1 and 2). Only runtimes with manual `mma` take this
//! path.

use cubecl::{
    CubeCount, CubeDim,
    cmma::MmaDefinition,
    ir::{ElemType, FastMath, FloatKind, MatrixIdent},
    prelude::*,
};

use super::kernel::ForwardTiles;

/// Lanes per plane the matrix-unit kernel is written for.
pub(super) const PLANE: u32 = 32;
/// Rows of an `mma` tile (`m`) and columns of its output tile (`n`).
pub(super) const MMA_M: u32 = 16;
pub(super) const MMA_N: u32 = 8;
/// Padding of a row of the shared `V` tile, in elements: staggers the rows across memory
/// banks so that a fragment load is conflict-free.
pub(super) const V_PAD: u32 = 8;

/// The `mma` reduction depth for an operand type: 16 for f16/bf16, 8 for TF32.
fn mma_k(dtype: StorageType) -> u32 {
    if dtype == StorageType::Scalar(ElemType::Float(FloatKind::F32)) {
        8
    } else {
        16
    }
}

/// The operand type the matrix units see for inputs of `dtype` (TF32 for f32).
fn operand_type(dtype: StorageType) -> StorageType {
    if dtype == StorageType::Scalar(ElemType::Float(FloatKind::F32)) {
        StorageType::Scalar(ElemType::Float(FloatKind::TF32))
    } else {
        dtype
    }
}

/// Whether the device has the manual `mma` this kernel needs for inputs of `dtype`.
pub fn supported<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> bool {
    let props = client.properties();
    let hw = &props.hardware;
    if hw.plane_size_min != PLANE || hw.plane_size_max != PLANE {
        return false;
    }
    let operand = operand_type(dtype);
    let f32_acc = StorageType::Scalar(ElemType::Float(FloatKind::F32));
    props.features.matmul.mma.iter().any(|c| {
        c.a_type == operand
            && c.b_type == operand
            && c.cd_type == f32_acc
            && c.m == MMA_M
            && c.n == MMA_N
            && c.k == mma_k(dtype)
    })
}

/// Units per cube for `block_1` rows: one plane per 16 rows.
pub fn units(block_1: usize) -> u32 {
    (block_1 as u32 / MMA_M) * PLANE
}

/// Whether the 16-bit kernel ([`smm_forward_mma16()`], `ldmatrix` loads) runs for `dtype`.
pub(super) fn uses_ldmatrix<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> bool {
    dtype.size() == 2
        && client
            .properties()
            .features
            .matmul
            .ldmatrix
            .contains(&dtype)
}

/// Shared memory of the kernel: the padded `V` tile, and the padded `X` tile for 16-bit types.
pub fn shared_bytes<R: Runtime>(
    client: &ComputeClient<R>,
    block_1: usize,
    block_2: usize,
    tile_3: usize,
    dtype: StorageType,
) -> usize {
    let pad = V_PAD as usize;
    let v_tile = block_2 * (tile_3 + pad) * dtype.size();
    if uses_ldmatrix(client, dtype) {
        let unpipelined = v_tile + block_1 * (block_2 + pad) * dtype.size();
        unpipelined.max(super::pipelined::shared_bytes(block_2, tile_3))
    } else {
        v_tile
    }
}

/// Widest vector (up to 16 B) that every row of `x` and `v` can be loaded with: unit stride
/// along the row, row and batch strides and row lengths multiples of it.
pub fn load_vector(x: (&[usize], &[usize]), v: (&[usize], &[usize]), dtype: StorageType) -> usize {
    let fits = |shape: &[usize], strides: &[usize], n: usize| {
        strides[2] == 1
            && shape[2].is_multiple_of(n)
            && strides[1].is_multiple_of(n)
            && strides[0].is_multiple_of(n)
    };
    [16 / dtype.size(), 4, 2]
        .into_iter()
        .find(|&n| fits(x.0, x.1, n) && fits(v.0, v.1, n))
        .unwrap_or(1)
}

/// Launches [`smm_forward_mma()`]; `tf32` selects TF32 operands for f32 inputs.
///
/// # Safety
/// The tensor arguments must describe valid buffers of the shapes [`super::dims_of`] checked.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn launch_forward<R: Runtime>(
    client: &ComputeClient<R>,
    count: CubeCount,
    x: TensorArg<R>,
    v: TensorArg<R>,
    out: TensorArg<R>,
    lse: TensorArg<R>,
    tiles: ForwardTiles,
    dtype: StorageType,
    tf32: bool,
    vector: usize,
) {
    let operand = operand_type(dtype);
    // Contiguous elements per register: 32 bits' worth of the operand, 2 for the accumulator.
    let operand_vector = if tf32 { 1 } else { 2 };
    let units = units(tiles.block_1 as usize);
    let pipelined = !tf32
        && uses_ldmatrix(client, dtype)
        && client.properties().features.copy_async
        && vector * dtype.size() == 16
        && super::pipelined::tiles_fit(tiles);
    if pipelined {
        // SAFETY: forwarded from the caller; 16-byte vectors divide every row and stride.
        unsafe {
            super::pipelined::smm_forward_pipelined::launch_unchecked::<R>(
                client,
                count,
                CubeDim::new_1d(units),
                vector,
                x,
                v,
                out,
                lse,
                tiles,
                dtype,
            );
        }
        return;
    }
    if !tf32 && uses_ldmatrix(client, dtype) {
        // SAFETY: forwarded from the caller; `vector` divides every row and stride.
        unsafe {
            smm_forward_mma16::launch_unchecked::<R>(
                client,
                count,
                CubeDim::new_1d(units),
                vector,
                x,
                v,
                out,
                lse,
                tiles,
                dtype,
            );
        }
        return;
    }
    // SAFETY: forwarded from the caller.
    unsafe {
        smm_forward_mma::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_1d(units),
            operand_vector,
            2,
            x,
            v,
            out,
            lse,
            tiles,
            mma_k(dtype),
            dtype,
            operand,
        );
    }
}

/// Slot (0 or 1) of a fragment element's row: the lane's rows are `r` and `r + 8`.
#[cube]
fn slot_of(row: u32) -> usize {
    (row / 8) as usize
}

/// Maximum over the 4 lanes that share a row.
#[cube]
pub(super) fn quad_max(v: f32) -> f32 {
    let v = f32::max(v, plane_shuffle_xor(v, 1));
    f32::max(v, plane_shuffle_xor(v, 2))
}

/// `acc[2·np] += a·B₀` and `acc[2·np + 1] += a·B₁` (m16n8k16), where `B₀`, `B₁` are two
/// adjacent 16 × 8 tiles of `V` loaded by one `ldmatrix.x4.trans` from this lane's row at
/// `start` (rows k and k + 8 for matrices 0/2 and 1/3, columns + 8 for matrices 2/3).
#[cube]
pub(super) fn mma_v_pair<F: Float, NV: Size>(
    a: &Array<Vector<F, Const<2>>>,
    v_s: &SharedMemory<Vector<F, NV>>,
    start: usize,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] np: u32,
) {
    let nv = NV::value();
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let regs = def.load_matrix::<Vector<F, NV>, Const<2>>(
        &v_s.slice(start, start + comptime!(8 / nv)),
        MatrixIdent::B,
        4usize,
        true,
    );
    let mut b0 = Array::<Vector<F, Const<2>>>::new(2usize);
    let mut b1 = Array::<Vector<F, Const<2>>>::new(2usize);
    b0[0usize] = regs[0usize];
    b0[1usize] = regs[1usize];
    b1[0usize] = regs[2usize];
    b1[1usize] = regs[3usize];
    let c0 = acc.index_mut(comptime!(2 * np) as usize);
    def.execute_inplace(a, &b0, c0);
    let c1 = acc.index_mut(comptime!(2 * np + 1) as usize);
    def.execute_inplace(a, &b1, c1);
}

/// Zeroed f32 accumulators of `n_tiles` m16n8 output tiles: per tile, this lane's two
/// 2-vectors (rows `r` and `r + 8`).
#[cube]
pub(super) fn zero_accumulators(
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
fn quad_sum(v: f32) -> f32 {
    let v = v + plane_shuffle_xor(v, 1);
    v + plane_shuffle_xor(v, 2)
}

/// `out = softmax(x)·v` and `lse`, as [`super::kernel::smm_forward()`], on the matrix units.
///
/// `F` is the storage type, `M` the operand type of the `mma` (`F`, or TF32 for f32), `NI` the
/// operand register width and `NC` the accumulator's. Grid: `(output column tiles, row blocks,
/// batch)`; `block_1 / 16` planes per cube.
#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
#[allow(clippy::too_many_arguments)]
pub fn smm_forward_mma<F: Float, M: Float, NI: Size, NC: Size>(
    x: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    #[comptime] t: ForwardTiles,
    #[comptime] mma_k: u32,
    #[define(F)] _dtype: StorageType,
    #[define(M)] _operand: StorageType,
) {
    let b2 = comptime!(t.block_2);
    let t3 = comptime!(t.tile_3);
    let v_ld = comptime!(t.tile_3 + V_PAD);
    let k_steps = comptime!(t.block_2 / mma_k);
    let n_tiles = comptime!(t.tile_3 / MMA_N);
    let units = comptime!((t.block_1 / MMA_M) * PLANE);

    let def = MmaDefinition::<M, M, f32>::new(
        comptime!(MMA_M as usize),
        comptime!(MMA_N as usize),
        comptime!(mma_k as usize),
    );
    let a_len = def.elems_per_lane(MatrixIdent::A);
    let a_vecs = def.vectors_per_lane(MatrixIdent::A);
    let b_vecs = def.vectors_per_lane(MatrixIdent::B);
    let c_vecs = def.vectors_per_lane(MatrixIdent::Accumulator);
    let ni = NI::value();
    let nc = NC::value();

    let batch = CUBE_POS_Z as usize;
    let plane = UNIT_POS / PLANE;
    let lane = UNIT_POS_PLANE;
    let row0 = (CUBE_POS_Y * t.block_1 + plane * MMA_M) as usize;
    let col0 = (CUBE_POS_X * t3) as usize;
    let d1 = x.shape(1);
    let d2 = x.shape(2);
    let d3 = v.shape(2);
    let x_base = batch * x.stride(0);
    let v_base = batch * v.stride(0);
    let (xs1, xs2) = (x.stride(1), x.stride(2));
    let (vs1, vs2) = (v.stride(1), v.stride(2));

    let mut v_s = SharedMemory::<F>::new(comptime!((t.block_2 * (t.tile_3 + V_PAD)) as usize));

    // Accumulators: one `mma` output tile per 8 output columns.
    let mut acc = Sequence::<Array<Vector<f32, NC>>>::new();
    #[unroll]
    for _ in 0..n_tiles {
        let mut frag = Array::<Vector<f32, NC>>::new(c_vecs);
        #[unroll]
        for i in 0..c_vecs {
            frag[i] = Vector::new(0.0f32);
        }
        acc.push(frag);
    }
    // Scores of this step, in the A-operand layout: `k_steps` fragments of `a_len` elements.
    let mut s = Array::<f32>::new(comptime!(k_steps as usize * a_len));
    let mut a_frags = Sequence::<Array<Vector<M, NI>>>::new();
    #[unroll]
    for _ in 0..k_steps {
        a_frags.push(Array::<Vector<M, NI>>::new(a_vecs));
    }
    let mut b_frag = Array::<Vector<M, NI>>::new(b_vecs);

    // Row statistics of the lane's two rows (slots), seeded finite so never −inf − (−inf).
    let mut m = Array::<f32>::new(2usize);
    let mut l = Array::<f32>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        m[r] = f32::min_value();
        l[r] = 0.0f32;
    }

    let steps = d2.div_ceil(b2 as usize);
    for step in 0..steps {
        let j0 = step * b2 as usize;
        // -- the V tile, zeros past the edges --
        #[unroll]
        for e in 0..comptime!(t.block_2 * t.tile_3 / units) {
            let idx = UNIT_POS + e * units;
            let kk = (idx / t3) as usize;
            let cc = idx % t3;
            let mut val = F::from_int(0);
            if j0 + kk < d2 && col0 + (cc as usize) < d3 {
                val = v[v_base + (j0 + kk) * vs1 + (col0 + cc as usize) * vs2];
            }
            v_s[kk * v_ld as usize + cc as usize] = val;
        }

        // -- scores straight from X into registers, and the step's row maxima --
        let mut step_max = Array::<f32>::new(2usize);
        step_max[0usize] = f32::min_value();
        step_max[1usize] = f32::min_value();
        #[unroll]
        for kc in 0..k_steps {
            #[unroll]
            for e in 0..a_len {
                let (r, c) = def.position_of_nth(lane, e as u32, MatrixIdent::A);
                let row = row0 + r as usize;
                let col = j0 + (kc * mma_k + c) as usize;
                let mut val = f32::min_value();
                if row < d1 && col < d2 {
                    val = f32::cast_from(x[x_base + row * xs1 + col * xs2]);
                }
                s[kc as usize * a_len + e] = val;
                let sl = slot_of(r);
                step_max[sl] = f32::max(step_max[sl], val);
            }
        }
        let mut alpha = Array::<f32>::new(2usize);
        #[unroll]
        for r in 0..2usize {
            let m_new = f32::max(m[r], quad_max(step_max[r]));
            alpha[r] = f32::exp(m[r] - m_new);
            m[r] = m_new;
            l[r] *= alpha[r];
        }

        // -- P = e^(x − m) as the A operand (0 past the end of the row) --
        #[unroll]
        for kc in 0..k_steps {
            let frag = a_frags.index_mut(kc as usize);
            #[unroll]
            for i in 0..a_vecs {
                let mut vec = Vector::<M, NI>::empty();
                #[unroll]
                for n in 0..ni {
                    let e = i * ni + n;
                    let (r, c) = def.position_of_nth(lane, e as u32, MatrixIdent::A);
                    let col = j0 + (kc * mma_k + c) as usize;
                    let sl = slot_of(r);
                    let mut p = 0.0f32;
                    if col < d2 {
                        p = f32::exp(s[kc as usize * a_len + e] - m[sl]);
                    }
                    l[sl] += p;
                    vec[n] = M::cast_from(p);
                }
                frag[i] = vec;
            }
        }

        // -- rescale the accumulators --
        #[unroll]
        for nt in 0..n_tiles {
            let frag = acc.index_mut(nt as usize);
            #[unroll]
            for i in 0..c_vecs {
                let mut vec = frag[i];
                #[unroll]
                for n in 0..nc {
                    let (r, _c) =
                        def.position_of_nth(lane, (i * nc + n) as u32, MatrixIdent::Accumulator);
                    vec[n] = vec[n] * alpha[slot_of(r)];
                }
                frag[i] = vec;
            }
        }
        sync_cube();

        // -- acc += P·V_j --
        #[unroll]
        for kc in 0..k_steps {
            let a = a_frags.index(kc as usize);
            #[unroll]
            for nt in 0..n_tiles {
                #[unroll]
                for i in 0..b_vecs {
                    let mut vec = Vector::<M, NI>::empty();
                    #[unroll]
                    for n in 0..ni {
                        let (k, c) = def.position_of_nth(lane, (i * ni + n) as u32, MatrixIdent::B);
                        let idx = (kc * mma_k + k) * v_ld + nt * MMA_N + c;
                        vec[n] = M::cast_from(v_s[idx as usize]);
                    }
                    b_frag[i] = vec;
                }
                let c_frag = acc.index_mut(nt as usize);
                def.execute_inplace(a, &b_frag, c_frag);
            }
        }
        sync_cube();
    }

    // -- normalise and store --
    let mut inv = Array::<f32>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        let total = quad_sum(l[r]);
        inv[r] = select(total == 0.0f32, 0.0f32, 1.0f32 / total);
        let row = row0 + (lane / 4 + r as u32 * 8) as usize;
        if (lane & 3) == 0 && row < d1 && CUBE_POS_X == 0 {
            // ln 0 = −inf: a row without a finite score gets lse = −inf.
            let at = batch * lse.stride(0) + row * lse.stride(1);
            lse[at] = m[r] + f32::ln(total);
        }
    }
    let (os1, os2) = (out.stride(1), out.stride(2));
    let o_base = batch * out.stride(0);
    #[unroll]
    for nt in 0..n_tiles {
        let frag = acc.index(nt as usize);
        #[unroll]
        for i in 0..c_vecs {
            let vec = frag[i];
            #[unroll]
            for n in 0..nc {
                let (r, c) =
                    def.position_of_nth(lane, (i * nc + n) as u32, MatrixIdent::Accumulator);
                let row = row0 + r as usize;
                let col = col0 + (nt * MMA_N + c) as usize;
                if row < d1 && col < d3 {
                    out[o_base + row * os1 + col * os2] = F::cast_from(vec[n] * inv[slot_of(r)]);
                }
            }
        }
    }
}

/// `out = softmax(x)·v` and `lse` for 16-bit inputs (f16, bf16) on the matrix units, with every
/// operand loaded by `ldmatrix` from shared memory.
///
/// Per step of `block_2` columns the cube stages the `X` tile (`block_1 × block_2`) and the `V`
/// tile (`block_2 × tile_3`) in shared memory with `NV`-wide vector loads (16 B when the layout
/// allows); each plane then loads its 16 rows of `X` as `mma` A fragments (`ldmatrix.x4`), takes
/// the row maxima across the 4 lanes of a row, rescales its accumulators, turns the scores into
/// the `P` fragments in registers, and multiplies them by `V` fragments loaded with
/// `ldmatrix.x4.trans` (two 8-column tiles per load). Rows of both tiles are padded by 8
/// elements (16 B), which makes every `ldmatrix` conflict-free.
// `exp` may lower to the hardware's approximate exponential (`ex2.approx` on CUDA: ~2 ulp, +0
// for −inf, NaN for NaN), the precision FlashAttention uses.
#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
pub fn smm_forward_mma16<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    v: &Tensor<Vector<F, NV>>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    #[comptime] t: ForwardTiles,
    #[define(F)] _dtype: StorageType,
) {
    let nv = NV::value();
    let b2 = comptime!(t.block_2);
    let t3 = comptime!(t.tile_3);
    // Row pitches of the staged tiles, in elements and in vectors.
    let x_ld = comptime!(t.block_2 + V_PAD);
    let v_ld = comptime!(t.tile_3 + V_PAD);
    let x_ldv = comptime!(((t.block_2 + V_PAD) as usize) / nv);
    let v_ldv = comptime!(((t.tile_3 + V_PAD) as usize) / nv);
    let k_steps = comptime!(t.block_2 / 16);
    let n_pairs = comptime!(t.tile_3 / 16);
    let units = comptime!((t.block_1 / MMA_M) * PLANE);

    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let c_vecs = def.vectors_per_lane(MatrixIdent::Accumulator);

    let batch = CUBE_POS_Z as usize;
    let plane = UNIT_POS / PLANE;
    let lane = UNIT_POS_PLANE;
    let block_row0 = (CUBE_POS_Y * t.block_1) as usize;
    let row0 = block_row0 + (plane * MMA_M) as usize;
    let col0 = (CUBE_POS_X * t3) as usize;
    let d1 = out.shape(1);
    let d2 = x.shape(2);
    let d3 = out.shape(2);
    let x_base = batch * x.stride(0);
    let v_base = batch * v.stride(0);
    let (xs1, xs2) = (x.stride(1), x.stride(2));
    let (vs1, vs2) = (v.stride(1), v.stride(2));

    let mut x_s = SharedMemory::<Vector<F, NV>>::new(comptime!(t.block_1 as usize * x_ldv));
    let mut v_s = SharedMemory::<Vector<F, NV>>::new(comptime!(t.block_2 as usize * v_ldv));

    let mut acc = Sequence::<Array<Vector<f32, Const<2>>>>::new();
    #[unroll]
    for _ in 0..comptime!(t.tile_3 / MMA_N) {
        let mut frag = Array::<Vector<f32, Const<2>>>::new(c_vecs);
        #[unroll]
        for i in 0..c_vecs {
            frag[i] = Vector::new(0.0f32);
        }
        acc.push(frag);
    }
    let mut m = Array::<f32>::new(2usize);
    let mut l = Array::<f32>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        m[r] = f32::min_value();
        l[r] = 0.0f32;
    }
    // This lane's row and column inside an 8×8 matrix of an `ldmatrix.x4`.
    let mat = lane / 8;
    let mat_row = lane % 8;

    let steps = d2.div_ceil(b2 as usize);
    for step in 0..steps {
        let j0 = step * b2 as usize;
        // -- stage X and V (zeros outside the tensors) --
        let x_vecs_row = comptime!(t.block_2 as usize / nv);
        #[unroll]
        for e in 0..comptime!((t.block_1 * t.block_2) as usize / nv / units as usize) {
            let idx = UNIT_POS as usize + e * units as usize;
            let (r, cv) = (idx / x_vecs_row, idx % x_vecs_row);
            let (row, col) = (block_row0 + r, j0 + cv * nv);
            let mut val = Vector::<F, NV>::new(F::from_int(0));
            if row < d1 && col < d2 {
                val = x[(x_base + row * xs1 + col * xs2) / nv];
            }
            x_s[r * x_ldv + cv] = val;
        }
        let v_vecs_row = comptime!(t.tile_3 as usize / nv);
        let v_vecs = comptime!((t.block_2 * t.tile_3) as usize / nv);
        #[unroll]
        for e in 0..comptime!(v_vecs.div_ceil(units as usize)) {
            let idx = UNIT_POS as usize + e * units as usize;
            if idx < v_vecs {
                let (k, cv) = (idx / v_vecs_row, idx % v_vecs_row);
                let (row, col) = (j0 + k, col0 + cv * nv);
                let mut val = Vector::<F, NV>::new(F::from_int(0));
                if row < d2 && col < d3 {
                    val = v[(v_base + row * vs1 + col * vs2) / nv];
                }
                v_s[k * v_ldv + cv] = val;
            }
        }
        sync_cube();

        // -- scores as A fragments, and the step's row maxima --
        let mut step_max = Array::<f32>::new(2usize);
        step_max[0usize] = f32::min_value();
        step_max[1usize] = f32::min_value();
        #[unroll]
        for kc in 0..k_steps {
            let r = plane * MMA_M + (mat % 2) * 8 + mat_row;
            let c = kc * 16 + (mat / 2) * 8;
            let start = (r * x_ld + c) as usize / nv;
            let regs = def.load_matrix::<Vector<F, NV>, Const<2>>(
                &x_s.slice(start, start + comptime!(8 / nv)),
                MatrixIdent::A,
                4usize,
                false,
            );
            #[unroll]
            for i in 0..4usize {
                #[unroll]
                for n in 0..2usize {
                    let e = i * 2 + n;
                    let (er, ec) = def.position_of_nth(lane, e as u32, MatrixIdent::A);
                    let col = j0 + (kc * 16 + ec) as usize;
                    let mut val = f32::min_value();
                    if col < d2 {
                        val = f32::cast_from(regs[i][n]);
                    }
                    let sl = slot_of(er);
                    step_max[sl] = f32::max(step_max[sl], val);
                }
            }
        }
        let mut alpha = Array::<f32>::new(2usize);
        #[unroll]
        for r in 0..2usize {
            let m_new = f32::max(m[r], quad_max(step_max[r]));
            alpha[r] = f32::exp(m[r] - m_new);
            m[r] = m_new;
            l[r] *= alpha[r];
        }

        // -- rescale the accumulators --
        #[unroll]
        for nt in 0..comptime!(t.tile_3 / MMA_N) {
            let frag = acc.index_mut(nt as usize);
            #[unroll]
            for i in 0..c_vecs {
                let mut vec = frag[i];
                #[unroll]
                for n in 0..2usize {
                    let (r, _c) =
                        def.position_of_nth(lane, (i * 2 + n) as u32, MatrixIdent::Accumulator);
                    vec[n] = vec[n] * alpha[slot_of(r)];
                }
                frag[i] = vec;
            }
        }

        // -- per 16 columns: P = e^(x − m) as an A fragment (scores reloaded from shared
        // memory rather than kept in registers), then acc += P·V, two 8-column tiles of V per
        // `ldmatrix.x4.trans` --
        #[unroll]
        for kc in 0..k_steps {
            let r = plane * MMA_M + (mat % 2) * 8 + mat_row;
            let c = kc * 16 + (mat / 2) * 8;
            let start = (r * x_ld + c) as usize / nv;
            let regs = def.load_matrix::<Vector<F, NV>, Const<2>>(
                &x_s.slice(start, start + comptime!(8 / nv)),
                MatrixIdent::A,
                4usize,
                false,
            );
            let mut a = Array::<Vector<F, Const<2>>>::new(4usize);
            #[unroll]
            for i in 0..4usize {
                let mut vec = Vector::<F, Const<2>>::empty();
                #[unroll]
                for n in 0..2usize {
                    let e = i * 2 + n;
                    let (er, ec) = def.position_of_nth(lane, e as u32, MatrixIdent::A);
                    let col = j0 + (kc * 16 + ec) as usize;
                    let sl = slot_of(er);
                    let mut p = 0.0f32;
                    if col < d2 {
                        p = f32::exp(f32::cast_from(regs[i][n]) - m[sl]);
                    }
                    l[sl] += p;
                    vec[n] = F::cast_from(p);
                }
                a[i] = vec;
            }
            #[unroll]
            for np in 0..n_pairs {
                let k = kc * 16 + (mat % 2) * 8 + mat_row;
                let c = np * 16 + (mat / 2) * 8;
                let start = (k * v_ld + c) as usize / nv;
                mma_v_pair::<F, NV>(&a, &v_s, start, &mut acc, np);
            }
        }
        sync_cube();
    }

    // -- normalise and store --
    let mut inv = Array::<f32>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        let total = quad_sum(l[r]);
        inv[r] = select(total == 0.0f32, 0.0f32, 1.0f32 / total);
        let row = row0 + (lane / 4 + r as u32 * 8) as usize;
        if (lane & 3) == 0 && row < d1 && CUBE_POS_X == 0 {
            let at = batch * lse.stride(0) + row * lse.stride(1);
            lse[at] = m[r] + f32::ln(total);
        }
    }
    let (os1, os2) = (out.stride(1), out.stride(2));
    let o_base = batch * out.stride(0);
    #[unroll]
    for nt in 0..comptime!(t.tile_3 / MMA_N) {
        let frag = acc.index(nt as usize);
        #[unroll]
        for i in 0..c_vecs {
            let vec = frag[i];
            #[unroll]
            for n in 0..2usize {
                let (r, c) =
                    def.position_of_nth(lane, (i * 2 + n) as u32, MatrixIdent::Accumulator);
                let row = row0 + r as usize;
                let col = col0 + (nt * MMA_N + c) as usize;
                if row < d1 && col < d3 {
                    out[o_base + row * os1 + col * os2] = F::cast_from(vec[n] * inv[slot_of(r)]);
                }
            }
        }
    }
}
