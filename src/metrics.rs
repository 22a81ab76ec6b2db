//! Every metric tallyd exports: names, help texts and the small helpers the data path calls.
//! The dashboards (dashboards/) and docs/operations.md are written against this list.
//!
//! Labels are bounded: `counter` takes only names from config, `reason` only [`Reject`] names,
//! `database` only the index of a configured database, never a key.

use std::time::Duration;

use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

use crate::protocol::Reject;

pub const EVENTS_ACCEPTED: &str = "tallyd_events_accepted_total";
pub const LINES_REJECTED: &str = "tallyd_lines_rejected_total";
pub const RECEIVED_BYTES: &str = "tallyd_received_bytes_total";
pub const CONNECTIONS_OPEN: &str = "tallyd_connections_open";
pub const CONNECTIONS_ACCEPTED: &str = "tallyd_connections_accepted_total";
pub const CONNECTIONS_REFUSED: &str = "tallyd_connections_refused_total";
/// The `reason` of a refused stream connection: `listen.max_connections` reached.
pub const REFUSED_MAX_CONNECTIONS: &str = "max_connections";
/// The `reason` of a refused stream connection: the file descriptor budget reached.
pub const REFUSED_DESCRIPTORS: &str = "descriptors";
pub const CONNECTIONS_IDLE_CLOSED: &str = "tallyd_connections_idle_closed_total";
/// Connections to the HTTP endpoints closed before their request head arrived, to make room.
pub const HTTP_EVICTED: &str = "tallyd_http_connections_evicted_total";
pub const DATAGRAMS_RECEIVED: &str = "tallyd_datagrams_received_total";
pub const PENDING_KEYS: &str = "tallyd_pending_keys";
pub const PENDING_EVENTS: &str = "tallyd_pending_events";
/// Histogram of connection pauses by back-pressure (the journal's cap, a failing journal, or
/// without a journal `coalesce.max_pending_keys`), recorded when each ends: `_count` is the
/// number of pauses, `_sum` the seconds spent paused.
pub const BACKPRESSURE_PAUSE: &str = "tallyd_backpressure_pause_seconds";
/// Connections paused by back-pressure now: what shows a pause while it lasts (the histogram
/// sees it only once it ends).
pub const BACKPRESSURE_PAUSED: &str = "tallyd_backpressure_paused_connections";
/// Committed batches settled, by outcome: `counted`, `counted_in_part` (with shards, another
/// copy claimed some databases first), `duplicate`.
pub const BATCHES: &str = "tallyd_batches_total";
/// Committed batches held in `data_dir/batches`, not yet routed or dropped.
pub const BATCHES_HELD: &str = "tallyd_batches_held";
/// Per database, batch ids remembered in `tallyd.batches` (counted every 10 s).
pub const BATCH_IDS_REMEMBERED: &str = "tallyd_batch_ids_remembered";
/// Per database, when the oldest remembered batch id was claimed (Unix seconds; 0: none).
pub const BATCH_OLDEST_CLAIM: &str = "tallyd_batch_oldest_claim_timestamp_seconds";
pub const FLUSHES: &str = "tallyd_flushes_total";
pub const FLUSH_ROWS: &str = "tallyd_flush_rows_total";
pub const FLUSH_EVENTS: &str = "tallyd_flush_events_total";
pub const FLUSH_DURATION: &str = "tallyd_flush_duration_seconds";
pub const FLUSH_ERRORS: &str = "tallyd_flush_errors_total";
pub const FLUSH_RETRIES: &str = "tallyd_flush_retries_total";
/// Flights written again through `tallyd.slots` after a direct write of a `rollup_into`
/// counter failed, by counter and database.
pub const DIRECT_FALLBACKS: &str = "tallyd_flush_direct_fallbacks_total";
/// Unique counters' rows a flush worker holds back while the hll extension is missing, by
/// database and worker (src/flush/held.rs).
pub const UNIQUE_HELD: &str = "tallyd_flush_unique_rows_held";
pub const FRESHNESS: &str = "tallyd_event_to_commit_seconds";
pub const ROLLUP_RUNS: &str = "tallyd_rollup_runs_total";
pub const ROLLUP_ROWS: &str = "tallyd_rollup_rows_total";
pub const ROLLUP_DURATION: &str = "tallyd_rollup_duration_seconds";
pub const ROLLUP_ERRORS: &str = "tallyd_rollup_errors_total";
pub const ROLLUP_UNMATCHED: &str = "tallyd_rollup_unmatched_keys";
pub const ROLLUP_OVERFLOW: &str = "tallyd_rollup_overflow_keys";
/// Slot rows of `insert_missing` targets held back because inserting their row failed on a
/// foreign key (the parent row is missing), by counter and database.
pub const ROLLUP_HELD_BACK: &str = "tallyd_rollup_held_back_rows";
/// How long the longest-held of those keys has been held, by counter and database.
pub const ROLLUP_HELD_BACK_OLDEST: &str = "tallyd_rollup_held_back_oldest_seconds";
pub const SLOT_ROWS: &str = "tallyd_slot_rows";
/// How far behind the rollup is, by database: seconds since the oldest last-completed pass of its
/// units began (a slot row written before then has been folded, unless held back).
pub const ROLLUP_LAG: &str = "tallyd_rollup_lag_seconds";
/// Per database, 1 while it is reachable (the last connection or round trip to it worked).
pub const DATABASE_UP: &str = "tallyd_database_up";
/// Per database, 1 while its flushes fail (the last attempt failed, reachable or not).
pub const FLUSH_FAILING: &str = "tallyd_flush_failing";
/// Per flush worker: age of the oldest event of the flight it is writing; grows while a flush
/// is stuck or failing, 0 when the worker is idle.
pub const FLUSH_OLDEST_PENDING: &str = "tallyd_flush_oldest_pending_seconds";
pub const BUILD_INFO: &str = "tallyd_build_info";
pub const JOURNAL_ERRORS: &str = "tallyd_journal_errors_total";
pub const JOURNAL_REPLAYED: &str = "tallyd_journal_replayed_events_total";
/// 1 while journal writes fail (`!sync` answers errors, connections do not read), else 0.
pub const JOURNAL_FAILING: &str = "tallyd_journal_writes_failing";
/// Bytes of journal segments on disk (not yet deleted), what `journal.max_bytes` bounds.
pub const JOURNAL_BYTES: &str = "tallyd_journal_bytes";
/// 1 while the journal is at `journal.max_bytes` (connections do not read), else 0.
pub const JOURNAL_FULL: &str = "tallyd_journal_full";
/// The start (Unix seconds) of the oldest window the last flush with rows of a windowed counter
/// wrote, by counter: how late its latest late events were.
pub const WINDOW_OLDEST_WRITTEN: &str = "tallyd_window_oldest_written_seconds";
/// Rows of windows older than a counter's `keep_windows`, deleted by the rollup, by counter.
pub const WINDOW_ROWS_EXPIRED: &str = "tallyd_window_rows_expired_total";
/// Events journaled only, at the memory cap, to be routed later (the outage bounded by disk).
pub const JOURNAL_SPILLED_EVENTS: &str = "tallyd_journal_spilled_events_total";
/// Spilled events read back from the journal and routed to the buckets.
pub const JOURNAL_FOLDED_EVENTS: &str = "tallyd_journal_folded_events_total";
/// Spilled records not yet routed.
pub const JOURNAL_UNFOLDED_RECORDS: &str = "tallyd_journal_unfolded_records";
pub const JOURNAL_UNREADABLE_RECORDS: &str = "tallyd_journal_unreadable_records_total";
pub const JOURNAL_UNREADABLE_BYTES: &str = "tallyd_journal_unreadable_bytes_total";
pub const JOURNAL_MISSING_RECORDS: &str = "tallyd_journal_missing_records_total";
/// Files in `journal/damaged/`: damaged segments moved aside at start and notes of missing
/// records, until an operator removes them.
pub const JOURNAL_DAMAGED_FILES: &str = "tallyd_journal_damaged_files";
pub const STATSD_IGNORED: &str = "tallyd_statsd_ignored_total";
pub const STATSD_UDP_DROPPED: &str = "tallyd_statsd_udp_dropped_total";
/// Reloads of config.toml (SIGHUP, `tallyd reload`), by `result`: `ok`, `invalid`, `refused`.
pub const CONFIG_RELOADS: &str = "tallyd_config_reloads_total";
/// 1 when the last reload was applied (or none was tried since the start), else 0.
pub const CONFIG_LAST_RELOAD_OK: &str = "tallyd_config_last_reload_successful";
/// When the configuration in force was loaded: the start, or the last applied reload.
pub const CONFIG_LAST_RELOAD_SUCCESS: &str = "tallyd_config_last_reload_success_timestamp_seconds";
/// Prefix of the process metrics (`tallyd_process_cpu_seconds_total`,
/// `tallyd_process_resident_memory_bytes`, ...) exported by the `metrics-process` collector.
pub const PROCESS_PREFIX: &str = "tallyd_";
/// How often the process metrics are refreshed.
pub const PROCESS_COLLECT_INTERVAL: Duration = Duration::from_secs(5);

/// Seconds: 1 ms to 30 s, roughly doubling.
const DURATION_BUCKETS: [f64; 16] = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0,
];
/// Event-to-commit age: around the flush interval (1 s by default) up to minutes of outage.
const FRESHNESS_BUCKETS: [f64; 18] = [
    0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0,
    300.0, 600.0,
];
/// Back-pressure pauses last until a flush commits: a few ms normally, minutes in an outage.
const PAUSE_BUCKETS: [f64; 16] = [
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot start the metrics recorder: {0}")]
    Install(metrics_exporter_prometheus::BuildError),
}

// Not `#[from]`: the message prints the cause, so it must not be the `source()` as well.
impl From<metrics_exporter_prometheus::BuildError> for MetricsError {
    fn from(err: metrics_exporter_prometheus::BuildError) -> MetricsError {
        MetricsError::Install(err)
    }
}

/// How often the recorder's upkeep runs (drains histogram data so that it does not grow).
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Installs the recorder, describes every metric, creates the unlabelled series at zero and
/// starts the process-metrics collector and the recorder's upkeep. Returns the handle whose
/// `render()` is the scrape (served on /metrics by [`crate::http`]). Must run inside a tokio
/// runtime.
pub fn install_recorder() -> Result<PrometheusHandle, MetricsError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(FLUSH_DURATION.into()), &DURATION_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(ROLLUP_DURATION.into()), &DURATION_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(FRESHNESS.into()), &FRESHNESS_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(BACKPRESSURE_PAUSE.into()), &PAUSE_BUCKETS)?
        .install_recorder()?;
    describe();
    register_zeroes();
    // These live as long as the runtime: the daemon exits with it.
    spawn_process_collector(CancellationToken::new());
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(UPKEEP_INTERVAL);
        loop {
            ticker.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// Refreshes the process metrics (CPU, memory, file descriptors, threads) now and then every
/// [`PROCESS_COLLECT_INTERVAL`] until `stop`. Must run inside a tokio runtime.
pub fn spawn_process_collector(stop: CancellationToken) -> tokio::task::JoinHandle<()> {
    let collector = metrics_process::Collector::new(PROCESS_PREFIX);
    collector.describe();
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(PROCESS_COLLECT_INTERVAL);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => collector.collect(),
                _ = stop.cancelled() => return,
            }
        }
    })
}

/// Counts the files in `dir` (data_dir/journal/damaged/) now and then every
/// [`PROCESS_COLLECT_INTERVAL`]: damage found at start stays reported, whenever Prometheus
/// first scrapes, until an operator removes the files. Must run inside a tokio runtime.
pub fn spawn_damage_collector(dir: std::path::PathBuf) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(PROCESS_COLLECT_INTERVAL);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let files = std::fs::read_dir(&dir).map_or(0, |d| d.filter_map(Result::ok).count());
            gauge!(JOURNAL_DAMAGED_FILES).set(files as f64);
        }
    })
}

/// Creates at 0 the labelled series whose label values the config gives (counter names,
/// database indexes), so that dashboards and alerts see them before their first event. Call
/// after [`install`].
pub fn register_known(counters: &[String], databases: usize) {
    register_counters(counters, databases);
    for database in 0..databases {
        database_up(database, false);
        gauge!(ROLLUP_LAG, "database" => database.to_string()).set(0.0);
        flush_failing(database, false);
    }
}

/// The per-counter series of `counters`, at 0: at the start, and for the counters a reload adds
/// (never for a running one: that would reset its totals).
pub fn register_counters(counters: &[String], databases: usize) {
    for name in counters {
        counter!(EVENTS_ACCEPTED, "counter" => name.clone()).absolute(0);
        // 0 until a flush writes a window of a windowed counter (all-time counters stay at 0).
        gauge!(WINDOW_OLDEST_WRITTEN, "counter" => name.clone()).set(0.0);
        counter!(WINDOW_ROWS_EXPIRED, "counter" => name.clone()).absolute(0);
        for database in 0..databases {
            gauge!(ROLLUP_UNMATCHED, "counter" => name.clone(), "database" => database.to_string())
                .set(0.0);
            counter!(DIRECT_FALLBACKS, "counter" => name.clone(), "database" => database.to_string())
                .absolute(0);
            rollup_overflow(name, database, 0);
            rollup_held_back(name, database, 0, Duration::ZERO);
        }
    }
}

/// Creates the series that would otherwise appear only with their first event, so that they
/// scrape as 0 from the start: `rate()` and `increase()` then count the first event too, and
/// alerts on them are not blind until something has gone wrong once.
fn register_zeroes() {
    for reason in Reject::ALL {
        counter!(LINES_REJECTED, "reason" => reason.as_str()).absolute(0);
    }
    for name in [
        RECEIVED_BYTES,
        CONNECTIONS_ACCEPTED,
        CONNECTIONS_IDLE_CLOSED,
        HTTP_EVICTED,
        DATAGRAMS_RECEIVED,
        FLUSHES,
        FLUSH_ROWS,
        FLUSH_EVENTS,
        FLUSH_ERRORS,
        FLUSH_RETRIES,
        ROLLUP_RUNS,
        ROLLUP_ROWS,
        ROLLUP_ERRORS,
        JOURNAL_ERRORS,
        JOURNAL_REPLAYED,
        JOURNAL_UNREADABLE_RECORDS,
        JOURNAL_UNREADABLE_BYTES,
        JOURNAL_MISSING_RECORDS,
        JOURNAL_SPILLED_EVENTS,
        JOURNAL_FOLDED_EVENTS,
        STATSD_UDP_DROPPED,
    ] {
        counter!(name).absolute(0);
    }
    for kind in ["event", "service_check"] {
        counter!(STATSD_IGNORED, "kind" => kind).absolute(0);
    }
    for reason in [REFUSED_MAX_CONNECTIONS, REFUSED_DESCRIPTORS] {
        counter!(CONNECTIONS_REFUSED, "reason" => reason).absolute(0);
    }
    for name in [
        CONNECTIONS_OPEN,
        PENDING_KEYS,
        PENDING_EVENTS,
        BACKPRESSURE_PAUSED,
        JOURNAL_DAMAGED_FILES,
        JOURNAL_FAILING,
        JOURNAL_BYTES,
        JOURNAL_FULL,
        JOURNAL_UNFOLDED_RECORDS,
    ] {
        gauge!(name).set(0.0);
    }
    for name in [
        FLUSH_DURATION,
        FRESHNESS,
        ROLLUP_DURATION,
        BACKPRESSURE_PAUSE,
    ] {
        // Registering is enough: the exporter renders an empty histogram (count 0).
        let _ = histogram!(name);
    }
}

pub fn describe() {
    describe_counter!(EVENTS_ACCEPTED, "Events accepted, by counter.");
    describe_counter!(LINES_REJECTED, "Lines rejected, by reason.");
    describe_counter!(
        RECEIVED_BYTES,
        Unit::Bytes,
        "Bytes read from stream connections and datagrams."
    );
    describe_gauge!(CONNECTIONS_OPEN, "Stream connections open now.");
    describe_counter!(
        BATCHES,
        "Committed batches settled, by outcome (counted, counted_in_part, duplicate)."
    );
    describe_gauge!(
        BATCHES_HELD,
        "Committed batches held in data_dir/batches, not yet routed or dropped."
    );
    describe_gauge!(
        BATCH_IDS_REMEMBERED,
        "Batch ids remembered in tallyd.batches, by database."
    );
    describe_gauge!(
        BATCH_OLDEST_CLAIM,
        Unit::Seconds,
        "When the oldest remembered batch id was claimed (Unix time), by database."
    );
    describe_counter!(CONNECTIONS_ACCEPTED, "Stream connections accepted.");
    describe_counter!(
        CONNECTIONS_REFUSED,
        "Stream connections refused, by reason: max_connections (listen.max_connections open, none idle long enough to give way) or descriptors (the stream connections' share of the file descriptor limit in use)."
    );
    describe_counter!(
        CONNECTIONS_IDLE_CLOSED,
        "Idle stream connections closed: idle for listen.idle_timeout_ms, or the longest idle one at listen.max_connections to admit a new one."
    );
    describe_counter!(
        HTTP_EVICTED,
        "Connections to the HTTP endpoints (metrics.listen) closed before sending a whole request head, to make room for a new one while all 32 were taken."
    );
    describe_counter!(DATAGRAMS_RECEIVED, "Datagrams received.");
    describe_gauge!(
        PENDING_KEYS,
        "Distinct (counter, key) aggregates in memory, not yet committed."
    );
    describe_gauge!(PENDING_EVENTS, "Events in memory, not yet committed.");
    describe_histogram!(
        BACKPRESSURE_PAUSE,
        Unit::Seconds,
        "Pauses of a connection's reading while the journal is full or failing, or, without a journal, at coalesce.max_pending_keys, recorded when each ends (count: pauses, sum: seconds paused)."
    );
    describe_gauge!(
        BACKPRESSURE_PAUSED,
        "Stream connections (native and statsd) whose reading is paused by back-pressure now: the journal is full or failing, or, without a journal, coalesce.max_pending_keys is reached."
    );
    describe_counter!(FLUSHES, "Flush transactions committed.");
    describe_counter!(FLUSH_ROWS, "Slot rows upserted by committed flushes.");
    describe_counter!(FLUSH_EVENTS, "Events covered by committed flushes.");
    describe_histogram!(
        FLUSH_DURATION,
        Unit::Seconds,
        "Duration of a committed flush transaction."
    );
    describe_counter!(FLUSH_ERRORS, "Flush attempts that failed.");
    describe_counter!(
        FLUSH_RETRIES,
        "Flush attempts that were retries of a failed one."
    );
    describe_histogram!(
        FRESHNESS,
        Unit::Seconds,
        "Age of the oldest event of a flush when it commits."
    );
    describe_counter!(
        DIRECT_FALLBACKS,
        "Flights written again through tallyd.slots because a direct write into a rollup_into table failed (a lock held past 200 ms, a foreign key, an overflow, a missing column), by counter and database; the counter then writes through tallyd.slots for 10 s, doubling at each failure in a row up to 10 minutes."
    );
    describe_gauge!(
        UNIQUE_HELD,
        "Unique counters' rows a flush worker holds back because the database lacks the hll extension (dropped), by database and worker: the worker's other rows commit; these commit once CREATE EXTENSION hll is run."
    );
    describe_counter!(ROLLUP_RUNS, "Rollup steps run by this daemon.");
    describe_counter!(
        ROLLUP_ROWS,
        "Slot rows folded into the summary by this daemon's rollups."
    );
    describe_histogram!(
        ROLLUP_DURATION,
        Unit::Seconds,
        "Duration of one rollup step."
    );
    describe_counter!(ROLLUP_ERRORS, "Rollup steps that failed.");
    describe_gauge!(
        ROLLUP_UNMATCHED,
        "Slot rows held back because their key has no row in the rollup_into table, by counter and database."
    );
    describe_gauge!(
        ROLLUP_OVERFLOW,
        "Keys the rollup holds back in tallyd.slots because their folded total would leave the 64-bit range (see tallyd.rollup_rejects), by counter and database."
    );
    describe_gauge!(
        ROLLUP_HELD_BACK,
        "Slot rows held back because inserting their rollup_into row failed on a foreign key (the parent row does not exist yet, or was deleted; see tallyd.held_back()), by counter and database."
    );
    describe_gauge!(
        ROLLUP_HELD_BACK_OLDEST,
        "Seconds since the longest-held of those keys was first held (0 without any): a key whose parent row was deleted stays held until tallyd forget drops it, by counter and database."
    );
    describe_gauge!(
        ROLLUP_LAG,
        Unit::Seconds,
        "How far behind the rollup is, by database: seconds since the oldest last-completed pass over a counter's keys began (slot rows written before it have been folded, unless held back)."
    );
    describe_gauge!(
        SLOT_ROWS,
        "Rows in tallyd.slots waiting to be rolled up (estimate), by database."
    );
    describe_gauge!(
        DATABASE_UP,
        "1 while the database (label: its index in the shard map) is reachable: the last connection or round trip to it (a flush, the instance lease's heartbeat every third of daemon.instance_lease_ms, a rollup) worked, even if the server refused a statement; 0 when it could not be reached."
    );
    describe_gauge!(
        FLUSH_FAILING,
        "1 while flushes into the database (label: its index in the shard map) fail: the last attempt failed, whether the database was unreachable or refused it (a lock timeout, a statement timeout); 0 after a commit."
    );
    describe_gauge!(
        BUILD_INFO,
        "Always 1; the version label says which tallyd runs."
    );
    describe_gauge!(
        FLUSH_OLDEST_PENDING,
        Unit::Seconds,
        "Per flush worker, age of the oldest event of the flight it is writing (0 when idle)."
    );
    describe_counter!(JOURNAL_ERRORS, "Journal writes or fsyncs that failed.");
    describe_counter!(
        JOURNAL_REPLAYED,
        "Events replayed from the journal at start."
    );
    describe_gauge!(
        JOURNAL_FAILING,
        "1 while journal writes fail: !sync answers errors and connections stop reading until a retry succeeds."
    );
    describe_gauge!(
        JOURNAL_BYTES,
        Unit::Bytes,
        "Bytes of journal segments on disk, not yet deleted (bounded by journal.max_bytes)."
    );
    describe_gauge!(
        JOURNAL_FULL,
        "1 while the journal is at journal.max_bytes: connections stop reading until flushes commit and covered segments are deleted."
    );
    describe_gauge!(
        WINDOW_OLDEST_WRITTEN,
        Unit::Seconds,
        "Start (Unix time) of the oldest window (of any span) the last flush with rows of this windowed counter wrote: late events show as an old window. 0 until then, and for all-time counters."
    );
    describe_counter!(
        WINDOW_ROWS_EXPIRED,
        "Rows of windows older than the counter's keep_windows, deleted by the rollup (slots and rollups), by counter."
    );
    describe_counter!(
        JOURNAL_SPILLED_EVENTS,
        "Events journaled only, not put into memory: at coalesce.max_pending_keys, and after that until the spilled records are read back; routed to memory once flushes make room (intake bounded by journal.max_bytes)."
    );
    describe_counter!(
        JOURNAL_FOLDED_EVENTS,
        "Spilled events read back from the journal and routed to memory."
    );
    describe_gauge!(
        JOURNAL_UNFOLDED_RECORDS,
        "Spilled journal records not yet read back and routed to memory (set at each spill and each record the folder routes)."
    );
    describe_counter!(
        JOURNAL_UNREADABLE_RECORDS,
        "Damaged journal records found at start (not replayed)."
    );
    describe_counter!(
        JOURNAL_UNREADABLE_BYTES,
        Unit::Bytes,
        "Bytes of journal segments that could not be read at start (damage, not a torn tail)."
    );
    describe_counter!(
        JOURNAL_MISSING_RECORDS,
        "Journal sequence numbers missing between the segments found at start."
    );
    describe_gauge!(
        JOURNAL_DAMAGED_FILES,
        "Files in data_dir/journal/damaged/: damaged journal segments moved aside at start, and notes of missing records; events in them were not replayed. Stays until an operator removes them (checked every 5 s)."
    );
    describe_counter!(
        STATSD_IGNORED,
        "DogStatsD events and service checks received on the statsd sockets and ignored, by kind."
    );
    describe_counter!(
        STATSD_UDP_DROPPED,
        "Datagrams the kernel dropped on the statsd UDP socket's full receive queue (SO_RXQ_OVFL), shown with the next datagram read."
    );
    describe_counter!(
        CONFIG_RELOADS,
        "Reloads of config.toml (SIGHUP, tallyd reload), by result: ok, invalid (the file does not load or validate), refused (it changes keys that cannot change while running)."
    );
    describe_gauge!(
        CONFIG_LAST_RELOAD_OK,
        "1 when the last reload was applied (or none was tried since the start), 0 when it was invalid or refused."
    );
    describe_gauge!(
        CONFIG_LAST_RELOAD_SUCCESS,
        Unit::Seconds,
        "Unix time the configuration in force was loaded: the start, or the last applied reload."
    );
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

/// A DogStatsD event or service check, read and ignored; `kind`: "event" or "service_check".
pub fn statsd_ignored(kind: &'static str) {
    counter!(STATSD_IGNORED, "kind" => kind).increment(1);
}

pub fn connection_refused(reason: &'static str) {
    counter!(CONNECTIONS_REFUSED, "reason" => reason).increment(1);
}

pub fn rejected(reason: Reject, n: u64) {
    counter!(LINES_REJECTED, "reason" => reason.as_str()).increment(n);
}

pub fn accepted_handle(counter_name: &str) -> metrics::Counter {
    counter!(EVENTS_ACCEPTED, "counter" => counter_name.to_string())
}

/// `database` is the index of the database in config order (0 with one database).
pub fn database_up(database: usize, up: bool) {
    gauge!(DATABASE_UP, "database" => database.to_string()).set(if up { 1.0 } else { 0.0 });
}

pub fn rollup_overflow(counter_name: &str, database: usize, keys: u64) {
    gauge!(ROLLUP_OVERFLOW, "counter" => counter_name.to_string(), "database" => database.to_string())
        .set(keys as f64);
}

pub fn rollup_held_back(counter_name: &str, database: usize, slot_rows: u64, held_for: Duration) {
    gauge!(ROLLUP_HELD_BACK, "counter" => counter_name.to_string(), "database" => database.to_string())
        .set(slot_rows as f64);
    gauge!(ROLLUP_HELD_BACK_OLDEST, "counter" => counter_name.to_string(), "database" => database.to_string())
        .set(held_for.as_secs_f64());
}

pub fn flush_committed(rows: usize, events: u64, took: Duration, oldest_age: Option<Duration>) {
    counter!(FLUSHES).increment(1);
    counter!(FLUSH_ROWS).increment(rows as u64);
    counter!(FLUSH_EVENTS).increment(events);
    histogram!(FLUSH_DURATION).record(took.as_secs_f64());
    if let Some(age) = oldest_age {
        histogram!(FRESHNESS).record(age.as_secs_f64());
    }
}

pub fn flush_failed() {
    counter!(FLUSH_ERRORS).increment(1);
}

/// A flush attempt that repeats a failed one is starting.
pub fn flush_retry() {
    counter!(FLUSH_RETRIES).increment(1);
}

/// A connection's pause by back-pressure ended after `took`.
pub fn backpressure_paused(took: Duration) {
    histogram!(BACKPRESSURE_PAUSE).record(took.as_secs_f64());
}

/// A connection's pause by back-pressure began (`1.0`) or ended (`-1.0`).
pub fn backpressure_paused_connections(change: f64) {
    gauge!(BACKPRESSURE_PAUSED).increment(change);
}

/// Whether the last flush attempt into `database` failed.
pub fn flush_failing(database: usize, failing: bool) {
    gauge!(FLUSH_FAILING, "database" => database.to_string()).set(if failing { 1.0 } else { 0.0 });
}

pub fn pending(keys: usize, events: u64) {
    gauge!(PENDING_KEYS).set(keys as f64);
    gauge!(PENDING_EVENTS).set(events as f64);
}

/// Per flush worker, the age of the oldest event of the flight it is writing (0: idle).
pub fn flight_age(worker: usize, age: Duration) {
    gauge!(FLUSH_OLDEST_PENDING, "worker" => worker.to_string()).set(age.as_secs_f64());
}

pub fn journal_error() {
    counter!(JOURNAL_ERRORS).increment(1);
}

/// A reload's outcome (`ok`, `invalid`, `refused`), or `None` at the start: the configuration
/// in force was loaded then (so the series exist from the start and rate() sees the first one).
pub fn config_reloaded(result: Option<&'static str>) {
    match result {
        None => {
            for result in ["ok", "invalid", "refused"] {
                counter!(CONFIG_RELOADS, "result" => result).absolute(0);
            }
        }
        Some(result) => counter!(CONFIG_RELOADS, "result" => result).increment(1),
    }
    let ok = result.is_none_or(|r| r == "ok");
    gauge!(CONFIG_LAST_RELOAD_OK).set(if ok { 1.0 } else { 0.0 });
    if ok {
        gauge!(CONFIG_LAST_RELOAD_SUCCESS).set(crate::clock::now_seconds());
    }
}
