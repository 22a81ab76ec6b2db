//! tallyd: a daemon beside the application that absorbs hot counter writes for PostgreSQL.
//!
//! # Layout
//! Modules follow the data path, in the order an event travels:
//! - [`protocol`]: framing bytes into lines and parsing a line into an event (no allocation per line).
//! - [`listener`]: the Unix stream and datagram sockets, connections, routing events to buckets.
//! - [`routing`]: the stable key hash, bucket and logical-shard choice, the database layout.
//! - [`bucket`]: bucket actors that coalesce events per (counter, key) until drained.
//! - [`journal`]: accepted events on disk until committed, replayed exactly once after a crash.
//! - [`flush`]: flush workers writing drained aggregates as batched, slotted upserts, exactly once.
//! - [`rollup`]: the schedule that folds slot rows into the summary (`tallyd.rollup()` in SQL).
//! - [`store`]: connections, which databases and private PostgreSQL clusters (open, migrate,
//!   stop), migrations, the instance lease, journal coverage in the ledger and shard moves.
//! - [`metrics`]: every exported metric, by name.
//! - [`config`]: config.toml, environment overrides, validation.
//! - [`daemon`]: wiring: starts the parts in order and stops them in reverse;
//!   [`instance`]: the instance id and the data_dir lock; [`shared`]: pending-state accounting;
//!   [`throttle`]: rate-limited logging; [`clock`]: event times in Unix milliseconds.

pub mod bucket;
pub mod clock;
pub mod config;
pub mod daemon;
pub mod flush;
pub mod instance;
pub mod journal;
pub mod listener;
pub mod metrics;
pub mod protocol;
pub mod rollup;
pub mod routing;
pub mod shared;
pub mod store;
pub mod throttle;
