//! The kinds workloads, one per kind of value: `unique` (its sketch byte for byte the
//! extension's `hll_add_agg(hll_hash_text(v), log2m, regwidth)` of the distinct values sent),
//! `max`, `min` and `last` (the value of the latest event, ties to the larger). Keys are shared
//! by every connection; odd rounds carry event times older than every even round's, so a replay
//! or a retry of old events must not move a `last` value back.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use futures_util::future::BoxFuture;
use rand::rngs::StdRng;
use rand::Rng;
use tallyd::config::CounterConfig;

use crate::common::kind_counter;
use crate::workload::{compare, Ctx, Round, Size, Store, Workload};

/// 2026-11-25T00:00:00Z: event times are around it.
pub const BASE: i64 = 1_795_564_800_000;

/// A kind of value, as config.toml names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Unique,
    Max,
    Min,
    Last,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Unique => "unique",
            Kind::Max => "max",
            Kind::Min => "min",
            Kind::Last => "last",
        }
    }
}

/// The sketch parameters of the unique workload's counter, declared explicitly.
pub const SKETCH: (i32, i32) = (11, 5);

/// What one key must show, from the events sent to it.
#[derive(Clone, Debug, Default)]
pub struct Kept {
    pub events: i64,
    /// A unique counter's distinct values.
    pub distinct: BTreeSet<String>,
    /// A max, min or last counter's (event time, value): for last, the latest event's, ties to
    /// the larger value.
    pub value: Option<(i64, i64)>,
}

impl Kept {
    pub fn add(&mut self, kind: Kind, at: i64, value: i64) {
        self.value = Some(match (kind, self.value) {
            (_, None) => (at, value),
            (Kind::Max, Some((t, v))) => (t.max(at), v.max(value)),
            (Kind::Min, Some((t, v))) => (t.max(at), v.min(value)),
            (_, Some(mine)) => mine.max((at, value)),
        });
    }
}

/// One kind's workload: a counter named after the kind, keys `k<n>`.
pub struct Kinds {
    kind: Kind,
    keys: Mutex<BTreeMap<String, Kept>>,
}

impl Kinds {
    pub fn new(kind: Kind) -> Kinds {
        Kinds {
            kind,
            keys: Mutex::new(BTreeMap::new()),
        }
    }

    fn counter(&self) -> &'static str {
        self.kind.name()
    }
}

impl Workload for Kinds {
    fn name(&self) -> &'static str {
        self.kind.name()
    }

    fn counters(&self) -> Vec<CounterConfig> {
        let extra = match self.kind {
            Kind::Unique => format!("log2m = {}\nregwidth = {}", SKETCH.0, SKETCH.1),
            _ => String::new(),
        };
        vec![kind_counter(self.counter(), self.kind.name(), &extra)]
    }

    fn round(&self, at: Ctx, rng: &mut StdRng) -> Round {
        let (n, keys) = match at.size {
            Size::Small => (40, 30),
            Size::Large => (1500, 1200),
        };
        // Even rounds later and later, odd ones earlier and earlier; 200 ms wide, so that
        // several events share a millisecond and `last` breaks ties by value.
        let step = at.round as i64 * 10_000;
        let from = BASE + if at.round % 2 == 0 { step } else { -step };
        let mut kept = self.keys.lock().unwrap();
        let mut lines = Vec::with_capacity(n);
        for _ in 0..n {
            let key = format!("k{}", rng.gen_range(0..keys));
            let time = from + rng.gen_range(0..200);
            let slot = kept.entry(key.clone()).or_default();
            slot.events += 1;
            let value = if self.kind == Kind::Unique {
                let value = format!("v{}", rng.gen_range(0..3000));
                slot.distinct.insert(value.clone());
                value
            } else {
                let value = rng.gen_range(-1_000_000i64..=1_000_000);
                slot.add(self.kind, time, value);
                value.to_string()
            };
            lines.push(format!("{} {key} {value} @{time}", self.counter()));
        }
        Round::of_events(lines)
    }

    fn verify<'a>(&'a self, store: &'a Store) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let counter = self.counter();
            let kept = self.keys.lock().unwrap().clone();
            // Per key: its kind, events and value.
            let want: BTreeMap<String, (String, i64, Option<i64>)> = kept
                .iter()
                .map(|(key, k)| {
                    let value = k.value.map(|(_, v)| v);
                    (key.clone(), (self.kind.name().to_string(), k.events, value))
                })
                .collect();
            let found = store
                .rows(
                    "SELECT key, kind, count, value FROM tallyd.totals WHERE counter = $1",
                    &[&counter],
                )
                .await
                .into_iter()
                .map(|(db, r)| (db, r.get::<_, String>(0), (r.get(1), r.get(2), r.get(3))))
                .collect();
            compare(store, counter, &want, found, |k| k.as_str())?;
            if self.kind == Kind::Unique {
                verify_sketches(store, counter, &kept).await?;
            }
            Ok(())
        })
    }
}

/// Every key's all-time row of `tallyd.unique_totals` is the extension's sketch of the key's
/// distinct values (cardinality and sketch as text), with its event count: two statements per
/// database, whatever the number of keys.
async fn verify_sketches(
    store: &Store,
    counter: &str,
    kept: &BTreeMap<String, Kept>,
) -> Result<(), String> {
    let (keys, values): (Vec<&str>, Vec<&str>) = kept
        .iter()
        .flat_map(|(k, kept)| kept.distinct.iter().map(move |v| (k.as_str(), v.as_str())))
        .unzip();
    let theirs: BTreeMap<String, (i64, String)> = store
        .first()
        .query(
            "SELECT k, round(hll_cardinality(s))::bigint, s::text FROM \
             (SELECT k, hll_add_agg(hll_hash_text(v), $3, $4) AS s \
              FROM unnest($1::text[], $2::text[]) AS x (k, v) GROUP BY k) y",
            &[&keys, &values, &SKETCH.0, &SKETCH.1],
        )
        .await
        .map_err(|e| format!("the extension's sketches: {e}"))?
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect();
    let want: BTreeMap<String, (i64, String, i64)> = kept
        .iter()
        .map(|(key, k)| {
            let (cardinality, sketch) = theirs[key].clone();
            (key.clone(), (cardinality, sketch, k.events))
        })
        .collect();
    let found = store
        .rows(
            "SELECT key, cardinality, sketch::text, events::bigint \
             FROM tallyd.unique_totals WHERE counter = $1 AND span = 'all'",
            &[&counter],
        )
        .await
        .into_iter()
        .map(|(db, r)| (db, r.get::<_, String>(0), (r.get(1), r.get(2), r.get(3))))
        .collect();
    compare(store, counter, &want, found, |k| k.as_str()).map_err(|e| format!("sketches: {e}"))
}
