//! What each CUDA kernel's schedule assumes of the SM, held by `cargo xtask cuda-check`
//! against ptxas for every planned variant: how many of its cubes share an SM (the register
//! budget follows: the registers a thread may use for that many cubes to fit), and, for the
//! matrix-unit kernels, the spill bytes ptxas may report — zero, but for the known spills
//! listed here, which are debts the check keeps from growing (NOTES, "CUDA without a GPU").
//!
//! One table, by kernel: a `#[cube]` kernel is named by its launch function's name (the
//! module of its type), a hand-written one by its entry point.

/// A kernel's budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occupancy {
    /// Cubes of the kernel that its schedule assumes share an SM.
    pub cubes_per_sm: u32,
    /// Bytes of spill stores plus loads ptxas may report for a variant (matrix-unit kernels:
    /// 0 unless a known spill is listed; plain-unit kernels are not held to it).
    pub known_spill_bytes: u32,
}

const fn cubes(cubes_per_sm: u32) -> Occupancy {
    Occupancy {
        cubes_per_sm,
        known_spill_bytes: 0,
    }
}

const fn spilling(cubes_per_sm: u32, known_spill_bytes: u32) -> Occupancy {
    Occupancy {
        cubes_per_sm,
        known_spill_bytes,
    }
}

/// The budgets of kernel `name` (a `#[cube]` kernel's type name, or a hand-written kernel's
/// entry point) on compute capability `cc`; `None` for a kernel that states none.
pub fn of(name: &str, cc: u32) -> Option<Occupancy> {
    let _ = cc;
    // `path::kernel_fn::KernelType<Runtime>` → `kernel_fn`; an entry point stays as it is.
    let path = name.split('<').next().unwrap_or(name);
    let kernel = path.rsplit("::").nth(1).unwrap_or(path);
    let budget = match kernel {
        // Attention and softmax·V forwards.
        // FlashAttention-2's schedule: 4 planes (2 at 64 rows) of up to 255 registers, two
        // cubes per SM. Known: the D 128 variants with score rules spill up to 44 + 52 B,
        // softmax·V's (given scores) up to 48 + 72 B on sm_86 / sm_89.
        "flash_forward_mma" => spilling(2, 120),
        // Eight 16-row planes of fragments (256 threads), one cube per SM. Known: D 256 on
        // CUDA's `wmma` spills up to 240 + 212 B (the path runs on CUDA only when forced).
        "flash_forward_cmma" => spilling(1, 452),
        // Plain units, 256 threads of register tiles: one cube per SM.
        "flash_forward_tiled" | "flash_forward_units" => cubes(1),
        // One producer and two (three at D 64) consumer warpgroups, `setmaxnreg` 24 / 240:
        // one block per SM.
        "burn_flash_hopper_forward" => cubes(1),
        // Backwards.
        // The row prepass `δ = rowsum(dO ⊙ O)`: memory-bound, four cubes per SM.
        "flash_delta" => cubes(4),
        // dK/dV and dQ on `mma.sync`: 4 planes, two cubes per SM (8 warps). Known spills:
        // dK/dV at D 80 up to 12 + 12 B, dQ up to 24 + 24 B.
        "flash_backward_dkv_mma" => spilling(2, 24),
        "flash_backward_dq_mma" => spilling(2, 48),
        // Cooperative matrices on CUDA's `wmma` (forced only): 4 planes, two cubes per SM.
        // Known: dK/dV spills 420–468 B (f16, D 128) and 11 KB (bf16, sm_80); dQ 124 B.
        "flash_backward_dkv_cmma" => spilling(2, 11_284),
        "flash_backward_dq_cmma" => spilling(2, 124),
        // Plain units (256 threads, f32): one cube per SM.
        "flash_backward_dkv" | "flash_backward_dq" | "flash_backward_given_tiled" => cubes(1),
        // Warp-specialised Hopper backward (384 threads): one block per SM. Known: the
        // masked / biased / dropout variants spill up to 244 + 184 B.
        "burn_flash_hopper_backward" => spilling(1, 428),
        "burn_flash_hopper_smm_dx" | "burn_flash_hopper_smm_dv" => cubes(1),
        // The Hopper backward's per-row pre- and post-passes: memory-bound, a full SM.
        "burn_flash_hopper_backward_rows" | "burn_flash_hopper_backward_dq" => cubes(8),
        // Decoding: the split kernel is register-limited (NOTES §6: 2–3 cubes per SM); the
        // merge and the append are memory-bound.
        "flash_decode" => cubes(2),
        "decode_merge" | "kv_append" => cubes(4),
        // The softmax family: a row per plane or cube (up to 512 threads), two cubes per SM
        // for the register tiers; the split and strided tiers stream, four.
        "softmax_rows" | "softmax_backward_rows" => cubes(2),
        "softmax_split_partials"
        | "softmax_split_finish"
        | "softmax_split_exchange"
        | "softmax_strided"
        | "softmax_backward_split_partials"
        | "softmax_backward_split_finish"
        | "softmax_backward_split_exchange"
        | "softmax_backward_strided" => cubes(4),
        // Serving pieces: the few-rows linear holds a K-slice per lane (two cubes), the
        // layer norm streams (four); the copy and the zeroing fill an SM.
        "linear_rows" => cubes(2),
        "layer_norm_rows" => cubes(4),
        "copy_kernel" | "zero_u32_kernel" => cubes(8),
        _ => return None,
    };
    let budget = if kernel == "flash_forward_mma" && crate::mutation::register_budget() {
        Occupancy {
            cubes_per_sm: 4 * budget.cubes_per_sm,
            ..budget
        }
    } else {
        budget
    };
    Some(budget)
}
