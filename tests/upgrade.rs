//! The V10 schema change (time windows) on a database an older tallyd wrote: every existing
//! row is kept and reads the same through `tallyd.totals` and `tallyd get`, the rollup goes on
//! folding it, and new events add to it. Rows written at every earlier schema keep exact
//! totals to the last, and a migration that deadlocks with a reader is tried again.

mod common;

use std::collections::BTreeMap;

use common::{sql, temp_dir, LineClient, TestConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_before_windows_read_the_same_after() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let mut client = sql(&conninfo).await;
    // The schema as of V9, and rows as that tallyd wrote them: slot rows of three slots and
    // summary rows.
    tallyd::store::migrate_up_to(&mut client, 9).await.unwrap();
    client
        .batch_execute(
            "INSERT INTO tallyd.slots (counter, key, slot, count, first_seen, last_seen)
             SELECT 'downloads', 'k' || (i % 50), i % 3, sum(i), now() - interval '1 day', now()
             FROM generate_series(1, 600) i GROUP BY i % 50, i % 3;
             INSERT INTO tallyd.rollups (counter, key, count, first_seen, last_seen)
             SELECT 'downloads', 'k' || i, 1000 * i, now() - interval '2 days', now() - interval '1 day'
             FROM generate_series(0, 79) i;",
        )
        .await
        .unwrap();
    let read = "SELECT key, count, first_seen::text, last_seen::text FROM tallyd.totals \
                WHERE counter = 'downloads' ORDER BY key";
    let before: Vec<(String, i64, String, String)> = client
        .query(read, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(before.len(), 80);

    // The daemon migrates the rest of the way at its start.
    let config = TestConfig::new(dir.path())
        .database_url(&conninfo)
        .with(|c| {
            c.counters = vec![
                common::counter("downloads", tallyd::config::KeyTypeName::Text),
                common::windowed_counter("daily", "day", "UTC", &["all"]),
            ];
            c.listen.set_datagram_socket(None);
            c.rollup.enabled = false;
        })
        .write();
    let daemon = common::spawn_daemon(&config);
    let after: Vec<(String, i64, String, String)> = client
        .query(read, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(after, before, "every row reads the same after V10");
    let spans: i64 = client
        .query_one(
            "SELECT count(*) FROM (SELECT span, win FROM tallyd.slots UNION ALL \
             SELECT span, win FROM tallyd.rollups) r WHERE span = 'all' AND win = '-infinity'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(spans, 150 + 80, "old rows are all-time rows");

    // New events add to the old rows; the rollup folds old and new together.
    let mut c = LineClient::connect(&dir.path().join("tallyd.sock")).await;
    c.send(b"downloads k7 5\ndaily k7 1\n").await;
    assert_eq!(c.flush().await, (2, 0));
    let out = common::tallyd(&config, &["rollup", "--until-empty"]);
    assert!(out.status.success(), "{out:?}");
    let k7 = |rows: &[(String, i64, String, String)]| rows.iter().find(|r| r.0 == "k7").unwrap().1;
    let out = common::tallyd(&config, &["get", "downloads", "k7"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.starts_with(&format!("downloads k7 count={} ", k7(&before) + 5)),
        "{text}"
    );
    assert_eq!(
        common::scalar(&client, "SELECT count(*) FROM tallyd.slots").await,
        0,
        "the rollup folded the old slot rows"
    );
    let total: i64 = client
        .query_one(
            "SELECT sum(count)::bigint FROM tallyd.totals WHERE counter = 'downloads'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(total, before.iter().map(|r| r.1).sum::<i64>() + 5);
    assert!(daemon.terminate().success());
    drop(client);
    common::stop_postgres(pg).await;
}

/// A row as a tallyd of some schema wrote it: in `tallyd.slots` (`slot` set) or
/// `tallyd.rollups`; `window` (span, first instant in Unix seconds) from V10, `kind` and
/// `value` from V12.
struct Written {
    counter: &'static str,
    key: String,
    slot: Option<i32>,
    window: Option<(&'static str, i64)>,
    count: i64,
    first_seen: i64,
    last_seen: i64,
    kind: Option<&'static str>,
    value: Option<i64>,
}

impl Written {
    fn sum(counter: &'static str, key: String, slot: Option<i32>, count: i64, at: i64) -> Self {
        Written {
            counter,
            key,
            slot,
            window: None,
            count,
            first_seen: at - 3600 * (count.rem_euclid(5) + 1),
            last_seen: at,
            kind: None,
            value: None,
        }
    }

    /// The INSERT of this row, in the columns its schema has.
    fn insert(&self) -> String {
        let (table, slot) = match self.slot {
            Some(s) => ("tallyd.slots", format!("{s}, ")),
            None => ("tallyd.rollups", String::new()),
        };
        let slot_column = if self.slot.is_some() { "slot, " } else { "" };
        let mut columns = format!("counter, key, {slot_column}count, first_seen, last_seen");
        let mut values = format!(
            "'{}', '{}', {slot}{}, to_timestamp({}), to_timestamp({})",
            self.counter, self.key, self.count, self.first_seen, self.last_seen
        );
        if let Some((span, win)) = self.window {
            columns.push_str(", span, win");
            values.push_str(&match span {
                "all" => ", 'all', '-infinity'".to_string(),
                _ => format!(", '{span}', to_timestamp({win})"),
            });
        }
        if let Some(kind) = self.kind {
            columns.push_str(", kind, value");
            values.push_str(&format!(", '{kind}', {}", self.value.unwrap()));
        }
        format!("INSERT INTO {table} ({columns}) VALUES ({values});\n")
    }
}

/// A row of tallyd.totals or tallyd.window_totals: (count, first_seen, last_seen, kind, value),
/// by (counter, key, span, window start); ('all', 0) for tallyd.totals.
type Totals = BTreeMap<(String, String, String, i64), (i64, i64, i64, String, Option<i64>)>;

/// The rows of `written` merged per (counter, key) over the all-time rows, or per (counter,
/// key, span, window) over the windowed ones, as the views merge them; but for `stars`, whose
/// rows fold into the application's table ([`stars`]).
fn merged(written: &[Written], windowed: bool) -> Totals {
    let mut out = Totals::new();
    // (last_seen, value) of the latest 'last' row so far, per key.
    let mut latest: BTreeMap<(String, String, String, i64), (i64, i64)> = BTreeMap::new();
    for w in written {
        let (span, win) = w.window.unwrap_or(("all", 0));
        if (span != "all") != windowed || w.counter == "stars" {
            continue;
        }
        let key = (w.counter.to_string(), w.key.clone(), span.to_string(), win);
        let e = out.entry(key.clone()).or_insert((
            0,
            i64::MAX,
            i64::MIN,
            w.kind.unwrap_or("sum").to_string(),
            None,
        ));
        e.0 += w.count;
        e.1 = e.1.min(w.first_seen);
        e.2 = e.2.max(w.last_seen);
        e.4 = match (w.kind, w.value, e.4) {
            (Some("max"), Some(v), old) => Some(old.map_or(v, |o: i64| o.max(v))),
            (Some("min"), Some(v), old) => Some(old.map_or(v, |o: i64| o.min(v))),
            (Some("last"), Some(v), _) => {
                let l = latest.entry(key).or_insert((w.last_seen, v));
                *l = (*l).max((w.last_seen, v));
                Some(l.1)
            }
            _ => None,
        };
    }
    out
}

/// The rows a tallyd of schema `version` could have written: sums in slots and rollups (from
/// V1), a `rollup_into` counter's slot rows (from V2; keys 11 and 12 have no row in the
/// application's table), windows with their all-time rows (from V10), max and last values, two
/// of them at the same last_seen (from V12). Timestamps in whole seconds.
fn written_at(version: u32) -> Vec<Written> {
    let at = 1_772_323_200; // 2026-03-01 00:00 UTC
    let mut rows = Vec::new();
    for i in 0..20 {
        rows.push(Written::sum(
            "downloads",
            format!("k{i}"),
            None,
            1000 * i + 7,
            at - 86_400 * i,
        ));
    }
    for i in 10..30 {
        for slot in 0..3 {
            let count = if (i, slot) == (29, 2) {
                -5
            } else {
                10 * i + slot + 1
            };
            rows.push(Written::sum(
                "downloads",
                format!("k{i}"),
                Some(slot as i32),
                count,
                at + 60 * slot,
            ));
        }
    }
    if version >= 2 {
        for id in 1..=12 {
            for slot in 0..2 {
                rows.push(Written::sum(
                    "stars",
                    id.to_string(),
                    Some(slot),
                    3 * id + slot as i64,
                    at,
                ));
            }
        }
    }
    if version >= 10 {
        for (i, key) in ["a", "b", "c"].into_iter().enumerate() {
            for (day, slot) in [(0, Some(0)), (0, Some(1)), (1, Some(2)), (1, None)] {
                let count = 10 * i as i64 + day + slot.unwrap_or(5) as i64 + 1;
                for window in [("day", at + 86_400 * day), ("all", 0)] {
                    let mut row =
                        Written::sum("daily", key.into(), slot, count, at + 86_400 * day + 100);
                    row.window = Some(window);
                    rows.push(row);
                }
            }
        }
    }
    if version >= 12 {
        for (kind, counter) in [("max", "peak"), ("last", "latest")] {
            for (n, (slot, value, seen)) in [
                (Some(0), 40, at + 10),
                (Some(1), -3, at + 30),
                (Some(2), 17, at + 30),
                (None, 25, at + 20),
            ]
            .into_iter()
            .enumerate()
            {
                let mut row = Written::sum(counter, "x".into(), slot, n as i64 + 1, seen);
                row.kind = Some(kind);
                row.value = Some(value);
                rows.push(row);
            }
        }
    }
    rows
}

/// tallyd.totals (`windowed` false) or tallyd.window_totals, but for the `rollup_into` counter
/// `stars` ([`stars`]).
async fn totals(client: &tokio_postgres::Client, windowed: bool) -> Totals {
    let query = if windowed {
        "SELECT counter, key, span, extract(epoch FROM window_start)::bigint, exact_count::text, \
         extract(epoch FROM first_seen)::bigint, extract(epoch FROM last_seen)::bigint, kind, value \
         FROM tallyd.window_totals WHERE counter <> 'stars'"
    } else {
        "SELECT counter, key, 'all', 0::bigint, exact_count::text, \
         extract(epoch FROM first_seen)::bigint, extract(epoch FROM last_seen)::bigint, kind, value \
         FROM tallyd.totals WHERE counter <> 'stars'"
    };
    let mut out = Totals::new();
    for r in client.query(query, &[]).await.unwrap() {
        let count: String = r.get(4);
        let row = (
            count.parse().unwrap(),
            r.get(5),
            r.get(6),
            r.get(7),
            r.get(8),
        );
        out.insert((r.get(0), r.get(1), r.get(2), r.get(3)), row);
    }
    out
}

/// Per `stars` key: its slot rows plus the application's column, less the column's starting
/// value (100 per id): the total written.
async fn stars(client: &tokio_postgres::Client) -> BTreeMap<i64, i64> {
    client
        .query(
            "SELECT k, sum(n)::bigint FROM (
                 SELECT key::bigint AS k, count AS n FROM tallyd.slots WHERE counter = 'stars'
                 UNION ALL SELECT id, stars - 100 * id FROM app_repos) t GROUP BY k",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// From the schema of each earlier migration (V1 .. V<n-1>: the last schema before each
/// feature, among them V9 before windows and V11 before kinds and corrections), with rows as
/// that tallyd wrote them, migrated to the last schema: every total, window and value reads
/// exactly what was written, the ledger row survives, the rollup folds the old rows (a
/// `rollup_into` counter's into its table, a key the range guard held back once it fits), and
/// corrections apply to them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_at_every_earlier_schema_keep_exact_totals_to_the_last() {
    let last = tallyd::store::migrations::runner()
        .get_migrations()
        .iter()
        .map(|m| m.version())
        .max()
        .unwrap();
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let urls = common::create_databases(&pg, last as usize - 1).await;
    for (from, url) in (1..last).zip(&urls) {
        let mut client = sql(url).await;
        tallyd::store::migrate_up_to(&mut client, from)
            .await
            .unwrap();
        let written = written_at(from);
        let mut batch: String = written.iter().map(Written::insert).collect();
        batch.push_str(
            "INSERT INTO tallyd.flushes (instance_id, writer, seq, journal_covered) \
             VALUES ('old', 3, 41, 40);\n",
        );
        if from >= 2 {
            batch.push_str(
                "CREATE TABLE app_repos (id bigint PRIMARY KEY, stars bigint NOT NULL);
                 INSERT INTO app_repos SELECT i, 100 * i FROM generate_series(1, 10) i;
                 INSERT INTO tallyd.rollup_targets (counter, target, key_column, count_column)
                 VALUES ('stars', 'app_repos', 'id', 'stars');\n",
            );
        }
        if from >= 14 {
            // As a tallyd of V14 or later does whenever it records its targets: each target's
            // rollup step function, generated.
            batch.push_str("SELECT tallyd.install_rollup_targets();\n");
        }
        if from >= 5 {
            // Held back by the range guard once; it fits now, so the rollup releases it.
            batch.push_str(
                "INSERT INTO tallyd.rollup_rejects (counter, key, total) VALUES ('downloads', 'k15', 1);\n",
            );
        }
        client
            .batch_execute(&batch)
            .await
            .unwrap_or_else(|e| panic!("rows at V{from}: {}", tallyd::store::DbError::from(e)));
        let before: i64 = common::scalar(
            &client,
            "SELECT sum(count)::bigint FROM tallyd.totals WHERE counter = 'downloads'",
        )
        .await;

        tallyd::store::migrate_up_to(&mut client, last)
            .await
            .unwrap_or_else(|e| panic!("V{from} to V{last}: {e}"));
        let all_time = merged(&written, false);
        let windows = merged(&written, true);
        let mut sent_stars: BTreeMap<i64, i64> = BTreeMap::new();
        for w in written.iter().filter(|w| w.counter == "stars") {
            *sent_stars.entry(w.key.parse().unwrap()).or_default() += w.count;
        }
        let context = |when: &str| format!("from V{from} to V{last}, {when}");
        let downloads: i64 = all_time
            .iter()
            .filter(|(k, _)| k.0 == "downloads")
            .map(|(_, v)| v.0)
            .sum();
        assert_eq!(downloads, before, "{}", context("the rows as written"));
        for when in ["migrated", "rolled up"] {
            if when == "rolled up" {
                tallyd::rollup::until_empty(&client, 1000)
                    .await
                    .unwrap_or_else(|e| panic!("{}: rollup: {e}", context(when)));
            }
            assert_eq!(totals(&client, false).await, all_time, "{}", context(when));
            assert_eq!(totals(&client, true).await, windows, "{}", context(when));
            if from >= 2 {
                assert_eq!(stars(&client).await, sent_stars, "{}", context(when));
            }
        }
        // Only what cannot fold is left in slots: the `stars` keys with no application row.
        let left: Vec<(String, String)> = client
            .query(
                "SELECT DISTINCT counter, key FROM tallyd.slots ORDER BY 1, 2",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let unmatched: Vec<(String, String)> = if from >= 2 {
            vec![("stars".into(), "11".into()), ("stars".into(), "12".into())]
        } else {
            vec![]
        };
        assert_eq!(left, unmatched, "{}", context("rolled up"));
        assert_eq!(
            common::scalar(&client, "SELECT count(*) FROM tallyd.rollup_rejects").await,
            0,
            "{}",
            context("the held-back key released")
        );
        let ledger = client
            .query_one(
                "SELECT instance_id, owner, writer, seq, journal_covered FROM tallyd.flushes",
                &[],
            )
            .await
            .unwrap();
        assert_eq!(
            (
                ledger.get::<_, String>(0),
                ledger.get::<_, String>(1),
                ledger.get::<_, i32>(2),
                ledger.get::<_, i64>(3),
                ledger.get::<_, i64>(4)
            ),
            ("old".into(), String::new(), 3, 41, 40),
            "{}",
            context("the ledger row")
        );

        // Corrections from SQL on rows an older schema wrote.
        client
            .batch_execute(
                "SELECT tallyd.set_total('downloads', 'k12', 5); \
                 SELECT tallyd.forget('downloads', 'k13')",
            )
            .await
            .unwrap_or_else(|e| panic!("{}: corrections: {e}", context("rolled up")));
        let mut corrected: BTreeMap<String, i64> = all_time
            .iter()
            .filter(|(k, _)| k.0 == "downloads")
            .map(|(k, v)| (k.1.clone(), v.0))
            .collect();
        corrected.insert("k12".into(), 5);
        corrected.remove("k13");
        let counts: BTreeMap<String, i64> = common::counts(&client, "downloads")
            .await
            .into_iter()
            .collect();
        assert_eq!(counts, corrected, "{}", context("corrected"));
    }
    common::stop_postgres(pg).await;
}

/// A reader of tallyd's tables that deadlocks with a migration does not fail the start: V12
/// alters `tallyd.slots`, then `tallyd.rollups`; a reader that holds `tallyd.rollups` (through
/// `tallyd.totals`, say) and then asks for `tallyd.slots` makes a cycle, which PostgreSQL breaks
/// by failing the migration (it waited first, and the reader's `deadlock_timeout` is longer).
/// The start tries that migration again once the reader is done. Before, the start failed:
/// `migration failed: error applying migration V12__counter_kinds: deadlock detected`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_that_deadlocks_with_a_reader_is_tried_again() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let mut old = sql(&conninfo).await;
    tallyd::store::migrate_up_to(&mut old, 11).await.unwrap();
    let reader = sql(&conninfo).await;
    reader
        .batch_execute("SET deadlock_timeout = '30s'; BEGIN; SELECT 1 FROM tallyd.rollups LIMIT 0")
        .await
        .unwrap();

    let config = TestConfig::new(dir.path())
        .database_url(&conninfo)
        .with(|c| {
            c.counters = vec![common::counter(
                "downloads",
                tallyd::config::KeyTypeName::Text,
            )]
        })
        .build();
    let prepare = tokio::spawn(async move {
        let mut client = sql(&conninfo).await;
        tallyd::store::prepare(&mut client, &config).await
    });
    // Once the migration holds `tallyd.slots` and waits for `tallyd.rollups`, the reader asks
    // for `tallyd.slots`: the cycle.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        assert!(
            !prepare.is_finished() && std::time::Instant::now() < deadline,
            "the migration never waited for tallyd.rollups (V12's lock order changed?)"
        );
        let waiting: i64 = old
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE NOT granted \
                 AND relation = 'tallyd.rollups'::regclass AND mode = 'AccessExclusiveLock'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if waiting > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    reader
        .batch_execute("SELECT 1 FROM tallyd.slots LIMIT 0; COMMIT")
        .await
        .expect("the reader is not the one failed: its deadlock_timeout is longer");
    prepare
        .await
        .unwrap()
        .expect("the start's migrations succeed after the deadlock");
    // A backend reports its statistics when it goes idle or exits, not at once: polled.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let deadlocks: i64 = old
            .query_one(
                "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if deadlocks > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the test made no deadlock"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let latest: i32 = old
        .query_one("SELECT max(version) FROM tallyd.schema_history", &[])
        .await
        .unwrap()
        .get(0);
    let last = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.strip_prefix('V')?
                .split_once("__")?
                .0
                .parse::<i32>()
                .ok()
        })
        .max()
        .unwrap();
    assert_eq!(latest, last, "every migration applied");
}
