//! The sums workload: deltas (a few negative) on hot keys every connection shares and on keys
//! of one connection; its model is each key's total.

use std::collections::BTreeMap;
use std::sync::Mutex;

use futures_util::future::BoxFuture;
use rand::rngs::StdRng;
use rand::Rng;
use tallyd::config::{CounterConfig, KeyTypeName};

use crate::common::counter;
use crate::workload::{compare, Ctx, Round, Size, Store, Workload};

const COUNTER: &str = "sums";

#[derive(Default)]
pub struct Sums {
    totals: Mutex<BTreeMap<String, i64>>,
}

impl Workload for Sums {
    fn name(&self) -> &'static str {
        "sums"
    }

    fn counters(&self) -> Vec<CounterConfig> {
        vec![counter(COUNTER, KeyTypeName::Text)]
    }

    fn round(&self, at: Ctx, rng: &mut StdRng) -> Round {
        let mut totals = self.totals.lock().unwrap();
        let mut lines = Vec::new();
        let (n, own_keys) = match at.size {
            Size::Small => (60, 100),
            Size::Large => (1500, 100_000),
        };
        for _ in 0..n {
            let key = if rng.gen_bool(0.3) {
                format!("hot{}", rng.gen_range(0..10))
            } else {
                format!("c{}-{}", at.conn, rng.gen_range(0..own_keys))
            };
            let delta: i64 = rng.gen_range(-3..20);
            *totals.entry(key.clone()).or_default() += delta;
            lines.push(format!("{COUNTER} {key} {delta}"));
        }
        Round::of_events(lines)
    }

    fn verify<'a>(&'a self, store: &'a Store) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let want: BTreeMap<String, Option<i64>> = self
                .totals
                .lock()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), Some(*v)))
                .collect();
            let found = store
                .rows(
                    "SELECT key, count FROM tallyd.totals WHERE counter = $1",
                    &[&COUNTER],
                )
                .await
                .into_iter()
                .map(|(db, r)| (db, r.get::<_, String>(0), r.get::<_, Option<i64>>(1)))
                .collect();
            compare(store, COUNTER, &want, found, |k| k.as_str())
        })
    }
}
