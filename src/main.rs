//! The `tallyd` command: parses the command line, loads config, sets up logging and calls into
//! the library.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio_postgres::types::Type;
use tokio_util::sync::CancellationToken;
use tracing::info;

use tallyd::config::{Config, DatabaseConfig};
use tallyd::daemon;
use tallyd::instance::lock_data_dir;
use tallyd::listener::Listeners;
use tallyd::protocol::{self, Line};
use tallyd::service::{self, Activated};
use tallyd::status::Reporter;
use tallyd::store::{Databases, DbError};
use tallyd::{rollup, store};

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
        #[arg(long)]
        no_wait: bool,
    },
    /// Print the exact total, first_seen and last_seen of one key.
    Get { counter: String, key: String },
    /// Apply database migrations and exit.
    Migrate,
    /// Validate the configuration and exit.
    CheckConfig,
    /// Tell the tallyd running on this config's data_dir to reload its config file (SIGHUP).
    ///
    /// The file is validated here first, with the same checks as `check-config`; the daemon's
    /// log and `tallyd_config_reloads_total` say whether it applied the reload.
    Reload,
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
            runtime.block_on(run(config, cli.config, logging))?;
        }
        Command::Reload => {
            tallyd::reload::check(&cli.config)?;
            let pid = tallyd::instance::signal_reload(&config.daemon.data_dir)?;
            println!(
                "{}: ok ({} counters); sent SIGHUP to tallyd (pid {pid}): its log and \
                 tallyd_config_reloads_total say whether the reload was applied",
                cli.config.display(),
                config.counters.len()
            );
        }
        Command::CheckConfig => {
            // The daemon's reload runs the same check; nothing is connected to here.
            tallyd::reload::check(&cli.config)?;
            println!(
                "{}: ok ({} counters)",
                cli.config.display(),
                config.counters.len()
            );
        }
        Command::Send { event, no_wait } => return runtime.block_on(send(&config, event, no_wait)),
        Command::Get { counter, key } => runtime.block_on(get(&config, &counter, &key))?,
        Command::Status { json } => runtime.block_on(show_status(&config, json))?,
        Command::MoveShards => runtime.block_on(move_shards(config))?,
        Command::Migrate => runtime.block_on(async {
            let dbs = Databases::connect_only(&config)?;
            store::migrate(&dbs, &config).await?;
            store::check_map(&dbs, &config.layout()).await?;
            println!("migrations applied");
            anyhow::Ok(())
        })?,
        Command::Rollup {
            until_empty,
            batch_rows,
        } => runtime.block_on(async {
            let batch = batch_rows.unwrap_or(config.rollup.batch_rows);
            let mut folded = 0;
            let mut held = Vec::new();
            for db in Databases::connect_only(&config)?.iter() {
                // The error names the database (hosts, port, dbname, user) itself.
                let client = db.connect().await?;
                folded += if until_empty {
                    rollup::until_empty(&client, batch).await?
                } else {
                    rollup::step(&client, batch).await?
                };
                held.extend(rollup::overflowed(&client, 20).await?);
            }
            println!("folded {folded} slot rows");
            // Not an error: the other keys folded, and these stay exact in tallyd.totals.
            for h in &held {
                println!(
                    "held back {} {:?}: its total ({}) would leave the 64-bit range; \
                     its slot rows stay in tallyd.slots",
                    h.counter,
                    h.key,
                    h.total_text()
                );
            }
            anyhow::Ok(())
        })?,
    }
    Ok(ExitCode::SUCCESS)
}

async fn run(config: Config, path: PathBuf, logging: tallyd::logging::Logging) -> Result<()> {
    let config = Arc::new(config);
    // The handlers first, before the pid file names this process: SIGHUP's default action ends
    // the process, and `tallyd reload` sends it as soon as the pid file is there.
    let signals = Signals::install()?;
    // The data_dir lock first: a second tallyd on the same data_dir is told so, before it
    // touches the metrics port, the sockets or the database.
    let lock = lock_data_dir(&config.daemon.data_dir)?;
    let _pid = tallyd::instance::write_pid(&lock, &config.daemon.data_dir)?;
    let reporter = Reporter::new(
        config.database.databases().len(),
        config.metrics.status_top_keys,
    );
    if let Some(listen) = config.metrics.listen() {
        tallyd::http::install(listen, reporter.clone())?;
        let names: Vec<String> = config.counters.iter().map(|c| c.name.clone()).collect();
        tallyd::metrics::register_known(&names, config.database.databases().len());
        info!(
            listen,
            "HTTP endpoints up (/metrics, /healthz, /readyz, /status)"
        );
    }
    // Then the sockets: a tallyd with another data_dir on the same sockets fails here, before
    // touching the database.
    // Under systemd's tallyd.socket, the sockets are systemd's: taken, not bound.
    let mut activated = Activated::take()?;
    let mut listeners = Listeners::bind_or_adopt(
        config.listen.socket(),
        config.listen.datagram_socket(),
        config.listen.mode(),
        &mut activated,
    )?;
    listeners.statsd =
        tallyd::statsd::Bound::bind_or_adopt(&config, config.listen.mode(), &mut activated)?;
    activated.finish();
    // Before the private PostgreSQL starts: a signal meanwhile stops it cleanly too.
    let shutdown = CancellationToken::new();
    let (reload_tx, requests) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(on_signal(signals, shutdown.clone(), reload_tx));
    let reloads = tallyd::reload::Requests {
        path,
        requests,
        logging: Some(logging),
    };
    let opened = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || Databases::open(&config)).await??
    };
    let supervision = daemon::Supervision {
        reporter,
        reloads: Some(reloads),
    };
    let dbs = opened.dbs().to_vec();
    let result = daemon::run_supervised(config, listeners, dbs, shutdown, supervision).await;
    tokio::task::spawn_blocking(move || opened.stop()).await?;
    Ok(result?)
}

/// The signals tallyd handles, installed (so their default actions no longer apply) before
/// anything names this process to others.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        let install =
            |kind, name| signal(kind).with_context(|| format!("cannot install the {name} handler"));
        Ok(Signals {
            term: install(SignalKind::terminate(), "SIGTERM")?,
            int: install(SignalKind::interrupt(), "SIGINT")?,
            hup: install(SignalKind::hangup(), "SIGHUP")?,
        })
    }
}

/// SIGTERM and SIGINT stop tallyd; SIGHUP asks for a reload (applied once tallyd is ready:
/// requests wait in `reload` until then).
async fn on_signal(
    signals: Signals,
    shutdown: CancellationToken,
    reload: tokio::sync::mpsc::UnboundedSender<()>,
) {
    let Signals {
        mut term,
        mut int,
        mut hup,
    } = signals;
    loop {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM: stopping"),
            _ = int.recv() => info!("SIGINT: stopping"),
            _ = hup.recv() => {
                info!("SIGHUP: reloading the configuration");
                let _ = reload.send(());
                continue;
            }
        }
        break;
    }
    service::stopping();
    shutdown.cancel();
}

async fn send(config: &Config, event: Vec<String>, no_wait: bool) -> Result<ExitCode> {
    let Some(socket) = config.listen.socket() else {
        bail!("tallyd send needs the stream socket, and listen.socket is off in this config");
    };
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .with_context(|| format!("connecting to {} (is tallyd running?)", socket.display()))?;
    let (rd, mut wr) = stream.into_split();
    // Replies are read while lines are still being written: with `!errors`, every rejected
    // line is answered, and a daemon whose replies are not read stops reading the connection.
    let replies = (!no_wait).then(|| tokio::spawn(read_send_replies(rd)));
    if !no_wait {
        wr.write_all(b"!errors\n").await?;
    }
    if event.len() == 1 && event[0] == "-" {
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            let line = line.context("reading stdin")?;
            wr.write_all(line.as_bytes()).await?;
            wr.write_all(b"\n").await?;
        }
    } else {
        wr.write_all(format!("{}\n", event.join(" ")).as_bytes())
            .await?;
    }
    let Some(replies) = replies else {
        wr.shutdown().await?;
        return Ok(ExitCode::SUCCESS);
    };
    wr.write_all(b"!flush\n").await?;
    let (accepted, rejected) = replies.await??;
    println!("accepted {accepted}, rejected {rejected}");
    std::io::stdout().flush()?;
    Ok(if rejected == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}

/// Reads the replies to `tallyd send`'s `!errors` and `!flush`, printing each rejected line to
/// stderr, and returns the `!flush` counts.
async fn read_send_replies(rd: tokio::net::unix::OwnedReadHalf) -> Result<(u64, u64)> {
    let mut rd = BufReader::new(rd);
    let mut reply = String::new();
    loop {
        reply.clear();
        if rd.read_line(&mut reply).await? == 0 {
            bail!("tallyd closed the connection before answering");
        }
        let fields: Vec<&str> = reply.trim_end().splitn(4, ' ').collect();
        match fields[..] {
            ["ok"] => {}
            ["ok", accepted, rejected] => {
                let count = |s: &str| s.parse::<u64>().ok();
                if let (Some(a), Some(r)) = (count(accepted), count(rejected)) {
                    return Ok((a, r));
                }
                bail!("unexpected reply from tallyd: {:?}", reply.trim_end());
            }
            // The numbers count the connection's lines, `!errors` first: one more than stdin's.
            ["rejected", line, reason, text] => match line.parse::<u64>() {
                Ok(n) => eprintln!("rejected {}: {reason} {text}", n.saturating_sub(1)),
                Err(_) if text == "\"\"" => eprintln!("rejected: {reason}"),
                Err(_) => eprintln!("rejected: {reason} {text}"),
            },
            _ => bail!("unexpected reply from tallyd: {:?}", reply.trim_end()),
        }
    }
}

/// `tallyd status`: GETs /status from the running daemon's metrics.listen.
async fn show_status(config: &Config, json: bool) -> Result<()> {
    let Some(listen) = config.metrics.listen() else {
        bail!("metrics.listen is empty: the status endpoint is off (set it to use tallyd status)");
    };
    let (code, body) = tallyd::http::get(listen, "/status").await?;
    if code != 200 {
        bail!(
            "GET http://{listen}/status answered {code}: {}",
            body.trim_end()
        );
    }
    if json {
        print!("{body}");
        return Ok(());
    }
    let status: tallyd::status::Status = serde_json::from_str(&body)
        .with_context(|| format!("reading the answer of http://{listen}/status"))?;
    print!("{}", status.table());
    Ok(())
}

async fn move_shards(config: Config) -> Result<()> {
    // A running daemon would go on writing the shards by the old map.
    let _lock =
        lock_data_dir(&config.daemon.data_dir).context("stop tallyd before moving shards")?;
    let config = Arc::new(config);
    let opened = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || Databases::open(&config)).await??
    };
    let result = async {
        store::migrate(opened.dbs(), &config).await?;
        anyhow::Ok(store::moves::settle(opened.dbs(), &config.layout()).await?)
    }
    .await;
    tokio::task::spawn_blocking(move || opened.stop()).await?;
    let moved = result?;
    println!("moved {} logical shards", moved.len());
    Ok(())
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

async fn get(config: &Config, counter: &str, key: &str) -> Result<()> {
    let (counters, limits) = config.protocol();
    let line = format!("{counter} {key}");
    let key = match protocol::parse_line(line.as_bytes(), &counters, &limits) {
        Ok(Line::Event(ev)) => ev.key.as_str().to_string(),
        Ok(_) => bail!("expected a counter and a key"),
        Err(reason) => bail!("{reason}"),
    };
    // The key's logical shard picks its database.
    let hash = tallyd::routing::key_hash(tallyd::routing::counter_seed(counter), key.as_bytes());
    let index = config.layout().database(hash);
    let db = Databases::connect_only(config)?.swap_remove(index);
    let embedded = config.database.databases()[index] == DatabaseConfig::EMBEDDED;
    let client = match db.connect().await {
        Ok(client) => client,
        // The private cluster runs only while tallyd does.
        Err(err) if embedded => {
            return Err(err).context(format!(
                "database {index} is \"embedded\": its PostgreSQL runs only while tallyd runs"
            ))
        }
        Err(err) => return Err(err.into()),
    };
    const TS: &str = "'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'";
    let declared = config.counters.iter().find(|c| c.name == counter);
    if let Some(into) = declared.and_then(|c| c.rollup_into.as_ref()) {
        // Folded counts live in the application's column; the rest is still in slots.
        let key_type: String = client
            .query_typed_one(
                "SELECT format_type(atttypid, atttypmod) FROM pg_attribute \
                 WHERE attrelid = to_regclass($1) AND attname = $2",
                &[(&into.table, Type::TEXT), (&into.key_column, Type::NAME)],
            )
            .await
            .map_err(DbError::from)
            .with_context(|| format!("looking up {}.{}", into.table, into.key_column))?
            .get(0);
        let sql = format!(
            "SELECT (coalesce((SELECT {col}::numeric FROM {table} \
                     WHERE {keycol} = $2::text::{key_type}), 0) \
                  + coalesce((SELECT sum(count) FROM tallyd.slots \
                     WHERE counter = $1 AND key = $2), 0))::text",
            col = quote_ident(&into.column),
            keycol = quote_ident(&into.key_column),
            table = into
                .table
                .split('.')
                .map(quote_ident)
                .collect::<Vec<_>>()
                .join("."),
        );
        let count: String = client
            .query_typed_one(&sql, &[(&counter, Type::TEXT), (&key, Type::TEXT)])
            .await
            .map_err(DbError::from)?
            .get(0);
        println!(
            "{counter} {key} count={count} (column {}.{} plus unfolded slots)",
            into.table, into.column
        );
        return Ok(());
    }
    let row = client
        .query_typed_opt(
            &format!(
                // exact_count: `count` is NULL for a total beyond the 64-bit range.
                "SELECT exact_count::text, to_char(first_seen AT TIME ZONE 'UTC', {TS}), \
                        to_char(last_seen AT TIME ZONE 'UTC', {TS}) \
                 FROM tallyd.totals WHERE counter = $1 AND key = $2"
            ),
            &[(&counter, Type::TEXT), (&key, Type::TEXT)],
        )
        .await
        .map_err(DbError::from)?;
    match row {
        Some(r) => {
            let (count, first, last): (String, String, String) = (r.get(0), r.get(1), r.get(2));
            println!("{counter} {key} count={count} first_seen={first} last_seen={last}");
        }
        None => println!("{counter} {key} count=0"),
    }
    Ok(())
}
