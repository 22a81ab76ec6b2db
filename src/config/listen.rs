//! The `[listen]` section: the tallyd sockets and the limits of what a connection may send.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

/// Size of `sockaddr_un.sun_path` (path plus its terminating NUL).
const SUN_PATH_BYTES: usize =
    std::mem::size_of::<libc::sockaddr_un>() - std::mem::size_of::<libc::sa_family_t>();

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ListenConfig {
    /// Stream socket path; empty disables it.
    socket: PathBuf,
    /// Datagram socket path; empty disables it.
    datagram_socket: PathBuf,
    /// Octal file mode of both socket files, as a string ("0660").
    pub socket_mode: String,
    pub max_line_bytes: usize,
    pub max_key_bytes: usize,
    pub max_connections: usize,
    /// Bytes read from a connection at a time; each read is one batch per bucket.
    pub read_buffer_bytes: usize,
    /// A stream connection that sends nothing for this long is closed; 0: never.
    idle_timeout_ms: u64,
}

impl Default for ListenConfig {
    fn default() -> Self {
        ListenConfig {
            socket: PathBuf::from("./var/tallyd.sock"),
            datagram_socket: PathBuf::from("./var/tallyd.dgram"),
            socket_mode: "0660".into(),
            max_line_bytes: 4096,
            max_key_bytes: 256,
            max_connections: 1024,
            read_buffer_bytes: 64 * 1024,
            idle_timeout_ms: 300_000,
        }
    }
}

/// `Some(path)` unless `path` is empty (the file's way of saying "off").
fn set(path: &Path) -> Option<&Path> {
    Some(path).filter(|p| !p.as_os_str().is_empty())
}

impl ListenConfig {
    /// The stream socket's path; `None` when it is off.
    pub fn socket(&self) -> Option<&Path> {
        set(&self.socket)
    }

    pub fn set_socket(&mut self, path: Option<PathBuf>) {
        self.socket = path.unwrap_or_default();
    }

    /// The datagram socket's path; `None` when it is off.
    pub fn datagram_socket(&self) -> Option<&Path> {
        set(&self.datagram_socket)
    }

    pub fn set_datagram_socket(&mut self, path: Option<PathBuf>) {
        self.datagram_socket = path.unwrap_or_default();
    }

    /// `None` when idle connections are never timed out.
    pub fn idle_timeout(&self) -> Option<Duration> {
        (self.idle_timeout_ms > 0).then(|| Duration::from_millis(self.idle_timeout_ms))
    }

    pub fn set_idle_timeout(&mut self, timeout: Option<Duration>) {
        self.idle_timeout_ms = timeout.map_or(0, |d| d.as_millis() as u64);
    }

    /// The socket file mode; validation has already rejected a bad `socket_mode`.
    pub fn mode(&self) -> u32 {
        self.parse_mode().unwrap_or(0o660)
    }

    /// The one parse of `socket_mode`: octal ("0660" or "0o660"), at most 0o777.
    fn parse_mode(&self) -> Option<u32> {
        let digits = self.socket_mode.trim_start_matches("0o");
        u32::from_str_radix(digits, 8).ok().filter(|m| *m <= 0o777)
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !(16..=1 << 20).contains(&self.max_line_bytes) {
            return Err(invalid(
                "listen.max_line_bytes",
                "must be between 16 and 1048576",
            ));
        }
        if self.max_key_bytes == 0 || self.max_key_bytes >= self.max_line_bytes {
            return Err(invalid(
                "listen.max_key_bytes",
                "must be at least 1 and less than listen.max_line_bytes",
            ));
        }
        if self.max_connections == 0 {
            return Err(invalid("listen.max_connections", "must be at least 1"));
        }
        if self.read_buffer_bytes < 512 {
            return Err(invalid("listen.read_buffer_bytes", "must be at least 512"));
        }
        if self.parse_mode().is_none() {
            return Err(invalid(
                "listen.socket_mode",
                "must be an octal file mode such as \"0660\"",
            ));
        }
        for (key, path) in [
            ("listen.socket", &self.socket),
            ("listen.datagram_socket", &self.datagram_socket),
        ] {
            // sockaddr_un's sun_path holds the path and its NUL: 108 bytes on Linux.
            let len = path.as_os_str().len();
            if len >= SUN_PATH_BYTES {
                return Err(invalid(
                    key,
                    format!(
                        "path is {len} bytes; a Unix socket path must be shorter than {SUN_PATH_BYTES} \
                         bytes (use a shorter directory)"
                    ),
                ));
            }
        }
        if self.socket().is_none() && self.datagram_socket().is_none() {
            return Err(invalid(
                "listen",
                "at least one of socket and datagram_socket must be set",
            ));
        }
        Ok(())
    }
}
