//! The counter model: one resolved [`Counter`] per counter id, built from its `[[counters]]`
//! table by one constructor ([`Counter::from_config`]), and the table of them by id
//! ([`counter_table`]) that the start builds and every reload builds again and swaps whole.
//!
//! Every part of the pipeline reads a counter here: the parser's index of names, key types and
//! kinds (`ingest::Schema`), the router (windows, retention, `!set`), the flush workers (name,
//! slots, windows) and the status view (name), and a reload compares the running table with the
//! new one. None of them keeps a copy of its own: a new counter key is added here once.

use std::collections::HashMap;

use crate::hll::Params;
use crate::kind::Kind;
use crate::protocol::KeyType;
use crate::window::{Span, Window, ALL_TIME};

use super::{ConfigError, CounterConfig, RollupInto};

/// A counter as the running daemon reads it: its `[[counters]]` table resolved (defaults
/// applied, windows loaded in their zone, what follows from the keys worked out). Its id, which
/// parsed events and pending rows carry, is its place in the table ([`counter_table`]).
#[derive(Clone, Debug)]
pub struct Counter {
    pub name: String,
    /// The key hash's seed, from the name ([`crate::routing::counter_seed`]): which bucket,
    /// database and flush worker a key goes to.
    pub seed: u64,
    /// How its keys are checked and canonicalised.
    pub key_type: KeyType,
    /// What it keeps per key.
    pub kind: Kind,
    /// A unique counter's sketch parameters (`log2m`, `regwidth`); `None` for the other kinds.
    pub params: Option<Params>,
    /// How many slot rows a key may spread over in `tallyd.slots`.
    pub slots: u32,
    /// The window its rows count in, loaded in its zone; `None`: all-time rows only.
    pub window: Option<Window>,
    /// `time_zone` as declared (`UTC` when unset): a reload refuses any change of it.
    pub time_zone: String,
    /// The coarser windows of `also`, in the same zone, finest first: written with `window`'s
    /// rows, in the same transaction.
    pub also: Vec<Window>,
    /// Whether all-time rows (`win` = [`ALL_TIME`]) are written: always without a window, and
    /// with one when `also` lists `all`.
    pub all_time: bool,
    /// `keep_windows`: how many windows of `window` are kept; `None`: all.
    pub keep_windows: Option<u32>,
    /// Whether `!set` can set a key's total exactly (see [`Counter::from_config`]).
    pub settable: bool,
    /// Where the rollup folds it, as declared; `None`: into `tallyd.rollups`.
    pub rollup_into: Option<RollupInto>,
    /// Whether lines may name it: false once a reload removed it. It keeps its id, retired,
    /// since pending and journaled events name it.
    pub live: bool,
}

impl Counter {
    /// `c` resolved: its window (and each `also` window) loaded in its zone. Validation loaded
    /// them already, so an error here means the zone left the system's database since.
    ///
    /// `settable`: `!set` can set a key's total exactly unless the counter is unique (a sketch
    /// is not a number), a max or min folded into an application's table (a set of a sum's
    /// column is written there, in the flush's transaction: `tallyd.set_target`, migrations/V20),
    /// or a windowed max, min or last counter that also writes coarser or all-time rows (a
    /// coarser max cannot follow a window's lowered one without every window's values). A
    /// windowed sum's coarser rows move by the window's difference.
    pub fn from_config(c: &CounterConfig) -> Result<Counter, ConfigError> {
        let window = c.window()?;
        let also: Vec<Window> = match &window {
            Some(window) => c
                .also_spans()
                .into_iter()
                .map(|span| window.with_span(span))
                .collect(),
            None => Vec::new(),
        };
        let all_time = c.all_time();
        let writes_also = window.is_some() && (all_time || !also.is_empty());
        let settable = c.kind != Kind::Unique
            && (c.rollup_into.is_none() || c.kind == Kind::Sum)
            && (c.kind == Kind::Sum || !writes_also);
        Ok(Counter {
            name: c.name.clone(),
            seed: crate::routing::counter_seed(&c.name),
            key_type: c.key_type,
            kind: c.kind,
            params: c.sketch_params(),
            slots: c.slots,
            window,
            time_zone: c.time_zone().to_string(),
            also,
            all_time,
            keep_windows: c.keep_windows,
            settable,
            rollup_into: c.rollup_into.clone(),
            live: true,
        })
    }

    /// An all-time sum counter of text keys, as every counter was before windows and kinds:
    /// what unit tests of the flush need.
    #[cfg(test)]
    pub fn new(name: &str, slots: u32) -> Counter {
        let declared = format!("name = {name:?}\nslots = {slots}\n");
        let c: CounterConfig = toml::from_str(&declared).expect("a plain counter");
        Counter::from_config(&c).expect("no window to load")
    }

    /// The span of `window`; `None` for an all-time counter.
    pub fn span(&self) -> Option<Span> {
        self.window.as_ref().map(Window::span)
    }

    /// The rows written with window `win` of this counter's window: each of its `also` windows
    /// holding it and the all-time row, as (span name, start in Unix ms); none without a window.
    pub fn also_of(&self, win: i64) -> Vec<(&'static str, i64)> {
        if self.window.is_none() {
            return Vec::new();
        }
        let mut out: Vec<(&'static str, i64)> = self
            .also
            .iter()
            .map(|w| (w.span().name(), w.bounds(win).0))
            .collect();
        if self.all_time {
            out.push(("all", ALL_TIME));
        }
        out
    }
}

/// The counter table once `declared` is in force over the `running` one (empty at the start):
/// each declared counter at the id it runs under (found by name), else at the next free id; a
/// running counter no longer declared stays at its id, retired (`live` false). Ids only grow,
/// since events name counters by id.
pub fn counter_table(
    running: &[Counter],
    declared: &[CounterConfig],
) -> Result<Vec<Counter>, ConfigError> {
    let mut table: Vec<Counter> = running
        .iter()
        .map(|c| Counter {
            live: false,
            ..c.clone()
        })
        .collect();
    let mut ids: HashMap<String, usize> = (table.iter().enumerate())
        .map(|(id, c)| (c.name.clone(), id))
        .collect();
    for c in declared {
        let counter = Counter::from_config(c)?;
        match ids.get(&c.name) {
            Some(&id) => table[id] = counter,
            None => {
                ids.insert(c.name.clone(), table.len());
                table.push(counter);
            }
        }
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn counters(text: &str) -> Vec<CounterConfig> {
        Config::from_toml(text, Vec::new()).unwrap().counters
    }

    #[test]
    fn ids_only_grow_and_a_removed_counter_stays_retired() {
        let first = counter_table(
            &[],
            &counters("[[counters]]\nname = \"a\"\n[[counters]]\nname = \"b\"\n"),
        )
        .unwrap();
        let next = counters("[[counters]]\nname = \"c\"\n[[counters]]\nname = \"b\"\nslots = 7\n");
        let table = counter_table(&first, &next).unwrap();
        let got: Vec<(&str, bool, u32)> = table
            .iter()
            .map(|c| (c.name.as_str(), c.live, c.slots))
            .collect();
        assert_eq!(got, [("a", false, 100), ("b", true, 7), ("c", true, 100)]);
        assert_eq!(table[2].seed, crate::routing::counter_seed("c"));
        // Declared again: live at its old id.
        let again = counter_table(&table, &counters("[[counters]]\nname = \"a\"\n")).unwrap();
        assert!(again[0].live && !again[1].live && !again[2].live);
    }

    #[test]
    fn what_follows_from_the_keys_is_worked_out_once() {
        let counter = |extra: &str| {
            let text = format!("[[counters]]\nname = \"x\"\n{extra}");
            Counter::from_config(&counters(&text)[0]).unwrap()
        };
        let day = "window = \"day\"\ntime_zone = \"Europe/Berlin\"\n";
        for (extra, settable) in [
            ("", true),
            ("kind = \"unique\"\n", false),
            ("kind = \"max\"\n", true),
            (
                "rollup_into = { table = \"t\", key_column = \"k\", column = \"c\" }\n",
                true,
            ),
            (
                "kind = \"max\"\nrollup_into = { table = \"t\", key_column = \"k\", column = \"c\" }\n",
                false,
            ),
            (&format!("{day}also = [\"month\", \"all\"]\n"), true),
            (&format!("kind = \"last\"\n{day}"), true),
            (&format!("kind = \"last\"\n{day}also = [\"all\"]\n"), false),
            (&format!("kind = \"min\"\n{day}also = [\"week\"]\n"), false),
        ] {
            assert_eq!(counter(extra).settable, settable, "{extra}");
        }
        let c = counter(&format!("{day}also = [\"month\", \"week\", \"all\"]\n"));
        assert_eq!(c.span(), Some(Span::Day));
        assert!(c.all_time);
        // 2026-03-29 13:00 UTC, the day Berlin's clocks go forward: its week began Monday 23
        // March and its month on 1 March, both at local midnight (+01:00).
        let (day_start, _) = c.window.as_ref().unwrap().bounds(1_774_789_200_000);
        assert_eq!(
            c.also_of(day_start),
            [
                ("week", 1_774_220_400_000),
                ("month", 1_772_319_600_000),
                ("all", ALL_TIME)
            ]
        );
        assert!(counter("").also_of(0).is_empty());
        let unique = counter("kind = \"unique\"\nlog2m = 14\n");
        let params = unique.params.unwrap();
        assert_eq!((params.log2m(), params.regwidth()), (14, 5));
        assert_eq!(counter("").params, None);
    }
}
