//! The `[batch]` section: idempotent batches (docs/protocol.md, "Batches").

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BatchConfig {
    /// Batch ids are remembered (in `tallyd.batches`) this many days after their claim: a copy
    /// resent later counts again.
    pub remember_days: u32,
    /// An open batch's lines (canonical, as journaled) kept in memory at most, per connection:
    /// a batch past it is refused at `!commit` (`batch_too_large`).
    pub max_bytes: u64,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            // A week: a daily importer's retries, a weekend's outage, and the next run's
            // re-reading of yesterday's files are all covered.
            remember_days: 7,
            max_bytes: 16 << 20,
        }
    }
}

impl BatchConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.remember_days == 0 || self.remember_days > 3650 {
            return Err(invalid("batch.remember_days", "must be between 1 and 3650"));
        }
        if self.max_bytes < 1024 || self.max_bytes > 1 << 30 {
            return Err(invalid(
                "batch.max_bytes",
                "must be between 1024 and 1073741824 (1 GiB)",
            ));
        }
        Ok(())
    }
}
