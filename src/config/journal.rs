//! The `[journal]` section: the on-disk journal of accepted events.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct JournalConfig {
    /// Write accepted events to `data_dir/journal` so that a crash loses nothing.
    pub enabled: bool,
    pub fsync: FsyncMode,
    /// With `fsync = "interval"`: how often.
    fsync_interval_ms: u64,
    /// A segment file is closed and a new one started past this size.
    pub segment_bytes: u64,
}

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig {
            enabled: true,
            fsync: FsyncMode::Interval,
            fsync_interval_ms: 100,
            segment_bytes: 64 << 20,
        }
    }
}

super::durations!(JournalConfig {
    fsync_interval_ms => fsync_interval, set_fsync_interval;
});

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FsyncMode {
    /// fsync after every group of writes, before `!sync` is answered.
    Always,
    /// fsync every `fsync_interval_ms`; `!sync` waits for the next one.
    Interval,
    /// Never fsync: survives a killed process, not a power loss.
    Off,
}

impl JournalConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.fsync_interval_ms == 0 {
            return Err(invalid("journal.fsync_interval_ms", "must be at least 1"));
        }
        if self.segment_bytes < 4096 {
            return Err(invalid("journal.segment_bytes", "must be at least 4096"));
        }
        Ok(())
    }
}
