//! The `[coalesce]` section: the bucket actors and how much they may hold.

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CoalesceConfig {
    /// Number of bucket actors; keys are hashed onto them. Must be a multiple of `flush.connections`.
    pub buckets: usize,
    /// Messages that may queue for one bucket before connections stop reading.
    pub queue_batches: usize,
    /// Hard cap on distinct pending keys; past it, listeners stop reading until a flush frees room.
    pub max_pending_keys: usize,
}

impl Default for CoalesceConfig {
    fn default() -> Self {
        CoalesceConfig {
            buckets: 120,
            queue_batches: 64,
            max_pending_keys: 2_000_000,
        }
    }
}

impl CoalesceConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        // `buckets` against `flush.connections` is checked by `Config::validate`.
        if self.buckets == 0 || self.buckets > 65_536 {
            return Err(invalid("coalesce.buckets", "must be between 1 and 65536"));
        }
        if self.queue_batches == 0 {
            return Err(invalid("coalesce.queue_batches", "must be at least 1"));
        }
        if self.max_pending_keys == 0 {
            return Err(invalid("coalesce.max_pending_keys", "must be at least 1"));
        }
        Ok(())
    }
}
