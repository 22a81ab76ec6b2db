//! The `[rollup]` section: the built-in rollup loop.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RollupConfig {
    pub enabled: bool,
    interval_ms: u64,
    pub batch_rows: i32,
}

impl Default for RollupConfig {
    fn default() -> Self {
        RollupConfig {
            enabled: true,
            interval_ms: 10_000,
            batch_rows: 1_000,
        }
    }
}

super::durations!(RollupConfig {
    interval_ms => interval, set_interval;
});

impl RollupConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.batch_rows < 1 {
            return Err(invalid("rollup.batch_rows", "must be at least 1"));
        }
        if self.interval_ms == 0 {
            return Err(invalid("rollup.interval_ms", "must be at least 1"));
        }
        Ok(())
    }
}
