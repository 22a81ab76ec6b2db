//! The `[database]` section: which PostgreSQL databases tallyd writes to and how keys are spread
//! over them.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// `embedded` (a private cluster under `data_dir/postgres`) or a `postgres://` URL / libpq key=value string.
    pub url: String,
    /// Extra server settings for the embedded cluster, passed as `-c name=value`.
    pub embedded_settings: std::collections::BTreeMap<String, String>,
    /// Apply migrations on start.
    pub migrate: bool,
    connect_timeout_ms: u64,
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

super::durations!(DatabaseConfig {
    connect_timeout_ms => connect_timeout, set_connect_timeout;
});

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

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let dbs = self.databases().len();
        if dbs > 256 {
            return Err(invalid("database.shards", "at most 256 databases"));
        }
        let logical = self.logical_shards as usize;
        if logical < dbs || logical > 65_536 {
            return Err(invalid(
                "database.logical_shards",
                format!("must be between the number of databases ({dbs}) and 65536"),
            ));
        }
        let map = &self.shard_map;
        if !map.is_empty() && (map.len() != logical || map.iter().any(|&d| d as usize >= dbs)) {
            return Err(invalid(
                "database.shard_map",
                format!(
                    "must list a database index below {dbs} for each of the {logical} logical shards"
                ),
            ));
        }
        if self.slot_partitions > 1024 {
            return Err(invalid(
                "database.slot_partitions",
                "must be between 0 and 1024",
            ));
        }
        Ok(())
    }
}
