//! `tallyd run`: the daemon in this process. Takes the data_dir lock, installs the signal
//! handlers, serves the HTTP endpoints, binds (or takes systemd's) sockets, opens the databases
//! (starting the private PostgreSQL when configured) and runs the daemon until a stop signal.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::config::Config;
use crate::daemon;
use crate::instance::lock_data_dir;
use crate::listener::Listeners;
use crate::logging::Logging;
use crate::service::{self, Activated};
use crate::status::Reporter;
use crate::store::Databases;

/// Runs the daemon configured by `config` (read from `path`, which a reload reads again).
pub async fn run(config: Config, path: PathBuf, logging: Logging) -> Result<()> {
    let config = Arc::new(config);
    // The handlers first, before the pid file names this process: SIGHUP's default action ends
    // the process, and `tallyd reload` sends it as soon as the pid file is there.
    let signals = Signals::install()?;
    // First: what follows (the sockets, the databases, the stream connections' budget) has
    // the raised limit.
    crate::conns::descriptors::raise_limit();
    // The data_dir lock first: a second tallyd on the same data_dir is told so, before it
    // touches the metrics port, the sockets or the database.
    let lock = lock_data_dir(&config.daemon.data_dir)?;
    let _pid = crate::instance::write_pid(&lock, &config.daemon.data_dir)?;
    let reporter = Reporter::new(
        config.database.databases().len(),
        config.metrics.status_top_keys,
    );
    if let Some(listen) = config.metrics.listen() {
        crate::http::install(listen, reporter.clone())?;
        let names: Vec<String> = config.counters.iter().map(|c| c.name.clone()).collect();
        crate::metrics::register_known(&names, config.database.databases().len());
        // Where the journal moves damaged segments at start (journal::read, DAMAGED_DIR).
        let damaged = config.daemon.data_dir.join("journal").join("damaged");
        crate::metrics::spawn_damage_collector(damaged);
        info!(
            listen,
            "HTTP endpoints up (/metrics, /healthz, /readyz, /status)"
        );
    }
    // Then the sockets: a tallyd with another data_dir on the same sockets fails here, before
    // touching the database.
    // Under systemd's tallyd.socket, the sockets are systemd's: taken, not bound.
    let mut activated = Activated::take()?;
    let listeners = Listeners::bind_or_adopt(
        config.listen.socket(),
        config.listen.datagram_socket(),
        config.listen.mode(),
        &mut activated,
    )?;
    let statsd =
        crate::statsd::Bound::bind_or_adopt(&config, config.listen.mode(), &mut activated)?;
    activated.finish();
    // Before the private PostgreSQL starts: a signal meanwhile stops it cleanly too.
    let shutdown = CancellationToken::new();
    let (reload_tx, requests) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(on_signal(signals, shutdown.clone(), reload_tx));
    let reloads = crate::reload::Requests {
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
    let result =
        daemon::run_supervised(config, listeners, statsd, dbs, shutdown, supervision).await;
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
