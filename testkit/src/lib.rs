//! tallyd's test kit: everything the integration tests (`tests/`, through `tests/common`) and
//! the benchmark (`bench/`) share to set up a daemon, so that no test builds TOML by hand,
//! spawns the binary its own way or parses a scrape its own way.
//!
//! # API
//! - [`temp_dir`]: a `/tmp/tallyd-test-*` directory the `postgres` OS user can traverse;
//!   [`free_port`]: a free 127.0.0.1 port.
//! - [`TestConfig`]: a typed builder over [`tallyd::config::Config`], with every path inside
//!   the test's directory and the metrics endpoint off:
//!   `TestConfig::new(dir).standard_counters().fast().database_url(&url)
//!   .with(|c| c.flush.set_interval(ms(50))).write()` writes `dir/config.toml` (serde, the
//!   ordinary file format) and returns its path; `.build()` returns the validated `Config`.
//!   [`counter`], [`counter_rolled_into`], [`counter_into_repositories`] and
//!   [`STANDARD_COUNTERS`] declare counters; [`windowed_counter`] a counter per day (or other
//!   window), [`unix_ms`] an event time for it; [`kind_counter`] any other counter, from the
//!   keys of its config.toml entry. `.external(url, "id")` makes it a `tallyd run` child on an
//!   external database (instance `id`, no datagram socket, no rollup schedule) and
//!   `.never_flushes()` leaves commits to `!flush`, corrections and stops (what a kill -9 finds
//!   is in the journal).
//! - [`Daemon`]: the real `tallyd run` as a child process. `Daemon::spawn(bin, &config_path)`
//!   starts it and waits until its socket answers `!ping`; `.terminate()` sends SIGTERM and
//!   returns the exit status; `.kill()` is a crash; `.signal(sig)`, `.pid()`, `.try_wait()`,
//!   `.wait()`; `.log()` reads its log (`<config>.log`), `.wait_for_log(text)` waits for a
//!   line; `.scrape()` reads its metrics; `.reload("ok")` sends SIGHUP and waits until the
//!   reload is counted. `spawn_with` changes the command first (a
//!   `pre_exec` hook, environment), `try_spawn_with` returns an error instead of panicking.
//!   Dropping it stops it with SIGTERM (so its private PostgreSQL stops too, even when the
//!   test fails). [`run_cli`] runs one `tallyd` command to completion. In `tests/`,
//!   `common::spawn_daemon(&config)` and `common::tallyd(&config, args)` pass the binary
//!   Cargo built.
//! - [`start_postgres`] / [`start_postgres_with`] / [`postgres`] (async): a private
//!   PostgreSQL cluster (fsync off) under `dir/pg`; stop it with `Embedded::stop` (async:
//!   [`stop_postgres`], [`stop_postgres_immediate`]). [`create_databases`]: `db0`, `db1`, ...
//!   in one cluster.
//! - [`InProcess`]: tallyd in-process (`daemon::run` on a task) on a config's sockets and
//!   databases: `InProcess::spawn(config)`, `.stop().await` (how the run ended), `.ended().await`
//!   (a start that must be refused). [`Harness`]: PostgreSQL plus an `InProcess` on temporary
//!   sockets: `Harness::start(|c| c.listen.max_connections = 4).await`, `.client()`, `.total()`,
//!   `.stop().await`.
//! - SQL on a test database: [`sql`] (a session by connection string), [`db`], [`scalar`],
//!   [`scalar_pair`], [`db_error`] (the server's message for a failure), and the reads of `tallyd.totals`: [`counter_total`], [`key_total`],
//!   [`total_and_keys`], [`counts`], and over several databases [`counter_total_over`],
//!   [`counts_per_database`] (0 where there is no row). Reads that tell "no row" from 0:
//!   [`count_of`], [`value_of`], [`total_row`] (count and value), [`rows_of`] /
//!   [`rows_of_key`] (a key's rows in slots, rollups and held-back rows), [`windows_of`] (a
//!   key's windows, their starts as [`utc`] prints them), [`sketch_of`] (a unique key's sketch,
//!   all time or one window) beside [`sql_sketch`] (the extension's sketch of the same values).
//! - Faults in the database: [`terminate`] tallyd's sessions ([`Sessions::Tallyd`]) or every
//!   client backend ([`Sessions::All`], PgBouncer's server connections) once, a [`Terminator`]
//!   again and again until stopped, a [`RollupLoop`] calling `tallyd.rollup` on its own session.
//! - [`LineClient`]: a stream connection speaking the line protocol (`.flush()`, `.sync()`,
//!   `.send_synced(lines)`); [`send_synced`] connects, sends lines and waits for `!sync`;
//!   [`buf_of`] joins lines.
//! - [`wait_until`] (async) and [`wait_until_blocking`]: poll a condition with a liveness bound;
//!   [`seeded`]: a random generator whose seed is printed (`TALLYD_TEST_SEED` repeats a run);
//!   [`in_ci`]: whether `CI` is set (a missing tool fails there instead of skipping).
//! - [`Samples`]: a parsed Prometheus text scrape (`Samples::parse`, `.get`, `.value`,
//!   `.histogram`); [`scrape`] / [`http_get`] fetch one.
//!
//! # Every test stops what it starts
//! `Daemon` and `Harness` stop their processes on drop; `Embedded` (a private PostgreSQL) must
//! be stopped with `stop()` or `stop_immediate()` (its drop stops it too, see
//! `tallyd::store::embedded`). `scripts/check-leftovers` lists any process left running from a
//! `/tmp/tallyd-test-*` directory after a run.

mod client;
mod config;
mod daemon;
mod faults;
mod harness;
mod postgres;
mod scrape;
mod sql;

pub use client::{buf_of, send_synced, LineClient};
pub use config::{
    counter, counter_into_repositories, counter_rolled_into, kind_counter, unix_ms,
    windowed_counter, TestConfig, STANDARD_COUNTERS,
};
pub use daemon::{run_cli, Daemon};
pub use faults::{terminate, RollupLoop, Sessions, Terminator};
pub use harness::{Harness, InProcess};
pub use postgres::{
    create_databases, postgres, start_postgres, start_postgres_with, stop_postgres,
    stop_postgres_immediate,
};
pub use scrape::{http_get, process_metrics, scrape, Samples};
pub use sql::{
    count_of, counter_total, counter_total_over, counts, counts_per_database, db, db_error,
    key_total, rows_of, rows_of_key, scalar, scalar_pair, sketch_of, sql, sql_sketch,
    total_and_keys, total_row, utc, value_of, windows_of, SketchRow,
};

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::SeedableRng;

/// How long [`wait_until`] waits: a liveness bound, not a timing assertion.
const WAIT: Duration = Duration::from_secs(120);

/// A temporary directory the `postgres` OS user can traverse (tests run as root). Its name
/// starts with `tallyd-test-`, which is what `scripts/check-leftovers` looks for.
pub fn temp_dir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("tallyd-test-")
        .tempdir_in("/tmp")
        .expect("temp dir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// A TCP port on 127.0.0.1 that was free a moment ago (for a metrics endpoint).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls `done` every 50 ms until it holds; panics naming `what` after two minutes.
pub async fn wait_until(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done().await {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`wait_until`] for a test without a runtime: polls `done` every 20 ms.
pub fn wait_until_blocking(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A random generator for a test's choices, its seed printed: `TALLYD_TEST_SEED=<seed>` runs
/// the same choices again.
pub fn seeded() -> StdRng {
    let seed: u64 = std::env::var("TALLYD_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("seed {seed} (TALLYD_TEST_SEED={seed} repeats this run)");
    StdRng::seed_from_u64(seed)
}

/// Whether the tests run in CI (`CI` is `true` or `1`): there a missing tool fails the test
/// instead of skipping it.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}
