//! The rows to the application's table (issue 32): the per-day counter `rollup_into`
//! `version_downloads` (the `redis-daily` peer's table, emptied and checked by the same calls,
//! bench/src/daily.rs), with the daemon's own rollup running at its defaults. The clock stops
//! when the table holds every event, as the peer's does: with `direct` (the default) the flush
//! writes the table itself, so that is when the last `!flush` is answered; without, when the
//! rollup has folded the last slot row.

use std::fmt::Write as _;
use std::time::Instant;

use anyhow::{ensure, Result};

use tallyd::config::{KeyTypeName, RollupInto};
use tallyd::window::Span;

use crate::client::{flush_replies, send};
use crate::env::BenchEnv;
use crate::load::Load;
use crate::report::{server_cpu_note, DaemonStats, Flow, Outcome};

impl BenchEnv {
    /// `load` (its `k<n>` keys sent as the version ids `n`) to a Berlin-day counter rolled into
    /// `version_downloads` with `insert_missing`, written by the flush (`direct`) or folded by
    /// the rollup; timed until the table holds every event, then checked exact.
    pub(crate) async fn tallyd_to_table(
        &self,
        name: &'static str,
        direct: bool,
        zone: &str,
        load: Load,
    ) -> Result<Outcome> {
        self.reset_version_downloads().await?;
        let (events, keys) = (load.events, load.keys);
        let buffers = load.buffers.into_iter().map(numeric_keys).collect();
        let daemon = self
            .spawn_daemon(name, |c| {
                let counter = &mut c.counters[0];
                counter.key_type = KeyTypeName::Bigint;
                counter.window = Some(Span::Day);
                counter.time_zone = Some(zone.into());
                counter.rollup_into = Some(RollupInto {
                    table: "public.version_downloads".into(),
                    key_column: "version_id".into(),
                    window_column: Some("date".into()),
                    column: "downloads".into(),
                    insert_missing: true,
                    direct,
                    on_add: Default::default(),
                });
                // The daemon's own rollup at its defaults (every 10 s, adaptive steps).
                c.rollup.enabled = true;
            })
            .await?;
        let before = daemon.usage().await?;
        let server_before = self.server_cpu()?;
        let started = Instant::now();
        let sent = send(&daemon.socket, buffers, true).await?;
        let accepted = flush_replies(&sent.replies)?;
        ensure!(
            accepted == events,
            "{name}: sent {events} events, tallyd accepted {accepted} (see {})",
            daemon.log.display()
        );
        let committed = self.wait_version_downloads(name, events, || Ok(())).await?;
        let server_cpu = self.server_cpu()? - server_before;
        let after = daemon.usage().await?;
        self.check_version_downloads(name, events, keys).await?;
        let peak_kib = daemon.status_kib("VmHWM")?;
        daemon.stop().await?;
        let rows = after.rows - before.rows;
        let mut note = format!(
            "exact in version_downloads: {events} events, {keys} versions; {} (flush and \
             rollup); table complete {:.2} s after the last !flush answer",
            server_cpu_note(server_cpu, rows),
            (committed - started).as_secs_f64() - sent.elapsed.as_secs_f64()
        );
        let per_million = server_cpu * 1e6 / events as f64;
        let _ = write!(note, "; server CPU {per_million:.2} s per million events");
        Ok(Outcome::daemon(
            name,
            events,
            committed - started,
            DaemonStats {
                ingest: sent.ingest,
                flow: Some(Flow::between(&before, &after)),
                peak_rss_mib: peak_kib as f64 / 1024.0,
                bytes_per_key: None,
            },
            note,
        ))
    }
}

/// A load buffer with its `bench k<n>` lines as `bench <n>`: the version id the bigint counter
/// takes (the peer maps `k<n>` to version `n` too, bench/src/redis_daily.rs).
fn numeric_keys(buffer: Vec<u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(buffer.len());
    for line in buffer.split_inclusive(|&b| b == b'\n') {
        match line.iter().position(|&b| b == b' ') {
            Some(space) if line.get(space + 1) == Some(&b'k') => {
                out.extend_from_slice(&line[..=space]);
                out.extend_from_slice(&line[space + 2..]);
            }
            _ => out.extend_from_slice(line),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k_keys_become_version_ids() {
        assert_eq!(
            numeric_keys(b"bench k12\nbench k3\n!flush\n".to_vec()),
            b"bench 12\nbench 3\n!flush\n".to_vec()
        );
    }
}
