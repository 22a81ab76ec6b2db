//! Reload: SIGHUP (or `tallyd reload`) re-reads config.toml and applies what may change while
//! tallyd runs, or nothing at all. [`Reloader::apply`] is the one entry point.
//!
//! Live: counters added or removed, a counter's `slots`, `rollup_into` and `keep_windows`,
//! `flush.interval_ms`,
//! `flush.retry_initial_ms`, `flush.retry_max_ms`, the memory limits (`coalesce.max_pending_keys`,
//! `flush.max_pending_keys`), the `[rollup]` section, `listen.max_line_bytes` and
//! `listen.max_key_bytes`, `log.level` and `log.format`. Everything else (sockets, data_dir,
//! databases, journal, buckets, flush connections, ...) is refused: one log line names every
//! such key that differs, and the running configuration stays in force. So is a counter's
//! `key_type` (pending and journaled keys were canonicalised by the old type; replayed under the
//! new one they could be rejected or merged), its `window`, `time_zone` and `also` (its pending
//! and stored rows were counted in the old windows; a counter removed and added back keeps
//! them too), and its `[counters.statsd]` table (the statsd mappings are built when the
//! sockets are bound). An invalid file changes nothing.
//!
//! The counter table is built again over the running one ([`counter_table`]), compared with it
//! ([`plan`]) and swapped whole. A removed counter: what was accepted for it is flushed as usual
//! (its id stays in the table, retired, and every flush worker is nudged at once); lines naming
//! it after the reload are rejected as `unknown_counter`, exactly as if it had never been
//! declared.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::config::{counter_table, Config, Counter, CounterConfig, FlushConfig};
use crate::ingest::{Ingest, Schema};
use crate::kind::Kind;
use crate::live::Live;
use crate::logging::Logging;
use crate::shared::Shared;
use crate::socket::reload_reply;
use crate::store::Db;
use crate::window::{Span, Window};

/// The keys a reload applies; any other difference outside `[[counters]]` refuses the file.
pub const LIVE_KEYS: [&str; 12] = [
    "coalesce.max_pending_keys",
    "flush.max_pending_keys",
    "flush.interval_ms",
    "flush.retry_initial_ms",
    "flush.retry_max_ms",
    "rollup.enabled",
    "rollup.interval_ms",
    "rollup.batch_rows",
    "listen.max_line_bytes",
    "listen.max_key_bytes",
    "log.level",
    "log.format",
];

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Database(#[from] crate::store::StoreError),
}

/// The one check of a config file, for `tallyd check-config`, `tallyd reload` and the daemon's
/// reload: it loads and validates (with the `TALLYD_*` overrides), and parses every database
/// entry as the daemon would, without connecting.
pub fn check(path: &Path) -> Result<Config, CheckError> {
    let config = Config::load(path)?;
    crate::store::Databases::check(&config)?;
    Ok(config)
}

/// Where reload requests come from (the binary: SIGHUP) and what they re-read.
pub struct Requests {
    /// The config file, re-read (with the same `TALLYD_*` overrides) at every request.
    pub path: PathBuf,
    pub requests: mpsc::UnboundedReceiver<()>,
    /// The process's logger, when the binary installed one (tests run without).
    pub logging: Option<Logging>,
}

/// What became of one reload.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Applied; what changed (empty: the file says what is running already).
    Applied(Vec<String>),
    /// The file does not load or validate, or a database refuses a `rollup_into` target.
    Invalid(String),
    /// Keys that cannot change while running.
    Refused(Vec<String>),
}

impl Outcome {
    /// The `result` label of `tallyd_config_reloads_total`.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Applied(_) => "ok",
            Outcome::Invalid(_) => "invalid",
            Outcome::Refused(_) => "refused",
        }
    }
}

/// What applying a file does: the new counter table and a line per change.
#[derive(Debug)]
pub struct Plan {
    pub table: Vec<Counter>,
    pub changes: Vec<String>,
}

/// Compares the running `old` config and its counter table `running` with `new` and the table
/// built from it over `running` (`table`, by [`counter_table`]): the plan, or every key that
/// cannot change live. Pure, so the rules are unit-tested.
pub fn plan(
    old: &Config,
    running: &[Counter],
    new: &Config,
    table: Vec<Counter>,
) -> Result<Plan, Vec<String>> {
    let mut refused = refused_section_keys(old, new);
    let mut changes = changed_live_keys(old, new);
    let was = |name: &str| old.counters.iter().find(|c| c.name == name);
    // The hll extension is checked at start, and only when a unique counter is declared.
    let has_unique = running.iter().any(|e| e.kind == Kind::Unique);
    for c in &new.counters {
        let key = |k: &str| format!("counters.{}.{k}", c.name);
        if was(&c.name).map(|o| &o.statsd) != Some(&c.statsd)
            && (was(&c.name).is_some() || c.statsd.is_some())
        {
            refused.push(key("statsd"));
        }
        let id = (table.iter().position(|e| e.name == c.name))
            .expect("the new table holds every declared counter");
        let now = &table[id];
        match running.get(id) {
            Some(e) if fixed_keys(e, now).next().is_some() => {
                refused.extend(fixed_keys(e, now).map(key));
            }
            Some(e) => {
                if !e.live {
                    changes.push(format!("counter {} added back", c.name));
                }
                if e.slots != now.slots {
                    changes.push(format!("{}: {} -> {}", key("slots"), e.slots, now.slots));
                }
                if e.keep_windows != now.keep_windows {
                    let shown = |n: Option<u32>| n.map_or("all".to_string(), |n| n.to_string());
                    changes.push(format!(
                        "{}: {} -> {}",
                        key("keep_windows"),
                        shown(e.keep_windows),
                        shown(now.keep_windows)
                    ));
                }
            }
            None if now.kind == Kind::Unique && !has_unique => {
                refused.push(key("kind"));
            }
            None => changes.push(format!("counter {} added", c.name)),
        }
        if was(&c.name).is_some_and(|o| o.rollup_into != c.rollup_into) {
            changes.push(key("rollup_into"));
        }
    }
    for o in &old.counters {
        if !new.counters.iter().any(|c| c.name == o.name) {
            if o.statsd.is_some() {
                refused.push(format!("counters.{}.statsd", o.name));
            }
            changes.push(format!("counter {} removed", o.name));
        }
    }
    if !refused.is_empty() {
        refused.sort();
        refused.dedup();
        return Err(refused);
    }
    Ok(Plan { table, changes })
}

/// The keys of a counter that differ between `was` and `now` and cannot change while tallyd
/// runs: `key_type` (pending and journaled keys were canonicalised by the old type), `kind`
/// and the sketch parameters (`log2m/regwidth`), and `window`, `time_zone` and `also` (pending
/// and stored rows were counted in the old windows).
fn fixed_keys<'a>(was: &'a Counter, now: &'a Counter) -> impl Iterator<Item = &'static str> + 'a {
    // `also` as declared: its coarser spans, and whether it lists `all`.
    let also = |c: &Counter| {
        let spans: Vec<Span> = c.also.iter().map(Window::span).collect();
        (spans, c.window.is_some() && c.all_time)
    };
    [
        ("key_type", was.key_type != now.key_type),
        ("kind", was.kind != now.kind),
        (
            "log2m/regwidth",
            was.kind == now.kind && was.params != now.params,
        ),
        ("window", was.span() != now.span()),
        ("time_zone", was.time_zone != now.time_zone),
        ("also", also(was) != also(now)),
    ]
    .into_iter()
    .filter_map(|(key, changed)| changed.then_some(key))
}

/// Every `section.key` outside `[[counters]]` whose value differs, as the file spells them.
fn differing_keys(old: &Config, new: &Config) -> Vec<String> {
    let as_table = |c: &Config| match toml::Value::try_from(c) {
        Ok(toml::Value::Table(t)) => t,
        _ => toml::Table::new(),
    };
    let (old, new) = (as_table(old), as_table(new));
    let mut keys = Vec::new();
    for (section, value) in new.iter().filter(|(s, _)| *s != "counters") {
        let (Some(a), Some(b)) = (
            old.get(section).and_then(|v| v.as_table()),
            value.as_table(),
        ) else {
            continue;
        };
        for key in a.keys().chain(b.keys().filter(|k| !a.contains_key(*k))) {
            if a.get(key) != b.get(key) {
                keys.push(format!("{section}.{key}"));
            }
        }
    }
    keys
}

fn refused_section_keys(old: &Config, new: &Config) -> Vec<String> {
    differing_keys(old, new)
        .into_iter()
        .filter(|k| !LIVE_KEYS.contains(&k.as_str()))
        .collect()
}

fn changed_live_keys(old: &Config, new: &Config) -> Vec<String> {
    differing_keys(old, new)
        .into_iter()
        .filter(|k| LIVE_KEYS.contains(&k.as_str()))
        .collect()
}

/// The running parts a reload changes.
pub struct Target {
    pub ingest: Arc<Ingest>,
    pub shared: Arc<Shared>,
    pub flush_config: Arc<Live<FlushConfig>>,
    /// The counter table in force (the flush workers and the status view read it; the ingest
    /// schema holds the same one).
    pub counters: Arc<Live<Vec<Counter>>>,
    pub dbs: Vec<Db>,
    /// The rollup tasks run on `rollups` until `rollup_stop`; a reload restarts them.
    pub rollups: TaskTracker,
    pub background: CancellationToken,
    pub rollup_stop: CancellationToken,
    /// The rollups a reload restarts report their state here.
    pub health: Arc<crate::health::Health>,
    pub logging: Option<Logging>,
}

/// Holds the running configuration and applies reloads to it.
pub struct Reloader {
    path: PathBuf,
    current: Arc<Config>,
    target: Target,
}

impl Reloader {
    pub fn new(path: PathBuf, current: Arc<Config>, target: Target) -> Reloader {
        crate::metrics::config_reloaded(None);
        Reloader {
            path,
            current,
            target,
        }
    }

    /// The configuration in force.
    pub fn current(&self) -> &Config {
        &self.current
    }

    /// Re-reads the file and applies it whole, or nothing; logs and counts the outcome.
    pub async fn apply(&mut self) -> Outcome {
        // Under systemd (Type=notify-reload, or `systemctl reload` with ExecReload): reloading
        // until READY=1 again.
        crate::service::reloading();
        let outcome = self.reload().await;
        match &outcome {
            Outcome::Applied(changes) if changes.is_empty() => {
                info!(path = %self.path.display(), "configuration reloaded: nothing changed")
            }
            Outcome::Applied(changes) => info!(
                path = %self.path.display(),
                changes = %changes.join(", "),
                "configuration reloaded"
            ),
            Outcome::Invalid(cause) => error!(
                path = %self.path.display(),
                %cause,
                "configuration not reloaded: the file is invalid; the running configuration stays in force"
            ),
            Outcome::Refused(keys) => error!(
                path = %self.path.display(),
                keys = %keys.join(", "),
                why = %self.refusals(keys).join("; "),
                "configuration not reloaded: these keys cannot change while tallyd runs (restart to \
                 change them); the running configuration stays in force"
            ),
        }
        // Counted after the log line: whoever sees the count (a test, an alert) finds the reason
        // already logged.
        crate::metrics::config_reloaded(Some(outcome.label()));
        // Whatever the outcome: the configuration in force (old or new) is serving.
        crate::service::ready();
        outcome
    }

    async fn reload(&mut self) -> Outcome {
        // The same check as `tallyd check-config` and `tallyd reload`.
        let new = match check(&self.path) {
            Ok(config) => config,
            Err(err) => return Outcome::Invalid(err.to_string()),
        };
        let running = self.target.counters.get();
        // The table built as at the start, over the running one: each counter keeps its id.
        let table = match counter_table(&running, &new.counters) {
            Ok(table) => table,
            Err(err) => return Outcome::Invalid(err.to_string()),
        };
        let plan = match plan(&self.current, &running, &new, table) {
            Ok(plan) => plan,
            Err(keys) => return Outcome::Refused(keys),
        };
        // The only step that can fail after validation, so it goes first: nothing is applied
        // if a database refuses a target.
        if targets_changed(&self.current.counters, &new.counters) {
            if let Err(err) = self.sync_targets(&new.counters).await {
                return Outcome::Invalid(err);
            }
        }
        if let Some(logging) = &self.target.logging {
            if let Err(err) = logging.apply(&new.log) {
                // Validation parsed the filter already; keep going with the old logger.
                warn!(cause = %err, "log settings not changed");
            }
        }
        self.swap(plan.table, running.len(), &new);
        self.current = Arc::new(new);
        Outcome::Applied(plan.changes)
    }

    /// Records the `rollup_into` targets in every database (checked there: table and columns).
    async fn sync_targets(&self, counters: &[CounterConfig]) -> Result<(), String> {
        for (index, db) in self.target.dbs.iter().enumerate() {
            let mut client = db.connect().await.map_err(|e| e.to_string())?;
            crate::store::sync_rollup_targets(&mut client, counters)
                .await
                .map_err(|e| format!("database {index}: {e}"))?;
        }
        Ok(())
    }

    /// Puts `new` and its counter `table` in force (the counters from `running` on are new).
    /// The flush side learns new counters before any line can name them.
    fn swap(&mut self, table: Vec<Counter>, running: usize, new: &Config) {
        let t = &self.target;
        let table = Arc::new(table);
        t.counters.set_shared(table.clone());
        t.flush_config.set(new.flush.clone());
        t.shared
            .set_limits(new.flush.max_pending_keys, new.coalesce.max_pending_keys);
        t.ingest
            .set_schema(Schema::new(table.clone(), new.limits()));
        let added: Vec<String> = table[running..].iter().map(|e| e.name.clone()).collect();
        crate::metrics::register_counters(&added, t.dbs.len());
        if table.iter().any(|e| !e.live) {
            // What was accepted for a removed counter is written now rather than at the next tick.
            t.shared.nudge_all();
        }
        if self.current.rollup != new.rollup || self.current.counters != new.counters {
            self.restart_rollups(new);
        }
    }

    fn restart_rollups(&mut self, new: &Config) {
        self.target.rollup_stop.cancel();
        self.target.rollup_stop = self.target.background.child_token();
        crate::rollup::spawn_all(
            new,
            &self.target.dbs,
            &self.target.rollup_stop,
            &self.target.rollups,
            &self.target.health,
        );
    }

    /// Each refused key with why it cannot change while tallyd runs.
    fn refusals(&self, keys: &[String]) -> Vec<String> {
        let running = self.target.counters.get();
        keys.iter()
            .map(|key| format!("{key}: {}", why_refused(key, &running)))
            .collect()
    }

    /// What `tallyd reload` prints (or fails with) for `outcome`.
    fn verdict(&self, started_ms: i64, outcome: &Outcome) -> reload_reply::Verdict {
        let (applied, text) = match outcome {
            Outcome::Applied(changes) if changes.is_empty() => (true, "nothing changed".into()),
            Outcome::Applied(changes) => (true, changes.join(", ")),
            Outcome::Invalid(cause) => (
                false,
                format!("the file is invalid, nothing changed: {cause}"),
            ),
            Outcome::Refused(keys) => (
                false,
                format!(
                    "nothing changed: restart tallyd to change these keys (the running \
                     configuration stays in force)\n  {}",
                    self.refusals(keys).join("\n  ")
                ),
            ),
        };
        reload_reply::Verdict {
            started_ms,
            applied,
            text,
        }
    }

    /// Serves `requests` until `stop`; one reload at a time, in order. Each verdict goes to the
    /// `tallyd reload` commands waiting for one.
    pub async fn serve(
        mut self,
        mut requests: mpsc::UnboundedReceiver<()>,
        stop: CancellationToken,
    ) {
        loop {
            tokio::select! {
                request = requests.recv() => {
                    if request.is_none() {
                        return;
                    }
                    let started_ms = crate::clock::now_ms();
                    let outcome = self.apply().await;
                    let verdict = self.verdict(started_ms, &outcome);
                    reload_reply::announce(&self.current.daemon.data_dir, &verdict);
                }
                _ = stop.cancelled() => return,
            }
        }
    }
}

/// Why `key` (as [`plan`] names it) cannot change while tallyd runs; `table` is the running
/// counter table, which tells a counter being added from one that runs.
fn why_refused(key: &str, table: &[Counter]) -> &'static str {
    let Some((counter, field)) = key
        .strip_prefix("counters.")
        .and_then(|k| k.rsplit_once('.'))
    else {
        return match key.split('.').next().unwrap_or_default() {
            "listen" | "statsd" => "the sockets are bound at start",
            "metrics" => "the HTTP endpoints are bound at start",
            "daemon" => "the data_dir, its lock and the instance lease are taken at start",
            "database" => "the databases are opened and prepared at start",
            "journal" => "the journal is opened, and replayed, at start",
            "batch" => "the batch claim tasks and the open batches' limit are set at start",
            "coalesce" | "flush" => {
                "the buckets and flush connections are laid out at start (the journal records \
                 the layout)"
            }
            _ => "it is read only at start",
        };
    };
    let runs = table.iter().any(|e| e.name == counter);
    match field {
        "kind" if !runs => {
            "the first unique counter needs a restart: tallyd checks (or creates) the hll \
             extension in every database at start"
        }
        "kind" => "its pending and stored values are of its old kind",
        "log2m/regwidth" => "sketches of other parameters cannot be unioned with its own",
        "key_type" => "its pending and journaled keys were canonicalised by the old key type",
        "window" | "time_zone" | "also" => {
            "its pending and stored rows were counted in the old windows (declare a new counter \
             instead)"
        }
        "statsd" => "the statsd mappings are built when the sockets are bound",
        _ => "it is read only at start",
    }
}

/// Whether the `rollup_into` targets recorded in the databases must change.
fn targets_changed(old: &[CounterConfig], new: &[CounterConfig]) -> bool {
    let targets = |cs: &[CounterConfig]| {
        let mut t: Vec<_> = cs
            .iter()
            .filter_map(|c| Some((c.name.clone(), c.rollup_into.clone()?)))
            .collect();
        t.sort_by(|a, b| a.0.cmp(&b.0));
        t
    };
    targets(old) != targets(new)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::protocol::{Counters, KeyType};

    fn config(text: &str) -> Config {
        Config::from_toml(text, Vec::new()).unwrap()
    }

    /// The counter table of a daemon started with `config`.
    fn initial_table(config: &Config) -> Vec<Counter> {
        config.counter_table().unwrap()
    }

    /// [`super::plan`] of `new` over `running`, with the table a reload builds for it.
    fn plan(old: &Config, running: &[Counter], new: &Config) -> Result<Plan, Vec<String>> {
        let table = counter_table(running, &new.counters).unwrap();
        super::plan(old, running, new, table)
    }

    const BASE: &str =
        "[[counters]]\nname = \"a\"\n[[counters]]\nname = \"b\"\nkey_type = \"bigint\"\n";

    #[test]
    fn counters_added_and_removed_keep_their_indexes() {
        let old = config(BASE);
        let table = initial_table(&old);
        let new = config("[[counters]]\nname = \"b\"\nkey_type = \"bigint\"\nslots = 7\n[[counters]]\nname = \"c\"\n");
        let plan = plan(&old, &table, &new).unwrap();
        let names: Vec<(&str, bool, u32)> = plan
            .table
            .iter()
            .map(|e| (e.name.as_str(), e.live, e.slots))
            .collect();
        assert_eq!(names, [("a", false, 100), ("b", true, 7), ("c", true, 100)]);
        assert!(plan.changes.contains(&"counter a removed".to_string()));
        assert!(plan.changes.contains(&"counter c added".to_string()));
        // Added back later: the same index again.
        let again = self::plan(&new, &plan.table, &old).unwrap();
        assert_eq!(again.table.len(), 3);
        assert!(again.table[0].live);
    }

    #[test]
    fn key_type_sockets_and_storage_are_refused_by_key() {
        let old = config(BASE);
        let table = initial_table(&old);
        let text = format!(
            "[listen]\nsocket = \"/tmp/other.sock\"\n[journal]\nfsync = \"always\"\n\
             [flush]\ninterval_ms = 5\nconnections = 4\n{}",
            BASE.replace("bigint", "text")
        );
        let refused = plan(&old, &table, &config(&text)).unwrap_err();
        assert_eq!(
            refused,
            [
                "counters.b.key_type",
                "flush.connections",
                "journal.fsync",
                "listen.socket"
            ]
        );
    }

    #[test]
    fn a_removed_counter_cannot_come_back_with_another_key_type() {
        let old = config(BASE);
        let removed = config("[[counters]]\nname = \"a\"\n");
        let p = plan(&old, &initial_table(&old), &removed).unwrap();
        let back = config("[[counters]]\nname = \"a\"\n[[counters]]\nname = \"b\"\n");
        assert_eq!(
            plan(&removed, &p.table, &back).unwrap_err(),
            ["counters.b.key_type"]
        );
    }

    const WINDOWED: &str = "[[counters]]\nname = \"a\"\nwindow = \"day\"\n\
                            time_zone = \"Europe/Berlin\"\nalso = [\"month\", \"all\"]\n";

    #[test]
    fn a_counters_windows_are_refused_and_its_retention_applied() {
        let old = config(WINDOWED);
        let table = initial_table(&old);
        for (text, refused) in [
            (WINDOWED.replace("\"day\"", "\"hour\""), "counters.a.window"),
            (
                WINDOWED.replace("Europe/Berlin", "UTC"),
                "counters.a.time_zone",
            ),
            (
                WINDOWED.replace("time_zone = \"Europe/Berlin\"\n", ""),
                "counters.a.time_zone",
            ),
            (WINDOWED.replace(", \"all\"", ""), "counters.a.also"),
            (
                "[[counters]]\nname = \"a\"\n".to_string(),
                "counters.a.window",
            ),
        ] {
            let err = plan(&old, &table, &config(&text)).unwrap_err();
            assert!(err.contains(&refused.to_string()), "{text}: {err:?}");
        }
        // Windowing an all-time counter is a change of its window too.
        let all_time = config("[[counters]]\nname = \"a\"\n");
        assert_eq!(
            plan(&all_time, &initial_table(&all_time), &old).unwrap_err(),
            [
                "counters.a.also",
                "counters.a.time_zone",
                "counters.a.window"
            ]
        );
        // The same windows listed in another order, and a new retention: applied.
        let text = WINDOWED.replace("[\"month\", \"all\"]", "[\"all\", \"month\"]")
            + "keep_windows = 30\n";
        let p = plan(&old, &table, &config(&text)).unwrap();
        assert_eq!(p.changes, ["counters.a.keep_windows: all -> 30"]);
        assert_eq!(p.table[0].keep_windows, Some(30));
        // A new windowed counter is added like any other.
        let text = format!("{WINDOWED}[[counters]]\nname = \"b\"\nwindow = \"week\"\n");
        let p = plan(&old, &table, &config(&text)).unwrap();
        assert_eq!(p.changes, ["counter b added"]);
        assert_eq!(p.table[1].span(), Some(Span::Week));
    }

    #[test]
    fn a_removed_counter_cannot_come_back_with_other_windows() {
        let old = config(WINDOWED);
        let removed = config("[[counters]]\nname = \"b\"\n");
        let p = plan(&old, &initial_table(&old), &removed).unwrap();
        let back = format!(
            "[[counters]]\nname = \"b\"\n{}",
            WINDOWED.replace("Europe/Berlin", "Asia/Kolkata")
        );
        assert_eq!(
            plan(&removed, &p.table, &config(&back)).unwrap_err(),
            ["counters.a.time_zone"]
        );
    }

    #[test]
    fn live_keys_are_changes() {
        let old = config(BASE);
        let text = format!("[flush]\ninterval_ms = 5\n[log]\nlevel = \"debug\"\nformat = \"json\"\n[rollup]\ninterval_ms = 7\n{BASE}");
        let plan = plan(&old, &initial_table(&old), &config(&text)).unwrap();
        assert_eq!(
            plan.changes,
            [
                "flush.interval_ms",
                "log.format",
                "log.level",
                "rollup.interval_ms"
            ]
        );
    }

    /// A retired counter keeps its index (pending events name it) but no line finds it, with
    /// either lookup (linear up to 8 counters, hashed beyond).
    #[test]
    fn a_retired_counter_is_not_looked_up() {
        for n in [3, 20] {
            let names: Vec<String> = (0..n).map(|i| format!("c{i}")).collect();
            let counters = Counters::with_retired(
                names
                    .iter()
                    .enumerate()
                    .map(|(i, name)| (name.as_str(), KeyType::Text, i != 1)),
            );
            assert_eq!(counters.lookup(b"c1"), None);
            assert_eq!(counters.lookup(b"c2"), Some((2, KeyType::Text)));
            assert_eq!(counters.name(1), "c1");
        }
    }
}
