//! The HTTP endpoints on `metrics.listen` (hyper, HTTP/1.1): `/metrics` (the Prometheus
//! scrape), `/healthz` (alive), `/readyz` (ready to take events, or why not) and `/status` (the
//! status view, [`crate::status`]); 404 for anything else. Also [`get`], the small client
//! `tallyd status` reads `/status` with.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;
use tracing::{debug, warn};

use crate::config::MetricsConfig;
use crate::metrics::{self, MetricsError};
use crate::status::Reporter;
use crate::throttle::Throttle;

/// The Prometheus text format's content type.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";
const JSON: &str = "application/json";
/// HTTP connections served at once (see [`MetricsConfig::HTTP_CONNECTIONS`]).
const MAX_CONNECTIONS: usize = MetricsConfig::HTTP_CONNECTIONS;
/// A connection that has not sent a whole request head within this is closed, so silent
/// clients give their slot back (a scrape or `tallyd status` sends its request at once).
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
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

/// Accepts connections, each served by its own task, at most [`MAX_CONNECTIONS`] at once. An
/// accept error (out of file descriptors) is logged and retried after a pause, so it cannot
/// spin.
async fn accept(listener: tokio::net::TcpListener, routes: Arc<Routes>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(err) => {
                if let Some(suppressed) = ACCEPT_FAILED.allow() {
                    warn!(cause = %err, suppressed, "metrics listener: cannot accept a connection");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            if let Some(suppressed) = TOO_MANY.allow() {
                warn!(
                    max = MAX_CONNECTIONS,
                    suppressed, "metrics listener: too many connections open; closing a new one"
                );
            }
            continue;
        };
        let routes = routes.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req| {
                let routes = routes.clone();
                async move { Ok::<_, Infallible>(routes.answer(&req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            if let Err(err) = conn.await {
                debug!(cause = %err, "metrics listener: connection ended with an error");
            }
        });
    }
}

static ACCEPT_FAILED: Throttle = Throttle::new(1000);
static TOO_MANY: Throttle = Throttle::new(1000);

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
            "/status" => json(StatusCode::OK, &self.reporter.status().await),
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
