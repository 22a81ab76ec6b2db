//! The HTTP endpoints on `metrics.listen` (hyper, HTTP/1.1): `/metrics` (the Prometheus
//! scrape), `/healthz` (alive), `/readyz` (ready to take events, or why not) and `/status` (the
//! status view, [`crate::status`]); 404 for anything else. Also [`get`], the small client
//! `tallyd status` reads `/status` with.
//!
//! At most [`MAX_CONNECTIONS`] connections are served at once. When all are taken, the next
//! one waits (it and those after it in the kernel's accept queue) until a connection ends or
//! one has waited [`EVICT_AFTER`] for a request head; that one is closed to make room
//! ([`Slots`]). So clients that connect and send part of a request cannot keep health checks
//! and scrapes out: those send their request at once and are answered.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Empty, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::config::MetricsConfig;
use crate::events::{HttpAcceptFailed, HttpConnectionEvicted};
use crate::metrics::{self, MetricsError};
use crate::status::{Busy, Reporter};

/// The Prometheus text format's content type.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";
const JSON: &str = "application/json";
/// HTTP connections served at once ([`MetricsConfig::HTTP_CONNECTIONS`]). The endpoints share
/// the process's file descriptors with the event sockets: without a bound, clients that
/// connect and send nothing (a stuck scraper, a port scan) would take every descriptor and
/// starve ingest. Beyond it, new connections wait in the kernel's accept queue (tallyd holds
/// one more, the next to admit).
const MAX_CONNECTIONS: usize = MetricsConfig::HTTP_CONNECTIONS;
/// A connection that has not sent a whole request head within this is closed, so silent
/// clients give their slot back (a scrape or `tallyd status` sends its request at once).
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// While every slot is taken and a connection waits for one, a connection that has waited
/// this long for a request head (since its accept or its last answer) is closed to make room:
/// the header timeout, shortened under pressure. Long enough for a client that sends its
/// request at once to be read (its request is already in the socket when it is admitted);
/// short enough that the slots take 128 connections a second from the queue, so a health
/// check queued behind 100 slow clients is answered within about a second.
const EVICT_AFTER: Duration = Duration::from_millis(250);
/// How long `tallyd status` waits for an answer: a liveness bound (the daemon answers in
/// milliseconds).
const CLIENT_PATIENCE: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("metrics.listen {0:?} is not a host:port address")]
    Address(String),
    #[error("cannot listen on metrics.listen {addr}: {cause}")]
    Bind {
        addr: SocketAddr,
        cause: std::io::Error,
    },
    #[error(
        "cannot connect to tallyd at http://{addr} (metrics.listen; is tallyd running?): {cause}"
    )]
    Connect {
        addr: SocketAddr,
        cause: std::io::Error,
    },
    #[error("GET http://{addr}{path}: {cause}")]
    Request {
        addr: SocketAddr,
        path: String,
        cause: hyper::Error,
    },
    #[error("GET http://{addr}{path}: no answer within {CLIENT_PATIENCE:?}")]
    Timeout { addr: SocketAddr, path: String },
    #[error(transparent)]
    Metrics(#[from] MetricsError),
}

fn parse_addr(listen: &str) -> Result<SocketAddr, HttpError> {
    listen
        .parse()
        .map_err(|_| HttpError::Address(listen.to_string()))
}

/// Installs the metrics recorder ([`metrics::install_recorder`]) and serves the endpoints on
/// `listen`, reporting through `reporter` (see [`serve`]). Must run inside a tokio runtime.
pub fn install(listen: &str, reporter: Arc<Reporter>) -> Result<SocketAddr, HttpError> {
    let handle = metrics::install_recorder()?;
    serve(listen, handle, reporter)
}

/// Binds `listen` now (so that a bad or taken address fails the start) and serves the endpoints
/// from a task that lives as long as the runtime. Returns the bound address.
pub fn serve(
    listen: &str,
    metrics: PrometheusHandle,
    reporter: Arc<Reporter>,
) -> Result<SocketAddr, HttpError> {
    let addr = parse_addr(listen)?;
    let bind_err = |cause| HttpError::Bind { addr, cause };
    let std_listener = std::net::TcpListener::bind(addr).map_err(bind_err)?;
    std_listener.set_nonblocking(true).map_err(bind_err)?;
    let listener = tokio::net::TcpListener::from_std(std_listener).map_err(bind_err)?;
    let bound = listener.local_addr().map_err(bind_err)?;
    let routes = Arc::new(Routes { metrics, reporter });
    tokio::spawn(accept(listener, routes));
    Ok(bound)
}

/// Accepts connections, each served by its own task, at most [`MAX_CONNECTIONS`] at once (see
/// [`Slots`]). An accept error (out of file descriptors) is logged and retried after a pause,
/// so it cannot spin.
async fn accept(listener: tokio::net::TcpListener, routes: Arc<Routes>) {
    let slots = Arc::new(SharedSlots::default());
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(err) => {
                HttpAcceptFailed { cause: &err }.emit();
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // The next connections wait in the kernel's queue meanwhile.
        slots.make_room().await;
        let slot = slots.admit();
        tokio::spawn(serve_connection(stream, slot, routes.clone()));
    }
}

/// Serves one connection until it ends, times out or is evicted to make room for another.
async fn serve_connection(stream: tokio::net::TcpStream, slot: SlotGuard, routes: Arc<Routes>) {
    let evicted = slot.evicted.clone();
    let slot = Arc::new(slot);
    let service = hyper::service::service_fn(move |req| {
        let routes = routes.clone();
        let answering = slot.answering();
        async move {
            let _answering = answering;
            Ok::<_, Infallible>(routes.answer(&req).await)
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        result = conn => {
            if let Err(err) = result {
                debug!(cause = %err, "metrics listener: connection ended with an error");
            }
        }
        // Dropping the connection closes it; no request of it was being answered.
        _ = evicted.cancelled() => {}
    }
}

/// The connections being served and which one gives way when all [`MAX_CONNECTIONS`] slots are
/// taken: plain logic, unit-tested below; the accept loop and the connection tasks share it
/// through [`SharedSlots`].
#[derive(Default)]
struct Slots {
    open: Vec<Slot>,
    next_id: u64,
}

struct Slot {
    id: u64,
    /// Since when it has waited for a request head (its accept, or the end of its last
    /// answer); `None` while a request of it is being answered, which is never cut short.
    waiting_since: Option<Instant>,
    evict: CancellationToken,
}

/// What a new connection does when it asks for a slot.
#[derive(Debug, PartialEq)]
enum Room {
    /// A slot is free.
    Free,
    /// The connection that had waited longest for a request head, `waited`, was told to close;
    /// its slot is free.
    Evicted { waited: Duration },
    /// Every connection waits for a head, none for [`EVICT_AFTER`] yet: ask again then (or
    /// when a connection ends).
    Until(Instant),
    /// Every connection is being answered: ask again when one ends.
    Busy,
}

impl Slots {
    fn room(&mut self, now: Instant) -> Room {
        if self.open.len() < MAX_CONNECTIONS {
            return Room::Free;
        }
        let oldest = (self.open.iter().enumerate())
            .filter_map(|(i, slot)| Some((i, slot.waiting_since?)))
            .min_by_key(|&(_, since)| since);
        let Some((i, since)) = oldest else {
            return Room::Busy;
        };
        let waited = now.saturating_duration_since(since);
        if waited < EVICT_AFTER {
            return Room::Until(since + EVICT_AFTER);
        }
        self.open.swap_remove(i).evict.cancel();
        Room::Evicted { waited }
    }

    /// Takes a slot (after [`Slots::room`] made one); the token is cancelled if it is evicted.
    fn admit(&mut self, now: Instant) -> (u64, CancellationToken) {
        self.next_id += 1;
        let evict = CancellationToken::new();
        self.open.push(Slot {
            id: self.next_id,
            waiting_since: Some(now),
            evict: evict.clone(),
        });
        (self.next_id, evict)
    }

    fn get(&mut self, id: u64) -> Option<&mut Slot> {
        self.open.iter_mut().find(|slot| slot.id == id)
    }

    /// A request head of `id` has arrived: it is answered now.
    fn answering(&mut self, id: u64) {
        if let Some(slot) = self.get(id) {
            slot.waiting_since = None;
        }
    }

    /// `id`'s answer is out: it waits for its next request head from `now`.
    fn answered(&mut self, id: u64, now: Instant) {
        if let Some(slot) = self.get(id) {
            slot.waiting_since = Some(now);
        }
    }

    /// `id` has ended (or was evicted: then it is gone already).
    fn release(&mut self, id: u64) {
        self.open.retain(|slot| slot.id != id);
    }
}

/// [`Slots`] behind a mutex (never held across an await), and the wake-up of a new connection
/// waiting for a slot.
#[derive(Default)]
struct SharedSlots {
    slots: Mutex<Slots>,
    released: Notify,
}

impl SharedSlots {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        // The critical sections cannot panic halfway; a poisoned lock still holds valid slots.
        self.slots
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Returns once a slot is free, evicting a slow connection if that is what it takes.
    async fn make_room(&self) {
        loop {
            // `notify_one` keeps a permit when nobody waits, so a release between this check
            // and the wait below is not missed.
            let room = self.lock().room(Instant::now());
            match room {
                Room::Free => return,
                Room::Evicted { waited } => {
                    HttpConnectionEvicted {
                        max: MAX_CONNECTIONS,
                        waited,
                    }
                    .emit();
                    return;
                }
                Room::Until(at) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at.into()) => {}
                        _ = self.released.notified() => {}
                    }
                }
                Room::Busy => self.released.notified().await,
            }
        }
    }

    fn admit(self: &Arc<Self>) -> SlotGuard {
        let (id, evicted) = self.lock().admit(Instant::now());
        SlotGuard {
            slots: self.clone(),
            id,
            evicted,
        }
    }
}

/// A connection's slot, given back when its task ends.
struct SlotGuard {
    slots: Arc<SharedSlots>,
    id: u64,
    evicted: CancellationToken,
}

impl SlotGuard {
    /// Marks the connection as being answered until the returned guard drops.
    fn answering(&self) -> Answering {
        self.slots.lock().answering(self.id);
        Answering {
            slots: self.slots.clone(),
            id: self.id,
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.slots.lock().release(self.id);
        self.slots.released.notify_one();
    }
}

/// A request being answered; its connection may be evicted again once this drops.
struct Answering {
    slots: Arc<SharedSlots>,
    id: u64,
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.slots.lock().answered(self.id, Instant::now());
    }
}

struct Routes {
    metrics: PrometheusHandle,
    reporter: Arc<Reporter>,
}

impl Routes {
    async fn answer(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return json(StatusCode::METHOD_NOT_ALLOWED, &Problem::new("use GET"));
        }
        match req.uri().path() {
            "/metrics" => respond(StatusCode::OK, TEXT_FORMAT, self.metrics.render().into()),
            "/healthz" => json(StatusCode::OK, &Alive { status: "alive" }),
            "/readyz" => {
                let readiness = self.reporter.readiness();
                let code = if readiness.ready {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                json(code, &readiness)
            }
            "/status" => match self.reporter.status().await {
                Ok(status) => json(StatusCode::OK, &status),
                Err(Busy) => json(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &Problem::new("too many status requests at once; try again"),
                ),
            },
            _ => json(
                StatusCode::NOT_FOUND,
                &Problem::new("not found: try /metrics, /healthz, /readyz or /status"),
            ),
        }
    }
}

#[derive(Serialize)]
struct Alive {
    status: &'static str,
}

#[derive(Serialize)]
struct Problem {
    error: &'static str,
}

impl Problem {
    fn new(error: &'static str) -> Problem {
        Problem { error }
    }
}

fn json(code: StatusCode, body: &impl Serialize) -> Response<Full<Bytes>> {
    let mut text = serde_json::to_vec(body).expect("status types serialize");
    text.push(b'\n');
    respond(code, JSON, text.into())
}

fn respond(code: StatusCode, content_type: &'static str, body: Bytes) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = code;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, content_type.parse().expect("valid header"));
    response
}

/// `GET path` from the endpoints at `listen`: the status code and the body.
pub async fn get(listen: &str, path: &str) -> Result<(u16, String), HttpError> {
    let addr = parse_addr(listen)?;
    let timeout = HttpError::Timeout {
        addr,
        path: path.to_string(),
    };
    tokio::time::timeout(CLIENT_PATIENCE, get_from(addr, path))
        .await
        .map_err(|_| timeout)?
}

async fn get_from(addr: SocketAddr, path: &str) -> Result<(u16, String), HttpError> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|cause| HttpError::Connect { addr, cause })?;
    let failed = |cause| HttpError::Request {
        addr,
        path: path.to_string(),
        cause,
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(failed)?;
    tokio::spawn(conn);
    let req = Request::get(path)
        .header(HOST, addr.to_string())
        .body(Empty::<Bytes>::new())
        .expect("valid request");
    let response = sender.send_request(req).await.map_err(failed)?;
    let code = response.status().as_u16();
    let body = response.into_body().collect().await.map_err(failed)?;
    Ok((code, String::from_utf8_lossy(&body.to_bytes()).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(now: Instant) -> (Slots, Vec<(u64, CancellationToken)>) {
        let mut slots = Slots::default();
        let admitted = (0..MAX_CONNECTIONS)
            .map(|i| {
                assert_eq!(slots.room(now), Room::Free);
                slots.admit(now + Duration::from_millis(i as u64))
            })
            .collect();
        (slots, admitted)
    }

    #[test]
    fn the_connection_waiting_longest_for_a_head_gives_way_after_evict_after() {
        let t0 = Instant::now();
        let (mut slots, admitted) = full(t0);
        // The first two are being answered; the third has waited longest for a head.
        slots.answering(admitted[0].0);
        slots.answering(admitted[1].0);
        let third = t0 + Duration::from_millis(2);
        assert_eq!(slots.room(third), Room::Until(third + EVICT_AFTER));
        let later = third + EVICT_AFTER + Duration::from_millis(5);
        assert_eq!(
            slots.room(later),
            Room::Evicted {
                waited: EVICT_AFTER + Duration::from_millis(5)
            }
        );
        assert!(admitted[2].1.is_cancelled());
        assert!(admitted.iter().filter(|(_, t)| t.is_cancelled()).count() == 1);
        assert_eq!(slots.room(later), Room::Free);
        let (newest, _) = slots.admit(later);
        // An answered connection waits for its next head from the end of its answer.
        for (id, _) in &admitted[3..] {
            slots.answering(*id);
        }
        slots.answering(newest);
        slots.answered(admitted[0].0, later);
        assert_eq!(slots.room(later), Room::Until(later + EVICT_AFTER));
        assert_eq!(
            slots.room(later + EVICT_AFTER),
            Room::Evicted {
                waited: EVICT_AFTER
            }
        );
        assert!(admitted[0].1.is_cancelled());
    }

    #[test]
    fn connections_being_answered_are_never_evicted() {
        let t0 = Instant::now();
        let (mut slots, admitted) = full(t0);
        for (id, _) in &admitted {
            slots.answering(*id);
        }
        assert_eq!(slots.room(t0 + HEADER_TIMEOUT), Room::Busy);
        slots.release(admitted[5].0);
        assert_eq!(slots.room(t0), Room::Free);
        // Releasing an evicted (already removed) connection changes nothing.
        slots.release(admitted[5].0);
        assert_eq!(slots.open.len(), MAX_CONNECTIONS - 1);
    }
}
