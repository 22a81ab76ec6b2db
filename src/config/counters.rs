//! The `[[counters]]` tables: the counters tallyd accepts, their key type, slots, time window and
//! rollup target.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use serde::de::{Error as _, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{invalid, ConfigError};
use crate::hll::{self, Params};
use crate::kind::Kind;
use crate::protocol::KeyType;
use crate::window::{Span, Window};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CounterConfig {
    pub name: String,
    #[serde(default = "default_key_type")]
    pub key_type: KeyTypeName,
    /// What it keeps per key: `sum` (the default), `unique`, `max`, `min` or `last`.
    #[serde(default, deserialize_with = "kind_key")]
    pub kind: Kind,
    /// A unique counter's sketch precision: postgresql-hll's `log2m` (default 11) ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log2m: Option<u32>,
    /// ... and `regwidth` (default 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regwidth: Option<u32>,
    /// How many slot rows a key may spread over in `tallyd.slots`.
    #[serde(default = "default_slots")]
    pub slots: u32,
    /// Count per window of this span (rows keyed by the window's start); absent: one all-time
    /// row per key.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "window_key"
    )]
    pub window: Option<Span>,
    /// The IANA zone the windows start in (only with `window`); absent: UTC.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "time_zone_key"
    )]
    pub time_zone: Option<String>,
    /// Coarser windows, and `all` (the all-time total), kept with `window` and written in the
    /// same transaction, so that they always agree.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "also_key"
    )]
    pub also: Vec<Also>,
    /// Keep only the last N windows of `window` (the `also` rows are kept whole); absent: all.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "keep_windows_key"
    )]
    pub keep_windows: Option<u32>,
    /// Fold this counter into a column of the application's own table instead of `tallyd.rollups`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollup_into: Option<RollupInto>,
    /// Which statsd metric this counter takes, and where its key is.
    #[serde(default)]
    pub statsd: Option<CounterStatsd>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RollupInto {
    /// The table, optionally schema-qualified: `public.repositories`.
    pub table: String,
    /// Column matched against the key (the key is cast to its type).
    pub key_column: String,
    /// For a windowed counter (and only then): the column matched against the window, a `date`
    /// (its first day in the counter's zone; day, week and month windows) or a `timestamptz`
    /// (its first instant). Only the rows of the counter's `window` go to the table; its `also`
    /// rows go to `tallyd.rollups`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_column: Option<String>,
    /// Integer column the folded counts are added to.
    pub column: String,
    /// For a windowed counter: insert the missing `(key, window)` rows (`INSERT ... ON CONFLICT
    /// (key_column, window_column) DO UPDATE`) instead of leaving their counts in `tallyd.slots`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insert_missing: bool,
    /// The flush adds each flight's counts to the table itself, in the flight's own transaction
    /// (the same upsert the rollup runs), and writes the counter's `also` rows straight into
    /// `tallyd.rollups` (default). `false`: they wait in `tallyd.slots` for the rollup. Off on
    /// Citus, and for a while after a direct write failed (docs/design.md, "Direct writes").
    #[serde(default = "direct_default", skip_serializing_if = "is_direct_default")]
    pub direct: bool,
    /// Columns of the table tallyd sets to a constant whenever it adds to (or inserts) a row,
    /// in the same statement: `on_add = { processed = false }` reopens a row the application's
    /// consumer job froze. Booleans, integers and strings, checked against the columns' types at
    /// start.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub on_add: BTreeMap<String, Constant>,
}

/// A constant of `rollup_into.on_add`, as written in config.toml.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum Constant {
    Bool(bool),
    Int(i64),
    Text(String),
}

impl Constant {
    /// The constant as PostgreSQL reads its text (`true`, `42`, `text`).
    pub fn text(&self) -> String {
        match self {
            Constant::Bool(b) => b.to_string(),
            Constant::Int(i) => i.to_string(),
            Constant::Text(t) => t.clone(),
        }
    }

    /// What it is, for an error.
    pub fn what(&self) -> &'static str {
        match self {
            Constant::Bool(_) => "a boolean",
            Constant::Int(_) => "an integer",
            Constant::Text(_) => "a string",
        }
    }
}

fn direct_default() -> bool {
    true
}

fn is_direct_default(direct: &bool) -> bool {
    *direct
}

impl RollupInto {
    /// `window_column` and `insert_missing` against the counter's `window`: both only with a
    /// window, and `window_column` required with one. Returns the offending key and why.
    fn check_window(&self, window: Option<Span>) -> Result<(), (&'static str, String)> {
        match (window, &self.window_column) {
            (Some(span), None) => Err((
                "window_column",
                format!(
                    "required with window = {:?}: the column of {} that holds the window (a \
                     date for day, week or month windows, or a timestamptz for any window)",
                    span.name(),
                    self.table
                ),
            )),
            (None, Some(_)) => Err((
                "window_column",
                "only with window: an all-time counter folds into one row per key".into(),
            )),
            (None, None) if self.insert_missing => Err((
                "insert_missing",
                "only with window and window_column: an all-time counter adds only to rows that \
                 exist"
                    .into(),
            )),
            _ => Ok(()),
        }
    }
}

fn default_key_type() -> KeyTypeName {
    KeyTypeName::Text
}

fn default_slots() -> u32 {
    100
}

/// The config name of [`KeyType`]: one enum serves the file and the parser.
pub type KeyTypeName = KeyType;

/// An entry of a counter's `also`: a coarser window, or `all`, the all-time total.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Also {
    Window(Span),
    All,
}

impl Also {
    pub fn name(self) -> &'static str {
        match self {
            Also::Window(span) => span.name(),
            Also::All => "all",
        }
    }
}

impl fmt::Display for Also {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Also {
    type Err = String;

    fn from_str(s: &str) -> Result<Also, String> {
        Span::ALL
            .into_iter()
            .map(Also::Window)
            .chain([Also::All])
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                format!("unknown window {s:?}: expected minute, hour, day, week, month or all")
            })
    }
}

impl<'de> Deserialize<'de> for Also {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Also, D::Error> {
        String::deserialize(d)?.parse().map_err(D::Error::custom)
    }
}

impl Serialize for Also {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// A type error in one of the window keys names the key (`.window: ...`);
/// [`deserialize_list`] puts the counter before it.
fn keyed<'de, D: Deserializer<'de>, T: Deserialize<'de>>(key: &str, d: D) -> Result<T, D::Error> {
    T::deserialize(d).map_err(|e| D::Error::custom(format!(".{key}: {e}")))
}

fn kind_key<'de, D: Deserializer<'de>>(d: D) -> Result<Kind, D::Error> {
    keyed("kind", d)
}

fn window_key<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Span>, D::Error> {
    keyed("window", d)
}

fn time_zone_key<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    keyed("time_zone", d)
}

fn also_key<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Also>, D::Error> {
    keyed("also", d)
}

fn keep_windows_key<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    keyed("keep_windows", d)
}

/// The `[[counters]]` array, each table's type error prefixed with the counter's key
/// ([`counter_key`]): `counters.downloads.window: unknown variant ...`,
/// `counters.downloads: unknown field ...`.
pub(super) fn deserialize_list<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Vec<CounterConfig>, D::Error> {
    struct List;
    impl<'de> Visitor<'de> for List {
        type Value = Vec<CounterConfig>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("[[counters]] tables")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut list = Vec::new();
            // Each table read whole first, so that an error in it can name the counter.
            while let Some(table) = seq.next_element::<toml::Value>()? {
                let name = table.get("name").and_then(toml::Value::as_str);
                let key = counter_key(list.len(), name, "");
                match CounterConfig::deserialize(table) {
                    Ok(counter) => list.push(counter),
                    Err(e) => {
                        let e = e.to_string();
                        let e = e.trim_end();
                        return Err(A::Error::custom(match e.strip_prefix('.') {
                            Some(keyed) => format!("{key}.{keyed}"),
                            None => format!("{key}: {e}"),
                        }));
                    }
                }
            }
            Ok(list)
        }
    }
    d.deserialize_seq(List)
}

/// How an error names key `key` of the `i`th counter (`""`: the counter itself):
/// `counters.<name>.<key>`, as a reload names it, or `counters[<i>].<key>` when its name is
/// missing or not a valid name.
fn counter_key(i: usize, name: Option<&str>, key: &str) -> String {
    let counter = match name.filter(|n| valid_name(n)) {
        Some(name) => format!("counters.{name}"),
        None => format!("counters[{i}]"),
    };
    match key {
        "" => counter,
        key => format!("{counter}.{key}"),
    }
}

/// 1 to 63 characters of letters, digits, '_', '-', '.' or ':'.
fn valid_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
}

/// Checks every counter and that names are unique; errors name `counters.<name>.<key>`.
pub(super) fn validate(counters: &[CounterConfig]) -> Result<(), ConfigError> {
    if counters.is_empty() {
        return Err(invalid(
            "counters",
            "declare at least one [[counters]] table with a name",
        ));
    }
    if counters.len() > u16::MAX as usize {
        return Err(invalid("counters", "too many counters"));
    }
    let mut seen = HashSet::new();
    for (i, counter) in counters.iter().enumerate() {
        counter.validate(i)?;
        if !seen.insert(counter.name.as_str()) {
            return Err(invalid(
                counter.key(i, "name"),
                format!("duplicate counter {:?}", counter.name),
            ));
        }
    }
    Ok(())
}

/// A plain SQL identifier: letters, digits and '_', at most 63 bytes.
fn ident(s: &str) -> bool {
    !s.is_empty() && s.len() <= 63 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

impl CounterConfig {
    /// How an error names this counter's key `key` (see [`counter_key`]); `i`: its place in
    /// the file.
    fn key(&self, i: usize, key: &str) -> String {
        counter_key(i, Some(&self.name), key)
    }

    /// Checks this counter, the `i`th in the file.
    fn validate(&self, i: usize) -> Result<(), ConfigError> {
        if !valid_name(&self.name) {
            return Err(invalid(
                self.key(i, "name"),
                "must be 1 to 63 characters of letters, digits, '_', '-', '.' or ':'",
            ));
        }
        self.validate_kind(i)?;
        if let Some(into) = &self.rollup_into {
            let table_ok = match into.table.split_once('.') {
                Some((schema, table)) => ident(schema) && ident(table),
                None => ident(&into.table),
            };
            let window_column_ok = into.window_column.as_deref().is_none_or(ident);
            if !table_ok || !ident(&into.key_column) || !ident(&into.column) || !window_column_ok {
                return Err(invalid(
                    self.key(i, "rollup_into"),
                    "table (optionally schema.table), key_column, window_column and column must \
                     be plain identifiers: letters, digits and '_'",
                ));
            }
            if let Some(column) = into.on_add.keys().find(|k| !ident(k)) {
                return Err(invalid(
                    self.key(i, "rollup_into.on_add"),
                    format!("{column:?} must be a plain identifier: letters, digits and '_'"),
                ));
            }
            let written = [
                Some(&into.key_column),
                Some(&into.column),
                into.window_column.as_ref(),
            ];
            if let Some(column) = into.on_add.keys().find(|k| written.contains(&Some(*k))) {
                return Err(invalid(
                    self.key(i, &format!("rollup_into.on_add.{column}")),
                    "names a column tallyd already writes (key_column, window_column or column)",
                ));
            }
            into.check_window(self.window)
                .map_err(|(k, reason)| invalid(self.key(i, &format!("rollup_into.{k}")), reason))?;
        }
        if self.slots == 0 || self.slots > 100_000 {
            return Err(invalid(
                self.key(i, "slots"),
                "must be between 1 and 100000",
            ));
        }
        if let Some(m) = &self.statsd {
            m.check()
                .map_err(|reason| invalid(self.key(i, "statsd"), reason))?;
        }
        self.validate_window(i)
    }

    /// `log2m` and `regwidth` only for a unique counter, within what postgresql-hll builds and
    /// estimates well; `rollup_into` not for `last`, nor for a windowed counter of another kind
    /// than sum.
    fn validate_kind(&self, i: usize) -> Result<(), ConfigError> {
        let key = |k: &str| self.key(i, k);
        if self.kind != Kind::Unique {
            for (k, set) in [
                ("log2m", self.log2m.is_some()),
                ("regwidth", self.regwidth.is_some()),
            ] {
                if set {
                    return Err(invalid(
                        key(k),
                        format!(
                            "only with kind = \"unique\" (this counter is {:?})",
                            self.kind.name()
                        ),
                    ));
                }
            }
        }
        if let Some(log2m) = self.log2m {
            if !(hll::LOG2M_MIN..=hll::LOG2M_MAX).contains(&log2m) {
                return Err(invalid(
                    key("log2m"),
                    format!("must be between {} and {}", hll::LOG2M_MIN, hll::LOG2M_MAX),
                ));
            }
        }
        if let Some(regwidth) = self.regwidth {
            if !(1..=REGWIDTH_ESTIMABLE_MAX).contains(&regwidth) {
                return Err(invalid(
                    key("regwidth"),
                    format!(
                        "must be between 1 and {REGWIDTH_ESTIMABLE_MAX} (postgresql-hll 2.17 \
                         estimates NaN for wider registers)"
                    ),
                ));
            }
        }
        let refused = match (self.kind, self.window) {
            (Kind::Last, _) => Some(
                "a last value is merged by its event time, which an application's column does \
                 not keep; read tallyd.totals (its `value`) instead",
            ),
            (Kind::Unique | Kind::Max | Kind::Min, Some(_)) => Some(
                "a windowed counter of this kind folds into tallyd.rollups; read \
                 tallyd.window_totals or tallyd.unique_totals",
            ),
            _ => None,
        };
        if let (Some(why), true) = (refused, self.rollup_into.is_some()) {
            return Err(invalid(
                key("rollup_into"),
                format!("not for a {} counter: {why}", self.kind.name()),
            ));
        }
        Ok(())
    }

    /// A unique counter's sketch parameters: `log2m` and `regwidth` as declared, the rest (and
    /// what is not declared) the extension's defaults ([`Params::default`]: log2m 11, regwidth
    /// 5, expthresh -1 (auto), sparse on), as `hll_add_agg(hash, log2m, regwidth)` builds;
    /// `None` for the other kinds.
    pub fn sketch_params(&self) -> Option<Params> {
        (self.kind == Kind::Unique).then(|| {
            let d = Params::default();
            Params::new(
                self.log2m.unwrap_or(d.log2m()),
                self.regwidth.unwrap_or(d.regwidth()),
                d.expthresh(),
                d.sparseon(),
            )
            .expect("validated")
        })
    }

    /// The window keys: `time_zone`, `also` and `keep_windows` only with `window`; the zone in
    /// the system's database; `also` coarser than `window`, each once.
    fn validate_window(&self, i: usize) -> Result<(), ConfigError> {
        let key = |k: &str| self.key(i, k);
        let Some(span) = self.window else {
            let set = [
                ("time_zone", self.time_zone.is_some()),
                ("also", !self.also.is_empty()),
                ("keep_windows", self.keep_windows.is_some()),
            ];
            return match set.iter().find(|(_, set)| *set) {
                Some((k, _)) => Err(invalid(
                    key(k),
                    "needs window: without a window a counter keeps one all-time total per key",
                )),
                None => Ok(()),
            };
        };
        Window::new(span, self.time_zone())
            .map_err(|e| invalid(key("time_zone"), e.to_string()))?;
        let mut seen = HashSet::new();
        for also in &self.also {
            if !seen.insert(also) {
                return Err(invalid(
                    key("also"),
                    format!("{:?} is listed twice", also.name()),
                ));
            }
            let Also::Window(coarse) = *also else {
                continue;
            };
            if !coarse.contains(span) {
                let allowed: Vec<String> = Span::ALL
                    .into_iter()
                    .filter(|s| s.contains(span))
                    .map(|s| format!("{:?}", s.name()))
                    .chain(["\"all\"".to_string()])
                    .collect();
                let why = if coarse == span {
                    format!("{:?} is the window itself", coarse.name())
                } else if span.contains(coarse) {
                    format!("{:?} is finer than the window", coarse.name())
                } else {
                    format!("a {coarse} does not hold whole {span}s")
                };
                return Err(invalid(
                    key("also"),
                    format!(
                        "{why}; with window = {:?}, also may list {}",
                        span.name(),
                        allowed.join(", ")
                    ),
                ));
            }
        }
        if self.keep_windows == Some(0) {
            return Err(invalid(key("keep_windows"), "must be at least 1"));
        }
        Ok(())
    }

    /// The zone windows start in: `time_zone`, else UTC.
    pub fn time_zone(&self) -> &str {
        self.time_zone.as_deref().unwrap_or("UTC")
    }

    /// This counter's window in its zone (the zone's file read again, from jiff's cache when it
    /// is fresh); `None` for an all-time counter. Validation loaded it already, so an error
    /// here means the zone left the database since.
    pub fn window(&self) -> Result<Option<Window>, ConfigError> {
        self.window
            .map(|span| Window::new(span, self.time_zone()))
            .transpose()
            .map_err(|e| invalid(format!("counters.{}.time_zone", self.name), e.to_string()))
    }

    /// The coarser spans of `also`, finest first.
    pub fn also_spans(&self) -> Vec<Span> {
        let mut spans: Vec<Span> = self
            .also
            .iter()
            .filter_map(|a| match a {
                Also::Window(span) => Some(*span),
                Also::All => None,
            })
            .collect();
        spans.sort();
        spans
    }

    /// Whether the all-time total is kept: every counter without a window, and a windowed one
    /// whose `also` lists `all`.
    pub fn all_time(&self) -> bool {
        self.window.is_none() || self.also.contains(&Also::All)
    }
}

/// The widest register a counter may declare, narrower than the widest the extension builds
/// (7): postgresql-hll 2.17's cardinality of a full sketch with 6- or 7-bit registers is NaN.
const REGWIDTH_ESTIMABLE_MAX: u32 = 5;

/// A counter's `[counters.statsd]` table.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct CounterStatsd {
    /// The statsd metric name this counter takes, or a pattern with one `*`.
    pub metric: String,
    /// The tag whose value is the key; unset: the part of `metric` matched by `*`.
    #[serde(default)]
    pub key_tag: Option<String>,
    /// What to do with a sampled line (`|@rate` below 1).
    #[serde(default)]
    pub sampled: Sampled,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Sampled {
    /// Rejected with reason `sampled`: it cannot be counted exactly.
    #[default]
    Reject,
    /// Counted as value / rate, rounded: approximate.
    Scale,
}

impl CounterStatsd {
    /// Why this mapping is unusable, if it is.
    pub fn check(&self) -> Result<(), String> {
        let stars = self.metric.matches('*').count();
        if self.metric.is_empty() || self.metric.contains(['|', ':', ' ', '\n']) {
            return Err("metric must be a statsd metric name (no '|', ':' or spaces)".into());
        }
        match (stars, &self.key_tag) {
            (0, None) => {
                Err("set key_tag, or put one '*' in metric to take the key from the name".into())
            }
            (0 | 1, _) => Ok(()),
            _ => Err("metric may hold at most one '*'".into()),
        }
        .and_then(|()| match &self.key_tag {
            Some(t) if t.is_empty() || t.contains([',', ':', '|', ' ']) => {
                Err("key_tag must be a tag name (no ',', ':', '|' or spaces)".into())
            }
            _ => Ok(()),
        })
    }
}
