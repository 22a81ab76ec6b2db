//! The administrative commands: `check-config`, `reload`, `migrate`, `rollup` and
//! `move-shards`. Each connects only to what it needs, and prints what it did.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::config::Config;
use crate::instance::lock_data_dir;
use crate::rollup;
use crate::socket::reload_reply::{WaitError, Waiter};
use crate::store::{self, Databases};

/// `tallyd check-config`: the checks a reload runs; nothing is connected to.
pub fn check_config(path: &Path, config: &Config) -> Result<()> {
    crate::reload::check(path)?;
    println!(
        "{}: ok ({} counters)",
        path.display(),
        config.counters.len()
    );
    Ok(())
}

/// `tallyd reload`: checks the file, signals the daemon that holds this data_dir and waits up
/// to `timeout` for its verdict: what it applied, or each refused key and why (an error, so the
/// command exits non-zero).
pub fn reload(path: &Path, config: &Config, timeout: Duration) -> Result<()> {
    crate::reload::check(path)?;
    let dir = &config.daemon.data_dir;
    let pid = crate::instance::running_pid(dir)?;
    // Listening before the signal: the verdict cannot come before anyone waits for it.
    let waiter = Waiter::bind(dir)?;
    let since_ms = crate::clock::now_ms();
    crate::instance::send_reload(dir, pid)?;
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    let alive = || unsafe { libc::kill(pid, 0) } == 0;
    let file = path.display();
    match waiter.wait(since_ms, timeout, alive) {
        Ok(v) if v.applied => {
            println!("{file}: reloaded by tallyd (pid {pid}): {}", v.text);
            Ok(())
        }
        Ok(v) => bail!("{file} not reloaded by tallyd (pid {pid}): {}", v.text),
        Err(WaitError::TimedOut(t)) => bail!(
            "sent SIGHUP to tallyd (pid {pid}), which gave no verdict within {} s: it applies a \
             reload once it is ready (replaying its journal, waiting for a database?), and its \
             log will say whether it did (--timeout waits longer)",
            t.as_secs()
        ),
        Err(WaitError::Ended) => {
            bail!("tallyd (pid {pid}) ended before answering the reload; see its log")
        }
        Err(err) => Err(err.into()),
    }
}

/// `tallyd migrate`: applies the migrations and checks the shard map.
pub async fn migrate(config: &Config) -> Result<()> {
    let dbs = Databases::connect_only(config)?;
    store::migrate(&dbs, config).await?;
    store::check_map(&dbs, &config.layout()).await?;
    println!("migrations applied");
    Ok(())
}

/// `tallyd rollup`: one step of `tallyd.rollup()` (or, with `until_empty`, every counter's rows
/// through one pass as the daemon steps them) in every database, then the keys the range guard
/// holds back and those a foreign key holds back.
pub async fn rollup(config: &Config, until_empty: bool, batch_rows: Option<i32>) -> Result<()> {
    let batch = batch_rows.unwrap_or(config.rollup.batch_rows);
    let mut folded = 0;
    let mut held = Vec::new();
    let mut no_parent = Vec::new();
    for db in Databases::connect_only(config)?.iter() {
        // The error names the database (hosts, port, dbname, user) itself.
        let client = db.connect().await?;
        let distributed: bool = client
            .query_typed_one("SELECT tallyd.is_distributed('tallyd.slots')", &[])
            .await?
            .get(0);
        folded += if until_empty && !distributed {
            // Every unit through one pass, with its cursor, as the daemon steps it; steps sized
            // as the daemon sizes them unless --batch-rows fixes them.
            let units = rollup::units_with_found(&client, config).await?;
            rollup::drain(&client, &units, batch_rows, config.rollup.batch_rows).await?
        } else if until_empty {
            rollup::until_empty(&client, batch).await?
        } else {
            rollup::step(&client, batch).await?
        };
        held.extend(rollup::overflowed(&client, 20).await?);
        no_parent.extend(rollup::held_back(&client).await?);
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
    for h in &no_parent {
        println!(
            "held back {} keys of {} ({} slot rows), e.g. {:?}: their rollup_into rows cannot \
             be inserted ({}); their slot rows stay in tallyd.slots until the parent row exists \
             (the oldest held for {} s; `tallyd forget {} KEY` drops a key whose parent was \
             deleted)",
            h.keys,
            h.counter,
            h.slot_rows,
            h.example_key,
            h.cause,
            h.held_for.as_secs(),
            h.counter
        );
    }
    Ok(())
}

/// `tallyd move-shards`: moves logical shards to the databases the map names, while no daemon
/// runs on this data_dir.
pub async fn move_shards(config: Config) -> Result<()> {
    // A running daemon would go on writing the shards by the old map.
    let _lock =
        lock_data_dir(&config.daemon.data_dir).context("stop tallyd before moving shards")?;
    let config = Arc::new(config);
    let opened = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || Databases::open(&config)).await??
    };
    let instance_id = crate::instance::instance_id(&config)?;
    let result = async {
        store::migrate(opened.dbs(), &config).await?;
        let layout = config.layout();
        anyhow::Ok(store::moves::settle(opened.dbs(), &layout, &instance_id).await?)
    }
    .await;
    tokio::task::spawn_blocking(move || opened.stop()).await?;
    let settled = result?;
    println!("moved {} logical shards", settled.moves.len());
    Ok(())
}
