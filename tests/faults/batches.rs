//! The batches workload: every round is a new batch under its own id (`!batch`, events,
//! `!commit`) and the previous round's batch sent again under the same id, as a client does
//! that never saw its answer; its model is each key's total with every batch counted once.
//! The copy sent again is answered `duplicate`, or `ok` when its claim was not decided within
//! the `!commit`'s wait (the database down, or both copies held across a restart): either
//! means the batch counts once, which is what `verify` checks.

use std::collections::BTreeMap;
use std::sync::Mutex;

use futures_util::future::BoxFuture;
use rand::rngs::StdRng;
use rand::Rng;
use tallyd::config::{CounterConfig, KeyTypeName};

use crate::common::counter;
use crate::workload::{compare, Ctx, Round, Size, Store, Workload};

const COUNTER: &str = "batches";

#[derive(Default)]
pub struct Batches {
    totals: Mutex<BTreeMap<String, i64>>,
    /// Per connection: the last batch sent (its lines, `!batch` to `!commit`, and its size).
    last: Mutex<BTreeMap<usize, (Vec<u8>, usize)>>,
}

impl Workload for Batches {
    fn name(&self) -> &'static str {
        "batches"
    }

    fn counters(&self) -> Vec<CounterConfig> {
        vec![counter(COUNTER, KeyTypeName::Text)]
    }

    fn round(&self, at: Ctx, rng: &mut StdRng) -> Round {
        let mut totals = self.totals.lock().unwrap();
        let (n, own_keys) = match at.size {
            Size::Small => (40, 100),
            Size::Large => (1500, 50_000),
        };
        let mut batch = format!("!batch faults:c{}:r{}\n", at.conn, at.round).into_bytes();
        for _ in 0..n {
            let key = if rng.gen_bool(0.3) {
                format!("hot{}", rng.gen_range(0..10))
            } else {
                format!("c{}-{}", at.conn, rng.gen_range(0..own_keys))
            };
            let delta: i64 = rng.gen_range(1..20);
            *totals.entry(key.clone()).or_default() += delta;
            batch.extend_from_slice(format!("{COUNTER} {key} {delta}\n").as_bytes());
        }
        batch.extend_from_slice(b"!commit\n");
        let mut lines = batch.clone();
        let mut replies = vec!["ok\n".to_string(), format!("ok {n} 0\n")];
        let mut last = self.last.lock().unwrap();
        if let Some((again, size)) = last.insert(at.conn, (batch, n)) {
            lines.extend_from_slice(&again);
            replies.push("ok\n".to_string());
            replies.push(format!("duplicate\n|ok {size} 0\n"));
        }
        // A batch's lines are not counted by `!flush`: `!commit` answered for them.
        Round {
            lines,
            events: 0,
            rejected: 0,
            replies,
        }
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
