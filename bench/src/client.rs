//! Clients: stream connections sending the pre-built buffers, then `!ping` and `!flush`, timed
//! from the first byte to the last answer.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// Bytes per client write: whole lines, up to this many.
const WRITE_BYTES: usize = 64 * 1024;

pub(crate) struct Sent {
    /// First byte to the last `pong`: every byte read and handed to the buckets.
    pub(crate) ingest: Duration,
    /// First byte to the last `!flush` answer (equal to `ingest` without `!flush`).
    pub(crate) elapsed: Duration,
    /// The `!flush` answers.
    pub(crate) replies: Vec<String>,
}

/// Connects one client per buffer, then, timed from the first byte: each writes its buffer in
/// line-aligned writes of up to 64 KiB, then `!ping` (ingested once answered), then, with
/// `flush`, `!flush` (committed once answered).
pub(crate) async fn send(socket: &Path, buffers: Vec<Vec<u8>>, flush: bool) -> Result<Sent> {
    let mut streams = Vec::with_capacity(buffers.len());
    for _ in &buffers {
        streams.push(UnixStream::connect(socket).await?);
    }
    let started = Instant::now();
    let tasks: Vec<_> = streams
        .into_iter()
        .zip(buffers)
        .map(|(stream, buf)| tokio::spawn(client(stream, buf, flush)))
        .collect();
    let mut ingested = started;
    let mut replies = Vec::with_capacity(tasks.len());
    for task in tasks {
        let (pong_at, reply) = task.await??;
        ingested = ingested.max(pong_at);
        replies.extend(reply);
    }
    Ok(Sent {
        ingest: ingested - started,
        elapsed: started.elapsed(),
        replies,
    })
}

/// When `!ping` was answered, and the answer to `!flush` if sent.
async fn client(
    stream: UnixStream,
    buf: Vec<u8>,
    flush: bool,
) -> Result<(Instant, Option<String>)> {
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::new(rd);
    let mut rest = &buf[..];
    while !rest.is_empty() {
        let end = if rest.len() <= WRITE_BYTES {
            rest.len()
        } else {
            memchr::memrchr(b'\n', &rest[..WRITE_BYTES]).map_or(WRITE_BYTES, |i| i + 1)
        };
        wr.write_all(&rest[..end]).await?;
        rest = &rest[end..];
    }
    wr.write_all(b"!ping\n").await?;
    let pong = read_reply(&mut rd).await?;
    let pong_at = Instant::now();
    ensure!(pong == "pong", "unexpected reply to !ping: {pong:?}");
    if !flush {
        return Ok((pong_at, None));
    }
    wr.write_all(b"!flush\n").await?;
    Ok((pong_at, Some(read_reply(&mut rd).await?)))
}

async fn read_reply(rd: &mut BufReader<tokio::net::unix::OwnedReadHalf>) -> Result<String> {
    let mut line = String::new();
    rd.read_line(&mut line).await?;
    ensure!(!line.is_empty(), "tallyd closed the connection");
    Ok(line.trim_end().to_string())
}

/// Sum of `ok <accepted> <rejected>` replies; any rejection is an error.
pub(crate) fn flush_replies(replies: &[String]) -> Result<u64> {
    let mut accepted = 0;
    for reply in replies {
        let f: Vec<&str> = reply.split(' ').collect();
        match f.as_slice() {
            ["ok", a, "0"] => accepted += a.parse::<u64>()?,
            _ => bail!("unexpected reply to !flush: {reply:?}"),
        }
    }
    Ok(accepted)
}
