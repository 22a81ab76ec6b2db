//! statsd and DogStatsD counters in: their own sockets (a Unix datagram socket, a Unix stream
//! socket with DogStatsD's length-prefixed packets, and UDP), each line mapped to the events of
//! tallyd's own counters and routed like a native line, so that back-pressure, the journal,
//! buckets and flushes are shared, unchanged.
//!
//! statsd lines get their own sockets rather than being detected on the native ones: a statsd
//! line can look like a native one (`a:1|c` is a native counter `a:1|c` without key), so one
//! socket, one protocol. [`parse`] reads a line, [`mapping`] turns it into events, [`receive`]
//! is the datagram loop, [`udp`] binds UDP and reads the kernel's drop count, [`frames`] and
//! [`stream`] read the stream socket's packets.

pub mod frames;
pub mod mapping;
pub mod parse;
pub mod receive;
mod stream;
pub mod udp;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{UdpSocket, UnixDatagram, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::conns::accept::{self, accept_loop, Conns};
use crate::conns::ConnLimits;
use crate::ingest::Ingest;
use crate::service::Activated;
use crate::socket::{take_or_bind_listener, ListenError};
use mapping::Mappings;

pub use crate::config::StatsdConfig;

/// The bound statsd sockets and the counters' mappings.
pub struct Bound {
    unix: Option<(UnixDatagram, PathBuf)>,
    /// The Unix socket came from systemd (socket activation): its file is never removed.
    unix_adopted: bool,
    /// The stream socket, and its file when tallyd bound it (systemd's stays).
    stream: Option<(UnixListener, Option<PathBuf>)>,
    udp: Option<UdpSocket>,
    mappings: Arc<Mappings>,
}

impl Bound {
    /// Binds the sockets `config.statsd` names; `None` when it names none.
    pub fn bind(config: &Config, mode: u32) -> Result<Option<Bound>, ListenError> {
        Bound::bind_or_adopt(config, mode, &mut Activated::default())
    }

    /// Like [`Bound::bind`], taking from `activated` the sockets systemd passed: the Unix one
    /// named `statsd` (or unnamed and bound to `statsd.socket`), the stream one named
    /// `statsd-stream` (or unnamed and bound to `statsd.stream_socket`), the UDP one named
    /// `statsd-udp`.
    pub fn bind_or_adopt(
        config: &Config,
        mode: u32,
        activated: &mut Activated,
    ) -> Result<Option<Bound>, ListenError> {
        let s = &config.statsd;
        if !s.enabled() {
            return Ok(None);
        }
        let buffer = s.receive_buffer_bytes;
        let passed = match s.socket() {
            Some(path) => activated
                .take_socket("statsd", libc::SOCK_DGRAM, path)?
                .map(|fd| (fd, path)),
            None => None,
        };
        let unix_adopted = passed.is_some();
        let unix = match (passed, s.socket()) {
            (Some((fd, path)), _) => Some((udp::adopt_unix(fd.into(), path, buffer)?, path)),
            (None, Some(path)) => Some(udp::bind_unix(path, mode, buffer)?),
            (None, None) => None,
        };
        let stream = match s.stream_socket() {
            Some(path) => {
                let mut adopted = Vec::new();
                let named = (path, mode, "statsd-stream");
                let listener = take_or_bind_listener(named, activated, &mut adopted)?;
                Some((listener, adopted.is_empty().then(|| path.to_path_buf())))
            }
            None => None,
        };
        let udp = match s.udp() {
            None => None,
            Some(addr) => {
                match activated.take_socket("statsd-udp", libc::SOCK_DGRAM, Path::new(""))? {
                    Some(fd) => Some(udp::adopt_udp(fd.into(), addr, buffer)?),
                    None => Some(udp::bind_udp(addr, buffer)?),
                }
            }
        };
        let mappings = Mappings::new(config.counters.iter().enumerate().filter_map(|(i, c)| {
            let m = c.statsd.as_ref()?;
            Some((i as u16, c.key_type, c.kind, m))
        }));
        Ok(Some(Bound {
            unix: unix.map(|(s, p)| (s, p.to_path_buf())),
            unix_adopted,
            stream,
            udp,
            mappings: Arc::new(mappings),
        }))
    }

    pub fn unix_path(&self) -> Option<&Path> {
        self.unix.as_ref().map(|(_, p)| p.as_path())
    }

    pub fn udp_addr(&self) -> Option<std::net::SocketAddr> {
        self.udp.as_ref().and_then(|s| s.local_addr().ok())
    }
}

/// Serves the statsd sockets on `tracker` until `cancel`; a Unix socket's file is removed on
/// the way out, unless systemd passed the socket. Stream connections are served within
/// `limits.max_connections` (without its idle timeout) and drained like the native ones: read
/// until their clients close them, for at most `drain` after `cancel`, then what the kernel
/// already holds for them.
pub fn spawn(
    bound: Bound,
    ingest: &Arc<Ingest>,
    (limits, drain): (ConnLimits, Duration),
    cancel: &CancellationToken,
    tracker: &TaskTracker,
) {
    if let Some((socket, path)) = bound.unix {
        let (ingest, cancel, mappings) = (ingest.clone(), cancel.clone(), bound.mappings.clone());
        let remove = !bound.unix_adopted;
        tracker.spawn(async move {
            receive::serve(&socket, &mappings, &ingest, &cancel).await;
            if remove {
                let _ = std::fs::remove_file(&path);
            }
        });
    }
    if let Some((listener, file)) = bound.stream {
        let framed = stream::Framed {
            mappings: bound.mappings.clone(),
            ingest: ingest.clone(),
        };
        // A DogStatsD client keeps its connection for good, and loses the packet it sends on
        // one tallyd closed (it reconnects only for the next): no idle timeout here.
        let limits = ConnLimits {
            idle_timeout: None,
            ..limits
        };
        let conns = Conns::new(&ingest.shared, framed, limits);
        let cancel = cancel.clone();
        tracker.spawn(async move {
            let connections = TaskTracker::new();
            accept_loop(&listener, file, &conns, &cancel, &connections).await;
            drop(listener);
            accept::drain(&connections, &conns, drain).await;
        });
    }
    if let Some(socket) = bound.udp {
        let (ingest, cancel, mappings) = (ingest.clone(), cancel.clone(), bound.mappings.clone());
        tracker.spawn(async move {
            receive::serve(&receive::Udp(socket), &mappings, &ingest, &cancel).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn load(text: &str, env: &[(&str, &str)]) -> Result<Config, String> {
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        Config::from_toml(text, env).map_err(|e| e.to_string())
    }

    const MAPPED: &str = "[[counters]]\nname = \"views\"\n[counters.statsd]\nmetric = \"page.views\"\nkey_tag = \"page\"\n";

    #[test]
    fn off_by_default_and_set_by_file_or_environment() {
        let config = load(MAPPED, &[]).unwrap();
        assert!(!config.statsd.enabled());
        let config = load(MAPPED, &[("TALLYD_STATSD_UDP", "127.0.0.1:8125")]).unwrap();
        assert_eq!(config.statsd.udp(), Some("127.0.0.1:8125"));
        let sampled = format!("[statsd]\nsocket = \"/tmp/s\"\n{MAPPED}sampled = \"scale\"\n");
        let config = load(&sampled, &[]).unwrap();
        assert_eq!(
            config.counters[0].statsd.as_ref().unwrap().sampled,
            crate::config::Sampled::Scale
        );
    }

    #[test]
    fn bad_settings_name_their_key() {
        let cases = [
            (
                format!("[statsd]\nudp = \"localhost\"\n{MAPPED}"),
                "statsd.udp",
            ),
            (
                format!("[statsd]\nudp = \"127.0.0.1:1\"\nreceive_buffer_bytes = 10\n{MAPPED}"),
                "statsd.receive_buffer_bytes",
            ),
            (
                "[statsd]\nudp = \"127.0.0.1:1\"\n[[counters]]\nname = \"a\"\n".to_string(),
                "no counter has a [counters.statsd] mapping",
            ),
            (
                "[[counters]]\nname = \"a\"\n[counters.statsd]\nmetric = \"a\"\n".to_string(),
                "counters.a.statsd: set key_tag",
            ),
            (
                format!("{MAPPED}sampled = \"sometimes\"\n"),
                "unknown variant `sometimes`",
            ),
        ];
        for (text, expected) in cases {
            let err = load(&text, &[]).unwrap_err();
            assert!(err.contains(expected), "{expected:?} not in {err}");
        }
    }
}
