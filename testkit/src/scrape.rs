//! [`Samples`]: a Prometheus text-format scrape parsed into series, and the plain HTTP GET
//! that fetches one from tallyd's metrics endpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// The samples of a text-format scrape, by series (`name{labels}` exactly as exported).
#[derive(Debug, Clone, Default)]
pub struct Samples {
    series: BTreeMap<String, f64>,
    /// Sample names (with `_bucket`, `_sum`, `_count` for histograms).
    names: BTreeSet<String>,
}

impl Samples {
    /// Parses the text format; panics on a malformed sample line.
    pub fn parse(text: &str) -> Samples {
        let mut samples = Samples::default();
        for line in text.lines() {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (key, value) = line.rsplit_once(' ').expect("sample line");
            let value: f64 = match value {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v
                    .parse()
                    .unwrap_or_else(|_| panic!("bad value in {line:?}")),
            };
            samples
                .names
                .insert(key.split('{').next().unwrap().to_string());
            samples.series.insert(key.to_string(), value);
        }
        samples
    }

    /// The value of one series (`name` or `name{labels}` exactly as exported), if present.
    pub fn get(&self, series: &str) -> Option<f64> {
        self.series.get(series).copied()
    }

    /// The value of one series; panics, listing the scrape, when it is absent.
    pub fn value(&self, series: &str) -> f64 {
        self.get(series)
            .unwrap_or_else(|| panic!("{series} is not in the scrape: {:#?}", self.series))
    }

    /// The sum of every series of `name` (any labels), or None when there is none.
    pub fn sum(&self, name: &str) -> Option<f64> {
        let values: Vec<f64> = self
            .series
            .iter()
            .filter(|(series, _)| series.split('{').next() == Some(name))
            .map(|(_, v)| *v)
            .collect();
        (!values.is_empty()).then(|| values.iter().sum())
    }

    /// Every series, in order.
    pub fn series(&self) -> &BTreeMap<String, f64> {
        &self.series
    }

    /// Every sample name (histograms as `_bucket`, `_sum`, `_count`).
    pub fn names(&self) -> &BTreeSet<String> {
        &self.names
    }

    /// `(le, cumulative count)` of the unlabelled histogram `name`, in bucket order, `+Inf` as
    /// infinity.
    pub fn histogram(&self, name: &str) -> Vec<(f64, f64)> {
        let prefix = format!("{name}_bucket{{le=\"");
        let mut buckets: Vec<(f64, f64)> = self
            .series
            .iter()
            .filter_map(|(series, &count)| {
                let le = series.strip_prefix(&prefix)?.strip_suffix("\"}")?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, count))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        buckets
    }
}

/// A plain HTTP/1.0 GET (so the body is not chunked and ends at close); returns the status
/// code and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).expect("UTF-8 response");
    let (head, body) = raw.split_once("\r\n\r\n").expect("HTTP response");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line: {head}"));
    (status, body.to_string())
}

/// The text of `GET /metrics`; panics unless the endpoint answers 200.
pub fn scrape(addr: SocketAddr) -> String {
    let (status, body) = http_get(addr, "/metrics");
    assert_eq!(status, 200, "GET /metrics: {body}");
    body
}

/// The metrics endpoint of this test process (tests that run the daemon in-process), installed
/// once, on a runtime of its own: each test's runtime ends with its test. Its samples now.
pub fn process_metrics() -> Samples {
    static PORT: std::sync::OnceLock<u16> = std::sync::OnceLock::new();
    let port = *PORT.get_or_init(|| {
        let port = crate::free_port();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let reporter = tallyd::status::Reporter::detached();
                tallyd::http::install(&format!("127.0.0.1:{port}"), reporter)
                    .expect("install the metrics endpoint");
                tx.send(()).unwrap();
                std::future::pending::<()>().await
            })
        });
        rx.recv().unwrap();
        port
    });
    Samples::parse(&scrape(([127, 0, 0, 1], port).into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_series_and_histograms() {
        let text = "# TYPE tallyd_flush_rows_total counter\n\
                    tallyd_flush_rows_total 42\n\
                    tallyd_flush_rows_totally 7\n\
                    tallyd_x_bucket{le=\"1\"} 3\n\
                    tallyd_x_bucket{le=\"0.5\"} 1\n\
                    tallyd_x_bucket{le=\"+Inf\"} 4\n\
                    tallyd_x_sum 2.5\n";
        let s = Samples::parse(text);
        assert_eq!(s.get("tallyd_flush_rows_total"), Some(42.0));
        assert_eq!(s.get("tallyd_flush_rows"), None);
        assert_eq!(
            s.histogram("tallyd_x"),
            vec![(0.5, 1.0), (1.0, 3.0), (f64::INFINITY, 4.0)]
        );
        assert!(s.names().contains("tallyd_x_bucket"));
        assert_eq!(s.sum("tallyd_x_bucket"), Some(8.0));
        assert_eq!(s.sum("tallyd_y"), None);
    }
}
