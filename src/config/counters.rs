//! The `[[counters]]` tables: the counters tallyd accepts, their key type, slots and rollup target.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};
use crate::protocol::KeyType;

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
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
    pub statsd: Option<CounterStatsd>,
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

/// Checks every counter and that names are unique; errors name `counters[i].<key>`.
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
                format!("counters[{i}].name"),
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
    /// Checks this counter, the `i`th in the file.
    fn validate(&self, i: usize) -> Result<(), ConfigError> {
        let name = self.name.as_bytes();
        if name.is_empty()
            || name.len() > 63
            || !name
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
        {
            return Err(invalid(
                format!("counters[{i}].name"),
                "must be 1 to 63 characters of letters, digits, '_', '-', '.' or ':'",
            ));
        }
        if let Some(into) = &self.rollup_into {
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
        if self.slots == 0 || self.slots > 100_000 {
            return Err(invalid(
                format!("counters[{i}].slots"),
                "must be between 1 and 100000",
            ));
        }
        if let Some(m) = &self.statsd {
            m.check()
                .map_err(|reason| invalid(format!("counters[{i}].statsd"), reason))?;
        }
        Ok(())
    }
}

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

/// What the flush workers (and the status view) know of a counter, by index.
#[derive(Clone, Debug)]
pub struct CounterInfo {
    pub name: String,
    pub slots: u32,
}

impl CounterInfo {
    pub fn new(name: &str, slots: u32) -> CounterInfo {
        CounterInfo {
            name: name.to_string(),
            slots,
        }
    }
}
