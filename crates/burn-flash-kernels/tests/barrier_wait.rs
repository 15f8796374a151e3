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
//! Built with `cuda`, run in the GPU suite (any sm_80+ GPU).

#![cfg(feature = "cuda")]

mod common;

use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::barrier::{Barrier, copy_async_checked};
use cubecl::prelude::*;

/// Units per cube.
const UNITS: u32 = 128;

/// One staged step: unit `u` copies `input[cube · UNITS + u]` into shared slot `u`
/// asynchronously, commits and arrives, waits (by token where `by_token`, else by parity 0),
/// then writes its neighbour's slot `(u + 1) % UNITS` to `output`.
#[cube(launch_unchecked)]
fn staged_step(input: &Array<f32>, output: &mut Array<f32>, #[comptime] by_token: bool) {
    let units = UNITS as usize;
    let mut tile = SharedMemory::<f32>::new(units);
    let bar = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    sync_cube();
    let u = UNIT_POS as usize;
    let base = CUBE_POS * units;
    copy_async_checked(
        &input.slice(base + u, base + u + 1),
        &mut tile.slice_mut(u, u + 1),
        1u32,
    );
    bar.commit_copy_async();
    let token = bar.arrive();
    if comptime!(by_token) {
        bar.wait(token);
    } else {
        bar.wait_parity(0u32);
    }
    output[base + u] = tile[(u + 1) % units];
}

/// Both waits give every unit its neighbour's staged element, over several cubes, the output
/// poisoned with NaN first.
#[test]
fn staged_step_waits_by_token_and_by_parity() {
    let client = CudaRuntime::client(&CudaDevice::default());
    let cubes = 6usize;
    let n = cubes * UNITS as usize;
    let seed = common::seed();
    let input = common::draw(n, seed);
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let input_h = client.create_from_slice(&bytes(&input));
    for by_token in [true, false] {
        let output_h = client.create_from_slice(&bytes(&vec![f32::NAN; n]));
        // SAFETY: `cubes` cubes of `UNITS` units index below `n` in both buffers, which hold
        // `n` f32 each.
        unsafe {
            staged_step::launch_unchecked::<CudaRuntime>(
                &client,
                CubeCount::Static(cubes as u32, 1, 1),
                CubeDim::new_1d(UNITS),
                ArrayArg::from_raw_parts(input_h.clone(), n),
                ArrayArg::from_raw_parts(output_h.clone(), n),
                by_token,
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
                "by token {by_token}: element {i} is {got}, want {want}"
            );
        }
    }
}

/// Both kernels lower to CUDA C++ for every architecture the crate targets, without a GPU
/// (`cuda_target`): the token kernel waits on its arrival's token, the parity kernel on the
/// phase's parity.
#[test]
fn staged_step_lowers_for_every_arch() {
    use burn_flash_kernels::cuda_target::{ARCHS, TargetRuntime, take_launches};
    let n = UNITS as usize;
    for arch in ARCHS {
        let client = TargetRuntime::client_of(arch);
        let (input_h, output_h) = (client.empty(n * 4), client.empty(n * 4));
        for by_token in [true, false] {
            // SAFETY: recorded, not run.
            unsafe {
                staged_step::launch_unchecked::<TargetRuntime>(
                    &client,
                    CubeCount::Static(1, 1, 1),
                    CubeDim::new_1d(UNITS),
                    ArrayArg::from_raw_parts(input_h.clone(), n),
                    ArrayArg::from_raw_parts(output_h.clone(), n),
                    by_token,
                );
            }
        }
        // The client hands launches to the server's thread: wait for them.
        cubecl::future::block_on(client.sync()).expect("the target server records");
    }
    let launches = take_launches();
    assert_eq!(launches.len(), 2 * ARCHS.len());
    for (i, l) in launches.iter().enumerate() {
        assert!(l.refused.is_none(), "{}: {:?}", l.arch, l.refused);
        let by_token = i % 2 == 0;
        let waits = if by_token { ".wait(" } else { "wait_parity(" };
        assert!(
            l.source.contains(waits),
            "{} by token {by_token}: no `{waits}` in\n{}",
            l.arch,
            l.source
        );
    }
}
