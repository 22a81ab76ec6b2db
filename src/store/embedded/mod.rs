//! Private PostgreSQL cluster: initdb on first start, reuse later, Unix socket only, stopped with tallyd.
//!
//! This module owns the cluster directory `<dir>`: the data directory `<dir>/pgdata`, the
//! socket directory `<dir>/pgsocket` and the server log `<dir>/postgres.log`. The server runs
//! as a direct child process (no pg_ctl) so that we can signal and reap it ourselves.
//!
//! PostgreSQL refuses to run as root, so when tallyd runs as root both `initdb` and
//! `postgres` run as the `postgres` OS user and the directories they write to are chowned to it.
//!
//! Everything here blocks; async callers should use `spawn_blocking`.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::io_error::IoError;

mod install;
mod run_as;

pub use install::find_bin_dir;
use install::resolve_bin_dir;
use run_as::{check_reachable, RunAs};

/// Port number only names the socket file (`.s.PGSQL.<port>`); each cluster has its own
/// socket directory, so the fixed default never collides. A `port` setting overrides it (for a
/// cluster that also listens on TCP).
pub const PORT: u16 = 5432;
/// `sun_path` is 108 bytes including the terminating NUL.
const MAX_SOCKET_PATH: usize = 107;
const POLL_INTERVAL: Duration = Duration::from_millis(20);
const START_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(60);
/// Grace period after escalating to SIGQUIT before resorting to SIGKILL.
const QUIT_GRACE: Duration = Duration::from_secs(5);
/// After a postmaster was SIGKILLed its children need a moment to notice and detach from
/// shared memory; until then a new postmaster refuses to start. Retry that long.
const SHMEM_BUSY_RETRY: Duration = Duration::from_secs(10);
const LOG_TAIL_BYTES: u64 = 8 * 1024;
const PGDATA: &str = "pgdata";
const PGSOCKET: &str = "pgsocket";
const LOG_FILE: &str = "postgres.log";
/// initdb writes here and the result is renamed to `pgdata`, so a crash during initdb never
/// leaves a half-initialised `pgdata` that looks like a real cluster.
const PGDATA_INIT: &str = "pgdata.initdb-tmp";
const SEARCH_ROOT: &str = "/usr/lib/postgresql";

pub struct EmbeddedOptions {
    /// Directory that holds the cluster: data in `<dir>/pgdata`, the Unix socket in
    /// `<dir>/pgsocket`, the server log in `<dir>/postgres.log`. Created if missing.
    pub dir: PathBuf,
    /// Extra server settings passed as `-c name=value`, e.g. ("fsync","off") for tests.
    pub settings: Vec<(String, String)>,
    /// Override the binary directory; None = discover.
    pub bin_dir: Option<PathBuf>,
}

impl EmbeddedOptions {
    fn port(&self) -> u16 {
        let set = self.settings.iter().rev().find(|(k, _)| k == "port");
        set.and_then(|(_, v)| v.parse().ok()).unwrap_or(PORT)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    #[error(
        "PostgreSQL server binaries not found (looked in {}). Install them with: apt-get install -y postgresql",
        display_paths(searched)
    )]
    NoBinaries { searched: Vec<PathBuf> },

    /// A file or directory operation on one path.
    #[error(transparent)]
    File(#[from] IoError),

    /// An operation not on one path (running a program, looking up a user).
    #[error("{what}: {cause}")]
    Io { what: String, cause: io::Error },

    #[error("running as root, but there is no `postgres` OS user to run PostgreSQL as (PostgreSQL refuses to run as root); create it with: useradd --system postgres")]
    NoPostgresUser,

    #[error("{} is not traversable by the {user} OS user that runs PostgreSQL; use a data_dir under /tmp or the project directory, or make every parent directory world-executable", path.display())]
    Unreachable { path: PathBuf, user: String },

    #[error("Unix socket path {} is {len} bytes, longer than the {MAX_SOCKET_PATH}-byte limit; use a shorter data_dir", path.display())]
    SocketPathTooLong { path: PathBuf, len: usize },

    #[error("initdb failed ({status}):\n{log}")]
    InitdbFailed { status: ExitStatus, log: String },

    #[error("another PostgreSQL server is already running on {}:\n{log}", data_dir.display())]
    AlreadyRunning { data_dir: PathBuf, log: String },

    #[error("PostgreSQL exited during startup ({status}); server log tail:\n{log}")]
    StartFailed { status: ExitStatus, log: String },

    #[error("PostgreSQL did not accept connections within {}s; server log tail:\n{log}", waited.as_secs())]
    StartTimeout { waited: Duration, log: String },
}

fn display_paths(paths: &[PathBuf]) -> String {
    let v: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    v.join(", ")
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> EmbeddedError {
    let what = what.into();
    move |cause| EmbeddedError::Io { what, cause }
}

/// A running postmaster. Dropping it performs a fast shutdown.
pub struct Embedded {
    child: Option<Child>,
    pid: u32,
    port: u16,
    data_dir: PathBuf,
    socket_dir: PathBuf,
    log_path: PathBuf,
}

/// Create `path` with `mode` if missing; an existing directory keeps its mode.
fn ensure_dir(path: &Path, mode: u32) -> Result<(), EmbeddedError> {
    match fs::DirBuilder::new().mode(mode).create(path) {
        Ok(()) => {
            // The umask may have stripped bits the server needs.
            fs::set_permissions(path, fs::Permissions::from_mode(mode))
                .map_err(|e| IoError::on("cannot chmod", path)(e).into())
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => Ok(()),
        Err(e) => Err(IoError::on("cannot create directory", path)(e).into()),
    }
}

/// libpq key-value quoting.
/// The connection string of a private cluster whose socket is in `socket_dir` (running or not).
pub fn socket_connection_string(socket_dir: &Path, port: u16, dbname: &str) -> String {
    format!(
        "host={} port={port} user=postgres dbname={}",
        crate::store::conninfo::quote(&socket_dir.to_string_lossy()),
        crate::store::conninfo::quote(dbname)
    )
}

fn initdb(
    bin_dir: &Path,
    dir: &Path,
    data_dir: &Path,
    run_as: &RunAs,
) -> Result<(), EmbeddedError> {
    let tmp = dir.join(PGDATA_INIT);
    if tmp.exists() {
        // Leftover of an initdb that died midway; it never held data.
        fs::remove_dir_all(&tmp).map_err(IoError::on("cannot remove stale", &tmp))?;
    }
    ensure_dir(&tmp, 0o700)?;
    run_as.own(&tmp)?;

    tracing::info!(data_dir = %data_dir.display(), "initialising PostgreSQL cluster");
    let initdb = bin_dir.join("initdb");
    let mut cmd = Command::new(&initdb);
    cmd.arg("-D")
        .arg(&tmp)
        .args([
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "-N",
        ])
        // initdb resolves its cwd; an inherited one like /root is unreadable for postgres.
        .current_dir(dir)
        .stdin(Stdio::null());
    run_as.apply(&mut cmd);
    let out = cmd
        .output()
        .map_err(io_err(format!("run {}", initdb.display())))?;
    if !out.status.success() {
        let mut log = String::from_utf8_lossy(&out.stdout).into_owned();
        log.push_str(&String::from_utf8_lossy(&out.stderr));
        let _ = fs::remove_dir_all(&tmp);
        return Err(EmbeddedError::InitdbFailed {
            status: out.status,
            log,
        });
    }
    // rename() replaces an empty directory but refuses a non-empty one, so a pgdata holding
    // something that is not a cluster is never clobbered.
    fs::rename(&tmp, data_dir).map_err(io_err(format!(
        "move new cluster {} to {} (is {} non-empty without PG_VERSION?)",
        tmp.display(),
        data_dir.display(),
        data_dir.display()
    )))?;
    Ok(())
}

/// What one spawn attempt of the postmaster ended with.
enum Launch {
    Ready(Child),
    /// Children of a killed postmaster still hold the old shared memory segment.
    ShmemBusy(EmbeddedError),
}

impl Embedded {
    /// Start (initdb first if `<dir>/pgdata/PG_VERSION` is missing). Blocks until the server
    /// accepts connections on its Unix socket, at most 60 s.
    pub fn start(opts: &EmbeddedOptions) -> Result<Embedded, EmbeddedError> {
        let bin_dir = resolve_bin_dir(opts)?;
        let run_as = RunAs::detect()?;

        // postgres chdirs into its data directory, and libpq needs an absolute host path.
        let dir = if opts.dir.is_absolute() {
            opts.dir.clone()
        } else {
            std::env::current_dir()
                .map_err(io_err("determine current directory"))?
                .join(&opts.dir)
        };
        let data_dir = dir.join(PGDATA);
        let socket_dir = dir.join(PGSOCKET);
        let log_path = dir.join(LOG_FILE);

        let socket_path = socket_dir.join(format!(".s.PGSQL.{}", opts.port()));
        let len = socket_path.as_os_str().as_bytes().len();
        if len > MAX_SOCKET_PATH {
            return Err(EmbeddedError::SocketPathTooLong {
                path: socket_path,
                len,
            });
        }

        if let Some(parent) = dir.parent() {
            fs::create_dir_all(parent).map_err(IoError::on("cannot create directory", parent))?;
        }
        // Owner only whatever the umask (root opens the server log in it), passable by the
        // server when root runs it as `postgres`.
        ensure_dir(&dir, if run_as.is_other_user() { 0o711 } else { 0o700 })?;
        check_reachable(&dir, &run_as)?;
        // The socket in it is 0700 too (unix_socket_permissions): trust authentication.
        ensure_dir(&socket_dir, 0o700)?;
        run_as.own(&socket_dir)?;

        if !data_dir.join("PG_VERSION").is_file() {
            initdb(&bin_dir, &dir, &data_dir, &run_as)?;
        }
        run_as.own(&data_dir)?;

        let deadline = Instant::now() + SHMEM_BUSY_RETRY;
        let child = loop {
            match launch(
                &bin_dir,
                &dir,
                &data_dir,
                &socket_dir,
                &socket_path,
                &log_path,
                opts,
                &run_as,
            )? {
                Launch::Ready(child) => break child,
                Launch::ShmemBusy(err) => {
                    if Instant::now() >= deadline {
                        return Err(err);
                    }
                    tracing::debug!(
                        "old server processes still attached to shared memory; retrying"
                    );
                    thread::sleep(Duration::from_millis(100));
                }
            }
        };
        let pid = child.id();
        tracing::info!(pid, socket_dir = %socket_dir.display(), "PostgreSQL ready");
        Ok(Embedded {
            child: Some(child),
            pid,
            port: opts.port(),
            data_dir,
            socket_dir,
            log_path,
        })
    }

    /// Directory containing the Unix socket (use as libpq `host=`).
    pub fn socket_dir(&self) -> &Path {
        &self.socket_dir
    }

    /// The cluster's data directory (`<dir>/pgdata`).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The server log (`<dir>/postgres.log`).
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// A tokio-postgres/libpq key-value connection string:
    /// `host=<socket_dir> port=5432 user=postgres dbname=<dbname>`.
    pub fn connection_string(&self, dbname: &str) -> String {
        socket_connection_string(&self.socket_dir, self.port, dbname)
    }

    /// Server process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Fast shutdown (SIGINT to the postmaster), wait for exit (timeout 60s, then SIGQUIT/SIGKILL).
    pub fn stop(mut self) -> Result<(), EmbeddedError> {
        self.shutdown(libc::SIGINT)
    }

    /// Immediate shutdown (SIGQUIT to postmaster) and wait: simulates a crash; the cluster
    /// restarts with crash recovery on the next `start`.
    pub fn stop_immediate(mut self) -> Result<(), EmbeddedError> {
        self.shutdown(libc::SIGQUIT)
    }

    fn shutdown(&mut self, signal: libc::c_int) -> Result<(), EmbeddedError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let status = terminate(&mut child, signal, STOP_TIMEOUT)?;
        if signal == libc::SIGINT && !status.success() {
            tracing::warn!(pid = self.pid, %status, "PostgreSQL exited abnormally on shutdown");
        } else {
            tracing::info!(pid = self.pid, %status, "PostgreSQL stopped");
        }
        Ok(())
    }
}

impl Drop for Embedded {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown(libc::SIGINT) {
            tracing::warn!(pid = self.pid, error = %e, "stopping PostgreSQL on drop failed");
        }
    }
}

fn send_signal(child: &Child, signal: libc::c_int) {
    // The child is not reaped yet, so its pid cannot have been reused.
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(child.id() as libc::pid_t, signal);
    }
}

fn wait_timeout(child: &mut Child, timeout: Duration) -> Result<Option<ExitStatus>, EmbeddedError> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child
            .try_wait()
            .map_err(io_err(format!("wait for PostgreSQL (pid {})", child.id())))?
        {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// Signal, wait, then escalate: SIGQUIT (immediate shutdown) and finally SIGKILL.
fn terminate(
    child: &mut Child,
    signal: libc::c_int,
    timeout: Duration,
) -> Result<ExitStatus, EmbeddedError> {
    if let Some(status) = child
        .try_wait()
        .map_err(io_err(format!("wait for PostgreSQL (pid {})", child.id())))?
    {
        return Ok(status);
    }
    send_signal(child, signal);
    if let Some(status) = wait_timeout(child, timeout)? {
        return Ok(status);
    }
    if signal != libc::SIGQUIT {
        tracing::warn!(
            pid = child.id(),
            "PostgreSQL did not stop in time; sending SIGQUIT"
        );
        send_signal(child, libc::SIGQUIT);
        if let Some(status) = wait_timeout(child, QUIT_GRACE)? {
            return Ok(status);
        }
    }
    tracing::warn!(
        pid = child.id(),
        "PostgreSQL still running; sending SIGKILL"
    );
    send_signal(child, libc::SIGKILL);
    child
        .wait()
        .map_err(io_err(format!("wait for PostgreSQL (pid {})", child.id())))
}

#[allow(clippy::too_many_arguments)]
fn launch(
    bin_dir: &Path,
    dir: &Path,
    data_dir: &Path,
    socket_dir: &Path,
    socket_path: &Path,
    log_path: &Path,
    opts: &EmbeddedOptions,
    run_as: &RunAs,
) -> Result<Launch, EmbeddedError> {
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(log_path)
        .map_err(IoError::on("cannot open server log", log_path))?;
    // Only this attempt's output belongs in an error; the log may hold another server's lines.
    let log_start = log
        .metadata()
        .map_err(IoError::on("cannot stat", log_path))?
        .len();
    let log_err = log.try_clone().map_err(io_err(format!(
        "duplicate handle of {}",
        log_path.display()
    )))?;

    let postgres = bin_dir.join("postgres");
    let mut cmd = Command::new(&postgres);
    cmd.arg("-D")
        .arg(data_dir)
        .arg("-k")
        .arg(socket_dir)
        .args([
            "-c",
            "listen_addresses=",
            "-c",
            "unix_socket_permissions=0700",
        ])
        .args(["-p", &opts.port().to_string()]);
    for (name, value) in &opts.settings {
        cmd.arg("-c").arg(format!("{name}={value}"));
    }
    cmd.current_dir(dir)
        // PostgreSQL built with systemd support would tell tallyd's service manager READY=1
        // (before tallyd is ready) and might take its watchdog; they are tallyd's, not its.
        .env_remove("NOTIFY_SOCKET")
        .env_remove("WATCHDOG_USEC")
        .env_remove("WATCHDOG_PID")
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        // Own process group: a Ctrl-C on tallyd's terminal must not shut the server down
        // underneath the flush tallyd performs on its way out.
        .process_group(0);
    run_as.apply(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(io_err(format!("start {}", postgres.display())))?;
    let pid = child.id();
    tracing::debug!(pid, data_dir = %data_dir.display(), "spawned postgres");

    let started = Instant::now();
    let pid_file = data_dir.join("postmaster.pid");
    loop {
        let exited = child
            .try_wait()
            .map_err(io_err(format!("wait for PostgreSQL (pid {pid})")))?;
        if let Some(status) = exited {
            let tail = read_log_tail(log_path, log_start);
            if tail.contains("lock file \"postmaster.pid\" already exists") {
                return Err(EmbeddedError::AlreadyRunning {
                    data_dir: data_dir.to_path_buf(),
                    log: tail,
                });
            }
            let busy = tail.contains("pre-existing shared memory block");
            let err = EmbeddedError::StartFailed { status, log: tail };
            return if busy {
                Ok(Launch::ShmemBusy(err))
            } else {
                Err(err)
            };
        }
        // The pid check matters: a second postmaster on the same directory would otherwise
        // see the first one's "ready" and socket and report success while it is dying.
        if pid_file_ready(&pid_file, pid) && UnixStream::connect(socket_path).is_ok() {
            return Ok(Launch::Ready(child));
        }
        if started.elapsed() >= START_TIMEOUT {
            let _ = terminate(&mut child, libc::SIGQUIT, QUIT_GRACE);
            return Err(EmbeddedError::StartTimeout {
                waited: START_TIMEOUT,
                log: read_log_tail(log_path, log_start),
            });
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// postmaster.pid: line 1 is the pid, line 8 the status, "ready" once connections are accepted.
fn pid_file_ready(pid_file: &Path, pid: u32) -> bool {
    let Ok(content) = fs::read_to_string(pid_file) else {
        return false;
    };
    let lines: Vec<&str> = content.lines().collect();
    lines.first().and_then(|l| l.trim().parse::<u32>().ok()) == Some(pid)
        && lines.get(7).map(|l| l.trim()) == Some("ready")
}

/// The last few KiB written to the log since `from`; best effort, since it only decorates an error.
fn read_log_tail(log_path: &Path, from: u64) -> String {
    let read = || -> io::Result<String> {
        let mut f = File::open(log_path)?;
        let end = f.metadata()?.len();
        let start = from.max(end.saturating_sub(LOG_TAIL_BYTES));
        f.seek(SeekFrom::Start(start))?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf)?;
        let mut s = String::from_utf8_lossy(&buf).into_owned();
        if start > from {
            // Started mid-line; drop the fragment.
            if let Some(i) = s.find('\n') {
                s.drain(..=i);
            }
        }
        Ok(s)
    };
    match read() {
        Ok(s) if !s.trim().is_empty() => s,
        Ok(_) => format!("(nothing in {})", log_path.display()),
        Err(e) => format!("(could not read {}: {e})", log_path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tempdir() -> tempfile::TempDir {
        let dir = tempfile::Builder::new()
            .prefix("tallyd-pg-")
            .tempdir_in("/tmp")
            .expect("create tempdir");
        // TempDir is 0700 root-owned; the postgres user has to traverse it.
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod tempdir");
        dir
    }

    fn opts(dir: &Path) -> EmbeddedOptions {
        EmbeddedOptions {
            dir: dir.to_path_buf(),
            settings: vec![("fsync".into(), "off".into())],
            bin_dir: None,
        }
    }

    fn psql(pg: &Embedded, sql: &str) -> String {
        let bin = find_bin_dir().expect("bin dir");
        let out = Command::new(bin.join("psql"))
            .arg("-h")
            .arg(pg.socket_dir())
            .args([
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-v",
                "ON_ERROR_STOP=1",
                "-Atc",
                sql,
            ])
            .output()
            .expect("run psql");
        assert!(
            out.status.success(),
            "psql failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    #[test]
    fn start_connect_stop() {
        let tmp = tempdir();
        let pg = Embedded::start(&opts(tmp.path())).expect("start");
        assert_eq!(psql(&pg, "select 1"), "1");
        assert_eq!(
            pg.connection_string("postgres"),
            format!(
                "host={} port=5432 user=postgres dbname=postgres",
                tmp.path().join("pgsocket").display()
            )
        );
        let pid = pg.pid();
        pg.stop().expect("stop");
        // SAFETY: probing with signal 0 only.
        assert_ne!(
            unsafe { libc::kill(pid as libc::pid_t, 0) },
            0,
            "postmaster still alive"
        );
    }

    #[test]
    fn restart_reuses_cluster() {
        let tmp = tempdir();
        let pg = Embedded::start(&opts(tmp.path())).expect("start");
        psql(&pg, "create table t (v int); insert into t values (42)");
        pg.stop().expect("stop");

        let pg = Embedded::start(&opts(tmp.path())).expect("restart");
        assert_eq!(psql(&pg, "select v from t"), "42");
        pg.stop().expect("stop again");
    }

    #[test]
    fn crash_recovery_after_stop_immediate() {
        let tmp = tempdir();
        let pg = Embedded::start(&opts(tmp.path())).expect("start");
        psql(&pg, "create table t (v int); insert into t values (7)");
        pg.stop_immediate().expect("stop_immediate");

        let pg = Embedded::start(&opts(tmp.path())).expect("start after crash");
        assert_eq!(psql(&pg, "select v from t"), "7");
        let log = fs::read_to_string(pg.log_path()).expect("read log");
        assert!(
            log.contains("not properly shut down"),
            "no crash recovery in log:\n{log}"
        );
        pg.stop().expect("stop");
    }

    #[test]
    fn start_after_sigkill() {
        let tmp = tempdir();
        let mut pg = Embedded::start(&opts(tmp.path())).expect("start");
        psql(&pg, "create table t (v int); insert into t values (9)");
        let mut child = pg.child.take().expect("child");
        child.kill().expect("SIGKILL");
        child.wait().expect("reap");
        drop(pg);

        let pg = Embedded::start(&opts(tmp.path())).expect("start after SIGKILL");
        assert_eq!(psql(&pg, "select v from t"), "9");
        pg.stop().expect("stop");
    }

    #[test]
    fn second_start_on_same_dir_fails() {
        let tmp = tempdir();
        let pg = Embedded::start(&opts(tmp.path())).expect("start");
        let err = match Embedded::start(&opts(tmp.path())) {
            Ok(second) => panic!("second start succeeded with pid {}", second.pid()),
            Err(e) => e,
        };
        assert!(
            matches!(err, EmbeddedError::AlreadyRunning { .. }),
            "unexpected error: {err}"
        );
        assert!(err.to_string().contains("already exists"), "{err}");
        assert_eq!(psql(&pg, "select 1"), "1");
        pg.stop().expect("stop");
    }

    #[test]
    fn socket_path_too_long() {
        let long = PathBuf::from("/tmp").join("x".repeat(100));
        let err = match Embedded::start(&opts(&long)) {
            Ok(_) => panic!("started with an overlong socket path"),
            Err(e) => e,
        };
        assert!(
            matches!(err, EmbeddedError::SocketPathTooLong { .. }),
            "{err}"
        );
        assert!(!long.exists(), "created the directory before validating");
    }

    #[test]
    fn missing_bin_dir_explains_install() {
        let tmp = tempdir();
        let mut o = opts(tmp.path());
        o.bin_dir = Some(tmp.path().join("nope"));
        let err = match Embedded::start(&o) {
            Ok(_) => panic!("started without binaries"),
            Err(e) => e,
        };
        assert!(
            err.to_string().contains("apt-get install -y postgresql"),
            "{err}"
        );
    }

    #[test]
    fn unreachable_dir_is_reported() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let tmp = tempfile::Builder::new()
            .tempdir_in("/tmp")
            .expect("tempdir");
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o700)).expect("chmod");
        let err = match Embedded::start(&opts(&tmp.path().join("cluster"))) {
            Ok(_) => panic!("started in an unreachable directory"),
            Err(e) => e,
        };
        assert!(matches!(err, EmbeddedError::Unreachable { .. }), "{err}");
        assert!(err.to_string().contains("/tmp"), "{err}");
    }

    #[test]
    fn conninfo_quoting() {
        assert_eq!(crate::store::conninfo::quote("/tmp/a"), "/tmp/a");
        assert_eq!(crate::store::conninfo::quote("a b"), "'a b'");
        assert_eq!(crate::store::conninfo::quote("it's"), "'it\\'s'");
        assert_eq!(crate::store::conninfo::quote(""), "''");
    }
}
