//! Results: one outcome per scenario, the table and the checks against the performance targets.

use std::fmt::Write as _;
use std::time::Duration;

use crate::env::FLUSH_INTERVAL_MS;
use crate::scenario::{ceiling_of, Scenario};
use crate::scrape::{histogram_delta, quantile, Usage};

/// What the daemon under test did: only tallyd scenarios have this.
pub(crate) struct DaemonStats {
    /// First byte to the last `pong`: every event read and handed to the buckets.
    pub(crate) ingest: Duration,
    /// None for the memory check, which never flushes.
    pub(crate) flow: Option<Flow>,
    pub(crate) peak_rss_mib: f64,
    pub(crate) bytes_per_key: Option<f64>,
}

/// Between the first byte and the last `!flush` answer.
pub(crate) struct Flow {
    rows: f64,
    cpu_s: f64,
    p50: Option<f64>,
    p99: Option<f64>,
}

impl Flow {
    pub(crate) fn between(before: &Usage, after: &Usage) -> Flow {
        let freshness = histogram_delta(&before.freshness, &after.freshness);
        Flow {
            rows: after.rows - before.rows,
            cpu_s: after.cpu_s - before.cpu_s,
            p50: quantile(&freshness, 0.50),
            p99: quantile(&freshness, 0.99),
        }
    }
    /// CPU seconds alone: a process that writes nothing and keeps no histogram.
    pub(crate) fn cpu_only(cpu_s: f64) -> Flow {
        Flow::written(0.0, cpu_s)
    }
    /// Rows written and CPU seconds, without a freshness histogram (the `redis-daily` peer).
    pub(crate) fn written(rows: f64, cpu_s: f64) -> Flow {
        Flow {
            rows,
            cpu_s,
            p50: None,
            p99: None,
        }
    }
}

pub(crate) struct Outcome {
    name: &'static str,
    /// None: not run (the note says why).
    total: Option<u64>,
    unit: &'static str,
    elapsed: Duration,
    daemon: Option<DaemonStats>,
    /// Acknowledged events missing after a kill -9 (the loss rows only).
    lost: Option<u64>,
    note: String,
}

impl Outcome {
    pub(crate) fn baseline(
        name: &'static str,
        total: u64,
        unit: &'static str,
        elapsed: Duration,
    ) -> Self {
        Outcome {
            name,
            total: Some(total),
            unit,
            elapsed,
            daemon: None,
            lost: None,
            note: "exact".into(),
        }
    }

    /// A row that did not run, and why.
    pub(crate) fn skipped(name: &'static str, why: String) -> Self {
        Outcome {
            name,
            total: None,
            unit: "event",
            elapsed: Duration::ZERO,
            daemon: None,
            lost: None,
            note: why,
        }
    }

    /// A kill -9 measurement: `acknowledged` events, `lost` of them missing afterwards. It has
    /// no rate: its time is in the note.
    pub(crate) fn loss(name: &'static str, acknowledged: u64, lost: u64, note: String) -> Self {
        Outcome {
            name,
            total: Some(acknowledged),
            unit: "event",
            elapsed: Duration::ZERO,
            daemon: None,
            lost: Some(lost),
            note,
        }
    }

    /// Replaces the check column's text.
    pub(crate) fn with_note(mut self, note: String) -> Self {
        self.note = note;
        self
    }

    pub(crate) fn daemon(
        name: &'static str,
        total: u64,
        elapsed: Duration,
        stats: DaemonStats,
        note: String,
    ) -> Self {
        Outcome {
            name,
            total: Some(total),
            unit: if stats.flow.is_some() { "event" } else { "key" },
            elapsed,
            daemon: Some(stats),
            lost: None,
            note,
        }
    }

    fn per_second(&self, took: Duration) -> Option<f64> {
        let secs = took.as_secs_f64();
        self.total.filter(|_| secs > 0.0).map(|t| t as f64 / secs)
    }

    /// Statements, rows or events per second, to commit.
    pub(crate) fn rate(&self) -> Option<f64> {
        self.per_second(self.elapsed)
    }

    pub(crate) fn ingest_rate(&self) -> Option<f64> {
        self.per_second(self.daemon.as_ref()?.ingest)
    }

    fn flow(&self) -> Option<&Flow> {
        self.daemon.as_ref()?.flow.as_ref()
    }

    fn rows_per_s(&self) -> Option<f64> {
        let rows = self.flow()?.rows;
        (rows > 0.0).then(|| rows / self.elapsed.as_secs_f64())
    }

    fn events_per_row(&self) -> Option<f64> {
        let rows = self.flow()?.rows;
        (rows > 0.0).then(|| self.total.unwrap_or(0) as f64 / rows)
    }

    pub(crate) fn cpu_per_million(&self) -> Option<f64> {
        let events = self.total? as f64;
        (events > 0.0).then(|| self.flow().map(|f| f.cpu_s / (events / 1e6)))?
    }

    pub(crate) fn summary(&self) -> String {
        let Some(rate) = self.rate() else {
            return self.note.clone();
        };
        let ingest = self.ingest_rate().map_or_else(String::new, |r| {
            format!(" (ingest {} {}/s)", thousands(r), self.unit)
        });
        format!(
            "{} {}s in {:.2} s: {} {}/s{ingest}; {}",
            thousands(self.total.unwrap_or(0) as f64),
            self.unit,
            self.elapsed.as_secs_f64(),
            thousands(rate),
            self.unit,
            self.note
        )
    }

    fn cells(&self) -> Vec<String> {
        let dash = || "-".to_string();
        let Some(total) = self.total else {
            let mut row = vec![self.name.to_string()];
            row.extend((2..HEADER.len()).map(|_| dash()));
            row.push(self.note.clone());
            return row;
        };
        let opt = |v: Option<f64>, f: fn(f64) -> String| v.map_or_else(dash, f);
        let ms = |v: f64| format!("{:.0}", v * 1000.0);
        let flow = self.flow();
        vec![
            self.name.to_string(),
            thousands(total as f64),
            if self.elapsed.is_zero() {
                dash()
            } else {
                format!("{:.2} s", self.elapsed.as_secs_f64())
            },
            self.rate()
                .map_or_else(dash, |r| format!("{} {}/s", thousands(r), self.unit)),
            opt(self.ingest_rate(), thousands),
            opt(self.rows_per_s(), thousands),
            opt(self.events_per_row(), |v| {
                if v >= 1000.0 {
                    thousands(v)
                } else {
                    format!("{v:.1}")
                }
            }),
            opt(self.cpu_per_million(), |v| format!("{v:.3}")),
            opt(self.daemon.as_ref().map(|d| d.peak_rss_mib), |v| {
                format!("{v:.1}")
            }),
            opt(flow.and_then(|f| f.p50), ms),
            opt(flow.and_then(|f| f.p99), ms),
            self.note.clone(),
        ]
    }
}

/// Thousands separators, no decimals.
pub(crate) fn thousands(v: f64) -> String {
    let digits = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if v < 0.0 {
        out.insert(0, '-');
    }
    out
}

/// The server's CPU time over some rows written: what a row costs PostgreSQL, whatever else
/// shares the machine.
pub(crate) fn server_cpu_note(seconds: f64, rows: f64) -> String {
    format!(
        "server CPU {seconds:.1} s = {:.1} us/row",
        seconds * 1e6 / rows.max(1.0)
    )
}

const HEADER: [&str; 12] = [
    "approach",
    "total",
    "elapsed",
    "rate (to commit)",
    "ingest ev/s",
    "rows/s",
    "ev/row",
    "CPU s/M ev",
    "peak RSS MiB",
    "p50 ms",
    "p99 ms",
    "check",
];

/// The plain-text table: names left-aligned, numbers right-aligned, the check column last.
pub(crate) fn table(outcomes: &[Outcome]) -> String {
    let rows: Vec<Vec<String>> = std::iter::once(HEADER.iter().map(|h| h.to_string()).collect())
        .chain(outcomes.iter().map(Outcome::cells))
        .collect();
    let widths: Vec<usize> = (0..HEADER.len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in &rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            let w = widths[c];
            let _ = match c {
                0 => write!(line, "{cell:<w$}"),
                c if c == HEADER.len() - 1 => write!(line, "  {cell}"),
                _ => write!(line, "  {cell:>w$}"),
            };
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn find<'a>(outcomes: &'a [Outcome], name: &str) -> Option<&'a Outcome> {
    outcomes
        .iter()
        .find(|o| o.name == name && o.total.is_some())
}

/// One target: `None` when a scenario it needs did not run.
fn check(label: &str, result: Option<(bool, String)>) -> String {
    match result {
        Some((true, detail)) => format!("PASS  {label}: {detail}"),
        Some((false, detail)) => format!("FAIL  {label}: {detail}"),
        None => format!("SKIP  {label}: needs scenarios that did not run"),
    }
}

pub(crate) fn checks(outcomes: &[Outcome]) -> Vec<String> {
    let hot = find(outcomes, Scenario::Hot.name());
    let slotted = [Scenario::SlottedRandom, Scenario::SlottedTime]
        .iter()
        .filter_map(|s| find(outcomes, s.name()).and_then(Outcome::rate))
        .reduce(f64::max);
    let batched = find(outcomes, Scenario::Batched.name()).and_then(Outcome::rate);
    let mut lines = vec![check(
        "hot-key tallyd events/s >= 100x the better slotted baseline",
        hot.and_then(Outcome::rate).zip(slotted).map(|(t, s)| {
            let ratio = t / s;
            (
                ratio >= 100.0,
                format!("{} vs {} = {ratio:.1}x", thousands(t), thousands(s)),
            )
        }),
    )];
    for s in [Scenario::HcUniform, Scenario::HcZipf] {
        let hc = find(outcomes, s.name());
        lines.push(check(
            &format!("{} rows/s >= 70% of the batched ceiling", s.name()),
            hc.and_then(Outcome::rows_per_s).zip(batched).map(|(r, b)| {
                let ratio = r / b;
                (
                    ratio >= 0.7,
                    format!(
                        "{} vs {} rows/s = {:.0}%",
                        thousands(r),
                        thousands(b),
                        ratio * 100.0
                    ),
                )
            }),
        ));
        lines.push(check(
            &format!("{} >= 1,000,000 events/s ingested", s.name()),
            hc.and_then(|o| Some((o.ingest_rate()?, o.rate()?)))
                .map(|(i, r)| {
                    (
                        i >= 1e6,
                        format!(
                            "ingest {} events/s (to commit: {} events/s)",
                            thousands(i),
                            thousands(r)
                        ),
                    )
                }),
        ));
    }
    lines.extend(high_cardinality(outcomes));
    lines.push(check(
        "hot-key CPU <= 0.5 s per million events",
        hot.and_then(Outcome::cpu_per_million)
            .map(|c| (c <= 0.5, format!("{c:.3} s per million events"))),
    ));
    lines.push(check(
        "<= 200 bytes RSS per pending key (1,000,000 keys)",
        find(outcomes, Scenario::Memory.name())
            .and_then(|o| o.daemon.as_ref()?.bytes_per_key)
            .map(|b| (b <= 200.0, format!("{b:.0} bytes per key"))),
    ));
    lines.extend(per_day(outcomes));
    lines.extend(unique(outcomes));
    let bound = (FLUSH_INTERVAL_MS + 250) as f64 / 1000.0;
    lines.push(check(
        &format!("hot-key p99 event-to-commit <= flush interval + 250 ms ({bound:.2} s)"),
        hot.and_then(|o| o.flow()?.p99)
            .map(|p| (p <= bound, format!("p99 {:.0} ms", p * 1000.0))),
    ));
    lines.extend(per_event(outcomes));
    let lost = |s: Scenario| find(outcomes, s.name()).and_then(|o| Some((o.lost?, o.total?)));
    for (s, label) in [
        (Scenario::TallydKill, "tallyd loses"),
        (Scenario::DayKill, "tallyd counting per day loses"),
    ] {
        lines.push(check(
            &format!("{label} no acknowledged event to kill -9"),
            lost(s).map(|(l, n)| {
                let peer = lost(Scenario::RedisDailyKill).map_or_else(String::new, |(rl, rn)| {
                    format!(
                        " ({}: {} of {})",
                        Scenario::RedisDailyKill.name(),
                        thousands(rl as f64),
                        thousands(rn as f64)
                    )
                });
                (
                    l == 0,
                    format!(
                        "{} of {} lost{peer}",
                        thousands(l as f64),
                        thousands(n as f64)
                    ),
                )
            }),
        ));
    }
    lines
}

/// The per-day targets (issue 24): each `tallyd-day-*` throughput row within 10% of its
/// all-time row in the same run, on events/s to commit and on daemon CPU per event; and a
/// pending (key, day) no dearer than a pending key.
fn per_day(outcomes: &[Outcome]) -> Vec<String> {
    let mut lines = Vec::new();
    for (day, all) in [
        (Scenario::DayHot, Scenario::Hot),
        (Scenario::DayHcUniform, Scenario::HcUniform),
    ] {
        let (d, a) = (find(outcomes, day.name()), find(outcomes, all.name()));
        let pair = |f: fn(&Outcome) -> Option<f64>| Some((f(d?)?, f(a?)?));
        lines.push(check(
            &format!(
                "{} events/s to commit >= 90% of {}'s",
                day.name(),
                all.name()
            ),
            pair(Outcome::rate).map(|(d, a)| {
                (
                    d >= 0.9 * a,
                    format!(
                        "{} vs {} events/s = {:.0}%",
                        thousands(d),
                        thousands(a),
                        d / a * 100.0
                    ),
                )
            }),
        ));
        lines.push(check(
            &format!(
                "{} CPU per million events <= 110% of {}'s",
                day.name(),
                all.name()
            ),
            pair(Outcome::cpu_per_million).map(|(d, a)| {
                (
                    d <= 1.1 * a,
                    format!("{d:.3} vs {a:.3} s = {:.0}%", d / a * 100.0),
                )
            }),
        ));
    }
    for s in [Scenario::DayMemory, Scenario::DayMemoryDays] {
        lines.push(check(
            &format!(
                "<= 200 bytes RSS per pending (key, day) (1,000,000 pairs, {})",
                s.name()
            ),
            find(outcomes, s.name())
                .and_then(|o| o.daemon.as_ref()?.bytes_per_key)
                .map(|b| (b <= 200.0, format!("{b:.0} bytes per (key, day)"))),
        ));
    }
    lines
}

/// The unique-count target (issue 25): each `tallyd-unique-*` row's events/s to commit at least
/// 60% of its sum counter's row in the same run, with both rows' daemon CPU per million events
/// (and both totals, when the two loads differ in size).
fn unique(outcomes: &[Outcome]) -> Vec<String> {
    [
        (Scenario::UniqueHot, Scenario::Hot),
        (Scenario::UniqueHc, Scenario::HcUniform),
    ]
    .iter()
    .map(|&(unique, sum)| {
        let (u, s) = (find(outcomes, unique.name()), find(outcomes, sum.name()));
        let detail = || -> Option<(bool, String)> {
            let (u, s) = (u?, s?);
            let (ur, sr) = (u.rate()?, s.rate()?);
            let cpu = |o: &Outcome| {
                o.cpu_per_million()
                    .map_or_else(|| "-".into(), |c| format!("{c:.3}"))
            };
            let mut text = format!(
                "{} vs {} events/s = {:.0}%; CPU s per million events {} vs {}",
                thousands(ur),
                thousands(sr),
                ur / sr * 100.0,
                cpu(u),
                cpu(s)
            );
            if u.total != s.total {
                let _ = write!(
                    text,
                    " ({} vs {} events sent)",
                    thousands(u.total? as f64),
                    thousands(s.total? as f64)
                );
            }
            Some((ur >= 0.6 * sr, text))
        };
        check(
            &format!(
                "{} events/s to commit >= 60% of {}'s",
                unique.name(),
                sum.name()
            ),
            detail(),
        )
    })
    .collect()
}

/// tallyd beside its peers, each pair run in the same process against the same server: a
/// later tallyd row gets its comparison by joining this list. The peer counts per day, so its
/// counterparts are the per-day rows; the all-time rows' lines stay, for the cost of a window.
/// The unique counters' peers follow: Redis `PFADD` on the same loads, and one `hll_add` upsert
/// per event (a statement is an event there).
const PEERS: [(Scenario, Scenario); 9] = [
    (Scenario::TableDayHc, Scenario::RedisDailyHc),
    (Scenario::TableDayHcRollup, Scenario::RedisDailyHc),
    (Scenario::DayHot, Scenario::RedisDailyHot),
    (Scenario::DayHcUniform, Scenario::RedisDailyHc),
    (Scenario::Hot, Scenario::RedisDailyHot),
    (Scenario::HcUniform, Scenario::RedisDailyHc),
    (Scenario::UniqueHot, Scenario::RedisPfaddHot),
    (Scenario::UniqueHc, Scenario::RedisPfaddHc),
    (Scenario::UniqueHot, Scenario::HllUpsertHot),
];

/// One line per pair of `PEERS` that both ran: tallyd's events/s to commit as a ratio to the
/// peer's, and both CPU figures (tallyd's daemon; the peer's redis-server, plus the mover for
/// `redis-daily`; none for a per-event SQL peer).
pub(crate) fn peers(outcomes: &[Outcome]) -> Vec<String> {
    PEERS
        .iter()
        .filter_map(|&(tallyd, peer)| {
            let (t, p) = (find(outcomes, tallyd.name())?, find(outcomes, peer.name())?);
            let (tr, pr) = (t.rate()?, p.rate()?);
            let cpu = |o: &Outcome| {
                o.cpu_per_million()
                    .map_or_else(|| "-".into(), |c| format!("{c:.3}"))
            };
            Some(format!(
                "PEER  {} / {} events/s to commit: {} vs {} = {:.1}x; CPU s per million events \
                 {} vs {}",
                tallyd.name(),
                peer.name(),
                thousands(tr),
                thousands(pr),
                tr / pr,
                cpu(t),
                cpu(p)
            ))
        })
        .collect()
}

/// The high-cardinality targets (issue 16), on uniform keys: events/s to commit, rows/s against
/// the server-side single-statement upsert measured in the same run, daemon CPU per event.
fn high_cardinality(outcomes: &[Outcome]) -> Vec<String> {
    let name = Scenario::HcUniform.name();
    let hc = find(outcomes, name);
    let server = find(outcomes, Scenario::ServerUpsert.name()).and_then(Outcome::rate);
    vec![
        check(
            &format!("{name} >= 1,500,000 events/s to commit"),
            hc.and_then(Outcome::rate)
                .map(|r| (r >= 1.5e6, format!("{} events/s", thousands(r)))),
        ),
        check(
            &format!("{name} rows/s >= the server-side upsert's rows/s"),
            hc.and_then(Outcome::rows_per_s).zip(server).map(|(r, s)| {
                (
                    r >= s,
                    format!(
                        "{} vs {} rows/s = {:.0}%",
                        thousands(r),
                        thousands(s),
                        r / s * 100.0
                    ),
                )
            }),
        ),
        check(
            &format!("{name} CPU <= 0.3 s per million events"),
            hc.and_then(Outcome::cpu_per_million)
                .map(|c| (c <= 0.3, format!("{c:.3} s per million events"))),
        ),
    ]
}

/// The per-event targets: tallyd's ingest rate against the counting receiver's, and CPU.
fn per_event(outcomes: &[Outcome]) -> Vec<String> {
    let mut lines = Vec::new();
    for (s, share) in [(Scenario::EventDgram, 0.9), (Scenario::EventStream, 0.7)] {
        let tallyd = find(outcomes, s.name()).and_then(Outcome::ingest_rate);
        let ceiling = ceiling_of(s)
            .and_then(|c| find(outcomes, c.name()))
            .and_then(Outcome::rate);
        lines.push(check(
            &format!(
                "{} ingest >= {:.0}% of the counting receiver",
                s.name(),
                share * 100.0
            ),
            tallyd.zip(ceiling).map(|(t, c)| {
                let ratio = t / c;
                (
                    ratio >= share,
                    format!(
                        "{} vs {} events/s = {:.0}%",
                        thousands(t),
                        thousands(c),
                        ratio * 100.0
                    ),
                )
            }),
        ));
    }
    lines.push(check(
        "tallyd-event-dgram CPU <= 1 s per million events",
        find(outcomes, Scenario::EventDgram.name())
            .and_then(Outcome::cpu_per_million)
            .map(|c| (c <= 1.0, format!("{c:.3} s per million events"))),
    ));
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skipped_and_loss_rows_have_no_rate() {
        let rows = [
            Outcome::skipped("redis-daily-hot", "skipped: no redis-server".into()),
            Outcome::loss("tallyd-kill-9", 500, 0, "0 lost".into()),
        ];
        let text = table(&rows);
        let lines: Vec<&str> = text.lines().collect();
        let dashes = "        -                 -            -       -       -           -             -       -       -";
        assert_eq!(
            lines[1],
            format!("redis-daily-hot      -{dashes}  skipped: no redis-server")
        );
        assert_eq!(lines[2], format!("tallyd-kill-9      500{dashes}  0 lost"));
        assert_eq!(rows[0].summary(), "skipped: no redis-server");
        assert_eq!(rows[1].rate(), None);
        let lines = checks(&rows);
        let kill: Vec<&String> = lines.iter().filter(|l| l.contains("kill -9")).collect();
        assert_eq!(
            kill,
            [
                "PASS  tallyd loses no acknowledged event to kill -9: 0 of 500 lost",
                "SKIP  tallyd counting per day loses no acknowledged event to kill -9: needs \
                 scenarios that did not run"
            ]
        );
    }

    /// A tallyd (or peer) row: `events` committed in `secs`, ingested in half that, 1,000 rows
    /// written at `cpu_s` CPU seconds.
    fn row(name: &'static str, events: u64, secs: f64, cpu_s: f64) -> Outcome {
        let stats = DaemonStats {
            ingest: Duration::from_secs_f64(secs / 2.0),
            flow: Some(Flow::written(1000.0, cpu_s)),
            peak_rss_mib: 50.0,
            bytes_per_key: None,
        };
        let elapsed = Duration::from_secs_f64(secs);
        Outcome::daemon(name, events, elapsed, stats, "exact".into())
    }

    #[test]
    fn per_day_rows_are_compared_with_their_all_time_rows_and_the_peer() {
        let rows = [
            row("redis-daily-hot", 1_000_000, 0.5, 0.5),
            row("tallyd-hot", 1_000_000, 0.1, 0.15),
            row("tallyd-day-hot", 1_000_000, 0.125, 0.16),
        ];
        let lines = checks(&rows);
        let day: Vec<&String> = lines.iter().filter(|l| l.contains("tallyd-day-")).collect();
        assert_eq!(
            day,
            [
                "FAIL  tallyd-day-hot events/s to commit >= 90% of tallyd-hot's: 8,000,000 vs \
                 10,000,000 events/s = 80%",
                "PASS  tallyd-day-hot CPU per million events <= 110% of tallyd-hot's: 0.160 vs \
                 0.150 s = 107%",
                "SKIP  tallyd-day-hc-uniform events/s to commit >= 90% of tallyd-hc-uniform's: \
                 needs scenarios that did not run",
                "SKIP  tallyd-day-hc-uniform CPU per million events <= 110% of \
                 tallyd-hc-uniform's: needs scenarios that did not run",
                "SKIP  <= 200 bytes RSS per pending (key, day) (1,000,000 pairs, \
                 tallyd-day-memory): needs scenarios that did not run",
                "SKIP  <= 200 bytes RSS per pending (key, day) (1,000,000 pairs, \
                 tallyd-day-memory-10-days): needs scenarios that did not run",
            ]
        );
        assert_eq!(
            peers(&rows),
            [
                "PEER  tallyd-day-hot / redis-daily-hot events/s to commit: 8,000,000 vs \
                 2,000,000 = 4.0x; CPU s per million events 0.160 vs 0.500",
                "PEER  tallyd-hot / redis-daily-hot events/s to commit: 10,000,000 vs 2,000,000 \
                 = 5.0x; CPU s per million events 0.150 vs 0.500",
            ]
        );
    }

    #[test]
    fn unique_rows_are_compared_with_their_sum_rows_and_peers() {
        let rows = [
            Outcome::baseline("hll-upsert-hot", 10_000, "stmt", Duration::from_secs(5)),
            row("redis-pfadd-hot", 10_000_000, 5.0, 5.0),
            row("tallyd-hot", 1_000_000, 0.1, 0.15),
            row("tallyd-unique-hot", 10_000_000, 2.0, 2.0),
            row("tallyd-hc-uniform", 10_000_000, 10.0, 5.0),
            row("tallyd-unique-hc", 3_000_000, 2.0, 1.5),
        ];
        let lines = checks(&rows);
        let unique: Vec<&String> = lines.iter().filter(|l| l.contains("-unique-")).collect();
        assert_eq!(
            unique,
            [
                "FAIL  tallyd-unique-hot events/s to commit >= 60% of tallyd-hot's: 5,000,000 vs \
                 10,000,000 events/s = 50%; CPU s per million events 0.200 vs 0.150 (10,000,000 \
                 vs 1,000,000 events sent)",
                "PASS  tallyd-unique-hc events/s to commit >= 60% of tallyd-hc-uniform's: \
                 1,500,000 vs 1,000,000 events/s = 150%; CPU s per million events 0.500 vs 0.500 \
                 (3,000,000 vs 10,000,000 events sent)",
            ]
        );
        assert_eq!(
            peers(&rows),
            [
                "PEER  tallyd-unique-hot / redis-pfadd-hot events/s to commit: 5,000,000 vs \
                 2,000,000 = 2.5x; CPU s per million events 0.200 vs 0.500",
                "PEER  tallyd-unique-hot / hll-upsert-hot events/s to commit: 5,000,000 vs 2,000 \
                 = 2500.0x; CPU s per million events 0.200 vs -",
            ]
        );
    }

    #[test]
    fn thousands_groups_digits() {
        assert_eq!(thousands(1234567.4), "1,234,567");
        assert_eq!(thousands(12.0), "12");
    }
}
