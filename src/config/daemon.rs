//! The `[daemon]` section: where this tallyd keeps its state, its identity, and how long a stop
//! may take.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DaemonConfig {
    /// Directory for the private PostgreSQL cluster, sockets and the instance id.
    pub data_dir: PathBuf,
    /// Stable identity of this tallyd; empty = generated once and kept in `data_dir/instance_id`.
    instance_id: String,
    /// On a graceful stop, how long open connections may keep sending before they are closed.
    drain_timeout_ms: u64,
    /// How long the final flush may retry before tallyd gives up on it.
    shutdown_timeout_ms: u64,
    /// How long the instance lease (one live tallyd per instance_id) lasts unrenewed; renewed
    /// every third of it.
    instance_lease_ms: u64,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            data_dir: PathBuf::from("./var"),
            instance_id: String::new(),
            drain_timeout_ms: 5_000,
            shutdown_timeout_ms: 30_000,
            instance_lease_ms: 10_000,
        }
    }
}

super::durations!(DaemonConfig {
    drain_timeout_ms => drain_timeout, set_drain_timeout;
    shutdown_timeout_ms => shutdown_timeout, set_shutdown_timeout;
    instance_lease_ms => instance_lease, set_instance_lease;
});

impl DaemonConfig {
    /// The configured instance id; `None` (empty in the file) keeps a generated one in data_dir.
    pub fn instance_id(&self) -> Option<&str> {
        Some(self.instance_id.as_str()).filter(|id| !id.is_empty())
    }

    pub fn set_instance_id(&mut self, id: Option<String>) {
        self.instance_id = id.unwrap_or_default();
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.instance_lease_ms < 1000 {
            return Err(invalid("daemon.instance_lease_ms", "must be at least 1000"));
        }
        Ok(())
    }
}
