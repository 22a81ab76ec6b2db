//! The `redis-pfadd` peer: what applications do today to count distinct values (Mastodon's
//! per-day `PFADD` keys): the same `--clients` client threads, with the same pre-built loads as
//! the `tallyd-unique` rows, each pipelining `PFADD <key> <value>` to a private redis-server
//! (redis.rs) over its Unix socket, `BATCH` commands per round trip. Redis has nothing to
//! commit, so the row is timed from the first byte to the last reply; afterwards `PFCOUNT` of
//! every key must come near the distinct values sent.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};

use crate::env::{BenchEnv, UNIQUE_COUNTER};
use crate::load::UniqueLoad;
use crate::redis::{Conn, RedisServer};
use crate::redis_daily::{send, BATCH};
use crate::report::{DaemonStats, Flow, Outcome};
use crate::resp::{push_command, read_ints, read_reply, Reply};
use crate::unique::{judge_cardinality, standard_error};

/// Redis's HyperLogLog precision: 2^14 registers (`HLL_P`), 0.81% standard error.
const REDIS_LOG2M: u32 = 14;

/// The key and the value of a load line `visitors <key> <value>`.
fn key_value(line: &[u8]) -> Result<(&[u8], &[u8])> {
    let not_a_line = || {
        format!(
            "not a unique load line: {:?}",
            String::from_utf8_lossy(line)
        )
    };
    let rest = line
        .strip_prefix(UNIQUE_COUNTER.as_bytes())
        .and_then(|l| l.strip_prefix(b" "))
        .with_context(not_a_line)?;
    let space = memchr::memchr(b' ', rest).with_context(not_a_line)?;
    let (key, value) = (&rest[..space], &rest[space + 1..]);
    ensure!(!key.is_empty() && !value.is_empty(), not_a_line());
    Ok((key, value))
}

/// Sends the events of `lines` (unique load lines, one per event) as `PFADD <key> <value>`,
/// `BATCH` per round trip: each batch is written whole, then all its replies are read. Returns
/// the events acknowledged (every one, or an error).
fn pipeline(conn: &mut Conn, lines: &[u8]) -> Result<u64> {
    let mut out = Vec::with_capacity(BATCH * 48);
    let mut scratch = Vec::new();
    let mut acked = 0u64;
    let mut rest = lines;
    while !rest.is_empty() {
        out.clear();
        let mut n = 0;
        while n < BATCH && !rest.is_empty() {
            let end = memchr::memchr(b'\n', rest).unwrap_or(rest.len());
            let (key, value) = key_value(&rest[..end])?;
            push_command(&mut out, &[b"PFADD", key, value]);
            rest = rest.get(end + 1..).unwrap_or_default();
            n += 1;
        }
        conn.writer.write_all(&out)?;
        read_ints(&mut conn.reader, n, &mut scratch)?;
        acked += n as u64;
    }
    Ok(acked)
}

/// Every key the server holds, and their `PFCOUNT`s summed (pipelined, `BATCH` a round trip).
fn count_all(socket: &Path) -> Result<(u64, u64)> {
    let mut conn = Conn::connect(socket)?;
    let keys = match conn.command(&[b"KEYS", b"*"])? {
        Reply::Array(Some(keys)) => keys,
        other => bail!("KEYS * answered {other:?}"),
    };
    let mut sum = 0u64;
    let mut out = Vec::with_capacity(BATCH * 32);
    for batch in keys.chunks(BATCH) {
        out.clear();
        for key in batch {
            let Reply::Bulk(Some(key)) = key else {
                bail!("KEYS * answered {key:?} among the keys");
            };
            push_command(&mut out, &[b"PFCOUNT", key]);
        }
        conn.writer.write_all(&out)?;
        for _ in batch {
            match read_reply(&mut conn.reader)? {
                Reply::Int(n) if n >= 0 => sum += n as u64,
                other => bail!("PFCOUNT answered {other:?}"),
            }
        }
    }
    Ok((keys.len() as u64, sum))
}

impl BenchEnv {
    /// The throughput row: `load` through `PFADD`s into Redis (`bin`, a redis-server started for
    /// this row), then the check of every key's `PFCOUNT`.
    pub(crate) async fn redis_pfadd(
        &self,
        name: &'static str,
        bin: PathBuf,
        load: UniqueLoad,
    ) -> Result<Outcome> {
        let dir = self.root.path.join(name);
        let redis = tokio::task::spawn_blocking(move || RedisServer::start(&bin, &dir)).await??;
        let (distinct, max_per_key) = (load.distinct, load.max_per_key);
        let load = load.load;
        let (events, keys, clients) = (load.events, load.keys, load.buffers.len());
        let socket = redis.socket.clone();
        let redis_before = redis.cpu_seconds()?;
        let (started, acked) =
            tokio::task::spawn_blocking(move || send(socket, load.buffers, pipeline)).await??;
        let replied = acked.iter().map(|&(at, _)| at).max().unwrap_or(started);
        let sent: u64 = acked.iter().map(|&(_, n)| n).sum();
        ensure!(
            sent == events,
            "{name}: {sent} of {events} events acknowledged"
        );
        let elapsed = replied - started;
        let redis_cpu = redis.cpu_seconds()? - redis_before;
        let peak_rss_mib = redis.peak_rss_mib()?;
        let socket = redis.socket.clone();
        let (stored_keys, counted) =
            tokio::task::spawn_blocking(move || count_all(&socket)).await??;
        drop(redis);
        ensure!(
            stored_keys == keys,
            "{name}: sent {events} events on {keys} keys, redis-server holds {stored_keys} keys"
        );
        // Redis's sparse sketches are estimates too (no explicit set): never held to exact.
        let judged = judge_cardinality(
            counted,
            distinct,
            max_per_key,
            0,
            standard_error(REDIS_LOG2M),
        )
        .or_else(|why| bail!("{name}: PFCOUNT off: {why}"))?;
        let note = format!(
            "{events} events, {keys} key{} acknowledged, {clients} clients, {BATCH} commands per \
             round trip; PFCOUNT {judged}; redis-server busy {:.0}% while they sent, CPU {:.2} s; \
             nothing committed (no AOF, no snapshots)",
            if keys == 1 { "" } else { "s" },
            redis_cpu / elapsed.as_secs_f64() * 100.0,
            redis_cpu
        );
        let stats = DaemonStats {
            ingest: elapsed,
            flow: Some(Flow::cpu_only(redis_cpu)),
            peak_rss_mib,
            bytes_per_key: None,
        };
        Ok(Outcome::daemon(name, events, elapsed, stats, note))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_lines_split_into_key_and_value() {
        assert_eq!(
            key_value(b"visitors hot v42").unwrap(),
            (&b"hot"[..], &b"v42"[..])
        );
        assert_eq!(
            key_value(b"visitors k7 v21").unwrap(),
            (&b"k7"[..], &b"v21"[..])
        );
        assert!(key_value(b"visitors hot").is_err());
        assert!(key_value(b"bench hot v1").is_err());
        assert!(key_value(b"visitors  v1").is_err());
    }
}
