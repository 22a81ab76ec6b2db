//! The batched import (`tallyd-import-batched`): the `tallyd-hc-uniform` load sent as batches
//! of `BATCH_LINES` events under ids (`!batch` ... `!commit`, each answered once durable and
//! claimed), beside the same events sent without batches in the same run, and the time to
//! answer a batch sent again (`duplicate`); and its peer in the same run, the importer
//! pattern crates.io uses (`crates-io-importer`: per file, the file's name inserted into a
//! `processed` table and its counts upserted, in one transaction).

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use crate::daemon::Counting;
use crate::env::BenchEnv;
use crate::load::Load;
use crate::report::{server_cpu_note, DaemonStats, Flow, Outcome};

/// Events per batch, as an importer would commit a log file's chunk.
pub(crate) const BATCH_LINES: usize = 10_000;
/// Batches sent again to time the `duplicate` answer.
const DUPLICATES: usize = 20;
/// The peer row's name.
pub(crate) const PEER: &str = "crates-io-importer";
/// How often a peer transaction is tried again after a deadlock or serialization failure.
const PEER_RETRIES: u32 = 10;

/// One client's buffer as batches `bench:<client>:<n>` of up to `BATCH_LINES` lines; returns
/// the bytes and how many batches.
fn as_batches(client: usize, buf: &[u8]) -> (Vec<u8>, Vec<Vec<u8>>) {
    let mut out = Vec::with_capacity(buf.len() + buf.len() / 100);
    let mut batches = Vec::new();
    let lines: Vec<&[u8]> = buf.split_inclusive(|&b| b == b'\n').collect();
    for (n, chunk) in lines.chunks(BATCH_LINES).enumerate() {
        let mut batch = format!("!batch bench:{client}:{n}\n").into_bytes();
        for l in chunk {
            batch.extend_from_slice(l);
        }
        batch.extend_from_slice(b"!commit\n");
        out.extend_from_slice(&batch);
        batches.push(batch);
    }
    (out, batches)
}

async fn reply(rd: &mut BufReader<tokio::net::unix::OwnedReadHalf>) -> Result<String> {
    let mut line = String::new();
    rd.read_line(&mut line).await?;
    ensure!(!line.is_empty(), "tallyd closed the connection");
    Ok(line.trim_end().to_string())
}

/// Writes `buf` (`batches` batches) and `!flush`; checks every batch is answered `ok` then
/// `ok <n> 0`, and the `!flush` `ok 0 0`; returns the events the batches counted.
async fn client(stream: UnixStream, buf: Vec<u8>, batches: usize) -> Result<u64> {
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::new(rd);
    let writer = tokio::spawn(async move {
        wr.write_all(&buf).await?;
        wr.write_all(b"!flush\n").await?;
        Ok::<_, std::io::Error>(wr)
    });
    let mut counted = 0;
    for _ in 0..batches {
        ensure!(reply(&mut rd).await? == "ok", "!batch not answered ok");
        let commit = reply(&mut rd).await?;
        let f: Vec<&str> = commit.split(' ').collect();
        match f.as_slice() {
            ["ok", n, "0"] => counted += n.parse::<u64>()?,
            _ => anyhow::bail!("unexpected answer to !commit: {commit:?}"),
        }
    }
    ensure!(
        reply(&mut rd).await? == "ok 0 0",
        "!flush after the batches"
    );
    writer.await??;
    Ok(counted)
}

/// Sends `batch` again on a new connection; the time from its first byte to `duplicate`.
async fn duplicate_answer(socket: &Path, batch: &[u8]) -> Result<Duration> {
    let (rd, mut wr) = UnixStream::connect(socket).await?.into_split();
    let mut rd = BufReader::new(rd);
    let started = Instant::now();
    wr.write_all(batch).await?;
    ensure!(reply(&mut rd).await? == "ok", "!batch not answered ok");
    let answer = reply(&mut rd).await?;
    let took = started.elapsed();
    ensure!(answer == "duplicate", "a batch sent again: {answer:?}");
    Ok(took)
}

/// One "file" of the peer: its events' counts per key, sorted by key (so that concurrent
/// transactions lock rows in the same order), as an importer aggregates a log file.
fn file_counts(lines: &[&[u8]]) -> (Vec<String>, Vec<i64>) {
    let mut counts: std::collections::HashMap<&[u8], i64> = std::collections::HashMap::new();
    for line in lines {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let key = line.rsplit(|&b| b == b' ').next().unwrap_or(line);
        *counts.entry(key).or_default() += 1;
    }
    let mut counts: Vec<(&[u8], i64)> = counts.into_iter().collect();
    counts.sort_unstable();
    counts
        .into_iter()
        .map(|(k, n)| (String::from_utf8_lossy(k).into_owned(), n))
        .unzip()
}

/// One peer client: its buffer's files of `BATCH_LINES` lines, each in one transaction (the
/// file's name into `bench_import_processed`, its counts upserted into `bench_import_counts`);
/// returns the events counted and the transactions tried again.
async fn peer_client(
    mut client: tokio_postgres::Client,
    index: usize,
    buf: Vec<u8>,
) -> Result<(u64, u32)> {
    let processed = client
        .prepare("INSERT INTO bench_import_processed (name) VALUES ($1)")
        .await?;
    let upsert = client
        .prepare(
            "INSERT INTO bench_import_counts (key, count) \
             SELECT * FROM unnest($1::text[], $2::bigint[]) \
             ON CONFLICT (key) DO UPDATE SET count = bench_import_counts.count + EXCLUDED.count",
        )
        .await?;
    let lines: Vec<&[u8]> = buf.split_inclusive(|&b| b == b'\n').collect();
    let (mut counted, mut retried) = (0u64, 0u32);
    for (n, file) in lines.chunks(BATCH_LINES).enumerate() {
        let name = format!("bench:{index}:{n}");
        let (keys, counts) = file_counts(file);
        let mut tries = 0;
        loop {
            let tx = client.transaction().await?;
            let result = async {
                tx.execute(&processed, &[&name]).await?;
                tx.execute(&upsert, &[&keys, &counts]).await?;
                tx.commit().await
            }
            .await;
            match result {
                Ok(()) => break,
                Err(e) if tries < PEER_RETRIES && retryable(&e) => {
                    tries += 1;
                    retried += 1;
                }
                Err(e) => return Err(e.into()),
            }
        }
        counted += file.len() as u64;
    }
    Ok((counted, retried))
}

fn retryable(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    matches!(
        e.code(),
        Some(&SqlState::T_R_DEADLOCK_DETECTED | &SqlState::T_R_SERIALIZATION_FAILURE)
    )
}

impl BenchEnv {
    /// The peer row: the same events as `tallyd-import-batched`, imported as crates.io imports
    /// its CDN logs, one transaction per file of `BATCH_LINES` events, from as many sessions as
    /// the batched row has clients; events/s to the last commit.
    pub(crate) async fn crates_io_importer(&self, load: &Load) -> Result<Outcome> {
        let admin = self.db.connect().await?;
        admin
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS bench_import_processed (name text PRIMARY KEY);
                 CREATE TABLE IF NOT EXISTS bench_import_counts (key text PRIMARY KEY,
                     count bigint NOT NULL);
                 TRUNCATE bench_import_processed, bench_import_counts;",
            )
            .await?;
        let mut clients = Vec::with_capacity(load.buffers.len());
        for _ in &load.buffers {
            clients.push(self.db.connect().await?);
        }
        let server_before = self.server_cpu()?;
        let started = Instant::now();
        let tasks: Vec<_> = clients
            .into_iter()
            .zip(load.buffers.iter().cloned())
            .enumerate()
            .map(|(i, (c, buf))| tokio::spawn(peer_client(c, i, buf)))
            .collect();
        let (mut counted, mut retried) = (0, 0);
        for t in tasks {
            let (n, r) = t.await??;
            counted += n;
            retried += r;
        }
        let elapsed = started.elapsed();
        let server_cpu = self.server_cpu()? - server_before;
        let row = admin
            .query_one(
                "SELECT (SELECT coalesce(sum(count), 0)::bigint FROM bench_import_counts), \
                        (SELECT count(*) FROM bench_import_counts), \
                        (SELECT count(*) FROM bench_import_processed)",
                &[],
            )
            .await?;
        let (sum, keys, files): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        ensure!(
            counted == load.events && sum as u64 == load.events && keys as u64 == load.keys,
            "{PEER}: sent {} events over {} keys, {counted} counted, the table sums to {sum} over {keys} keys",
            load.events,
            load.keys
        );
        let note = format!(
            "exact: {} events, {} keys, {files} files of {BATCH_LINES} events, one transaction \
             each (name into `processed`, counts upserted), {} sessions; {retried} tried again; \
             server CPU {server_cpu:.1} s = {:.2} s/M events",
            load.events,
            load.keys,
            load.buffers.len(),
            server_cpu * 1e6 / load.events as f64
        );
        Ok(Outcome::baseline(PEER, load.events, "event", elapsed).with_note(note))
    }

    /// The same events unbatched (as `tallyd-hc-uniform`), then as batches on a new daemon:
    /// the batched row, with the unbatched figures and the duplicate answer time in its note.
    pub(crate) async fn tallyd_import(&self, name: &'static str, load: Load) -> Result<Outcome> {
        let (events, keys) = (load.events, load.keys);
        let batched: Vec<(Vec<u8>, Vec<Vec<u8>>)> = load
            .buffers
            .iter()
            .enumerate()
            .map(|(i, b)| as_batches(i, b))
            .collect();
        let unbatched = self
            .tallyd("tallyd-import-unbatched", Counting::AllTime, |_| {}, load)
            .await?;
        println!("  (same run, without batches) {}", unbatched.summary());

        let daemon = self.spawn_daemon(name, |_| {}).await?;
        let before = daemon.usage().await?;
        let server_before = self.server_cpu()?;
        let mut streams = Vec::with_capacity(batched.len());
        for _ in &batched {
            streams.push(UnixStream::connect(&daemon.socket).await?);
        }
        let samples: Vec<Vec<u8>> = batched
            .iter()
            .filter_map(|(_, b)| b.first().cloned())
            .collect();
        let started = Instant::now();
        let tasks: Vec<_> = streams
            .into_iter()
            .zip(batched)
            .map(|(s, (buf, b))| tokio::spawn(client(s, buf, b.len())))
            .collect();
        let mut counted = 0;
        for t in tasks {
            counted += t.await??;
        }
        let elapsed = started.elapsed();
        let after = daemon.usage().await?;
        let server_cpu = self.server_cpu()? - server_before;
        let peak_kib = daemon.status_kib("VmHWM")?;
        ensure!(
            counted == events,
            "{name}: sent {events} events in batches, {counted} counted"
        );
        self.check_totals(name, events, keys).await?;
        let mut dup = Vec::with_capacity(DUPLICATES);
        for i in 0..DUPLICATES {
            dup.push(duplicate_answer(&daemon.socket, &samples[i % samples.len()]).await?);
        }
        dup.sort();
        self.check_totals(name, events, keys).await?;
        daemon.stop().await?;
        let rows = after.rows - before.rows;
        let rate = events as f64 / elapsed.as_secs_f64();
        let ratio = rate / unbatched.rate().unwrap_or(f64::NAN);
        let mut note = format!(
            "exact: {events} events, {keys} keys, in batches of {BATCH_LINES} with ids; {:.0}% of the \
             same events unbatched in this run ({:.0} events/s); a batch of {BATCH_LINES} sent again \
             answered `duplicate` in {:.1} ms (median of {DUPLICATES}, max {:.1} ms), nothing counted",
            ratio * 100.0,
            unbatched.rate().unwrap_or(f64::NAN),
            dup[DUPLICATES / 2].as_secs_f64() * 1e3,
            dup[DUPLICATES - 1].as_secs_f64() * 1e3,
        );
        let _ = write!(note, "; {}", server_cpu_note(server_cpu, rows));
        Ok(Outcome::daemon(
            name,
            events,
            elapsed,
            DaemonStats {
                ingest: elapsed,
                flow: Some(Flow::between(&before, &after)),
                peak_rss_mib: peak_kib as f64 / 1024.0,
                bytes_per_key: None,
            },
            note,
        ))
    }
}
