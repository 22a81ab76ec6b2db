//! The per-event scenarios: `--event-clients` threads each sending one event per syscall (one
//! `send` per datagram, or one `write` per line on its own stream connection), to tallyd and, in
//! the same run, to a receiver in this process that only reads and counts newlines: the
//! transport's ceiling on this machine, which tallyd's ingest rate is compared to.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure, Context, Result};

use tallyd::metrics as m;
use tallyd_testkit::Samples;

use crate::bench::{BenchEnv, Scenario, COUNTER};
use crate::client::flush_replies;
use crate::report::{check, find, thousands, DaemonStats, Flow, Outcome};
use crate::scrape::{scrape, Usage};

/// Keys the events cycle through (`k0` to `k999`): coalescing has little to do, as for an
/// application's many counters, and the flush stays small beside the reading.
const KEYS: u64 = 1_000;
/// How long the ceiling's receiver waits for a byte before it gives up.
const RECEIVER_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the datagram scenario waits for its events to be read, then committed.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(120);
const READ_BYTES: usize = 64 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transport {
    Datagram,
    Stream,
}

/// The ceiling measured beside each per-event scenario, run just before it.
pub(crate) fn ceiling_of(s: Scenario) -> Option<Scenario> {
    match s {
        Scenario::EventDgram => Some(Scenario::CeilingEventDgram),
        Scenario::EventStream => Some(Scenario::CeilingEventStream),
        _ => None,
    }
}

/// `picked` with each per-event scenario's ceiling before it (a ratio needs both in one run).
pub(crate) fn with_ceilings(picked: Vec<Scenario>) -> Vec<Scenario> {
    let mut out = Vec::with_capacity(picked.len() + 2);
    for s in picked {
        if let Some(c) = ceiling_of(s).filter(|c| !out.contains(c)) {
            out.push(c);
        }
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// Client `i`'s lines: `bench k<n>\n`, one per event, cycling through the keys.
fn client_lines(i: usize) -> Vec<Vec<u8>> {
    (0..KEYS)
        .map(|k| format!("{COUNTER} k{}\n", (k + i as u64) % KEYS).into_bytes())
        .collect()
}

/// Events client `i` of `clients` sends, so that they add up to `events`.
fn share(events: u64, clients: usize, i: usize) -> u64 {
    let clients = clients as u64;
    events / clients + u64::from((i as u64) < events % clients)
}

/// Distinct keys `events` events cover.
fn keys_of(events: u64) -> u64 {
    events.min(KEYS)
}

/// Sends client `i`'s share, one event per `send`, on a socket connected to `path`.
fn datagram_client(path: &Path, events: u64, i: usize, start: &Barrier) -> Result<()> {
    let socket = UnixDatagram::unbound()?;
    socket
        .connect(path)
        .with_context(|| format!("connecting to {}", path.display()))?;
    let lines = client_lines(i);
    start.wait();
    for n in 0..events {
        // Blocks while the receiver's queue is full: nothing is dropped on a Unix socket.
        socket.send(&lines[(n % KEYS) as usize])?;
    }
    Ok(())
}

/// What a stream client saw: when `!ping` and `!flush` were answered, and the `!flush` answer.
struct StreamDone {
    pong_at: Option<Instant>,
    flush_reply: Option<String>,
}

/// Writes client `i`'s share, one `write` per line; with `control` (tallyd), then `!ping` and
/// `!flush`, waiting for each answer. Without, it closes the connection.
fn stream_client(
    stream: UnixStream,
    events: u64,
    i: usize,
    control: bool,
    start: &Barrier,
) -> Result<StreamDone> {
    let lines = client_lines(i);
    let mut wr = stream;
    start.wait();
    for n in 0..events {
        wr.write_all(&lines[(n % KEYS) as usize])?;
    }
    if !control {
        return Ok(StreamDone {
            pong_at: None,
            flush_reply: None,
        });
    }
    let mut rd = BufReader::new(wr.try_clone()?);
    let mut answer = |wr: &mut UnixStream, line: &[u8]| -> Result<String> {
        wr.write_all(line)?;
        let mut reply = String::new();
        rd.read_line(&mut reply)?;
        ensure!(!reply.is_empty(), "tallyd closed the connection");
        Ok(reply.trim_end().to_string())
    };
    let pong = answer(&mut wr, b"!ping\n")?;
    let pong_at = Instant::now();
    ensure!(pong == "pong", "unexpected reply to !ping: {pong:?}");
    let flush_reply = answer(&mut wr, b"!flush\n")?;
    Ok(StreamDone {
        pong_at: Some(pong_at),
        flush_reply: Some(flush_reply),
    })
}

/// Runs `clients` client threads started together; returns when the first byte went out and
/// every client's result.
fn run_clients<T: Send + 'static>(
    clients: usize,
    body: impl Fn(usize, &Barrier) -> Result<T> + Send + Sync + 'static,
) -> Result<(Instant, Vec<T>)> {
    let start = Arc::new(Barrier::new(clients + 1));
    let body = Arc::new(body);
    let threads: Vec<JoinHandle<Result<T>>> = (0..clients)
        .map(|i| {
            let (start, body) = (start.clone(), body.clone());
            std::thread::spawn(move || body(i, &start))
        })
        .collect();
    start.wait();
    let started = Instant::now();
    let mut out = Vec::with_capacity(clients);
    for t in threads {
        out.push(
            t.join()
                .map_err(|_| anyhow!("a client thread panicked"))??,
        );
    }
    Ok((started, out))
}

/// Datagram clients sending `events` in all to `path`.
fn send_datagrams(path: PathBuf, events: u64, clients: usize) -> Result<Instant> {
    let (started, _) = run_clients(clients, move |i, start| {
        datagram_client(&path, share(events, clients, i), i, start)
    })?;
    Ok(started)
}

/// Stream clients, each on its own connection (connected before the clock starts).
fn send_lines(
    path: &Path,
    events: u64,
    clients: usize,
    control: bool,
) -> Result<(Instant, Vec<StreamDone>)> {
    let mut streams = Vec::with_capacity(clients);
    for _ in 0..clients {
        streams
            .push(Some(UnixStream::connect(path).with_context(|| {
                format!("connecting to {}", path.display())
            })?));
    }
    let streams = std::sync::Mutex::new(streams);
    run_clients(clients, move |i, start| {
        let stream = streams.lock().expect("streams")[i].take().expect("once");
        stream_client(stream, share(events, clients, i), i, control, start)
    })
}

/// Newlines in `buf`.
fn newlines(buf: &[u8]) -> u64 {
    memchr::memchr_iter(b'\n', buf).count() as u64
}

/// The datagram ceiling's receiver: one thread, one `recv` per datagram, counting newlines
/// until `events`; returns when the last was counted.
fn datagram_receiver(socket: UnixDatagram, events: u64) -> JoinHandle<Result<Instant>> {
    std::thread::spawn(move || {
        socket.set_read_timeout(Some(RECEIVER_TIMEOUT))?;
        let mut buf = vec![0u8; READ_BYTES];
        let mut counted = 0;
        while counted < events {
            let n = socket.recv(&mut buf).context("counting receiver")?;
            counted += newlines(&buf[..n]);
        }
        Ok(Instant::now())
    })
}

/// The stream ceiling's receiver: accepts `clients` connections, one thread each reading until
/// the client closes, counting newlines; returns the count and when the last bytes came.
fn stream_receiver(listener: UnixListener, clients: usize) -> JoinHandle<Result<(u64, Instant)>> {
    std::thread::spawn(move || {
        let mut readers = Vec::with_capacity(clients);
        for _ in 0..clients {
            let (mut conn, _) = listener.accept()?;
            conn.set_read_timeout(Some(RECEIVER_TIMEOUT))?;
            readers.push(std::thread::spawn(move || -> Result<(u64, Instant)> {
                let mut buf = vec![0u8; READ_BYTES];
                let (mut counted, mut last) = (0, Instant::now());
                loop {
                    let n = conn.read(&mut buf)?;
                    if n == 0 {
                        return Ok((counted, last));
                    }
                    counted += newlines(&buf[..n]);
                    last = Instant::now();
                }
            }));
        }
        let mut total = (0, Instant::now());
        for r in readers {
            let (n, last) = r.join().map_err(|_| anyhow!("a reader panicked"))??;
            total = (total.0 + n, total.1.max(last));
        }
        Ok(total)
    })
}

impl BenchEnv {
    /// The counting receiver on `transport`, with the same clients and events as tallyd gets.
    pub(crate) async fn per_event_ceiling(
        &self,
        name: &'static str,
        transport: Transport,
        events: u64,
        clients: usize,
    ) -> Result<Outcome> {
        let dir = self.root.path.join(name);
        std::fs::create_dir_all(&dir)?;
        let elapsed = tokio::task::spawn_blocking(move || -> Result<Duration> {
            match transport {
                Transport::Datagram => {
                    let path = dir.join("ceiling.dgram");
                    let receiver = datagram_receiver(UnixDatagram::bind(&path)?, events);
                    let started = send_datagrams(path, events, clients)?;
                    let done = receiver
                        .join()
                        .map_err(|_| anyhow!("receiver panicked"))??;
                    Ok(done - started)
                }
                Transport::Stream => {
                    let path = dir.join("ceiling.sock");
                    let receiver = stream_receiver(UnixListener::bind(&path)?, clients);
                    let (started, _) = send_lines(&path, events, clients, false)?;
                    let (counted, last) = receiver
                        .join()
                        .map_err(|_| anyhow!("receiver panicked"))??;
                    ensure!(
                        counted == events,
                        "{name}: sent {events} lines, counted {counted}"
                    );
                    Ok(last - started)
                }
            }
        })
        .await??;
        Ok(Outcome::baseline(name, events, "event", elapsed))
    }

    /// tallyd with `clients` threads sending `events` one per syscall on `transport`; checks
    /// that every one was accepted and committed exactly once.
    pub(crate) async fn per_event_tallyd(
        &self,
        name: &'static str,
        transport: Transport,
        events: u64,
        clients: usize,
    ) -> Result<Outcome> {
        let dgram = self.root.path.join(name).join("tallyd.dgram");
        let daemon = self
            .spawn_daemon(name, |c| {
                if transport == Transport::Datagram {
                    c.listen.datagram_socket = dgram.clone();
                }
            })
            .await?;
        let before = Usage::take(&daemon).await?;
        let (ingest, elapsed) = match transport {
            Transport::Datagram => {
                let started =
                    tokio::task::spawn_blocking(move || send_datagrams(dgram, events, clients))
                        .await??;
                let read = self.accepted(&daemon, events).await?;
                let committed = self.committed(name, events).await?;
                (read - started, committed - started)
            }
            Transport::Stream => {
                let socket = daemon.socket.clone();
                let (started, done) =
                    tokio::task::spawn_blocking(move || send_lines(&socket, events, clients, true))
                        .await??;
                let finished = Instant::now();
                let pong = done.iter().filter_map(|d| d.pong_at).max();
                let replies: Vec<String> = done.into_iter().filter_map(|d| d.flush_reply).collect();
                let accepted = flush_replies(&replies)?;
                ensure!(
                    accepted == events,
                    "{name}: sent {events} events, tallyd accepted {accepted}"
                );
                (pong.unwrap_or(finished) - started, finished - started)
            }
        };
        let after = Usage::take(&daemon).await?;
        let peak_rss_mib = daemon.peak_rss_mib()?;
        daemon.stop().await?;
        // After the stop's final flush too: nothing committed twice.
        let keys = keys_of(events);
        self.check_totals(name, events, keys).await?;
        let stats = DaemonStats {
            ingest,
            flow: Some(Flow::between(&before, &after)),
            peak_rss_mib,
            bytes_per_key: None,
        };
        let note = format!("exact: {events} events, {keys} keys, {clients} clients");
        Ok(Outcome::daemon(name, events, elapsed, stats, note))
    }

    /// Waits until the daemon has accepted `events` (its datagrams all read); returns when.
    async fn accepted(&self, daemon: &crate::daemon::Daemon, events: u64) -> Result<Instant> {
        let series = format!("{}{{counter=\"{COUNTER}\"}}", m::EVENTS_ACCEPTED);
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        loop {
            let now = Instant::now();
            let s = Samples::parse(&scrape(&daemon.metrics).await?);
            let accepted = s.get(&series).unwrap_or(0.0) as u64;
            if accepted >= events {
                ensure!(accepted == events, "accepted {accepted} of {events} events");
                return Ok(now);
            }
            ensure!(
                now < deadline,
                "only {accepted} of {events} datagram events accepted after {SETTLE_TIMEOUT:?}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Waits until `tallyd.totals` holds all `events` (datagrams have no `!flush`); returns when.
    async fn committed(&self, name: &str, events: u64) -> Result<Instant> {
        let client = self.db.connect().await?;
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        loop {
            let now = Instant::now();
            let stored: i64 = client
                .query_one(
                    "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.totals WHERE counter = $1",
                    &[&COUNTER],
                )
                .await?
                .get(0);
            if stored as u64 >= events {
                return Ok(now);
            }
            ensure!(
                now < deadline,
                "{name}: {stored} of {events} events committed after {SETTLE_TIMEOUT:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The per-event targets: tallyd's ingest rate against the counting receiver's, and CPU.
pub(crate) fn checks(outcomes: &[Outcome]) -> Vec<String> {
    let mut lines = Vec::new();
    for (s, share) in [(Scenario::EventDgram, 0.9), (Scenario::EventStream, 0.7)] {
        let tallyd = find(outcomes, s.name()).and_then(Outcome::ingest_rate);
        let ceiling = ceiling_of(s)
            .and_then(|c| find(outcomes, c.name()))
            .and_then(Outcome::rate);
        lines.push(check(
            &format!(
                "{} ingest >= {:.0}% of the counting receiver",
                s.name(),
                share * 100.0
            ),
            tallyd.zip(ceiling).map(|(t, c)| {
                let ratio = t / c;
                (
                    ratio >= share,
                    format!(
                        "{} vs {} events/s = {:.0}%",
                        thousands(t),
                        thousands(c),
                        ratio * 100.0
                    ),
                )
            }),
        ));
    }
    lines.push(check(
        "tallyd-event-dgram CPU <= 1 s per million events",
        find(outcomes, Scenario::EventDgram.name())
            .and_then(Outcome::cpu_per_million)
            .map(|c| (c <= 1.0, format!("{c:.3} s per million events"))),
    ));
    lines
}
