//! The host side of the cooperative-matrix forward: the fragment shape a device offers
//! ([`Fragment`], [`fragment()`], [`choose()`]), the vector width, and the shared-memory
//! layout and its size ([`layout()`], [`shared_bytes()`], [`fits()`]).

use super::*;

/// A cooperative-matrix shape `m × n × k` with 16-bit operands (or f32 ones rounded to TF32)
/// and f32 accumulators, and the plane size the kernel is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fragment {
    /// Rows of `A` and of the accumulator.
    pub m: u32,
    /// Columns of `B` and of the accumulator.
    pub n: u32,
    /// The reduction depth.
    pub k: u32,
    /// Lanes per plane.
    pub plane: u32,
    /// The operands are f32 inputs rounded to TF32 (CUDA's `wmma` m16n16k8, sm_80+): staged in
    /// shared memory as 4-byte values; else the input's 16-bit type.
    pub tf32: bool,
}

impl Fragment {
    /// Lanes per row of a plane's tile.
    pub fn lanes_per_row(&self) -> u32 {
        self.plane / self.m
    }

    /// Planes per cube of `block_q` rows: `m` rows per plane.
    pub fn planes(&self, block_q: u32) -> u32 {
        block_q / self.m
    }

    /// Units per cube of `block_q` rows.
    pub fn units(&self, block_q: u32) -> u32 {
        self.planes(block_q) * self.plane
    }

    /// Bytes of a staged operand element: 4 for TF32, else 2.
    pub fn operand_bytes(&self) -> u32 {
        if self.tf32 { 4 } else { 2 }
    }

    /// The kernels' operand type for inputs of `dtype`: TF32 or `dtype` itself.
    pub fn operand(&self, dtype: StorageType) -> StorageType {
        if self.tf32 {
            StorageType::Scalar(ElemType::Float(FloatKind::TF32))
        } else {
            dtype
        }
    }
}

/// The fragment the device offers for operands of `dtype` (f16 or bf16; with `tf32`, f32
/// rounded to TF32) with f32 accumulators ([`choose`] over the device's `cmma` configurations
/// and plane sizes). `None` where it has none (WGSL, Mesa's lavapipe, f32 without `tf32`, TF32
/// outside CUDA sm_80+).
pub fn fragment<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    tf32: bool,
) -> Option<Fragment> {
    let props = client.properties();
    let hw = &props.hardware;
    choose(
        props.features.matmul.cmma.iter(),
        (hw.plane_size_min, hw.plane_size_max),
        dtype,
        tf32,
    )
}

/// The fragment among `configs` (a device's `cmma` configurations) for operands of `dtype`
/// with f32 accumulators, on planes of (smallest, largest) `plane` lanes: square, 16 × 16 × 16
/// where offered (CUDA's `wmma`, NVIDIA's and AMD's Vulkan drivers), else 8 × 8 × 8 (Metal's
/// simdgroup matrices), with whole rows of it per plane; with `tf32` and f32 `dtype`, TF32
/// operands 16 × 16 × 8 (CUDA's `wmma` on sm_80+). `None` for f32 without `tf32` (or 16-bit
/// with it), planes of varying size, or no such configuration.
pub fn choose<'a>(
    configs: impl Iterator<Item = &'a MmaConfig>,
    plane: (u32, u32),
    dtype: StorageType,
    tf32: bool,
) -> Option<Fragment> {
    let sixteen_bit = [FloatKind::F16, FloatKind::BF16]
        .into_iter()
        .any(|k| dtype == StorageType::Scalar(ElemType::Float(k)));
    let f32_acc = StorageType::Scalar(ElemType::Float(FloatKind::F32));
    let (plane, largest) = plane;
    let takes = if tf32 { dtype == f32_acc } else { sixteen_bit };
    if !takes || plane != largest || plane == 0 {
        return None;
    }
    let operand = if tf32 {
        StorageType::Scalar(ElemType::Float(FloatKind::TF32))
    } else {
        dtype
    };
    configs
        .filter(|c| c.a_type == operand && c.b_type == operand && c.cd_type == f32_acc)
        .filter(|c| {
            let depth = if tf32 {
                c.k == 8 && c.m == 16
            } else {
                c.k == c.m
            };
            c.m == c.n && depth && [8, 16].contains(&c.m)
        })
        .filter(|c| plane.is_multiple_of(c.m) && c.n.is_multiple_of(plane / c.m))
        .map(|c| Fragment {
            m: c.m,
            n: c.n,
            k: c.k,
            plane,
            tf32,
        })
        .max_by_key(|f| f.m)
}

/// The widest vector, in elements (up to 8: 16 bytes of a 16-bit type), that divides the rows
/// and every stride of the tensors (shape, strides), each with a unit stride along its rows,
/// and `block_k / lanes` (the given scores a lane reads per group); 1 otherwise.
pub fn vector(tensors: &[(&[usize], &[usize])], c: FlashConfig, f: Fragment) -> usize {
    let lane_cols = (c.block_k / f.lanes_per_row()) as usize;
    [8, 4, 2]
        .into_iter()
        .find(|&n| {
            lane_cols.is_multiple_of(n)
                && tensors.iter().all(|(shape, strides)| {
                    let last = strides.len() - 1;
                    strides[last] == 1
                        && shape[last].is_multiple_of(n)
                        && strides[..last].iter().all(|s| s.is_multiple_of(n))
                })
        })
        .unwrap_or(1)
}

/// Offsets, in elements, of the regions of the kernel's two shared arrays (the `Q` rows of a
/// pass are staged at 0 before the loop).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SharedLayout {
    /// The step's `K` block (computed scores; the `Q` tile is staged at 0 before the loop).
    pub k_at: u32,
    /// The step's `V` block.
    pub v_at: u32,
    /// The planes' `P` tiles.
    pub p_at: u32,
    /// Length of the 16-bit array.
    pub len: u32,
    /// Length of the f32 array: the planes' score tiles.
    pub s_len: u32,
}

/// Row pitch of the `Q` and `K` tiles.
pub(super) fn d_ld(c: FlashConfig) -> u32 {
    c.head_dim + PAD
}

/// Row pitch of the `V` block.
pub(super) fn v_ld(c: FlashConfig) -> u32 {
    c.value_dim + PAD
}

/// Row pitch of a `P` tile.
pub(super) fn p_ld(c: FlashConfig) -> u32 {
    c.block_k + PAD
}

/// Row pitch of a score tile.
pub(super) fn s_ld(c: FlashConfig) -> u32 {
    c.block_k + S_PAD
}

/// The shared layout of `c`.
pub fn layout(c: FlashConfig) -> SharedLayout {
    let k_len = if c.given() { 0 } else { c.block_k * d_ld(c) };
    let q_len = if c.given() {
        0
    } else {
        c.block_q.min(Q_PASS) * d_ld(c)
    };
    let v_at = k_len;
    let p_at = v_at + c.block_k * v_ld(c);
    SharedLayout {
        k_at: 0,
        v_at,
        p_at,
        len: (p_at + c.block_q * p_ld(c)).max(q_len),
        s_len: c.block_q * s_ld(c),
    }
}

/// Shared memory of [`flash_forward_cmma()`] for `c` on `f`'s operands, in bytes.
pub fn shared_bytes(c: FlashConfig, f: Fragment) -> usize {
    let lay = layout(c);
    lay.len as usize * f.operand_bytes() as usize + lay.s_len as usize * 4
}

/// Whether `c` fits the kernel on fragment `f`: 16 to [`WIDE_BLOCK_Q`] rows in whole planes, whole
/// fragments along the keys, `D` and the output tile, and whole lanes per row of the step's
/// columns.
pub fn fits(c: FlashConfig, f: Fragment) -> bool {
    let lanes = f.lanes_per_row();
    [16, 32, 64, 128].contains(&c.block_q)
        && c.block_q.is_multiple_of(f.m)
        && c.block_k > 0
        && c.block_k.is_multiple_of(f.n)
        && c.block_k.is_multiple_of(f.k)
        && c.block_k.is_multiple_of(4 * lanes)
        && f.n.is_multiple_of(lanes)
        && c.head_dim.is_multiple_of(f.k)
        && c.value_dim.is_multiple_of(f.n)
        && c.value_dim > 0
}
