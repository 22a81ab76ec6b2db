//! The `redis-daily` peer: what GitLab (`Gitlab::Counters::BufferedCounter`) and Discourse do
//! today to count per day without a row lock per event. The same `--clients` client threads,
//! with the same pre-built loads as the tallyd rows, each pipeline
//! `HINCRBY downloads:<YYYY-MM-DD> <version_id> 1` to a private redis-server (redis.rs) over
//! its Unix socket, `BATCH` commands per round trip; the mover (mover.rs) moves the day's hash
//! into `version_downloads` every second. Timed from the first byte to the moment the table
//! sums to what was sent (daily.rs), with the clients' end asking the mover to move at once,
//! as tallyd's clients end with `!flush`.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Instant, SystemTime};

use anyhow::{bail, Context, Result};

use crate::daily::utc_day;
use crate::env::{BenchEnv, COUNTER, HOT};
use crate::load::Load;
use crate::mover::{day_key, Mover, OnRedisError};
use crate::per_event::run_clients;
use crate::redis::{Conn, RedisServer};
use crate::report::{server_cpu_note, thousands, DaemonStats, Flow, Outcome};
use crate::resp::{push_hincrby, read_ints};

/// Commands per round trip: about 64 KiB of `HINCRBY`s, the size of the tallyd clients' writes.
pub(crate) const BATCH: usize = 1_000;
/// Added to the version id of a key `a<n>` (the loss measurement's unacknowledged half), so
/// those rows are told apart from the acknowledged half's `k<n>` in the same table.
pub(crate) const AFTER: u64 = 1 << 40;
/// The version the hot key `hot` counts for.
const HOT_VERSION: u64 = 0;

/// Why a `redis-*` row did not run.
pub(crate) const NO_REDIS: &str =
    "skipped: redis-server not found (set REDIS_SERVER, or run scripts/ensure-redis)";

/// The version a load line counts for: `bench k<n>` is version n, `bench a<n>` version
/// `AFTER` + n, `bench hot` version 0.
fn version_of(line: &[u8]) -> Result<u64> {
    let key = line
        .strip_prefix(COUNTER.as_bytes())
        .and_then(|l| l.strip_prefix(b" "))
        .with_context(|| format!("not a load line: {:?}", String::from_utf8_lossy(line)))?;
    if key == HOT.as_bytes() {
        return Ok(HOT_VERSION);
    }
    let (offset, digits) = match key.split_first() {
        Some((b'k', digits)) => (0, digits),
        Some((b'a', digits)) => (AFTER, digits),
        _ => bail!("not a load key: {:?}", String::from_utf8_lossy(key)),
    };
    let n: u64 = std::str::from_utf8(digits)
        .ok()
        .and_then(|d| d.parse().ok())
        .with_context(|| format!("not a load key: {:?}", String::from_utf8_lossy(key)))?;
    Ok(offset + n)
}

/// Sends the events of `lines` (load lines, one per event) as `HINCRBY`s into today's hash,
/// `BATCH` per round trip: each batch is written whole, then all its replies are read. The
/// batch's commands are built from the lines just before it is written (the day can change
/// between batches). Returns the events acknowledged (every one, or an error).
pub(crate) fn pipeline(conn: &mut Conn, lines: &[u8]) -> Result<u64> {
    let mut out = Vec::with_capacity(BATCH * 64);
    let mut scratch = Vec::new();
    let mut acked = 0u64;
    let mut rest = lines;
    while !rest.is_empty() {
        let key = day_key(&utc_day(SystemTime::now(), 0));
        out.clear();
        let mut n = 0;
        while n < BATCH && !rest.is_empty() {
            let end = memchr::memchr(b'\n', rest).unwrap_or(rest.len());
            push_hincrby(&mut out, key.as_bytes(), version_of(&rest[..end])?);
            rest = rest.get(end + 1..).unwrap_or_default();
            n += 1;
        }
        std::io::Write::write_all(&mut conn.writer, &out)?;
        read_ints(&mut conn.reader, n, &mut scratch)?;
        acked += n as u64;
    }
    Ok(acked)
}

impl BenchEnv {
    /// The throughput row: `load` through Redis (`bin`, a redis-server) and the mover into
    /// `version_downloads`.
    pub(crate) async fn redis_daily(
        &self,
        name: &'static str,
        bin: PathBuf,
        load: Load,
    ) -> Result<Outcome> {
        let dir = self.root.path.join(name);
        let redis = tokio::task::spawn_blocking(move || RedisServer::start(&bin, &dir)).await??;
        self.reset_version_downloads().await?;
        let socket = redis.socket.clone();
        let mover = Mover::start(socket.clone(), self.conninfo.clone(), OnRedisError::Fail).await?;
        let (events, keys, clients) = (load.events, load.keys, load.buffers.len());
        let redis_before = redis.cpu_seconds()?;
        let server_before = self.server_cpu()?;
        let (started, acked) =
            tokio::task::spawn_blocking(move || send(socket, load.buffers, pipeline)).await??;
        let ingested = acked.iter().map(|&(at, _)| at).max().unwrap_or(started);
        let sent: u64 = acked.iter().map(|&(_, n)| n).sum();
        if sent != events {
            bail!("{name}: {sent} of {events} events acknowledged");
        }
        // How busy Redis was while the clients sent: near 100%, it set the pace, not they.
        let busy = (redis.cpu_seconds()? - redis_before) / (ingested - started).as_secs_f64();
        mover.move_now();
        let committed = match self
            .wait_version_downloads(name, events, || mover.alive())
            .await
        {
            Ok(at) => at,
            Err(err) => {
                return Err(match mover.stop().await {
                    Err(why) => why.context(format!("{name}: {err:#}")),
                    Ok(_) => err,
                })
            }
        };
        let redis_cpu = redis.cpu_seconds()? - redis_before;
        let server_cpu = self.server_cpu()? - server_before;
        let peak_rss_mib = redis.peak_rss_mib()?;
        let mover = mover.stop().await?;
        self.check_version_downloads(name, events, keys).await?;
        drop(redis);
        let rows = mover.rows as f64;
        let note = format!(
            "exact: {events} events, {keys} version{}, {clients} clients, {BATCH} commands per \
             round trip; redis-server busy {:.0}% while they sent; moves with rows: {}; CPU s: \
             redis-server {redis_cpu:.2}, mover {:.2}; {}",
            if keys == 1 { "" } else { "s" },
            busy * 100.0,
            thousands(mover.moves as f64),
            mover.cpu_s,
            server_cpu_note(server_cpu, rows)
        );
        let stats = DaemonStats {
            ingest: ingested - started,
            flow: Some(Flow::written(rows, redis_cpu + mover.cpu_s)),
            peak_rss_mib,
            bytes_per_key: None,
        };
        Ok(Outcome::daemon(
            name,
            events,
            committed - started,
            stats,
            note,
        ))
    }
}

/// One client thread per buffer, each on its own connection (connected before the clock
/// starts), sending its buffer through `pipeline` (this peer's, or the `redis-pfadd` one's);
/// returns when the first byte went out and, per client, when its last reply came and how many
/// events were acknowledged.
pub(crate) fn send(
    socket: PathBuf,
    buffers: Vec<Vec<u8>>,
    pipeline: fn(&mut Conn, &[u8]) -> Result<u64>,
) -> Result<(Instant, Vec<(Instant, u64)>)> {
    let clients = buffers.len();
    let conns = (0..clients)
        .map(|_| Conn::connect(&socket).map(Some))
        .collect::<Result<Vec<_>>>()?;
    let conns = Mutex::new(conns);
    run_clients(clients, move |i, start| {
        let mut conn = conns.lock().expect("connections")[i]
            .take()
            .expect("one client per connection");
        start.wait();
        let acked = pipeline(&mut conn, &buffers[i])?;
        Ok((Instant::now(), acked))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_lines_map_to_versions() {
        assert_eq!(version_of(b"bench k42").unwrap(), 42);
        assert_eq!(version_of(b"bench a42").unwrap(), AFTER + 42);
        assert_eq!(version_of(b"bench hot").unwrap(), HOT_VERSION);
        assert!(version_of(b"bench x1").is_err());
        assert!(version_of(b"other k1").is_err());
        assert!(version_of(b"bench k").is_err());
    }
}
