//! What each CUDA kernel's schedule assumes of the SM, held by `cargo xtask cuda-check`
//! against ptxas for every planned variant: how many of its cubes share an SM (the register
//! budget follows: the registers a thread may use for that many cubes to fit), and, for the
//! matrix-unit kernels, the spill bytes ptxas may report — zero, but for the known spills
//! a kernel lists, which are debts the check keeps from growing (NOTES §12). A ceiling is the
//! largest spill measured with some room: cubecl 0.10 emits a kernel's declarations in an
//! order that changes between processes, and ptxas's allocation moves with it (RESULTS §15).
//!
//! Each kernel states its [`Occupancy`] next to its definition (`OCCUPANCY`,
//! `DKV_OCCUPANCY`, …); the check finds it by the kernel's name (`crates/cuda-check`,
//! `budget::stated`). This module is a leaf: it names no kernel.

/// A kernel's budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occupancy {
    /// Cubes of the kernel that its schedule assumes share an SM.
    pub cubes_per_sm: u32,
    /// Bytes of spill stores plus loads ptxas may report for a variant (matrix-unit kernels:
    /// 0 unless a known spill is listed; plain-unit kernels are not held to it).
    pub known_spill_bytes: u32,
}

impl Occupancy {
    /// `cubes_per_sm` cubes per SM, no spill.
    pub const fn cubes(cubes_per_sm: u32) -> Self {
        Self {
            cubes_per_sm,
            known_spill_bytes: 0,
        }
    }

    /// `cubes_per_sm` cubes per SM, and a known spill of at most `known_spill_bytes`.
    pub const fn spilling(cubes_per_sm: u32, known_spill_bytes: u32) -> Self {
        Self {
            cubes_per_sm,
            known_spill_bytes,
        }
    }
}
