//! The eager modes (TorchTPU's names): Strict (`DEFER_NEVER`, asynchronous, the default),
//! Debug (`DEFER_NEVER_AND_LAUNCH_BLOCKING`, waits on every op) and DeferAndFuse
//! (`DEFER_AND_FUSE`, records ops into a per-device graph and runs it at sync points).

use std::sync::atomic::{AtomicU8, Ordering};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EagerMode {
    Strict = 0,
    Debug = 1,
    DeferAndFuse = 2,
}

static MODE: AtomicU8 = AtomicU8::new(0);

impl EagerMode {
    pub fn from_u8(v: u8) -> Option<EagerMode> {
        match v {
            0 => Some(EagerMode::Strict),
            1 => Some(EagerMode::Debug),
            2 => Some(EagerMode::DeferAndFuse),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            EagerMode::Strict => "strict",
            EagerMode::Debug => "debug",
            EagerMode::DeferAndFuse => "defer_and_fuse",
        }
    }
}

pub fn get() -> EagerMode {
    EagerMode::from_u8(MODE.load(Ordering::Acquire)).unwrap_or(EagerMode::Strict)
}

pub(crate) fn store(m: EagerMode) {
    MODE.store(m as u8, Ordering::Release);
}

/// The mode the environment asks for at start.
pub fn from_env() -> EagerMode {
    let on = |k: &str| {
        std::env::var(k)
            .map(|v| v == "1" || v.eq_ignore_ascii_case("true"))
            .unwrap_or(false)
    };
    if on("TORCH_TPU_DEFER_AND_FUSE") {
        EagerMode::DeferAndFuse
    } else if on("TORCH_TPU_LAUNCH_BLOCKING") {
        EagerMode::Debug
    } else {
        EagerMode::Strict
    }
}

/// NaN/Inf checking in Debug mode (`TORCH_TPU_CHECK_NANS=1`).
pub fn check_nans() -> bool {
    std::env::var("TORCH_TPU_CHECK_NANS")
        .map(|v| v == "1")
        .unwrap_or(false)
}
