//! The corrections workload: increments, `!set`, `!forget` and `!forget *` in random order on
//! a text and a bigint counter. Each connection owns its keys (numbers from 100000, which no
//! other workload uses, so that `!forget *` reaches only its own), so the order it sent them in
//! is the order they apply in: its model is each key's total, or no row at all after a forget.

use std::collections::BTreeMap;
use std::sync::Mutex;

use futures_util::future::BoxFuture;
use rand::rngs::StdRng;
use rand::Rng;
use tallyd::config::{CounterConfig, KeyTypeName};

use crate::common::{buf_of, counter};
use crate::workload::{compare, Ctx, Round, Size, Store, Workload};

const COUNTERS: [(&str, KeyTypeName); 2] = [
    ("corr_text", KeyTypeName::Text),
    ("corr_ids", KeyTypeName::Bigint),
];

#[derive(Default)]
pub struct Corrections {
    /// Per (counter, key): its total, `None` once forgotten (no row).
    model: Mutex<BTreeMap<(&'static str, String), Option<i64>>>,
}

impl Workload for Corrections {
    fn name(&self) -> &'static str {
        "corrections"
    }

    fn counters(&self) -> Vec<CounterConfig> {
        COUNTERS.iter().map(|(n, t)| counter(n, *t)).collect()
    }

    fn round(&self, at: Ctx, rng: &mut StdRng) -> Round {
        let (n, keys) = match at.size {
            Size::Small => (rng.gen_range(1..40), 5),
            Size::Large => (800, 300),
        };
        let base = 100_000 + at.conn as u32 * 1000;
        let mut model = self.model.lock().unwrap();
        let mut lines = Vec::new();
        let mut round = Round::default();
        for _ in 0..n {
            let key = (base + rng.gen_range(0..keys)).to_string();
            let counter = COUNTERS[rng.gen_range(0..2)].0;
            let slot = model.entry((counter, key.clone())).or_insert(None);
            let dice = if at.commits {
                rng.gen_range(0..100)
            } else {
                99
            };
            match dice {
                0..=3 => {
                    let v: i64 = rng.gen_range(-1000..1000);
                    lines.push(format!("!set {counter} {key} {v}"));
                    *slot = Some(v);
                    round.replies.push("ok\n".into());
                }
                4..=5 => {
                    lines.push(format!("!forget {counter} {key}"));
                    *slot = None;
                    round.replies.push("ok\n".into());
                }
                6 => {
                    lines.push(format!("!forget * {key}"));
                    for (counter, _) in COUNTERS {
                        model.insert((counter, key.clone()), None);
                    }
                    round.replies.push("ok\n".into());
                }
                _ => {
                    let d: i64 = rng.gen_range(-5..20);
                    lines.push(format!("{counter} {key} {d}"));
                    *slot = Some(slot.unwrap_or(0) + d);
                    round.events += 1;
                }
            }
        }
        // At least one correction a round where they may come: a fault's rounds then carry as
        // many corrections as rounds, whatever the dice said.
        if at.commits && round.replies.is_empty() {
            let key = (base + rng.gen_range(0..keys)).to_string();
            let counter = COUNTERS[rng.gen_range(0..2)].0;
            let v: i64 = rng.gen_range(-1000..1000);
            lines.push(format!("!set {counter} {key} {v}"));
            model.insert((counter, key), Some(v));
            round.replies.push("ok\n".into());
        }
        round.lines = buf_of(lines);
        round
    }

    fn verify<'a>(&'a self, store: &'a Store) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let model = self.model.lock().unwrap().clone();
            for (counter, _) in COUNTERS {
                let want: BTreeMap<String, i64> = model
                    .iter()
                    .filter_map(|((c, k), v)| (*c == counter).then_some((k.clone(), (*v)?)))
                    .collect();
                let found = store
                    .rows(
                        "SELECT key, count FROM tallyd.totals WHERE counter = $1",
                        &[&counter],
                    )
                    .await
                    .into_iter()
                    .map(|(db, r)| (db, r.get::<_, String>(0), r.get::<_, i64>(1)))
                    .collect();
                compare(store, counter, &want, found, |k| k.as_str())?;
            }
            Ok(())
        })
    }
}
