//! The cooperative-matrix kernels (forward, backward dK/dV and dQ) compile for the runtimes CI
//! has no device of: every variant a plan can pick is expanded here (the kernel definition needs only a client, lavapipe's) and
//! compiled to Metal's MSL (8 × 8 × 8 simdgroup matrices) and, with `cuda`, to CUDA C++ (`wmma`
//! 16 × 16 × 16). An instruction a target lacks fails here, not on a user's Mac. The SPIR-V path
//! runs for real on NVIDIA's Vulkan driver in the GPU suite.

#![cfg(feature = "wgpu")]

use burn_flash_kernels::flash::args::{
    DropoutCompilationArg, ForwardOutputsCompilationArg, GradInputsCompilationArg,
    ScoreArgsCompilationArg, ScoreInputsCompilationArg,
};
use burn_flash_kernels::flash::backward::cmma as backward;
use burn_flash_kernels::flash::forward::cmma::{self, Fragment};
use burn_flash_kernels::flash::{FlashConfig, ScoreRules, ScoreSource, Tile};
use cubecl::{
    Compiler,
    ir::{ElemType, FloatKind},
    prelude::*,
    server::ExecutionMode,
    wgpu::{WgpuDevice, WgpuRuntime},
};
use cubecl_cpp::metal::{MslDialect, arch::MetalArchitecture};
use cubecl_cpp::shared::{CompilationOptions, DialectWmmaCompiler};

/// The compilation arguments of a launch with no aliased outputs.
fn tensor() -> TensorCompilationArg {
    TensorCompilationArg { inplace: None }
}

fn inputs<E: CubePrimitive, F: CubePrimitive>() -> ScoreInputsCompilationArg<E, F> {
    ScoreInputsCompilationArg {
        q: tensor(),
        k: tensor(),
        v: tensor(),
        mask: tensor(),
        bias: tensor(),
        slopes: tensor(),
        sinks: tensor(),
        seqs: tensor(),
    }
}

fn scalars() -> ScoreArgsCompilationArg {
    ScoreArgsCompilationArg {
        scale: (),
        softcap: (),
        dropout: DropoutCompilationArg {
            seed_lo: (),
            seed_hi: (),
            threshold: (),
            inv_keep: (),
        },
        window_left: (),
        window_right: (),
    }
}

fn grads<E: CubePrimitive>() -> GradInputsCompilationArg<E> {
    GradInputsCompilationArg {
        d_out: tensor(),
        lse: tensor(),
        delta: tensor(),
    }
}

/// Which kernel of the schedule.
#[derive(Clone, Copy, Debug)]
enum Which {
    Forward,
    BackwardDkv,
    BackwardDq,
}

/// The definition of a cooperative-matrix kernel for `c` on fragment `f`, in `dtype`, with
/// `vector`-element row loads.
fn definition(
    which: Which,
    c: FlashConfig,
    f: Fragment,
    dtype: StorageType,
    vector: usize,
) -> KernelDefinition {
    let client = WgpuRuntime::client(&WgpuDevice::DefaultDevice);
    match which {
        Which::Forward => {
            let settings =
                KernelSettings::default().cube_dim(CubeDim::new_2d(f.plane, f.planes(c.block_q)));
            cmma::flash_forward_cmma::FlashForwardCmma::<WgpuRuntime>::new(
                settings,
                client,
                inputs(),
                ForwardOutputsCompilationArg {
                    out: tensor(),
                    lse: tensor(),
                },
                scalars(),
                vector,
                c,
                f,
                [dtype, f.operand(dtype)],
            )
            .define()
        }
        Which::BackwardDkv => {
            let settings =
                KernelSettings::default().cube_dim(CubeDim::new_2d(f.plane, backward::PLANES));
            backward::flash_backward_dkv_cmma::FlashBackwardDkvCmma::<WgpuRuntime>::new(
                settings,
                client,
                inputs(),
                grads(),
                tensor(),
                tensor(),
                scalars(),
                vector,
                c,
                f,
                [dtype, f.operand(dtype)],
            )
            .define()
        }
        Which::BackwardDq => {
            let settings =
                KernelSettings::default().cube_dim(CubeDim::new_2d(f.plane, backward::PLANES));
            backward::flash_backward_dq_cmma::FlashBackwardDqCmma::<WgpuRuntime>::new(
                settings,
                client,
                inputs(),
                grads(),
                tensor(),
                tensor(),
                scalars(),
                vector,
                c,
                f,
                c.fills() || c.given(),
                [dtype, f.operand(dtype)],
            )
            .define()
        }
    }
}

fn float(kind: FloatKind) -> StorageType {
    StorageType::Scalar(ElemType::Float(kind))
}

/// Every score rule a call can ask for, alone and together, for `source`.
fn rule_sets(source: ScoreSource) -> Vec<ScoreRules> {
    let none = ScoreRules::NONE;
    if source == ScoreSource::Given {
        return vec![none];
    }
    vec![
        none,
        ScoreRules {
            causal: true,
            ..none
        },
        ScoreRules {
            mask: true,
            bias: true,
            softcap: true,
            ..none
        },
        ScoreRules {
            mask: true,
            masked_score: Some((-1e4f32).to_bits()),
            quiet: true,
            causal: true,
            ..none
        },
        ScoreRules {
            dropout: true,
            causal: true,
            bias: true,
            ..none
        },
    ]
}

/// Every configuration a plan can compile on fragment `f`: both score sources, each rule set;
/// forward: head dims from 16 to 256 (`D ≠ Dv` included), 16 to 128 rows per cube and 16 to 64
/// keys per step (the plans' defaults and fall-backs); backward: head dims up to 128.
fn variants(which: Which, f: Fragment) -> Vec<FlashConfig> {
    let mut out = Vec::new();
    if !matches!(which, Which::Forward) {
        for source in [ScoreSource::QueryKey, ScoreSource::Given] {
            for rules in rule_sets(source) {
                for (d, dv) in [(16, 16), (64, 128), (128, 128)] {
                    let d = if source == ScoreSource::Given { 0 } else { d };
                    let c = FlashConfig::new(source, rules, backward::tile(d, dv, f));
                    if backward::fits(c, f) {
                        out.push(c);
                    }
                }
            }
        }
        return out;
    }
    for source in [ScoreSource::QueryKey, ScoreSource::Given] {
        for rules in rule_sets(source) {
            for (d, dv) in [(16, 16), (64, 64), (128, 128), (96, 256), (256, 256)] {
                for (block_q, block_k) in [
                    (16, 16),
                    (32, 64),
                    (cmma::BLOCK_Q, 16),
                    (cmma::WIDE_BLOCK_Q, cmma::BLOCK_K),
                ] {
                    let c = FlashConfig::new(
                        source,
                        rules,
                        Tile {
                            block_q,
                            row_tiles: 1,
                            block_k,
                            head_dim: if source == ScoreSource::Given { 0 } else { d },
                            value_dim: dv,
                        },
                    );
                    if cmma::fits(c, f) {
                        out.push(c);
                    }
                }
            }
        }
    }
    out
}

/// Compiles every variant on `f` in `dtype` with `compiler`, for each vector width; returns how
/// many compiled, and panics with the first error. `expect` must be in every source.
fn compile_all<C: Compiler>(
    compiler: &mut C,
    options: &C::CompilationOptions,
    f: Fragment,
    dtype: StorageType,
    expect: &str,
) -> usize {
    let addr = u32::as_type_native_unchecked().storage_type();
    let mut n = 0;
    for (which, c) in [Which::Forward, Which::BackwardDkv, Which::BackwardDq]
        .into_iter()
        .flat_map(|w| variants(w, f).into_iter().map(move |c| (w, c)))
    {
        // The widths a plan can pass ([`cmma::vector`]): dividing a lane's columns per step.
        let lane_cols = (c.block_k / f.lanes_per_row()) as usize;
        for vector in [1, 2, 4, 8]
            .into_iter()
            .filter(|n| lane_cols.is_multiple_of(*n))
        {
            let def = definition(which, c, f, dtype, vector);
            let source = compiler
                .compile(def, options, ExecutionMode::Unchecked, addr)
                .unwrap_or_else(|e| panic!("{which:?} {c:?} vector {vector} {dtype:?}: {e:?}"))
                .to_string();
            assert!(
                source.contains(expect),
                "{which:?} {c:?} vector {vector}: no `{expect}` in the source"
            );
            n += 1;
        }
    }
    n
}

/// Metal: the fragments Metal registers (cubecl-wgpu's Metal backend offers these to the plan),
/// on 32-lane simdgroups; every planned variant compiles to MSL with simdgroup matrices.
#[test]
fn every_variant_compiles_to_msl() {
    let configs = MslDialect::supported_wmma_combinations(&MetalArchitecture::Metal3);
    let mut compiled = 0;
    for kind in [FloatKind::F16, FloatKind::BF16] {
        let dtype = float(kind);
        let Some(f) = cmma::choose(configs.iter(), (32, 32), dtype, false) else {
            // Metal has no bf16 × bf16 → f32 simdgroup product: bf16 stays on plain units.
            assert_eq!(kind, FloatKind::BF16, "Metal offers f16 × f16 → f32");
            continue;
        };
        assert_eq!((f.m, f.n, f.k), (8, 8, 8));
        compiled += compile_all(
            &mut cubecl_cpp::MslCompiler::default(),
            &CompilationOptions::default(),
            f,
            dtype,
            "simdgroup_multiply_accumulate",
        );
    }
    eprintln!("{compiled} MSL variants compiled");
    assert!(compiled > 50);
}

/// CUDA (`wmma`, where the cooperative-matrix kernel is tested on a GPU first): every planned
/// variant compiles to CUDA C++ for f16 and bf16 on 16 × 16 × 16 fragments.
#[cfg(feature = "cuda")]
#[test]
fn every_variant_compiles_to_cuda() {
    let f = Fragment {
        m: 16,
        n: 16,
        k: 16,
        plane: 32,
        tf32: false,
    };
    let mut compiled = 0;
    for kind in [FloatKind::F16, FloatKind::BF16] {
        compiled += compile_all(
            &mut cubecl::cuda::CudaCompiler::default(),
            &CompilationOptions::default(),
            f,
            float(kind),
            "wmma::mma_sync",
        );
    }
    eprintln!("{compiled} CUDA variants compiled");
    assert!(compiled > 50);
}

/// CUDA with TF32 operands (`AttentionOptions::tf32`): every variant compiles to CUDA C++ for
/// f32 on 16 × 16 × 8 TF32 fragments, its staged operands rounded by `__float_to_tf32` (given
/// scores too, which no plan runs on TF32: softmax·V keeps f32).
#[cfg(feature = "cuda")]
#[test]
fn tf32_variants_compile_to_cuda() {
    let f = Fragment {
        m: 16,
        n: 16,
        k: 8,
        plane: 32,
        tf32: true,
    };
    let compiled = compile_all(
        &mut cubecl::cuda::CudaCompiler::default(),
        &CompilationOptions::default(),
        f,
        float(FloatKind::F32),
        "__float_to_tf32",
    );
    eprintln!("{compiled} TF32 CUDA variants compiled");
    assert!(compiled > 30);
}
