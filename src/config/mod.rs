//! Configuration: the serde model of config.toml, `TALLYD_<SECTION>_<KEY>` overrides, and validation.
//! This file holds `Config`, loading and the top-level `validate`; each section lives in its own
//! file (named after it) with its defaults, its typed accessors and its own `validate`; the
//! counter model the running daemon reads, built from `[[counters]]`, in `counter.rs`.
//!
//! Every key has a default, so an empty file is a valid config. Unknown keys are an error, so a typo
//! never silently falls back to a default. `Serialize` writes the same format back (the test kit
//! builds a `Config` value and writes it as config.toml).

use std::path::Path;

use serde::{Deserialize, Serialize};

mod batch;
mod coalesce;
mod counter;
mod counters;
mod daemon;
mod database;
mod flush;
mod journal;
mod listen;
mod log;
mod metrics;
mod rollup;
mod statsd;

pub use batch::BatchConfig;
pub use coalesce::CoalesceConfig;
pub use counter::{counter_table, Counter};
pub use counters::{
    Also, Constant, CounterConfig, CounterStatsd, KeyTypeName, RollupInto, Sampled,
};
pub use daemon::DaemonConfig;
pub use database::DatabaseConfig;
pub use flush::FlushConfig;
pub use journal::{FsyncMode, JournalConfig, DEFAULT_JOURNAL_MAX_BYTES};
pub use listen::ListenConfig;
pub use log::{LogConfig, LogFormat};
pub use metrics::MetricsConfig;
pub use rollup::RollupConfig;
pub use statsd::StatsdConfig;

use crate::io_error::IoError;
use crate::protocol::{Counters, Limits};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Read(#[from] IoError),
    /// The TOML error's message and position, without its excerpt of the file: the line may be
    /// a database URL with a password.
    #[error("invalid config: {0}")]
    Parse(String),
    #[error("environment variable {var}: {reason}")]
    Env { var: String, reason: String },
    #[error("invalid config: {key}: {reason}")]
    Invalid { key: String, reason: String },
}

// Not `#[from]`: the message prints the TOML error, so it must not be the `source()` as well.
impl From<toml::de::Error> for ConfigError {
    fn from(err: toml::de::Error) -> ConfigError {
        ConfigError::Parse(err.message().trim_end().to_string())
    }
}

/// A TOML syntax error in `text`: its message and line and column, not the line itself.
fn syntax_error(err: toml::de::Error, text: &str) -> ConfigError {
    let message = err.message().trim_end();
    let Some(start) = err.span().map(|s| s.start.min(text.len())) else {
        return ConfigError::Parse(message.to_string());
    };
    let before = &text[..start];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    ConfigError::Parse(format!("line {line}, column {column}: {message}"))
}
fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

/// The `Duration` getter and setter of each `_ms` field a section keeps as an integer for the
/// file's sake, so that no call site converts milliseconds by hand.
macro_rules! durations {
    ($section:ty { $($field:ident => $get:ident, $set:ident;)* }) => {
        impl $section {
            $(
                pub fn $get(&self) -> Duration {
                    Duration::from_millis(self.$field)
                }
                pub fn $set(&mut self, value: Duration) {
                    self.$field = value.as_millis() as u64;
                }
            )*
        }
    };
}
use durations;

#[derive(Debug, Clone, Deserialize, Serialize, Default, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub daemon: DaemonConfig,
    pub database: DatabaseConfig,
    pub listen: ListenConfig,
    pub coalesce: CoalesceConfig,
    pub flush: FlushConfig,
    pub rollup: RollupConfig,
    pub journal: JournalConfig,
    /// Idempotent batches.
    pub batch: BatchConfig,
    pub metrics: MetricsConfig,
    pub log: LogConfig,
    /// statsd / DogStatsD sockets (off by default).
    pub statsd: StatsdConfig,
    #[serde(deserialize_with = "counters::deserialize_list")]
    pub counters: Vec<CounterConfig>,
}

impl Config {
    /// The counter table of a daemon started with this file: each counter at its place in
    /// `[[counters]]` (see [`counter_table`]).
    pub fn counter_table(&self) -> Result<Vec<Counter>, ConfigError> {
        counter_table(&[], &self.counters)
    }

    /// The line limits of `[listen]`, as the protocol parser takes them.
    pub fn limits(&self) -> Limits {
        Limits {
            max_line_bytes: self.listen.max_line_bytes,
            max_key_bytes: self.listen.max_key_bytes,
        }
    }

    /// The parser's index of the declared counters, and the line limits: for parsing a key as
    /// the daemon would (`tallyd get`) without loading the counters' windows.
    pub fn protocol(&self) -> (Counters, Limits) {
        let counters = Counters::declare(
            self.counters
                .iter()
                .map(|c| (c.name.as_str(), c.key_type, c.kind, true)),
        );
        (counters, self.limits())
    }

    /// How keys are routed to databases, buckets and flush workers.
    pub fn layout(&self) -> crate::routing::Layout {
        crate::routing::Layout {
            buckets: self.coalesce.buckets,
            workers: self.flush.connections,
            map: self.database.shard_map(),
        }
    }

    /// Reads `path`, applies `TALLYD_*` environment overrides and validates. Relative paths
    /// (data_dir, the sockets) are resolved against `path`'s directory, so that a command run
    /// from elsewhere with `--config` finds the daemon's files.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(IoError::on("cannot read config file", path))?;
        let mut config = Self::from_toml(&text, std::env::vars())?;
        config.resolve_paths(path.parent().unwrap_or(Path::new("")));
        Ok(config)
    }

    /// Makes the relative paths of the config relative to `base` (the config file's directory)
    /// instead of the working directory, as [`Config::load`] does.
    pub fn resolve_paths(&mut self, base: &Path) {
        let at = |p: &Path| resolve(base, p);
        self.daemon.data_dir = resolve(base, &self.daemon.data_dir);
        let (l, s) = (&mut self.listen, &mut self.statsd);
        l.set_socket(l.socket().map(at));
        l.set_datagram_socket(l.datagram_socket().map(at));
        s.set_socket(s.socket().map(at));
        s.set_stream_socket(s.stream_socket().map(at));
    }

    /// Parses `text`, applies overrides from `env` (only `TALLYD_<SECTION>_<KEY>` pairs are used) and validates.
    pub fn from_toml(
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let mut doc: toml::Table = text.parse().map_err(|e| syntax_error(e, text))?;
        apply_env(&mut doc, env)?;
        let config: Config = doc.try_into()?;
        config.validate()?;
        Ok(config)
    }

    /// Each section checks itself; the rules that span sections are checked here. The one
    /// validation of `check-config`, the start and a reload.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.listen.validate()?;
        self.daemon.validate()?;
        self.flush.validate()?;
        self.coalesce.validate()?;
        let (c, f) = (&self.coalesce, &self.flush);
        if c.buckets % f.connections != 0 {
            return Err(invalid(
                "coalesce.buckets",
                format!(
                    "must be between 1 and 65536 and a multiple of flush.connections ({})",
                    f.connections
                ),
            ));
        }
        if f.max_pending_keys > c.max_pending_keys {
            return Err(invalid(
                "flush.max_pending_keys",
                "must be at least 1 and at most coalesce.max_pending_keys",
            ));
        }
        self.database.validate()?;
        self.rollup.validate()?;
        self.journal.validate()?;
        self.batch.validate()?;
        self.log.validate()?;
        counters::validate(&self.counters)?;
        let mapped = self.counters.iter().any(|c| c.statsd.is_some());
        self.statsd.validate(mapped)
    }
}

/// `path` as seen from the working directory when it is relative to `base`.
fn resolve(base: &Path, path: &Path) -> std::path::PathBuf {
    if path.is_absolute() {
        return path.to_path_buf();
    }
    let rel: std::path::PathBuf = path
        .components()
        .filter(|c| *c != std::path::Component::CurDir)
        .collect();
    base.join(rel)
}

/// Applies `TALLYD_<SECTION>_<KEY>=value` overrides. Section names have no underscore, so the
/// first underscore after the prefix separates section from key (`TALLYD_FLUSH_INTERVAL_MS`).
/// Values are read as TOML when they parse (numbers, booleans), otherwise as strings.
fn apply_env(
    doc: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(), ConfigError> {
    const SECTIONS: [&str; 11] = [
        "daemon", "database", "listen", "coalesce", "flush", "rollup", "journal", "batch",
        "metrics", "log", "statsd",
    ];
    for (var, value) in env {
        let Some(rest) = var.strip_prefix("TALLYD_") else {
            continue;
        };
        let rest = rest.to_ascii_lowercase();
        let Some((section, key)) = rest.split_once('_') else {
            continue;
        };
        if !SECTIONS.contains(&section) {
            continue;
        }
        let parsed = format!("v = {value}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or(toml::Value::String(value));
        let table = doc
            .entry(section)
            .or_insert_with(|| toml::Value::Table(Default::default()));
        let Some(table) = table.as_table_mut() else {
            return Err(ConfigError::Env {
                var,
                reason: format!("[{section}] is not a table in the config file"),
            });
        };
        table.insert(key.to_string(), parsed);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const MINIMAL: &str = "[[counters]]\nname = \"downloads\"\n";

    fn none() -> Vec<(String, String)> {
        Vec::new()
    }

    #[test]
    fn relative_paths_are_resolved_against_the_config_files_directory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tallyd.toml");
        let text = "[daemon]\ndata_dir = \"./var\"\n[listen]\nsocket = \"/run/x.sock\"\n\
                    [statsd]\nstream_socket = \"var/s.sock\"\n[[counters]]\nname = \"a\"\n\
                    [counters.statsd]\nmetric = \"a.*\"\n";
        std::fs::write(&path, text).unwrap();
        let c = Config::load(&path).unwrap();
        let var = dir.path().join("var");
        assert_eq!(c.daemon.data_dir, var);
        assert_eq!(c.listen.socket(), Some(Path::new("/run/x.sock")));
        let dgram = var.join("tallyd.dgram");
        assert_eq!(c.listen.datagram_socket(), Some(dgram.as_path()));
        let stream = var.join("s.sock");
        assert_eq!(c.statsd.stream_socket(), Some(stream.as_path()));
        assert_eq!(c.statsd.socket(), None, "off stays off");
    }

    #[test]
    fn shipped_config_is_valid() {
        let text = include_str!("../../config.toml");
        let config = Config::from_toml(text, none()).expect("config.toml parses");
        assert_eq!(config.database.url, DatabaseConfig::EMBEDDED);
        assert!(!config.counters.is_empty());
    }

    #[test]
    fn defaults_fill_an_almost_empty_file() {
        let config = Config::from_toml(MINIMAL, none()).unwrap();
        assert_eq!(config.flush.interval(), Duration::from_millis(1000));
        assert_eq!(config.counters[0].key_type, KeyTypeName::Text);
        assert_eq!(config.listen.mode(), 0o660);
    }

    #[test]
    fn serializing_writes_the_file_format_back() {
        let text = include_str!("../../config.toml");
        let config = Config::from_toml(text, none()).unwrap();
        let written = toml::to_string(&config).expect("serialize");
        let again = Config::from_toml(&written, none()).expect("reads back");
        assert_eq!(format!("{again:?}"), format!("{config:?}"));
    }

    #[test]
    fn unknown_keys_are_errors() {
        let err = Config::from_toml("[flush]\ninterval = 5\n", none()).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }

    #[test]
    fn env_overrides_file() {
        let env = vec![
            ("TALLYD_FLUSH_INTERVAL_MS".to_string(), "250".to_string()),
            (
                "TALLYD_DATABASE_URL".to_string(),
                "postgres://x@localhost/db".to_string(),
            ),
            ("PATH".to_string(), "/bin".to_string()),
        ];
        let config = Config::from_toml(MINIMAL, env).unwrap();
        assert_eq!(config.flush.interval(), Duration::from_millis(250));
        assert_eq!(config.database.url, "postgres://x@localhost/db");
    }

    #[test]
    fn validation_names_the_key() {
        let text = format!("{MINIMAL}[coalesce]\nbuckets = 7\n[flush]\nconnections = 2\n");
        let err = Config::from_toml(&text, none()).unwrap_err();
        assert!(err.to_string().contains("coalesce.buckets"), "{err}");
        let text = "[[counters]]\nname = \"bad name\"\n";
        let err = Config::from_toml(text, none()).unwrap_err();
        assert!(err.to_string().contains("counters[0].name"), "{err}");
        // A counter is named by its name, as a reload names it; by its place only while it
        // has no valid name.
        for (text, key) in [
            (
                format!("{MINIMAL}slots = 0\n"),
                "counters.downloads.slots: ",
            ),
            (
                format!("{MINIMAL}{MINIMAL}"),
                "counters.downloads.name: duplicate",
            ),
            (
                format!("{MINIMAL}kind = \"sum\"\nlog2m = 12\n"),
                "counters.downloads.log2m: only with kind = \"unique\"",
            ),
            (
                format!("{MINIMAL}[[counters]]\nslots = 3\n"),
                "counters[1]: missing field `name`",
            ),
            (
                format!("{MINIMAL}[[counters]]\nname = 7\n"),
                "counters[1]: invalid type: integer `7`, expected a string",
            ),
        ] {
            let err = Config::from_toml(&text, none()).unwrap_err().to_string();
            assert!(err.contains(key), "{text}\n{err}\nlacks {key}");
        }
    }

    /// A syntax error is placed by line and column, without printing the line: it may hold a
    /// database password.
    #[test]
    fn a_syntax_error_does_not_show_the_line() {
        let text = format!("{MINIMAL}[database]\nurl = \"postgresql://u:pa\"cretpw@h/db\"\n");
        let err = Config::from_toml(&text, none()).unwrap_err().to_string();
        assert!(err.starts_with("invalid config: line 4, column "), "{err}");
        assert!(!err.contains("cretpw"), "{err}");
    }

    /// The file keeps `""` and `-1` for "off"; the accessors say `None`, and writing the
    /// config back keeps the file's spelling.
    #[test]
    fn off_settings_are_none_and_round_trip() {
        let text = format!(
            "{MINIMAL}[listen]\ndatagram_socket = \"\"\n[metrics]\nlisten = \"\"\n\
             [flush]\nslot_offset = -1\nlock_timeout_ms = 0\n[statsd]\n"
        );
        let config = Config::from_toml(&text, none()).unwrap();
        assert_eq!(config.listen.datagram_socket(), None);
        assert!(config.listen.socket().is_some());
        assert_eq!(config.metrics.listen(), None);
        assert_eq!(config.flush.slot_offset(), None);
        assert_eq!(config.flush.lock_timeout(), None);
        assert_eq!((config.statsd.socket(), config.statsd.udp()), (None, None));
        assert_eq!(config.daemon.instance_id(), None);
        let written = toml::to_string(&config).unwrap();
        assert!(written.contains("datagram_socket = \"\""), "{written}");
        assert!(written.contains("slot_offset = -1"), "{written}");
        assert_eq!(Config::from_toml(&written, none()).unwrap(), config);
    }

    const WINDOWED: &str = "[[counters]]\nname = \"downloads\"\nwindow = \"day\"\n\
                            time_zone = \"Europe/Berlin\"\nalso = [\"month\", \"week\", \"all\"]\n\
                            keep_windows = 30\n";

    #[test]
    fn a_windowed_counter_reads_and_round_trips() {
        use crate::window::Span;
        let config = Config::from_toml(WINDOWED, none()).unwrap();
        let c = &config.counters[0];
        assert_eq!(c.window, Some(Span::Day));
        assert_eq!(c.also_spans(), [Span::Week, Span::Month]);
        assert!(c.all_time());
        let window = c.window().unwrap().expect("windowed");
        assert_eq!(
            (window.span(), window.zone_name()),
            (Span::Day, "Europe/Berlin")
        );
        let info = Counter::from_config(c).unwrap();
        assert_eq!(info.span(), Some(Span::Day));
        let also: Vec<Span> = info.also.iter().map(|w| w.span()).collect();
        assert_eq!(
            (also, info.all_time, info.keep_windows),
            (vec![Span::Week, Span::Month], true, Some(30))
        );
        assert!(info.also.iter().all(|w| w.zone_name() == "Europe/Berlin"));
        let written = toml::to_string(&config).unwrap();
        assert!(
            written.contains("also = [\"month\", \"week\", \"all\"]"),
            "{written}"
        );
        assert_eq!(Config::from_toml(&written, none()).unwrap(), config);

        // Without `all`, no all-time rows; without a window, as before windows.
        let text = WINDOWED.replace(", \"all\"", "");
        assert!(!Config::from_toml(&text, none()).unwrap().counters[0].all_time());
        let plain = Config::from_toml(MINIMAL, none()).unwrap();
        let c = &plain.counters[0];
        assert!(c.window().unwrap().is_none() && c.all_time() && c.also_spans().is_empty());
        assert_eq!(c.time_zone(), "UTC");
        let info = Counter::from_config(c).unwrap();
        assert!(info.window.is_none() && info.all_time && info.keep_windows.is_none());
        assert!(info.also.is_empty() && info.live && info.settable);
        assert!(!toml::to_string(&plain).unwrap().contains("window"));
    }

    #[test]
    fn window_keys_are_checked_by_name() {
        let day = "[[counters]]\nname = \"d\"\nwindow = \"day\"\n";
        let week = "[[counters]]\nname = \"w\"\nwindow = \"week\"\n";
        for (text, message) in [
            (
                format!("{MINIMAL}[[counters]]\nname = \"b\"\nwindow = \"fortnight\"\n"),
                "counters.b.window: unknown variant `fortnight`, expected one of `minute`, \
                 `hour`, `day`, `week`, `month`",
            ),
            (
                format!("{MINIMAL}time_zone = \"Europe/Berlin\"\n"),
                "counters.downloads.time_zone: needs window: without a window a counter keeps one \
                 all-time total per key",
            ),
            (
                format!("{MINIMAL}also = [\"all\"]\n"),
                "counters.downloads.also: needs window",
            ),
            (
                format!("{MINIMAL}keep_windows = 7\n"),
                "counters.downloads.keep_windows: needs window",
            ),
            (
                format!("{day}keep_windows = 0\n"),
                "counters.d.keep_windows: must be at least 1",
            ),
            (
                format!("{day}keep_windows = -1\n"),
                "counters.d.keep_windows: invalid value: integer `-1`, expected u32",
            ),
            (
                format!("{day}time_zone = \"Mars/Olympus_Mons\"\n"),
                "counters.d.time_zone: unknown time zone \"Mars/Olympus_Mons\": ",
            ),
            (
                format!("{day}time_zone = 1\n"),
                "counters.d.time_zone: invalid type: integer `1`, expected a string",
            ),
            (
                format!("{day}also = [\"day\"]\n"),
                "counters.d.also: \"day\" is the window itself; with window = \"day\", also may \
                 list \"week\", \"month\", \"all\"",
            ),
            (
                format!("{day}also = [\"hour\"]\n"),
                "counters.d.also: \"hour\" is finer than the window",
            ),
            (
                format!("{week}also = [\"month\"]\n"),
                "counters.w.also: a month does not hold whole weeks; with window = \"week\", \
                 also may list \"all\"",
            ),
            (
                format!("{day}also = [\"week\", \"all\", \"week\"]\n"),
                "counters.d.also: \"week\" is listed twice",
            ),
            (
                format!("{day}also = [\"fortnight\"]\n"),
                "counters.d.also: unknown window \"fortnight\": expected minute, hour, day, \
                 week, month or all",
            ),
            (
                format!("{MINIMAL}windows = \"day\"\n"),
                "counters.downloads: unknown field `windows`",
            ),
        ] {
            let err = Config::from_toml(&text, none()).unwrap_err().to_string();
            assert!(err.starts_with("invalid config: "), "{err}");
            assert!(err.contains(message), "{text}\n{err}\nlacks\n{message}");
        }
        // Each span with each coarser one, and `all`.
        for text in [
            format!("{day}also = [\"week\", \"month\", \"all\"]\n"),
            "[[counters]]\nname = \"m\"\nwindow = \"minute\"\nalso = [\"hour\", \"day\", \"week\", \"month\", \"all\"]\n".to_string(),
            format!("{week}also = [\"all\"]\ntime_zone = \"Asia/Kathmandu\"\n"),
        ] {
            Config::from_toml(&text, none()).unwrap_or_else(|e| panic!("{text}: {e}"));
        }
    }

    #[test]
    fn on_add_takes_constants_for_other_columns() {
        let into = |on_add: &str| {
            format!(
                "{MINIMAL}rollup_into = {{ table = \"public.crates\", key_column = \"id\", \
                 column = \"downloads\", on_add = {{ {on_add} }} }}\n"
            )
        };
        let text = into("processed = false, state = \"new\", version = 2");
        let config = Config::from_toml(&text, none()).unwrap();
        let target = config.counters[0].rollup_into.as_ref().unwrap();
        assert_eq!(
            target.on_add.iter().collect::<Vec<_>>(),
            vec![
                (&"processed".to_string(), &Constant::Bool(false)),
                (&"state".to_string(), &Constant::Text("new".into())),
                (&"version".to_string(), &Constant::Int(2)),
            ]
        );
        let back = toml::to_string(&config).unwrap();
        assert_eq!(
            Config::from_toml(&back, none()).unwrap().counters,
            config.counters
        );
        for (on_add, message) in [
            (
                "downloads = 0",
                "counters.downloads.rollup_into.on_add.downloads: names a column tallyd already \
                 writes (key_column, window_column or column)",
            ),
            (
                "id = 1",
                "counters.downloads.rollup_into.on_add.id: names a column tallyd already writes",
            ),
            (
                "\"the state\" = 1",
                "counters.downloads.rollup_into.on_add: \"the state\" must be a plain identifier",
            ),
        ] {
            let err = Config::from_toml(&into(on_add), none())
                .unwrap_err()
                .to_string();
            assert!(err.contains(message), "{on_add}\n{err}\nlacks\n{message}");
        }
        // Neither floats nor arrays nor tables: constants a column reads as written.
        for on_add in ["ratio = 0.5", "tags = [1]", "x = { y = 1 }"] {
            assert!(
                Config::from_toml(&into(on_add), none()).is_err(),
                "{on_add}"
            );
        }
        // Unset, not written back.
        let plain = Config::from_toml(MINIMAL, none()).unwrap();
        assert!(!toml::to_string(&plain).unwrap().contains("on_add"));
    }

    #[test]
    fn windowed_rollup_into_keys_are_checked_by_name() {
        let day = "[[counters]]\nname = \"d\"\nwindow = \"day\"\n";
        let into = |extra: &str| {
            format!(
                "rollup_into = {{ table = \"public.version_downloads\", key_column = \"version_id\", \
                 column = \"downloads\"{extra} }}\n"
            )
        };
        for (text, message) in [
            (
                format!("{day}{}", into("")),
                "counters.d.rollup_into.window_column: required with window = \"day\": the \
                 column of public.version_downloads that holds the window (a date for day, week \
                 or month windows, or a timestamptz for any window)",
            ),
            (
                format!("{MINIMAL}{}", into(", window_column = \"date\"")),
                "counters.downloads.rollup_into.window_column: only with window",
            ),
            (
                format!("{MINIMAL}{}", into(", insert_missing = true")),
                "counters.downloads.rollup_into.insert_missing: only with window and window_column",
            ),
            (
                format!("{day}{}", into(", window_column = \"the date\"")),
                "counters.d.rollup_into: table (optionally schema.table), key_column, \
                 window_column and column must be plain identifiers",
            ),
        ] {
            let err = Config::from_toml(&text, none()).unwrap_err().to_string();
            assert!(err.contains(message), "{text}\n{err}\nlacks\n{message}");
        }
        let text = format!(
            "{day}{}",
            into(", window_column = \"date\", insert_missing = true")
        );
        let config = Config::from_toml(&text, none()).unwrap();
        let target = config.counters[0].rollup_into.as_ref().unwrap();
        assert_eq!(
            (target.window_column.as_deref(), target.insert_missing),
            (Some("date"), true)
        );
        let back = toml::to_string(&config).unwrap();
        assert_eq!(
            Config::from_toml(&back, none()).unwrap().counters,
            config.counters
        );
        // Unset, the new keys are not written back.
        let plain = Config::from_toml(&format!("{MINIMAL}{}", into("")), none()).unwrap();
        let back = toml::to_string(&plain).unwrap();
        assert!(
            !back.contains("window_column") && !back.contains("insert_missing"),
            "{back}"
        );
    }

    #[test]
    fn each_section_names_its_key() {
        for (text, key) in [
            ("[flush]\ninterval_ms = 0\n", "flush.interval_ms"),
            ("[rollup]\ninterval_ms = 0\n", "rollup.interval_ms"),
            ("[journal]\nsegment_bytes = 1\n", "journal.segment_bytes"),
            (
                "[daemon]\ninstance_lease_ms = 5\n",
                "daemon.instance_lease_ms",
            ),
            ("[log]\nlevel = \"tallyd=loud\"\n", "log.level"),
            (
                "[database]\nlogical_shards = 0\n",
                "database.logical_shards",
            ),
            ("[statsd]\nudp = \"x\"\n", "statsd.udp"),
        ] {
            let err = Config::from_toml(&format!("{MINIMAL}{text}"), none()).unwrap_err();
            assert!(err.to_string().contains(key), "{key} not in {err}");
        }
    }
}
