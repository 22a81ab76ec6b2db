//! The windows workload: a sum per Berlin day with `also = ["month", "all"]` and a unique
//! counter per UTC day with `also = ["week", "all"]`, event times over 60 days across the end of
//! summer time. Its model is every window's total (or sketch, byte for byte the extension's of
//! the window's distinct values) and the all-time row; every key's day sketches also union to
//! its all-time sketch.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use futures_util::future::BoxFuture;
use jiff::tz::TimeZone;
use jiff::Timestamp;
use rand::rngs::StdRng;
use rand::Rng;
use tallyd::config::CounterConfig;

use crate::common::kind_counter;
use crate::kinds::{BASE, SKETCH};
use crate::workload::{compare, Ctx, Round, Size, Store, Workload};

const SUM: &str = "win_sum";
const SUM_ZONE: &str = "Europe/Berlin";
const UNIQUE: &str = "win_unique";
const DAY: i64 = 86_400_000;

/// (key, span, window start in Unix ms; 0 for the all-time row).
type Window = (String, &'static str, i64);

#[derive(Default)]
struct Model {
    sums: BTreeMap<Window, i64>,
    /// Per window: its distinct values and events.
    uniques: BTreeMap<Window, (BTreeSet<String>, i64)>,
}

#[derive(Default)]
pub struct Windows {
    model: Mutex<Model>,
}

/// The first instant of the window of `span` holding `at` in `zone`, in Unix ms.
fn start(at: i64, span: &str, zone: &TimeZone) -> i64 {
    let z = Timestamp::from_millisecond(at)
        .unwrap()
        .to_zoned_datetime(zone.clone());
    let first = match span {
        "day" => z.start_of_day(),
        "month" => z.first_of_month().and_then(|m| m.start_of_day()),
        "week" => {
            let back = z.date().weekday().to_monday_zero_offset();
            z.date()
                .checked_sub(jiff::Span::new().days(back))
                .and_then(|d| d.to_zoned_datetime(zone.clone()))
        }
        other => panic!("no span {other}"),
    };
    first.unwrap().timestamp().as_millisecond()
}

impl Workload for Windows {
    fn name(&self) -> &'static str {
        "windows"
    }

    fn counters(&self) -> Vec<CounterConfig> {
        vec![
            kind_counter(
                SUM,
                "sum",
                &format!("window = \"day\"\ntime_zone = {SUM_ZONE:?}\nalso = [\"month\", \"all\"]"),
            ),
            kind_counter(
                UNIQUE,
                "unique",
                &format!(
                    "window = \"day\"\ntime_zone = \"UTC\"\nalso = [\"week\", \"all\"]\n\
                     log2m = {}\nregwidth = {}",
                    SKETCH.0, SKETCH.1
                ),
            ),
        ]
    }

    fn round(&self, at: Ctx, rng: &mut StdRng) -> Round {
        let (n, keys) = match at.size {
            Size::Small => (30, 8),
            Size::Large => (600, 400),
        };
        let berlin = TimeZone::get(SUM_ZONE).expect("the Berlin zone");
        let utc = TimeZone::UTC;
        let mut model = self.model.lock().unwrap();
        let mut lines = Vec::new();
        for _ in 0..n {
            let key = format!("w{}", rng.gen_range(0..keys));
            // 2026-10-11 to 2026-12-10: the end of summer time (2026-10-25) among them; the
            // first and last millisecond of a day now and then.
            let day = BASE - 45 * DAY + rng.gen_range(0..60) * DAY;
            let time = day + [0, DAY - 1, rng.gen_range(0..DAY)][rng.gen_range(0..3)];
            let delta: i64 = rng.gen_range(1..10);
            for span in ["day", "month"] {
                let w = (key.clone(), span, start(time, span, &berlin));
                *model.sums.entry(w).or_default() += delta;
            }
            *model.sums.entry((key.clone(), "all", 0)).or_default() += delta;
            lines.push(format!("{SUM} {key} {delta} @{time}"));
            let value = format!("v{}", rng.gen_range(0..500));
            let windows = [
                (key.clone(), "day", start(time, "day", &utc)),
                (key.clone(), "week", start(time, "week", &utc)),
                (key.clone(), "all", 0),
            ];
            for w in windows {
                let (values, events) = model.uniques.entry(w).or_default();
                values.insert(value.clone());
                *events += 1;
            }
            lines.push(format!("{UNIQUE} {key} {value} @{time}"));
        }
        Round::of_events(lines)
    }

    fn verify<'a>(&'a self, store: &'a Store) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let (sums, uniques) = {
                let m = self.model.lock().unwrap();
                (m.sums.clone(), m.uniques.clone())
            };
            // The sum's windows and its all-time row, each exact.
            let want: BTreeMap<Window, Option<i64>> =
                sums.iter().map(|(w, n)| (w.clone(), Some(*n))).collect();
            let found = store
                .rows(
                    "SELECT key, span, (extract(epoch FROM window_start) * 1000)::bigint, count \
                     FROM tallyd.window_totals WHERE counter = $1 \
                     UNION ALL SELECT key, 'all', 0, count FROM tallyd.totals WHERE counter = $1",
                    &[&SUM],
                )
                .await
                .into_iter()
                .map(|(db, r)| {
                    let span = span_name(r.get(1));
                    (db, (r.get::<_, String>(0), span, r.get(2)), r.get(3))
                })
                .collect();
            compare(store, SUM, &want, found, |w| w.0.as_str())?;
            verify_sketches(store, &uniques).await?;
            days_union_to_all(store).await
        })
    }
}

fn span_name(span: String) -> &'static str {
    match span.as_str() {
        "day" => "day",
        "week" => "week",
        "month" => "month",
        "all" => "all",
        other => panic!("unexpected span {other}"),
    }
}

/// Every window of the unique counter (and its all-time row) is the extension's sketch of that
/// window's distinct values, with its event count.
async fn verify_sketches(
    store: &Store,
    uniques: &BTreeMap<Window, (BTreeSet<String>, i64)>,
) -> Result<(), String> {
    let mut windows = Vec::new();
    let mut values = Vec::new();
    for (i, (_, (distinct, _))) in uniques.iter().enumerate() {
        for v in distinct {
            windows.push(i as i32);
            values.push(v.as_str());
        }
    }
    let theirs: BTreeMap<i32, (i64, String)> = store
        .first()
        .query(
            "SELECT w, round(hll_cardinality(s))::bigint, s::text FROM \
             (SELECT w, hll_add_agg(hll_hash_text(v), $3, $4) AS s \
              FROM unnest($1::int[], $2::text[]) AS x (w, v) GROUP BY w) y",
            &[&windows, &values, &SKETCH.0, &SKETCH.1],
        )
        .await
        .map_err(|e| format!("the extension's sketches: {e}"))?
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect();
    let want: BTreeMap<Window, (i64, String, i64)> = uniques
        .iter()
        .enumerate()
        .map(|(i, (w, (_, events)))| {
            let (cardinality, sketch) = theirs[&(i as i32)].clone();
            (w.clone(), (cardinality, sketch, *events))
        })
        .collect();
    let found = store
        .rows(
            "SELECT key, span, CASE WHEN span = 'all' THEN 0 \
                    ELSE (extract(epoch FROM window_start) * 1000)::bigint END, \
                    cardinality, sketch::text, events::bigint \
             FROM tallyd.unique_totals WHERE counter = $1",
            &[&UNIQUE],
        )
        .await
        .into_iter()
        .map(|(db, r)| {
            let w = (r.get::<_, String>(0), span_name(r.get(1)), r.get(2));
            (db, w, (r.get(3), r.get(4), r.get(5)))
        })
        .collect();
    compare(store, UNIQUE, &want, found, |w| w.0.as_str()).map_err(|e| format!("sketches: {e}"))
}

/// On every database, each key's day sketches union (`hll_union_agg`) to its all-time sketch.
async fn days_union_to_all(store: &Store) -> Result<(), String> {
    for (i, client) in store.all().iter().enumerate() {
        let row = client
            .query_one(
                "SELECT count(*) FILTER (WHERE d.s IS DISTINCT FROM a.s), count(*) FROM \
                 (SELECT key, hll_union_agg(sketch)::text AS s FROM tallyd.unique_totals \
                  WHERE counter = $1 AND span = 'day' GROUP BY key) d \
                 FULL JOIN (SELECT key, sketch::text AS s FROM tallyd.unique_totals \
                            WHERE counter = $1 AND span = 'all') a USING (key)",
                &[&UNIQUE],
            )
            .await
            .map_err(|e| format!("the union of the days: {e}"))?;
        let (differ, keys): (i64, i64) = (row.get(0), row.get(1));
        if differ != 0 {
            return Err(format!(
                "database {i}: {differ} of {keys} keys' days do not union to their all-time sketch"
            ));
        }
    }
    Ok(())
}
