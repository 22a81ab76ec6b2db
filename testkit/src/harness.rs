//! tallyd in-process (`daemon::run` on a task of the test's runtime): [`InProcess`], the one way
//! a test starts it, and [`Harness`], a private PostgreSQL plus an `InProcess` on temporary
//! sockets, for tests that need the daemon's library API or many quick restarts.

use std::path::Path;
use std::sync::Arc;

use tallyd::config::Config;
use tallyd::daemon::{self, DaemonError};
use tallyd::listener::Listeners;
use tallyd::store::embedded::Embedded;
use tallyd::store::Db;
use tempfile::TempDir;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::{counts, db, start_postgres_with, temp_dir, LineClient, TestConfig};

/// `daemon::run` on a task, on the sockets its config names (bound before the task starts, so a
/// client may connect at once: it is served once the daemon is ready). Dropping it leaves the
/// task to end with the test's runtime; `stop` stops it.
pub struct InProcess {
    config: Arc<Config>,
    stop: CancellationToken,
    task: JoinHandle<Result<(), DaemonError>>,
}

impl InProcess {
    /// Runs `config` on a [`Db`] per database it configures (connection strings only: a
    /// private cluster is the binary's; [`Harness`] starts one itself).
    pub fn spawn(config: Config) -> InProcess {
        let dbs = config.database.databases().into_iter().map(db).collect();
        InProcess::spawn_on(Arc::new(config), dbs)
    }

    /// Runs `config` on `dbs`.
    pub fn spawn_on(config: Arc<Config>, dbs: Vec<Db>) -> InProcess {
        let listeners = Listeners::bind(
            config.listen.socket(),
            config.listen.datagram_socket(),
            config.listen.mode(),
        )
        .expect("bind test sockets");
        let stop = CancellationToken::new();
        let task = tokio::spawn(daemon::run(config.clone(), listeners, dbs, stop.clone()));
        InProcess { config, stop, task }
    }

    /// Waits until the daemon answers `!ping` on its stream socket: it is ready (schema
    /// prepared, journal replayed). Panics with the run's error if the run ends first.
    pub async fn ready(&mut self) {
        let socket = self
            .config
            .listen
            .socket()
            .expect("a stream socket to ping");
        let ping = async {
            let mut c = LineClient::connect(socket).await;
            c.send(b"!ping\n").await;
            c.read_line().await
        };
        tokio::select! {
            answer = ping => assert_eq!(answer, "pong\n"),
            ended = &mut self.task => panic!("the daemon stopped before it was ready: {ended:?}"),
        }
    }

    /// A graceful stop; returns how the run ended.
    pub async fn stop(self) -> Result<(), DaemonError> {
        self.stop.cancel();
        self.ended().await
    }

    /// Waits until the run ends by itself (a start that is refused) and returns how.
    pub async fn ended(self) -> Result<(), DaemonError> {
        self.task.await.expect("daemon task")
    }
}

/// A running tallyd (in-process) beside its private PostgreSQL. `stop()` stops both; dropping
/// it stops PostgreSQL (the daemon task ends with the test's runtime).
pub struct Harness {
    // Dropped in order: PostgreSQL stops before its directory is removed.
    pub pg: Option<Embedded>,
    pub dir: TempDir,
    pub db: Db,
    pub config: Arc<Config>,
    daemon: Option<InProcess>,
}

impl Harness {
    /// Starts PostgreSQL and tallyd with the test config (`TestConfig::standard_counters().fast()`)
    /// changed by `edit`.
    pub async fn start(edit: impl FnOnce(&mut Config)) -> Harness {
        Harness::start_with(edit, "", &[]).await
    }

    /// Like `start`, running `setup_sql` before the daemon starts, with extra server settings.
    pub async fn start_with(
        edit: impl FnOnce(&mut Config),
        setup_sql: &str,
        pg_settings: &[(&str, &str)],
    ) -> Harness {
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
        let db = db(&pg.connection_string("postgres"));
        if !setup_sql.is_empty() {
            let client = db.connect().await.unwrap();
            client.batch_execute(setup_sql).await.expect("setup SQL");
        }
        let config = Harness::config_for(dir.path()).with(edit).build();
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
            daemon: None,
        };
        h.start_daemon().await;
        h
    }

    /// The config a harness in `dir` starts from.
    pub fn config_for(dir: &Path) -> TestConfig {
        TestConfig::new(dir).standard_counters().fast()
    }

    /// For a restart with another config: the current config changed by `edit`. Call between
    /// `stop_daemon` and `start_daemon`.
    pub fn reconfigure(&mut self, edit: impl FnOnce(&mut Config)) {
        let mut config = (*self.config).clone();
        edit(&mut config);
        config.validate().expect("test config is valid");
        self.config = Arc::new(config);
    }

    /// Starts the daemon task and waits until it answers `!ping`.
    pub async fn start_daemon(&mut self) {
        let mut daemon = InProcess::spawn_on(self.config.clone(), vec![self.db.clone()]);
        daemon.ready().await;
        self.daemon = Some(daemon);
    }

    /// Graceful stop of the daemon (PostgreSQL keeps running).
    pub async fn stop_daemon(&mut self) {
        if let Some(d) = self.daemon.take() {
            d.stop().await.expect("daemon run");
        }
    }

    pub fn socket(&self) -> &Path {
        self.config.listen.socket().unwrap()
    }

    pub fn datagram_socket(&self) -> &Path {
        self.config.listen.datagram_socket().unwrap()
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
        counts(&self.sql().await, counter).await
    }

    /// Stops the daemon, then PostgreSQL.
    pub async fn stop(mut self) {
        self.stop_daemon().await;
        if let Some(pg) = self.pg.take() {
            tokio::task::spawn_blocking(move || pg.stop().unwrap())
                .await
                .unwrap();
        }
    }
}
