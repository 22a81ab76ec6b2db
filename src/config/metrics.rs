//! The `[metrics]` section: the Prometheus endpoint.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// host:port of the Prometheus endpoint; empty disables it.
    listen: String,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: "127.0.0.1:9187".into(),
        }
    }
}

impl MetricsConfig {
    /// The Prometheus endpoint's address; `None` (empty in the file) when it is off.
    pub fn listen(&self) -> Option<&str> {
        Some(self.listen.as_str()).filter(|l| !l.is_empty())
    }

    pub fn set_listen(&mut self, addr: Option<String>) {
        self.listen = addr.unwrap_or_default();
    }
}
