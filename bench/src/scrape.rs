//! The daemon's own numbers: its CPU time and a scrape of its Prometheus endpoint (rows
//! written, reader pauses, the event-to-commit histogram and its quantiles), parsed by the
//! test kit's `Samples`.

use std::collections::HashMap;

use anyhow::{ensure, Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use tallyd::metrics as m;
use tallyd_testkit::Samples;

/// CPU seconds and a metrics scrape at one moment.
pub(crate) struct Usage {
    pub(crate) cpu_s: f64,
    pub(crate) rows: f64,
    /// Time readers waited at `coalesce.max_pending_keys`, summed over connections.
    pub(crate) paused_s: f64,
    pub(crate) freshness: Vec<(f64, f64)>,
    /// Seconds spent in committed flush transactions, summed over the flush connections.
    pub(crate) flushing_s: f64,
}

impl Usage {
    /// The daemon's CPU seconds `cpu_s` beside the metrics scraped just before (`s`).
    pub(crate) fn new(s: &Samples, cpu_s: f64) -> Usage {
        Usage {
            cpu_s,
            rows: s.get(m::FLUSH_ROWS).unwrap_or(0.0),
            paused_s: s
                .get(&format!("{}_sum", m::BACKPRESSURE_PAUSE))
                .unwrap_or(0.0),
            freshness: s.histogram(m::FRESHNESS),
            flushing_s: s.get(&format!("{}_sum", m::FLUSH_DURATION)).unwrap_or(0.0),
        }
    }
}

/// GET /metrics over HTTP/1.0, so the body is plain (not chunked) and ends at close.
pub(crate) async fn scrape(addr: &str) -> Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to the metrics endpoint {addr}"))?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("malformed HTTP response from the metrics endpoint")?;
    ensure!(head.contains(" 200 "), "metrics endpoint answered {head:?}");
    Ok(body.to_string())
}

/// Per-bucket difference of two scrapes of one histogram.
pub(crate) fn histogram_delta(before: &[(f64, f64)], after: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let old: HashMap<u64, f64> = before.iter().map(|(le, c)| (le.to_bits(), *c)).collect();
    after
        .iter()
        .map(|(le, c)| (*le, c - old.get(&le.to_bits()).copied().unwrap_or(0.0)))
        .collect()
}

/// Quantile `q` from cumulative buckets, interpolating linearly inside the bucket it falls in
/// (from 0 for the first); in the `+Inf` bucket, the largest finite bound.
pub(crate) fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(le, cum) in buckets {
        if cum >= rank && cum > below {
            if le.is_infinite() {
                return Some(lower);
            }
            return Some(lower + (le - lower) * (rank - below) / (cum - below));
        }
        lower = if le.is_finite() { le } else { lower };
        below = cum;
    }
    Some(lower)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_interpolates_within_the_bucket() {
        let buckets = [(0.1, 0.0), (0.5, 10.0), (1.0, 20.0), (f64::INFINITY, 20.0)];
        let close = |q: Option<f64>, want: f64| q.is_some_and(|v| (v - want).abs() < 1e-9);
        assert!(close(quantile(&buckets, 0.25), 0.3));
        assert_eq!(quantile(&buckets, 0.5), Some(0.5));
        assert_eq!(quantile(&buckets, 0.75), Some(0.75));
        let first = [(1.0, 4.0), (f64::INFINITY, 4.0)];
        assert_eq!(quantile(&first, 0.5), Some(0.5));
        let overflow = [(1.0, 0.0), (f64::INFINITY, 3.0)];
        assert_eq!(quantile(&overflow, 0.99), Some(1.0));
        assert_eq!(quantile(&[(1.0, 0.0), (f64::INFINITY, 0.0)], 0.5), None);
    }

    #[test]
    fn histogram_deltas() {
        let delta = histogram_delta(&[(0.5, 1.0)], &[(0.5, 4.0), (f64::INFINITY, 9.0)]);
        assert_eq!(delta, vec![(0.5, 3.0), (f64::INFINITY, 9.0)]);
    }
}
