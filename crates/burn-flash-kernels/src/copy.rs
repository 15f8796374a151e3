//! A vectorised device-to-device copy: the bandwidth ceiling the benchmarks compare against,
//! measured with the same launch path and timing as the kernels.

use cubecl::{CubeCount, CubeDim, prelude::*, server::Handle};

/// The copy and the zeroing fill an SM.
/// Held by `cargo xtask cuda-check` ([`crate::occupancy`]).
pub const OCCUPANCY: crate::occupancy::Occupancy = crate::occupancy::Occupancy::cubes(8);

#[cube(launch_unchecked)]
fn copy_kernel<F: Float, N: Size>(
    input: &Array<Vector<F, N>>,
    output: &mut Array<Vector<F, N>>,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS < input.len() {
        output[ABSOLUTE_POS] = input[ABSOLUTE_POS];
    }
}

/// Copies `len` elements of `dtype` from `input` to `output` (both contiguous, at least `len`
/// elements long).
pub fn launch_copy<R: Runtime>(
    client: &ComputeClient<R>,
    input: &Handle,
    output: &Handle,
    len: usize,
    dtype: StorageType,
) {
    let vector = client
        .io_optimized_vector_sizes(dtype.size())
        .find(|v| len.is_multiple_of(*v))
        .unwrap_or(1);
    let (count, cube_dim) = linear_grid(client, len / vector);
    // SAFETY: the kernel checks its index against the input length, and the caller guarantees
    // both buffers hold `len` elements.
    unsafe {
        copy_kernel::launch_unchecked::<R>(
            client,
            count,
            cube_dim,
            vector,
            // Array lengths are in scalars; the kernel sees them in vectors.
            ArrayArg::from_raw_parts(input.clone(), len),
            ArrayArg::from_raw_parts(output.clone(), len),
            dtype,
        );
    }
}

#[cube(launch_unchecked)]
fn zero_u32_kernel(output: &mut Array<u32>) {
    if ABSOLUTE_POS < output.len() {
        output[ABSOLUTE_POS] = 0u32;
    }
}

/// Cubes of 256 units for `units` units (at least one cube), as a grid within the device's x
/// limit (kernels read the linear `CUBE_POS` / `ABSOLUTE_POS` and ignore what lies past their
/// length).
fn linear_grid<R: Runtime>(client: &ComputeClient<R>, units: usize) -> (CubeCount, CubeDim) {
    const CUBE_UNITS: usize = 256;
    let cubes = units.div_ceil(CUBE_UNITS).max(1);
    let max_x = client.properties().hardware.max_cube_count.0 as usize;
    let y = cubes.div_ceil(max_x);
    let count = CubeCount::Static(cubes.div_ceil(y) as u32, y as u32, 1);
    (count, CubeDim::new_1d(CUBE_UNITS as u32))
}

/// A new buffer of `len` zeroed `u32` words (the exchange buffers of the kernels that hand
/// values between cubes).
pub fn zeroed_u32<R: Runtime>(client: &ComputeClient<R>, len: usize) -> Handle {
    let buffer = client.empty(len * 4);
    launch_zero_u32::<R>(client, &buffer, len);
    buffer
}

/// Sets the first `len` `u32` words of `buffer` to zero (the exchange buffers of the kernels
/// that hand values between cubes start zeroed).
pub fn launch_zero_u32<R: Runtime>(client: &ComputeClient<R>, buffer: &Handle, len: usize) {
    let (count, cube_dim) = linear_grid(client, len);
    // SAFETY: the kernel checks its index against `len`, which the caller guarantees the
    // buffer holds.
    unsafe {
        zero_u32_kernel::launch_unchecked::<R>(
            client,
            count,
            cube_dim,
            ArrayArg::from_raw_parts(buffer.clone(), len),
        );
    }
}
