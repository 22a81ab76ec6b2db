//! The administrative commands: `check-config`, `reload`, `migrate`, `rollup` and
//! `move-shards`. Each connects only to what it needs, and prints what it did.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};

use crate::config::Config;
use crate::instance::lock_data_dir;
use crate::rollup;
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

/// `tallyd reload`: checks the file, then signals the daemon that holds this data_dir.
pub fn reload(path: &Path, config: &Config) -> Result<()> {
    crate::reload::check(path)?;
    let pid = crate::instance::signal_reload(&config.daemon.data_dir)?;
    println!(
        "{}: ok ({} counters); sent SIGHUP to tallyd (pid {pid}): its log and \
         tallyd_config_reloads_total say whether the reload was applied",
        path.display(),
        config.counters.len()
    );
    Ok(())
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
             be inserted ({}); their slot rows stay in tallyd.slots until the parent row exists",
            h.keys, h.counter, h.slot_rows, h.example_key, h.cause
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
