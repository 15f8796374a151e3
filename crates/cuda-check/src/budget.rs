//! The budgets a compiled variant is held to, and the summary of a run.

use std::collections::BTreeMap;
use std::fmt::Write;

use burn_flash_kernels::cuda_target::TargetLaunch;
use burn_flash_kernels::occupancy::Occupancy;

use crate::Variant;
use crate::nvrtc::Compiled;

/// Registers of an SM on every target architecture (sm_80 – sm_90).
const SM_REGISTERS: u32 = 65_536;
/// Registers a thread can have.
const MAX_REGISTERS: u32 = 255;

/// The most registers a thread of a `threads`-thread cube may use for `cubes` cubes to fit on
/// an SM at once: registers are allocated per warp in units of 256 (8 a thread).
pub fn register_budget(threads: u32, cubes: u32) -> u32 {
    let warps = threads.div_ceil(32).max(1);
    (SM_REGISTERS / (32 * warps * cubes.max(1)) / 8 * 8).min(MAX_REGISTERS)
}

/// Whether `source` issues matrix instructions (`mma.sync`, `wmma`, `wgmma`).
pub fn matrix_units(source: &str) -> bool {
    source.contains("mma.sync") || source.contains("wmma::") || source.contains("wgmma.")
}

/// A variant against its budgets.
pub struct Verdict {
    /// Its register budget, where its kernel states an occupancy.
    pub register_budget: Option<u32>,
    /// Whether it issues matrix instructions (and must not spill).
    pub matrix_units: bool,
    /// What it breaks (empty: nothing).
    pub failures: Vec<String>,
}

impl Verdict {
    /// Whether it keeps every budget.
    pub fn ok(&self) -> bool {
        self.failures.is_empty()
    }

    /// `ok`, or what it breaks.
    pub fn status(&self) -> String {
        if self.ok() {
            "ok".into()
        } else {
            self.failures.join("; ")
        }
    }
}

/// Holds `launch`, compiled as `compiled`, to its budgets.
pub fn judge(launch: &TargetLaunch, compiled: &Compiled) -> Verdict {
    let threads = launch.cube_dim.num_elems();
    let stated = stated_for(launch);
    let cubes = stated.map(|o| o.cubes_per_sm);
    let mut v = Verdict {
        register_budget: cubes.map(|c| register_budget(threads, c)),
        matrix_units: matrix_units(&launch.source),
        failures: Vec::new(),
    };
    if let Some(why) = &launch.refused {
        v.failures.push(format!("refused before NVRTC: {why}"));
        return v;
    }
    let (r, _) = match compiled {
        Ok(c) => c,
        Err(_) => {
            v.failures.push("NVRTC failed (log below)".into());
            return v;
        }
    };
    match (cubes, v.register_budget) {
        (Some(c), Some(budget)) if r.registers > budget => v.failures.push(format!(
            "{} registers over the budget of {budget} ({c} cubes of {threads} threads per SM)",
            r.registers
        )),
        (None, _) => v.failures.push(format!(
            "no occupancy stated for `{}` (burn_flash_kernels::occupancy)",
            launch.name
        )),
        _ => {}
    }
    let allowed = stated.map_or(0, |o| o.known_spill_bytes);
    if v.matrix_units && r.spill_stores + r.spill_loads > allowed {
        v.failures.push(format!(
            "spills {} B stored, {} B loaded in a matrix-unit kernel (known spills: {allowed} B)",
            r.spill_stores, r.spill_loads
        ));
    }
    let smem = launch.shared_bytes + r.static_smem as usize;
    if smem > launch.arch.max_shared {
        v.failures.push(format!(
            "{smem} B of shared memory over the {} B of {} ({})",
            launch.arch.max_shared, launch.arch.nvrtc, launch.arch.gpu
        ));
    }
    v
}

/// A table by kernel and architecture: variants, most registers (budget), spills, shared
/// memory, NVRTC time.
pub fn summary(rows: &[(&Variant, &(Compiled, bool), &Verdict)]) -> String {
    #[derive(Default)]
    struct Row {
        variants: usize,
        registers: u32,
        budget: u32,
        spills: u32,
        smem: usize,
        ms: f64,
        ms_max: f64,
        failures: usize,
    }
    let mut table: BTreeMap<(String, String), Row> = BTreeMap::new();
    for (v, (c, _), verdict) in rows {
        let row = table
            .entry((v.launch.entry.clone(), v.launch.arch.nvrtc.to_string()))
            .or_default();
        row.variants += 1;
        row.failures += usize::from(!verdict.ok());
        row.smem = row.smem.max(v.launch.shared_bytes);
        if let Some(b) = verdict.register_budget {
            row.budget = row.budget.max(b);
        }
        if let Ok((r, ms)) = c {
            row.registers = row.registers.max(r.registers);
            row.spills = row.spills.max(r.spill_stores + r.spill_loads);
            row.smem = row.smem.max(v.launch.shared_bytes + r.static_smem as usize);
            row.ms += ms;
            row.ms_max = row.ms_max.max(*ms);
        }
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<40} {:<7} {:>4} {:>5} {:>6} {:>7} {:>7} {:>8} {:>8} {:>5}",
        "kernel", "arch", "n", "regs", "budget", "spill B", "smem B", "NVRTC s", "max ms", "fail"
    );
    for ((entry, arch), r) in table {
        let _ = writeln!(
            out,
            "{:<40} {:<7} {:>4} {:>5} {:>6} {:>7} {:>7} {:>8.1} {:>8.0} {:>5}",
            entry,
            arch,
            r.variants,
            r.registers,
            r.budget,
            r.spills,
            r.smem,
            r.ms / 1e3,
            r.ms_max,
            r.failures
        );
    }
    out
}

/// The fields of one CSV line (double-quoted fields may hold commas).
fn csv_fields(line: &str) -> Vec<String> {
    let (mut fields, mut field, mut quoted) = (Vec::new(), String::new(), false);
    for ch in line.chars() {
        match ch {
            '"' => quoted = !quoted,
            ',' if !quoted => fields.push(std::mem::take(&mut field)),
            _ => field.push(ch),
        }
    }
    fields.push(field);
    fields
}

/// The rows of this run whose registers or spills differ from `old` (a previous
/// `resources.csv`), keyed by kernel, variant and arch; variants only one side has are counted.
pub fn compare(old: &str, rows: &[(&Variant, &(Compiled, bool), &Verdict)]) -> String {
    let mut lines = old.lines();
    let header = csv_fields(lines.next().unwrap_or_default());
    let col = |name: &str| header.iter().position(|h| h == name);
    let (Some(k), Some(var), Some(a), Some(reg), Some(ss), Some(sl)) = (
        col("kernel"),
        col("variant"),
        col("arch"),
        col("registers"),
        col("spill_stores"),
        col("spill_loads"),
    ) else {
        return "cuda-check: the baseline is not a resources.csv\n".into();
    };
    let mut before: BTreeMap<(String, String, String), (u32, u32)> = BTreeMap::new();
    for line in lines {
        let f = csv_fields(line);
        let num = |i: usize| f.get(i).and_then(|x| x.parse::<u32>().ok()).unwrap_or(0);
        if let (Some(kernel), Some(variant), Some(arch)) = (f.get(k), f.get(var), f.get(a)) {
            let key = (kernel.clone(), variant.clone(), arch.clone());
            before.insert(key, (num(reg), num(ss) + num(sl)));
        }
    }
    let mut out = String::new();
    let (mut changed, mut new) = (0, 0);
    for (v, (c, _), _) in rows {
        let Ok((r, _)) = c else { continue };
        let key = (
            v.launch.entry.clone(),
            v.call.clone(),
            v.launch.arch.nvrtc.to_string(),
        );
        let Some((regs, spills)) = before.remove(&key) else {
            new += 1;
            continue;
        };
        let now = (r.registers, r.spill_stores + r.spill_loads);
        if now != (regs, spills) {
            changed += 1;
            let _ = writeln!(
                out,
                "changed {} {} [{}]: registers {regs} → {}, spill bytes {spills} → {}",
                key.2, key.0, key.1, now.0, now.1
            );
        }
    }
    let _ = writeln!(
        out,
        "cuda-check: against the baseline, {changed} variants changed, {new} new, {} gone",
        before.len()
    );
    out
}

/// The budgets of `launch`'s kernel: [`stated`] of its name, but the cooperative-matrix
/// backward's kernels on TF32 operands (entries `…_m_tf32_…`) state their own.
pub fn stated_for(launch: &TargetLaunch) -> Option<Occupancy> {
    use burn_flash_kernels::flash::backward::cmma;
    let kernel = launch.name.split('<').next().unwrap_or(launch.name);
    if launch.entry.contains("_m_tf32") {
        if kernel.contains("flash_backward_dq_cmma") {
            return Some(cmma::DQ_TF32_OCCUPANCY);
        }
        if kernel.contains("flash_backward_dkv_cmma") {
            return Some(cmma::DKV_TF32_OCCUPANCY);
        }
    }
    stated(launch.name)
}

/// The budgets kernel `name` states next to its definition: a `#[cube]` kernel's type name (`path::kernel_fn::Type<R>`,
/// found by `kernel_fn`) or a hand-written kernel's entry point; `None` for a kernel that
/// states none.
pub fn stated(name: &str) -> Option<Occupancy> {
    use burn_flash_kernels::flash::{backward, forward};
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
        "burn_flash_sm80_backward" => backward::sm80::OCCUPANCY,
        "burn_flash_sm80_backward_paired" => backward::sm80::PAIRED_OCCUPANCY,
        "burn_flash_hopper_backward_rows" | "burn_flash_hopper_backward_dq" => {
            backward::hopper::ROWS_OCCUPANCY
        }
        "burn_flash_hopper_smm_dx" | "burn_flash_hopper_smm_dv" => {
            backward::hopper_given::OCCUPANCY
        }
        "burn_flash_sm80_smm_dx" | "burn_flash_sm80_smm_dv" => backward::sm80_given::OCCUPANCY,
        "flash_decode" => burn_flash_kernels::decode::kernel::OCCUPANCY,
        "decode_merge" => burn_flash_kernels::decode::kernel::MERGE_OCCUPANCY,
        "kv_append" => burn_flash_kernels::decode::append::OCCUPANCY,
        "softmax_rows" | "softmax_backward_rows" => {
            burn_flash_kernels::softmax::kernel::ROWS_OCCUPANCY
        }
        "softmax_split_partials"
        | "softmax_split_finish"
        | "softmax_split_exchange"
        | "softmax_strided"
        | "softmax_backward_split_partials"
        | "softmax_backward_split_finish"
        | "softmax_backward_split_exchange"
        | "softmax_backward_strided" => burn_flash_kernels::softmax::kernel::STREAM_OCCUPANCY,
        "linear_rows" => burn_flash_kernels::linear::OCCUPANCY,
        "layer_norm_rows" => burn_flash_kernels::norm::OCCUPANCY,
        "copy_kernel" | "zero_u32_kernel" => burn_flash_kernels::copy::OCCUPANCY,
        _ => return None,
    };
    if kernel == "flash_forward_mma" && burn_flash_kernels::mutation::register_budget() {
        return Some(Occupancy {
            cubes_per_sm: 4 * budget.cubes_per_sm,
            ..budget
        });
    }
    Some(budget)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_budgets_follow_the_allocation_unit() {
        // 4 warps, 1 cube: capped at 255; 2 cubes: 256 → 255; 3 cubes: 2048 / 12 = 170 → 168.
        assert_eq!(register_budget(128, 1), 255);
        assert_eq!(register_budget(128, 3), 168);
        // 384 threads (the Hopper kernels), 1 cube: 65536 / 384 = 170 → 168.
        assert_eq!(register_budget(384, 1), 168);
        // 256 threads, 2 cubes: 128; a partial warp counts whole.
        assert_eq!(register_budget(256, 2), 128);
        assert_eq!(register_budget(250, 2), 128);
    }

    #[test]
    fn csv_fields_keep_quoted_commas() {
        assert_eq!(
            csv_fields("k,\"softmax [32, 512] fwd\",sm_80,12"),
            ["k", "softmax [32, 512] fwd", "sm_80", "12"]
        );
    }

    #[test]
    fn matrix_instructions_are_recognised() {
        assert!(matrix_units("asm(\"mma.sync.aligned.m16n8k16\")"));
        assert!(matrix_units("wmma::mma_sync(acc, a, b, acc);"));
        assert!(matrix_units("wgmma.mma_async.sync.aligned"));
        assert!(!matrix_units("float acc = a * b;"));
    }
}
