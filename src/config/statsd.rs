//! The `[statsd]` section: where statsd lines are received (the counters' own `[counters.statsd]`
//! tables are checked with the counters).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

/// The `[statsd]` table: where statsd lines are received. All off by default.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct StatsdConfig {
    /// Unix datagram socket path (DogStatsD's `unix://` socket); empty disables it.
    socket: PathBuf,
    /// Unix stream socket path for DogStatsD's length-prefixed stream (`unixstream://`); empty
    /// disables it.
    stream_socket: PathBuf,
    /// UDP address, e.g. "127.0.0.1:8125"; empty disables it.
    udp: String,
    /// Receive buffer asked of the kernel for each statsd socket (SO_RCVBUF); datagrams beyond
    /// it are dropped by the kernel and counted in `tallyd_statsd_udp_dropped_total` for UDP.
    pub receive_buffer_bytes: usize,
}

impl Default for StatsdConfig {
    fn default() -> Self {
        StatsdConfig {
            socket: PathBuf::new(),
            stream_socket: PathBuf::new(),
            udp: String::new(),
            receive_buffer_bytes: 8 << 20,
        }
    }
}

impl StatsdConfig {
    /// The Unix datagram socket's path; `None` when it is off.
    pub fn socket(&self) -> Option<&Path> {
        Some(self.socket.as_path()).filter(|p| !p.as_os_str().is_empty())
    }

    pub fn set_socket(&mut self, path: Option<PathBuf>) {
        self.socket = path.unwrap_or_default();
    }

    /// The Unix stream socket's path (DogStatsD's `unixstream://`); `None` when it is off.
    pub fn stream_socket(&self) -> Option<&Path> {
        Some(self.stream_socket.as_path()).filter(|p| !p.as_os_str().is_empty())
    }

    pub fn set_stream_socket(&mut self, path: Option<PathBuf>) {
        self.stream_socket = path.unwrap_or_default();
    }

    /// The UDP address; `None` when it is off.
    pub fn udp(&self) -> Option<&str> {
        Some(self.udp.as_str()).filter(|a| !a.is_empty())
    }

    pub fn set_udp(&mut self, addr: Option<String>) {
        self.udp = addr.unwrap_or_default();
    }

    pub fn enabled(&self) -> bool {
        self.socket().is_some() || self.stream_socket().is_some() || self.udp().is_some()
    }

    /// Checks the section; `mapped` says whether any counter has a `[counters.statsd]` table.
    pub(super) fn validate(&self, mapped: bool) -> Result<(), ConfigError> {
        if self
            .udp()
            .is_some_and(|a| a.parse::<std::net::SocketAddr>().is_err())
        {
            return Err(invalid(
                "statsd.udp",
                "must be an IP address and port, such as \"127.0.0.1:8125\"",
            ));
        }
        if !(4096..=1 << 30).contains(&self.receive_buffer_bytes) {
            return Err(invalid(
                "statsd.receive_buffer_bytes",
                "must be between 4096 and 1073741824",
            ));
        }
        if self.enabled() && !mapped {
            return Err(invalid(
                "statsd",
                "statsd sockets are set but no counter has a [counters.statsd] mapping",
            ));
        }
        Ok(())
    }
}
