//! Measurements and a known limit, run by hand (`cargo test --test outage -- --ignored`): the
//! memory of the start's replay of a large journal, the cost of tailing the journal after an
//! outage, the fold of a large backlog.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tallyd::config::FsyncMode;

use crate::common::{self, buf_of, LineClient, Samples};
use crate::{flushed, rss_mib, start_unready, Rig};

/// A journal of about 96 MiB (4 MiB segments) left by an outage (the database down, the same
/// 64 KiB of lines sent again and again, every read spilled or coalesced, none committed),
/// kill -9, then a start with the database up. The replay is said to be bounded by the memory
/// cap: the pending keys are, but the start must not hold the whole journal in memory either
/// (it reads it segment by segment, so a few segments at most). Exact afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_does_not_hold_a_large_journal_in_memory() {
    const CAP: usize = 500;
    const MIB: usize = 96;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.journal.segment_bytes = 4 << 20;
        c.journal.fsync = FsyncMode::Off;
    })
    .await;
    rig.pg_down().await;
    // 64 KiB of lines over 1,000 keys, each key's delta 1.
    let mut chunk = Vec::new();
    let mut lines = 0i64;
    while chunk.len() < 65_000 {
        chunk.extend_from_slice(format!("downloads hot-{:03} 1\n", lines % 1000).as_bytes());
        lines += 1;
    }
    let mut c = rig.client().await;
    let mut sent = 0i64;
    let started = Instant::now();
    // A journal line is the line sent and ` @<unix ms>`: 35 bytes for 20.
    while (sent / lines) as usize * chunk.len() * 35 / 20 < MIB << 20 {
        c.send(&chunk).await;
        sent += lines;
    }
    c.sync().await;
    let journal = rig.samples().await.value("tallyd_journal_bytes") / 1048576.0;
    println!(
        "{sent} events, a {journal:.0} MiB journal in {:?}",
        started.elapsed()
    );
    drop(c);
    daemon.kill();
    rig.pg_up().await;
    let mut child = start_unready(&rig);
    let pid = child.id();
    let started = Instant::now();
    let mut rss_max = 0.0f64;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the start ended: {status}");
        }
        rss_max = rss_max.max(rss_mib(pid));
        if rig.totals().await.1 == sent {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "replay not done in 5 min"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    println!(
        "start with a {journal:.0} MiB journal: committed in {:?}, RSS up to {rss_max:.0} MiB",
        started.elapsed()
    );
    assert_eq!(rig.totals().await, (1000, sent));
    assert!(
        rss_max < journal,
        "the start held the journal in memory: RSS up to {rss_max:.0} MiB for a {journal:.0} MiB journal"
    );
}

/// CPU seconds (user + system) the process has used.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split(' ').collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// `clients` connections sending `per_tick` events each every `tick` over `keys` keys until
/// `stop`; returns the events sent.
fn steady_traffic(
    socket: PathBuf,
    clients: usize,
    tick: Duration,
    per_tick: usize,
    keys: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<(i64, Vec<LineClient>)> {
    tokio::spawn(async move {
        let mut conns = Vec::new();
        for _ in 0..clients {
            conns.push(LineClient::connect(&socket).await);
        }
        let mut sent = 0i64;
        let mut tick = tokio::time::interval(tick);
        let mut n = 0usize;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            tick.tick().await;
            for c in conns.iter_mut() {
                let lines =
                    buf_of((0..per_tick).map(|k| format!("downloads hot-{} 1", (n + k) % keys)));
                n += per_tick;
                c.send(&lines).await;
                sent += per_tick as i64;
            }
        }
        (sent, conns)
    })
}

/// After an outage, with steady traffic that the database keeps up with easily: does tallyd
/// leave spill mode (the folder catches up, records go to memory again), and what does the
/// folder's re-reading of the current segment cost? Compared with the same traffic before the
/// outage. Prints the figures; asserts only exactness.
async fn tailing_cost(segment_bytes: u64) {
    const CAP: usize = 100_000;
    let (mut rig, mut daemon) = Rig::start(CAP, 0, &[], |c| {
        c.journal.segment_bytes = segment_bytes;
    })
    .await;
    let pid = daemon.pid();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // 4 x 150 events / 10 ms = 60,000 events/s over a million keys: 12,000 keys a flush
    // interval (well under the cap), but the cap is reached after two seconds of outage.
    let traffic = steady_traffic(
        rig.socket(),
        4,
        Duration::from_millis(10),
        150,
        1_000_000,
        stop.clone(),
    );
    let measure = |label: &'static str, rig: &Rig, pid: u32| {
        let addr = rig.metrics;
        async move {
            let s0 = Samples::parse(&common::scrape(addr));
            let cpu0 = cpu_seconds(pid);
            let mut unfolded_min = f64::MAX;
            let mut rss_max = 0.0f64;
            for _ in 0..50 {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let s = Samples::parse(&common::scrape(addr));
                unfolded_min = unfolded_min.min(s.value("tallyd_journal_unfolded_records"));
                rss_max = rss_max.max(rss_mib(pid));
            }
            let s1 = Samples::parse(&common::scrape(addr));
            let cpu = cpu_seconds(pid) - cpu0;
            let spilled = s1.value("tallyd_journal_spilled_events_total")
                - s0.value("tallyd_journal_spilled_events_total");
            let received =
                s1.value("tallyd_received_bytes_total") - s0.value("tallyd_received_bytes_total");
            println!(
                "segment_bytes {segment_bytes}: {label}: {:.2} CPU s per s, {:.1} MB/s received, \
                 {spilled} events spilled in 10 s, unfolded records at least {unfolded_min}, RSS up to {rss_max:.0} MiB",
                cpu / 10.0,
                received / 10e6
            );
        }
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    measure("before the outage", &rig, pid).await;
    rig.pg_down().await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let s = rig.samples().await;
    println!(
        "segment_bytes {segment_bytes}: after 10 s down: journal {:.0} MiB, {} events spilled",
        s.value("tallyd_journal_bytes") / 1048576.0,
        s.value("tallyd_journal_spilled_events_total")
    );
    rig.pg_up().await;
    tokio::time::sleep(Duration::from_secs(20)).await;
    measure("20 s after the database returned", &rig, pid).await;
    measure("30 s after the database returned", &rig, pid).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (sent, mut conns) = traffic.await.unwrap();
    for c in conns.iter_mut() {
        flushed(c, "steady traffic").await;
    }
    assert_eq!(rig.totals().await.1, sent);
    let _ = daemon.try_wait();
    assert!(daemon.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run by hand"]
async fn measure_tailing_cost_64_mib_segments() {
    tailing_cost(64 << 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run by hand"]
async fn measure_tailing_cost_1_mib_segments() {
    tailing_cost(1 << 20).await;
}

/// With the database down: sends 64 KiB buffers over 100,000 keys (each key's delta 1) on one
/// connection until the journal holds `target` bytes; returns the connection (synced) and the
/// events sent.
async fn spill_fast(rig: &Rig, target: f64) -> (LineClient, i64) {
    let mut buffers = Vec::new();
    let mut k = 0usize;
    while k < 100_000 {
        let mut b = Vec::new();
        let mut n = 0i64;
        while b.len() < 65_000 && k < 100_000 {
            b.extend_from_slice(format!("downloads key-{k:06} 1\n").as_bytes());
            k += 1;
            n += 1;
        }
        buffers.push((b, n));
    }
    let mut c = rig.client().await;
    let mut sent = 0i64;
    let mut i = 0;
    loop {
        let (b, n) = &buffers[i % buffers.len()];
        c.send(b).await;
        sent += n;
        i += 1;
        if i % 500 == 0 && rig.samples().await.value("tallyd_journal_bytes") >= target {
            break;
        }
    }
    c.sync().await;
    (c, sent)
}

/// A journal of `ATTACK_JOURNAL_MIB` (256 by default) spilled with the database down, kill -9,
/// then a start: the start's resident memory while it reads and replays the journal, and the
/// pending keys (bounded by the cap). Prints the figures; asserts exactness.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run by hand"]
async fn measure_replay_memory() {
    const CAP: usize = 50_000;
    let target: f64 = std::env::var("ATTACK_JOURNAL_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256.0)
        * 1048576.0;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.journal.max_bytes = 4 << 30;
    })
    .await;
    let pid = daemon.pid();
    rig.pg_down().await;
    let started = Instant::now();
    let (c, sent) = spill_fast(&rig, target).await;
    let rss_spilling = rss_mib(pid);
    let journal = rig.samples().await.value("tallyd_journal_bytes") / 1048576.0;
    println!(
        "spilled {sent} events, journal {journal:.0} MiB in {:?}; RSS while spilling {rss_spilling:.0} MiB",
        started.elapsed()
    );
    drop(c);
    daemon.kill();
    rig.pg_up().await;
    let mut child = start_unready(&rig);
    let pid = child.id();
    let started = Instant::now();
    let mut rss_max = 0.0f64;
    let mut pending_max = 0.0f64;
    let mut cpu;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the start ended: {status}");
        }
        rss_max = rss_max.max(rss_mib(pid));
        cpu = cpu_seconds(pid);
        let addr = rig.metrics;
        if let Ok(Ok(text)) =
            tokio::task::spawn_blocking(move || std::panic::catch_unwind(|| common::scrape(addr)))
                .await
        {
            pending_max = pending_max.max(Samples::parse(&text).value("tallyd_pending_keys"));
        }
        if std::os::unix::net::UnixStream::connect(rig.socket()).is_ok()
            && rig.totals().await.1 == sent
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1200),
            "replay not done in 20 min"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "start with a {journal:.0} MiB journal: replayed and committed in {:?} ({cpu:.1} CPU s); \
         RSS up to {rss_max:.0} MiB; pending keys up to {pending_max} (cap {CAP})",
        started.elapsed()
    );
    assert_eq!(rig.totals().await, (100_000, sent));
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A spilled backlog of `ATTACK_JOURNAL_MIB` (256 by default; events over 100,000 keys, cap
/// 50,000) folded once the database returns, without a restart: how long, the CPU and the
/// resident memory, with the default 64 MiB segments. Prints the figures; asserts exactness.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run by hand"]
async fn measure_fold_of_a_large_backlog() {
    const CAP: usize = 50_000;
    let target: f64 = std::env::var("ATTACK_JOURNAL_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256.0)
        * 1048576.0;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.journal.max_bytes = 4 << 30;
    })
    .await;
    let pid = daemon.pid();
    rig.pg_down().await;
    let started = Instant::now();
    let (mut c, sent) = spill_fast(&rig, target).await;
    let s = rig.samples().await;
    let journal = s.value("tallyd_journal_bytes") / 1048576.0;
    println!(
        "spilled {} of {sent} events, journal {journal:.0} MiB in {:?}; RSS {:.0} MiB",
        s.value("tallyd_journal_spilled_events_total"),
        started.elapsed(),
        rss_mib(pid)
    );
    let cpu0 = cpu_seconds(pid);
    rig.pg_up().await;
    let started = Instant::now();
    let mut rss_max = 0.0f64;
    let mut pending_max = 0.0f64;
    loop {
        let s = rig.samples().await;
        rss_max = rss_max.max(rss_mib(pid));
        pending_max = pending_max.max(s.value("tallyd_pending_keys"));
        if s.value("tallyd_journal_unfolded_records") == 0.0
            && s.value("tallyd_pending_keys") == 0.0
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1800),
            "not folded in 30 min"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    flushed(&mut c, "after the fold").await;
    println!(
        "folded and committed a {journal:.0} MiB backlog in {:?} ({:.1} CPU s of tallyd); RSS up to \
         {rss_max:.0} MiB; pending keys up to {pending_max} (cap {CAP})",
        started.elapsed(),
        cpu_seconds(pid) - cpu0
    );
    assert_eq!(rig.totals().await, (100_000, sent));
    assert!(daemon.terminate().success());
}

/// CPU seconds per million events received over `secs` seconds, and the events received.
async fn cpu_per_event(rig: &Rig, pid: u32, secs: u64) -> (f64, f64) {
    let s0 = rig.samples().await;
    let cpu0 = cpu_seconds(pid);
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let cpu = cpu_seconds(pid) - cpu0;
    let accepted = |s: &Samples| s.sum("tallyd_events_accepted_total").unwrap_or(0.0);
    let events = accepted(&rig.samples().await) - accepted(&s0);
    (cpu / events * 1e6, events)
}

/// Issue 33, item 5 (docs/benchmarks.md, "After an outage"), with the outage attack's settings:
/// the default journal (64 MiB segments), `coalesce.max_pending_keys` `ATTACK_CAP` (100,000 by
/// default, so that the outage spills; 2000000 is tallyd's default), steady traffic of 60,000
/// events/s over a million keys, the database stopped for `ATTACK_OUTAGE_SECS` (60 by default):
/// the seconds from its return until tallyd routes in memory again (no record waits spilled, and
/// none spilled for a second), until it has caught up (besides that, the keys pending back
/// within twice their number before the outage), and tallyd's CPU seconds per million events
/// over 10 s before the outage and 10 s after that. Prints the figures; asserts only exactness.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run by hand"]
async fn measure_the_end_of_an_outage() {
    let outage = std::env::var("ATTACK_OUTAGE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60u64);
    let cap = std::env::var("ATTACK_CAP")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000usize);
    let (mut rig, mut daemon) = Rig::start(cap, 0, &[], |_| {}).await;
    let pid = daemon.pid();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = steady_traffic(
        rig.socket(),
        4,
        Duration::from_millis(10),
        150,
        1_000_000,
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (before, events) = cpu_per_event(&rig, pid, 10).await;
    let pending_before = rig.samples().await.value("tallyd_pending_keys");
    println!(
        "before the outage: {before:.2} CPU s per million events ({events} events in 10 s), \
         {pending_before} keys pending"
    );
    rig.pg_down().await;
    tokio::time::sleep(Duration::from_secs(outage)).await;
    let s = rig.samples().await;
    println!(
        "after {outage} s down: journal {:.0} MiB, {} events spilled, {} records unfolded",
        s.value("tallyd_journal_bytes") / 1048576.0,
        s.value("tallyd_journal_spilled_events_total"),
        s.value("tallyd_journal_unfolded_records")
    );
    rig.pg_up().await;
    let back = Instant::now();
    let cpu0 = cpu_seconds(pid);
    let mut last_spilled = rig
        .samples()
        .await
        .value("tallyd_journal_spilled_events_total");
    let mut calm_since = None;
    let mut caught_up = None;
    let mut recovered = None;
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let s = rig.samples().await;
        let spilled = s.value("tallyd_journal_spilled_events_total");
        let calm = spilled == last_spilled && s.value("tallyd_journal_unfolded_records") == 0.0;
        last_spilled = spilled;
        if caught_up.is_none()
            && calm
            && s.value("tallyd_pending_keys") <= (2.0 * pending_before).max(10_000.0)
        {
            caught_up = Some(back.elapsed());
        }
        match (calm, calm_since) {
            (true, None) => calm_since = Some(back.elapsed()),
            (true, Some(since)) if back.elapsed() - since >= Duration::from_secs(1) => {
                recovered = recovered.or(Some(since));
            }
            (false, _) => calm_since = None,
            _ => {}
        }
        if (recovered.is_some() && caught_up.is_some()) || back.elapsed() > Duration::from_secs(180)
        {
            break;
        }
    }
    let recovery_cpu = cpu_seconds(pid) - cpu0;
    match recovered {
        Some(t) => println!(
            "routing in memory again {:.1} s after the database returned ({recovery_cpu:.1} CPU s meanwhile)",
            t.as_secs_f64()
        ),
        None => println!("still spilling 180 s after the database returned"),
    }
    match caught_up {
        Some(t) => println!(
            "caught up {:.1} s after the database returned (keys pending within twice their \
             number before the outage)",
            t.as_secs_f64()
        ),
        None => println!("not caught up within 180 s"),
    }
    let (after, events) = cpu_per_event(&rig, pid, 10).await;
    println!("after the outage: {after:.2} CPU s per million events ({events} events in 10 s)");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (sent, mut conns) = traffic.await.unwrap();
    for c in conns.iter_mut() {
        flushed(c, "steady traffic").await;
    }
    assert_eq!(rig.totals().await.1, sent);
    let _ = daemon.try_wait();
    assert!(daemon.terminate().success());
}
