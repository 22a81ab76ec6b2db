//! The `[metrics]` section: the HTTP endpoints (Prometheus scrape, health, status).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// host:port of the HTTP endpoints (/metrics, /healthz, /readyz, /status); empty disables
    /// them.
    listen: String,
    /// Hottest pending keys shown per counter in /status and `tallyd status`; 0 shows none
    /// (keys are user data).
    pub status_top_keys: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: "127.0.0.1:9187".into(),
            status_top_keys: 10,
        }
    }
}

impl MetricsConfig {
    /// HTTP connections served at once. The endpoints share the process's file descriptors
    /// with the event sockets: without a bound, clients that connect and send nothing (a stuck
    /// scraper, a port scan) would take every descriptor and starve ingest. Beyond it, a
    /// connection is closed as soon as it is accepted. The stream connections' descriptor
    /// budget keeps this many for them.
    pub const HTTP_CONNECTIONS: usize = 32;

    /// The Prometheus endpoint's address; `None` (empty in the file) when it is off.
    pub fn listen(&self) -> Option<&str> {
        Some(self.listen.as_str()).filter(|l| !l.is_empty())
    }

    pub fn set_listen(&mut self, addr: Option<String>) {
        self.listen = addr.unwrap_or_default();
    }
}
