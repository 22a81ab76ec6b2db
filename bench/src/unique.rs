//! The unique-count rows (issue 25): the counter they declare (`kind = "unique"` at
//! postgresql-hll's default precision), the extension the bench's server needs for it, what
//! `tallyd.unique_totals` must hold afterwards, and the per-event SQL peer `hll-upsert-hot`
//! (one `hll_add` upsert per event on one row, what an application does without a buffer).
//!
//! A sketch's cardinality is an estimate: the checks hold it to what the sketch promises, the
//! exact count while a key holds at most the explicit threshold's values (postgresql-hll keeps
//! the hashes themselves), else within 3 standard errors (1.04 / sqrt(2^log2m)) of the distinct
//! values sent.

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use tallyd::config::{CounterConfig, KeyTypeName};
use tallyd::hll::Params;
use tallyd::protocol::Kind;

use crate::env::{BenchArgs, BenchEnv, HOT, UNIQUE_COUNTER};
use crate::report::{thousands, Outcome};

/// Why a unique-count row did not run.
pub(crate) const NO_HLL: &str = "skipped: the hll extension is not available on the bench's \
                                 PostgreSQL (scripts/ensure-postgres installs postgresql-15-hll)";

/// Standard errors a full sketch's cardinality may be off by.
const TOLERANCE_SE: f64 = 3.0;

/// The precision of every sketch here: postgresql-hll's defaults (log2m 11, regwidth 5, the
/// explicit threshold automatic), which a unique counter takes when it sets none.
fn params() -> Params {
    Params::default()
}

/// The unique counter the `tallyd-unique-*` rows declare: `kind = "unique"`, text keys,
/// `log2m` and `regwidth` left at their defaults.
pub(crate) fn unique_counter() -> CounterConfig {
    let mut counter = tallyd_testkit::counter(UNIQUE_COUNTER, KeyTypeName::Text);
    counter.kind = Kind::Unique;
    counter
}

/// The relative standard error of a sketch of 2^`log2m` registers (HyperLogLog's 1.04 /
/// sqrt(m): 2.3% for postgresql-hll's default log2m 11, 0.81% for Redis's 16,384 registers).
pub(crate) fn standard_error(log2m: u32) -> f64 {
    1.04 / f64::from(1u32 << log2m).sqrt()
}

/// What the sketches of some keys may read: `estimate` (their cardinalities summed) against the
/// `distinct` (key, value) pairs sent, no key holding more than `max_per_key`. Exact while
/// `max_per_key` is at most `exact_up_to` (an explicit sketch is its hashes), else within
/// `TOLERANCE_SE` standard errors `se`. `Ok` or `Err` with the same description.
pub(crate) fn judge_cardinality(
    estimate: u64,
    distinct: u64,
    max_per_key: u64,
    exact_up_to: u64,
    se: f64,
) -> std::result::Result<String, String> {
    let what = format!(
        "cardinality {} of {} distinct values",
        thousands(estimate as f64),
        thousands(distinct as f64)
    );
    if max_per_key <= exact_up_to {
        return if estimate == distinct {
            Ok(format!(
                "{what}: exact (at most {max_per_key} a key, explicit)"
            ))
        } else {
            Err(format!(
                "{what}: not exact, yet no key holds more than {max_per_key} (explicit up to \
                 {exact_up_to})"
            ))
        };
    }
    let error = (estimate as f64 - distinct as f64) / distinct as f64;
    let limit = TOLERANCE_SE * se;
    let text = format!(
        "{what}: {:+.2}% (within {:.2}%, {TOLERANCE_SE} standard errors)",
        error * 100.0,
        limit * 100.0
    );
    if error.abs() <= limit {
        Ok(text)
    } else {
        Err(text.replace("(within", "(NOT within"))
    }
}

/// `judge_cardinality` for postgresql-hll sketches of the bench's precision, as an error
/// naming the row.
fn judge_hll(name: &str, estimate: u64, distinct: u64, max_per_key: u64) -> Result<String> {
    let p = params();
    let exact_up_to = p.explicit_threshold() as u64;
    judge_cardinality(
        estimate,
        distinct,
        max_per_key,
        exact_up_to,
        standard_error(p.log2m()),
    )
    .or_else(|why| bail!("{name}: NOT EXACT: {why}"))
}

impl BenchEnv {
    /// Whether the bench's server has postgresql-hll; if so, `CREATE EXTENSION IF NOT EXISTS
    /// hll` (tallyd refuses to start with a unique counter without it).
    pub(crate) async fn hll_ready(&self) -> Result<bool> {
        let client = self.db.connect().await?;
        let available = client
            .query_opt(
                "SELECT 1 FROM pg_available_extensions WHERE name = 'hll'",
                &[],
            )
            .await?
            .is_some();
        if available {
            client
                .batch_execute("CREATE EXTENSION IF NOT EXISTS hll")
                .await
                .context("CREATE EXTENSION hll on the bench's PostgreSQL")?;
        }
        Ok(available)
    }

    /// What the unique counter's rows in `tallyd.unique_totals` must hold: `events` events on
    /// `keys` keys, all-time rows only, and cardinalities near the `distinct` (key, value) pairs
    /// sent (`judge_cardinality`). Returns the cardinality's description.
    pub(crate) async fn check_unique_totals(
        &self,
        name: &str,
        events: u64,
        keys: u64,
        distinct: u64,
        max_per_key: u64,
    ) -> Result<String> {
        let client = self.db.connect().await?;
        let row = client
            .query_one(
                "SELECT count(*), coalesce(sum(events), 0)::bigint, \
                        coalesce(sum(cardinality), 0)::bigint, \
                        count(*) FILTER (WHERE span <> 'all') \
                 FROM tallyd.unique_totals WHERE counter = $1",
                &[&UNIQUE_COUNTER],
            )
            .await?;
        let (stored_keys, stored_events, cardinality, windowed): (i64, i64, i64, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        ensure!(
            stored_events as u64 == events && stored_keys as u64 == keys && windowed == 0,
            "{name}: NOT EXACT: sent {events} events on {keys} keys, tallyd.unique_totals holds \
             {stored_events} events on {stored_keys} rows ({windowed} of them not span 'all')"
        );
        judge_hll(name, cardinality as u64, distinct, max_per_key)
    }

    /// `hll-upsert-hot`: `--connections` sessions, each upserting one event per statement into
    /// the hot key's sketch in `visitors` for `--baseline-seconds`, the values drawn uniformly
    /// from the `--hc-keys` values the `tallyd-unique-hot` load draws from. Afterwards the
    /// sketch's cardinality must be near the distinct values sent.
    pub(crate) async fn hll_upsert(&self, name: &'static str, args: &BenchArgs) -> Result<Outcome> {
        if !self.hll_ready().await? {
            return Ok(Outcome::skipped(name, NO_HLL.into()));
        }
        let admin = self.db.connect().await?;
        admin
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS visitors (page text PRIMARY KEY, sketch hll NOT NULL);
                 TRUNCATE visitors",
            )
            .await?;
        let p = params();
        let empty = format!("hll_empty({}, {})", p.log2m(), p.regwidth());
        let sql = format!(
            "INSERT INTO visitors(page, sketch) VALUES ($1, hll_add({empty}, hll_hash_text($2))) \
             ON CONFLICT (page) DO UPDATE SET sketch = hll_add(visitors.sketch, hll_hash_text($2))"
        );
        let mut sessions = Vec::with_capacity(args.connections);
        for _ in 0..args.connections {
            let client = self.db.connect().await?;
            let stmt = client.prepare(&sql).await?;
            sessions.push((client, stmt));
        }
        let started = Instant::now();
        let deadline = started + Duration::from_secs(args.baseline_seconds);
        let values = args.hc_keys;
        let tasks: Vec<_> = sessions
            .into_iter()
            .map(|(client, stmt)| tokio::spawn(upsert_loop(client, stmt, values, deadline)))
            .collect();
        let mut sent = Vec::new();
        for task in tasks {
            sent.extend(task.await??);
        }
        let elapsed = started.elapsed();
        let total = sent.len() as u64;
        sent.sort_unstable();
        sent.dedup();
        let distinct = sent.len() as u64;
        let row = admin
            .query_one(
                "SELECT count(*), coalesce(max(hll_cardinality(sketch)), 0)::bigint \
                 FROM visitors WHERE page = $1",
                &[&HOT],
            )
            .await?;
        let (rows, cardinality): (i64, i64) = (row.get(0), row.get(1));
        ensure!(
            rows == i64::from(total > 0),
            "{name}: {total} statements, and visitors holds {rows} rows for the hot key"
        );
        let judged = judge_hll(name, cardinality as u64, distinct, distinct)?;
        Ok(Outcome::baseline(name, total, "stmt", elapsed).with_note(judged))
    }
}

/// One session's statements until the deadline: each upserts `v<n>` (n drawn uniformly from
/// `0..values`) into the hot key's sketch. Returns the values sent.
async fn upsert_loop(
    client: tokio_postgres::Client,
    stmt: tokio_postgres::Statement,
    values: u64,
    deadline: Instant,
) -> Result<Vec<u64>> {
    let mut rng = StdRng::from_entropy();
    let mut sent = Vec::new();
    while Instant::now() < deadline {
        let v = rng.gen_range(0..values);
        let written = client.execute(&stmt, &[&HOT, &format!("v{v}")]).await?;
        ensure!(written == 1, "an hll upsert wrote {written} rows, not 1");
        sent.push(v);
    }
    Ok(sent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cardinality_is_exact_while_explicit_and_within_three_errors_after() {
        let se = standard_error(11);
        assert!((se - 0.022_98).abs() < 1e-4, "{se}");
        assert!((standard_error(14) - 0.008_125).abs() < 1e-6);
        assert_eq!(
            judge_cardinality(3_000_000, 3_000_000, 3, 160, se).unwrap(),
            "cardinality 3,000,000 of 3,000,000 distinct values: exact (at most 3 a key, explicit)"
        );
        assert_eq!(
            judge_cardinality(2_999_999, 3_000_000, 3, 160, se).unwrap_err(),
            "cardinality 2,999,999 of 3,000,000 distinct values: not exact, yet no key holds \
             more than 3 (explicit up to 160)"
        );
        assert_eq!(
            judge_cardinality(1_020_000, 1_000_000, 1_000_000, 160, se).unwrap(),
            "cardinality 1,020,000 of 1,000,000 distinct values: +2.00% (within 6.89%, 3 \
             standard errors)"
        );
        assert_eq!(
            judge_cardinality(930_000, 1_000_000, 1_000_000, 160, se).unwrap_err(),
            "cardinality 930,000 of 1,000,000 distinct values: -7.00% (NOT within 6.89%, 3 \
             standard errors)"
        );
    }

    #[test]
    fn the_bench_precision_is_the_daemons_and_the_extensions_default() {
        let p = params();
        assert_eq!(
            (p.log2m(), p.regwidth(), p.explicit_threshold()),
            (11, 5, 160)
        );
    }
}
