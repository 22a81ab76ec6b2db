//! The scenarios: their names, the default order, and which ones `--only` and
//! `--skip-baselines` select.

use anyhow::{bail, Result};

use crate::env::BenchArgs;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scenario {
    Naive,
    SlottedRandom,
    SlottedTime,
    InsertOnly,
    Batched,
    ServerUpsert,
    RedisDailyHot,
    RedisDailyHc,
    HllUpsertHot,
    RedisPfaddHot,
    RedisPfaddHc,
    Hot,
    DayHot,
    UniqueHot,
    HcUniform,
    DayHcUniform,
    TableDayHc,
    TableDayHcRollup,
    UniqueHc,
    HcZipf,
    Import,
    HotRollup,
    CeilingEventDgram,
    EventDgram,
    CeilingEventStream,
    EventStream,
    Memory,
    DayMemory,
    DayMemoryDays,
    RollupFold,
    RedisDailyKill,
    TallydKill,
    DayKill,
    SustainedAllTime,
    SustainedTableDay,
}

pub(crate) const SCENARIOS: [Scenario; 35] = [
    Scenario::Naive,
    Scenario::SlottedRandom,
    Scenario::SlottedTime,
    Scenario::InsertOnly,
    Scenario::Batched,
    Scenario::ServerUpsert,
    Scenario::RedisDailyHot,
    Scenario::RedisDailyHc,
    Scenario::HllUpsertHot,
    Scenario::RedisPfaddHot,
    Scenario::RedisPfaddHc,
    Scenario::Hot,
    Scenario::DayHot,
    Scenario::UniqueHot,
    Scenario::HcUniform,
    Scenario::DayHcUniform,
    Scenario::TableDayHc,
    Scenario::TableDayHcRollup,
    Scenario::UniqueHc,
    Scenario::HcZipf,
    Scenario::Import,
    Scenario::HotRollup,
    Scenario::CeilingEventDgram,
    Scenario::EventDgram,
    Scenario::CeilingEventStream,
    Scenario::EventStream,
    Scenario::Memory,
    Scenario::DayMemory,
    Scenario::DayMemoryDays,
    Scenario::RollupFold,
    Scenario::RedisDailyKill,
    Scenario::TallydKill,
    Scenario::DayKill,
    Scenario::SustainedAllTime,
    Scenario::SustainedTableDay,
];

impl Scenario {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Scenario::Naive => "naive",
            Scenario::SlottedRandom => "slotted-random",
            Scenario::SlottedTime => "slotted-time",
            Scenario::InsertOnly => "insert-only",
            Scenario::Batched => "batched",
            Scenario::ServerUpsert => "server-upsert",
            Scenario::RedisDailyHot => "redis-daily-hot",
            Scenario::RedisDailyHc => "redis-daily-hc-uniform",
            Scenario::HllUpsertHot => "hll-upsert-hot",
            Scenario::RedisPfaddHot => "redis-pfadd-hot",
            Scenario::RedisPfaddHc => "redis-pfadd-hc",
            Scenario::Hot => "tallyd-hot",
            Scenario::DayHot => "tallyd-day-hot",
            Scenario::UniqueHot => "tallyd-unique-hot",
            Scenario::HcUniform => "tallyd-hc-uniform",
            Scenario::DayHcUniform => "tallyd-day-hc-uniform",
            Scenario::TableDayHc => "tallyd-table-day-hc-uniform",
            Scenario::TableDayHcRollup => "tallyd-table-day-hc-uniform-rollup",
            Scenario::UniqueHc => "tallyd-unique-hc",
            Scenario::HcZipf => "tallyd-hc-zipf",
            Scenario::Import => "tallyd-import-batched",
            Scenario::HotRollup => "tallyd-hot-rollup-journal",
            Scenario::CeilingEventDgram => "ceiling-event-dgram",
            Scenario::EventDgram => "tallyd-event-dgram",
            Scenario::CeilingEventStream => "ceiling-event-stream",
            Scenario::EventStream => "tallyd-event-stream",
            Scenario::Memory => "tallyd-memory",
            Scenario::DayMemory => "tallyd-day-memory",
            Scenario::DayMemoryDays => "tallyd-day-memory-10-days",
            Scenario::RollupFold => "tallyd-rollup-fold",
            Scenario::RedisDailyKill => "redis-daily-kill-9",
            Scenario::TallydKill => "tallyd-kill-9",
            Scenario::DayKill => "tallyd-day-kill-9",
            Scenario::SustainedAllTime => "tallyd-sustained-all-time",
            Scenario::SustainedTableDay => "tallyd-sustained-table-day",
        }
    }

    fn is_baseline(self) -> bool {
        !self.name().starts_with("tallyd-")
    }
}

/// The scenarios `--only` and `--skip-baselines` leave: `--only` is a comma-separated list of
/// exact names or `name-` groups, run in the default order.
pub(crate) fn selected(args: &BenchArgs) -> Result<Vec<Scenario>> {
    let wanted = |s: &Scenario| !(args.skip_baselines && s.is_baseline());
    let Some(only) = args.only.as_deref() else {
        let all = SCENARIOS.iter().copied().filter(wanted).collect();
        return Ok(with_ceilings(all));
    };
    let mut picked = Vec::new();
    for one in only.split(',') {
        picked.extend(selected_one(one)?);
    }
    let picked = SCENARIOS
        .iter()
        .copied()
        .filter(|s| picked.contains(s))
        .filter(wanted)
        .collect();
    Ok(with_ceilings(picked))
}

/// One `--only` entry: an exact name, else a `name-` group.
fn selected_one(only: &str) -> Result<Vec<Scenario>> {
    let exact: Vec<Scenario> = SCENARIOS
        .iter()
        .copied()
        .filter(|s| s.name() == only)
        .collect();
    let picked: Vec<Scenario> = if exact.is_empty() {
        let group = format!("{only}-");
        SCENARIOS
            .iter()
            .copied()
            .filter(|s| s.name().starts_with(&group))
            .collect()
    } else {
        exact
    };
    if picked.is_empty() {
        let names: Vec<&str> = SCENARIOS.iter().map(|s| s.name()).collect();
        bail!(
            "--only {only:?}: no such scenario; one of {}",
            names.join(", ")
        );
    }
    Ok(picked)
}

/// The ceiling measured beside each per-event scenario, run just before it.
pub(crate) fn ceiling_of(s: Scenario) -> Option<Scenario> {
    match s {
        Scenario::EventDgram => Some(Scenario::CeilingEventDgram),
        Scenario::EventStream => Some(Scenario::CeilingEventStream),
        _ => None,
    }
}

/// `picked` with each per-event scenario's ceiling before it (a ratio needs both in one run).
fn with_ceilings(picked: Vec<Scenario>) -> Vec<Scenario> {
    let mut out = Vec::with_capacity(picked.len() + 2);
    for s in picked {
        if let Some(c) = ceiling_of(s).filter(|c| !out.contains(c)) {
            out.push(c);
        }
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_selects_a_name_or_a_group() {
        let args = |only: Option<&str>, skip| BenchArgs {
            connections: 1,
            baseline_seconds: 1,
            events: 1,
            hc_events: 1,
            hc_keys: 1,
            clients: 1,
            event_clients: 1,
            event_events: 1,
            sustained_rate: 1,
            sustained_seconds: 1,
            skip_baselines: skip,
            only: only.map(String::from),
            fast_db: false,
        };
        assert_eq!(
            selected(&args(Some("tallyd-hot"), false)).unwrap(),
            vec![Scenario::Hot]
        );
        assert_eq!(
            selected(&args(Some("slotted"), false)).unwrap(),
            vec![Scenario::SlottedRandom, Scenario::SlottedTime]
        );
        // --skip-baselines leaves the 21 tallyd scenarios, and the ceilings of two of them.
        assert_eq!(selected(&args(None, true)).unwrap().len(), 23);
        // The peer is a group: its two throughput rows and its loss row.
        assert_eq!(
            selected(&args(Some("redis-daily"), false)).unwrap(),
            vec![
                Scenario::RedisDailyHot,
                Scenario::RedisDailyHc,
                Scenario::RedisDailyKill
            ]
        );
        // The per-day rows are a group too, each right after its all-time row; an exact name
        // picks one.
        assert_eq!(
            selected(&args(Some("tallyd-day"), false)).unwrap(),
            vec![
                Scenario::DayHot,
                Scenario::DayHcUniform,
                Scenario::DayMemory,
                Scenario::DayMemoryDays,
                Scenario::DayKill
            ]
        );
        assert_eq!(
            selected(&args(
                Some("tallyd-day-memory,tallyd-hot,tallyd-memory"),
                false
            ))
            .unwrap(),
            vec![Scenario::Hot, Scenario::Memory, Scenario::DayMemory]
        );
        // The unique-count rows and their Redis peer are groups; the list runs in the default
        // order, peers first.
        assert_eq!(
            selected(&args(
                Some("tallyd-unique,redis-pfadd,hll-upsert-hot"),
                false
            ))
            .unwrap(),
            vec![
                Scenario::HllUpsertHot,
                Scenario::RedisPfaddHot,
                Scenario::RedisPfaddHc,
                Scenario::UniqueHot,
                Scenario::UniqueHc
            ]
        );
        // A per-event scenario comes with its ceiling, run just before it.
        assert_eq!(
            selected(&args(Some("tallyd-event-dgram"), false)).unwrap(),
            vec![Scenario::CeilingEventDgram, Scenario::EventDgram]
        );
        assert!(selected(&args(Some("nope"), false)).is_err());
        // A list runs in the default order, each once.
        assert_eq!(
            selected(&args(
                Some("tallyd-hc-uniform,server-upsert,tallyd-hc"),
                false
            ))
            .unwrap(),
            vec![
                Scenario::ServerUpsert,
                Scenario::HcUniform,
                Scenario::HcZipf
            ]
        );
    }
}
