//! Hand-written CUDA for Hopper (sm_90), launched through cubecl's own client (issue 35): the
//! instructions a `#[cube]` kernel cannot issue — `wgmma`, TMA bulk copies, `mbarrier`,
//! `setmaxnreg`, `elect.sync` — written as CUDA C++ with inline PTX and compiled by the same
//! NVRTC, cache, streams and memory pools as every other Burn op.
//!
//! How (cubecl 0.10, read from `cubecl-cuda/src/compute/context.rs` and
//! `cubecl-runtime/src/kernel.rs`):
//! - a [`task::HandWritten`] is a `CubeTask<CudaCompiler>`: its `compile` returns a
//!   `CompiledKernel` whose `source` is ours and whose `entrypoint_name` names our
//!   `extern "C" __global__` function. NVRTC compiles it for `sm_{major}{minor}a` (so `sm_90a`
//!   on H100/H200, where `wgmma` and `setmaxnreg` exist);
//! - the context reads one thing from the kernel's `repr`: its dynamic shared memory, which
//!   [`task::HandWritten`] takes from a `#[cube]` shell kernel that allocates exactly that many
//!   bytes (the shell is compiled, never launched);
//! - the launch passes the buffers in the order pushed, then one by-value struct holding the
//!   scalars (`MetadataBindingInfo` with no dynamic part): the hand-written signature is
//!   `(T* buffer_0, …, const __grid_constant__ Params p)`;
//! - the `KernelId` carries the source's hash, the entry point, the block and the shared
//!   memory, so that cubecl's in-memory and on-disk caches never mix two sources.
//!
//! Clusters come only from `__cluster_dims__` in the source (the launch is a plain
//! `cuLaunchKernel`). Every Hopper-only instruction sits under `__CUDA_ARCH_FEAT_SM90_ALL`,
//! since NVRTC gets `sm_100a` on Blackwell, which has no `wgmma`; the host checks the device
//! first ([`sm90`]).
//!
//! [`door`]: the first kernel through this path — a TMA bulk copy into shared memory completed
//! on an `mbarrier`, `elect.sync`, and a flag that says the sm_90a features were compiled in.

pub mod door;
pub mod task;

use cubecl::cuda::{CudaCompiler, CudaRuntime};
use cubecl::ir::features::Tma;
use cubecl::prelude::{ComputeClient, Runtime};

use crate::cuda_target::TargetRuntime;

/// A runtime whose kernels cubecl-cuda's compiler compiles: [`CudaRuntime`] on a GPU, and
/// [`TargetRuntime`] for a stated architecture without one (`crate::cuda_target`). The
/// hand-written kernels launch on either.
pub trait CudaCompiled: Runtime<Compiler = CudaCompiler> {}

impl CudaCompiled for CudaRuntime {}

impl CudaCompiled for TargetRuntime {}

/// `Some($body)` with `$cuda` bound to `$client` (a `&ComputeClient<R>` of any runtime) as
/// the client of a [`CudaCompiled`] runtime, where it is one; `None` elsewhere.
macro_rules! with_cuda_client {
    ($client:expr, |$cuda:ident| $body:expr) => {{
        let any = $client as &dyn core::any::Any;
        if let Some($cuda) =
            any.downcast_ref::<cubecl::prelude::ComputeClient<cubecl::cuda::CudaRuntime>>()
        {
            Some($body)
        } else if let Some($cuda) =
            any.downcast_ref::<cubecl::prelude::ComputeClient<$crate::cuda_target::TargetRuntime>>()
        {
            Some($body)
        } else {
            None
        }
    }};
}
pub(crate) use with_cuda_client;

/// Whether the device of `client` is a Hopper GPU (compute capability 9.x): it registers TMA
/// (sm_90 and later) but not the wide im2col mode of sm_100.
pub fn sm90<R: Runtime>(client: &ComputeClient<R>) -> bool {
    let tma = client.properties().features.tma;
    tma.contains(Tma::Base) && !tma.contains(Tma::Im2colWide)
}

/// FNV-1a of `text`, at compile time: a hand-written source's identity in its `KernelId`.
pub const fn source_hash(text: &str) -> u64 {
    let bytes = text.as_bytes();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    hash
}

/// The `#define`s a hand-written kernel's variant is compiled with, one `#define NAME value`
/// line each: the element type's (`WG_ELEM`, the `wgmma` type name; `ELEM_BF16`), then the
/// variant's words and flags in the order given. Its [`Defines::key`] is the variant's id: the
/// defines are all that varies between a source's variants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Defines(String);

impl Defines {
    /// The element type's lines: bf16, else f16.
    pub fn elem(bf16: bool) -> Self {
        let name = if bf16 { "bf16" } else { "f16" };
        Self(format!("#define WG_ELEM \"{name}\"\n")).word("ELEM_BF16", bf16)
    }

    /// No line yet (a source without an element type's `wgmma`).
    pub fn empty() -> Self {
        Self(String::new())
    }

    /// Adds `#define name value` (a flag as 0 or 1).
    pub fn word(mut self, name: &str, value: impl Into<u32>) -> Self {
        self.0 += &format!("#define {name} {}\n", value.into());
        self
    }

    /// Adds a line per score rule ([`crate::flash::ScoreRules::flags`]), in its order.
    pub fn rules(self, rules: &crate::flash::ScoreRules) -> Self {
        rules
            .flags()
            .into_iter()
            .fold(self, |d, (name, on)| d.word(name, on))
    }

    /// The lines.
    pub fn text(&self) -> &str {
        &self.0
    }

    /// The variant's id: [`source_hash`] of the lines.
    pub fn key(&self) -> u64 {
        source_hash(&self.0)
    }
}

/// `source` with every active mutation of `edits` (`(active, from, to)`: `from` replaced by
/// `to`) applied, and its [`source_hash`]; unchanged (with `hash`) when none is active. Only
/// `--features mutants` builds ever activate one; the mutated text is leaked once per launch
/// that asks, which only those builds do. An active mutation whose `from` is not in the source
/// panics, in release builds too (the GPU runs them): a moved site must not pass as a mutation
/// the tests survived.
pub fn mutated(
    source: &'static str,
    hash: u64,
    edits: &[(bool, &str, &str)],
) -> (&'static str, u64) {
    let mut out = (source, hash);
    for &(active, from, to) in edits {
        if active {
            assert!(out.0.contains(from), "mutation site `{from}` is missing");
            out.0 = Box::leak(out.0.replace(from, to).into_boxed_str());
            out.1 = source_hash(out.0);
        }
    }
    out
}

/// Two 32-bit words as one little-endian parameter word of a hand-written kernel.
pub fn words(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | u64::from(hi) << 32
}
