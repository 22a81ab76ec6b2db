//! Shared test setup: a private PostgreSQL in a temporary directory (started by tallyd's own
//! embedded module), the daemon running in-process on temporary sockets, and a line client.
#![allow(dead_code)]

pub mod netpg;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use tallyd::config::Config;
use tallyd::daemon;
use tallyd::listener::Listeners;
use tallyd::store::embedded::{Embedded, EmbeddedOptions};
use tallyd::store::Db;
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const COUNTERS: &str = r#"
[[counters]]
name = "downloads"
key_type = "text"

[[counters]]
name = "views"
key_type = "bigint"

[[counters]]
name = "ips"
key_type = "inet"

[[counters]]
name = "users"
key_type = "uuid"
"#;

/// A temporary directory the `postgres` OS user can traverse (tests run as root).
pub fn temp_dir() -> TempDir {
    let dir = tempfile::Builder::new()
        .prefix("tallyd-test-")
        .tempdir_in("/tmp")
        .expect("temp dir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// A private PostgreSQL for one test, fast and not durable against power loss (fsync off).
pub fn start_postgres(dir: &Path) -> Embedded {
    start_postgres_with(dir, &[])
}

/// `start_postgres` off the async threads.
pub async fn postgres(dir: &Path) -> Embedded {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || start_postgres(&dir))
        .await
        .unwrap()
}

pub fn start_postgres_with(dir: &Path, settings: &[(&str, &str)]) -> Embedded {
    let mut all: Vec<(String, String)> = [
        // Safe against a crash of PostgreSQL itself (the tests crash it), not of the machine.
        ("fsync", "off"),
        ("full_page_writes", "off"),
        ("max_prepared_transactions", "16"),
    ]
    .iter()
    .chain(settings)
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    all.dedup_by(|a, b| a.0 == b.0);
    Embedded::start(&EmbeddedOptions {
        dir: dir.join("pg"),
        settings: all,
        bin_dir: None,
    })
    .expect("start PostgreSQL (install it with: apt-get install -y postgresql)")
}

/// A running tallyd (in-process) beside its private PostgreSQL.
pub struct Harness {
    // Dropped in order: PostgreSQL stops before its directory is removed.
    pub pg: Option<Embedded>,
    pub dir: TempDir,
    pub db: Db,
    pub config: Arc<Config>,
    pub extra: String,
    shutdown: CancellationToken,
    daemon: Option<JoinHandle<()>>,
}

impl Harness {
    /// Starts PostgreSQL and tallyd. `extra` is merged over the test config (TOML).
    pub async fn start(extra: &str) -> Harness {
        Harness::start_with(extra, "", &[]).await
    }

    /// Like `start`, running `setup_sql` before the daemon starts, with extra server settings.
    pub async fn start_with(extra: &str, setup_sql: &str, pg_settings: &[(&str, &str)]) -> Harness {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let dir = temp_dir();
        let pg = {
            let path = dir.path().to_path_buf();
            let settings: Vec<(String, String)> = pg_settings
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            tokio::task::spawn_blocking(move || {
                let refs: Vec<(&str, &str)> = settings
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                start_postgres_with(&path, &refs)
            })
            .await
            .unwrap()
        };
        let db = Db::new(
            &pg.connection_string("postgres"),
            std::time::Duration::from_secs(5),
        )
        .unwrap();
        if !setup_sql.is_empty() {
            let client = db.connect().await.unwrap();
            client.batch_execute(setup_sql).await.expect("setup SQL");
        }
        let config = test_config(dir.path(), extra);
        // The daemon prepares the schema too; doing it here first means the test can use SQL
        // as soon as `start` returns.
        let mut client = db.connect().await.unwrap();
        tallyd::store::prepare(&mut client, &config)
            .await
            .expect("prepare schema");
        let mut h = Harness {
            config: Arc::new(config),
            dir,
            pg: Some(pg),
            db,
            extra: extra.to_string(),
            shutdown: CancellationToken::new(),
            daemon: None,
        };
        h.start_daemon().await;
        h
    }

    pub async fn start_daemon(&mut self) {
        let config = self.config.clone();
        let listeners = Listeners::bind(
            &config.listen.socket,
            &config.listen.datagram_socket,
            config.listen.mode(),
        )
        .expect("bind test sockets");
        self.shutdown = CancellationToken::new();
        let db = self.db.clone();
        let shutdown = self.shutdown.clone();
        self.daemon = Some(tokio::spawn(async move {
            daemon::run(config, listeners, vec![db], shutdown)
                .await
                .expect("daemon run");
        }));
        // Connections are served once the daemon is ready (schema prepared, journal replayed).
        let mut c = self.client().await;
        c.send(b"!ping\n").await;
        assert_eq!(c.read_line().await, "pong\n");
    }

    /// Graceful stop of the daemon (PostgreSQL keeps running).
    pub async fn stop_daemon(&mut self) {
        self.shutdown.cancel();
        if let Some(d) = self.daemon.take() {
            d.await.expect("daemon task");
        }
    }

    pub fn socket(&self) -> &Path {
        &self.config.listen.socket
    }

    pub fn datagram_socket(&self) -> &Path {
        &self.config.listen.datagram_socket
    }

    pub async fn client(&self) -> LineClient {
        LineClient::connect(self.socket()).await
    }

    pub async fn sql(&self) -> tokio_postgres::Client {
        self.db.connect().await.expect("connect to test database")
    }

    /// (count, first_seen ms, last_seen ms) from tallyd.totals; count 0 when absent.
    pub async fn total(&self, counter: &str, key: &str) -> (i64, Option<i64>, Option<i64>) {
        let client = self.sql().await;
        let row = client
            .query_opt(
                "SELECT count, (extract(epoch FROM first_seen) * 1000)::bigint, \
                        (extract(epoch FROM last_seen) * 1000)::bigint \
                 FROM tallyd.totals WHERE counter = $1 AND key = $2",
                &[&counter, &key],
            )
            .await
            .unwrap();
        row.map_or((0, None, None), |r| (r.get(0), r.get(1), r.get(2)))
    }

    /// Every (key, count) of one counter, sorted by key.
    pub async fn all(&self, counter: &str) -> Vec<(String, i64)> {
        let client = self.sql().await;
        client
            .query(
                "SELECT key, count FROM tallyd.totals WHERE counter = $1 ORDER BY key",
                &[&counter],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }

    pub async fn stop(mut self) {
        self.stop_daemon().await;
        if let Some(pg) = self.pg.take() {
            tokio::task::spawn_blocking(move || pg.stop().unwrap())
                .await
                .unwrap();
        }
    }
}

/// The test config: temporary paths, fast flushes, no metrics endpoint; `extra` (TOML) is merged
/// over it key by key.
pub fn test_config(dir: &Path, extra: &str) -> Config {
    let base = format!(
        r#"
[daemon]
data_dir = "{dir}/data"
drain_timeout_ms = 2000
[database]
url = "embedded"
[listen]
socket = "{dir}/tallyd.sock"
datagram_socket = "{dir}/tallyd.dgram"
[flush]
interval_ms = 200
retry_initial_ms = 20
retry_max_ms = 500
[rollup]
enabled = false
[metrics]
listen = ""
{COUNTERS}
"#,
        dir = dir.display()
    );
    let mut doc: toml::Table = base.parse().unwrap();
    merge(&mut doc, extra.parse().expect("extra config is TOML"));
    Config::from_toml(&doc.to_string(), Vec::new()).expect("test config")
}

fn merge(into: &mut toml::Table, from: toml::Table) {
    for (k, v) in from {
        match (into.get_mut(&k), v) {
            (Some(toml::Value::Table(a)), toml::Value::Table(b)) => merge(a, b),
            // More [[counters]] are added to the standard ones.
            (Some(toml::Value::Array(a)), toml::Value::Array(b)) => a.extend(b),
            (_, v) => {
                into.insert(k, v);
            }
        }
    }
}

/// A stream connection speaking the line protocol.
pub struct LineClient {
    rd: BufReader<OwnedReadHalf>,
    pub wr: OwnedWriteHalf,
}

impl LineClient {
    pub async fn connect(path: &Path) -> LineClient {
        let stream = UnixStream::connect(path).await.expect("connect to tallyd");
        let (rd, wr) = stream.into_split();
        LineClient {
            rd: BufReader::new(rd),
            wr,
        }
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.wr.write_all(bytes).await.expect("write to tallyd");
    }

    pub async fn read_line(&mut self) -> String {
        let mut line = String::new();
        self.rd
            .read_line(&mut line)
            .await
            .expect("read from tallyd");
        line
    }

    /// Sends `!flush` and returns (accepted, rejected) since the previous one.
    pub async fn flush(&mut self) -> (u64, u64) {
        self.send(b"!flush\n").await;
        let line = self.read_line().await;
        let f: Vec<&str> = line.trim_end().split(' ').collect();
        assert_eq!(f.len(), 3, "unexpected reply {line:?}");
        assert_eq!(f[0], "ok", "unexpected reply {line:?}");
        (f[1].parse().unwrap(), f[2].parse().unwrap())
    }
}

pub fn buf_of(lines: impl IntoIterator<Item = String>) -> Vec<u8> {
    let mut out = Vec::new();
    for l in lines {
        out.extend_from_slice(l.as_bytes());
        out.push(b'\n');
    }
    out
}

/// Starts the real `tallyd run` binary and waits until its socket answers `!ping`. Its log goes
/// to `<config>.log`, for a look after a failure.
pub fn spawn_daemon(config: &Path, socket: &Path) -> std::process::Child {
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .arg("--config")
        .arg(config)
        .arg("run")
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(config.with_extension("log"))
                .unwrap(),
        )
        .spawn()
        .expect("spawn tallyd run");
    wait_until_up(&mut child, config, socket);
    child
}

/// Waits until a spawned `tallyd run` answers `!ping` on `socket`; panics with its log (next to
/// `config`) if it exits first.
pub fn wait_until_up(child: &mut std::process::Child, config: &Path, socket: &Path) {
    use std::io::{BufRead, Write};
    use std::time::{Duration, Instant};
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(mut s) = std::os::unix::net::UnixStream::connect(socket) {
            s.write_all(b"!ping\n").unwrap();
            let mut line = String::new();
            let _ = std::io::BufReader::new(&s).read_line(&mut line);
            if line == "pong\n" {
                return;
            }
        }
        if let Some(status) = child.try_wait().unwrap() {
            let log = std::fs::read_to_string(config.with_extension("log")).unwrap_or_default();
            panic!("tallyd run exited early: {status}\n{log}");
        }
        assert!(Instant::now() < deadline, "tallyd did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGTERM, then waits for the exit status.
pub fn terminate(mut child: std::process::Child) -> std::process::ExitStatus {
    // SAFETY: a plain kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    child.wait().unwrap()
}
