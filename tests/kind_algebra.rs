//! Every copy of each kind's merge agrees with the Rust merge (`Kept::merge`, src/kind/mod.rs)
//! on the same inputs, in a private PostgreSQL with the hll extension: the SQL text tallyd
//! builds (src/kind/sql.rs: the pairwise form, the upsert's `value` and `sketch` columns under
//! the flush's alias and the shard move's, the aggregate form), `tallyd get`'s read of a column
//! merged with unfolded slot rows (src/store/read.rs), `tallyd.unique_totals`, and the copies
//! the migrations hold and Rust cannot generate (V12: the views `tallyd.totals` and
//! `tallyd.window_totals`, the fold of `tallyd.rollup()` with its `GROUP BY` and its `ON
//! CONFLICT`, `tallyd.rollup_sketches`, `tallyd.rollup_into_kind`). The inputs take the 64-bit
//! edges, equal event times for `last` (the larger value wins) and later times with smaller
//! values, empty, explicit and full sketches, in several orders; a copy that merges otherwise
//! (GREATEST for LEAST, a `last` that ignores the time or the tie, a union that drops a side)
//! fails here. The bucket's path (`Value::add`, one event at a time) is checked against the
//! same merge.
//!
//! scripts/ensure-postgres installs the extension (Debian's `postgresql-<version>-hll`); where
//! it is not installed the test says so and passes without checking anything.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{postgres, sql, stop_postgres, temp_dir, TestConfig};
use tallyd::config::{KeyTypeName, RollupInto};
use tallyd::hll::{hash_text, Params, Sketch};
use tallyd::kind::sql::{self as kind_sql, Side};
use tallyd::kind::{Kept, Kind, Op, Theirs, Value};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;

const T: i64 = 1_700_000_000_000;

/// One row of a key: its kept value and the event time it came from (Unix ms).
type Row = (Kept, i64);

fn at(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms as u64)
}

/// The numeric cases, as (value, event time): each is merged in every copy in this order (and
/// pairwise in both orders).
fn number_cases() -> Vec<Vec<(i64, i64)>> {
    vec![
        // Equal times: `last` keeps the larger value, whichever comes first.
        vec![(5, T), (3, T)],
        vec![(3, T), (5, T)],
        // A later time wins a `last` whatever its value.
        vec![(i64::MIN, T), (i64::MAX, T - 1)],
        vec![(i64::MAX, T), (i64::MIN, T + 1)],
        // Several rows at the latest time, one earlier with the largest value.
        vec![(0, T), (-1, T), (i64::MAX, T - 5), (i64::MIN, T), (1, T)],
        vec![(i64::MAX, T), (i64::MAX, T)],
        vec![
            (-7, T + 3),
            (9, T + 1),
            (-7, T + 3),
            (2, T + 2),
            (-8, T + 3),
        ],
    ]
}

fn sketch_of(values: impl IntoIterator<Item = String>) -> Sketch {
    let mut sketch = Sketch::new(Params::default());
    for v in values {
        sketch.add_hash(hash_text(v.as_bytes()));
    }
    sketch
}

fn named(prefix: &str, range: std::ops::Range<u32>) -> Vec<String> {
    range.map(|i| format!("{prefix}{i}")).collect()
}

/// The unique cases: each row a sketch of these values (explicit, empty, full: the defaults'
/// explicit threshold is 160 values).
fn value_sets() -> Vec<Vec<Vec<String>>> {
    let few = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        vec![few(&["a", "b"]), few(&["b", "c"])],
        vec![few(&[]), few(&["x"])],
        vec![named("v", 0..300), named("v", 200..600)],
        vec![few(&["p"]), named("w", 0..170), few(&["q", "p"])],
    ]
}

/// The cases of `kind` as rows.
fn cases(kind: Kind) -> Vec<Vec<Row>> {
    match kind {
        Kind::Unique => value_sets()
            .into_iter()
            .map(|rows| {
                let times = [T, T + 2, T + 1];
                rows.into_iter()
                    .zip(times.into_iter().cycle())
                    .map(|(values, at)| (Kept::Sketch(sketch_of(values)), at))
                    .collect()
            })
            .collect(),
        kind => number_cases()
            .into_iter()
            .map(|rows| {
                let kept = |v| match kind {
                    Kind::Max => Kept::Max(v),
                    Kind::Min => Kept::Min(v),
                    _ => Kept::Last(v),
                };
                rows.into_iter().map(|(v, at)| (kept(v), at)).collect()
            })
            .collect(),
    }
}

const KINDS: [Kind; 4] = [Kind::Max, Kind::Min, Kind::Last, Kind::Unique];

/// The Rust merge of `rows` in order: each merged into the value of those before it, whose
/// time is the latest of theirs.
fn merged(rows: &[Row]) -> Kept {
    let (mut kept, mut latest) = rows[0].clone();
    for (theirs, at) in &rows[1..] {
        kept.merge(latest, Theirs::Kept(theirs), *at)
            .expect("rows of one kind merge");
        latest = latest.max(*at);
    }
    kept
}

/// What a copy returns, as the test compares it: a number, or a sketch's bytes.
#[derive(Debug, PartialEq, Eq)]
enum Got {
    Number(Option<i64>),
    Bytes(Option<Vec<u8>>),
}

fn expect(kept: &Kept) -> Got {
    match kept {
        Kept::Sketch(sketch) => Got::Bytes(Some(sketch.to_bytes())),
        kept => Got::Number(kept.number()),
    }
}

fn value_of(kept: &Kept) -> Option<i64> {
    kept.number()
}

fn sketch_bytes(kept: &Kept) -> Option<Vec<u8>> {
    kept.sketch().map(Sketch::to_bytes)
}

/// Reads column 0 of `row` as `kind` returns it (a sketch as bytea).
fn got(kind: Kind, row: &tokio_postgres::Row) -> Got {
    match kind {
        Kind::Unique => Got::Bytes(row.get(0)),
        _ => Got::Number(row.get(0)),
    }
}

async fn one(
    client: &Client,
    query: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
) -> tokio_postgres::Row {
    client
        .query_typed_one(query, params)
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"))
}

/// The pairwise form: every ordered pair of a case's rows.
async fn check_pairs(client: &Client) {
    for kind in KINDS {
        let sql = match kind {
            Kind::Unique => format!(
                "SELECT hll_send({})",
                kind_sql::pair(kind, Side::untimed("$1::hll"), Side::untimed("$3::hll")).unwrap()
            ),
            _ => format!(
                "SELECT {}",
                kind_sql::pair(kind, Side::timed("$1", "$2"), Side::timed("$3", "$4")).unwrap()
            ),
        };
        let ty = if kind == Kind::Unique {
            Type::BYTEA
        } else {
            Type::INT8
        };
        for rows in cases(kind) {
            for a in &rows {
                for b in &rows {
                    let want = merged(&[a.clone(), b.clone()]);
                    let (va, vb) = (value_of(&a.0), value_of(&b.0));
                    let (sa, sb) = (sketch_bytes(&a.0), sketch_bytes(&b.0));
                    let (ta, tb) = (at(a.1), at(b.1));
                    let row = if kind == Kind::Unique {
                        one(
                            client,
                            &sql,
                            &[
                                (&sa, ty.clone()),
                                (&ta, Type::TIMESTAMPTZ),
                                (&sb, ty.clone()),
                            ],
                        )
                        .await
                    } else {
                        one(
                            client,
                            &sql,
                            &[
                                (&va, ty.clone()),
                                (&ta, Type::TIMESTAMPTZ),
                                (&vb, ty.clone()),
                                (&tb, Type::TIMESTAMPTZ),
                            ],
                        )
                        .await
                    };
                    assert_eq!(
                        got(kind, &row),
                        expect(&want),
                        "{kind} pair {a:?} {b:?}: {sql}"
                    );
                }
            }
        }
    }
    // A unique value merged with none (a NULL column or no slot row) is itself.
    let sql = format!(
        "SELECT hll_send({}), hll_send({})",
        kind_sql::pair(
            Kind::Unique,
            Side::untimed("$1::hll"),
            Side::untimed("NULL::hll")
        )
        .unwrap(),
        kind_sql::pair(
            Kind::Unique,
            Side::untimed("NULL::hll"),
            Side::untimed("$1::hll")
        )
        .unwrap()
    );
    let bytes = sketch_of(["n".to_string()]).to_bytes();
    let row = one(client, &sql, &[(&bytes, Type::BYTEA)]).await;
    assert_eq!(
        (row.get::<_, Vec<u8>>(0), row.get::<_, Vec<u8>>(1)),
        (bytes.clone(), bytes)
    );
}

/// The upsert's `value` and `sketch` columns, under the flush's alias (`s`) and the shard
/// move's (`r`): each case's rows upserted one by one onto one row.
async fn check_upserts(client: &Client) {
    client
        .batch_execute(
            "CREATE TEMP TABLE up (k int PRIMARY KEY, kind text, value bigint, \
             last_seen timestamptz, sketch bytea)",
        )
        .await
        .unwrap();
    for alias in ["s", "r"] {
        let upsert = format!(
            "INSERT INTO up AS {alias} VALUES (1, $1, $2, $3, $4) ON CONFLICT (k) DO UPDATE SET \
             value = {}, sketch = {}, last_seen = GREATEST({alias}.last_seen, EXCLUDED.last_seen)",
            kind_sql::value_column(alias),
            kind_sql::sketch_column(alias),
        );
        for kind in KINDS {
            for rows in cases(kind) {
                client.batch_execute("DELETE FROM up").await.unwrap();
                for (kept, ms) in &rows {
                    let params: [(&(dyn ToSql + Sync), Type); 4] = [
                        (&kind.column(), Type::TEXT),
                        (&value_of(kept), Type::INT8),
                        (&at(*ms), Type::TIMESTAMPTZ),
                        (&sketch_bytes(kept), Type::BYTEA),
                    ];
                    client
                        .execute_typed(&upsert, &params)
                        .await
                        .unwrap_or_else(|e| panic!("{upsert}: {e}"));
                }
                let read = match kind {
                    Kind::Unique => "SELECT sketch FROM up",
                    _ => "SELECT value FROM up",
                };
                let row = one(client, read, &[]).await;
                assert_eq!(
                    got(kind, &row),
                    expect(&merged(&rows)),
                    "{kind} upsert as {alias}: {rows:?}"
                );
            }
        }
    }
}

/// The aggregate form over a case's rows.
async fn check_aggregates(client: &Client) {
    for kind in KINDS {
        let agg = kind_sql::aggregate(kind).unwrap();
        for rows in cases(kind) {
            let kinds: Vec<&str> = rows.iter().map(|_| kind.name()).collect();
            let values: Vec<Option<i64>> = rows.iter().map(|r| value_of(&r.0)).collect();
            let times: Vec<SystemTime> = rows.iter().map(|r| at(r.1)).collect();
            let sketches: Vec<Option<Vec<u8>>> = rows.iter().map(|r| sketch_bytes(&r.0)).collect();
            let shown = if kind == Kind::Unique {
                format!("hll_send({agg})")
            } else {
                agg.to_string()
            };
            let sql = format!(
                "SELECT {shown} FROM unnest($1::text[], $2::bigint[], $3::timestamptz[], $4::bytea[]) \
                 AS r (kind, value, last_seen, sketch)"
            );
            let params: [(&(dyn ToSql + Sync), Type); 4] = [
                (&kinds, Type::TEXT_ARRAY),
                (&values, Type::INT8_ARRAY),
                (&times, Type::TIMESTAMPTZ_ARRAY),
                (&sketches, Type::BYTEA_ARRAY),
            ];
            let row = one(client, &sql, &params).await;
            assert_eq!(
                got(kind, &row),
                expect(&merged(&rows)),
                "{kind} aggregate: {rows:?}"
            );
        }
    }
}

/// The counter of `kind`'s cases in tallyd's tables.
fn counter(kind: Kind) -> String {
    format!("c_{}", kind.name())
}

/// Writes the first row of every case (or, `rest`, every row after the first) as slot rows of
/// counters named `prefix` and the kind, each in a slot of its own, of both an all-time row and
/// a day window.
async fn insert_slot_rows(client: &Client, prefix: &str, rest: bool) {
    let insert = "INSERT INTO tallyd.slots (counter, key, span, win, slot, count, first_seen, \
                  last_seen, kind, value, sketch) \
                  VALUES ($1, $2, $3, $4::text::timestamptz, $5, 1, $6, $6, $7, $8, $9)";
    for kind in KINDS {
        for (i, rows) in cases(kind).iter().enumerate() {
            let which = if rest { 1..rows.len() } else { 0..1 };
            for (slot, (kept, ms)) in rows.iter().enumerate().take(which.end).skip(which.start) {
                for (span, win) in [("all", "-infinity"), ("day", "2023-11-14 00:00:00+00")] {
                    let params: [(&(dyn ToSql + Sync), Type); 9] = [
                        (&format!("{prefix}{}", counter(kind)), Type::TEXT),
                        (&format!("case{i}"), Type::TEXT),
                        (&span, Type::TEXT),
                        (&win, Type::TEXT),
                        (&(slot as i32), Type::INT4),
                        (&at(*ms), Type::TIMESTAMPTZ),
                        (&kind.column(), Type::TEXT),
                        (&value_of(kept), Type::INT8),
                        (&sketch_bytes(kept), Type::BYTEA),
                    ];
                    client
                        .execute_typed(insert, &params)
                        .await
                        .unwrap_or_else(|e| panic!("{insert}: {e}"));
                }
            }
        }
    }
}

/// The views (and `tallyd.unique_totals`) and the rollups agree with the merge of every row of
/// each case; `rolled_up`: the rollup rows hold every case whole.
async fn check_stored(client: &Client, rolled_up: bool) {
    for kind in KINDS {
        let c = counter(kind);
        for (i, rows) in cases(kind).iter().enumerate() {
            let want = expect(&merged(rows));
            let key = format!("case{i}");
            let params: [(&(dyn ToSql + Sync), Type); 2] = [(&c, Type::TEXT), (&key, Type::TEXT)];
            let reads = match kind {
                Kind::Unique => vec![
                    "SELECT hll_send(sketch) FROM tallyd.unique_totals \
                     WHERE counter = $1 AND key = $2 AND span = 'all'",
                    "SELECT hll_send(sketch) FROM tallyd.unique_totals \
                     WHERE counter = $1 AND key = $2 AND span = 'day'",
                    "SELECT sketch FROM tallyd.rollups WHERE counter = $1 AND key = $2 AND span = 'all'",
                    "SELECT sketch FROM tallyd.rollups WHERE counter = $1 AND key = $2 AND span = 'day'",
                ],
                _ => vec![
                    "SELECT value FROM tallyd.totals WHERE counter = $1 AND key = $2",
                    "SELECT value FROM tallyd.window_totals WHERE counter = $1 AND key = $2",
                    "SELECT value FROM tallyd.rollups WHERE counter = $1 AND key = $2 AND span = 'all'",
                    "SELECT value FROM tallyd.rollups WHERE counter = $1 AND key = $2 AND span = 'day'",
                ],
            };
            let reads = if rolled_up { &reads[..] } else { &reads[..2] };
            for read in reads {
                let row = one(client, read, &params).await;
                assert_eq!(got(kind, &row), want, "{kind} {read}: {rows:?}");
            }
        }
    }
}

/// `tallyd.rollup_into_kind`, and `tallyd get`'s read of the column with the slot rows not
/// folded yet: the first row of each case in the application's column, the rest in slots (a
/// unique case also with a NULL column: the slot rows' union).
async fn check_rollup_into(client: &Client) {
    client
        .batch_execute(
            "CREATE TABLE app_max (k text PRIMARY KEY, v bigint);
             CREATE TABLE app_min (k text PRIMARY KEY, v numeric);
             CREATE TABLE app_unique (k text PRIMARY KEY, v hll);",
        )
        .await
        .unwrap();
    insert_slot_rows(client, "into_", true).await;
    for kind in [Kind::Max, Kind::Min, Kind::Unique] {
        let (table, c) = (
            format!("app_{}", kind.name()),
            format!("into_{}", counter(kind)),
        );
        for (i, rows) in cases(kind).iter().enumerate() {
            let first: Option<&Kept> = (i > 0 || kind != Kind::Unique).then_some(&rows[0].0);
            let insert = format!(
                "INSERT INTO {table} VALUES ($1, $2::text::{})",
                if kind == Kind::Unique {
                    "bytea::hll"
                } else {
                    "numeric"
                }
            );
            let column: Option<String> = first.map(|k| match k {
                Kept::Sketch(s) => format!(
                    "\\x{}",
                    s.to_bytes()
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<String>()
                ),
                k => k.number().unwrap().to_string(),
            });
            client
                .execute_typed(
                    &insert,
                    &[(&format!("case{i}"), Type::TEXT), (&column, Type::TEXT)],
                )
                .await
                .unwrap_or_else(|e| panic!("{insert}: {e}"));
        }
        // The slot rows hold each case's rows after the first, of two windows: only the
        // all-time ones fold into a column.
        client
            .execute(
                &format!("DELETE FROM tallyd.slots WHERE counter = '{c}' AND span <> 'all'"),
                &[],
            )
            .await
            .unwrap();
        let into = RollupInto {
            table: table.clone(),
            key_column: "k".into(),
            window_column: None,
            column: "v".into(),
            insert_missing: false,
            direct: false,
            on_add: Default::default(),
        };
        let want = |i: usize, rows: &[Row]| -> Kept {
            if i == 0 && kind == Kind::Unique {
                merged(&rows[1..])
            } else {
                merged(rows)
            }
        };
        let shown = |kept: &Kept| match kept {
            Kept::Sketch(s) => (s.cardinality().round_ties_even() as i64).to_string(),
            k => k.number().unwrap().to_string(),
        };
        for (i, rows) in cases(kind).iter().enumerate() {
            let key = format!("case{i}");
            let read = tallyd::store::read::folded_kind(client, (&c, &key), &into, kind)
                .await
                .unwrap();
            assert_eq!(
                read,
                Some(shown(&want(i, rows))),
                "{kind} get of {key}: {rows:?}"
            );
        }
        let folded: i64 = one(
            client,
            "SELECT tallyd.rollup_into_kind('tallyd.slots', $1, $2::regclass, 'k', 'v', 'text', $3, 1000)",
            &[(&c, Type::TEXT), (&table, Type::TEXT), (&kind.name(), Type::TEXT)],
        )
        .await
        .get(0);
        let slot_rows: usize = cases(kind).iter().map(|rows| rows.len() - 1).sum();
        assert_eq!(folded as usize, slot_rows, "{kind}: every slot row folded");
        for (i, rows) in cases(kind).iter().enumerate() {
            let key = format!("case{i}");
            let read = match kind {
                Kind::Unique => format!("SELECT hll_send(v) FROM {table} WHERE k = $1"),
                _ => format!("SELECT v::bigint FROM {table} WHERE k = $1"),
            };
            let row = one(client, &read, &[(&key, Type::TEXT)]).await;
            assert_eq!(
                got(kind, &row),
                expect(&want(i, rows)),
                "{kind} rollup_into of {key}: {rows:?}"
            );
        }
    }
}

/// The bucket's path: a case's rows as events, one at a time, into a pending value.
fn check_events() {
    for kind in KINDS {
        let op = Op::new(kind, None);
        if kind == Kind::Unique {
            for sets in value_sets() {
                let hashes: Vec<i64> = sets
                    .iter()
                    .flatten()
                    .map(|v| hash_text(v.as_bytes()))
                    .collect();
                let Some((&first, rest)) = hashes.split_first() else {
                    continue;
                };
                let mut value = Value::new(op, first);
                for &h in rest {
                    value.add(h, T, T);
                }
                let all = sketch_of(sets.into_iter().flatten());
                assert_eq!(value.sketch(), Some(&all), "unique events");
            }
            continue;
        }
        for rows in cases(kind) {
            let mut value = Value::new(op, value_of(&rows[0].0).unwrap());
            let mut latest = rows[0].1;
            for (kept, ms) in &rows[1..] {
                value.add(value_of(kept).unwrap(), *ms, latest);
                latest = latest.max(*ms);
            }
            assert_eq!(
                value.number(),
                merged(&rows).number(),
                "{kind} events: {rows:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_copy_of_each_kinds_merge_agrees_with_the_rust_merge() {
    check_events();
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let client = sql(&conninfo).await;
    if let Err(e) = client.batch_execute("CREATE EXTENSION hll").await {
        let cause = e
            .as_db_error()
            .map_or(e.to_string(), |d| d.message().to_string());
        assert!(
            cause.contains("is not available") || cause.contains("control file"),
            "CREATE EXTENSION hll: {cause}"
        );
        eprintln!("SKIPPED: postgresql-hll is not installed ({cause}); scripts/ensure-postgres installs it");
        stop_postgres(pg).await;
        return;
    }
    // The schema as a start prepares it, with a unique counter declared (so
    // tallyd.unique_totals exists).
    let config = TestConfig::new(dir.path())
        .database_url(&conninfo)
        .with(|c| {
            let mut unique = common::counter("c_unique", KeyTypeName::Text);
            unique.kind = Kind::Unique;
            c.counters.push(unique);
        })
        .build();
    tallyd::store::migrate(&[common::db(&conninfo)], &config)
        .await
        .unwrap();

    check_pairs(&client).await;
    check_upserts(&client).await;
    check_aggregates(&client).await;

    // The first row of each case folded into tallyd.rollups, the rest in slot rows: the views
    // merge both, the next fold merges the slot rows (GROUP BY) and then the rollup row (ON
    // CONFLICT).
    insert_slot_rows(&client, "", false).await;
    let _: i64 = one(&client, "SELECT tallyd.rollup(100000)", &[])
        .await
        .get(0);
    insert_slot_rows(&client, "", true).await;
    check_stored(&client, false).await;
    let _: i64 = one(&client, "SELECT tallyd.rollup(100000)", &[])
        .await
        .get(0);
    let left: i64 = one(&client, "SELECT count(*) FROM tallyd.slots", &[])
        .await
        .get(0);
    assert_eq!(left, 0, "the rollup folded every slot row");
    check_stored(&client, true).await;

    check_rollup_into(&client).await;
    drop(client);
    stop_postgres(pg).await;
}
