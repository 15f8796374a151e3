//! The two-kernel diagnostic of compute-sanitizer synccheck's "Missing wait" on the `#[cube]`
//! `mma.sync` kernels (NOTES.md §11, item 14): they stage tiles with `cp.async` arrivals on
//! cubecl's `Barrier` (libcu++ `cuda::barrier`) and wait with `wait_parity`. Each kernel here
//! does one staged step the same way — every unit copies one element into shared memory with
//! `cp.async`, commits the copies to the barrier and arrives — and then waits either with the
//! arrival's token (`Barrier::wait`) or with the phase's parity (`Barrier::wait_parity`, as the
//! kernels do), then reads its neighbour's element. Both must give the shifted input (the test);
//! run under `compute-sanitizer --tool synccheck`, a report on the parity kernel alone says that
//! synccheck does not count `wait_parity` as the wait for a unit's own arrival (a false report
//! on the `mma.sync` kernels), one on both kernels a real missing wait in cubecl's lowering.
//! A third kernel stages with plain stores and waits by token: the control without a `cp.async`
//! arrival. s56's first run (H100): the token kernel alone reported "Missing wait" at every
//! unit's `arrive` (and synccheck aborted it), so the report does not come from
//! `wait_parity`; one test per kernel now, each run in its own process.
//! Built with `cuda`, run in the GPU suite (any sm_80+ GPU).

#![cfg(feature = "cuda")]

mod common;

use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::barrier::{Barrier, copy_async_checked};
use cubecl::prelude::*;

/// Units per cube.
const UNITS: u32 = 128;

/// How a kernel's one step stages and waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Step {
    /// `cp.async` committed to the barrier, then the unit's arrival, waited by its token.
    CopyToken,
    /// The same, waited by the phase's parity (how the `mma.sync` kernels wait).
    CopyParity,
    /// A plain load and store into shared memory, then the arrival waited by its token: the
    /// barrier without `cp.async` (the control).
    PlainToken,
}

/// One staged step: unit `u` puts `input[cube · UNITS + u]` into shared slot `u` (`step`
/// says how), arrives, waits, then writes its neighbour's slot `(u + 1) % UNITS` to `output`.
#[cube(launch_unchecked)]
fn staged_step(input: &Array<f32>, output: &mut Array<f32>, #[comptime] step: Step) {
    let units = UNITS as usize;
    let mut tile = SharedMemory::<f32>::new(units);
    let bar = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    sync_cube();
    let u = UNIT_POS as usize;
    let base = CUBE_POS * units;
    if comptime!(step == Step::PlainToken) {
        tile[u] = input[base + u];
    } else {
        copy_async_checked(
            &input.slice(base + u, base + u + 1),
            &mut tile.slice_mut(u, u + 1),
            1u32,
        );
        bar.commit_copy_async();
    }
    let token = bar.arrive();
    if comptime!(step == Step::CopyParity) {
        bar.wait_parity(0u32);
    } else {
        bar.wait(token);
    }
    output[base + u] = tile[(u + 1) % units];
}

/// `step` gives every unit its neighbour's staged element, over several cubes, the output
/// poisoned with NaN first. One kernel a test, so that compute-sanitizer's report (and a
/// launch it aborts) belongs to one kernel.
fn check_step(step: Step) {
    let client = CudaRuntime::client(&CudaDevice::default());
    let cubes = 6usize;
    let n = cubes * UNITS as usize;
    let seed = common::seed();
    let input = common::draw(n, seed);
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let input_h = client.create_from_slice(&bytes(&input));
    let output_h = client.create_from_slice(&bytes(&vec![f32::NAN; n]));
    // SAFETY: `cubes` cubes of `UNITS` units index below `n` in both buffers, which hold `n`
    // f32 each.
    unsafe {
        staged_step::launch_unchecked::<CudaRuntime>(
            &client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(UNITS),
            ArrayArg::from_raw_parts(input_h.clone(), n),
            ArrayArg::from_raw_parts(output_h.clone(), n),
            step,
        );
    }
    let out = client.read_one(output_h).expect("reads `output`");
    let units = UNITS as usize;
    for (i, c) in out.chunks_exact(4).enumerate() {
        let got = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        let (cube, u) = (i / units, i % units);
        let want = input[cube * units + (u + 1) % units];
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "{step:?}: element {i} is {got}, want {want}"
        );
    }
}

/// `cp.async` staging waited by the arrival's token.
#[test]
fn staged_copy_waits_by_token() {
    check_step(Step::CopyToken);
}

/// `cp.async` staging waited by parity.
#[test]
fn staged_copy_waits_by_parity() {
    check_step(Step::CopyParity);
}

/// Plain staging waited by the arrival's token (no `cp.async` arrival on the barrier).
#[test]
fn plain_store_waits_by_token() {
    check_step(Step::PlainToken);
}

/// The kernels lower to CUDA C++ for every architecture the crate targets, without a GPU
/// (`cuda_target`): the token kernels wait on their arrival's token, the parity kernel on the
/// phase's parity; only the copying kernels arrive through `cp.async`.
#[test]
fn staged_step_lowers_for_every_arch() {
    use burn_flash_kernels::cuda_target::{ARCHS, TargetRuntime, take_launches};
    let n = UNITS as usize;
    let steps = [Step::CopyToken, Step::CopyParity, Step::PlainToken];
    for arch in ARCHS {
        let client = TargetRuntime::client_of(arch);
        let (input_h, output_h) = (client.empty(n * 4), client.empty(n * 4));
        for step in steps {
            // SAFETY: recorded, not run.
            unsafe {
                staged_step::launch_unchecked::<TargetRuntime>(
                    &client,
                    CubeCount::Static(1, 1, 1),
                    CubeDim::new_1d(UNITS),
                    ArrayArg::from_raw_parts(input_h.clone(), n),
                    ArrayArg::from_raw_parts(output_h.clone(), n),
                    step,
                );
            }
        }
        // The client hands launches to the server's thread: wait for them.
        cubecl::future::block_on(client.sync()).expect("the target server records");
    }
    let launches = take_launches();
    assert_eq!(launches.len(), steps.len() * ARCHS.len());
    for (i, l) in launches.iter().enumerate() {
        assert!(l.refused.is_none(), "{}: {:?}", l.arch, l.refused);
        let step = steps[i % steps.len()];
        let waits = if step == Step::CopyParity {
            "wait_parity("
        } else {
            ".wait("
        };
        assert!(
            l.source.contains(waits),
            "{} {step:?}: no `{waits}` in\n{}",
            l.arch,
            l.source
        );
        let copies = l.source.contains("cp.async");
        assert_eq!(
            copies,
            step != Step::PlainToken,
            "{} {step:?}: cp.async",
            l.arch
        );
    }
}
