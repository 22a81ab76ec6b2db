//! A fault's setup and traffic. [`Rig`]: a private PostgreSQL with its databases (each workload's
//! setup run in each), and the real `tallyd run` declaring every workload's counters.
//! [`Traffic`]: each workload's connections, sending rounds concurrently and checking every
//! acknowledgement, so that what the models record is exactly what the daemon acknowledged.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tallyd::config::Config;
use tallyd::store::embedded::Embedded;
use tempfile::TempDir;

use crate::common::{self, free_port, sql, temp_dir, Daemon, LineClient, Samples, TestConfig};
use crate::workload::{Ctx, Size, Store, Workload};

/// How long a reply may take: a liveness bound (a database restart, a pooler, a loaded
/// machine), not a speed check.
const PATIENCE: Duration = Duration::from_secs(120);

pub struct Rig {
    // Dropped before the directory: PostgreSQL stops before its files go.
    pg: Option<Embedded>,
    dir: TempDir,
    /// Every database created, in order (the daemon may use the first few).
    pub conninfos: Vec<String>,
    pub config: PathBuf,
    pub workloads: Vec<Arc<dyn Workload>>,
    /// Whether shards have moved between the databases (see [`Store::moved`]).
    pub moved: bool,
    base: TestConfig,
    started: Instant,
}

impl Rig {
    /// A private PostgreSQL with `databases` databases (its `postgres` database when 1), each
    /// workload's setup SQL run in each, and the config of a `tallyd run` on them (as shards
    /// when several) with every workload's counters, its metrics endpoint on, changed by `edit`.
    pub async fn start(
        workloads: Vec<Arc<dyn Workload>>,
        databases: usize,
        edit: impl FnOnce(&mut Config),
    ) -> Rig {
        let dir = temp_dir();
        let pg = common::postgres(dir.path()).await;
        let conninfos = match databases {
            1 => vec![pg.connection_string("postgres")],
            n => common::create_databases(&pg, n).await,
        };
        for conninfo in &conninfos {
            let client = sql(conninfo).await;
            for w in &workloads {
                client
                    .batch_execute(&w.setup_sql())
                    .await
                    .unwrap_or_else(|e| panic!("{}'s setup: {e}", w.name()));
            }
        }
        let counters: Vec<_> = workloads.iter().flat_map(|w| w.counters()).collect();
        let urls = conninfos.clone();
        let base = TestConfig::new(dir.path())
            .external(&conninfos[0], "faults")
            .metrics_port(free_port())
            .with(move |c| {
                c.counters = counters;
                if urls.len() > 1 {
                    c.database.shards = urls;
                }
                c.flush.set_retry_initial(Duration::from_millis(20));
                c.flush.set_retry_max(Duration::from_millis(200));
            })
            .with(edit);
        let config = base.write();
        Rig {
            pg: Some(pg),
            dir,
            conninfos,
            config,
            workloads,
            moved: false,
            base,
            started: Instant::now(),
        }
    }

    /// Rewrites the config with `edit` applied to it, for the next start.
    pub fn reconfigure(&mut self, edit: impl FnOnce(&mut Config)) {
        self.base = self.base.clone().with(edit);
        self.base.write();
    }

    /// Starts `tallyd run` and waits until it answers `!ping` (its journal replayed).
    pub async fn spawn(&self) -> Daemon {
        let config = self.config.clone();
        tokio::task::spawn_blocking(move || common::spawn_daemon(&config))
            .await
            .unwrap()
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("tallyd.sock")
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn pg(&self) -> &Embedded {
        self.pg.as_ref().expect("PostgreSQL is up")
    }

    /// Crash-stops PostgreSQL (SIGQUIT: it recovers at its next start).
    pub async fn pg_down(&mut self) {
        common::stop_postgres_immediate(self.pg.take().expect("PostgreSQL is up")).await;
    }

    pub async fn pg_up(&mut self) {
        assert!(self.pg.is_none(), "PostgreSQL is up already");
        self.pg = Some(common::postgres(self.dir.path()).await);
    }

    /// The databases the daemon writes to as configured now (reached directly).
    pub fn databases(&self) -> &[String] {
        &self.conninfos[..self.base.config().database.databases().len()]
    }

    /// The databases, with the key layout of the config as it is now.
    pub async fn store(&self) -> Store {
        Store::open(self.databases(), &self.config, self.moved).await
    }

    /// Every workload's model against the databases; panics listing every difference.
    pub async fn verify(&self, when: &str) {
        let failed = self.unverified().await;
        assert!(
            failed.is_empty(),
            "{when}, the databases differ from what was acknowledged:\n  {}",
            failed.join("\n  ")
        );
        println!(
            "{when}: every workload exact ({:?})",
            self.started.elapsed()
        );
    }

    /// The workloads whose databases differ from their model, each with what differs.
    pub async fn unverified(&self) -> Vec<String> {
        let store = self.store().await;
        let mut failed = Vec::new();
        for w in &self.workloads {
            if let Err(e) = w.verify(&store).await {
                failed.push(format!("{}: {e}", w.name()));
            }
        }
        failed
    }

    /// `tallyd.rollup` until it folds nothing, on every database; then the only slot rows left
    /// are those of keys a `rollup_into` table has no row for.
    pub async fn roll_up_everything(&self, through: Option<&str>) {
        for conninfo in self.databases() {
            let client = sql(through.unwrap_or(conninfo)).await;
            // The simple query protocol: nothing prepared, as through a transaction pooler.
            while rollup_step(&client).await > 0 {}
            let direct = sql(conninfo).await;
            let (slots, unmatched) = common::scalar_pair(
                &direct,
                "SELECT (SELECT count(*) FROM tallyd.slots), \
                        (SELECT coalesce(sum(slot_rows), 0)::bigint FROM tallyd.unmatched())",
            )
            .await;
            assert_eq!(
                slots, unmatched,
                "slot rows left but those without a target"
            );
        }
    }
}

/// One `tallyd.rollup` step of up to 2,000 slot rows (each takes a key lock: more would pass
/// the server's lock table); returns the rows it folded.
async fn rollup_step(client: &tokio_postgres::Client) -> i64 {
    let messages = client
        .simple_query("SELECT tallyd.rollup(2000)")
        .await
        .unwrap_or_else(|e| panic!("tallyd.rollup: {}", common::db_error(&e)));
    messages
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0)?.parse().ok(),
            _ => None,
        })
        .expect("tallyd.rollup returns the rows it folded")
}

impl Drop for Rig {
    fn drop(&mut self) {
        if let Some(pg) = self.pg.take() {
            let _ = pg.stop_immediate();
        }
    }
}

/// What acknowledges a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ack {
    /// `!flush`: committed, answered with the events accepted since the previous one.
    Flush,
    /// `!sync`: durable in the journal.
    Sync,
    /// `!flush` on a workload's even connections, `!sync` on its odd ones.
    Mixed,
}

/// How long each connection goes on sending.
#[derive(Clone, Copy, Debug)]
pub enum Until {
    Rounds(usize),
    /// At least this long, and at least this many rounds (a loaded machine takes longer, and
    /// the fault still meets as many rounds).
    Elapsed(Duration, usize),
}

/// Rounds to send: how many, how large, acknowledged how, and whether they may hold lines that
/// commit by themselves (see [`Ctx::commits`]).
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub until: Until,
    pub size: Size,
    pub ack: Ack,
    pub commits: bool,
}

impl Plan {
    pub fn rounds(n: usize, size: Size, ack: Ack) -> Plan {
        Plan {
            until: Until::Rounds(n),
            size,
            ack,
            commits: true,
        }
    }

    /// Small rounds for at least `d` and at least `rounds` rounds per connection.
    pub fn for_time(d: Duration, rounds: usize, ack: Ack) -> Plan {
        Plan {
            until: Until::Elapsed(d, rounds),
            size: Size::Small,
            ack,
            commits: true,
        }
    }
}

/// One connection of one workload.
struct Conn {
    workload: Arc<dyn Workload>,
    index: usize,
    client: LineClient,
    /// Rounds it has sent, across restarts.
    rounds: usize,
    /// Events accepted and rejected since its last `!flush`.
    period: (u64, u64),
    /// Answers to its rounds' lines (corrections) read so far.
    replies: usize,
}

/// Every workload's connections.
pub struct Traffic {
    conns: Vec<Conn>,
    rng: StdRng,
}

/// Rounds being sent: [`Traffic::join`] takes the connections back.
pub struct Running(Vec<tokio::task::JoinHandle<Conn>>);

impl Traffic {
    /// `per_workload` connections of every workload of `rig`.
    pub async fn connect(rig: &Rig, per_workload: usize, rng: &mut StdRng) -> Traffic {
        let mut conns = Vec::new();
        for w in &rig.workloads {
            for index in 0..per_workload {
                conns.push(Conn {
                    workload: w.clone(),
                    index,
                    client: LineClient::connect(&rig.socket()).await,
                    rounds: 0,
                    period: (0, 0),
                    replies: 0,
                });
            }
        }
        Traffic {
            conns,
            rng: StdRng::seed_from_u64(rng.gen()),
        }
    }

    /// New connections after a restart (a connection's period starts again with it).
    pub async fn reconnect(&mut self, rig: &Rig) {
        for c in &mut self.conns {
            c.client = LineClient::connect(&rig.socket()).await;
            c.period = (0, 0);
        }
    }

    /// Every connection sends its rounds at once; returns once all are acknowledged.
    pub async fn run(&mut self, plan: Plan) {
        let running = self.spawn(plan);
        self.join(running).await;
    }

    /// As [`Traffic::run`], without waiting: for a fault that strikes while rounds go on.
    pub fn spawn(&mut self, plan: Plan) -> Running {
        Running(
            self.conns
                .drain(..)
                .map(|c| {
                    let rng = StdRng::seed_from_u64(self.rng.gen());
                    tokio::spawn(send_rounds(c, plan, rng))
                })
                .collect(),
        )
    }

    pub async fn join(&mut self, running: Running) {
        for task in running.0 {
            self.conns.push(task.await.expect("a connection's rounds"));
        }
    }

    /// `!flush` on every connection: each answered with the events it sent since its last one.
    pub async fn flush_all(&mut self) {
        for c in &mut self.conns {
            c.client.send(b"!flush\n").await;
            expect_flush(c).await;
        }
    }

    /// Rounds acknowledged, over every connection.
    pub fn rounds(&self) -> usize {
        self.conns.iter().map(|c| c.rounds).sum()
    }

    /// Answers read to corrections, over every connection.
    pub fn replies(&self) -> usize {
        self.conns.iter().map(|c| c.replies).sum()
    }
}

async fn send_rounds(mut c: Conn, plan: Plan, mut rng: StdRng) -> Conn {
    let started = Instant::now();
    let mut sent = 0;
    loop {
        match plan.until {
            Until::Rounds(n) if sent >= n => break,
            Until::Elapsed(d, n) if started.elapsed() >= d && sent >= n => break,
            _ => {}
        }
        let ctx = Ctx {
            conn: c.index,
            round: c.rounds,
            size: plan.size,
            commits: plan.commits,
        };
        let round = c.workload.round(ctx, &mut rng);
        let flush = match plan.ack {
            Ack::Flush => true,
            Ack::Sync => false,
            Ack::Mixed => c.index % 2 == 0,
        };
        let mut bytes = round.lines;
        bytes.extend_from_slice(if flush { b"!flush\n" } else { b"!sync\n" });
        c.client.send(&bytes).await;
        for want in &round.replies {
            let reply = reply(&mut c, "an answer to a line").await;
            // A want may name alternatives, `|` between them (each ends with its `\n`).
            assert!(
                want.split('|').any(|w| w == reply),
                "{} connection {}: {reply:?}, want {want:?}",
                c.workload.name(),
                c.index
            );
            c.replies += 1;
        }
        c.period.0 += round.events;
        c.period.1 += round.rejected;
        if flush {
            expect_flush(&mut c).await;
        } else {
            let reply = reply(&mut c, "`!sync`").await;
            assert_eq!(
                reply,
                "ok\n",
                "{} connection {}",
                c.workload.name(),
                c.index
            );
        }
        c.rounds += 1;
        sent += 1;
    }
    c
}

/// Reads the answer to a `!flush` already sent: the connection's period.
async fn expect_flush(c: &mut Conn) {
    let reply = reply(c, "`!flush`").await;
    let (accepted, rejected) = std::mem::take(&mut c.period);
    assert_eq!(
        reply,
        format!("ok {accepted} {rejected}\n"),
        "{} connection {}",
        c.workload.name(),
        c.index
    );
}

async fn reply(c: &mut Conn, what: &str) -> String {
    tokio::time::timeout(PATIENCE, c.client.read_line())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{} connection {}: no answer to {what} within {PATIENCE:?}",
                c.workload.name(),
                c.index
            )
        })
}

/// A scrape of the daemon's metrics, off the async threads.
pub async fn samples(daemon: &Daemon) -> Samples {
    let addr = daemon.metrics();
    tokio::task::spawn_blocking(move || Samples::parse(&common::scrape(addr)))
        .await
        .unwrap()
}
