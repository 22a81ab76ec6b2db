//! The baselines: one statement per event (naive, slotted, insert-only) from `--connections`
//! sessions, the batched-upsert ceiling, and the rollup fold, all on the bench's server.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use tallyd::config::{Config, KeyTypeName};
use tallyd::store::{self, Db};

use crate::env::{BenchArgs, BenchEnv, COUNTER, HOT};
use crate::report::{server_cpu_note, thousands, Outcome};

/// Slots of the slotted baselines.
const SLOTS: i32 = 100;
/// Rows per statement of the batched ceiling, and the key space they are drawn from.
const BATCH_ROWS: usize = 5_000;
const BATCH_KEY_SPACE: usize = 1_000_000;

#[derive(Clone, Copy, Debug)]
pub(crate) enum PerEvent {
    Naive,
    SlotRandom,
    SlotTime,
    Insert,
}

impl PerEvent {
    fn sql(self) -> &'static str {
        match self {
            PerEvent::Naive => {
                "INSERT INTO bench_naive(key, count) VALUES ($1, 1) \
                 ON CONFLICT (key) DO UPDATE SET count = bench_naive.count + 1"
            }
            PerEvent::SlotRandom | PerEvent::SlotTime => {
                "INSERT INTO bench_slotted(key, slot, count) VALUES ($1, $2, 1) \
                 ON CONFLICT (key, slot) DO UPDATE SET count = bench_slotted.count + 1"
            }
            PerEvent::Insert => "INSERT INTO bench_events(key) VALUES ($1)",
        }
    }

    fn table(self) -> &'static str {
        match self {
            PerEvent::Naive => "bench_naive",
            PerEvent::SlotRandom | PerEvent::SlotTime => "bench_slotted",
            PerEvent::Insert => "bench_events",
        }
    }

    /// What the table must sum to after `n` statements.
    fn total_sql(self) -> &'static str {
        match self {
            PerEvent::Naive => "SELECT coalesce(sum(count), 0)::bigint FROM bench_naive",
            PerEvent::SlotRandom | PerEvent::SlotTime => {
                "SELECT coalesce(sum(count), 0)::bigint FROM bench_slotted"
            }
            PerEvent::Insert => "SELECT count(*) FROM bench_events",
        }
    }

    /// The slot of the next statement: random, or the clock's microseconds modulo 100.
    fn slot(self, rng: &mut StdRng) -> i32 {
        match self {
            PerEvent::SlotTime => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                (now.subsec_micros() % SLOTS as u32) as i32
            }
            _ => rng.gen_range(0..SLOTS),
        }
    }
}

impl BenchEnv {
    /// `--connections` sessions, each issuing `kind`'s statement on the hot key until the deadline.
    pub(crate) async fn per_event(
        &self,
        name: &'static str,
        kind: PerEvent,
        args: &BenchArgs,
    ) -> Result<Outcome> {
        let admin = self.db.connect().await?;
        admin
            .batch_execute(&format!("TRUNCATE {}", kind.table()))
            .await?;
        let mut sessions = Vec::with_capacity(args.connections);
        for _ in 0..args.connections {
            let client = self.db.connect().await?;
            let stmt = client.prepare(kind.sql()).await?;
            sessions.push((client, stmt));
        }
        let started = Instant::now();
        let deadline = started + Duration::from_secs(args.baseline_seconds);
        let tasks: Vec<_> = sessions
            .into_iter()
            .map(|(client, stmt)| tokio::spawn(statement_loop(client, stmt, kind, deadline)))
            .collect();
        let mut total = 0u64;
        for task in tasks {
            total += task.await??;
        }
        let elapsed = started.elapsed();
        let stored: i64 = admin.query_one(kind.total_sql(), &[]).await?.get(0);
        ensure!(
            stored as u64 == total,
            "{name}: {total} statements committed but {} holds {stored}",
            kind.table()
        );
        Ok(Outcome::baseline(name, total, "stmt", elapsed))
    }
}

async fn statement_loop(
    client: tokio_postgres::Client,
    stmt: tokio_postgres::Statement,
    kind: PerEvent,
    deadline: Instant,
) -> Result<u64> {
    let mut rng = StdRng::from_entropy();
    let mut n = 0u64;
    while Instant::now() < deadline {
        match kind {
            PerEvent::Naive | PerEvent::Insert => client.execute(&stmt, &[&HOT]).await?,
            PerEvent::SlotRandom | PerEvent::SlotTime => {
                let slot = kind.slot(&mut rng);
                client.execute(&stmt, &[&HOT, &slot]).await?
            }
        };
        n += 1;
    }
    Ok(n)
}

/// Slot rows folded per second as `tallyd rollup --until-empty` folds them (every counter through
/// one pass with its cursor, steps sized by the daemon's adaptive pace from `rollup.batch_rows`),
/// one session, from 500,000 slot rows (250,000 keys, two slots each), with the server's CPU per
/// row folded.
pub(crate) async fn rollup_fold(env: &BenchEnv, name: &'static str) -> Result<Outcome> {
    const KEYS: i64 = 250_000;
    let db = &env.db;
    let mut client = db.connect().await?;
    let mut config = Config::default();
    config
        .counters
        .push(tallyd_testkit::counter(COUNTER, KeyTypeName::Text));
    config.validate()?;
    store::prepare(&mut client, &config).await?;
    client
        .batch_execute(&format!(
            "TRUNCATE tallyd.slots, tallyd.rollups;
             INSERT INTO tallyd.slots SELECT '{COUNTER}', 'k' || i, s, 1, now(), now()
               FROM generate_series(1, {KEYS}) i, generate_series(0, 1) s;"
        ))
        .await?;
    // Its own statement: a multi-statement batch runs as one transaction, and VACUUM refuses that.
    client.batch_execute("VACUUM ANALYZE tallyd.slots").await?;
    let cpu_before = env.server_cpu()?;
    let started = Instant::now();
    let units = tallyd::rollup::units_with_found(&client, &config).await?;
    let folded = tallyd::rollup::drain(&client, &units, None, config.rollup.batch_rows).await?;
    let elapsed = started.elapsed();
    let server_cpu = env.server_cpu()? - cpu_before;
    let summed: i64 = client
        .query_one(
            "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.rollups",
            &[],
        )
        .await?
        .get(0);
    ensure!(
        folded == 2 * KEYS && summed == 2 * KEYS,
        "{name}: folded {folded} rows summing to {summed}, expected {}",
        2 * KEYS
    );
    client
        .batch_execute("TRUNCATE tallyd.slots, tallyd.rollups")
        .await?;
    let note = format!("exact; {}", server_cpu_note(server_cpu, folded as f64));
    Ok(Outcome::baseline(name, folded as u64, "row", elapsed).with_note(note))
}

/// One session upserting 5,000 distinct keys per statement: what PostgreSQL itself can absorb.
pub(crate) async fn batched_ceiling(db: &Db, seconds: Duration) -> Result<Outcome> {
    let client = db.connect().await?;
    client.batch_execute("TRUNCATE bench_batch").await?;
    let stmt = client
        .prepare(
            "INSERT INTO bench_batch(key, count) SELECT * FROM unnest($1::text[], $2::bigint[]) \
             ON CONFLICT (key) DO UPDATE SET count = bench_batch.count + EXCLUDED.count",
        )
        .await?;
    let mut rng = StdRng::from_entropy();
    let counts = vec![1i64; BATCH_ROWS];
    let started = Instant::now();
    let mut rows = 0u64;
    while started.elapsed() < seconds {
        let keys: Vec<String> = rand::seq::index::sample(&mut rng, BATCH_KEY_SPACE, BATCH_ROWS)
            .iter()
            .map(|k| format!("k{k}"))
            .collect();
        client.execute(&stmt, &[&keys, &counts]).await?;
        rows += BATCH_ROWS as u64;
    }
    let elapsed = started.elapsed();
    let stored: i64 = client
        .query_one(
            "SELECT coalesce(sum(count), 0)::bigint FROM bench_batch",
            &[],
        )
        .await?
        .get(0);
    ensure!(
        stored as u64 == rows,
        "batched: {rows} rows sent, table sums to {stored}"
    );
    Ok(Outcome::baseline("batched", rows, "row", elapsed))
}

/// The server-side ceiling of a flush's upsert: one `INSERT INTO tallyd.slots ... SELECT ... FROM
/// generate_series(...) ON CONFLICT DO UPDATE` of `keys` rows, the same statement shape (SET
/// clause and range guard) and table a flush writes, with no client in the way. It runs twice:
/// into the empty table (every row inserted) and again over the same keys (every row updated),
/// as a high-cardinality run's first and later flushes do; rows/s is both passes together.
pub(crate) async fn server_upsert(
    env: &BenchEnv,
    name: &'static str,
    keys: u64,
) -> Result<Outcome> {
    let client = env.db.connect().await?;
    let cpu_before = env.server_cpu()?;
    client.batch_execute("TRUNCATE tallyd.slots").await?;
    let sql = format!(
        "INSERT INTO tallyd.slots AS s (counter, key, slot, count, first_seen, last_seen)
         SELECT '{COUNTER}', 'k' || i, 0, 1, now(), now() FROM generate_series(0, {last}) i
         ON CONFLICT (counter, key, span, win, slot) DO UPDATE SET
             count = s.count + EXCLUDED.count,
             first_seen = LEAST(s.first_seen, EXCLUDED.first_seen),
             last_seen = GREATEST(s.last_seen, EXCLUDED.last_seen)
         WHERE s.count::numeric + EXCLUDED.count BETWEEN -9223372036854775808 AND 9223372036854775807",
        last = keys as i64 - 1
    );
    let mut passes = Vec::with_capacity(2);
    for _ in 0..2 {
        let started = Instant::now();
        let written = client.execute(&sql, &[]).await?;
        passes.push(started.elapsed());
        ensure!(
            written == keys,
            "{name}: one pass wrote {written} rows, expected {keys}"
        );
    }
    let stored: i64 = client
        .query_one(
            "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.slots",
            &[],
        )
        .await?
        .get(0);
    ensure!(
        stored as u64 == 2 * keys,
        "{name}: two passes over {keys} keys, tallyd.slots sums to {stored}"
    );
    let server_cpu = env.server_cpu()? - cpu_before;
    client.batch_execute("TRUNCATE tallyd.slots").await?;
    let rate = |d: Duration| keys as f64 / d.as_secs_f64();
    let note = format!(
        "exact; insert pass {} rows/s, update pass {} rows/s; {}",
        thousands(rate(passes[0])),
        thousands(rate(passes[1])),
        server_cpu_note(server_cpu, (2 * keys) as f64)
    );
    Ok(Outcome::baseline(name, 2 * keys, "row", passes[0] + passes[1]).with_note(note))
}
