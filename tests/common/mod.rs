//! Shared test setup: the test kit (`tallyd-testkit`, see testkit/src/lib.rs for its API) plus
//! what only the tests of this package can know: the path of the `tallyd` binary Cargo built.
#![allow(dead_code)]

pub mod netpg;
pub mod prometheus;

use std::path::Path;
use std::process::Output;

pub use tallyd_testkit::*;

/// The `tallyd` binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_tallyd");

/// Starts `tallyd run` with the config at `config` and waits until it answers `!ping`.
pub fn spawn_daemon(config: &Path) -> Daemon {
    Daemon::spawn(Path::new(BIN), config)
}

/// Runs `tallyd --config <config> <args>` to completion.
pub fn tallyd(config: &Path, args: &[&str]) -> Output {
    run_cli(Path::new(BIN), config, args)
}

/// Runs `sql` (simple query protocol, several statements allowed) on the first database of the
/// daemon configured by `config`: its private PostgreSQL while that daemon runs.
#[allow(dead_code)]
pub fn run_sql(config: &Path, sql: &str) -> Vec<tokio_postgres::SimpleQueryMessage> {
    let config = tallyd::config::Config::load(config).expect("load config");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let db = tallyd::store::Databases::connect_only(&config)
            .unwrap()
            .remove(0);
        let client = db.connect().await.expect("connect to the database");
        client.simple_query(sql).await.expect(sql)
    })
}
