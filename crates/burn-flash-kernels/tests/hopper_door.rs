//! Issue 35's door on the GPU: a hand-written CUDA kernel (TMA bulk copy, `mbarrier`,
//! `elect.sync`) compiled by cubecl-cuda's NVRTC for `sm_90a` and launched through the same
//! client as every other kernel. Needs a Hopper GPU: built with `cuda`, run in the GPU suite.

#![cfg(feature = "cuda")]

mod common;

use burn_flash_kernels::hopper::{self, door};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;

/// SplitMix64 from `seed`: the inputs of one run (the seed is printed to replay it).
fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    common::splitmix(n, seed)
        .map(|z| ((z >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0)
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `out = 2·a + s` for lengths inside one block, across blocks and with a partial last block;
/// every element against an f64 reference (the f32 result rounds once: exact to half an ulp);
/// the output poisoned with NaN first; the sm_90a branch compiled in and one lane elected per
/// warp.
#[test]
fn hand_written_kernel_runs_through_the_client() {
    let client = CudaRuntime::client(&CudaDevice::default());
    assert!(
        hopper::sm90(&client),
        "the door test needs a Hopper GPU (sm_90): this is the GPU suite"
    );
    let seed = common::seed();
    for (case, n) in [4usize, 256, 1028, 256 * 37 + 100].into_iter().enumerate() {
        let a = random_f32(n, seed.wrapping_add(case as u64));
        let s = a[0] * 0.37 + 1.25;
        let a_h = client.create_from_slice(&f32_bytes(&a));
        let out_h = client.create_from_slice(&f32_bytes(&vec![f32::NAN; n]));
        let flags_h = client.create_from_slice(&[0u8; 8]);
        door::launch(&client, &a_h, &out_h, &flags_h, n, s)
            .unwrap_or_else(|e| panic!("n {n}: {e}"));
        let out = to_f32(&client.read_one(out_h).expect("reads `out`"));
        let flags = client.read_one(flags_h).expect("reads `flags`");
        let flags = [
            u32::from_le_bytes([flags[0], flags[1], flags[2], flags[3]]),
            u32::from_le_bytes([flags[4], flags[5], flags[6], flags[7]]),
        ];
        for (i, (&got, &x)) in out.iter().zip(&a).enumerate() {
            let want = 2.0 * f64::from(x) + f64::from(s);
            let ulp = f64::from(f32::EPSILON) * want.abs().max(f64::from(f32::MIN_POSITIVE));
            assert!(
                (f64::from(got) - want).abs() <= 0.5 * ulp,
                "n {n}: out[{i}] = {got}, want {want}"
            );
        }
        assert_eq!(flags[0], 1, "n {n}: the sm_90a branch did not run");
        let blocks = n.div_ceil(door::BLOCK as usize) as u32;
        assert_eq!(
            flags[1], blocks,
            "n {n}: one elected lane per block's first warp"
        );
    }
}

/// Bad input is refused before any launch: a length bulk copies cannot move, a buffer too
/// short for `n`.
#[test]
fn bad_input_is_refused() {
    let client = CudaRuntime::client(&CudaDevice::default());
    let a = client.create_from_slice(&[0u8; 64]);
    let out = client.create_from_slice(&[0u8; 64]);
    let flags = client.create_from_slice(&[0u8; 8]);
    if !hopper::sm90(&client) {
        assert_eq!(
            door::launch(&client, &a, &out, &flags, 16, 1.0),
            Err(door::DoorError::NotHopper)
        );
        return;
    }
    assert_eq!(
        door::launch(&client, &a, &out, &flags, 6, 1.0),
        Err(door::DoorError::Length(6))
    );
    assert_eq!(
        door::launch(&client, &a, &out, &flags, 32, 1.0),
        Err(door::DoorError::Buffer {
            arg: "a",
            needed: 128,
            got: 64
        })
    );
}

/// One `wgmma.mma_async` (m64n64k16, f16 → f32, both operands from shared memory through
/// no-swizzle descriptors) against the f64 product: the inputs are multiples of 1/8, so every
/// product and sum is exact in f32 and the result must match to the bit. A wrong descriptor
/// (LBO/SBO swapped), a wrong core-matrix layout or a wrong accumulator mapping moves elements.
#[test]
fn wgmma_through_the_door() {
    let client = CudaRuntime::client(&CudaDevice::default());
    assert!(hopper::sm90(&client), "needs a Hopper GPU (sm_90)");
    let seed = common::seed();
    let draw = |salt: u64| -> Vec<f32> {
        random_f32(64 * 16, seed ^ salt)
            .into_iter()
            .map(|x| (x * 16.0).round() / 8.0)
            .collect()
    };
    let (a, bt) = (draw(0x5a), draw(0xa5));
    let bytes = |v: &[f32]| -> Vec<u8> {
        v.iter()
            .flat_map(|&x| common::f16_bits(x).to_le_bytes())
            .collect()
    };
    let a_h = client.create_from_slice(&bytes(&a));
    let bt_h = client.create_from_slice(&bytes(&bt));
    let out_h = client.create_from_slice(&f32_bytes(&vec![f32::NAN; 64 * 64]));
    door::launch_wgmma(&client, &a_h, &bt_h, &out_h).expect("launches");
    let out = to_f32(&client.read_one(out_h).expect("reads `out`"));
    for m in 0..64 {
        for n in 0..64 {
            let want: f64 = (0..16)
                .map(|k| f64::from(a[m * 16 + k]) * f64::from(bt[n * 16 + k]))
                .sum();
            assert_eq!(f64::from(out[m * 64 + n]), want, "out[{m}][{n}]");
        }
    }
}
