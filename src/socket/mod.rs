//! Unix sockets as tallyd binds them: a stale socket file cleared (a live one refused), the
//! socket mode set, a socket systemd passed adopted instead; and reading datagrams, one or a
//! batch at a time ([`DatagramSource`]). Shared by the native listeners ([`crate::listener`])
//! and the statsd ones ([`crate::statsd`]). Also the socket through which `tallyd reload` hears
//! the daemon's verdict ([`reload_reply`]).

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;

mod batch;
mod datagram;
pub mod reload_reply;

pub(crate) use batch::RecvBatch;
pub use datagram::{check_dgram_qlen, MAX_DATAGRAM};
pub(crate) use datagram::{recv_nonblocking, DatagramSource};

use crate::io_error::IoError;
use crate::service::Activated;

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("{path}: another tallyd is listening on this socket")]
    InUse { path: PathBuf },
    #[error("{path}: exists and is not a socket; refusing to replace it")]
    NotASocket { path: PathBuf },
    #[error(transparent)]
    Activation(#[from] crate::service::ActivationError),
    #[error(transparent)]
    Io(#[from] IoError),
}

/// Removes a socket file left by a crashed tallyd; refuses to touch a live socket, a symlink or
/// anything that is not a socket.
fn clear_stale(path: &Path) -> Result<(), ListenError> {
    let io_err = |what, cause| ListenError::Io(IoError::on(what, path)(cause));
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("cannot inspect", e)),
        Ok(meta) if !meta.file_type().is_socket() => Err(ListenError::NotASocket {
            path: path.to_path_buf(),
        }),
        Ok(_) => {
            let live = std::os::unix::net::UnixStream::connect(path).is_ok()
                || std::os::unix::net::UnixDatagram::unbound()
                    .and_then(|s| s.connect(path))
                    .is_ok();
            if live {
                return Err(ListenError::InUse {
                    path: path.to_path_buf(),
                });
            }
            std::fs::remove_file(path).map_err(|e| io_err("cannot remove stale socket", e))
        }
    }
}

pub(crate) fn prepare(path: &Path) -> Result<(), ListenError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(IoError::on("cannot create socket directory", dir))?;
    }
    clear_stale(path)
}

pub(crate) fn set_mode(path: &Path, mode: u32) -> Result<(), ListenError> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|cause| IoError::on("cannot set socket mode", path)(cause).into())
}

/// The socket at `path`: the one systemd passed under `name` (or unnamed, of `kind` and bound to
/// `path`), noted in `adopted` so that its file is never removed; else bound here, with `mode`.
pub(crate) fn take_or_bind<T>(
    (path, mode, name, kind): (&Path, u32, &str, libc::c_int),
    activated: &mut Activated,
    adopted: &mut Vec<PathBuf>,
    from_fd: impl FnOnce(std::os::fd::OwnedFd) -> io::Result<T>,
    bind: impl FnOnce(&Path) -> io::Result<T>,
) -> Result<T, ListenError> {
    if let Some(fd) = activated.take_socket(name, kind, path)? {
        adopted.push(path.to_path_buf());
        return adopt(path, || from_fd(fd));
    }
    prepare(path)?;
    let socket = bind(path).map_err(|e| bind_err(path, e))?;
    set_mode(path, mode)?;
    Ok(socket)
}

/// A Unix stream listener at `path`, taken or bound as [`take_or_bind`] does.
pub(crate) fn take_or_bind_listener(
    (path, mode, name): (&Path, u32, &str),
    activated: &mut Activated,
    adopted: &mut Vec<PathBuf>,
) -> Result<UnixListener, ListenError> {
    take_or_bind(
        (path, mode, name, libc::SOCK_STREAM),
        activated,
        adopted,
        |fd| {
            let l = std::os::unix::net::UnixListener::from(fd);
            l.set_nonblocking(true)?;
            UnixListener::from_std(l)
        },
        |p: &Path| UnixListener::bind(p),
    )
}

fn bind_err(path: &Path, cause: io::Error) -> ListenError {
    ListenError::Io(IoError::on("cannot bind", path)(cause))
}

/// A socket systemd passed, made non-blocking and registered with the runtime by `make`.
pub(crate) fn adopt<T>(
    path: &Path,
    make: impl FnOnce() -> io::Result<T>,
) -> Result<T, ListenError> {
    make().map_err(|cause| {
        ListenError::Io(IoError::on(
            "cannot use the socket systemd passed for",
            path,
        )(cause))
    })
}

/// Removes a socket file tallyd bound itself (`None`: systemd's, which stays).
pub(crate) fn remove_socket_file(path: Option<PathBuf>) {
    if let Some(path) = path {
        let _ = std::fs::remove_file(path);
    }
}
