//! The loss measurement, for the `redis-daily` peer and for tallyd alike: the server is killed
//! with SIGKILL mid-run, once every client's first half was acknowledged and while the clients
//! go on sending their second half. An acknowledgement is Redis's reply to each `HINCRBY` (the
//! event is in Redis's memory), and tallyd's `ok` to `!sync` (the connection's earlier lines are
//! fsynced in its journal). The server is then started again and its writer finishes (Redis:
//! the mover's last move; tallyd: the journal's replay and the final flush of a clean stop).
//! The first half's keys are `k<n>` and the second half's `a<n>`, so the table tells them
//! apart: whatever the first half is missing was lost after being acknowledged.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};

use crate::daemon::{Counting, Daemon};
use crate::env::{BenchArgs, BenchEnv, COUNTER};
use crate::load::{spread_load, KeyDist};
use crate::mover::{Mover, OnRedisError};
use crate::per_event::run_clients;
use crate::redis::{Conn, RedisServer};
use crate::redis_daily::{pipeline, AFTER, BATCH};
use crate::report::{thousands, Outcome};

/// How long the clients take to send the acknowledged half: long enough for the mover to have
/// run a few times (every second) before the kill, so what Redis loses is what a crash between
/// two moves loses, not everything.
const ACKED_OVER: Duration = Duration::from_millis(2_500);

/// Each client's two halves: `first` is acknowledged before the kill, `second` is in flight.
struct KillLoad {
    first: Vec<Vec<u8>>,
    second: Vec<Vec<u8>>,
    sent: Sent,
}

/// What the two halves hold.
struct Sent {
    acked: u64,
    acked_keys: u64,
    after: u64,
}

/// `events` events over `keys` uniform keys, half acknowledged (`k<n>`), half after (`a<n>`).
fn kill_load(events: u64, keys: u64, clients: usize) -> KillLoad {
    let first = spread_load(events / 2, keys, clients, KeyDist::Uniform);
    let mut second = spread_load(events - events / 2, keys, clients, KeyDist::Uniform);
    for buf in &mut second.buffers {
        relabel(buf);
    }
    KillLoad {
        first: first.buffers,
        second: second.buffers,
        sent: Sent {
            acked: first.events,
            acked_keys: first.keys,
            after: second.events,
        },
    }
}

/// `bench k<n>` lines to `bench a<n>`, in place.
fn relabel(buf: &mut [u8]) {
    let key_at = COUNTER.len() + 1;
    let mut start = 0;
    while start + key_at < buf.len() {
        buf[start + key_at] = b'a';
        start = memchr::memchr(b'\n', &buf[start..]).map_or(buf.len(), |i| start + i + 1);
    }
}

/// When the clients started and when the last one to be acknowledged killed the server.
struct Killed {
    started: Instant,
    at: Instant,
}

/// A client's way of sending: a chunk of up to `BATCH` lines, and the wait for the
/// acknowledgement of everything sent so far.
struct Sending<C> {
    chunk: fn(&mut C, &[u8]) -> Result<()>,
    acknowledged: fn(&mut C) -> Result<()>,
}

/// Sends `lines` in chunks of `BATCH` lines through `chunk`, paced at `per_second` lines.
fn paced<C>(
    conn: &mut C,
    lines: &[u8],
    per_second: f64,
    chunk: fn(&mut C, &[u8]) -> Result<()>,
) -> Result<()> {
    let start = Instant::now();
    let mut rest = lines;
    let mut sent = 0usize;
    while !rest.is_empty() {
        let due = start + Duration::from_secs_f64(sent as f64 / per_second);
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        let end = memchr::memchr_iter(b'\n', rest)
            .nth(BATCH - 1)
            .map_or(rest.len(), |i| i + 1);
        chunk(conn, &rest[..end])?;
        rest = &rest[end..];
        sent += BATCH;
    }
    Ok(())
}

/// One thread per connection: each sends its first half, paced over `ACKED_OVER`, and waits
/// for its acknowledgement; the last one acknowledged sends SIGKILL to `pid` (the caller's
/// child, not yet reaped, so the pid is still its own); each then sends its second half at the
/// same pace until the connection fails.
fn run_killed<C: Send + 'static>(
    conns: Vec<C>,
    (first, second): (Vec<Vec<u8>>, Vec<Vec<u8>>),
    pid: u32,
    how: Sending<C>,
) -> Result<Killed> {
    let clients = conns.len();
    let conns = Mutex::new(conns.into_iter().map(Some).collect::<Vec<_>>());
    let synced = AtomicUsize::new(0);
    let killed = Arc::new(OnceLock::new());
    let killed_at = killed.clone();
    let (started, _) = run_clients(clients, move |i, start| {
        let mut conn = conns.lock().expect("connections")[i]
            .take()
            .expect("one client per connection");
        let lines = memchr::memchr_iter(b'\n', &first[i]).count();
        let per_second = lines as f64 / ACKED_OVER.as_secs_f64();
        start.wait();
        paced(&mut conn, &first[i], per_second, how.chunk)?;
        (how.acknowledged)(&mut conn)?;
        if synced.fetch_add(1, Ordering::SeqCst) + 1 == clients {
            // Set first: every failure from here on is the kill's.
            let _ = killed.set(Instant::now());
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        match paced(&mut conn, &second[i], per_second, how.chunk) {
            Err(_) if killed.get().is_some() => Ok(()),
            other => other,
        }
    })?;
    let at = *killed_at.get().context("the server was never killed")?;
    Ok(Killed { started, at })
}

/// What the table held after the restart: the acknowledged half's events and keys, and the
/// second half's events.
struct Kept {
    acked: u64,
    acked_keys: u64,
    after: u64,
}

/// The row: acknowledged events, how many were lost; an error if any was counted twice.
fn loss(
    name: &'static str,
    load: &Sent,
    kept: Kept,
    killed: &Killed,
    acknowledged: &str,
    table: &str,
) -> Result<Outcome> {
    ensure!(
        kept.acked <= load.acked && kept.after <= load.after,
        "{name}: NOT EXACT: {table} holds {} of the {} acknowledged events and {} of the {} sent \
         after them: counted twice",
        kept.acked,
        load.acked,
        kept.after,
        load.after
    );
    let lost = load.acked - kept.acked;
    ensure!(
        lost > 0 || kept.acked_keys == load.acked_keys,
        "{name}: NOT EXACT: the acknowledged events add up but cover {} keys, not {}",
        kept.acked_keys,
        load.acked_keys
    );
    let note = format!(
        "kill -9 {:.2} s in, {} events acknowledged ({acknowledged}): {} of them in {table} \
         after the restart, {} lost; of the unacknowledged second half (up to {}, cut short by \
         the kill), {} kept",
        (killed.at - killed.started).as_secs_f64(),
        thousands(load.acked as f64),
        thousands(kept.acked as f64),
        thousands(lost as f64),
        thousands(load.after as f64),
        thousands(kept.after as f64),
    );
    Ok(Outcome::loss(name, load.acked, lost, note))
}

impl BenchEnv {
    /// `redis-daily-kill-9`: Redis (`bin`, a redis-server) killed under the clients, started again (empty: no AOF), the
    /// mover's last move, then what `version_downloads` holds.
    pub(crate) async fn redis_daily_kill(
        &self,
        name: &'static str,
        bin: PathBuf,
        args: &BenchArgs,
    ) -> Result<Outcome> {
        let dir = self.root.path.join(name);
        let redis = {
            let (bin, dir) = (bin.clone(), dir.clone());
            tokio::task::spawn_blocking(move || RedisServer::start(&bin, &dir)).await??
        };
        self.reset_version_downloads().await?;
        let mover = Mover::start(
            redis.socket.clone(),
            self.conninfo.clone(),
            OnRedisError::Retry,
        )
        .await?;
        let load = self.kill_load(args).await?;
        let conns = (0..args.clients)
            .map(|_| Conn::connect(&redis.socket))
            .collect::<Result<Vec<_>>>()?;
        let pid = redis.pid();
        let how = Sending {
            chunk: |c: &mut Conn, b: &[u8]| pipeline(c, b).map(drop),
            // Every HINCRBY was acknowledged by its reply, read before the next chunk.
            acknowledged: |_| Ok(()),
        };
        let halves = (load.first, load.second);
        let killed =
            tokio::task::spawn_blocking(move || run_killed(conns, halves, pid, how)).await??;
        // Dropping reaps it (killed already).
        drop(redis);
        let redis = tokio::task::spawn_blocking(move || RedisServer::start(&bin, &dir)).await??;
        let mover = mover.stop().await?;
        drop(redis);
        let kept = self.kept_version_downloads().await?;
        let how = format!(
            "every HINCRBY's reply read; mover runs failed while Redis was down: {}",
            mover.redis_failures
        );
        loss(name, &load.sent, kept, &killed, &how, "version_downloads")
    }

    /// `tallyd-kill-9`: tallyd (journal on, its defaults) killed under the clients, started
    /// again on its data_dir (the journal replayed), stopped cleanly (a final flush), then what
    /// `tallyd.totals` holds; `tallyd-day-kill-9` the same counting per day, then what
    /// `tallyd.window_totals` holds.
    pub(crate) async fn tallyd_kill(
        &self,
        name: &'static str,
        counting: Counting,
        args: &BenchArgs,
    ) -> Result<Outcome> {
        let (daemon, config, port) = self
            .spawn_daemon_keep(name, |c| counting.configure(c))
            .await?;
        let load = self.kill_load(args).await?;
        let conns = (0..args.clients)
            .map(|_| {
                UnixStream::connect(&daemon.socket)
                    .with_context(|| format!("connecting to {}", daemon.socket.display()))
            })
            .collect::<Result<Vec<_>>>()?;
        let pid = daemon.pid();
        let how = Sending {
            chunk: |s: &mut UnixStream, b: &[u8]| Ok(s.write_all(b)?),
            acknowledged: sync,
        };
        let halves = (load.first, load.second);
        let killed =
            tokio::task::spawn_blocking(move || run_killed(conns, halves, pid, how)).await??;
        daemon.kill().await;
        let restarted = Daemon::spawn(&self.tallyd, &config, port).await?;
        restarted.stop().await?;
        let (kept, view) = self.kept_totals(counting).await?;
        loss(
            name,
            &load.sent,
            kept,
            &killed,
            "`!sync` answered ok on every connection",
            view,
        )
    }

    async fn kill_load(&self, args: &BenchArgs) -> Result<KillLoad> {
        let (events, keys, clients) = (args.events, args.hc_keys, args.clients);
        Ok(tokio::task::spawn_blocking(move || kill_load(events, keys, clients)).await?)
    }

    async fn kept_version_downloads(&self) -> Result<Kept> {
        let client = self.db.connect().await?;
        let row = client
            .query_one(
                "SELECT coalesce(sum(downloads) FILTER (WHERE version_id < $1), 0)::bigint,
                        count(DISTINCT version_id) FILTER (WHERE version_id < $1),
                        coalesce(sum(downloads) FILTER (WHERE version_id >= $1), 0)::bigint
                 FROM version_downloads",
                &[&(AFTER as i64)],
            )
            .await?;
        Ok(kept(&row))
    }

    /// What the counter holds (summed over its days, counting per day), and where it was read.
    async fn kept_totals(&self, counting: Counting) -> Result<(Kept, &'static str)> {
        let (view, days) = match counting {
            Counting::AllTime => ("tallyd.totals", ""),
            Counting::PerDay => ("tallyd.window_totals", " AND span = 'day'"),
        };
        let client = self.db.connect().await?;
        let row = client
            .query_one(
                &format!(
                    "SELECT coalesce(sum(count) FILTER (WHERE key LIKE 'k%'), 0)::bigint,
                            count(DISTINCT key) FILTER (WHERE key LIKE 'k%'),
                            coalesce(sum(count) FILTER (WHERE key LIKE 'a%'), 0)::bigint
                     FROM {view} WHERE counter = $1{days}"
                ),
                &[&COUNTER],
            )
            .await?;
        Ok((kept(&row), view))
    }
}

fn kept(row: &tokio_postgres::Row) -> Kept {
    Kept {
        acked: row.get::<_, i64>(0) as u64,
        acked_keys: row.get::<_, i64>(1) as u64,
        after: row.get::<_, i64>(2) as u64,
    }
}

/// `!sync`, and waits for its `ok`: every line sent before is in the journal.
fn sync(stream: &mut UnixStream) -> Result<()> {
    stream.write_all(b"!sync\n")?;
    let mut reply = String::new();
    BufReader::new(&*stream).read_line(&mut reply)?;
    ensure!(reply == "ok\n", "tallyd answered {reply:?} to !sync");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_second_half_has_its_own_keys() {
        let mut buf = b"bench k1\nbench k22\nbench k3\n".to_vec();
        relabel(&mut buf);
        assert_eq!(buf, b"bench a1\nbench a22\nbench a3\n");
        let load = kill_load(101, 10, 3);
        assert_eq!((load.sent.acked, load.sent.after), (50, 51));
        assert!(load.second.concat().starts_with(b"bench a"));
        assert!(!load.second.concat().windows(2).any(|w| w == b" k"));
    }
}
