//! Configuration: the serde model of config.toml, `TALLYD_<SECTION>_<KEY>` overrides, and validation.
//!
//! Every key has a default, so an empty file is a valid config. Unknown keys are an error, so a typo
//! never silently falls back to a default. `Serialize` writes the same format back (the test kit
//! builds a `Config` value and writes it as config.toml).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::io_error::IoError;
use crate::protocol::{Counters, KeyType, Limits};

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
/// Size of `sockaddr_un.sun_path` (path plus its terminating NUL).
const SUN_PATH_BYTES: usize =
    std::mem::size_of::<libc::sockaddr_un>() - std::mem::size_of::<libc::sa_family_t>();

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub daemon: DaemonConfig,
    pub database: DatabaseConfig,
    pub listen: ListenConfig,
    pub coalesce: CoalesceConfig,
    pub flush: FlushConfig,
    pub rollup: RollupConfig,
    pub journal: JournalConfig,
    pub metrics: MetricsConfig,
    pub log: LogConfig,
    /// statsd / DogStatsD sockets (off by default).
    pub statsd: crate::statsd::StatsdConfig,
    pub counters: Vec<CounterConfig>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DaemonConfig {
    /// Directory for the private PostgreSQL cluster, sockets and the instance id.
    pub data_dir: PathBuf,
    /// Stable identity of this tallyd; empty = generated once and kept in `data_dir/instance_id`.
    pub instance_id: String,
    /// On a graceful stop, how long open connections may keep sending before they are closed.
    pub drain_timeout_ms: u64,
    /// How long the final flush may retry before tallyd gives up on it.
    pub shutdown_timeout_ms: u64,
    /// How long the instance lease (one live tallyd per instance_id) lasts unrenewed; renewed
    /// every third of it.
    pub instance_lease_ms: u64,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            data_dir: PathBuf::from("./var"),
            instance_id: String::new(),
            drain_timeout_ms: 5_000,
            shutdown_timeout_ms: 30_000,
            instance_lease_ms: 10_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// `embedded` (a private cluster under `data_dir/postgres`) or a `postgres://` URL / libpq key=value string.
    pub url: String,
    /// Extra server settings for the embedded cluster, passed as `-c name=value`.
    pub embedded_settings: std::collections::BTreeMap<String, String>,
    /// Apply migrations on start.
    pub migrate: bool,
    pub connect_timeout_ms: u64,
    /// Hash-partition `tallyd.slots` by key into this many partitions (0: not partitioned).
    pub slot_partitions: u32,
    /// Several databases (each `embedded` or a URL); empty: just `url`. Keys are spread over
    /// them by logical shard.
    pub shards: Vec<String>,
    /// Logical shards keys hash to; they map onto the databases.
    pub logical_shards: u32,
    /// Database index (into `shards`) of each logical shard; empty: an even split in order.
    pub shard_map: Vec<u32>,
    /// At start, move logical shards whose recorded database differs from the map, instead of
    /// refusing to start.
    pub move_shards: bool,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: Self::EMBEDDED.into(),
            embedded_settings: Default::default(),
            migrate: true,
            connect_timeout_ms: 5_000,
            slot_partitions: 0,
            shards: Vec::new(),
            logical_shards: 480,
            shard_map: Vec::new(),
            move_shards: false,
        }
    }
}

impl DatabaseConfig {
    /// A database entry (`url`, or one of `shards`) that names a private cluster.
    pub const EMBEDDED: &'static str = "embedded";

    /// The databases tallyd writes to, in shard-map order: `shards`, or just `url`.
    pub fn databases(&self) -> Vec<&str> {
        if self.shards.is_empty() {
            vec![self.url.as_str()]
        } else {
            self.shards.iter().map(String::as_str).collect()
        }
    }

    /// The database index of every logical shard: `shard_map`, or an even split in order
    /// (shard s goes to database s * databases / logical_shards).
    pub fn shard_map(&self) -> Vec<u16> {
        if !self.shard_map.is_empty() {
            return self.shard_map.iter().map(|&d| d as u16).collect();
        }
        let (n, dbs) = (self.logical_shards as u64, self.databases().len() as u64);
        (0..n).map(|s| (s * dbs / n) as u16).collect()
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ListenConfig {
    /// Stream socket path; empty disables it.
    pub socket: PathBuf,
    /// Datagram socket path; empty disables it.
    pub datagram_socket: PathBuf,
    /// Octal file mode of both socket files, as a string ("0660").
    pub socket_mode: String,
    pub max_line_bytes: usize,
    pub max_key_bytes: usize,
    pub max_connections: usize,
    /// Bytes read from a connection at a time; each read is one batch per bucket.
    pub read_buffer_bytes: usize,
    /// A stream connection that sends nothing for this long is closed; 0: never.
    pub idle_timeout_ms: u64,
}

impl Default for ListenConfig {
    fn default() -> Self {
        ListenConfig {
            socket: PathBuf::from("./var/tallyd.sock"),
            datagram_socket: PathBuf::from("./var/tallyd.dgram"),
            socket_mode: "0660".into(),
            max_line_bytes: 4096,
            max_key_bytes: 256,
            max_connections: 1024,
            read_buffer_bytes: 64 * 1024,
            idle_timeout_ms: 300_000,
        }
    }
}

impl ListenConfig {
    /// `None` when idle connections are never timed out.
    pub fn idle_timeout(&self) -> Option<Duration> {
        (self.idle_timeout_ms > 0).then(|| Duration::from_millis(self.idle_timeout_ms))
    }

    /// The socket file mode; validation has already rejected a bad `socket_mode`.
    pub fn mode(&self) -> u32 {
        self.parse_mode().unwrap_or(0o660)
    }

    /// The one parse of `socket_mode`: octal ("0660" or "0o660"), at most 0o777.
    fn parse_mode(&self) -> Option<u32> {
        let digits = self.socket_mode.trim_start_matches("0o");
        u32::from_str_radix(digits, 8).ok().filter(|m| *m <= 0o777)
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoalesceConfig {
    /// Number of bucket actors; keys are hashed onto them. Must be a multiple of `flush.connections`.
    pub buckets: usize,
    /// Messages that may queue for one bucket before connections stop reading.
    pub queue_batches: usize,
    /// Hard cap on distinct pending keys; past it, listeners stop reading until a flush frees room.
    pub max_pending_keys: usize,
}

impl Default for CoalesceConfig {
    fn default() -> Self {
        CoalesceConfig {
            buckets: 120,
            queue_batches: 64,
            max_pending_keys: 2_000_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct FlushConfig {
    pub interval_ms: u64,
    /// Flush sooner once this many distinct keys are pending.
    pub max_pending_keys: usize,
    /// Parallel PostgreSQL connections; each key always goes through the same one.
    pub connections: usize,
    /// Rows per upsert statement.
    pub batch_rows: usize,
    pub retry_initial_ms: u64,
    pub retry_max_ms: u64,
    /// `lock_timeout` of the flush sessions, so a lock held on `tallyd.slots` fails the flush
    /// (which is retried) instead of stalling it; 0 leaves the server's setting.
    pub lock_timeout_ms: u64,
    /// `statement_timeout` of the flush sessions; 0 leaves the server's setting.
    pub statement_timeout_ms: u64,
    /// First slot this instance writes; connection `i` writes slot `slot_offset + i`.
    /// -1 derives it from the instance id, so instances on one database use different slots.
    pub slot_offset: i64,
}

impl Default for FlushConfig {
    fn default() -> Self {
        FlushConfig {
            interval_ms: 1000,
            max_pending_keys: 100_000,
            connections: 2,
            batch_rows: 5_000,
            retry_initial_ms: 100,
            retry_max_ms: 10_000,
            lock_timeout_ms: 5_000,
            statement_timeout_ms: 60_000,
            slot_offset: -1,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RollupConfig {
    pub enabled: bool,
    pub interval_ms: u64,
    pub batch_rows: i32,
}

impl Default for RollupConfig {
    fn default() -> Self {
        RollupConfig {
            enabled: true,
            interval_ms: 10_000,
            batch_rows: 1_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct JournalConfig {
    /// Write accepted events to `data_dir/journal` so that a crash loses nothing.
    pub enabled: bool,
    pub fsync: FsyncMode,
    /// With `fsync = "interval"`: how often.
    pub fsync_interval_ms: u64,
    /// A segment file is closed and a new one started past this size.
    pub segment_bytes: u64,
}

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig {
            enabled: true,
            fsync: FsyncMode::Interval,
            fsync_interval_ms: 100,
            segment_bytes: 64 << 20,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FsyncMode {
    /// fsync after every group of writes, before `!sync` is answered.
    Always,
    /// fsync every `fsync_interval_ms`; `!sync` waits for the next one.
    Interval,
    /// Never fsync: survives a killed process, not a power loss.
    Off,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// host:port of the HTTP endpoints (/metrics, /healthz, /readyz, /status); empty disables
    /// them.
    pub listen: String,
    /// Hottest pending keys shown per counter in /status and `tallyd status`; 0 shows none
    /// (keys are user data).
    pub status_top_keys: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: "127.0.0.1:9187".into(),
            status_top_keys: 10,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// A tracing filter (`info`, `tallyd=debug`); RUST_LOG wins when set.
    pub level: String,
    /// `text` or `json`.
    pub format: LogFormat,
}

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: "info".into(),
            format: LogFormat::Text,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CounterConfig {
    pub name: String,
    #[serde(default = "default_key_type")]
    pub key_type: KeyTypeName,
    /// How many slot rows a key may spread over in `tallyd.slots`.
    #[serde(default = "default_slots")]
    pub slots: u32,
    /// Fold this counter into a column of the application's own table instead of `tallyd.rollups`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollup_into: Option<RollupInto>,
    /// Which statsd metric this counter takes, and where its key is.
    #[serde(default)]
    pub statsd: Option<crate::statsd::mapping::CounterStatsd>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RollupInto {
    /// The table, optionally schema-qualified: `public.repositories`.
    pub table: String,
    /// Column matched against the key (the key is cast to its type).
    pub key_column: String,
    /// Integer column the folded counts are added to.
    pub column: String,
}

fn default_key_type() -> KeyTypeName {
    KeyTypeName::Text
}

fn default_slots() -> u32 {
    100
}

/// The config name of [`KeyType`]: one enum serves the file and the parser.
pub type KeyTypeName = KeyType;

// `Duration` and `Option` views of the settings the file keeps as `_ms` integers and sentinel
// values (for compatibility): call sites use these instead of converting or comparing.
fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

impl DaemonConfig {
    pub fn drain_timeout(&self) -> Duration {
        ms(self.drain_timeout_ms)
    }
    pub fn shutdown_timeout(&self) -> Duration {
        ms(self.shutdown_timeout_ms)
    }
}

impl DatabaseConfig {
    pub fn connect_timeout(&self) -> Duration {
        ms(self.connect_timeout_ms)
    }
}

impl FlushConfig {
    pub fn interval(&self) -> Duration {
        ms(self.interval_ms)
    }
    pub fn retry_initial(&self) -> Duration {
        ms(self.retry_initial_ms)
    }
    pub fn retry_max(&self) -> Duration {
        ms(self.retry_max_ms)
    }
    /// The configured first slot; `None` (`-1` in the file) derives it from the instance id.
    pub fn slot_offset(&self) -> Option<u64> {
        u64::try_from(self.slot_offset).ok()
    }
}

impl RollupConfig {
    pub fn interval(&self) -> Duration {
        ms(self.interval_ms)
    }
}

impl JournalConfig {
    pub fn fsync_interval(&self) -> Duration {
        ms(self.fsync_interval_ms)
    }
}

impl MetricsConfig {
    /// The Prometheus endpoint's address; `None` (empty in the file) when it is off.
    pub fn listen(&self) -> Option<&str> {
        Some(self.listen.as_str()).filter(|l| !l.is_empty())
    }
}

impl Config {
    /// The declared counters and line limits, as the protocol parser takes them.
    pub fn protocol(&self) -> (Counters, Limits) {
        let counters = Counters::new(self.counters.iter().map(|c| (c.name.as_str(), c.key_type)));
        let limits = Limits {
            max_line_bytes: self.listen.max_line_bytes,
            max_key_bytes: self.listen.max_key_bytes,
        };
        (counters, limits)
    }

    /// How keys are routed to databases, buckets and flush workers.
    pub fn layout(&self) -> crate::routing::Layout {
        crate::routing::Layout {
            buckets: self.coalesce.buckets,
            workers: self.flush.connections,
            map: self.database.shard_map(),
        }
    }

    /// Reads `path`, applies `TALLYD_*` environment overrides and validates.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(IoError::on("cannot read config file", path))?;
        Self::from_toml(&text, std::env::vars())
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

    pub fn validate(&self) -> Result<(), ConfigError> {
        let l = &self.listen;
        if !(16..=1 << 20).contains(&l.max_line_bytes) {
            return Err(invalid(
                "listen.max_line_bytes",
                "must be between 16 and 1048576",
            ));
        }
        if l.max_key_bytes == 0 || l.max_key_bytes >= l.max_line_bytes {
            return Err(invalid(
                "listen.max_key_bytes",
                "must be at least 1 and less than listen.max_line_bytes",
            ));
        }
        if self.daemon.instance_lease_ms < 1000 {
            return Err(invalid("daemon.instance_lease_ms", "must be at least 1000"));
        }
        if l.max_connections == 0 {
            return Err(invalid("listen.max_connections", "must be at least 1"));
        }
        if l.read_buffer_bytes < 512 {
            return Err(invalid("listen.read_buffer_bytes", "must be at least 512"));
        }
        if l.parse_mode().is_none() {
            return Err(invalid(
                "listen.socket_mode",
                "must be an octal file mode such as \"0660\"",
            ));
        }
        for (key, path) in [
            ("listen.socket", &l.socket),
            ("listen.datagram_socket", &l.datagram_socket),
        ] {
            // sockaddr_un's sun_path holds the path and its NUL: 108 bytes on Linux.
            let len = path.as_os_str().len();
            if len >= SUN_PATH_BYTES {
                return Err(invalid(
                    key,
                    format!(
                        "path is {len} bytes; a Unix socket path must be shorter than {SUN_PATH_BYTES} \
                         bytes (use a shorter directory)"
                    ),
                ));
            }
        }
        if l.socket.as_os_str().is_empty() && l.datagram_socket.as_os_str().is_empty() {
            return Err(invalid(
                "listen",
                "at least one of socket and datagram_socket must be set",
            ));
        }
        let f = &self.flush;
        if f.connections == 0 || f.connections > 64 {
            return Err(invalid("flush.connections", "must be between 1 and 64"));
        }
        let c = &self.coalesce;
        if c.buckets == 0 || c.buckets > 65_536 || c.buckets % f.connections != 0 {
            return Err(invalid(
                "coalesce.buckets",
                format!(
                    "must be between 1 and 65536 and a multiple of flush.connections ({})",
                    f.connections
                ),
            ));
        }
        if c.queue_batches == 0 {
            return Err(invalid("coalesce.queue_batches", "must be at least 1"));
        }
        if c.max_pending_keys == 0 {
            return Err(invalid("coalesce.max_pending_keys", "must be at least 1"));
        }
        if f.interval_ms == 0 {
            return Err(invalid("flush.interval_ms", "must be at least 1"));
        }
        if f.max_pending_keys == 0 || f.max_pending_keys > c.max_pending_keys {
            return Err(invalid(
                "flush.max_pending_keys",
                "must be at least 1 and at most coalesce.max_pending_keys",
            ));
        }
        if f.batch_rows == 0 {
            return Err(invalid("flush.batch_rows", "must be at least 1"));
        }
        if f.retry_initial_ms == 0 || f.retry_max_ms < f.retry_initial_ms {
            return Err(invalid(
                "flush.retry_max_ms",
                "retry_initial_ms must be at least 1 and retry_max_ms at least retry_initial_ms",
            ));
        }
        let dbs = self.database.databases().len();
        if dbs > 256 {
            return Err(invalid("database.shards", "at most 256 databases"));
        }
        let logical = self.database.logical_shards as usize;
        if logical < dbs || logical > 65_536 {
            return Err(invalid(
                "database.logical_shards",
                format!("must be between the number of databases ({dbs}) and 65536"),
            ));
        }
        let map = &self.database.shard_map;
        if !map.is_empty() && (map.len() != logical || map.iter().any(|&d| d as usize >= dbs)) {
            return Err(invalid(
                "database.shard_map",
                format!(
                    "must list a database index below {dbs} for each of the {logical} logical shards"
                ),
            ));
        }
        if self.database.slot_partitions > 1024 {
            return Err(invalid(
                "database.slot_partitions",
                "must be between 0 and 1024",
            ));
        }
        if f.slot_offset < -1 {
            return Err(invalid(
                "flush.slot_offset",
                "must be -1 (derive) or a slot number",
            ));
        }
        if self.rollup.batch_rows < 1 || self.rollup.interval_ms == 0 {
            return Err(invalid(
                "rollup",
                "batch_rows and interval_ms must be at least 1",
            ));
        }
        if self.journal.fsync_interval_ms == 0 || self.journal.segment_bytes < 4096 {
            return Err(invalid(
                "journal",
                "fsync_interval_ms must be at least 1 and segment_bytes at least 4096",
            ));
        }
        if self.counters.is_empty() {
            return Err(invalid(
                "counters",
                "declare at least one [[counters]] table with a name",
            ));
        }
        if self.counters.len() > u16::MAX as usize {
            return Err(invalid("counters", "too many counters"));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, counter) in self.counters.iter().enumerate() {
            let key = format!("counters[{i}].name");
            let name = counter.name.as_bytes();
            if name.is_empty()
                || name.len() > 63
                || !name
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
            {
                return Err(invalid(
                    key,
                    "must be 1 to 63 characters of letters, digits, '_', '-', '.' or ':'",
                ));
            }
            if !seen.insert(counter.name.as_str()) {
                return Err(invalid(
                    key,
                    format!("duplicate counter {:?}", counter.name),
                ));
            }
            if let Some(into) = &counter.rollup_into {
                let ident = |s: &str| {
                    !s.is_empty()
                        && s.len() <= 63
                        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                };
                let table_ok = match into.table.split_once('.') {
                    Some((schema, table)) => ident(schema) && ident(table),
                    None => ident(&into.table),
                };
                if !table_ok || !ident(&into.key_column) || !ident(&into.column) {
                    return Err(invalid(
                        format!("counters[{i}].rollup_into"),
                        "table (optionally schema.table), key_column and column must be plain \
                         identifiers: letters, digits and '_'",
                    ));
                }
            }
            if counter.slots == 0 || counter.slots > 100_000 {
                return Err(invalid(
                    format!("counters[{i}].slots"),
                    "must be between 1 and 100000",
                ));
            }
        }
        crate::statsd::StatsdConfig::check(self).map_err(|(key, reason)| invalid(key, reason))?;
        Ok(())
    }
}

/// Applies `TALLYD_<SECTION>_<KEY>=value` overrides. Section names have no underscore, so the
/// first underscore after the prefix separates section from key (`TALLYD_FLUSH_INTERVAL_MS`).
/// Values are read as TOML when they parse (numbers, booleans), otherwise as strings.
fn apply_env(
    doc: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(), ConfigError> {
    const SECTIONS: [&str; 10] = [
        "daemon", "database", "listen", "coalesce", "flush", "rollup", "journal", "metrics", "log",
        "statsd",
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

    const MINIMAL: &str = "[[counters]]\nname = \"downloads\"\n";

    fn none() -> Vec<(String, String)> {
        Vec::new()
    }

    #[test]
    fn shipped_config_is_valid() {
        let text = include_str!("../config.toml");
        let config = Config::from_toml(text, none()).expect("config.toml parses");
        assert_eq!(config.database.url, DatabaseConfig::EMBEDDED);
        assert!(!config.counters.is_empty());
    }

    #[test]
    fn defaults_fill_an_almost_empty_file() {
        let config = Config::from_toml(MINIMAL, none()).unwrap();
        assert_eq!(config.flush.interval_ms, 1000);
        assert_eq!(config.counters[0].key_type, KeyTypeName::Text);
        assert_eq!(config.listen.mode(), 0o660);
    }

    #[test]
    fn serializing_writes_the_file_format_back() {
        let text = include_str!("../config.toml");
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
        assert_eq!(config.flush.interval_ms, 250);
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
}
