//! The per-event scenarios: `--event-clients` threads each sending one event per syscall (one
//! `send` per datagram, or one `write` per line on its own stream connection), to tallyd and, in
//! the same run, to the counting receiver (bench/src/receiver.rs, a child process that only
//! reads and counts newlines): the transport's ceiling on this machine, which tallyd's ingest
//! rate is compared to.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure, Context, Result};

use tallyd::metrics as m;
use tallyd_testkit::Samples;

use crate::client::flush_replies;
use crate::daemon::Daemon;
use crate::env::{BenchEnv, COUNTER};
use crate::load::share;
use crate::procfs::{cpu_seconds_of, proc_kib};
use crate::report::{DaemonStats, Flow, Outcome};
use crate::scrape::scrape;

/// Keys the events cycle through (`k0` to `k999`): coalescing has little to do, as for an
/// application's many counters, and the flush stays small beside the reading.
const KEYS: u64 = 1_000;
/// How long the datagram scenario waits for its events to be read, then committed.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transport {
    Datagram,
    Stream,
}

/// Client `i`'s lines: `bench k<n>\n`, one per event, cycling through the keys.
fn client_lines(i: usize) -> Vec<Vec<u8>> {
    (0..KEYS)
        .map(|k| format!("{COUNTER} k{}\n", (k + i as u64) % KEYS).into_bytes())
        .collect()
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

/// Runs `clients` client threads started together (each calls `wait` on the barrier it is
/// given once ready); returns when the first byte went out and every client's result.
pub(crate) fn run_clients<T: Send + 'static>(
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

/// The counting receiver (bench/src/receiver.rs) as a child process, bound and ready.
struct Receiver {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Receiver {
    fn spawn(transport: Transport, socket: &Path, events: u64) -> Result<Receiver> {
        let kind = match transport {
            Transport::Datagram => "datagram",
            Transport::Stream => "stream",
        };
        let mut child = Command::new(std::env::current_exe()?)
            .arg("--count-newlines")
            .arg(kind)
            .arg(socket)
            .arg(events.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the counting receiver")?;
        let out = BufReader::new(child.stdout.take().context("receiver stdout")?);
        let mut r = Receiver { child, out };
        r.expect("ready")?;
        Ok(r)
    }

    fn expect(&mut self, what: &str) -> Result<()> {
        let mut line = String::new();
        self.out.read_line(&mut line)?;
        ensure!(
            line.trim_end() == what,
            "counting receiver said {line:?}, expected {what:?}"
        );
        Ok(())
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lets it exit (it waits for its standard input to close).
    fn finish(mut self) -> Result<()> {
        drop(self.child.stdin.take());
        let status = self.child.wait()?;
        ensure!(status.success(), "counting receiver exited with {status}");
        Ok(())
    }
}

/// What the ceiling measured: first byte to the last newline counted, the receiver's CPU
/// seconds over that time, and its peak RSS in MiB.
struct Counted {
    elapsed: Duration,
    cpu_s: f64,
    peak_rss_mib: f64,
}

fn count_newlines(
    transport: Transport,
    socket: PathBuf,
    events: u64,
    clients: usize,
) -> Result<Counted> {
    let mut receiver = Receiver::spawn(transport, &socket, events)?;
    let pid = receiver.pid();
    let cpu_before = cpu_seconds_of(pid)?;
    let started = match transport {
        Transport::Datagram => send_datagrams(socket, events, clients)?,
        Transport::Stream => send_lines(&socket, events, clients, false)?.0,
    };
    receiver.expect("done")?;
    let elapsed = started.elapsed();
    let cpu_s = cpu_seconds_of(pid)? - cpu_before;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let peak_kib = proc_kib(&status, "VmHWM").unwrap_or(0);
    receiver.finish()?;
    Ok(Counted {
        elapsed,
        cpu_s,
        peak_rss_mib: peak_kib as f64 / 1024.0,
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
        let socket = dir.join(match transport {
            Transport::Datagram => "ceiling.dgram",
            Transport::Stream => "ceiling.sock",
        });
        let counted =
            tokio::task::spawn_blocking(move || count_newlines(transport, socket, events, clients))
                .await??;
        let stats = DaemonStats {
            ingest: counted.elapsed,
            flow: Some(Flow::cpu_only(counted.cpu_s)),
            peak_rss_mib: counted.peak_rss_mib,
            bytes_per_key: None,
        };
        let note = format!("counted {events} newlines, {clients} clients");
        Ok(Outcome::daemon(name, events, counted.elapsed, stats, note))
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
                    c.listen.set_datagram_socket(Some(dgram.clone()));
                }
            })
            .await?;
        let before = daemon.usage().await?;
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
        let after = daemon.usage().await?;
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
    async fn accepted(&self, daemon: &Daemon, events: u64) -> Result<Instant> {
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
