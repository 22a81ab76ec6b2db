//! The rollup_into workload: a bigint counter folded into an application's table
//! (`public.fault_repos.downloads`, matched on `id`), whose rows start at a value of their own;
//! a few keys have no row and stay in tallyd's slots. Its model is what each key was sent: the
//! column's growth plus the key's unfolded slot rows, read in one statement (one snapshot, so a
//! rollup running meanwhile moves nothing between the two), summed over the databases (each
//! folds the rows it holds into its own table).

use std::collections::BTreeMap;
use std::sync::Mutex;

use futures_util::future::BoxFuture;
use rand::rngs::StdRng;
use rand::Rng;
use tallyd::config::{CounterConfig, KeyTypeName};

use crate::common::counter_rolled_into;
use crate::workload::{Ctx, Round, Size, Store, Workload};

const COUNTER: &str = "into_app";
/// Keys 1 to ROWS have a row; ROWS + 1 to ROWS + UNMATCHED do not.
const ROWS: i64 = 300;
const UNMATCHED: i64 = 5;

#[derive(Default)]
pub struct RollupInto {
    sent: Mutex<BTreeMap<i64, i64>>,
}

impl Workload for RollupInto {
    fn name(&self) -> &'static str {
        "rollup_into"
    }

    fn counters(&self) -> Vec<CounterConfig> {
        vec![counter_rolled_into(
            COUNTER,
            KeyTypeName::Bigint,
            "public.fault_repos",
            "id",
            "downloads",
        )]
    }

    /// Each row starts at its id, so that a fold that replaced the column instead of adding to
    /// it would show.
    fn setup_sql(&self) -> String {
        format!(
            "CREATE TABLE public.fault_repos (id bigint PRIMARY KEY, downloads bigint NOT NULL); \
             INSERT INTO public.fault_repos SELECT i, i FROM generate_series(1, {ROWS}) i;"
        )
    }

    fn round(&self, at: Ctx, rng: &mut StdRng) -> Round {
        let n = match at.size {
            Size::Small => 40,
            Size::Large => 800,
        };
        let mut sent = self.sent.lock().unwrap();
        let mut lines = Vec::new();
        for _ in 0..n {
            let id = rng.gen_range(1..=ROWS + UNMATCHED);
            let delta: i64 = rng.gen_range(1..10);
            *sent.entry(id).or_default() += delta;
            lines.push(format!("{COUNTER} {id} {delta}"));
        }
        Round::of_events(lines)
    }

    fn verify<'a>(&'a self, store: &'a Store) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let sent = self.sent.lock().unwrap().clone();
            // Per key: the column's growth, over every database, plus its slot rows.
            let mut found: BTreeMap<i64, i64> = BTreeMap::new();
            let rows = store
                .rows(
                    "SELECT coalesce(a.id, t.key::bigint), a.downloads - a.id, t.count \
                     FROM public.fault_repos a FULL JOIN \
                          (SELECT key, count FROM tallyd.totals WHERE counter = $1) t \
                     ON t.key = a.id::text",
                    &[&COUNTER],
                )
                .await;
            for (db, r) in rows {
                let id: i64 = r.get(0);
                let (folded, pending): (Option<i64>, Option<i64>) = (r.get(1), r.get(2));
                if pending.is_some() && db != store.home(COUNTER, &id.to_string()) {
                    return Err(format!("{COUNTER} {id}: slot rows on database {db}"));
                }
                let n = folded.unwrap_or(0) + pending.unwrap_or(0);
                if n != 0 {
                    *found.entry(id).or_default() += n;
                }
            }
            let want: BTreeMap<i64, i64> = sent.into_iter().filter(|(_, n)| *n != 0).collect();
            if found != want {
                let differ: Vec<_> = want
                    .keys()
                    .chain(found.keys())
                    .filter(|id| want.get(id) != found.get(id))
                    .take(5)
                    .map(|id| (id, found.get(id), want.get(id)))
                    .collect();
                return Err(format!(
                    "{COUNTER}: (key, folded plus pending, sent) differ: {differ:?}"
                ));
            }
            // Nothing of it in tallyd's own summary (but what a shard move put there).
            if store.moved {
                return Ok(());
            }
            for (i, client) in store.all().iter().enumerate() {
                let n = crate::common::scalar(
                    client,
                    "SELECT count(*) FROM tallyd.rollups WHERE counter = 'into_app'",
                )
                .await;
                if n != 0 {
                    return Err(format!(
                        "{COUNTER}: {n} rows in tallyd.rollups on database {i}"
                    ));
                }
            }
            Ok(())
        })
    }
}
