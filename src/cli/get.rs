//! `tallyd get`: one key's exact total, from the database its logical shard lives in (or the
//! application's `rollup_into` column plus the slot rows not folded yet): the arguments and
//! what is printed; the reading is [`crate::store::read`]'s.

use anyhow::{bail, Context, Result};
use tokio_postgres::Client;

use crate::config::{Config, DatabaseConfig, RollupInto};
use crate::kind::Kind;
use crate::protocol::{self, Line};
use crate::routing;
use crate::store::read::{self, Range, Shown};
use crate::store::Databases;
use crate::window::Window;

/// Which windows of a windowed counter `get` shows.
#[derive(Debug, Default)]
pub struct Windows {
    /// The latest this many (when no range is given).
    pub last: u32,
    /// The windows holding `from` through `to` (either open).
    pub from: Option<String>,
    pub to: Option<String>,
}

/// Prints `counter`'s total for `key` (canonicalised by the counter's key type, as the daemon
/// does); for a windowed counter, the windows `windows` asks for, then the all-time total if
/// the counter keeps one.
pub async fn get(config: &Config, counter: &str, key: &str, windows: &Windows) -> Result<()> {
    let (counters, limits) = config.protocol();
    // A value after the key: every kind but a sum needs one to parse (`0` fits them all).
    let line = format!("{counter} {key} 0");
    let key = match protocol::parse_line(line.as_bytes(), &counters, &limits) {
        Ok(Line::Event(ev)) => ev.key.as_str().to_string(),
        Ok(_) => bail!("expected a counter and a key"),
        Err(reason) => bail!("{reason}"),
    };
    // The key's logical shard picks its database.
    let hash = routing::key_hash(routing::counter_seed(counter), key.as_bytes());
    let index = config.layout().database(hash);
    let db = Databases::connect_only(config)?.swap_remove(index);
    let embedded = config.database.databases()[index] == DatabaseConfig::EMBEDDED;
    let client = match db.connect().await {
        Ok(client) => client,
        // The private cluster runs only while tallyd does.
        Err(err) if embedded => {
            let dir = &config.daemon.data_dir;
            let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.clone());
            return Err(err).context(format!(
                "database {index} is \"embedded\": its PostgreSQL runs only while tallyd runs \
                 (on data_dir {}: is it running?)",
                dir.display()
            ));
        }
        Err(err) => return Err(err.into()),
    };
    let declared = config.counters.iter().find(|c| c.name == counter);
    let window = declared.map(|c| c.window()).transpose()?.flatten();
    let at = (counter, key.as_str());
    if let (Some(into), Some(window)) = (declared.and_then(|c| c.rollup_into.as_ref()), &window) {
        // The window's rows are folded into the application's (key, window) rows; its `also`
        // rows (the all-time total) into tallyd.rollups, read below as for any windowed counter.
        show_folded_windows(&client, at, window, into, windows).await?;
        if !declared.is_some_and(|c| c.all_time()) {
            return Ok(());
        }
        return show_total(&client, at, "all").await;
    }
    if let Some(into) = declared.and_then(|c| c.rollup_into.as_ref()) {
        // Folded counts live in the application's column; the rest is still in slots.
        let kind = declared.map_or(Kind::Sum, |c| c.kind);
        if kind != Kind::Sum {
            let value = read::folded_kind(&client, at, into, kind).await?;
            println!(
                "{counter} {key} {kind}={} (column {}.{} plus unfolded slots)",
                value.as_deref().unwrap_or("none"),
                into.table,
                into.column
            );
            return Ok(());
        }
        let count = read::folded_sum(&client, at, into).await?;
        println!(
            "{counter} {key} count={count} (column {}.{} plus unfolded slots)",
            into.table, into.column
        );
        return Ok(());
    }
    // A windowed counter: its windows, then its all-time total (if it keeps one) as `all`.
    let mut head = format!("{counter} {key}");
    if let Some(window) = &window {
        show_windows(&client, at, window, windows).await?;
        if !declared.is_some_and(|c| c.all_time()) {
            return Ok(());
        }
        head = "all".into();
    }
    show_total(&client, at, &head).await
}

/// Prints the all-time total of `key` from `tallyd.totals`, after `head`.
async fn show_total(client: &Client, at: (&str, &str), head: &str) -> Result<()> {
    match read::total(client, at.0, at.1).await? {
        Some(t) => println!(
            "{head} count={}{} first_seen={} last_seen={}",
            t.count,
            shown(&t.shown),
            t.first_seen,
            t.last_seen
        ),
        None => println!("{head} count=0"),
    }
    Ok(())
}

/// What a row of a kind other than sum shows after its count: ` max=42` (min, last), or
/// ` unique=1234` (the cardinality of the window's, or the all-time, sketch); nothing for a sum.
fn shown(shown: &Shown) -> String {
    match shown {
        Shown::Sum | Shown::Value(_, None) => String::new(),
        Shown::Value(kind, Some(v)) => format!(" {kind}={v}"),
        Shown::Unique(cardinality) => format!(" unique={cardinality}"),
    }
}

/// The window starts (Unix ms) `which` names, each end open when not given.
fn range_of(window: &Window, which: &Windows) -> Result<(Option<i64>, Option<i64>)> {
    let at = |text: &Option<String>| -> Result<Option<i64>> {
        text.as_deref()
            .map(|t| window.parse_instant(t).map(|ms| window.bounds(ms).0))
            .transpose()
            .map_err(anyhow::Error::msg)
    };
    Ok((at(&which.from)?, at(&which.to)?))
}

/// Prints the windows of `key` that `which` asks for, oldest first, one line each.
async fn show_windows(
    client: &Client,
    at: (&str, &str),
    window: &Window,
    which: &Windows,
) -> Result<()> {
    let (from, to) = range_of(window, which)?;
    let ranged = from.is_some() || to.is_some();
    let range = Range {
        from: from.unwrap_or(i64::MIN + 1),
        to: to.unwrap_or(i64::MAX),
        limit: if ranged {
            i64::MAX
        } else {
            i64::from(which.last)
        },
    };
    let rows = read::windows(client, at, window.span().name(), range).await?;
    let (counter, key) = at;
    println!(
        "{counter} {key} window={} time_zone={}",
        window.span(),
        window.zone_name()
    );
    if rows.is_empty() {
        println!("(no counts in these windows)");
    }
    for row in &rows {
        println!(
            "{} count={}{}",
            window.name_of(row.start),
            row.count,
            shown(&row.shown)
        );
    }
    Ok(())
}

/// Prints the windows of `key` of a windowed counter folded into the application's `(key,
/// window)` rows: each window is its row's column plus its slot rows not folded yet.
async fn show_folded_windows(
    client: &Client,
    at: (&str, &str),
    window: &Window,
    into: &RollupInto,
    which: &Windows,
) -> Result<()> {
    let (from, to) = range_of(window, which)?;
    let range = (from.unwrap_or(i64::MIN + 1), to.unwrap_or(i64::MAX));
    let counts = read::folded_windows(client, at, window, into, range).await?;
    let how_many = if from.is_some() || to.is_some() {
        counts.len()
    } else {
        which.last as usize
    };
    let (counter, key) = at;
    println!(
        "{counter} {key} window={} time_zone={} (column {}.{} plus unfolded slots)",
        window.span(),
        window.zone_name(),
        into.table,
        into.column
    );
    if counts.is_empty() {
        println!("(no counts in these windows)");
    }
    let skip = counts.len().saturating_sub(how_many);
    for (start, count) in counts.into_iter().skip(skip) {
        println!("{} count={count}", window.name_of(start));
    }
    Ok(())
}
