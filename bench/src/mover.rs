//! The `redis-daily` peer's mover: the periodic job that empties Redis's per-day hashes into
//! PostgreSQL, as GitLab's `BufferedCounter` flush and Discourse's periodic job do. Every
//! `INTERVAL` (the daemon's flush interval in the bench) it takes each day's hash
//! `downloads:<YYYY-MM-DD>` (today's and yesterday's, so a run across midnight moves both)
//! atomically with `RENAME` to `downloads:<day>:moving`, reads it with `HGETALL`, upserts one
//! row per version into `version_downloads` in one transaction and deletes the moved hash
//! after the commit. A hash still under `:moving` (a move that failed before its `DEL`) is
//! moved first.
//!
//! It runs on its own thread with its own single-threaded runtime (Redis calls block; only the
//! PostgreSQL part is async), so its CPU time is the thread's own and is measured apart from the
//! bench's clients.

use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{anyhow, bail, Context, Result};
use futures_util::future::try_join_all;
use tokio::runtime::Runtime;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

use tallyd::store::Db;

use crate::daily::utc_day;
use crate::env::FLUSH_INTERVAL_MS;
use crate::redis::Conn;
use crate::resp::{read_int_pairs, Reply};

/// How often the mover runs: as often as tallyd flushes in the bench.
const INTERVAL: Duration = Duration::from_millis(FLUSH_INTERVAL_MS);
/// Rows per upsert statement, the statements of one move pipelined in one transaction: tallyd's
/// default `flush.batch_rows`, so both write the same statement shape.
const CHUNK_ROWS: usize = 5_000;

/// One row per (version, day): `unnest` of two arrays, as tallyd's flush binds its rows.
const UPSERT: &str = "INSERT INTO version_downloads (version_id, date, downloads)
    SELECT v, $3::text::date, n FROM unnest($1::bigint[], $2::bigint[]) AS t(v, n)
    ON CONFLICT (version_id, date)
    DO UPDATE SET downloads = version_downloads.downloads + EXCLUDED.downloads";

/// The hash the clients `HINCRBY` into for `day` (`YYYY-MM-DD`).
pub(crate) fn day_key(day: &str) -> String {
    format!("downloads:{day}")
}

/// What a failed Redis call does to the mover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnRedisError {
    /// Ends it with the error (the throughput runs: Redis never fails there).
    Fail,
    /// Drops the connection, counts the failure and tries again at the next run (the loss
    /// measurement, whose Redis is killed under it, as a scheduled job would be retried).
    Retry,
}

/// What the mover did over its life.
#[derive(Debug, Default)]
pub(crate) struct MoverStats {
    /// Rows upserted (one per version and day per move).
    pub(crate) rows: u64,
    /// Moves that wrote at least one row.
    pub(crate) moves: u64,
    /// CPU seconds of the mover's thread (its Redis calls, parsing, and its PostgreSQL client).
    pub(crate) cpu_s: f64,
    /// Runs a Redis call failed in (with `OnRedisError::Retry`).
    pub(crate) redis_failures: u64,
}

enum Signal {
    /// Move now (the clients are done), then keep the cadence.
    Now,
    /// One last move, then exit.
    Stop,
}

/// The mover's thread and the way to signal it.
pub(crate) struct Mover {
    signals: SyncSender<Signal>,
    thread: JoinHandle<Result<MoverStats>>,
}

impl Mover {
    /// Starts the mover of the Redis at `socket` into the bench's database (`conninfo`), and
    /// waits until it has connected to PostgreSQL.
    pub(crate) async fn start(
        socket: PathBuf,
        conninfo: String,
        on_redis_error: OnRedisError,
    ) -> Result<Mover> {
        let (signals, rx) = sync_channel(4);
        let (ready, connected) = tokio::sync::oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("mover".into())
            .spawn(move || {
                let cpu_start = thread_cpu_seconds();
                let job = Job::connect(socket, &conninfo, on_redis_error);
                let job = match job {
                    Ok(job) => {
                        let _ = ready.send(Ok(()));
                        job
                    }
                    Err(err) => {
                        let _ = ready.send(Err(anyhow!("{err:#}")));
                        return Err(err);
                    }
                };
                let mut stats = job.run(&rx)?;
                stats.cpu_s = thread_cpu_seconds() - cpu_start;
                Ok(stats)
            })?;
        connected
            .await
            .context("the mover exited before connecting")??;
        Ok(Mover { signals, thread })
    }

    /// Asks for a move now (the clients are done), as `!flush` asks tallyd.
    pub(crate) fn move_now(&self) {
        // Full: a request to move is already queued. Disconnected: the thread has ended, and
        // `alive` and `stop` say why.
        let _ = self.signals.try_send(Signal::Now);
    }

    /// An error once the mover's thread has ended (it ends only on an error before `stop`).
    pub(crate) fn alive(&self) -> Result<()> {
        if self.thread.is_finished() {
            bail!("the mover stopped early");
        }
        Ok(())
    }

    /// One last move, then its stats (or the error that ended it).
    pub(crate) async fn stop(self) -> Result<MoverStats> {
        let _ = self.signals.send(Signal::Stop);
        let thread = self.thread;
        tokio::task::spawn_blocking(move || thread.join())
            .await?
            .map_err(|_| anyhow!("the mover's thread panicked"))?
            .context("the mover")
    }
}

/// A failed step of a move: Redis's part, or PostgreSQL's.
enum Failed {
    Redis(anyhow::Error),
    Database(anyhow::Error),
}

/// The mover's state on its thread.
struct Job {
    rt: Runtime,
    pg: Client,
    upsert: Statement,
    socket: PathBuf,
    redis: Option<Conn>,
    on_redis_error: OnRedisError,
    stats: MoverStats,
}

impl Job {
    fn connect(socket: PathBuf, conninfo: &str, on_redis_error: OnRedisError) -> Result<Job> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let db = Db::new(conninfo, Duration::from_secs(10))?;
        let (pg, upsert) = rt.block_on(async {
            let pg = db.connect().await?;
            let upsert = pg.prepare(UPSERT).await?;
            anyhow::Ok((pg, upsert))
        })?;
        Ok(Job {
            rt,
            pg,
            upsert,
            socket,
            redis: None,
            on_redis_error,
            stats: MoverStats::default(),
        })
    }

    /// Moves every `INTERVAL` from the start of the previous move (back to back when a move
    /// takes longer), at once on `Signal::Now`, and a last time on `Signal::Stop`.
    fn run(mut self, signals: &Receiver<Signal>) -> Result<MoverStats> {
        let mut next = Instant::now() + INTERVAL;
        loop {
            let last = match signals.recv_timeout(next.saturating_duration_since(Instant::now())) {
                Ok(Signal::Now) | Err(RecvTimeoutError::Timeout) => false,
                Ok(Signal::Stop) | Err(RecvTimeoutError::Disconnected) => true,
            };
            let started = Instant::now();
            let now = SystemTime::now();
            for day in [utc_day(now, 1), utc_day(now, 0)] {
                match self.move_day(&day) {
                    Ok(()) => {}
                    Err(Failed::Database(err)) => return Err(err),
                    Err(Failed::Redis(err)) => {
                        if self.on_redis_error == OnRedisError::Fail {
                            return Err(err);
                        }
                        self.redis = None;
                        self.stats.redis_failures += 1;
                        break;
                    }
                }
            }
            if last {
                return Ok(self.stats);
            }
            next = started + INTERVAL;
        }
    }

    /// Moves `day`'s hash, if there is one.
    fn move_day(&mut self, day: &str) -> Result<(), Failed> {
        let live = day_key(day);
        let moving = format!("{live}:moving");
        let redis = self.redis()?;
        let leftover = match redis.command(&[b"EXISTS", moving.as_bytes()]) {
            Ok(Reply::Int(n)) => n > 0,
            Ok(other) => return Err(Failed::Redis(anyhow!("EXISTS answered {other:?}"))),
            Err(err) => return Err(Failed::Redis(err)),
        };
        if !leftover {
            match redis.command(&[b"RENAME", live.as_bytes(), moving.as_bytes()]) {
                Ok(Reply::Status(_)) => {}
                // Nothing counted for that day since the last move.
                Ok(Reply::Error(e)) if e.contains("no such key") => return Ok(()),
                Ok(other) => return Err(Failed::Redis(anyhow!("RENAME answered {other:?}"))),
                Err(err) => return Err(Failed::Redis(err)),
            }
        }
        let pairs = redis
            .send(&[b"HGETALL", moving.as_bytes()])
            .and_then(|()| read_int_pairs(&mut redis.reader))
            .map_err(Failed::Redis)?;
        let rows = pairs.len() as u64;
        self.rt
            .block_on(upsert(&mut self.pg, &self.upsert, day, pairs))
            .map_err(|e| Failed::Database(e.context(format!("moving {moving}"))))?;
        self.stats.rows += rows;
        self.stats.moves += 1;
        match self.redis()?.command(&[b"DEL", moving.as_bytes()]) {
            Ok(Reply::Int(_)) => Ok(()),
            Ok(other) => Err(Failed::Redis(anyhow!("DEL answered {other:?}"))),
            Err(err) => Err(Failed::Redis(err)),
        }
    }

    /// The connection to Redis, opened again after a failure.
    fn redis(&mut self) -> Result<&mut Conn, Failed> {
        if self.redis.is_none() {
            self.redis = Some(Conn::connect(&self.socket).map_err(Failed::Redis)?);
        }
        Ok(self.redis.as_mut().expect("connected above"))
    }
}

/// One transaction: the rows sorted by version (as tallyd sorts a flush's rows), in statements
/// of `CHUNK_ROWS` sent together (pipelined), then COMMIT.
async fn upsert(
    pg: &mut Client,
    stmt: &Statement,
    day: &str,
    mut pairs: Vec<(i64, i64)>,
) -> Result<()> {
    pairs.sort_unstable_by_key(|&(version, _)| version);
    let chunks: Vec<(Vec<i64>, Vec<i64>)> = pairs
        .chunks(CHUNK_ROWS)
        .map(|c| c.iter().copied().unzip())
        .collect();
    let params: Vec<[&(dyn ToSql + Sync); 3]> = chunks
        .iter()
        .map(|(versions, counts)| [versions as &(dyn ToSql + Sync), counts, &day])
        .collect();
    let tx = pg.transaction().await?;
    try_join_all(params.iter().map(|p| tx.execute(stmt, p))).await?;
    tx.commit().await?;
    Ok(())
}

/// CPU seconds the calling thread has used.
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for clock_gettime to write.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}
