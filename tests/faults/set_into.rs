//! The set-into workload: `!set` of a `rollup_into` counter (issue 35, migrations/V20) among its
//! increments. A day counter in Berlin with its all-time total (`also = ["all"]`), written
//! directly into a crates.io-shaped table with `insert_missing` and `on_add = { processed =
//! false }`: a set writes the day's value into the application's row (inserting it where
//! missing) and moves the all-time row by the difference. Its model is every (key, day) total
//! (the last set's value, at least 1, plus the events after it) and every key's all-time total (the sum of
//! its days): a day is the table's row plus what tallyd still holds for it, summed over the
//! databases, as for the direct workload. Not run by the shard move: a set on the key's new
//! database cannot reach the row the old database's table keeps (docs/reliability.md).

use std::collections::BTreeMap;
use std::sync::Mutex;

use futures_util::future::BoxFuture;
use rand::rngs::StdRng;
use rand::Rng;
use tallyd::config::{Also, Constant, CounterConfig, KeyTypeName, RollupInto};
use tallyd::window::Span;

use crate::common::{buf_of, counter};
use crate::kinds::BASE;
use crate::workload::{compare, Ctx, Round, Size, Store, Workload};

const COUNTER: &str = "set_into_vd";
const ZONE: &str = "Europe/Berlin";
const DAY: i64 = 86_400_000;
/// The Berlin days its events fall on: 2026-11-22 to 25, the first starting at this instant.
const FIRST_DAY: i64 = BASE - 3 * DAY - 3_600_000;
const DAYS: [&str; 4] = ["2026-11-22", "2026-11-23", "2026-11-24", "2026-11-25"];

#[derive(Default)]
pub struct SetInto {
    /// (key, day as the table's `date` column prints it): its total.
    model: Mutex<BTreeMap<(i64, String), i64>>,
}

impl Workload for SetInto {
    fn name(&self) -> &'static str {
        "set_into"
    }

    fn counters(&self) -> Vec<CounterConfig> {
        let mut c = counter(COUNTER, KeyTypeName::Bigint);
        c.window = Some(Span::Day);
        c.time_zone = Some(ZONE.into());
        c.also = vec![Also::All];
        c.rollup_into = Some(RollupInto {
            table: "public.fault_set_downloads".into(),
            key_column: "version_id".into(),
            window_column: Some("date".into()),
            column: "downloads".into(),
            insert_missing: true,
            direct: true,
            on_add: [("processed".to_string(), Constant::Bool(false))].into(),
        });
        vec![c]
    }

    fn setup_sql(&self) -> String {
        "CREATE TABLE public.fault_set_downloads (version_id bigint NOT NULL, date date NOT NULL, \
             downloads bigint NOT NULL DEFAULT 0, processed boolean NOT NULL DEFAULT true, \
             PRIMARY KEY (version_id, date));"
            .into()
    }

    fn round(&self, at: Ctx, rng: &mut StdRng) -> Round {
        let (n, keys) = match at.size {
            Size::Small => (30, 20),
            Size::Large => (600, 1_500),
        };
        // Each connection its own keys: the order it sent them in is the order they apply in.
        let base = 1 + at.conn as i64 * 10_000;
        let mut model = self.model.lock().unwrap();
        let mut lines = Vec::new();
        let mut round = Round::default();
        for i in 0..n {
            let id = base + rng.gen_range(0..keys);
            let d = rng.gen_range(0..DAYS.len());
            let day = FIRST_DAY + d as i64 * DAY;
            let time = day + [0, DAY - 1, rng.gen_range(0..DAY)][rng.gen_range(0..3)];
            let total = model.entry((id, DAYS[d].to_string())).or_default();
            // A set now and then, and one a round where they may come.
            let set =
                at.commits && (rng.gen_range(0..100) < 5 || (i == 0 && round.replies.is_empty()));
            if set {
                let v: i64 = rng.gen_range(1..5_000);
                lines.push(format!("!set {COUNTER} {id} {v} @{time}"));
                *total = v;
                round.replies.push("ok\n".into());
            } else {
                let delta: i64 = rng.gen_range(1..10);
                lines.push(format!("{COUNTER} {id} {delta} @{time}"));
                *total += delta;
                round.events += 1;
            }
        }
        round.lines = buf_of(lines);
        round
    }

    fn verify<'a>(&'a self, store: &'a Store) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let want = self.model.lock().unwrap().clone();
            let mut found: BTreeMap<(i64, String), i64> = BTreeMap::new();
            let rows = store
                .rows(
                    "SELECT version_id, date::text, downloads FROM public.fault_set_downloads \
                     UNION ALL \
                     SELECT key::bigint, \
                         ((window_start + interval '12 hours') AT TIME ZONE 'Europe/Berlin')::date::text, \
                         count FROM tallyd.window_totals WHERE counter = $1 AND span = 'day'",
                    &[&COUNTER],
                )
                .await;
            for (_, r) in rows {
                *found.entry((r.get(0), r.get(1))).or_default() += r.get::<_, i64>(2);
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
            let reopened = store
                .rows(
                    "SELECT count(*) FROM public.fault_set_downloads WHERE processed",
                    &[],
                )
                .await;
            if reopened.iter().any(|(_, r)| r.get::<_, i64>(0) != 0) {
                return Err(format!(
                    "{COUNTER}: a row tallyd wrote kept processed = true"
                ));
            }
            // The all-time totals: the sum of each key's days, each key on its own database.
            let mut all: BTreeMap<String, i64> = BTreeMap::new();
            for ((id, _), n) in &want {
                *all.entry(id.to_string()).or_default() += n;
            }
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
