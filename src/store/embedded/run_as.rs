//! The OS account initdb and postgres run as: PostgreSQL refuses to run as root, so when tallyd
//! runs as root they run as the `postgres` user, and the directories they write to are
//! chowned to it (and must be reachable by it).

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use super::{io_err, EmbeddedError};
use crate::io_error::IoError;

/// The OS account initdb and postgres run as.
#[derive(Clone)]
pub(super) struct RunAs {
    name: String,
    /// `None` when we are not root and simply run as ourselves.
    ids: Option<(u32, u32)>,
    /// The run-as user's home directory: its `HOME`, so that libpq in the server (Citus's
    /// node connections) looks for client certificates there, not in root's unreadable home.
    home: Option<std::ffi::OsString>,
}

impl RunAs {
    pub(super) fn detect() -> Result<RunAs, EmbeddedError> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Ok(RunAs {
                name: "current".to_string(),
                ids: None,
                home: None,
            });
        }
        let (uid, gid, home) = lookup_user("postgres")?.ok_or(EmbeddedError::NoPostgresUser)?;
        Ok(RunAs {
            name: "postgres".to_string(),
            ids: Some((uid, gid)),
            home,
        })
    }

    /// Whether the server runs as another user than tallyd (tallyd is root).
    pub(super) fn is_other_user(&self) -> bool {
        self.ids.is_some()
    }

    pub(super) fn apply(&self, cmd: &mut Command) {
        if let Some((uid, gid)) = self.ids {
            // std drops supplementary groups itself (setgroups(0)) when root sets a uid
            // without explicit groups, which is what `.groups(&[])` would do.
            cmd.uid(uid).gid(gid);
        }
        if let Some(home) = &self.home {
            cmd.env("HOME", home);
        }
    }

    /// Make `path` (recursively) owned by the run-as user; a no-op when not root.
    pub(super) fn own(&self, path: &Path) -> Result<(), EmbeddedError> {
        let Some((uid, gid)) = self.ids else {
            return Ok(());
        };
        let meta = fs::symlink_metadata(path).map_err(IoError::on("cannot stat", path))?;
        if meta.uid() == uid && meta.gid() == gid {
            // Our own directories are chowned as a whole, so a correct top means a correct tree;
            // this keeps restarts of large clusters cheap.
            return Ok(());
        }
        chown_recursive(path, uid, gid)
    }
}

/// Thread-safe passwd lookup; tests start clusters from several threads at once.
/// The user's uid, gid and home directory (none when the entry names none).
#[allow(clippy::type_complexity)]
fn lookup_user(
    name: &str,
) -> Result<Option<(u32, u32, Option<std::ffi::OsString>)>, EmbeddedError> {
    let cname = CString::new(name).map_err(|e| EmbeddedError::Io {
        what: format!("look up user {name}"),
        cause: io::Error::new(io::ErrorKind::InvalidInput, e),
    })?;
    let mut buf = vec![0u8; 4096];
    loop {
        // SAFETY: all-zero is a valid bit pattern for the plain-data passwd struct.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the duration of the call and buf.len() is its size.
        let rc = unsafe {
            libc::getpwnam_r(
                cname.as_ptr(),
                &mut pwd,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut result,
            )
        };
        if rc == libc::ERANGE && buf.len() < 1 << 20 {
            buf.resize(buf.len() * 2, 0);
            continue;
        }
        if rc != 0 {
            return Err(EmbeddedError::Io {
                what: format!("look up user {name}"),
                cause: io::Error::from_raw_os_error(rc),
            });
        }
        if result.is_null() {
            return Ok(None);
        }
        let home = (!pwd.pw_dir.is_null()).then(|| {
            // SAFETY: on success a non-null pw_dir points to a NUL-terminated string in `buf`.
            let home = unsafe { std::ffi::CStr::from_ptr(pwd.pw_dir) };
            std::ffi::OsStr::from_bytes(home.to_bytes()).to_os_string()
        });
        return Ok(Some((pwd.pw_uid, pwd.pw_gid, home)));
    }
}

fn chown_recursive(path: &Path, uid: u32, gid: u32) -> Result<(), EmbeddedError> {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid))
        .map_err(io_err(format!("chown {} to postgres", path.display())))?;
    let meta = fs::symlink_metadata(path).map_err(IoError::on("cannot stat", path))?;
    if meta.is_dir() {
        let entries = fs::read_dir(path).map_err(IoError::on("cannot read directory", path))?;
        for entry in entries {
            let entry = entry.map_err(IoError::on("cannot read directory", path))?;
            chown_recursive(&entry.path(), uid, gid)?;
        }
    }
    Ok(())
}

/// Whether a process with exactly (uid, gid) and no supplementary groups may traverse `path`.
fn traversable_by(meta: &fs::Metadata, uid: u32, gid: u32) -> bool {
    let mode = meta.mode();
    if meta.uid() == uid {
        mode & 0o100 != 0
    } else if meta.gid() == gid {
        mode & 0o010 != 0
    } else {
        mode & 0o001 != 0
    }
}

/// Root can create the directories, but the unprivileged server must be able to walk to them;
/// failing here beats an opaque "Permission denied" from initdb.
pub(super) fn check_reachable(dir: &Path, run_as: &RunAs) -> Result<(), EmbeddedError> {
    let Some((uid, gid)) = run_as.ids else {
        return Ok(());
    };
    for p in dir.ancestors() {
        let meta = fs::metadata(p).map_err(IoError::on("cannot stat", p))?;
        if !traversable_by(&meta, uid, gid) {
            return Err(EmbeddedError::Unreachable {
                path: p.to_path_buf(),
                user: run_as.name.clone(),
            });
        }
    }
    Ok(())
}
