//! The Debian package round trip, on this machine: build it with cargo-deb, install it with
//! dpkg, check the installed config, run the installed binary as the `tallyd` user with the
//! installed config (its database pointed at a private cluster the test starts), count events
//! exactly, stop it, purge the package and check that nothing of it is left. The package's
//! sysctl drop-in (net.unix.max_dgram_qlen) is installed, applied by postinst and removed by the
//! purge; the machine's value is put back when the test ends. Also: `tallyd --help` lists
//! exactly the commands README's table documents.
//!
//! The package is built with `cargo deb --no-build --fast --no-dbgsym --strip` over the debug
//! binary Cargo built for the tests, which a target directory of the test's own presents as the
//! release build (`CARGO_TARGET_DIR`): 5 to 8 s here, where `cargo deb` (a release build from
//! scratch, then the package with its stripped binary and a -dbgsym.ddeb) took 34 min of wall
//! time (368 CPU-seconds) on this shared 2-core machine, 2.4 min of it packaging. The packaging
//! (assets, conffiles, units, maintainer scripts) is the same. Not `--profile dev`: cargo-deb
//! warns that it will refuse the dev profile. `cargo deb` (release) is what users run.
//!
//! Needs root and dpkg (CI runs as root); skipped with a printed reason otherwise. It refuses
//! to run when a `tallyd` package, user, /etc/tallyd or /var/lib/tallyd already exists (not
//! the test's to purge).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

const CONFIG: &str = "/etc/tallyd/config.toml";
const BINARY: &str = "/usr/bin/tallyd";
const SOCKET: &str = "/run/tallyd/tallyd.sock";
const SYSCTL_CONF: &str = "/usr/lib/sysctl.d/60-tallyd.conf";
const QLEN: &str = "/proc/sys/net/unix/max_dgram_qlen";
const UNITS: [&str; 3] = [
    "/usr/lib/systemd/system/tallyd.service",
    "/usr/lib/systemd/system/tallyd.socket",
    "/usr/lib/systemd/system/tallyd-datagram.socket",
];
/// A liveness bound on the daemon's start, not a speed check.
const PATIENCE: Duration = Duration::from_secs(120);

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"))
}

fn ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn have(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// (uid, gid) of an OS user, if it exists.
fn user_ids(name: &str) -> Option<(u32, u32)> {
    let out = run(Command::new("getent").args(["passwd", name]));
    let line = String::from_utf8_lossy(&out.stdout).into_owned();
    let f: Vec<&str> = line.trim().split(':').collect();
    (out.status.success() && f.len() > 3).then(|| (f[2].parse().unwrap(), f[3].parse().unwrap()))
}

fn group_exists(name: &str) -> bool {
    run(Command::new("getent").args(["group", name]))
        .status
        .success()
}

fn package_installed() -> bool {
    let out = run(Command::new("dpkg-query").args(["-W", "-f=${Status}", "tallyd"]));
    String::from_utf8_lossy(&out.stdout).contains("installed")
}

/// Purges the package when the test ends, passed or failed.
struct Purge;

impl Drop for Purge {
    fn drop(&mut self) {
        let _ = Command::new("dpkg").args(["--purge", "tallyd"]).output();
    }
}

/// The machine's net.unix.max_dgram_qlen, which postinst raises, put back when the test ends.
struct RestoreQlen(Option<String>);

impl Drop for RestoreQlen {
    fn drop(&mut self) {
        if let Some(was) = &self.0 {
            let _ = std::fs::write(QLEN, was);
        }
    }
}

/// The installed daemon; killed when the test ends (before [`Purge`], declared earlier).
struct Running(Option<Child>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn cargo_deb() -> PathBuf {
    if let Some(path) = std::env::var_os("CARGO_DEB") {
        return path.into();
    }
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cargo"));
    let path = home.join("bin/cargo-deb");
    assert!(
        path.exists() || have("cargo-deb"),
        "cargo-deb is missing: run scripts/ensure-cargo-deb (scripts/test does)"
    );
    if path.exists() {
        path
    } else {
        "cargo-deb".into()
    }
}

/// Builds the package from the debug binary (see the file's comment) into `out`, with a target
/// directory beside it where `release/tallyd` is that binary (cargo-deb also writes its
/// temporary files there, not into the shared target/).
fn build_package(out: &Path) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let target = out.with_file_name("target");
    std::fs::create_dir_all(target.join("release")).unwrap();
    std::os::unix::fs::symlink(common::BIN, target.join("release/tallyd")).unwrap();
    let started = Instant::now();
    let stdout = ok(Command::new(cargo_deb())
        .args(["--no-build", "--fast", "--no-dbgsym", "--strip", "--quiet"])
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("-o")
        .arg(out)
        .env("CARGO_TARGET_DIR", &target));
    let deb = PathBuf::from(stdout.trim());
    eprintln!(
        "built {} ({} bytes) in {:.1} s",
        deb.display(),
        std::fs::metadata(&deb).unwrap().len(),
        started.elapsed().as_secs_f64()
    );
    eprintln!("{}", ok(Command::new("dpkg").arg("-c").arg(&deb)));
    deb
}

/// `!ping` answered on the installed socket.
fn pong() -> bool {
    let Ok(mut s) = UnixStream::connect(SOCKET) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut line = String::new();
    s.write_all(b"!ping\n").is_ok()
        && BufReader::new(&s).read_line(&mut line).is_ok()
        && line == "pong\n"
}

/// What systemd does for the unit: the `tallyd` user, its home as HOME, /run/tallyd made by
/// RuntimeDirectory=, the database from the environment (EnvironmentFile=).
fn start_installed(ids: (u32, u32), url: &str, log: &Path) -> Running {
    std::fs::create_dir_all("/run/tallyd").unwrap();
    std::os::unix::fs::chown("/run/tallyd", Some(ids.0), Some(ids.1)).unwrap();
    let mut cmd = Command::new(BINARY);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("PG") || k.starts_with("TALLYD_"))
    {
        cmd.env_remove(k);
    }
    cmd.args(["--config", CONFIG, "run"])
        .current_dir("/var/lib/tallyd")
        .env("HOME", "/var/lib/tallyd")
        .env("TALLYD_DATABASE_URL", url)
        .env(
            "TALLYD_METRICS_LISTEN",
            format!("127.0.0.1:{}", free_port()),
        )
        .uid(ids.0)
        .gid(ids.1)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap());
    let mut daemon = Running(Some(cmd.spawn().expect("start the installed tallyd")));
    let deadline = Instant::now() + PATIENCE;
    while !pong() {
        let child = daemon.0.as_mut().unwrap();
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "installed tallyd exited: {status}\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "installed tallyd did not answer !ping"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    daemon
}

/// The installed `tallyd get` (installed config, test database): the count.
fn installed_count(url: &str, key: &str) -> u64 {
    let text = ok(Command::new(BINARY)
        .args(["--config", CONFIG, "get", "downloads", key])
        .env("TALLYD_DATABASE_URL", url));
    let n = text
        .split_whitespace()
        .find_map(|f| f.strip_prefix("count="));
    n.unwrap_or_else(|| panic!("no count in {text:?}"))
        .parse()
        .unwrap()
}

fn uid_of_process(pid: u32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn package_installs_runs_as_the_tallyd_user_and_purges_cleanly() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !have("dpkg") {
        eprintln!("skipped: installing a package needs root and dpkg");
        return;
    }
    assert!(
        !package_installed()
            && user_ids("tallyd").is_none()
            && !Path::new("/etc/tallyd").exists()
            && !Path::new("/var/lib/tallyd").exists(),
        "a tallyd package, user, /etc/tallyd or /var/lib/tallyd already exists on this machine: \
         not this test's to purge"
    );
    let dir = temp_dir();
    let deb = build_package(&dir.path().join("deb"));

    // Writing the value it has tells whether postinst can change it here.
    let qlen_was = std::fs::read_to_string(QLEN).ok();
    let qlen_settable = qlen_was
        .as_ref()
        .is_some_and(|v| std::fs::write(QLEN, v).is_ok());
    let _restore = RestoreQlen(qlen_was);
    let _purge = Purge;
    ok(Command::new("dpkg").arg("-i").arg(&deb));
    let ids = user_ids("tallyd").expect("postinst created the tallyd user");
    assert!(group_exists("tallyd"));
    let data = std::fs::metadata("/var/lib/tallyd").expect("postinst created /var/lib/tallyd");
    assert_eq!(
        (data.uid(), data.gid(), data.mode() & 0o7777),
        (ids.0, ids.1, 0o700)
    );
    for path in [BINARY, CONFIG, SYSCTL_CONF].iter().chain(&UNITS) {
        assert!(Path::new(path).exists(), "{path} installed");
    }
    let sysctl = std::fs::read_to_string(SYSCTL_CONF).unwrap();
    assert!(
        sysctl.contains("\nnet.unix.max_dgram_qlen = 512\n"),
        "{sysctl}"
    );
    if qlen_settable {
        let qlen: u32 = std::fs::read_to_string(QLEN)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(
            qlen >= 512,
            "postinst applied {SYSCTL_CONF}: max_dgram_qlen is {qlen}"
        );
    } else {
        eprintln!("{QLEN} is read-only here: postinst could not apply {SYSCTL_CONF}");
    }
    let conffiles = ok(Command::new("dpkg-query").args(["-W", "-f=${Conffiles}", "tallyd"]));
    assert!(
        conffiles.contains(CONFIG),
        "{CONFIG} is a conffile: {conffiles}"
    );
    if have("systemd-analyze") {
        // It exits 0 on an unknown key or a bad value too, with a warning: none may appear.
        let out = run(Command::new("systemd-analyze").arg("verify").args(UNITS));
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && said.trim().is_empty(),
            "systemd-analyze verify: {said}"
        );
    } else {
        eprintln!("systemd-analyze is absent: the installed units were not verified");
    }
    let checked = ok(Command::new(BINARY).args(["--config", CONFIG, "check-config"]));
    assert!(checked.contains(": ok"), "{checked}");

    // A private cluster on 127.0.0.1 (trust), which the tallyd user reaches over TCP.
    let port = free_port().to_string();
    let pg = start_postgres_with(
        dir.path(),
        &[("listen_addresses", "127.0.0.1"), ("port", &port)],
    );
    let url = format!("postgresql://postgres@127.0.0.1:{port}/postgres");
    let log = dir.path().join("installed.log");
    let mut daemon = start_installed(ids, &url, &log);
    let pid = daemon.0.as_ref().unwrap().id();
    assert_eq!(
        uid_of_process(pid),
        ids.0,
        "the daemon runs as the tallyd user"
    );
    assert_eq!(std::fs::metadata(SOCKET).unwrap().uid(), ids.0);

    let mut s = UnixStream::connect(SOCKET).unwrap();
    let lines: String = (0..1000)
        .map(|i| format!("downloads file-{}\n", i % 7))
        .collect();
    s.write_all(lines.as_bytes()).unwrap();
    s.write_all(b"!flush\n").unwrap();
    let mut reply = String::new();
    BufReader::new(&s).read_line(&mut reply).unwrap();
    assert_eq!(reply, "ok 1000 0\n");
    for k in 0..7 {
        let expected = (0..1000).filter(|i| i % 7 == k).count() as u64;
        assert_eq!(installed_count(&url, &format!("file-{k}")), expected);
    }

    let mut child = daemon.0.take().unwrap();
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "installed tallyd: {status}\n{}",
        std::fs::read_to_string(&log).unwrap()
    );
    assert!(
        !Path::new(SOCKET).exists(),
        "tallyd removed the socket file it bound"
    );

    ok(Command::new("dpkg").args(["--purge", "tallyd"]));
    assert!(!package_installed());
    for path in [
        BINARY,
        CONFIG,
        SYSCTL_CONF,
        "/etc/tallyd",
        "/var/lib/tallyd",
        "/run/tallyd",
    ]
    .iter()
    .chain(&UNITS)
    {
        assert!(!Path::new(path).exists(), "{path} is left after the purge");
    }
    assert!(user_ids("tallyd").is_none(), "the tallyd user is left");
    assert!(!group_exists("tallyd"), "the tallyd group is left");
    pg.stop().unwrap();
}

/// The commands `tallyd --help` lists, each with a row in README's "Commands" table, and no row
/// for a command that does not exist: the help and the docs agree.
#[test]
fn help_lists_the_commands_readme_documents() {
    let out = run(Command::new(common::BIN).arg("--help"));
    let help = String::from_utf8_lossy(&out.stdout);
    let commands: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect();
    assert!(commands.contains(&"run"), "{help}");
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let documented: Vec<&str> = readme
        .lines()
        .filter_map(|l| l.strip_prefix("| `tallyd "))
        .filter_map(|l| l.split([' ', '`']).next())
        .collect();
    for c in &commands {
        assert!(
            documented.contains(c),
            "`tallyd {c}` is in --help but not in README's Commands table"
        );
    }
    for c in &documented {
        assert!(
            commands.contains(c),
            "README documents `tallyd {c}`, which --help does not list"
        );
    }
}
