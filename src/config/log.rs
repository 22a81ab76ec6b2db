//! The `[log]` section: the log filter and line format.

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// A tracing filter (`info`, `tallyd=debug`); RUST_LOG wins when set.
    pub level: String,
    /// `text` or `json`.
    pub format: LogFormat,
}

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: "info".into(),
            format: LogFormat::Text,
        }
    }
}

impl LogConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        tracing_subscriber::EnvFilter::try_new(&self.level)
            .map(drop)
            .map_err(|e| invalid("log.level", format!("not a valid filter: {e}")))
    }
}
