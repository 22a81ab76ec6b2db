//! [`Daemon`]: the real `tallyd run` binary as a child process, from start (wait until its
//! socket answers `!ping`) to stop (SIGTERM, wait, exit status), with its log kept beside its
//! config. Also [`run_cli`], one `tallyd` command run to completion.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use tallyd::config::Config;

use crate::scrape::{scrape, Samples};

/// How long a daemon may take to answer `!ping` after its start, and to exit after SIGTERM
/// before the drop gives up waiting and kills it: a liveness bound, not a speed check.
const PATIENCE: Duration = Duration::from_secs(120);

/// A `tallyd run` child process. Dropping it sends SIGTERM and waits, so its private
/// PostgreSQL stops too even when the test panics.
pub struct Daemon {
    child: Option<Child>,
    log: PathBuf,
    socket: PathBuf,
    metrics: Option<SocketAddr>,
}

impl Daemon {
    /// Starts `bin --config <config> run` and waits until its stream socket answers `!ping`;
    /// panics with the log if it exits first. Its stderr goes to `<config>.log`, copied through
    /// a pipe by this process (so that a limit set on the daemon, such as a file-size limit,
    /// never stops its log).
    pub fn spawn(bin: &Path, config: &Path) -> Daemon {
        Daemon::spawn_with(bin, config, |_| {})
    }

    /// Like `spawn`, with `prepare` changing the command first (e.g. a `pre_exec` hook).
    pub fn spawn_with(bin: &Path, config: &Path, prepare: impl FnOnce(&mut Command)) -> Daemon {
        Daemon::try_spawn_with(bin, config, prepare).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like `spawn_with`, returning what went wrong instead of panicking (for the benchmark).
    pub fn try_spawn_with(
        bin: &Path,
        config: &Path,
        prepare: impl FnOnce(&mut Command),
    ) -> Result<Daemon, String> {
        let text = std::fs::read_to_string(config)
            .map_err(|e| format!("reading {}: {e}", config.display()))?;
        let mut parsed = Config::from_toml(&text, Vec::new()).map_err(|e| e.to_string())?;
        // Relative paths are the config file's directory's, as the daemon reads them.
        parsed.resolve_paths(config.parent().unwrap_or(Path::new("")));
        let log = config.with_extension("log");
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| format!("opening {}: {e}", log.display()))?;
        let mut cmd = Command::new(bin);
        cmd.arg("--config")
            .arg(config)
            .arg("run")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        prepare(&mut cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("spawning {} run: {e}", bin.display()))?;
        let mut stderr = child.stderr.take().expect("piped stderr");
        // Ends when the daemon exits (end of the pipe).
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut file));
        let mut daemon = Daemon {
            child: Some(child),
            log,
            socket: parsed.listen.socket().unwrap().to_path_buf(),
            metrics: parsed.metrics.listen().and_then(|l| l.parse().ok()),
        };
        daemon.wait_until_up()?;
        Ok(daemon)
    }

    /// Polls the socket until `!ping` answers: the daemon has no readiness notification.
    fn wait_until_up(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if ping(&self.socket, deadline) {
                return Ok(());
            }
            if let Some(status) = self.try_wait() {
                return Err(format!("tallyd run exited early: {status}\n{}", self.log()));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "tallyd did not answer `!ping` within {PATIENCE:?}; log: {}",
                    self.log.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Where its log goes: `<config>.log`.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("daemon running").id()
    }

    /// The stream socket path from its config.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The metrics endpoint from its config; panics when it is off.
    pub fn metrics(&self) -> SocketAddr {
        self.metrics
            .expect("metrics.listen is set in the test config")
    }

    /// Everything the daemon has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal` (e.g. `libc::SIGHUP`) to the daemon.
    pub fn signal(&self, signal: i32) {
        // SAFETY: a plain kill(2) on our own child, not yet reaped (so its pid is not reused).
        unsafe { libc::kill(self.pid() as libc::pid_t, signal) };
    }

    /// The exit status if it has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.as_mut()?.try_wait().unwrap()
    }

    /// SIGHUP, then waits until the daemon has counted one more reload with `result` (`ok`,
    /// `invalid`, ...) in `tallyd_config_reloads_total` (its metrics endpoint must be on);
    /// panics if it has not within the kit's patience.
    pub fn reload(&self, result: &str) {
        let counted = || {
            self.scrape()
                .get(&format!(
                    r#"tallyd_config_reloads_total{{result="{result}"}}"#
                ))
                .unwrap_or(0.0)
        };
        let before = counted();
        self.signal(libc::SIGHUP);
        let deadline = Instant::now() + PATIENCE;
        while counted() < before + 1.0 {
            assert!(
                Instant::now() < deadline,
                "no reload counted as {result:?} within {PATIENCE:?}; log: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the log contains `text`; false if the daemon exits first or the line does
    /// not come within the kit's patience. The log reaches its file through a pipe copied by a
    /// thread of this process, so a line the daemon has written may show up a little later:
    /// a test that checks for a line waits for it here rather than reading the file once.
    pub fn wait_for_log(&mut self, text: &str) -> bool {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if self.log().contains(text) {
                return true;
            }
            if self.try_wait().is_some() || Instant::now() > deadline {
                return self.log().contains(text);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A scrape of its metrics endpoint.
    pub fn scrape(&self) -> Samples {
        Samples::parse(&scrape(self.metrics()))
    }

    /// Graceful stop: SIGTERM, then the exit status.
    pub fn terminate(mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait_inner()
    }

    /// A crash: SIGKILL, then the exit status. A private PostgreSQL it started keeps running
    /// (as after a real crash); the next `tallyd run` on the same data_dir stops it.
    pub fn kill(mut self) -> ExitStatus {
        self.signal(libc::SIGKILL);
        self.wait_inner()
    }

    /// Waits for the daemon to exit by itself.
    pub fn wait(mut self) -> ExitStatus {
        self.wait_inner()
    }

    fn wait_inner(&mut self) -> ExitStatus {
        self.child.take().expect("daemon running").wait().unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // SAFETY: as in `signal`.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + PATIENCE;
        while child.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// True when `socket` answers `!ping` with `pong` before `deadline`.
fn ping(socket: &Path, deadline: Instant) -> bool {
    let Ok(mut s) = std::os::unix::net::UnixStream::connect(socket) else {
        return false;
    };
    // The socket is bound before the daemon serves it (a replay may come first), so a connection
    // can wait in the backlog: it waits for its answer until the deadline rather than being
    // given up and asked again on a new one, which the daemon would accept later and count.
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = s.set_read_timeout(Some(left.max(Duration::from_millis(1))));
    let mut line = String::new();
    s.write_all(b"!ping\n").is_ok()
        && std::io::BufReader::new(&s).read_line(&mut line).is_ok()
        && line == "pong\n"
}

/// Runs `bin --config <config> <args>` to completion and returns its output.
pub fn run_cli(bin: &Path, config: &Path, args: &[&str]) -> Output {
    Command::new(bin)
        .arg("--config")
        .arg(config)
        .args(args)
        .output()
        .expect("run tallyd")
}
