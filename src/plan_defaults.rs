//! The plan inputs of calls that do not set them: how plans use the Hopper kernels
//! ([`HopperUse`]), how the Hopper forward's blocks take its tiles ([`TileSchedule`]), the
//! decoding kernel's schedule ([`DecodeSchedule`]) and whether the
//! attention backward must return the same bits on every run ([`PlanDefaults::deterministic`],
//! PyTorch's `use_deterministic_algorithms`).
//!
//! A call's options win ([`crate::FlashAttentionOptions::hopper`], `decode`, `deterministic`,
//! [`crate::SoftmaxMatmulOptions::hopper`]); calls that cannot carry them (Burn's `attention`
//! arguments, the `nn` modules, `softmax_matmul` without options) plan with these. The planners
//! themselves are functions of their arguments, and the library reads no environment for them:
//! a program (a test suite, a bench) sets these once, before its first call.

use std::sync::RwLock;

use burn_flash_kernels::attention::{
    AmpereTile, AmpereUse, BackwardOverlap, DecodeSchedule, HopperUse, TileSchedule,
};
use burn_flash_kernels::softmax_matmul::SoftmaxMatmulOptions;

/// The process's plan inputs for calls that leave them unset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PlanDefaults {
    /// How plans use the Hopper kernels.
    pub hopper: HopperUse,
    /// How the Hopper forward's blocks take its tiles (and whether the backward's are persistent).
    pub schedule: TileSchedule,
    /// The decoding kernel's schedule.
    pub decode: DecodeSchedule,
    /// The attention backward returns the same bits on every run
    /// ([`burn_flash_kernels::attention::AttentionOptions::deterministic`]).
    pub deterministic: bool,
    /// How the Hopper backward's consumers meet over a step's `dSᵀ`.
    pub backward_overlap: BackwardOverlap,
    /// How plans use the Ampere backward
    /// ([`burn_flash_kernels::attention::AttentionOptions::ampere_backward`]).
    pub ampere_backward: AmpereUse,
    /// The Ampere backward's block shape
    /// ([`burn_flash_kernels::attention::AttentionOptions::ampere_tile`]).
    pub ampere_tile: AmpereTile,
    /// f32 attention may run its products as TF32
    /// ([`burn_flash_kernels::attention::AttentionOptions::tf32`]).
    pub tf32: bool,
}

impl PlanDefaults {
    /// The Hopper kernels where they measured faster, the measured decoding schedule, the
    /// fastest backward (deterministic or not).
    pub const STANDARD: Self = Self {
        hopper: HopperUse::Faster,
        schedule: TileSchedule::Planned,
        decode: DecodeSchedule::STANDARD,
        deterministic: false,
        backward_overlap: BackwardOverlap::Planned,
        ampere_backward: AmpereUse::Faster,
        ampere_tile: AmpereTile::Planned,
        tf32: false,
    };
}

impl PlanDefaults {
    /// The defaults a program's settings name (each `None`: the standard one): `hopper` as
    /// [`HopperUse::from_name`] reads it, `keys` and `cubes` the decoding schedule's numbers.
    pub fn from_names(
        hopper: Option<&str>,
        keys: Option<&str>,
        cubes: Option<&str>,
    ) -> Result<Self, String> {
        let mut d = Self::STANDARD;
        if let Some(h) = hopper {
            d.hopper = HopperUse::from_name(h)
                .ok_or_else(|| format!("hopper use {h:?}: off, always or faster"))?;
        }
        if let Some(k) = keys {
            d.decode.keys_per_step = k
                .parse()
                .map_err(|_| format!("decode keys {k:?}: not a number"))?;
        }
        if let Some(c) = cubes {
            d.decode.cubes_per_sm = c
                .parse()
                .map_err(|_| format!("decode cubes {c:?}: not a number"))?;
        }
        match d.decode.invalid() {
            Some(reason) => Err(reason),
            None => Ok(d),
        }
    }

    /// [`PlanDefaults::from_names`] of the settings `BURN_FLASH_HOPPER`,
    /// `BURN_FLASH_DECODE_KEYS` and `BURN_FLASH_DECODE_CUBES` as `get` finds them, and
    /// `BURN_FLASH_PERSISTENT` ([`TileSchedule::from_name`]), `BURN_FLASH_BWD_OVERLAP`
    /// ([`BackwardOverlap::from_name`]), `BURN_FLASH_AMPERE_BWD` ([`AmpereUse::from_name`]),
    /// `BURN_FLASH_AMPERE_TILE` ([`AmpereTile::from_name`]), `BURN_FLASH_TF32` (`1` or `0`) and
    /// `BURN_FLASH_DETERMINISTIC` (`1` or `0`): how the
    /// test suites and benches read them from
    /// their environment (the library reads none).
    pub fn from_settings(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let (hopper, keys, cubes) = (
            get("BURN_FLASH_HOPPER"),
            get("BURN_FLASH_DECODE_KEYS"),
            get("BURN_FLASH_DECODE_CUBES"),
        );
        let mut d = Self::from_names(hopper.as_deref(), keys.as_deref(), cubes.as_deref())?;
        if let Some(name) = get("BURN_FLASH_PERSISTENT") {
            d.schedule = TileSchedule::from_name(&name).ok_or_else(|| {
                format!(
                    "tile schedule {name:?}: planned, off, on, a number of blocks, dynamic or dN"
                )
            })?;
        }
        if let Some(name) = get("BURN_FLASH_BWD_OVERLAP") {
            d.backward_overlap = BackwardOverlap::from_name(&name).ok_or_else(|| {
                format!("backward overlap {name:?}: planned, lockstep, deferred or staggered")
            })?;
        }
        if let Some(name) = get("BURN_FLASH_AMPERE_BWD") {
            d.ampere_backward = AmpereUse::from_name(&name)
                .ok_or_else(|| format!("Ampere backward use {name:?}: off, always or faster"))?;
        }
        if let Some(name) = get("BURN_FLASH_AMPERE_TILE") {
            d.ampere_tile = AmpereTile::from_name(&name).ok_or_else(|| {
                format!("Ampere backward tile {name:?}: planned, wide, narrow or paired")
            })?;
        }
        d.deterministic = match get("BURN_FLASH_DETERMINISTIC").as_deref() {
            None | Some("0") => false,
            Some("1") => true,
            Some(other) => return Err(format!("deterministic {other:?}: 1 or 0")),
        };
        d.tf32 = match get("BURN_FLASH_TF32").as_deref() {
            None | Some("0") => false,
            Some("1") => true,
            Some(other) => return Err(format!("TF32 {other:?}: 1 or 0")),
        };
        Ok(d)
    }
}

impl Default for PlanDefaults {
    fn default() -> Self {
        Self::STANDARD
    }
}

static DEFAULTS: RwLock<PlanDefaults> = RwLock::new(PlanDefaults::STANDARD);

/// Sets the plan inputs of the calls that leave them unset, for the whole process.
pub fn set_plan_defaults(defaults: PlanDefaults) {
    *DEFAULTS.write().unwrap_or_else(|e| e.into_inner()) = defaults;
}

/// The plan inputs of the calls that leave them unset ([`PlanDefaults::STANDARD`] unless
/// [`set_plan_defaults`] said otherwise).
pub fn plan_defaults() -> PlanDefaults {
    *DEFAULTS.read().unwrap_or_else(|e| e.into_inner())
}

/// `options` with an unset Hopper choice taken from the defaults ([`HopperUse::Off`] keeps the
/// call off the Hopper kernels, forward and backward; the other uses leave it to the plan), and
/// an unset Ampere use (`Faster`) the defaults' `ampere_backward`.
pub(crate) fn softmax_matmul_options(options: SoftmaxMatmulOptions) -> SoftmaxMatmulOptions {
    let defaults = plan_defaults();
    let options = match options.schedule {
        TileSchedule::Planned => SoftmaxMatmulOptions {
            schedule: defaults.schedule,
            ..options
        },
        _ => options,
    };
    // An unset (`Faster`) Ampere use takes the process's.
    let options = SoftmaxMatmulOptions {
        ampere: match options.ampere {
            AmpereUse::Faster => defaults.ampere_backward,
            other => other,
        },
        ..options
    };
    match (options.hopper, defaults.hopper) {
        (None, HopperUse::Off) => SoftmaxMatmulOptions {
            hopper: Some(false),
            ..options
        },
        _ => options,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settings a suite reads name the plan inputs; a bad one is refused with its name.
    #[test]
    fn settings_name_the_plan_inputs() {
        let read = |pairs: &[(&str, &str)]| {
            let pairs: Vec<(String, String)> = pairs
                .iter()
                .map(|&(k, v)| (k.to_string(), v.to_string()))
                .collect();
            PlanDefaults::from_settings(|name| {
                pairs
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
            })
        };
        assert_eq!(read(&[]), Ok(PlanDefaults::STANDARD));
        for (name, schedule) in [
            ("planned", TileSchedule::Planned),
            ("off", TileSchedule::PerTile),
            ("0", TileSchedule::PerTile),
            ("on", TileSchedule::Persistent),
            ("1", TileSchedule::Persistent),
            ("3", TileSchedule::Blocks(3)),
            ("dynamic", TileSchedule::Dynamic),
            ("d1", TileSchedule::DynamicBlocks(1)),
            ("d3", TileSchedule::DynamicBlocks(3)),
        ] {
            let d = read(&[("BURN_FLASH_PERSISTENT", name)]).expect(name);
            assert_eq!(d.schedule, schedule, "{name}");
            assert_eq!(d.hopper, HopperUse::Faster, "{name}");
        }
        let d = read(&[
            ("BURN_FLASH_HOPPER", "off"),
            ("BURN_FLASH_DETERMINISTIC", "1"),
        ])
        .expect("valid");
        assert_eq!((d.hopper, d.deterministic), (HopperUse::Off, true));
        assert_eq!(d.ampere_backward, AmpereUse::Faster);
        for (name, use_) in [
            ("off", AmpereUse::Off),
            ("always", AmpereUse::Always),
            ("1", AmpereUse::Always),
            ("faster", AmpereUse::Faster),
        ] {
            let d = read(&[("BURN_FLASH_AMPERE_BWD", name)]).expect(name);
            assert_eq!(d.ampere_backward, use_, "{name}");
        }
        assert_eq!(d.ampere_tile, AmpereTile::Planned);
        assert!(!d.tf32);
        assert!(read(&[("BURN_FLASH_TF32", "1")]).expect("1").tf32);
        for (name, tile) in [
            ("planned", AmpereTile::Planned),
            ("wide", AmpereTile::Wide),
            ("narrow", AmpereTile::Narrow),
            ("paired", AmpereTile::Paired),
        ] {
            let d = read(&[("BURN_FLASH_AMPERE_TILE", name)]).expect(name);
            assert_eq!(d.ampere_tile, tile, "{name}");
        }
        for (name, overlap) in [
            ("lockstep", BackwardOverlap::Lockstep),
            ("deferred", BackwardOverlap::Deferred),
            ("staggered", BackwardOverlap::Staggered),
        ] {
            let d = read(&[("BURN_FLASH_BWD_OVERLAP", name)]).expect(name);
            assert_eq!(d.backward_overlap, overlap, "{name}");
        }
        for (key, value) in [
            ("BURN_FLASH_PERSISTENT", "many"),
            ("BURN_FLASH_PERSISTENT", "d0"),
            ("BURN_FLASH_PERSISTENT", "dx"),
            ("BURN_FLASH_HOPPER", "sometimes"),
            ("BURN_FLASH_DETERMINISTIC", "yes"),
            ("BURN_FLASH_AMPERE_BWD", "sometimes"),
            ("BURN_FLASH_AMPERE_TILE", "square"),
            ("BURN_FLASH_TF32", "on"),
            ("BURN_FLASH_BWD_OVERLAP", "sometimes"),
        ] {
            let err = read(&[(key, value)]).expect_err(value);
            assert!(err.contains(value), "{key}={value}: {err}");
        }
    }

    /// Blocks of a launch: every tile its own block, persistent blocks no more than the SMs
    /// or the tiles, and at least one.
    #[test]
    fn tile_schedules_count_blocks() {
        let (tiles, sms) = (512, 132);
        assert_eq!(TileSchedule::PerTile.blocks(tiles, sms, true), 512);
        assert_eq!(TileSchedule::Planned.blocks(tiles, sms, false), 512);
        assert_eq!(TileSchedule::Planned.blocks(tiles, sms, true), 132);
        assert_eq!(TileSchedule::Persistent.blocks(tiles, sms, false), 132);
        assert_eq!(TileSchedule::Persistent.blocks(40, sms, false), 40);
        assert_eq!(TileSchedule::Blocks(3).blocks(tiles, sms, false), 3);
        assert_eq!(TileSchedule::Blocks(900).blocks(tiles, sms, false), 512);
        assert_eq!(TileSchedule::Persistent.blocks(0, 0, false), 1);
        assert_eq!(TileSchedule::Dynamic.blocks(tiles, sms, false), 132);
        assert_eq!(TileSchedule::DynamicBlocks(3).blocks(tiles, sms, false), 3);
        assert_eq!(TileSchedule::DynamicBlocks(900).blocks(2, sms, false), 2);
        assert!(TileSchedule::Dynamic.dynamic() && TileSchedule::DynamicBlocks(2).dynamic());
        assert!(!TileSchedule::Planned.dynamic() && !TileSchedule::Blocks(2).dynamic());
    }
}
