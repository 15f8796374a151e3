//! What each CUDA kernel's schedule assumes of the SM, held by `cargo xtask cuda-check`
//! against ptxas for every planned variant: how many of its cubes share an SM (the register
//! budget follows: the registers a thread may use for that many cubes to fit), and, for the
//! matrix-unit kernels, the spill bytes ptxas may report — zero, but for the known spills
//! a kernel lists, which are debts the check keeps from growing (NOTES §12). A ceiling is the
//! largest spill measured with some room: cubecl 0.10 emits a kernel's declarations in an
//! order that changes between processes, and ptxas's allocation moves with it (RESULTS §16).
//!
//! Each kernel states its [`Occupancy`] next to its definition (`OCCUPANCY`,
//! `DKV_OCCUPANCY`, …); [`of`] finds it by the kernel's name.

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

/// The budgets of kernel `name`: a `#[cube]` kernel's type name (`path::kernel_fn::Type<R>`,
/// found by `kernel_fn`) or a hand-written kernel's entry point; `None` for a kernel that
/// states none.
pub fn of(name: &str) -> Option<Occupancy> {
    use crate::flash::{backward, forward};
    let path = name.split('<').next().unwrap_or(name);
    let kernel = path.rsplit("::").nth(1).unwrap_or(path);
    let budget = match kernel {
        "flash_forward_mma" => forward::mma::OCCUPANCY,
        "flash_forward_cmma" => forward::cmma::OCCUPANCY,
        "flash_forward_tiled" => forward::tiled::OCCUPANCY,
        "flash_forward_units" => forward::units::OCCUPANCY,
        "burn_flash_hopper_forward" => forward::hopper::OCCUPANCY,
        "flash_delta" => backward::DELTA_OCCUPANCY,
        "flash_backward_dkv_mma" => backward::mma_dkv::OCCUPANCY,
        "flash_backward_dq_mma" => backward::mma_dq::OCCUPANCY,
        "flash_backward_dkv_cmma" => backward::cmma::DKV_OCCUPANCY,
        "flash_backward_dq_cmma" => backward::cmma::DQ_OCCUPANCY,
        "flash_backward_dkv" => backward::units::DKV_OCCUPANCY,
        "flash_backward_dq" => backward::units::DQ_OCCUPANCY,
        "flash_backward_given_tiled" => backward::units_given::OCCUPANCY,
        "burn_flash_hopper_backward" => backward::hopper::OCCUPANCY,
        "burn_flash_hopper_backward_rows" | "burn_flash_hopper_backward_dq" => {
            backward::hopper::ROWS_OCCUPANCY
        }
        "burn_flash_hopper_smm_dx" | "burn_flash_hopper_smm_dv" => {
            backward::hopper_given::OCCUPANCY
        }
        "flash_decode" => crate::decode::kernel::OCCUPANCY,
        "decode_merge" => crate::decode::kernel::MERGE_OCCUPANCY,
        "kv_append" => crate::decode::append::OCCUPANCY,
        "softmax_rows" | "softmax_backward_rows" => crate::softmax::kernel::ROWS_OCCUPANCY,
        "softmax_split_partials"
        | "softmax_split_finish"
        | "softmax_split_exchange"
        | "softmax_strided"
        | "softmax_backward_split_partials"
        | "softmax_backward_split_finish"
        | "softmax_backward_split_exchange"
        | "softmax_backward_strided" => crate::softmax::kernel::STREAM_OCCUPANCY,
        "linear_rows" => crate::linear::OCCUPANCY,
        "layer_norm_rows" => crate::norm::OCCUPANCY,
        "copy_kernel" | "zero_u32_kernel" => crate::copy::OCCUPANCY,
        _ => return None,
    };
    if kernel == "flash_forward_mma" && crate::mutation::register_budget() {
        return Some(Occupancy {
            cubes_per_sm: 4 * budget.cubes_per_sm,
            ..budget
        });
    }
    Some(budget)
}
