//! The in-memory compilation cache: program key -> compiled program and its I/O plan.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::exec::Program;

#[derive(Default)]
pub struct Cache {
    map: Mutex<HashMap<Vec<u8>, Arc<Program>>>,
}

impl Cache {
    pub fn get(&self, key: &[u8]) -> Option<Arc<Program>> {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned()
    }

    pub fn insert(&self, key: Vec<u8>, p: Arc<Program>) {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, p);
    }

    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&self) {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}
