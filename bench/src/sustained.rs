//! The sustained rows (issue 32): `--sustained-rate` new distinct keys a second (one event each,
//! a key never sent before) for `--sustained-seconds`, with the daemon's defaults and its own
//! rollup running, to an all-time counter (folded into `tallyd.rollups`) or a per-day counter
//! `rollup_into` `version_downloads` (`insert_missing`, written by the flush). Sampled every 5 s:
//! slot rows waiting and the application's table lag; the targets are two rollup intervals'
//! worth of each.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use tallyd::config::{Config, KeyTypeName, RollupInto};
use tallyd::metrics as m;
use tallyd::window::Span;
use tallyd_testkit::Samples;

use crate::client::flush_replies;
use crate::env::{BenchArgs, BenchEnv, COUNTER};
use crate::report::{DaemonStats, Flow, Outcome};
use crate::scrape::scrape;

/// How often the load is topped up to its rate.
const TICK: Duration = Duration::from_millis(100);
/// How often slot rows and table lag are sampled while the load runs.
const SAMPLE: Duration = Duration::from_secs(5);
/// How long the rollup is given to fold what waits once the load ends.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(600);
/// The first key sent (keys are numeric: the per-day counter's are version ids).
const FIRST_KEY: u64 = 10_000_000;

/// Where the rows end up.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sink {
    /// An all-time counter folded by the rollup into `tallyd.rollups`.
    Summary,
    /// A Berlin-day counter `rollup_into` `version_downloads`, at its defaults (`direct`).
    Table,
}

impl Sink {
    fn table(self) -> &'static str {
        match self {
            Sink::Summary => "tallyd.rollups",
            Sink::Table => "public.version_downloads",
        }
    }
}

/// One sample: `t` seconds after the first byte.
struct Sample {
    t: f64,
    sent: u64,
    waiting: i64,
    lag_rows: i64,
    rollup_lag_s: Option<f64>,
}

impl BenchEnv {
    pub(crate) async fn tallyd_sustained(
        &self,
        name: &'static str,
        sink: Sink,
        zone: &str,
        args: &BenchArgs,
    ) -> Result<Outcome> {
        let (rate, seconds) = (args.sustained_rate, args.sustained_seconds);
        let events = rate * seconds;
        if sink == Sink::Table {
            self.reset_version_downloads().await?;
        }
        let daemon = self
            .spawn_daemon(name, |c| {
                let counter = &mut c.counters[0];
                counter.key_type = KeyTypeName::Bigint;
                if sink == Sink::Table {
                    counter.window = Some(Span::Day);
                    counter.time_zone = Some(zone.into());
                    counter.rollup_into = Some(RollupInto {
                        table: "public.version_downloads".into(),
                        key_column: "version_id".into(),
                        window_column: Some("date".into()),
                        column: "downloads".into(),
                        insert_missing: true,
                        direct: true,
                        on_add: Default::default(),
                    });
                }
                // The daemon's own rollup at its defaults (every 10 s, adaptive steps).
                c.rollup.enabled = true;
            })
            .await?;
        let interval = Config::default().rollup.interval().as_secs_f64();
        let client = self.db.connect().await?;
        let counts = Counts::read(&client, sink).await?;
        let before = daemon.usage().await?;
        let server_before = self.server_cpu()?;
        let stream = UnixStream::connect(&daemon.socket).await?;
        let (rd, mut wr) = stream.into_split();
        let sent = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let writer = {
            let sent = sent.clone();
            tokio::spawn(async move {
                let per_tick = rate / 10;
                let mut buf = String::with_capacity(per_tick as usize * 12);
                let mut tick = tokio::time::interval(TICK);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                for i in 0..seconds * 10 {
                    tick.tick().await;
                    buf.clear();
                    let first = FIRST_KEY + i * per_tick;
                    for key in first..first + per_tick {
                        let _ = writeln!(buf, "{COUNTER} {key}");
                    }
                    wr.write_all(buf.as_bytes()).await?;
                    sent.fetch_add(per_tick, Ordering::Relaxed);
                }
                wr.write_all(b"!flush\n").await?;
                let mut reply = String::new();
                BufReader::new(rd).read_line(&mut reply).await?;
                anyhow::Ok(reply.trim_end().to_string())
            })
        };
        let mut samples = Vec::new();
        let mut next = started;
        let mut writer = Some(writer);
        let mut load_over: Option<Instant> = None;
        let drained_at = loop {
            tokio::time::sleep_until(next.into()).await;
            let s = self
                .sample(&client, &daemon.metrics, &counts, &sent, started)
                .await?;
            println!(
                "    {:>5.0} s: sent {:>9}, slot rows waiting {:>9}, table lag {:>9} rows \
                 ({:.1} s), rollup lag {}",
                s.t,
                s.sent,
                s.waiting,
                s.lag_rows,
                s.lag_rows as f64 / rate as f64,
                s.rollup_lag_s.map_or("-".into(), |l| format!("{l:.0} s"))
            );
            let done = load_over.is_some() && s.waiting <= 0 && s.lag_rows <= 0;
            samples.push(s);
            if done {
                break Some(started.elapsed());
            }
            if writer.as_ref().is_some_and(|w| w.is_finished()) {
                let reply = writer.take().context("the writer")?.await??;
                let accepted = flush_replies(&[reply])?;
                ensure!(
                    accepted == events,
                    "{name}: sent {events} events, tallyd accepted {accepted} (see {})",
                    daemon.log.display()
                );
                load_over = Some(Instant::now());
            }
            if load_over.is_some_and(|at| at.elapsed() > DRAIN_TIMEOUT) {
                break None;
            }
            // Every 5 s under load, then every second while it drains.
            next += if load_over.is_some() {
                Duration::from_secs(1)
            } else {
                SAMPLE
            };
        };
        let load_ended = load_over.map_or(0.0, |at| (at - started).as_secs_f64());
        let server_cpu = self.server_cpu()? - server_before;
        let after = daemon.usage().await?;
        self.check_sustained(name, sink, events, drained_at.is_some())
            .await?;
        let peak_kib = daemon.status_kib("VmHWM")?;
        daemon.stop().await?;
        let note = sustained_note(&samples, rate, interval, load_ended, drained_at, server_cpu);
        let note = format!(
            "{note} ({:.2} s per million events)",
            server_cpu * 1e6 / events as f64
        );
        Ok(Outcome::daemon(
            name,
            events,
            drained_at.unwrap_or_else(|| started.elapsed()),
            DaemonStats {
                ingest: Duration::from_secs_f64(load_ended),
                flow: Some(Flow::between(&before, &after)),
                peak_rss_mib: peak_kib as f64 / 1024.0,
                bytes_per_key: None,
            },
            note,
        ))
    }

    async fn sample(
        &self,
        client: &tokio_postgres::Client,
        metrics: &str,
        counts: &Counts,
        sent: &AtomicU64,
        started: Instant,
    ) -> Result<Sample> {
        let now = Counts::read(client, counts.sink).await?;
        let sent = sent.load(Ordering::Relaxed);
        let rollup_lag_s = Samples::parse(&scrape(metrics).await?).sum(m::ROLLUP_LAG);
        Ok(Sample {
            t: started.elapsed().as_secs_f64(),
            sent,
            waiting: (now.slots_in - counts.slots_in) - (now.slots_out - counts.slots_out),
            lag_rows: sent as i64 - (now.table_in - counts.table_in),
            rollup_lag_s,
        })
    }

    /// Every event where it belongs. All-time: `tallyd.totals` exact at any moment, and once
    /// drained every event in `tallyd.rollups` and nothing left in `tallyd.slots`. Per day: the
    /// table and the counter's slot rows together hold every event (a `rollup_into` counter's
    /// rows are the table's, not `tallyd.totals`'), and once drained the table alone, one row
    /// per key.
    async fn check_sustained(
        &self,
        name: &str,
        sink: Sink,
        events: u64,
        drained: bool,
    ) -> Result<()> {
        let client = self.db.connect().await?;
        match sink {
            Sink::Table if drained => self.check_version_downloads(name, events, events).await,
            Sink::Table => {
                let row = client
                    .query_one(
                        "SELECT (SELECT coalesce(sum(downloads), 0)::bigint FROM version_downloads) \
                         + (SELECT coalesce(sum(count), 0)::bigint FROM tallyd.slots \
                            WHERE counter = $1)",
                        &[&COUNTER],
                    )
                    .await?;
                let held: i64 = row.get(0);
                ensure!(
                    held as u64 == events,
                    "{name}: NOT EXACT: sent {events} events, version_downloads and the slot \
                     rows hold {held}"
                );
                Ok(())
            }
            Sink::Summary => {
                let row = client
                    .query_one(
                        "SELECT count(*), coalesce(sum(count), 0)::bigint FROM tallyd.totals \
                         WHERE counter = $1",
                        &[&COUNTER],
                    )
                    .await?;
                let (keys, total): (i64, i64) = (row.get(0), row.get(1));
                ensure!(
                    keys as u64 == events && total as u64 == events,
                    "{name}: NOT EXACT: sent {events} events on as many keys, tallyd.totals \
                     holds {total} on {keys} keys"
                );
                if !drained {
                    return Ok(());
                }
                let row = client
                    .query_one(
                        "SELECT (SELECT count(*) FROM tallyd.slots WHERE counter = $1), \
                         (SELECT coalesce(sum(count), 0)::bigint FROM tallyd.rollups \
                          WHERE counter = $1)",
                        &[&COUNTER],
                    )
                    .await?;
                let (slots, folded): (i64, i64) = (row.get(0), row.get(1));
                ensure!(
                    slots == 0 && folded as u64 == events,
                    "{name}: NOT EXACT: drained, yet {slots} slot rows wait and tallyd.rollups \
                     sums to {folded} of {events}"
                );
                Ok(())
            }
        }
    }
}

/// Rows inserted into and deleted from `tallyd.slots` (its partitions too) and inserted into the
/// table, from the server's statistics: cheap to read under load (a `count(*)` over millions of
/// rows is not), and up to about a second late.
struct Counts {
    sink: Sink,
    slots_in: i64,
    slots_out: i64,
    table_in: i64,
}

impl Counts {
    async fn read(client: &tokio_postgres::Client, sink: Sink) -> Result<Counts> {
        let row = client
            .query_one(
                &format!(
                    "SELECT coalesce(sum(n_tup_ins) FILTER (WHERE relid <> '{t}'::regclass), 0)::bigint,
                            coalesce(sum(n_tup_del) FILTER (WHERE relid <> '{t}'::regclass), 0)::bigint,
                            coalesce(sum(n_tup_ins) FILTER (WHERE relid = '{t}'::regclass), 0)::bigint
                     FROM pg_stat_user_tables
                     WHERE relid = '{t}'::regclass OR relid = 'tallyd.slots'::regclass
                        OR relid IN (SELECT inhrelid FROM pg_inherits
                                     WHERE inhparent = 'tallyd.slots'::regclass)",
                    t = sink.table()
                ),
                &[],
            )
            .await
            .context("reading pg_stat_user_tables")?;
        Ok(Counts {
            sink,
            slots_in: row.get(0),
            slots_out: row.get(1),
            table_in: row.get(2),
        })
    }
}

/// The most waiting and the most lag (with when), the targets, the series once a minute, the
/// drain, and the server's CPU per million events.
fn sustained_note(
    samples: &[Sample],
    rate: u64,
    interval_s: f64,
    load_ended: f64,
    drained_at: Option<Duration>,
    server_cpu: f64,
) -> String {
    let most_waiting = samples.iter().max_by_key(|s| s.waiting);
    let most_lag = samples.iter().max_by_key(|s| s.lag_rows);
    let (waiting, waiting_t) = most_waiting.map_or((0, 0.0), |s| (s.waiting, s.t));
    let (lag, lag_t) = most_lag.map_or((0, 0.0), |s| (s.lag_rows, s.t));
    let lag_s = lag as f64 / rate as f64;
    let waiting_target = 2.0 * interval_s * rate as f64;
    let met = |ok: bool| if ok { "met" } else { "NOT met" };
    let mut note = format!(
        "{rate} new keys/s for {load_ended:.0} s; slot rows waiting at most {waiting} (at {waiting_t:.0} s; \
         target below {waiting_target:.0}: {}); table lag at most {lag} rows, {lag_s:.1} s of load \
         (at {lag_t:.0} s; target {:.0} s: {})",
        met((waiting as f64) < waiting_target),
        2.0 * interval_s,
        met(lag_s <= 2.0 * interval_s),
    );
    let _ = match drained_at {
        Some(d) => write!(note, "; drained at {:.0} s", d.as_secs_f64()),
        None => write!(note, "; NOT drained {DRAIN_TIMEOUT:?} after the load"),
    };
    note.push_str("; waiting/lag rows every 60 s:");
    let mut minute = 60.0;
    for s in samples {
        if s.t + 2.5 >= minute {
            let _ = write!(note, " {:.0}s {}/{}", s.t, s.waiting, s.lag_rows);
            minute += 60.0;
        }
    }
    let _ = write!(note, "; server CPU {server_cpu:.1} s to drained");
    note
}
