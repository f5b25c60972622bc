//! XLA options set by `torch.tpu.compiler.custom_compiler_options` for the programs compiled
//! while it is active. They are part of every cache key (per-op programs, deferred graphs,
//! the disk cache), so a program compiled with them is never reused without them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use pjrt::OptionValue;

/// The active options, and their bytes for cache keys.
pub struct Custom {
    pub list: Vec<(String, OptionValue)>,
    pub key: Vec<u8>,
}

static CURRENT: RwLock<Option<Arc<Custom>>> = RwLock::new(None);
/// Whether `CURRENT` holds options (every op's key checks it).
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// Makes `list` the active options (empty: none); returns the previous ones.
pub fn set(list: Vec<(String, OptionValue)>) -> Vec<(String, OptionValue)> {
    let new = (!list.is_empty()).then(|| {
        let key = format!("{list:?}").into_bytes();
        Arc::new(Custom { list, key })
    });
    let mut g = CURRENT.write().unwrap_or_else(|e| e.into_inner());
    ACTIVE.store(new.is_some(), Ordering::Release);
    let old = std::mem::replace(&mut *g, new);
    old.map(|c| c.list.clone()).unwrap_or_default()
}

/// The active options, if any.
pub fn current() -> Option<Arc<Custom>> {
    CURRENT.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The bytes the active options add to a cache key (empty when none).
pub(crate) fn key_part() -> Vec<u8> {
    if !ACTIVE.load(Ordering::Acquire) {
        return Vec::new();
    }
    current().map(|c| c.key.clone()).unwrap_or_default()
}
