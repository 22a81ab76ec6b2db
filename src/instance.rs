//! This instance's identity and its hold on `data_dir`: the instance id (from config, else kept
//! in `data_dir/instance_id`) and the `data_dir/tallyd.lock` that keeps a second tallyd off the
//! same directory; and `data_dir/tallyd.pid`, through which `tallyd reload` signals the daemon.
//! Also data_dir's mode: private to tallyd's user whatever the umask ([`restrict`]).

use std::fs::{DirBuilder, OpenOptions, Permissions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tracing::warn;

use crate::config::Config;
use crate::io_error::IoError;

#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    #[error("another tallyd is running on this data_dir ({dir})")]
    Locked { dir: PathBuf },
    #[error("daemon.data_dir {dir} exists and is not a directory")]
    NotADirectory { dir: PathBuf },
    #[error("no tallyd is running on data_dir {dir} (its tallyd.lock is free)")]
    NotRunning { dir: PathBuf },
    #[error("{path} does not hold a process id; is the tallyd on this data_dir still starting?")]
    NoPid { path: PathBuf },
    #[error(
        "{path} names pid {pid}, which does not hold {lock} (a stale pid file: that tallyd \
         died without removing it, and the lock is held by another tallyd command or by a tallyd \
         still starting); not signalling it, since the pid may now belong to another process"
    )]
    StalePid {
        pid: i32,
        path: PathBuf,
        lock: PathBuf,
    },
    #[error("cannot signal tallyd (pid {pid}, from {path}): {cause}")]
    Signal {
        pid: i32,
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error(transparent)]
    Io(#[from] IoError),
}

fn io_err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> InstanceError + 'a {
    move |cause| IoError::on(what, path)(cause).into()
}

/// This instance's id: from config, else the one kept in `data_dir/instance_id`, else a new one
/// (written there, so that the next start has the same id and finds its journal coverage).
pub fn instance_id(config: &Config) -> Result<String, InstanceError> {
    if let Some(id) = config.daemon.instance_id() {
        return Ok(id.to_string());
    }
    let path = config.daemon.data_dir.join("instance_id");
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("cannot read", &path)(e)),
    }
    let id = format!("{:016x}", rand::random::<u64>());
    prepare_data_dir(&config.daemon.data_dir)?;
    write_atomically(&path, id.as_bytes()).map_err(io_err("cannot write", &path))?;
    Ok(id)
}

/// Writes `path` whole or not at all (a temporary file, synced, then renamed over it), with
/// mode 0600 whatever the umask.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    // A temporary file left by a crash keeps its old mode through `open`.
    file.set_permissions(Permissions::from_mode(0o600))?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// The mode data_dir is created with: its user's only (it holds every key in the journal and,
/// with the private PostgreSQL, a superuser socket), plus passage (x, not listing) for others
/// when tallyd runs as root, since the private PostgreSQL then runs as `postgres` and must
/// reach its directory inside.
fn data_dir_mode() -> u32 {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        0o711
    } else {
        0o700
    }
}

/// Creates data_dir with [`data_dir_mode`] whatever the umask (its missing parents as before,
/// with the umask's mode: they are not tallyd's), or [`restrict`]s an existing one, keeping the
/// passage bits its operator gave it (for sockets kept inside it, say), with a log line when
/// that changes anything.
fn prepare_data_dir(dir: &Path) -> Result<(), InstanceError> {
    if dir.exists() && !dir.is_dir() {
        return Err(InstanceError::NotADirectory {
            dir: dir.to_path_buf(),
        });
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io_err("cannot create data_dir", dir))?;
    }
    let mode = data_dir_mode();
    match DirBuilder::new().mode(mode).create(dir) {
        // The umask may have taken the passage bits away.
        Ok(()) => std::fs::set_permissions(dir, Permissions::from_mode(mode))
            .map_err(io_err("cannot set the mode of data_dir", dir)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => {
            let restricted = restrict(dir, true).map_err(io_err("cannot restrict", dir))?;
            if let Some(r) = restricted {
                warn!(dir = %dir.display(), was = %format!("{:04o}", r.was), now = %format!("{:04o}", r.now),
                    entries = r.entries, "data_dir was open to other users; restricted it and what is in it to tallyd's user");
            }
            Ok(())
        }
        Err(e) => Err(io_err("cannot create data_dir", dir)(e)),
    }
}

/// What [`restrict`] changed.
#[derive(Debug, PartialEq)]
pub struct Restricted {
    /// The directory's mode before, and after.
    pub was: u32,
    pub now: u32,
    /// Files and directories directly in it that were restricted too.
    pub entries: usize,
}

/// Takes from `dir` every permission of group and others (all but passage, x, with
/// `keep_passage`: then nobody else may list it or write in it, but may still reach a socket in
/// it whose name they know); from the regular files directly in it every permission of group
/// and others; from the directories directly in it reading and writing by group and others
/// (the private PostgreSQL's directory must stay passable when root runs it as `postgres`).
/// Symlinks are not followed. `None` when nothing was open.
pub fn restrict(dir: &Path, keep_passage: bool) -> std::io::Result<Option<Restricted>> {
    let was = std::fs::symlink_metadata(dir)?.permissions().mode() & 0o7777;
    let now = was & !if keep_passage { 0o066 } else { 0o077 };
    if now != was {
        std::fs::set_permissions(dir, Permissions::from_mode(now))?;
    }
    let mut entries = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        // The entry itself: `DirEntry::metadata` does not follow symlinks.
        let meta = entry.metadata()?;
        let mode = meta.permissions().mode() & 0o7777;
        let closed = if meta.is_file() {
            mode & !0o077
        } else if meta.is_dir() {
            mode & !0o066
        } else {
            continue;
        };
        if closed != mode {
            std::fs::set_permissions(entry.path(), Permissions::from_mode(closed))?;
            entries += 1;
        }
    }
    Ok((now != was || entries > 0).then_some(Restricted { was, now, entries }))
}

/// Holds `data_dir/tallyd.lock` while it lives.
#[derive(Debug)]
pub struct DataDirLock {
    _file: std::fs::File,
}

/// Takes `data_dir/tallyd.lock` for as long as the returned lock lives, so that two tallyd
/// processes never share a data directory (its private PostgreSQL, journal and instance id).
pub fn lock_data_dir(dir: &Path) -> Result<DataDirLock, InstanceError> {
    let path = dir.join("tallyd.lock");
    prepare_data_dir(dir)?;
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(io_err("cannot open", &path))?;
    // SAFETY: flock on a descriptor we own; the lock goes with the file.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(InstanceError::Locked {
            dir: dir.to_path_buf(),
        });
    }
    Ok(DataDirLock { _file: file })
}

/// `data_dir/tallyd.pid`, holding the running daemon's process id; removed when dropped.
#[derive(Debug)]
pub struct PidFile {
    path: PathBuf,
}

impl Drop for PidFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Writes this process's id to `data_dir/tallyd.pid`. Only `tallyd run` does, with the data_dir
/// lock held: so the file names the daemon that holds the lock, never another command.
pub fn write_pid(_lock: &DataDirLock, dir: &Path) -> Result<PidFile, InstanceError> {
    let path = dir.join("tallyd.pid");
    let pid = format!("{}\n", std::process::id());
    write_atomically(&path, pid.as_bytes()).map_err(io_err("cannot write", &path))?;
    Ok(PidFile { path })
}

/// Sends SIGHUP (reload the config) to `pid`, which [`running_pid`] found running on `dir`.
pub fn send_reload(dir: &Path, pid: i32) -> Result<(), InstanceError> {
    // SAFETY: kill(2) with a positive pid and a signal number; no memory is involved.
    if unsafe { libc::kill(pid, libc::SIGHUP) } != 0 {
        let cause = std::io::Error::last_os_error();
        let path = dir.join("tallyd.pid");
        return Err(InstanceError::Signal { pid, path, cause });
    }
    Ok(())
}

/// The pid of the daemon running on `dir`: the one its pid file names, when that process holds
/// the data_dir lock. Errors when no daemon holds the lock, or its pid file is missing or stale.
pub fn running_pid(dir: &Path) -> Result<i32, InstanceError> {
    match lock_data_dir(dir) {
        Ok(lock) => {
            drop(lock);
            return Err(InstanceError::NotRunning {
                dir: dir.to_path_buf(),
            });
        }
        Err(InstanceError::Locked { .. }) => {}
        Err(err) => return Err(err),
    }
    let path = dir.join("tallyd.pid");
    let pid = std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .filter(|&pid| pid > 0)
        .ok_or_else(|| InstanceError::NoPid { path: path.clone() })?;
    // The pid file outlives a tallyd killed with -9, and the kernel reuses pids: signal only
    // the process that holds the lock now.
    let lock = dir.join("tallyd.lock");
    let holders = lock_holders(&lock).map_err(io_err("cannot read /proc/locks to check", &lock))?;
    if !holders.contains(&pid) {
        return Err(InstanceError::StalePid { pid, path, lock });
    }
    Ok(pid)
}

/// The processes holding a lock on `path`, from `/proc/locks` (one line per lock: `id: FLOCK
/// ADVISORY WRITE pid major:minor:inode start end`; waiters are marked `->`). Matched on the
/// inode only: on overlayfs the device `stat` reports is not the one the lock is recorded on.
fn lock_holders(path: &Path) -> std::io::Result<Vec<i32>> {
    use std::os::unix::fs::MetadataExt;
    let inode = std::fs::metadata(path)?.ino();
    let locks = std::fs::read_to_string("/proc/locks")?;
    Ok(parse_lock_holders(&locks, inode))
}

fn parse_lock_holders(locks: &str, inode: u64) -> Vec<i32> {
    locks
        .lines()
        .filter(|l| !l.contains("->"))
        .filter_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            let (pid, id) = (fields.get(4)?, fields.get(5)?);
            let ino: u64 = id.rsplit(':').next()?.parse().ok()?;
            (ino == inode).then(|| pid.parse().ok()).flatten()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn lock_holders_are_read_from_proc_locks() {
        let locks = "1: FLOCK  ADVISORY  WRITE 4242 08:02:131074 0 EOF\n\
                     1: -> FLOCK  ADVISORY  WRITE 77 08:02:131074 0 EOF\n\
                     2: POSIX  ADVISORY  WRITE 99 08:02:5 0 EOF\n";
        assert_eq!(super::parse_lock_holders(locks, 131074), [4242]);
    }

    use super::*;

    #[test]
    fn restrict_closes_a_directory_and_its_files_to_group_and_others() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        let set = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        let (file, tight, sub) = (
            dir.path().join("f"),
            dir.path().join("t"),
            dir.path().join("d"),
        );
        std::fs::write(&file, b"x").unwrap();
        std::fs::write(&tight, b"x").unwrap();
        std::fs::create_dir(&sub).unwrap();
        set(&file, 0o664);
        set(&tight, 0o600);
        set(&sub, 0o777);
        set(dir.path(), 0o775);
        let restricted = restrict(dir.path(), true).unwrap();
        assert_eq!(
            restricted,
            Some(Restricted {
                was: 0o775,
                now: 0o711,
                entries: 2
            })
        );
        assert_eq!(
            (mode(&file), mode(&tight), mode(&sub)),
            (0o600, 0o600, 0o711)
        );
        assert_eq!(restrict(dir.path(), true).unwrap(), None);
        assert_eq!(restrict(dir.path(), false).unwrap().unwrap().now, 0o700);
    }

    #[test]
    fn a_second_lock_on_the_same_data_dir_is_refused_until_the_first_goes() {
        let dir = tempfile::tempdir().unwrap();
        let first = lock_data_dir(dir.path()).unwrap();
        assert!(matches!(
            lock_data_dir(dir.path()),
            Err(InstanceError::Locked { .. })
        ));
        drop(first);
        lock_data_dir(dir.path()).unwrap();
    }
}
