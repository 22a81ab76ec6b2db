//! What a counter keeps per key, and so what the field after an event's key means.

use std::fmt;

/// A counter's aggregate (`kind` in config.toml). The third field of an event line is a delta
/// for `sum` and a value for every other kind (docs/protocol.md, "Kinds").
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Deserialize, serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// The sum of the deltas (default 1): today's counters.
    #[default]
    Sum,
    /// The distinct values seen, as a postgresql-hll sketch (the value is text, hashed as
    /// `hll_hash_text` hashes it).
    Unique,
    /// The largest 64-bit integer value seen.
    Max,
    /// The smallest 64-bit integer value seen.
    Min,
    /// The 64-bit integer value of the event with the latest event time (ties: the largest).
    Last,
}

impl Kind {
    pub const ALL: [Kind; 5] = [Kind::Sum, Kind::Unique, Kind::Max, Kind::Min, Kind::Last];

    /// The config name, also the `kind` column of tallyd's tables (NULL there for `sum`).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Sum => "sum",
            Kind::Unique => "unique",
            Kind::Max => "max",
            Kind::Min => "min",
            Kind::Last => "last",
        }
    }

    /// Whether the value is a 64-bit integer (max, min, last).
    pub fn numeric(self) -> bool {
        matches!(self, Kind::Max | Kind::Min | Kind::Last)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
