//! `tallyd-bench`: the command line of the benchmark (docs/benchmarks.md). It parses the
//! options, finds the daemon binary to measure and hands both to [`bench::run`]; the scenarios
//! start in `bench.rs`. The benchmark is its own package so that neither the daemon binary nor
//! the `tallyd` library carries it.

mod baselines;
mod bench;
mod client;
mod daemon;
mod daily;
mod env;
mod import;
mod kill;
mod load;
mod mover;
mod per_event;
mod procfs;
mod receiver;
mod redis;
mod redis_daily;
mod redis_pfadd;
mod report;
mod resp;
mod scenario;
mod scrape;
mod statsd;
mod sustained;
mod table;
mod unique;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;

/// Measure tallyd against per-event upserts on a private PostgreSQL (docs/benchmarks.md).
#[derive(Parser, Debug)]
#[command(name = "tallyd-bench", version)]
struct Cli {
    #[command(flatten)]
    args: env::BenchArgs,
    /// The `tallyd` binary to measure. Default: `tallyd` beside this executable, built first
    /// (`cargo build -p tallyd`, same profile) when `cargo run` started the bench.
    #[arg(long, value_name = "PATH")]
    tallyd: Option<PathBuf>,
    /// Internal: run as the per-event scenarios' counting receiver (bench/src/receiver.rs).
    #[arg(long, hide = true, num_args = 3, value_names = ["KIND", "SOCKET", "EVENTS"])]
    count_newlines: Option<Vec<String>>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(args) = &cli.count_newlines {
        return receiver_main(args);
    }
    let result = daemon_binary(cli.tallyd).and_then(|tallyd| {
        let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
        runtime.block_on(bench::run(cli.args, tallyd))
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("tallyd-bench: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn receiver_main(args: &[String]) -> ExitCode {
    let result = args[2]
        .parse()
        .context("--count-newlines: EVENTS is not a number")
        .and_then(|events| receiver::run(&args[0], Path::new(&args[1]), events));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("tallyd-bench counting receiver: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// The daemon to spawn: `explicit`, else `tallyd` in this executable's directory (the same
/// target directory and profile, where `cargo build` puts both binaries).
fn daemon_binary(explicit: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(path) = explicit {
        ensure!(path.is_file(), "--tallyd {}: no such file", path.display());
        return Ok(path);
    }
    let exe = std::env::current_exe().context("finding the bench's own executable")?;
    let dir = exe
        .parent()
        .context("the bench's executable has no directory")?;
    // `cargo run -p tallyd-bench` builds this package only; build the daemon too, so the bench
    // never measures a stale binary. Cargo has released its lock by now (it execs the binary).
    if let Some(cargo) = std::env::var_os("CARGO") {
        build_daemon(Path::new(&cargo), dir)?;
    }
    let path = dir.join("tallyd");
    if !path.is_file() {
        bail!(
            "no daemon binary at {}: build it with `cargo build --release -p tallyd` (or run \
             `cargo run --release -p tallyd-bench`, which does), or pass --tallyd PATH",
            path.display()
        );
    }
    Ok(path)
}

/// `cargo build -p tallyd --bin tallyd` into the target directory and profile of `exe_dir`
/// (`<target>/release` or `<target>/debug`).
fn build_daemon(cargo: &Path, exe_dir: &Path) -> Result<()> {
    let profile = profile_of(exe_dir)?;
    let target_dir = exe_dir
        .parent()
        .context("the bench's executable is not in a target directory")?;
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let status = std::process::Command::new(cargo)
        .args([
            "build",
            "-p",
            "tallyd",
            "--bin",
            "tallyd",
            "--profile",
            profile,
        ])
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(target_dir)
        .status()
        .with_context(|| format!("running {} build -p tallyd", cargo.display()))?;
    ensure!(
        status.success(),
        "building the daemon (cargo build -p tallyd) failed: {status}"
    );
    Ok(())
}

/// The cargo profile that builds into `exe_dir`: its name, except that `dev` builds into `debug`.
fn profile_of(exe_dir: &Path) -> Result<&str> {
    match exe_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => Ok("dev"),
        Some(name) => Ok(name),
        None => bail!("cannot tell the build profile from {}", exe_dir.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_follows_the_executable_directory() {
        assert_eq!(
            profile_of(Path::new("/w/target/release")).unwrap(),
            "release"
        );
        assert_eq!(profile_of(Path::new("/w/target/debug")).unwrap(), "dev");
        assert_eq!(
            profile_of(Path::new("/w/target/profiling")).unwrap(),
            "profiling"
        );
        assert!(profile_of(Path::new("/")).is_err());
    }

    #[test]
    fn an_explicit_daemon_must_exist() {
        let err = daemon_binary(Some(PathBuf::from("/nonexistent/tallyd"))).unwrap_err();
        assert_eq!(
            err.to_string(),
            "--tallyd /nonexistent/tallyd: no such file"
        );
    }
}
