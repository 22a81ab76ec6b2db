//! The service manager (systemd): readiness, reload and stop notifications and the watchdog
//! (`sd_notify`, through the `sd-notify` crate), and the sockets systemd passes in (socket
//! activation, `LISTEN_FDS`). Every function here is a no-op when tallyd was not started by
//! systemd: without `NOTIFY_SOCKET` nothing is sent, without `LISTEN_FDS` nothing is adopted
//! and the listeners bind their own sockets.
//!
//! Why socket activation matters: the sockets belong to systemd (`tallyd.socket`), so while
//! tallyd restarts, clients still connect and send; the kernel queues their connections and
//! datagrams until the new process accepts them. A restart never refuses a client.

use std::collections::HashMap;
use std::future::Future;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use sd_notify::NotifyState;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Sends `states` to the service manager, if there is one. A failure is logged and otherwise
/// ignored: systemd then times the start out (or the watchdog fires), which says more than a
/// daemon that stops over it.
fn notify(states: &[NotifyState]) {
    if let Err(err) = sd_notify::notify(states) {
        warn!(cause = %err, "cannot notify the service manager (NOTIFY_SOCKET)");
    }
}

/// READY=1: the sockets are bound, the journal is replayed and connections are served. Sent at
/// start and again after a reload.
pub fn ready() {
    notify(&[NotifyState::Ready, NotifyState::Status("ready: serving")]);
}

/// RELOADING=1 with the monotonic time systemd asks for (`Type=notify-reload` needs it); send
/// [`ready`] once the new configuration is in force, or rejected.
pub fn reloading() {
    let mut states = vec![
        NotifyState::Reloading,
        NotifyState::Status("reloading the configuration"),
    ];
    match NotifyState::monotonic_usec_now() {
        Ok(now) => states.push(now),
        Err(err) => debug!(cause = %err, "no monotonic clock for MONOTONIC_USEC"),
    }
    notify(&states);
}

/// STOPPING=1: a graceful stop began (drain, final flush).
pub fn stopping() {
    notify(&[
        NotifyState::Stopping,
        NotifyState::Status("stopping: draining connections, final flush"),
    ]);
}

/// A STATUS= line for `systemctl status`.
pub fn status(text: &str) {
    notify(&[NotifyState::Status(text)]);
}

/// While `stop` is not cancelled and systemd asked for a watchdog (`WatchdogSec=`, hence
/// `WATCHDOG_USEC`), sends WATCHDOG=1 every half period, each time only after `probe` has
/// completed within the period. Spawned on the daemon's runtime: a ping proves that the runtime
/// still schedules tasks and that `probe` (the daemon's check of its main loop) made progress;
/// a stuck runtime or a probe that hangs stops the pings, and systemd restarts tallyd. It
/// proves nothing about the database (see /readyz): restarting would not bring that back.
pub fn spawn_watchdog<F, Fut>(probe: F, stop: CancellationToken)
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = bool> + Send,
{
    let Some(period) = sd_notify::watchdog_enabled() else {
        return;
    };
    let every = (period / 2).max(Duration::from_millis(1));
    info!(period_ms = period.as_millis() as u64, "systemd watchdog on");
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            match tokio::time::timeout(period, probe()).await {
                Ok(true) => notify(&[NotifyState::Watchdog]),
                Ok(false) => warn!("watchdog probe failed: no WATCHDOG=1 ping"),
                Err(_) => warn!("watchdog probe did not finish within the watchdog period"),
            }
        }
    });
}

/// The sockets systemd passed (`LISTEN_FDS`, for this process: `LISTEN_PID`), with their
/// `FileDescriptorName=` (`LISTEN_FDNAMES`). Each is taken at most once; what is left over is
/// logged and closed.
#[derive(Default)]
pub struct Activated {
    fds: Vec<(String, OwnedFd)>,
}

#[derive(Debug, thiserror::Error)]
pub enum ActivationError {
    #[error("the sockets systemd passed are unusable (LISTEN_FDS, LISTEN_FDNAMES): {0}")]
    Env(std::io::Error),
    #[error(
        "the socket systemd passed as {name:?} (FileDescriptorName=) is {found}; tallyd's \
         {name} socket must be {expected}"
    )]
    WrongType {
        name: String,
        expected: &'static str,
        found: &'static str,
    },
}

impl Activated {
    /// Takes the passed sockets (marked close-on-exec, so the private PostgreSQL does not
    /// inherit them). Empty when tallyd was not socket-activated.
    pub fn take() -> Result<Activated, ActivationError> {
        let fds = sd_notify::listen_fds_with_names().map_err(ActivationError::Env)?;
        let fds = fds
            // SAFETY: systemd passed these descriptors to this process (LISTEN_PID matched)
            // and nothing else in tallyd owns them; each is wrapped once.
            .map(|(fd, name)| (name, unsafe { OwnedFd::from_raw_fd(fd) }))
            .collect::<Vec<_>>();
        if !fds.is_empty() {
            let names: Vec<&str> = fds.iter().map(|(n, _)| n.as_str()).collect();
            info!(sockets = ?names, "sockets passed by systemd (socket activation)");
        }
        Ok(Activated { fds })
    }

    pub fn is_empty(&self) -> bool {
        self.fds.is_empty()
    }

    /// The socket named `name`; else the first one of socket type `kind` (`libc::SOCK_STREAM`,
    /// `libc::SOCK_DGRAM`) bound to the Unix socket `path`, whatever its name (a socket unit
    /// without `FileDescriptorName=` names its sockets after itself, e.g. `tallyd.socket`). A
    /// socket named `name` of another type is an error: served as the wrong kind, it would
    /// never take a client while tallyd says it is ready.
    pub fn take_socket(
        &mut self,
        name: &str,
        kind: i32,
        path: &std::path::Path,
    ) -> Result<Option<OwnedFd>, ActivationError> {
        if let Some(at) = self.fds.iter().position(|(n, _)| n == name) {
            let found = socket_type(raw(&self.fds[at].1));
            if found != Some(kind) {
                return Err(ActivationError::WrongType {
                    name: name.to_string(),
                    expected: type_name(Some(kind)),
                    found: type_name(found),
                });
            }
            return Ok(Some(self.fds.remove(at).1));
        }
        let at = self.fds.iter().position(|(n, fd)| {
            !KNOWN_NAMES.contains(&n.as_str())
                && socket_type(raw(fd)) == Some(kind)
                && local_path(raw(fd)).as_deref() == Some(path)
        });
        Ok(at.map(|at| self.fds.remove(at).1))
    }

    /// Logs (and closes) what no configured socket took.
    pub fn finish(self) {
        let by_name: HashMap<&str, usize> =
            self.fds.iter().fold(HashMap::new(), |mut m, (n, _)| {
                *m.entry(n.as_str()).or_default() += 1;
                m
            });
        for (name, count) in by_name {
            warn!(
                name,
                count,
                "a socket systemd passed matches no configured socket; closing it \
                 (name it with FileDescriptorName= stream, datagram, statsd, statsd-stream or \
                 statsd-udp, or listen on the path config.toml names)"
            );
        }
    }
}

/// The `FileDescriptorName=`s tallyd knows: each names one configured socket.
const KNOWN_NAMES: [&str; 5] = [
    "stream",
    "datagram",
    "statsd",
    "statsd-stream",
    "statsd-udp",
];

fn raw(fd: &OwnedFd) -> RawFd {
    use std::os::fd::AsRawFd;
    fd.as_raw_fd()
}

/// How a socket type reads in an error, with the socket unit setting that makes one.
fn type_name(kind: Option<i32>) -> &'static str {
    match kind {
        Some(libc::SOCK_STREAM) => "a stream socket (ListenStream=)",
        Some(libc::SOCK_DGRAM) => "a datagram socket (ListenDatagram=)",
        Some(_) => "a socket of another type",
        None => "not a socket",
    }
}

/// SO_TYPE of a socket.
fn socket_type(fd: RawFd) -> Option<i32> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a valid fd and a pointer to an int of the size given.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_TYPE,
            (&mut value as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(value)
}

/// The path a Unix socket is bound to.
fn local_path(fd: RawFd) -> Option<std::path::PathBuf> {
    // SAFETY: borrowed for the call only; `ManuallyDrop` keeps the fd open.
    let socket =
        std::mem::ManuallyDrop::new(unsafe { std::os::unix::net::UnixDatagram::from_raw_fd(fd) });
    let addr = socket.local_addr().ok()?;
    addr.as_pathname().map(|p| p.to_path_buf())
}

#[cfg(test)]
mod tests {
    use std::os::fd::OwnedFd;
    use std::os::unix::net::{UnixDatagram, UnixListener};

    use super::Activated;

    fn passed(sockets: Vec<(&str, OwnedFd)>) -> Activated {
        Activated {
            fds: sockets
                .into_iter()
                .map(|(n, fd)| (n.to_string(), fd))
                .collect(),
        }
    }

    #[test]
    fn sockets_are_taken_by_name_else_by_type_and_path() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (
            dir.path().join("a.sock"),
            dir.path().join("b.dgram"),
            dir.path().join("c.sock"),
        );
        let mut activated = passed(vec![
            ("tallyd.socket", UnixListener::bind(&a).unwrap().into()),
            ("tallyd.socket", UnixDatagram::bind(&b).unwrap().into()),
            ("stream", UnixListener::bind(&c).unwrap().into()),
        ]);
        // A name wins over a path.
        let named = activated
            .take_socket("stream", libc::SOCK_STREAM, &a)
            .unwrap();
        assert_eq!(super::local_path(super::raw(&named.unwrap())), Some(c));
        // Unnamed: the right type at the right path, nothing else.
        assert!(activated
            .take_socket("datagram", libc::SOCK_DGRAM, &a)
            .unwrap()
            .is_none());
        assert!(activated
            .take_socket("datagram", libc::SOCK_STREAM, &b)
            .unwrap()
            .is_none());
        let dgram = activated.take_socket("datagram", libc::SOCK_DGRAM, &b);
        assert!(dgram.unwrap().is_some());
        assert!(activated
            .take_socket("stream", libc::SOCK_STREAM, &a)
            .unwrap()
            .is_some());
        assert!(activated.is_empty());
    }

    #[test]
    fn a_socket_named_for_another_role_is_not_taken_by_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.dgram");
        let mut activated = passed(vec![("statsd", UnixDatagram::bind(&path).unwrap().into())]);
        assert!(activated
            .take_socket("datagram", libc::SOCK_DGRAM, &path)
            .unwrap()
            .is_none());
        assert!(activated
            .take_socket("statsd", libc::SOCK_DGRAM, &path)
            .unwrap()
            .is_some());
    }

    /// Swapped `FileDescriptorName=`s: refused by name, not served as the wrong kind.
    #[test]
    fn a_named_socket_of_the_wrong_type_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.dgram");
        let mut activated = passed(vec![("stream", UnixDatagram::bind(&path).unwrap().into())]);
        let err = activated
            .take_socket("stream", libc::SOCK_STREAM, &path)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"stream\"") && err.contains("is a datagram socket"),
            "{err}"
        );
    }
}
