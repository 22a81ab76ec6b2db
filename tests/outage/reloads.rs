//! Reloads while records are spilled, and the fold's own parsing: a lowered
//! `listen.max_key_bytes`, a removed counter and a moved cap keep every spilled event; a line
//! near `listen.max_line_bytes` (longer in the journal) survives the fold; and what `!flush`
//! says of an overflow found while folding, and a set's answer of a refusal found while folding.

use std::time::Duration;

use crate::common::{buf_of, sql};
use crate::{flushed, Rig};

// ---------------------------------------------------------------------------------------------

/// Events accepted (and `!sync`ed) with keys within `listen.max_key_bytes`, spilled with the
/// database down; a reload then lowers `listen.max_key_bytes` (a limit the docs say applies to
/// lines sent after the reload). The folder parses the spilled lines again against the new
/// limit: they must still be committed, and `!flush` must not answer `ok` for events that
/// were dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_lowers_max_key_bytes_keeps_spilled_events() {
    const CAP: usize = 100;
    const LONG: usize = 50;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |_| {}).await;
    rig.pg_down().await;
    let mut filler = rig.fill_memory(CAP).await;
    let mut c = rig.client().await;
    let key = |k: usize| format!("{k:03}-{}", "x".repeat(60));
    c.send_synced(&buf_of(
        (0..LONG).map(|k| format!("downloads {} 3", key(k))),
    ))
    .await;
    let spilled = rig
        .samples()
        .await
        .value("tallyd_journal_spilled_events_total");
    // The filler's own read may have spilled too (its events count against the cap before
    // the check): folded at once, with the database down, until memory was full.
    assert!(
        spilled >= LONG as f64,
        "the long keys were spilled ({spilled})"
    );
    rig.reload(&daemon, |c| c.listen.max_key_bytes = 32);
    rig.pg_up().await;
    let answer = flushed(&mut c, "after the reload").await;
    let (rows, sum) = rig.totals().await;
    let rejected = rig
        .samples()
        .await
        .value(r#"tallyd_lines_rejected_total{reason="key_too_long"}"#);
    println!("`!flush` answered {answer:?}; committed {rows} keys, sum {sum}; key_too_long rejections: {rejected}");
    assert_eq!(filler.flush().await, (CAP as u64, 0));
    assert_eq!(
        rig.totals().await,
        ((CAP + LONG) as i64, (CAP + 3 * LONG) as i64),
        "`!sync`ed events with keys the limit allowed when they were accepted were dropped at the fold \
         (`!flush` answered {answer:?})"
    );
    assert_eq!(answer, (LONG as u64, 0));
    assert!(daemon.terminate().success());
}

/// The same without any reload: a line within `listen.max_line_bytes` as sent becomes longer
/// in the journal (its canonical form gets ` @<unix ms>`, 15 bytes). Spilled, it is parsed
/// again at the fold against the same limit and rejected as too long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_near_max_line_bytes_survives_the_fold() {
    const CAP: usize = 100;
    const LONG: usize = 50;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.listen.max_line_bytes = 128;
        c.listen.max_key_bytes = 120;
    })
    .await;
    rig.pg_down().await;
    let mut filler = rig.fill_memory(CAP).await;
    let mut c = rig.client().await;
    // 10 + 110 + 2 = 122 bytes a line: accepted.
    let lines = buf_of((0..LONG).map(|k| format!("downloads {k:03}-{} 3", "y".repeat(106))));
    assert!(lines.split(|&b| b == b'\n').all(|l| l.len() <= 128));
    c.send_synced(&lines).await;
    rig.pg_up().await;
    let answer = flushed(&mut c, "lines near the limit").await;
    assert_eq!(filler.flush().await, (CAP as u64, 0));
    let too_long = rig
        .samples()
        .await
        .value(r#"tallyd_lines_rejected_total{reason="too_long"}"#);
    assert_eq!(
        rig.totals().await,
        ((CAP + LONG) as i64, (CAP + 3 * LONG) as i64),
        "accepted and `!sync`ed lines dropped at the fold ({too_long} rejected as too long; \
         `!flush` answered {answer:?})"
    );
    assert!(daemon.terminate().success());
}

/// A reload during spilling removes the counter the spilled events name, and lowers then
/// raises `coalesce.max_pending_keys`: the spilled events are still committed exactly, the
/// fold stays within the cap in force, and `!flush` answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_during_spilling_remove_a_counter_and_move_the_cap() {
    const CAP: usize = 1_000;
    const KEYS: usize = 20_000;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |_| {}).await;
    rig.pg_down().await;
    let mut filler = rig.fill_memory(CAP).await;
    let mut c = rig.client().await;
    for chunk in 0..KEYS / 1000 {
        c.send_synced(&buf_of(
            (0..1000).map(|k| format!("downloads k{chunk:02}-{k:03} 2")),
        ))
        .await;
    }
    let s = rig.samples().await;
    assert!(s.value("tallyd_journal_spilled_events_total") >= KEYS as f64);
    // `downloads` removed; the cap lowered to a tenth.
    rig.reload(&daemon, |c| {
        c.counters.retain(|k| k.name != "downloads");
        c.coalesce.max_pending_keys = CAP / 10;
        c.flush.max_pending_keys = CAP / 20;
    });
    rig.pg_up().await;
    let mut highest = 0.0f64;
    // Halfway through the fold, the cap is raised again.
    loop {
        let s = rig.samples().await;
        highest = highest.max(s.value("tallyd_pending_keys"));
        if s.value("tallyd_journal_folded_events_total") >= (KEYS / 2) as f64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    rig.reload(&daemon, |c| {
        c.coalesce.max_pending_keys = CAP * 5;
        c.flush.max_pending_keys = CAP;
    });
    assert_eq!(
        flushed(&mut c, "spilled events of a removed counter").await,
        (KEYS as u64, 0)
    );
    assert_eq!(filler.flush().await, (CAP as u64, 0));
    assert_eq!(
        rig.totals().await,
        ((CAP + KEYS) as i64, (CAP + 2 * KEYS) as i64)
    );
    // The fold at the lowered cap: one record (1000 keys) above it at most.
    println!("while folding at the lowered cap: at most {highest} keys pending");
    assert!(
        highest <= (CAP / 10 + 1000) as f64,
        "{highest} keys pending"
    );
    // Lines for the removed counter are refused after the reload, as for any unknown counter.
    c.send(b"!errors\ndownloads late 1\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    assert!(c.read_line().await.contains("unknown_counter"));
    assert!(daemon.terminate().success());
}

/// Two events of one key whose sum overflows a bigint: when they are coalesced in memory the
/// second is rejected and `!flush` says so (`ok 2 1`). Spilled, the folder finds the overflow
/// on its own connection: the client's `!flush` must still count it as rejected, not answer
/// that both were accepted while only one is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_after_spilled_events_reports_their_overflow() {
    const CAP: usize = 50;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |_| {}).await;
    let big = i64::MAX;
    // In memory (database up): the reference answer.
    let mut c = rig.client().await;
    c.send(format!("downloads mem {big}\ndownloads mem {big}\n").as_bytes())
        .await;
    let in_memory = flushed(&mut c, "in memory").await;
    assert_eq!(in_memory, (1, 1), "the second event overflows");
    rig.pg_down().await;
    let mut filler = rig.fill_memory(CAP).await;
    c.send_synced(format!("downloads spilled {big}\ndownloads spilled {big}\n").as_bytes())
        .await;
    assert!(
        rig.samples()
            .await
            .value("tallyd_journal_spilled_events_total")
            >= 2.0
    );
    rig.pg_up().await;
    let spilled = flushed(&mut c, "spilled").await;
    assert_eq!(filler.flush().await, (CAP as u64, 0));
    let db = sql(&rig.conninfos[0]).await;
    assert_eq!(crate::common::key_total(&db, "downloads", "mem").await, big);
    assert_eq!(
        crate::common::key_total(&db, "downloads", "spilled").await,
        big
    );
    assert_eq!(crate::common::counter_total(&db, "views").await, CAP as i64);
    assert_eq!(
        spilled, in_memory,
        "`!flush` after spilled events answered {spilled:?}, coalesced in memory {in_memory:?}: \
         the overflow the folder found is not reported to the client"
    );
    assert!(daemon.terminate().success());
}

/// A set the flush refuses (TD003: it would move the all-time row beyond 64 bits) inside a
/// spilled record, after a correction the connection sent before: answered `error overflow` on
/// its own line, and the set after it `ok`. The folder numbers a record's corrections as its
/// sender did; before, it numbered them from its own count, so the refusal named another
/// correction of the sender's: the refused set was answered `ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_set_in_a_spilled_record_is_answered_on_its_line() {
    const CAP: usize = 50;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.counters.push(crate::common::windowed_counter(
            "wd",
            "day",
            "UTC",
            &["all"],
        ));
    })
    .await;
    let max = i64::MAX;
    let d1 = crate::common::unix_ms("2026-11-23T10:00:00Z");
    let d2 = crate::common::unix_ms("2026-11-24T10:00:00Z");
    let mut c = rig.client().await;
    // Day 2 holds 1, so a set of day 1 to the maximum would take the all-time row beyond it.
    c.send(format!("wd k 1 @{d2}\n").as_bytes()).await;
    assert_eq!(flushed(&mut c, "in memory").await, (1, 0));
    // The connection's first correction, in memory.
    c.send(format!("!set wd j 5 @{d1}\n").as_bytes()).await;
    assert_eq!(c.read_line().await, "ok\n");
    rig.pg_down().await;
    let mut filler = rig.fill_memory(CAP).await;
    // Its second (refused) and third, spilled with an event.
    c.send(format!("wd e 1 @{d1}\n!set wd k {max} @{d1}\n!set wd j 7 @{d1}\n").as_bytes())
        .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while rig
        .samples()
        .await
        .value("tallyd_journal_spilled_events_total")
        < 1.0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the record did not spill"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    rig.pg_up().await;
    let refused = c.read_line().await;
    assert!(
        refused.starts_with("error overflow "),
        "the refused set was answered {refused:?}"
    );
    assert_eq!(c.read_line().await, "ok\n", "the set after it");
    assert_eq!(flushed(&mut c, "spilled").await, (1, 0));
    assert_eq!(filler.flush().await, (CAP as u64, 0));
    let db = sql(&rig.conninfos[0]).await;
    assert_eq!(crate::common::key_total(&db, "wd", "k").await, 1);
    assert_eq!(crate::common::key_total(&db, "wd", "j").await, 7);
    assert_eq!(crate::common::key_total(&db, "wd", "e").await, 1);
    assert!(daemon.terminate().success());
}
