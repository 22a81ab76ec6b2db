//! The status view as the readable text `tallyd status` prints (`--json` prints the JSON).

use std::fmt::Write;

use super::{CounterStatus, DbStatus, Status};

impl Status {
    /// A few aligned tables: the daemon, counters (with their hottest keys), databases, the
    /// journal.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let ready = if self.ready {
            "ready".to_string()
        } else {
            format!("NOT READY: {}", self.reasons.join("; "))
        };
        let _ = writeln!(
            out,
            "tallyd {}, {}, up {}, {} connections open\n{ready}",
            self.version,
            self.phase,
            seconds(self.uptime_seconds),
            self.connections_open
        );
        if let Some(m) = &self.memory {
            let _ = writeln!(
                out,
                "memory cap: {} of {} keys ({:.1}%); {} keys, {} events pending",
                m.counted_keys,
                m.max_pending_keys,
                m.used * 100.0,
                m.pending_keys,
                m.pending_events
            );
        }
        out.push('\n');
        out.push_str(&self.counter_table());
        out.push('\n');
        out.push_str(&database_table(&self.databases));
        if let Some(j) = &self.journal {
            let oldest = j
                .oldest_segment_age_seconds
                .map_or("-".to_string(), seconds);
            let _ = writeln!(
                out,
                "\njournal: {} segments, {} bytes ({:.0}% of journal.max_bytes), oldest segment {oldest}, {}",
                j.segments,
                j.bytes,
                j.used * 100.0,
                if j.writable {
                    "writable"
                } else {
                    "WRITES FAILING"
                }
            );
        }
        if let Some(b) = &self.batches {
            let _ = writeln!(
                out,
                "batches: {} ids remembered, oldest claim {}, {} held",
                b.remembered.map_or("-".to_string(), |n| n.to_string()),
                b.oldest_claim_age_seconds.map_or("-".to_string(), seconds),
                b.held
            );
        }
        out
    }

    fn counter_table(&self) -> String {
        let mut rows = vec![vec![
            "COUNTER".to_string(),
            "PENDING KEYS".to_string(),
            "PENDING EVENTS".to_string(),
        ]];
        rows.extend(self.counters.iter().map(|c| {
            vec![
                c.name.clone(),
                c.pending_keys.to_string(),
                c.pending_events.to_string(),
            ]
        }));
        let mut out = align(&rows);
        if self.hottest_shown {
            for c in self.counters.iter().filter(|c| !c.hottest.is_empty()) {
                let _ = writeln!(out, "hottest {}: {}", c.name, hottest(c));
            }
            if !self.hottest_complete {
                out.push_str("(hottest keys from a sample: a bucket was busy or held many keys)\n");
            }
        }
        out
    }
}

fn hottest(c: &CounterStatus) -> String {
    c.hottest
        .iter()
        .map(|h| format!("{:?} ({} events, sum {})", h.key, h.events, h.sum))
        .collect::<Vec<_>>()
        .join(", ")
}

fn database_table(dbs: &[DbStatus]) -> String {
    let mut rows = vec![[
        "DATABASE",
        "STATE",
        "LAST FLUSH",
        "FLUSH LAG",
        "RETRIES",
        "SLOT ROWS",
        "NAME",
    ]
    .map(String::from)
    .to_vec()];
    rows.extend(dbs.iter().map(|d| {
        vec![
            d.index.to_string(),
            match d.up {
                None => "unknown".to_string(),
                Some(true) => "up".to_string(),
                Some(false) => "DOWN".to_string(),
            },
            d.last_flush_age_seconds
                .map_or("never".to_string(), |s| format!("{} ago", seconds(s))),
            d.flush_lag_seconds.map_or("-".to_string(), seconds),
            d.retries.to_string(),
            d.slot_rows.map_or("-".to_string(), |n| n.to_string()),
            d.name.clone(),
        ]
    }));
    let mut out = align(&rows);
    for d in dbs.iter().filter(|d| d.up == Some(false)) {
        if let Some(err) = &d.last_error {
            let _ = writeln!(out, "database {} last error: {err}", d.index);
        }
    }
    out
}

/// Columns padded to their widest cell, two spaces apart.
fn align(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// `0.4s`, `12s`, `3m05s`, `2h01m`.
fn seconds(s: f64) -> String {
    if s < 10.0 {
        format!("{s:.1}s")
    } else if s < 60.0 {
        format!("{}s", s as u64)
    } else if s < 3600.0 {
        format!("{}m{:02}s", s as u64 / 60, s as u64 % 60)
    } else {
        format!("{}h{:02}m", s as u64 / 3600, s as u64 % 3600 / 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_at_a_glance() {
        assert_eq!(seconds(0.42), "0.4s");
        assert_eq!(seconds(42.0), "42s");
        assert_eq!(seconds(185.0), "3m05s");
        assert_eq!(seconds(7260.0), "2h01m");
    }

    #[test]
    fn columns_align_to_the_widest_cell() {
        let rows = vec![
            vec!["A".to_string(), "BB".to_string()],
            vec!["long".to_string(), "x".to_string()],
        ];
        assert_eq!(align(&rows), "A     BB\nlong  x\n");
    }
}
