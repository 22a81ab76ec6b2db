//! The `tallyd` binary: parses the command line and hands each command to [`tallyd::cli`].

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use tallyd::cli;
use tallyd::config::Config;

#[derive(Parser)]
#[command(
    version,
    about = "Absorbs hot counter writes for PostgreSQL: coalesced, slotted, exact."
)]
struct Cli {
    /// Configuration file.
    #[arg(
        long,
        short,
        global = true,
        default_value = "config.toml",
        env = "TALLYD_CONFIG"
    )]
    config: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon (and its private PostgreSQL when database.url = "embedded").
    Run,
    /// Send events to a running daemon and wait until they are committed.
    ///
    /// `tallyd send COUNTER KEY [DELTA]` sends one event; `tallyd send -` sends lines from stdin.
    Send {
        /// COUNTER KEY [DELTA] [@UNIX_MS], or `-` to read protocol lines from stdin.
        #[arg(required = true, num_args = 1..=4, allow_hyphen_values = true)]
        event: Vec<String>,
        /// Do not wait for the commit (no `!flush`).
        #[arg(long, conflicts_with = "batch")]
        no_wait: bool,
        /// Send the events as one batch under this id, counted exactly once: sent again under
        /// the same id if the connection drops; prints `committed` or `duplicate` (exit 0).
        #[arg(long, value_name = "ID")]
        batch: Option<String>,
    },
    /// Set one key's total in a running daemon, exactly: events it accepted before are
    /// superseded, later ones are added (docs/protocol.md, "Corrections").
    Set {
        counter: String,
        key: String,
        #[arg(allow_hyphen_values = true)]
        value: String,
        /// Windowed counters: the window holding this time (as `tallyd get --window`).
        #[arg(long)]
        window: Option<String>,
    },
    /// Forget one key in a running daemon: every row of it, in every window, is deleted, and
    /// no replay brings it back. `tallyd forget --everywhere KEY` forgets it in every counter.
    Forget {
        /// COUNTER KEY, or KEY with --everywhere.
        #[arg(required = true, num_args = 1..=2)]
        args: Vec<String>,
        #[arg(long)]
        everywhere: bool,
    },
    /// Print the exact total, first_seen and last_seen of one key; for a windowed counter, its
    /// windows (the last few, one, or a range) and its all-time total if it keeps one.
    Get {
        counter: String,
        key: String,
        /// Windowed counters: how many of the latest windows to show.
        #[arg(long, default_value_t = 7)]
        last: u32,
        /// Windowed counters: the window holding this time (a local date `2026-11-25`, a local
        /// date and time `2026-11-25T14:00` in the counter's time_zone, or an RFC 3339 instant).
        #[arg(long, conflicts_with_all = ["from", "to"])]
        window: Option<String>,
        /// Windowed counters: the windows from the one holding this time (same forms as
        /// --window)...
        #[arg(long)]
        from: Option<String>,
        /// ...to the one holding this time, both included.
        #[arg(long)]
        to: Option<String>,
    },
    /// Apply database migrations and exit.
    Migrate,
    /// Validate the configuration and exit.
    CheckConfig,
    /// Tell the tallyd running on this config's data_dir to reload its config file (SIGHUP),
    /// and wait for its verdict.
    ///
    /// The file is validated here first, with the same checks as `check-config`. Prints what the
    /// daemon changed; exits 1, naming each key it refused and why, when it kept its running
    /// configuration (a key that needs a restart, a rollup_into table that does not exist).
    Reload {
        /// Seconds to wait for the daemon's verdict (it applies a reload once it is ready).
        #[arg(long, default_value_t = 60)]
        timeout: u64,
    },
    /// Fold slot rows into tallyd.rollups (for cron or a systemd timer).
    Rollup {
        /// Repeat until nothing is left to fold.
        #[arg(long)]
        until_empty: bool,
        /// Slot rows per step; default from [rollup] batch_rows.
        #[arg(long)]
        batch_rows: Option<i32>,
    },
    /// Show what a running daemon is doing: pending keys and events per counter, the hottest
    /// keys, each database's state and flush lag, the rollup backlog, the journal, memory and
    /// connections (read from /status on metrics.listen).
    Status {
        /// Print the raw JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Move logical shards to the databases the map names (while no daemon runs; see
    /// docs/scaling.md). `[database] move_shards = true` makes `tallyd run` do the same at start.
    MoveShards,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match dispatch(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("tallyd: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn dispatch(cli: Cli) -> Result<ExitCode> {
    let config =
        Config::load(&cli.config).with_context(|| format!("loading {}", cli.config.display()))?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    match cli.command {
        Command::Run => {
            let logging = tallyd::logging::Logging::init(&config.log)?;
            runtime.block_on(cli::run::run(config, cli.config, logging))?;
        }
        Command::Reload { timeout } => {
            let timeout = std::time::Duration::from_secs(timeout);
            cli::admin::reload(&cli.config, &config, timeout)?
        }
        Command::CheckConfig => cli::admin::check_config(&cli.config, &config)?,
        Command::Send {
            event,
            no_wait,
            batch: None,
        } => return runtime.block_on(cli::send::send(&config, event, no_wait)),
        Command::Send {
            event,
            batch: Some(id),
            ..
        } => return runtime.block_on(cli::send::send_batch(&config, &id, event)),
        Command::Set {
            counter,
            key,
            value,
            window,
        } => {
            let line = cli::correct::set_line(&config, &counter, &key, &value, window.as_deref())?;
            runtime.block_on(cli::correct::correct(&config, &line))?
        }
        Command::Forget { args, everywhere } => {
            let line = match (everywhere, &args[..]) {
                (true, [key]) => format!("!forget * {key}"),
                (false, [counter, key]) => format!("!forget {counter} {key}"),
                (true, _) => anyhow::bail!("tallyd forget --everywhere takes one KEY"),
                (false, _) => {
                    anyhow::bail!("tallyd forget takes COUNTER KEY (or --everywhere KEY)")
                }
            };
            runtime.block_on(cli::correct::correct(&config, &line))?
        }
        Command::Get {
            counter,
            key,
            last,
            window,
            from,
            to,
        } => {
            let windows = cli::get::Windows {
                last,
                from: window.clone().or(from),
                to: window.or(to),
            };
            runtime.block_on(cli::get::get(&config, &counter, &key, &windows))?
        }
        Command::Status { json } => runtime.block_on(cli::status::show_status(&config, json))?,
        Command::MoveShards => runtime.block_on(cli::admin::move_shards(config))?,
        Command::Migrate => runtime.block_on(cli::admin::migrate(&config))?,
        Command::Rollup {
            until_empty,
            batch_rows,
        } => runtime.block_on(cli::admin::rollup(&config, until_empty, batch_rows))?,
    }
    Ok(ExitCode::SUCCESS)
}
