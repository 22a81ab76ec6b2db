//! The batched import (`tallyd-import-batched`): the `tallyd-hc-uniform` load sent as batches
//! of `BATCH_LINES` events under ids (`!batch` ... `!commit`, each answered once durable and
//! claimed), beside the same events sent without batches in the same run, and the time to
//! answer a batch sent again (`duplicate`).

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

impl BenchEnv {
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
