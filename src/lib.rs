//! tallyd: a daemon beside the application that absorbs hot counter writes for PostgreSQL.
//!
//! # Layout
//! The modules stand in layers, leaves first; each imports only from its own layer and the ones
//! before it (docs/design.md, "Layering", which `tests/layout.rs` checks against the imports).
//! - Leaves: [`clock`] (event times in Unix milliseconds), [`io_error`] (the one I/O error
//!   type), [`throttle`] (rate-limited logging), [`live`] (a setting a reload swaps whole),
//!   [`routing`] (the stable key hash, bucket and logical-shard choice, the database layout),
//!   [`protocol`] (framing bytes into lines and parsing a line into an event, no allocation per
//!   line), [`service`] (systemd: READY/RELOADING/STOPPING notifications, the watchdog,
//!   socket activation), [`window`] (the time window of an event time, in a time zone), [`hll`]
//!   (HyperLogLog sketches in postgresql-hll's storage format, its hash, union and
//!   cardinality), [`kind`] (the counter kinds: their names, the value a key keeps and the one
//!   merge of each kind, in Rust and as SQL text).
//! - Settings, identity and reports: [`config`] (config.toml, environment overrides,
//!   validation, and the counter model: one resolved counter per id, the table a reload
//!   swaps), [`instance`] (the instance id, the data_dir and its lock), [`logging`] (the log
//!   filter and format, replaceable by a reload), [`health`] (the phase and each database's
//!   state, as the parts report them), [`metrics`] (every exported metric).
//! - [`events`]: a metric and its rate-limited log line, emitted together.
//! - The database: [`store`] (connections, which databases and private PostgreSQL clusters,
//!   migrations, Citus, shard moves, the instance lease, journal coverage).
//! - State and I/O: [`shared`] (pending-state accounting), [`bucket`] (actors that coalesce
//!   events per (counter, key) until drained), [`journal`] (accepted lines on disk until
//!   committed, replayed exactly once after a crash), [`socket`] (binding Unix sockets,
//!   reading datagrams), [`conns`] (stream connections whatever their protocol: accepting
//!   within the limits, the descriptor budget, idle eviction, waiting for bytes).
//! - Pipelines: [`ingest`] (from bytes to routed events, for every transport), [`batch`]
//!   (idempotent batches: held until their id is claimed, then routed), [`listener`]
//!   (the native stream and datagram sockets, connections), [`statsd`] (statsd / DogStatsD
//!   counter lines on their own sockets), [`flush`] (flush workers writing drained aggregates as
//!   batched, slotted upserts, exactly once), [`rollup`] (the schedule that folds slot rows into
//!   the summary, `tallyd.rollup()` in SQL).
//! - The view: [`status`] (readiness and the status view).
//! - Wiring: [`reload`] (SIGHUP / `tallyd reload`: re-read config.toml, apply what may change
//!   live), [`daemon`] (starts the parts in order and stops them in reverse).
//! - Surfaces: [`http`] (the endpoints on `metrics.listen`: /metrics, /healthz, /readyz,
//!   /status), [`cli`] (the `tallyd` commands); the binary (`src/main.rs`) only parses the
//!   command line.
//!
//! # Public surface
//! The users of this library are the binary (`src/main.rs`), the integration tests (`tests/`)
//! and the benchmark (`bench/`); only what they use is public. The modules the daemon wires
//! internally (flush, shared accounting, throttled logging) are private, so they can
//! change without touching anything outside the crate.

// Public: each is used by the binary, the tests or the benchmark.
/// The benchmark measures coalescing directly (`Batch`, `Pending`, key hashing).
pub mod bucket;
/// The commands of the `tallyd` binary (src/main.rs parses the command line only).
pub mod cli;
/// The clock events are stamped with (ms since the Unix epoch), so a test can bound
/// `first_seen` / `last_seen` by the same clock.
pub mod clock;
pub mod config;
pub mod daemon;
/// The daemon's health (phase, databases) as its parts report it.
pub mod health;
/// HyperLogLog sketches as postgresql-hll stores them: the tests check them against the
/// extension.
pub mod hll;
/// The HTTP endpoints: the binary starts them, `tallyd status` reads them.
pub mod http;
/// From bytes to routed events, for every transport: the schema, the router, the replay.
pub mod ingest;
/// The instance id and the data_dir lock: the binary takes the lock before anything else.
pub mod instance;
/// The one I/O error type every module's error wraps (`{what} {path}: {cause}`).
pub mod io_error;
/// Public only for now: its start-up damage summary (`OldJournal::damage`) is read by nothing
/// but its unit tests, so private it fails the dead-code lint.
pub mod journal;
/// The counter kinds and their merges: the config, the protocol, the buckets, the flush and the
/// store read them, the benchmark and the tests check them.
pub mod kind;
/// `Listeners::bind`: tests and the binary bind the sockets before `daemon::run`.
pub mod listener;
/// The binary sets up logging through it, so that a reload can change level and format.
pub mod logging;
pub mod metrics;
pub mod protocol;
/// The binary passes the reload requests (SIGHUP) to `daemon::run_reloadable`.
pub mod reload;
pub mod rollup;
/// Key hashing and the layout: `tallyd get` and the shard tests route keys as the daemon does.
pub mod routing;
/// systemd: readiness and stop notifications, the watchdog, socket activation.
pub mod service;
/// Binding Unix sockets (stale files, modes, systemd's) and reading datagrams.
pub mod socket;
/// The statsd listeners and their config (`[statsd]`, `[counters.statsd]`).
pub mod statsd;
/// Readiness and the status view: the binary and the tests read them.
pub mod status;
pub mod store;
/// Time windows (minute to month, in a time zone): the config and the pipeline read them.
pub mod window;

// Private: wired by `daemon`, reached from outside only through it.
/// Idempotent batches: held payloads, their claims, their routing.
mod batch;
/// Stream connections, for the native listener and statsd alike.
mod conns;
/// Internal events: a metric and its rate-limited log line emitted together.
mod events;
mod flush;
mod live;
mod shared;
mod throttle;
