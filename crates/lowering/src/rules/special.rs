//! special rules.

use crate::Rule;

pub const RULES: &[(&str, Rule)] = &[];
