//! The calls whose launches the check compiles: each is a real call of a public launch
//! function of `burn-flash-kernels` on a [`TargetRuntime`] client, so the plan, the kernel
//! and its comptime configuration are the ones a GPU of that architecture would get.
//!
//! [`calls`] with `all = false` is the representative grid CI compiles: every kernel family
//! on each architecture it targets, every score feature at least once, every head-dim class
//! (64, 128, 256, and odd sizes that round up), each dtype. `all = true` crosses them.

mod attention;
mod rows;

use burn_flash_kernels::cuda_target::{Arch, TargetRuntime};
use burn_flash_kernels::tensor::TensorRef;
use cubecl::ir::{ElemType, FloatKind, UIntKind};
use cubecl::prelude::*;
use cubecl::server::Handle;

/// A client of one target architecture.
pub type Client = ComputeClient<TargetRuntime>;

/// A call's body: launches on a client, or the error the launch function returned.
type Body = Box<dyn Fn(&Client) -> Result<(), String>>;

/// One call of the grid.
pub struct Call {
    /// What it is, e.g. `attention fwd MatrixUnits f16 D128 causal`.
    pub name: String,
    run: Body,
}

impl Call {
    /// Makes the call on `client` (its launches are recorded by the target runtime).
    pub fn run(&self, client: &Client) -> Result<(), String> {
        (self.run)(client)
    }
}

/// A tensor on a target device: its buffer (never read), shape and pitched strides.
struct Owned {
    handle: Handle,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

impl Owned {
    fn new(client: &Client, shape: &[usize], dtype: StorageType) -> Self {
        let layout = client.empty_tensor(shape.into(), dtype.size());
        Self {
            handle: layout.memory,
            shape: shape.to_vec(),
            strides: layout.strides.to_vec(),
        }
    }

    fn r(&self) -> TensorRef<'_> {
        TensorRef {
            handle: &self.handle,
            shape: &self.shape,
            strides: &self.strides,
        }
    }
}

fn float(kind: FloatKind) -> StorageType {
    StorageType::Scalar(ElemType::Float(kind))
}

const F32: StorageType = StorageType::Scalar(ElemType::Float(FloatKind::F32));
const U32: StorageType = StorageType::Scalar(ElemType::UInt(UIntKind::U32));

fn dtype_name(kind: FloatKind) -> &'static str {
    match kind {
        FloatKind::F16 => "f16",
        FloatKind::BF16 => "bf16",
        _ => "f32",
    }
}

/// Every float dtype with `all`, else `few`.
fn dtypes(all: bool, few: &'static [FloatKind]) -> &'static [FloatKind] {
    const ALL: [FloatKind; 3] = [FloatKind::F32, FloatKind::F16, FloatKind::BF16];
    if all { &ALL } else { few }
}

fn push(
    calls: &mut Vec<Call>,
    name: String,
    archs: Vec<Arch>,
    run: impl Fn(&Client) -> Result<(), String> + 'static,
) {
    // A call is made on the architectures its kernel targets.
    if !archs.is_empty() {
        calls.push(Call {
            name,
            run: Box::new(run),
        });
    }
}

/// Every call of the grid on `archs` (module docs).
pub fn calls(archs: &[Arch], all: bool) -> Vec<Call> {
    let mut calls = Vec::new();
    attention::attention(&mut calls, archs, all);
    attention::ampere_backward(&mut calls, archs, all);
    attention::tf32(&mut calls, archs, all);
    attention::decode(&mut calls, archs, all);
    rows::softmax(&mut calls, archs, all);
    rows::softmax_matmul(&mut calls, archs, all);
    rows::rows(&mut calls, archs, all);
    calls
}
