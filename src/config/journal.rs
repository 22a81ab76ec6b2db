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
    /// At this many bytes of segments on disk, connections stop reading (back-pressure) until
    /// flushes commit and covered segments are deleted. 0 means the default,
    /// [`DEFAULT_JOURNAL_MAX_BYTES`]; see [`JournalConfig::max_bytes`].
    pub max_bytes: u64,
}

/// 1 GiB: about 20 million events of ~50 bytes, some 30 minutes of database outage at 10,000
/// events/s before clients are paused, and 16 segments at the default `segment_bytes` (space
/// comes back a segment at a time). Small enough to sit beside PostgreSQL on a shared disk.
pub const DEFAULT_JOURNAL_MAX_BYTES: u64 = 1 << 30;

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig {
            enabled: true,
            fsync: FsyncMode::Interval,
            fsync_interval_ms: 100,
            segment_bytes: 64 << 20,
            max_bytes: DEFAULT_JOURNAL_MAX_BYTES,
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
    /// The journal's cap on disk, with 0 meaning the default. There is no "unlimited": a
    /// journal that fills the disk fails its writes and pauses intake anyway, with the disk
    /// it shares full for everyone else too.
    pub fn max_bytes(&self) -> u64 {
        match self.max_bytes {
            0 => DEFAULT_JOURNAL_MAX_BYTES,
            n => n,
        }
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.fsync_interval_ms == 0 {
            return Err(invalid("journal.fsync_interval_ms", "must be at least 1"));
        }
        if self.segment_bytes < 4096 {
            return Err(invalid("journal.segment_bytes", "must be at least 4096"));
        }
        if self.max_bytes != 0 && self.max_bytes < 65_536 {
            return Err(invalid(
                "journal.max_bytes",
                "must be 0 (the default, 1 GiB) or at least 65536",
            ));
        }
        Ok(())
    }
}
