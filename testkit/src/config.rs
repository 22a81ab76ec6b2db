//! [`TestConfig`]: a typed builder over tallyd's `Config` for tests. Tests edit a `Config`
//! value and the builder writes it as config.toml with serde, so no test edits TOML text.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tallyd::config::{Config, CounterConfig, KeyTypeName, RollupInto};

/// The counters most tests declare: `downloads` (text), `views` (bigint), `ips` (inet) and
/// `users` (uuid), in that order.
pub const STANDARD_COUNTERS: [(&str, KeyTypeName); 4] = [
    ("downloads", KeyTypeName::Text),
    ("views", KeyTypeName::Bigint),
    ("ips", KeyTypeName::Inet),
    ("users", KeyTypeName::Uuid),
];

/// A counter declaration with the default number of slots and no `rollup_into`.
pub fn counter(name: &str, key_type: KeyTypeName) -> CounterConfig {
    let text = format!(
        "name = {:?}\nkey_type = {:?}",
        name,
        key_type_name(key_type)
    );
    toml::from_str(&text).expect("counter declaration")
}

/// A counter of `kind` (`"sum"`, `"unique"`, `"max"`, `"min"`, `"last"`) with `extra` keys of
/// its `[[counters]]` entry, one per line as config.toml writes them (`"log2m = 12"`,
/// `"window = \"day\"\nalso = [\"all\"]"`, or `""`): parsed as the file is, so that a test
/// declares any counter without reaching into the config types.
pub fn kind_counter(name: &str, kind: &str, extra: &str) -> CounterConfig {
    let text = format!("name = {name:?}\nkind = {kind:?}\n{extra}");
    toml::from_str(&text).unwrap_or_else(|e| panic!("counter declaration {text:?}: {e}"))
}

/// Unix milliseconds of an RFC 3339 instant (`"2026-11-25T00:00:00Z"`): event times for
/// `@unix_ms`.
pub fn unix_ms(instant: &str) -> i64 {
    instant
        .parse::<jiff::Timestamp>()
        .unwrap_or_else(|e| panic!("{instant}: {e}"))
        .as_millisecond()
}

/// A text-keyed counter counted per `window` ("day", ...) of `time_zone`, with `also` ("month",
/// "all", ...).
pub fn windowed_counter(name: &str, window: &str, time_zone: &str, also: &[&str]) -> CounterConfig {
    let text =
        format!("name = {name:?}\nwindow = {window:?}\ntime_zone = {time_zone:?}\nalso = {also:?}");
    toml::from_str(&text).expect("windowed counter declaration")
}

/// A counter folded into `table.column` (matched on `key_column`) instead of `tallyd.rollups`, by
/// the rollup: its flushes write `tallyd.slots` (`direct = false`), which is what the tests of the
/// rollup need; the flush's direct writes have tests of their own (tests/direct.rs).
pub fn counter_rolled_into(
    name: &str,
    key_type: KeyTypeName,
    table: &str,
    key_column: &str,
    column: &str,
) -> CounterConfig {
    let mut counter = counter(name, key_type);
    counter.rollup_into = Some(RollupInto {
        table: table.into(),
        key_column: key_column.into(),
        window_column: None,
        column: column.into(),
        insert_missing: false,
        direct: false,
        on_add: Default::default(),
    });
    counter
}

/// `name` (bigint keys) folded into `public.repositories.download_count`, matched on `id`: the
/// application table of the `rollup_into` tests (each creates it as it needs).
pub fn counter_into_repositories(name: &str) -> CounterConfig {
    counter_rolled_into(
        name,
        KeyTypeName::Bigint,
        "public.repositories",
        "id",
        "download_count",
    )
}

fn key_type_name(k: KeyTypeName) -> &'static str {
    match k {
        KeyTypeName::Text => "text",
        KeyTypeName::Bigint => "bigint",
        KeyTypeName::Uuid => "uuid",
        KeyTypeName::Inet => "inet",
    }
}

/// A test's config: tallyd's defaults, with every path inside the test's directory (data_dir
/// `dir/data`, sockets `dir/tallyd.sock` and `dir/tallyd.dgram`), the metrics endpoint off, and
/// an embedded PostgreSQL that does not fsync. No counters until the test declares some.
#[derive(Debug, Clone)]
pub struct TestConfig {
    dir: PathBuf,
    config: Config,
}

impl TestConfig {
    pub fn new(dir: &Path) -> TestConfig {
        let mut config = Config::default();
        config.daemon.data_dir = dir.join("data");
        config.listen.set_socket(Some(dir.join("tallyd.sock")));
        config
            .listen
            .set_datagram_socket(Some(dir.join("tallyd.dgram")));
        config.metrics.set_listen(None);
        config
            .database
            .embedded_settings
            .insert("fsync".into(), "off".into());
        TestConfig {
            dir: dir.to_path_buf(),
            config,
        }
    }

    /// Declares `downloads`, `views`, `ips` and `users` ([`STANDARD_COUNTERS`]).
    pub fn standard_counters(self) -> TestConfig {
        self.counters(&STANDARD_COUNTERS)
    }

    /// Declares more counters, after those already declared.
    pub fn counters(mut self, counters: &[(&str, KeyTypeName)]) -> TestConfig {
        for (name, key_type) in counters {
            self.config.counters.push(counter(name, *key_type));
        }
        self
    }

    /// Quick turnarounds for tests: flushes every 200 ms, retries from 20 ms up to 500 ms,
    /// drains connections for at most 2 s on a stop, no rollup schedule.
    pub fn fast(self) -> TestConfig {
        self.with(|c| {
            c.daemon.set_drain_timeout(Duration::from_millis(2000));
            c.flush.set_interval(Duration::from_millis(200));
            c.flush.set_retry_initial(Duration::from_millis(20));
            c.flush.set_retry_max(Duration::from_millis(500));
            c.rollup.enabled = false;
        })
    }

    /// A `tallyd run` child on the external database `url` as instance `id`, without a datagram
    /// socket or a rollup schedule (a test that wants them sets them after).
    pub fn external(self, url: &str, id: &str) -> TestConfig {
        let id = id.to_string();
        self.database_url(url).with(|c| {
            c.daemon.set_instance_id(Some(id));
            c.listen.set_datagram_socket(None);
            c.rollup.enabled = false;
        })
    }

    /// No timed flush (one every ten minutes): only a `!flush`, a correction, a stop or the
    /// memory cap commits, so what a kill -9 finds is in the journal alone.
    pub fn never_flushes(self) -> TestConfig {
        self.with(|c| c.flush.set_interval(Duration::from_secs(600)))
    }

    /// The database: `embedded` (the default) or a connection string.
    pub fn database_url(self, url: &str) -> TestConfig {
        let url = url.to_string();
        self.with(|c| c.database.url = url)
    }

    /// The metrics endpoint on 127.0.0.1:`port`.
    pub fn metrics_port(self, port: u16) -> TestConfig {
        self.with(|c| c.metrics.set_listen(Some(format!("127.0.0.1:{port}"))))
    }

    /// Any other change, on the `Config` value itself.
    pub fn with(mut self, edit: impl FnOnce(&mut Config)) -> TestConfig {
        edit(&mut self.config);
        self
    }

    /// The config as it is now, not validated (for tests of validation).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The validated config.
    pub fn build(self) -> Config {
        self.config.validate().expect("test config is valid");
        self.config
    }

    /// Writes `dir/config.toml` and returns its path.
    pub fn write(&self) -> PathBuf {
        self.write_as("config.toml")
    }

    /// Writes `dir/<name>` and returns its path. Not validated, so a test can write an invalid
    /// config for `tallyd check-config` to refuse.
    pub fn write_as(&self, name: &str) -> PathBuf {
        let path = self.dir.join(name);
        let text = toml::to_string(&self.config).expect("serialize the test config");
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        path
    }
}
