//! An outage bounded by disk, not memory, against the real `tallyd run` and a real PostgreSQL
//! stopped and started: with the database down and `coalesce.max_pending_keys` reached, tallyd
//! keeps reading connections and journals their events (spilled: journaled only), answers
//! `!ping`, `!sync` and `!flush` as the protocol says, and folds them back into memory, in
//! bounded memory, once the database returns. Every acknowledged event is committed exactly
//! once, and every `!flush` is answered within a bound once the database is back. The modules:
//! - `bounded`: memory and pending keys within their bounds while the database is down, control
//!   lines answered at the cap, the fold and the start's replay bounded by the cap, kill -9 while
//!   spilled and while folding, a stop with the database down;
//! - `ordering`: records reaching the journal out of order across segment rollovers are all
//!   folded, in each fsync mode; a folder that catches up again and again routes no record
//!   twice;
//! - `reloads`: reloads while records are spilled (a limit lowered, a counter removed, the cap
//!   moved) keep the spilled events; a line near `listen.max_line_bytes` survives the fold;
//! - `full_disk`: the journal's disk fills while records are spilled or folded, and tallyd
//!   recovers by itself;
//! - `crashes`: kill -9 while folding and during the start's replays with tallyd's sessions
//!   terminated, stops with spilled records, two shards with two flush writers each;
//! - `measure`: measurements and known limits, run by hand (`-- --ignored`, with
//!   `ATTACK_TALLYD_BIN` set to a release build for meaningful figures).
//!
//! The memory cap under every workload (kinds, windows, corrections, `rollup_into`):
//! tests/faults.

mod bounded;
#[path = "../common/mod.rs"]
mod common;
mod crashes;
mod full_disk;
mod measure;
mod ordering;
mod reloads;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use common::{
    buf_of, free_port, scalar_pair, sql, temp_dir, Daemon, LineClient, Samples, TestConfig,
};
use tallyd::config::{Config, KeyTypeName};
use tallyd::store::embedded::Embedded;

/// How long a `!flush` may take once the database is back before the test calls it hung.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// A daemon on a private PostgreSQL (its database `postgres`, or `db0..` with shards) whose
/// memory cap is small, with a metrics endpoint.
pub struct Rig {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub conninfos: Vec<String>,
    pub metrics: SocketAddr,
    pg: Option<Embedded>,
    env: Vec<(&'static str, String)>,
}

/// The binary under test: Cargo's, or `ATTACK_TALLYD_BIN` (a release build, for the
/// measurements).
pub fn bin() -> PathBuf {
    std::env::var_os("ATTACK_TALLYD_BIN").map_or_else(|| PathBuf::from(common::BIN), PathBuf::from)
}

/// What every rig sets; `edit` changes more.
fn base(c: &mut Config, cap: usize) {
    c.daemon.set_instance_id(Some("outage".into()));
    c.listen.set_datagram_socket(None);
    c.rollup.enabled = false;
    c.coalesce.max_pending_keys = cap;
    c.flush.max_pending_keys = cap / 2;
    c.flush.set_interval(Duration::from_millis(200));
    c.flush.set_retry_initial(Duration::from_millis(20));
    c.flush.set_retry_max(Duration::from_millis(200));
}

impl Rig {
    /// PostgreSQL up (with `shards` databases, or none: its `postgres` database), the daemon
    /// started on it with `env` set.
    pub async fn start(
        cap: usize,
        shards: usize,
        env: &[(&'static str, &str)],
        edit: impl FnOnce(&mut Config),
    ) -> (Rig, Daemon) {
        let rig = Rig::create(cap, shards, env, edit).await;
        let daemon = rig.spawn().await;
        (rig, daemon)
    }

    /// As [`Rig::start`], without starting the daemon.
    pub async fn create(
        cap: usize,
        shards: usize,
        env: &[(&'static str, &str)],
        edit: impl FnOnce(&mut Config),
    ) -> Rig {
        let dir = temp_dir();
        let pg = common::postgres(dir.path()).await;
        let conninfos = match shards {
            0 => vec![pg.connection_string("postgres")],
            n => common::create_databases(&pg, n).await,
        };
        let port = free_port();
        let urls = conninfos.clone();
        let config = TestConfig::new(dir.path())
            .counters(&[
                ("downloads", KeyTypeName::Text),
                ("views", KeyTypeName::Text),
            ])
            .metrics_port(port)
            .with(|c| {
                if shards == 0 {
                    c.database.url = urls[0].clone();
                } else {
                    c.database.shards = urls;
                }
                base(c, cap);
                edit(c);
            })
            .write();
        Rig {
            dir,
            config,
            conninfos,
            metrics: ([127, 0, 0, 1], port).into(),
            pg: Some(pg),
            env: env.iter().map(|(k, v)| (*k, v.to_string())).collect(),
        }
    }

    pub async fn spawn(&self) -> Daemon {
        let config = self.config.clone();
        let env = self.env.clone();
        tokio::task::spawn_blocking(move || {
            Daemon::spawn_with(&bin(), &config, |cmd| {
                for (k, v) in env {
                    cmd.env(k, v);
                }
            })
        })
        .await
        .unwrap()
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("tallyd.sock")
    }

    pub fn journal_dir(&self) -> PathBuf {
        self.dir.path().join("data/journal")
    }

    pub async fn pg_down(&mut self) {
        common::stop_postgres_immediate(self.pg.take().expect("PostgreSQL is up")).await;
    }

    pub async fn pg_up(&mut self) {
        assert!(self.pg.is_none(), "PostgreSQL is up already");
        self.pg = Some(common::postgres(self.dir.path()).await);
    }

    pub async fn samples(&self) -> Samples {
        let addr = self.metrics;
        tokio::task::spawn_blocking(move || Samples::parse(&common::scrape(addr)))
            .await
            .unwrap()
    }

    /// (rows, sum of counts) in `tallyd.totals` over every database.
    pub async fn totals(&self) -> (i64, i64) {
        let mut out = (0, 0);
        for conninfo in &self.conninfos {
            let (rows, sum) = scalar_pair(
                &sql(conninfo).await,
                "SELECT count(*), coalesce(sum(count), 0)::bigint FROM tallyd.totals",
            )
            .await;
            out = (out.0 + rows, out.1 + sum);
        }
        out
    }

    pub async fn client(&self) -> LineClient {
        LineClient::connect(&self.socket()).await
    }
}

impl Rig {
    /// Rewrites config.toml with `edit` applied, sends SIGHUP and waits until the reload is
    /// counted as applied.
    pub fn reload(&self, daemon: &Daemon, edit: impl FnOnce(&mut Config)) {
        let text = std::fs::read_to_string(&self.config).unwrap();
        let mut config = Config::from_toml(&text, Vec::new()).unwrap();
        edit(&mut config);
        std::fs::write(&self.config, toml::to_string(&config).unwrap()).unwrap();
        daemon.reload("ok");
    }

    /// `clients` connections, each sending `rounds` rounds of `n` new keys (`c<i>-<round>-<k>`,
    /// delta 1) acknowledged by `!sync` (the database may be down); returns them, still open.
    pub async fn synced_rounds(&self, clients: usize, rounds: usize, n: usize) -> Vec<LineClient> {
        let mut out = Vec::new();
        for i in 0..clients {
            let mut c = self.client().await;
            for r in 0..rounds {
                assert_eq!(round(&mut c, &format!("c{i}-{r:03}"), n).await, "ok\n");
            }
            out.push(c);
        }
        out
    }

    /// Fills memory to the cap on a connection of its own (`cap` distinct `views` keys,
    /// acknowledged), so that what follows is spilled. Returns that connection.
    pub async fn fill_memory(&self, cap: usize) -> LineClient {
        let mut c = self.client().await;
        c.send_synced(&buf_of((0..cap).map(|k| format!("views fill-{k} 1"))))
            .await;
        c
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if let Some(pg) = self.pg.take() {
            let _ = pg.stop_immediate();
        }
    }
}

/// `!flush` with a bound: panics naming `what` when it is not answered within [`PATIENCE`].
pub async fn flushed(c: &mut LineClient, what: &str) -> (u64, u64) {
    match tokio::time::timeout(PATIENCE, c.flush()).await {
        Ok(answer) => answer,
        Err(_) => panic!("`!flush` not answered within {PATIENCE:?}: {what}"),
    }
}

/// `tallyd run` started without waiting for it to answer (its replay runs before it serves).
pub fn start_unready(rig: &Rig) -> std::process::Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(rig.config.with_extension("log"))
        .unwrap();
    std::process::Command::new(bin())
        .arg("--config")
        .arg(&rig.config)
        .arg("run")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

/// One round: `n` new keys and `!sync` in one write; the reply (an error when the journal
/// cannot be written).
pub async fn round(c: &mut LineClient, prefix: &str, n: usize) -> String {
    let mut lines = buf_of((0..n).map(|k| format!("downloads {prefix}-{k:03} 1")));
    lines.extend_from_slice(b"!sync\n");
    c.send(&lines).await;
    tokio::time::timeout(PATIENCE, c.read_line())
        .await
        .expect("`!sync` answered")
}

/// Resident memory in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap()
        .trim()
        .trim_end_matches(" kB")
        .trim()
        .parse()
        .unwrap();
    kb / 1024.0
}
