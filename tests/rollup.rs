//! The rollup: folding slot rows into the summary (or an application's column), exactly, while
//! flushes, other rollups and readers run.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{buf_of, counter_total, scalar, Harness};
use tallyd::config::Config;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn folds_known_slots_exactly() {
    let h = Harness::start(|_| {}).await;
    let c = h.sql().await;
    // Three keys over several slots, with known times.
    c.batch_execute(
        "INSERT INTO tallyd.slots VALUES
           ('downloads', 'a', 0, 5, 'epoch'::timestamptz + interval '10 s', 'epoch'::timestamptz + interval '20 s'),
           ('downloads', 'a', 1, 7, 'epoch'::timestamptz + interval '5 s',  'epoch'::timestamptz + interval '15 s'),
           ('downloads', 'a', 7, -2, 'epoch'::timestamptz + interval '12 s', 'epoch'::timestamptz + interval '30 s'),
           ('downloads', 'b', 3, 1, 'epoch'::timestamptz + interval '1 s',  'epoch'::timestamptz + interval '1 s'),
           ('views',     '9', 0, 100, 'epoch'::timestamptz + interval '2 s', 'epoch'::timestamptz + interval '3 s');
         INSERT INTO tallyd.rollups VALUES
           ('downloads', 'b', 10, 'epoch'::timestamptz + interval '4 s', 'epoch'::timestamptz + interval '4 s');",
    )
    .await
    .unwrap();
    let before = (
        h.total("downloads", "a").await,
        h.total("downloads", "b").await,
        h.total("views", "9").await,
    );
    assert_eq!(before.0, (10, Some(5_000), Some(30_000)));
    assert_eq!(before.1, (11, Some(1_000), Some(4_000)));

    // A small batch folds at most that many rows and leaves totals unchanged.
    assert_eq!(scalar(&c, "SELECT tallyd.rollup(2)").await, 2);
    assert_eq!(scalar(&c, "SELECT count(*) FROM tallyd.slots").await, 3);
    let mid = (
        h.total("downloads", "a").await,
        h.total("downloads", "b").await,
        h.total("views", "9").await,
    );
    assert_eq!(mid, before);

    let folded = tallyd::rollup::until_empty(&c, 1000).await.unwrap();
    assert_eq!(folded, 3);
    assert_eq!(scalar(&c, "SELECT count(*) FROM tallyd.slots").await, 0);
    let after = (
        h.total("downloads", "a").await,
        h.total("downloads", "b").await,
        h.total("views", "9").await,
    );
    assert_eq!(after, before);
    assert_eq!(scalar(&c, "SELECT count(*) FROM tallyd.rollups").await, 3);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushes_rollups_and_a_reader_together() {
    let h = Harness::start(|c| {
        c.flush.connections = 4;
        c.flush.set_interval(Duration::from_millis(20));
        c.coalesce.buckets = 120;
    })
    .await;
    const KEYS: usize = 50;
    let stop = Arc::new(AtomicBool::new(false));
    let run_for = Duration::from_secs(4);

    // Two rollup workers, stepping as fast as they can. Any error (deadlock, serialization) fails.
    let mut workers = Vec::new();
    for _ in 0..2 {
        let client = h.sql().await;
        let stop = stop.clone();
        workers.push(tokio::spawn(async move {
            let mut folded = 0i64;
            while !stop.load(Ordering::Relaxed) {
                folded += tallyd::rollup::step(&client, 40)
                    .await
                    .expect("rollup step");
            }
            folded
        }));
    }
    // A reader: the grand total never goes down (events only add), and never exceeds what was sent.
    let sent = Arc::new(std::sync::atomic::AtomicI64::new(0));
    let reader = {
        let client = h.sql().await;
        let stop = stop.clone();
        let sent = sent.clone();
        tokio::spawn(async move {
            let mut last = 0i64;
            let mut reads = 0;
            while !stop.load(Ordering::Relaxed) {
                let upper = sent.load(Ordering::SeqCst);
                let total = counter_total(&client, "downloads").await;
                assert!(total >= last, "total went down: {last} -> {total}");
                let upper_after = sent.load(Ordering::SeqCst);
                assert!(
                    total <= upper_after,
                    "total {total} exceeds sent {upper_after} (was {upper})"
                );
                last = total;
                reads += 1;
            }
            reads
        })
    };
    // Senders on 4 connections, confirming with !flush so `sent` only counts accepted lines.
    let started = Instant::now();
    let mut senders = Vec::new();
    for i in 0..4 {
        let mut c = h.client().await;
        let sent = sent.clone();
        senders.push(tokio::spawn(async move {
            let lines = buf_of((0..KEYS).map(|k| format!("downloads k{k} {}", i + 1)));
            let per_round = (KEYS * (i + 1)) as i64;
            let mut rounds = 0i64;
            while started.elapsed() < run_for {
                sent.fetch_add(per_round, Ordering::SeqCst);
                c.send(&lines).await;
                assert_eq!(c.flush().await, (KEYS as u64, 0));
                rounds += 1;
            }
            (i, rounds)
        }));
    }
    let mut expected = 0i64;
    let mut per_key = 0i64;
    for s in senders {
        let (i, rounds) = s.await.unwrap();
        expected += rounds * (KEYS * (i + 1)) as i64;
        per_key += rounds * (i + 1) as i64;
    }
    stop.store(true, Ordering::Relaxed);
    let reads = reader.await.unwrap();
    let mut folded = 0;
    for w in workers {
        folded += w.await.unwrap();
    }
    assert!(reads > 10 && folded > 0, "reads {reads}, folded {folded}");
    let all = h.all("downloads").await;
    assert_eq!(all.len(), KEYS);
    assert!(
        all.iter().all(|(_, n)| *n == per_key),
        "{all:?} != {per_key}"
    );
    assert_eq!(all.iter().map(|(_, n)| n).sum::<i64>(), expected);
    println!("concurrent: {expected} events, {reads} reads, {folded} slot rows folded");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rollup_changes_nothing() {
    let h = Harness::start(|_| {}).await;
    let mut c = h.client().await;
    c.send(&buf_of((0..2000).map(|k| format!("views {k} {k}"))))
        .await;
    c.flush().await;
    let sql = h.sql().await;
    let before = scalar(&sql, "SELECT sum(count)::bigint FROM tallyd.totals").await;
    let rows_before = scalar(&sql, "SELECT count(*) FROM tallyd.slots").await;

    // A rollup that folded everything but has not committed yet...
    let victim = h.sql().await;
    let pid: i32 = victim
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    victim.batch_execute("BEGIN").await.unwrap();
    assert_eq!(
        scalar(&victim, "SELECT tallyd.rollup(100000)").await,
        rows_before
    );
    // ...is invisible to readers, and killing it rolls it all back.
    assert_eq!(
        scalar(&sql, "SELECT sum(count)::bigint FROM tallyd.totals").await,
        before
    );
    let killed: bool = sql
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap()
        .get(0);
    assert!(killed);
    assert!(
        victim.batch_execute("COMMIT").await.is_err(),
        "the killed session cannot commit"
    );
    assert_eq!(
        scalar(&sql, "SELECT sum(count)::bigint FROM tallyd.totals").await,
        before
    );
    assert_eq!(
        scalar(&sql, "SELECT count(*) FROM tallyd.slots").await,
        rows_before
    );
    assert_eq!(scalar(&sql, "SELECT count(*) FROM tallyd.rollups").await, 0);

    // A later rollup folds everything exactly once.
    assert_eq!(
        tallyd::rollup::until_empty(&sql, 500).await.unwrap(),
        rows_before
    );
    assert_eq!(
        scalar(&sql, "SELECT sum(count)::bigint FROM tallyd.totals").await,
        before
    );
    assert_eq!(before, (0..2000).sum::<i64>());
    h.stop().await;
}

/// V19 plans the summary step's claim with sorts off and turns them on again after it: both
/// only inside the step, whatever the session set (a user's `enable_sort = off` stays off, and
/// the step's own `on` does not leak into the caller's transaction).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claims_sort_setting_stays_inside_the_step() {
    let h = Harness::start(|_| {}).await;
    let c = h.sql().await;
    c.batch_execute(
        "INSERT INTO tallyd.slots VALUES
           ('downloads', 'a', 0, 5, now(), now()),
           ('downloads', 'b', 1, 7, now(), now());",
    )
    .await
    .unwrap();
    c.batch_execute("BEGIN; SET LOCAL enable_sort = off")
        .await
        .unwrap();
    let folded = scalar(
        &c,
        "SELECT folded FROM tallyd.rollup_summary('downloads', 'sum', '', 1000)",
    )
    .await;
    assert_eq!(folded, 2);
    let inside: String = c
        .query_one("SELECT current_setting('enable_sort')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        inside, "off",
        "the step left the caller's enable_sort changed"
    );
    c.batch_execute("COMMIT").await.unwrap();
    let after: String = c
        .query_one("SELECT current_setting('enable_sort')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(after, "on");
    assert_eq!(h.total("downloads", "a").await.0, 5);
    assert_eq!(h.total("downloads", "b").await.0, 7);
    assert_eq!(scalar(&c, "SELECT count(*) FROM tallyd.slots").await, 0);
    h.stop().await;
}

const REPOS: &str = "
CREATE TABLE public.repositories (id bigint PRIMARY KEY, name text, download_count bigint);
INSERT INTO public.repositories SELECT i, 'repo' || i, CASE WHEN i % 2 = 0 THEN 0 END FROM generate_series(1, 100) i;
";

/// Declares `repo_downloads` (bigint), folded into `public.repositories.download_count`.
fn repo_downloads(c: &mut Config) {
    c.counters
        .push(common::counter_into_repositories("repo_downloads"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollup_into_an_application_column() {
    let h = Harness::start_with(repo_downloads, REPOS, &[]).await;
    let mut c = h.client().await;
    // Keys 1..=100 exist in the table; 1000..=1004 do not.
    let lines = (1..=100)
        .flat_map(|id| std::iter::repeat_n(format!("repo_downloads {id}"), (id % 5 + 1) as usize))
        .chain((1000..1005).map(|id| format!("repo_downloads {id} 7")));
    c.send(&buf_of(lines)).await;
    c.flush().await;
    let sql = h.sql().await;
    let folded = tallyd::rollup::until_empty(&sql, 1000).await.unwrap();
    assert_eq!(folded, 100, "one slot row per existing key folded");
    for row in sql
        .query(
            "SELECT id, download_count FROM public.repositories ORDER BY id",
            &[],
        )
        .await
        .unwrap()
    {
        let (id, n): (i64, i64) = (row.get(0), row.get(1));
        assert_eq!(n, id % 5 + 1, "repository {id}");
    }
    // Missing keys are kept, and reported.
    assert_eq!(
        scalar(
            &sql,
            "SELECT sum(count)::bigint FROM tallyd.slots WHERE counter = 'repo_downloads'"
        )
        .await,
        35
    );
    let unmatched: i64 = sql
        .query_one(
            "SELECT slot_rows FROM tallyd.unmatched() WHERE counter = 'repo_downloads'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(unmatched, 5);
    // Nothing went to tallyd.rollups for this counter.
    assert_eq!(scalar(&sql, "SELECT count(*) FROM tallyd.rollups").await, 0);
    // Once the row appears, the next rollup folds it.
    sql.batch_execute("INSERT INTO public.repositories VALUES (1000, 'late', 3)")
        .await
        .unwrap();
    assert_eq!(tallyd::rollup::until_empty(&sql, 1000).await.unwrap(), 1);
    assert_eq!(
        scalar(
            &sql,
            "SELECT download_count FROM public.repositories WHERE id = 1000"
        )
        .await,
        10
    );
    h.stop().await;
}

/// Two client lines (a total at the 64-bit limit, then one more) must not stop the rollup for
/// everyone or make tallyd.totals unreadable: only that key is held back, exact, in slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_total_beyond_64_bits_holds_back_only_its_key() {
    let h = Harness::start(|_| {}).await;
    let sql = h.sql().await;
    let mut c = h.client().await;
    c.send(format!("downloads huge {}\n", i64::MAX).as_bytes())
        .await;
    assert_eq!(c.flush().await, (1, 0));
    assert_eq!(tallyd::rollup::until_empty(&sql, 1000).await.unwrap(), 1);
    c.send(b"downloads huge 1\ndownloads other 5\nviews 9 3\n")
        .await;
    assert_eq!(c.flush().await, (3, 0));

    // Every other key folds, and the step keeps succeeding.
    assert_eq!(tallyd::rollup::until_empty(&sql, 1000).await.unwrap(), 2);
    assert_eq!(tallyd::rollup::until_empty(&sql, 1000).await.unwrap(), 0);
    let held = tallyd::rollup::overflowed(&sql, 10).await.unwrap();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(
        (held[0].counter.as_str(), held[0].key.as_str()),
        ("downloads", "huge")
    );
    assert_eq!(held[0].total.as_deref(), Some("9223372036854775808"));
    assert_eq!(
        scalar(&sql, "SELECT count(*) FROM tallyd.slots").await,
        1,
        "only the held-back key's slot row stays"
    );

    // A whole-table read works; the key beyond the range reads exactly in exact_count.
    let rows: Vec<(String, String, Option<i64>, String)> = sql
        .query(
            "SELECT counter, key, count, exact_count::text FROM tallyd.totals ORDER BY 1, 2",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let row = |c: &str, k: &str, n: Option<i64>, e: &str| (c.into(), k.into(), n, e.into());
    assert_eq!(
        rows,
        vec![
            row("downloads", "huge", None, "9223372036854775808"),
            row("downloads", "other", Some(5), "5"),
            row("views", "9", Some(3), "3"),
        ]
    );
    assert_eq!(
        scalar(&sql, "SELECT sum(count)::bigint FROM tallyd.totals").await,
        8,
        "sum() over the view skips the NULL"
    );

    // Back in range (a negative delta), the key folds again.
    c.send(b"downloads huge -2\n").await;
    assert_eq!(c.flush().await, (1, 0));
    tallyd::rollup::until_empty(&sql, 1000).await.unwrap();
    assert!(tallyd::rollup::overflowed(&sql, 10)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(scalar(&sql, "SELECT count(*) FROM tallyd.slots").await, 0);
    assert_eq!(h.total("downloads", "huge").await.0, i64::MAX - 1);
    h.stop().await;
}

/// The guard's key-by-key fallback must pick keys that have a row in the target table: with more
/// unmatched keys (a normal state) than `batch_rows`, picking among all slot keys never reached
/// the overflowing key, which was never held back, so every later step raised again and no key
/// of the counter folded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmatched_keys_do_not_stall_the_rollup_into_guard() {
    let table = format!(
        "CREATE TABLE public.repositories (id bigint PRIMARY KEY, name text, download_count bigint);
         INSERT INTO public.repositories VALUES (9, 'big', {}), (95, 'a', 0), (96, 'b', 0), (97, 'c', 0);",
        i64::MAX
    );
    let h = Harness::start_with(repo_downloads, &table, &[]).await;
    let sql = h.sql().await;
    let mut c = h.client().await;
    // 200 keys without a row in the target table; their ids sort before the matched ones.
    let mut lines: Vec<String> = (1000..1200)
        .map(|k| format!("repo_downloads {k} 1"))
        .collect();
    lines.extend(["9 1", "95 5", "96 6", "97 7"].map(|l| format!("repo_downloads {l}")));
    c.send(&buf_of(lines)).await;
    assert_eq!(c.flush().await, (204, 0));
    for _ in 0..5 {
        tallyd::rollup::until_empty(&sql, 10).await.unwrap();
    }
    let folded: Vec<i64> = sql
        .query(
            "SELECT download_count FROM public.repositories WHERE id IN (95, 96, 97) ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let held = tallyd::rollup::overflowed(&sql, 10).await.unwrap();
    assert_eq!(
        (
            folded,
            held.iter().map(|h| h.key.as_str()).collect::<Vec<_>>()
        ),
        (vec![5, 6, 7], vec!["9"]),
        "the matched keys fold and only key 9 is held back"
    );
    assert_eq!(
        scalar(
            &sql,
            "SELECT sum(count)::bigint FROM tallyd.slots WHERE counter = 'repo_downloads'"
        )
        .await,
        201,
        "the held-back event and the 200 unmatched ones stay in slots"
    );
    h.stop().await;
}

/// The same guard for a counter that rolls up into an application column: the key whose column
/// would overflow is held back, the others fold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollup_into_holds_back_a_key_whose_column_would_overflow() {
    let h = Harness::start_with(repo_downloads, REPOS, &[]).await;
    let sql = h.sql().await;
    sql.batch_execute(&format!(
        "UPDATE public.repositories SET download_count = {} WHERE id = 1",
        i64::MAX
    ))
    .await
    .unwrap();
    let mut c = h.client().await;
    c.send(b"repo_downloads 1 1\nrepo_downloads 2 4\ndownloads x 2\n")
        .await;
    assert_eq!(c.flush().await, (3, 0));
    assert_eq!(tallyd::rollup::until_empty(&sql, 1000).await.unwrap(), 2);
    let held = tallyd::rollup::overflowed(&sql, 10).await.unwrap();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(
        (held[0].counter.as_str(), held[0].key.as_str()),
        ("repo_downloads", "1")
    );
    assert_eq!(
        scalar(
            &sql,
            "SELECT download_count FROM public.repositories WHERE id = 2"
        )
        .await,
        4
    );
    assert_eq!(
        scalar(
            &sql,
            "SELECT sum(count)::bigint FROM tallyd.slots WHERE counter = 'repo_downloads'"
        )
        .await,
        1,
        "the held-back event stays in slots"
    );
    // A later step does not fail either.
    tallyd::rollup::until_empty(&sql, 1000).await.unwrap();
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_slots_and_back() {
    let mut h = Harness::start(|c| c.database.slot_partitions = 8).await;
    let sql = h.sql().await;
    let parts = "SELECT count(*) FROM pg_inherits WHERE inhparent = 'tallyd.slots'::regclass";
    assert_eq!(scalar(&sql, parts).await, 8);
    let mut c = h.client().await;
    c.send(&buf_of((0..5000).map(|k| format!("views {k} 2"))))
        .await;
    c.flush().await;
    assert_eq!(
        scalar(&sql, "SELECT sum(count)::bigint FROM tallyd.totals").await,
        10_000
    );
    let spread = scalar(&sql, "SELECT count(DISTINCT tableoid) FROM tallyd.slots").await;
    assert_eq!(spread, 8, "rows spread over every partition");
    assert_eq!(tallyd::rollup::step(&sql, 1000).await.unwrap(), 1000);
    drop(c);
    // Back to a plain table on restart: rows are carried over.
    h.stop_daemon().await;
    h.reconfigure(|c| c.database.slot_partitions = 0);
    h.start_daemon().await;
    let mut c = h.client().await;
    c.send(b"views 1 1\n").await;
    c.flush().await;
    assert_eq!(scalar(&sql, parts).await, 0);
    assert_eq!(
        scalar(&sql, "SELECT sum(count)::bigint FROM tallyd.totals").await,
        10_001
    );
    // The view is recreated as the migrations last defined it (with exact_count).
    assert_eq!(
        scalar(&sql, "SELECT sum(exact_count)::bigint FROM tallyd.totals").await,
        10_001
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_cron_runs_the_same_step() {
    let available = std::process::Command::new("sh")
        .arg("-c")
        .arg("test -f \"$(pg_config --sharedir)/extension/pg_cron.control\" || ls /usr/share/postgresql/*/extension/pg_cron.control")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !available {
        // scripts/ensure-postgres installs it; without it there is nothing to test here.
        eprintln!("SKIPPED: pg_cron is not installed (apt-get install postgresql-<version>-cron)");
        return;
    }
    let settings = [
        ("shared_preload_libraries", "pg_cron"),
        ("cron.database_name", "postgres"),
        ("cron.use_background_workers", "on"),
    ];
    let h = Harness::start_with(|_| {}, "", &settings).await;
    let sql = h.sql().await;
    let mut c = h.client().await;
    c.send(&buf_of((0..300).map(|k| format!("downloads k{k} 3"))))
        .await;
    c.flush().await;
    assert_eq!(scalar(&sql, "SELECT count(*) FROM tallyd.slots").await, 300);
    sql.batch_execute(
        "CREATE EXTENSION pg_cron;
         SELECT cron.schedule('tallyd-rollup', '* * * * *', 'SELECT tallyd.rollup(1000)');",
    )
    .await
    .unwrap();
    // Debian's pg_cron 1.4 schedules by the minute (second intervals need 1.5).
    let deadline = Instant::now() + Duration::from_secs(90);
    while scalar(&sql, "SELECT count(*) FROM tallyd.slots").await > 0 {
        assert!(
            Instant::now() < deadline,
            "pg_cron did not roll up within 90 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(
        scalar(&sql, "SELECT count(*) FROM tallyd.rollups").await,
        300
    );
    assert_eq!(
        scalar(&sql, "SELECT sum(count)::bigint FROM tallyd.totals").await,
        900
    );
    h.stop().await;
}

/// `tallyd.totals` is defined only by the migrations: repartitioning `tallyd.slots` drops the
/// view and recreates it from its own definition (`pg_get_viewdef`), so a migration that changes
/// the view is never reverted by a restart with another `slot_partitions`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repartitioning_keeps_the_view_the_migrations_defined() {
    let mut h = Harness::start(|_| {}).await;
    let sql = h.sql().await;
    let view = "SELECT pg_get_viewdef('tallyd.totals'::regclass)";
    let before: String = sql.query_one(view, &[]).await.unwrap().get(0);
    for partitions in [4, 0] {
        h.stop_daemon().await;
        h.reconfigure(|c| c.database.slot_partitions = partitions);
        h.start_daemon().await;
        let after: String = sql.query_one(view, &[]).await.unwrap().get(0);
        assert_eq!(after, before, "after repartitioning into {partitions}");
    }
    h.stop().await;
}
