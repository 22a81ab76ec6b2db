//! The `redis-daily` peer's Redis: Debian's `redis-server`, started privately by the bench in
//! its own directory on a Unix socket only (no TCP port, no RDB snapshots, no AOF: a buffer,
//! as GitLab and Discourse run theirs), killed with SIGKILL and started again by the loss
//! measurement; and a blocking connection to it.

use std::io::{BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::procfs::{cpu_seconds_of, proc_kib};
use crate::resp::{push_command, read_reply, Reply};

/// How long a started redis-server may take to answer `PING`.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// `$REDIS_SERVER`, else `redis-server` on `PATH` (Debian installs it in /usr/bin);
/// `None` when neither is there (scripts/ensure-redis installs it).
pub(crate) fn find_redis_server() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("REDIS_SERVER") {
        return Some(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .map(|dir| dir.join("redis-server"))
        .find(|bin| bin.is_file())
}

/// A private `redis-server` child process, killed (SIGKILL) when dropped.
pub(crate) struct RedisServer {
    child: Child,
    pub(crate) socket: PathBuf,
}

impl RedisServer {
    /// Starts `bin` with its files in `dir` and its socket at `dir/redis.sock`, and waits until
    /// it answers `PING`. Nothing it holds survives it: `--save ''` (no snapshots) and
    /// `--appendonly no` (no AOF), Redis's own defaults otherwise (no config file is read).
    pub(crate) fn start(bin: &Path, dir: &Path) -> Result<RedisServer> {
        std::fs::create_dir_all(dir)?;
        let socket = dir.join("redis.sock");
        let log = dir.join("redis.log");
        let child = Command::new(bin)
            .args(["--port", "0", "--unixsocket"])
            .arg(&socket)
            .args([
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--daemonize", "no", "--dir"])
            .arg(dir)
            .arg("--logfile")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut server = RedisServer { child, socket };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = server.child.try_wait()? {
                let tail = std::fs::read_to_string(&log).unwrap_or_default();
                bail!(
                    "redis-server exited at its start ({status}); {}:\n{tail}",
                    log.display()
                );
            }
            if let Ok(mut conn) = Conn::connect(&server.socket) {
                if conn.command(&[b"PING"])? == Reply::Status("PONG".into()) {
                    return Ok(server);
                }
            }
            if Instant::now() > deadline {
                bail!("redis-server did not answer PING within {START_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// utime + stime of the server (all its threads), in seconds.
    pub(crate) fn cpu_seconds(&self) -> Result<f64> {
        cpu_seconds_of(self.pid())
    }

    /// VmHWM, in MiB.
    pub(crate) fn peak_rss_mib(&self) -> Result<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))?;
        let kib = proc_kib(&status, "VmHWM").context("no VmHWM in redis-server's status")?;
        Ok(kib as f64 / 1024.0)
    }
}

impl Drop for RedisServer {
    /// SIGKILL (it holds nothing worth a clean stop), then reaps it.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A blocking connection to a redis-server's Unix socket.
pub(crate) struct Conn {
    pub(crate) reader: BufReader<UnixStream>,
    pub(crate) writer: UnixStream,
    out: Vec<u8>,
}

impl Conn {
    pub(crate) fn connect(socket: &Path) -> Result<Conn> {
        let stream = UnixStream::connect(socket)
            .with_context(|| format!("connecting to redis-server at {}", socket.display()))?;
        Ok(Conn {
            reader: BufReader::with_capacity(64 * 1024, stream.try_clone()?),
            writer: stream,
            out: Vec::new(),
        })
    }

    /// One command, one reply (an error reply is a `Reply::Error`, for the caller to judge).
    pub(crate) fn command(&mut self, args: &[&[u8]]) -> Result<Reply> {
        self.send(args)?;
        read_reply(&mut self.reader)
    }

    /// Writes one command; its reply is read by the caller.
    pub(crate) fn send(&mut self, args: &[&[u8]]) -> Result<()> {
        self.out.clear();
        push_command(&mut self.out, args);
        self.writer.write_all(&self.out)?;
        Ok(())
    }
}
