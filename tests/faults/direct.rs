//! The direct workload: a day counter in Berlin with its all-time total (`also = ["all"]`),
//! `rollup_into` crates.io's `version_downloads` shape with `insert_missing` and `direct` (the
//! default): each flight writes its day rows into the application's table and its all-time rows
//! into `tallyd.rollups` in its own transaction, or, when a direct write fails, through
//! `tallyd.slots` for the rollup. Its model is every (key, day) total and every key's all-time
//! total: a day is the table's row plus what tallyd still holds for it (`tallyd.window_totals`:
//! slot rows a fallback or a fault left, rows a shard move put in `tallyd.rollups`), summed over
//! the databases; the all-time total is `tallyd.totals`, on the key's own database.

use std::collections::BTreeMap;
use std::sync::Mutex;

use futures_util::future::BoxFuture;
use rand::rngs::StdRng;
use rand::Rng;
use tallyd::config::{Also, CounterConfig, KeyTypeName, RollupInto};
use tallyd::window::Span;

use crate::common::counter;
use crate::kinds::BASE;
use crate::workload::{compare, Ctx, Round, Size, Store, Workload};

const COUNTER: &str = "direct_vd";
const ZONE: &str = "Europe/Berlin";
const DAY: i64 = 86_400_000;
/// The Berlin days its events fall on: 2026-11-22 to 25, the first starting at this instant
/// (midnight, UTC+1).
const FIRST_DAY: i64 = BASE - 3 * DAY - 3_600_000;
const DAYS: [&str; 4] = ["2026-11-22", "2026-11-23", "2026-11-24", "2026-11-25"];

#[derive(Default)]
struct Model {
    /// (key, day as the table's `date` column prints it).
    days: BTreeMap<(i64, String), i64>,
    all: BTreeMap<String, i64>,
}

#[derive(Default)]
pub struct Direct {
    model: Mutex<Model>,
}

impl Workload for Direct {
    fn name(&self) -> &'static str {
        "direct"
    }

    fn counters(&self) -> Vec<CounterConfig> {
        let mut c = counter(COUNTER, KeyTypeName::Bigint);
        c.window = Some(Span::Day);
        c.time_zone = Some(ZONE.into());
        c.also = vec![Also::All];
        c.rollup_into = Some(RollupInto {
            table: "public.fault_downloads".into(),
            key_column: "version_id".into(),
            window_column: Some("date".into()),
            column: "downloads".into(),
            insert_missing: true,
            direct: true,
            on_add: Default::default(),
        });
        vec![c]
    }

    /// crates.io's table, a few rows there already (the column adds to them).
    fn setup_sql(&self) -> String {
        "CREATE TABLE public.fault_downloads (version_id bigint NOT NULL, date date NOT NULL, \
             downloads bigint NOT NULL DEFAULT 0, PRIMARY KEY (version_id, date)); \
         INSERT INTO public.fault_downloads \
             SELECT i, date '2026-11-24', 1000 FROM generate_series(1, 20) i;"
            .into()
    }

    fn round(&self, at: Ctx, rng: &mut StdRng) -> Round {
        let (n, keys) = match at.size {
            Size::Small => (40, 30),
            Size::Large => (800, 2_000),
        };
        let mut model = self.model.lock().unwrap();
        let mut lines = Vec::new();
        for _ in 0..n {
            let id: i64 = rng.gen_range(1..=keys);
            // One of the four days, its first and last millisecond now and then.
            let d = rng.gen_range(0..DAYS.len());
            let day = FIRST_DAY + d as i64 * DAY;
            let time = day + [0, DAY - 1, rng.gen_range(0..DAY)][rng.gen_range(0..3)];
            let delta: i64 = rng.gen_range(1..10);
            *model.days.entry((id, DAYS[d].to_string())).or_default() += delta;
            *model.all.entry(id.to_string()).or_default() += delta;
            lines.push(format!("{COUNTER} {id} {delta} @{time}"));
        }
        Round::of_events(lines)
    }

    fn verify<'a>(&'a self, store: &'a Store) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let (want, all) = {
                let m = self.model.lock().unwrap();
                (m.days.clone(), m.all.clone())
            };
            // Each (key, day): the table's growth plus what tallyd holds, over the databases.
            let mut found: BTreeMap<(i64, String), i64> = BTreeMap::new();
            let rows = store
                .rows(
                    "SELECT version_id, date::text, downloads - \
                         CASE WHEN date = '2026-11-24' AND version_id <= 20 THEN 1000 ELSE 0 END \
                     FROM public.fault_downloads \
                     UNION ALL \
                     SELECT key::bigint, \
                         ((window_start + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date::text, \
                         count FROM tallyd.window_totals WHERE counter = $1 AND span = 'day'",
                    &[&COUNTER],
                )
                .await;
            for (_, r) in rows {
                let n: i64 = r.get(2);
                if n != 0 {
                    *found.entry((r.get(0), r.get(1))).or_default() += n;
                }
            }
            if found != want {
                let differ: Vec<_> = want
                    .keys()
                    .chain(found.keys())
                    .filter(|k| want.get(k) != found.get(k))
                    .take(5)
                    .map(|k| (k, found.get(k), want.get(k)))
                    .collect();
                return Err(format!(
                    "{COUNTER}: ((key, day), table plus held, sent) differ: {differ:?}"
                ));
            }
            // The all-time totals, each key on its own database.
            let want: BTreeMap<String, Option<i64>> =
                all.into_iter().map(|(k, n)| (k, Some(n))).collect();
            let found = store
                .rows(
                    "SELECT key, count FROM tallyd.totals WHERE counter = $1",
                    &[&COUNTER],
                )
                .await
                .into_iter()
                .map(|(db, r)| (db, r.get::<_, String>(0), r.get(1)))
                .collect();
            compare(store, COUNTER, &want, found, |k| k.as_str())
        })
    }
}
