//! Double-buffered staging of global memory into shared memory with asynchronous copies
//! (`cp.async`, CUDA sm_80+): the copies of step `j + 1` go into one buffer while step `j`
//! computes from the other; one shared barrier per buffer tracks their completion.

use cubecl::{
    prelude::barrier::{Barrier, copy_async_checked},
    prelude::*,
};

/// Copies one vector from `src_at` to `dst_at` asynchronously (`valid`), or zero-fills it.
#[cube]
pub(crate) fn copy_vec<F: Float, NV: Size>(
    src: &Tensor<Vector<F, NV>>,
    dst: &mut SharedMemory<Vector<F, NV>>,
    src_at: usize,
    dst_at: usize,
    valid: bool,
) {
    let nv = NV::value();
    // An invalid vector copies 0 bytes (zero fill) from a valid address.
    let at = select(valid, src_at, 0);
    let len = select(valid, 1usize, 0usize);
    copy_async_checked(
        &src.slice(at, at + len),
        &mut dst.slice_mut(dst_at, dst_at + 1),
        comptime!(nv as u32),
    );
}

/// Commits the copies this unit issued for the step after `step` (into the other of two
/// buffers, tracked by barrier `1 − step % 2`) and arrives on that barrier. Called only where
/// that step exists, so that every arrival is waited on before the cube exits.
#[cube]
pub(crate) fn commit_next(bar0: &Barrier, bar1: &Barrier, step: usize) {
    let parity = step % 2;
    if parity == 0 {
        bar1.commit_copy_async();
        let _token = bar1.arrive();
    } else {
        bar0.commit_copy_async();
        let _token = bar0.arrive();
    }
}

/// Waits for the copies of step `step` (barrier `step % 2`, in its `step / 2`-th phase).
#[cube]
pub(crate) fn wait_step(bar0: &Barrier, bar1: &Barrier, step: usize) {
    let parity = step % 2;
    if parity == 0 {
        bar0.wait_parity(((step / 2) % 2) as u32);
    } else {
        bar1.wait_parity(((step / 2) % 2) as u32);
    }
}
