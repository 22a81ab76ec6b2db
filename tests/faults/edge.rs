//! The 64-bit edge workload: a windowed sum with an all-time row (`also = ["all"]`) whose keys
//! live near `i64::MAX`. Each key of a connection starts at the maximum less a million on its
//! first day; then small events on three other days, and (where corrections may come) sets of
//! those days that move the all-time row up to 10,000 below the maximum. Its model is each
//! key's day rows and all-time total, exact, through kill -9, replays, folds and shard moves
//! (which once summed a moved key's rows in 64 bits and stopped the daemon). Sets refused
//! beyond the maximum are not sent here: one read past the memory cap is spilled and folded
//! by the folder, whose refusal reaches no connection (answered `ok`, though nothing changed;
//! docs/reliability.md), so the answer depends on the fault; they are checked in
//! tests/corrections/refusals.rs.

use std::collections::BTreeMap;
use std::sync::Mutex;

use futures_util::future::BoxFuture;
use rand::rngs::StdRng;
use rand::Rng;
use tallyd::config::CounterConfig;

use crate::common::{buf_of, unix_ms, windowed_counter};
use crate::workload::{compare, Ctx, Round, Size, Store, Workload};

const COUNTER: &str = "edge";
/// The first instant of each of the four days (UTC) its events fall in.
const DAYS: [&str; 4] = [
    "2026-11-20T00:00:00Z",
    "2026-11-21T00:00:00Z",
    "2026-11-22T00:00:00Z",
    "2026-11-23T00:00:00Z",
];
/// Where each key starts (day 0), and how close to the maximum its events may take it.
const SEED: i64 = i64::MAX - 1_000_000;
const MARGIN: i64 = 10_000;

/// (key, span, window start in Unix ms; 0 for the all-time row).
type Row = (String, &'static str, i64);

/// A key's day totals (a day with a row) and its all-time total.
type Totals = ([Option<i64>; 4], i64);

#[derive(Default)]
pub struct Edge {
    model: Mutex<BTreeMap<String, Totals>>,
}

impl Workload for Edge {
    fn name(&self) -> &'static str {
        "edge"
    }

    fn counters(&self) -> Vec<CounterConfig> {
        vec![windowed_counter(COUNTER, "day", "UTC", &["all"])]
    }

    fn round(&self, at: Ctx, rng: &mut StdRng) -> Round {
        let (keys, per_key) = match at.size {
            Size::Small => (3, 5),
            Size::Large => (20, 60),
        };
        let mut model = self.model.lock().unwrap();
        let mut lines = Vec::new();
        let mut round = Round::default();
        for k in 0..keys {
            let key = format!("e{}-{k}", at.conn);
            let (days, all) = model.entry(key.clone()).or_insert(([None; 4], 0));
            if days[0].is_none() {
                lines.push(format!("{COUNTER} {key} {SEED} @{}", unix_ms(DAYS[0])));
                days[0] = Some(SEED);
                *all += SEED;
                round.events += 1;
                continue;
            }
            let d = rng.gen_range(1..4);
            let day = days[d].unwrap_or(0);
            // A set alone on its key in the round: no event of the key shares its flight.
            if at.commits && *all + 1000 <= i64::MAX - MARGIN && rng.gen_bool(0.3) {
                let v = day + rng.gen_range(0..1000);
                lines.push(format!("!set {COUNTER} {key} {v} @{}", unix_ms(DAYS[d])));
                *all += v - day;
                days[d] = Some(v);
                round.replies.push("ok\n".into());
                continue;
            }
            for _ in 0..per_key {
                let delta = rng.gen_range(1..6);
                if *all + delta > i64::MAX - MARGIN {
                    break;
                }
                let d = rng.gen_range(1..4);
                lines.push(format!("{COUNTER} {key} {delta} @{}", unix_ms(DAYS[d])));
                days[d] = Some(days[d].unwrap_or(0) + delta);
                *all += delta;
                round.events += 1;
            }
        }
        round.lines = buf_of(lines);
        round
    }

    fn verify<'a>(&'a self, store: &'a Store) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let mut want: BTreeMap<Row, Option<i64>> = BTreeMap::new();
            for (key, (days, all)) in self.model.lock().unwrap().iter() {
                for (d, n) in days.iter().enumerate() {
                    if let Some(n) = n {
                        want.insert((key.clone(), "day", unix_ms(DAYS[d])), Some(*n));
                    }
                }
                want.insert((key.clone(), "all", 0), Some(*all));
            }
            let found = store
                .rows(
                    "SELECT key, span, (extract(epoch FROM window_start) * 1000)::bigint, count \
                     FROM tallyd.window_totals WHERE counter = $1 \
                     UNION ALL SELECT key, 'all', 0, count FROM tallyd.totals WHERE counter = $1",
                    &[&COUNTER],
                )
                .await
                .into_iter()
                .map(|(db, r)| {
                    let span = if r.get::<_, String>(1) == "all" {
                        "all"
                    } else {
                        "day"
                    };
                    (db, (r.get::<_, String>(0), span, r.get(2)), r.get(3))
                })
                .collect();
            compare(store, COUNTER, &want, found, |w| w.0.as_str())
        })
    }
}
