//! Records reach the journal's writer in another order than their numbers (connections
//! overflow its queue and their records come from blocking threads), across segment rollovers:
//! the folder must fold every spilled record, in each fsync mode, and every `!flush` is answered
//! with exact totals. And the records appended once the folder has caught up are not its: it
//! routes none of them a second time.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tallyd::config::FsyncMode;

use crate::common::buf_of;
use crate::{flushed, Rig};

/// The journal's segments as (name's first record, records in the file, highest record), by
/// name: what the folder's `segments_from` sees.
fn segments(dir: &Path) -> Vec<(u64, usize, u64, String)> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    paths.retain(|p| p.extension().is_some_and(|x| x == "journal"));
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            let first = name[..20].parse().unwrap();
            let records = tallyd::journal::records_from(&p, 0).unwrap_or_default();
            let last = records.iter().map(|(s, _)| *s).max().unwrap_or(0);
            (first, records.len(), last, name)
        })
        .collect()
}

/// Segments holding a record numbered at or above the next segment's first: a folder whose
/// next record is between the two skips the earlier segment (`journal::segments_from`).
fn overlapping(dir: &Path) -> Vec<String> {
    let segs = segments(dir);
    segs.windows(2)
        .filter(|w| w[0].2 >= w[1].0)
        .map(|w| {
            format!(
                "{} holds record {} >= {} (first of {})",
                w[0].3, w[0].2, w[1].0, w[1].3
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------

/// Many connections (700, as many applications' pools might open) with 4 KiB segments (a
/// rollover every few records): after each group commit the connections' next records and
/// `!sync`s overflow the writer's queue (1,024 inputs) and reach it from blocking threads in
/// any order, so segments hold records numbered above the next segment's first. A burst with
/// the database down, then short bursts with it up but faster than the cap (so they spill
/// too); after each, the folder catches up with the tail of the journal while the burst's last
/// records are still on their way, and must be done within seconds. Then every `!flush` is
/// answered and the totals are exact.
async fn out_of_order(fsync: FsyncMode) {
    const CLIENTS: usize = 700;
    const LINES: usize = 20;
    const BURSTS: usize = 16;
    let (mut rig, daemon) = Rig::start(5_000, 0, &[], |c| {
        c.journal.segment_bytes = 4096;
        c.journal.fsync = fsync;
    })
    .await;
    rig.pg_down().await;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(rig.client().await);
    }
    let mut events = 0i64;
    let mut overlaps = 0;
    for burst in 0..BURSTS {
        let length = if burst == 0 { 2000 } else { 500 };
        let until = Instant::now() + Duration::from_millis(length);
        let mut tasks = Vec::new();
        for (i, mut c) in clients.drain(..).enumerate() {
            tasks.push(tokio::spawn(async move {
                let mut chunks = 0usize;
                while Instant::now() < until {
                    let lines =
                        buf_of((0..LINES).map(|k| {
                            format!("downloads b{burst:02}-c{i:03}-{chunks:05}-{k:02} 3")
                        }));
                    c.send_synced(&lines).await;
                    chunks += 1;
                }
                (c, chunks)
            }));
        }
        while Instant::now() < until {
            overlaps = overlaps.max(overlapping(&rig.journal_dir()).len());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for t in tasks {
            let (c, chunks) = t.await.unwrap();
            events += (chunks * LINES) as i64;
            clients.push(c);
        }
        if burst == 0 {
            let spilled = rig
                .samples()
                .await
                .value("tallyd_journal_spilled_events_total");
            assert!(spilled > 0.0, "nothing spilled");
            rig.pg_up().await;
        }
        let caught_up = Instant::now() + Duration::from_secs(20);
        loop {
            let unfolded = rig.samples().await.value("tallyd_journal_unfolded_records");
            if unfolded == 0.0 {
                break;
            }
            if Instant::now() > caught_up {
                let segs = segments(&rig.journal_dir());
                panic!(
                    "the folder is stuck after burst {burst}: {unfolded} spilled records unfolded \
                     20 s after the clients paused; first segments (name's first record, records, \
                     highest record): {:?}; segments holding a record above the next one's first: {:?}",
                    segs.iter()
                        .take(6)
                        .map(|(f, n, l, _)| (*f, *n, *l))
                        .collect::<Vec<_>>(),
                    overlapping(&rig.journal_dir())
                        .into_iter()
                        .take(3)
                        .collect::<Vec<_>>()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    println!(
        "{events} events sent by {CLIENTS} clients in {BURSTS} bursts; up to {overlaps} segments at once held a record above the next one's first"
    );
    for (i, c) in clients.iter_mut().enumerate() {
        flushed(c, &format!("client {i}")).await;
    }
    assert_eq!(rig.totals().await, (events, events * 3));
    drop(clients);
    assert!(daemon.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_out_of_order_across_rollovers_are_all_folded_fsync_interval() {
    out_of_order(FsyncMode::Interval).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_out_of_order_across_rollovers_are_all_folded_fsync_always() {
    out_of_order(FsyncMode::Always).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_out_of_order_across_rollovers_are_all_folded_fsync_off() {
    out_of_order(FsyncMode::Off).await;
}

/// The folder catches up with the journal again and again while connections keep sending: a
/// connection spills a burst past the cap every 300 ms (the database up), and tickers send one
/// event per read meanwhile, so each time the folder routes the last spilled record, records
/// numbered right after it (routed to memory at once, not spilled) are appended to the segment
/// it is reading. It must stop there: routing them again counts their events twice (a ticker's
/// total above what it sent, and more events folded than spilled). Each ticker's total and the
/// bursts' are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_folder_routes_no_record_twice_once_it_has_caught_up() {
    const CAP: usize = 1_000;
    const TICKERS: usize = 4;
    const BURST: usize = 3 * CAP;
    let (rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.listen.read_buffer_bytes = 4096;
        c.flush.set_interval(Duration::from_millis(50));
    })
    .await;
    let until = Instant::now() + Duration::from_secs(6);
    let mut tickers = Vec::new();
    for i in 0..TICKERS {
        let mut c = rig.client().await;
        tickers.push(tokio::spawn(async move {
            let line = format!("downloads tick-{i} 1\n");
            let mut sent = 0u64;
            while Instant::now() < until {
                c.send(line.as_bytes()).await;
                sent += 1;
                tokio::time::sleep(Duration::from_micros(300)).await;
            }
            (c, sent)
        }));
    }
    let mut spiller = rig.client().await;
    let mut bursts = 0;
    while Instant::now() < until {
        spiller
            .send_synced(&buf_of(
                (0..BURST).map(|k| format!("views burst{bursts:03}-{k:05} 1")),
            ))
            .await;
        bursts += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let mut sent_total = 0;
    for (i, t) in tickers.into_iter().enumerate() {
        let (mut c, sent) = t.await.unwrap();
        assert_eq!(flushed(&mut c, "a ticker").await, (sent, 0));
        let total = crate::common::scalar(
            &crate::common::sql(&rig.conninfos[0]).await,
            &format!(
                "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.totals WHERE key = 'tick-{i}'"
            ),
        )
        .await;
        assert_eq!(
            total, sent as i64,
            "ticker {i}: committed {total} of {sent} sent"
        );
        sent_total += sent as i64;
    }
    flushed(&mut spiller, "the spiller").await;
    let s = rig.samples().await;
    let (spilled, folded) = (
        s.value("tallyd_journal_spilled_events_total"),
        s.value("tallyd_journal_folded_events_total"),
    );
    println!(
        "{bursts} bursts of {BURST} keys, {sent_total} ticks; {spilled} events spilled, {folded} folded"
    );
    assert!(
        spilled >= (bursts * (BURST - CAP)) as f64 / 2.0,
        "the bursts spilled only {spilled} events"
    );
    assert_eq!(folded, spilled, "every spilled event folded once");
    let bursts = bursts as i64;
    assert_eq!(
        rig.totals().await,
        (
            TICKERS as i64 + bursts * BURST as i64,
            sent_total + bursts * BURST as i64
        )
    );
    drop(spiller);
    assert!(daemon.terminate().success());
}
