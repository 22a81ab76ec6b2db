//! The application's own per-day table the per-day scenarios fill: crates.io's
//! `version_downloads(version_id, date, downloads)`, emptied before each scenario, the wait
//! until it holds what was sent, and the exactness check after. Today the `redis-daily` peer
//! writes it; a tallyd scenario with a `window = "day"` counter rolled into it reuses the same
//! three calls, so both are timed and checked alike.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Result};

use crate::env::BenchEnv;

/// The table, as crates.io declares it (without the foreign key to `versions`, which no
/// scenario here needs).
const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS version_downloads (
    version_id bigint NOT NULL,
    date date NOT NULL,
    downloads bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (version_id, date))";

/// How often the wait reads the table's sum, at most. It waits at least four times as long as
/// the last sum took, so on a million rows (tens of ms a sum) the poll costs the server at most
/// a fifth of a core, and the time it returns is late by at most about five sums.
const POLL: Duration = Duration::from_millis(10);
/// How long the wait gives the writer to reach the sum.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(300);

const SUM: &str = "SELECT coalesce(sum(downloads), 0)::bigint FROM version_downloads";

impl BenchEnv {
    /// Creates `version_downloads` if needed, empty.
    pub(crate) async fn reset_version_downloads(&self) -> Result<()> {
        let client = self.db.connect().await?;
        client
            .batch_execute(&format!("{SCHEMA}; TRUNCATE version_downloads"))
            .await?;
        Ok(())
    }

    /// Waits until `version_downloads` sums to `events`, and returns when it first did.
    /// `writer_alive` is asked before every read: an error from it (the writer died) ends the
    /// wait with that error instead of waiting out the timeout.
    pub(crate) async fn wait_version_downloads(
        &self,
        name: &str,
        events: u64,
        mut writer_alive: impl FnMut() -> Result<()>,
    ) -> Result<Instant> {
        let client = self.db.connect().await?;
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        loop {
            writer_alive()?;
            let asked = Instant::now();
            let stored: i64 = client.query_one(SUM, &[]).await?.get(0);
            let took = asked.elapsed();
            if stored as u64 == events {
                return Ok(asked + took / 2);
            }
            ensure!(
                (stored as u64) < events,
                "{name}: version_downloads sums to {stored}, more than the {events} events sent"
            );
            if asked > deadline {
                bail!("{name}: version_downloads holds {stored} of {events} events after {SETTLE_TIMEOUT:?}");
            }
            tokio::time::sleep(POLL.max(took * 4)).await;
        }
    }

    /// The exactness check: `version_downloads` sums to `events` over `keys` versions.
    pub(crate) async fn check_version_downloads(
        &self,
        name: &str,
        events: u64,
        keys: u64,
    ) -> Result<()> {
        let client = self.db.connect().await?;
        let row = client
            .query_one(
                "SELECT count(DISTINCT version_id), coalesce(sum(downloads), 0)::bigint \
                 FROM version_downloads",
                &[],
            )
            .await?;
        let (stored_keys, stored_events): (i64, i64) = (row.get(0), row.get(1));
        ensure!(
            stored_events as u64 == events && stored_keys as u64 == keys,
            "{name}: NOT EXACT: sent {events} events on {keys} versions, version_downloads \
             holds {stored_events} events on {stored_keys} versions"
        );
        Ok(())
    }
}

/// The UTC day `days_back` days before `now`, as `YYYY-MM-DD` (the `date` an event counts for).
pub(crate) fn utc_day(now: SystemTime, days_back: u64) -> String {
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (y, m, d) = civil_from_days((secs / 86_400).saturating_sub(days_back) as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar (Howard
/// Hinnant's `civil_from_days`), so the bench needs no calendar crate for one date a batch.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_map_to_calendar_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(10_957 + 31 + 28), (2000, 2, 29));
        assert_eq!(civil_from_days(10_957 + 31 + 29), (2000, 3, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_723 + 365), (2024, 12, 31));
        let at = UNIX_EPOCH + Duration::from_secs(19_782 * 86_400 + 86_399);
        assert_eq!(utc_day(at, 0), "2024-02-29");
        assert_eq!(utc_day(at, 1), "2024-02-28");
    }
}
