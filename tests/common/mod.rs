//! Shared test setup: the test kit (`tallyd-testkit`, see testkit/src/lib.rs for its API) plus
//! what only the tests of this package can know: the path of the `tallyd` binary Cargo built.
#![allow(dead_code)]

pub mod netpg;

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
