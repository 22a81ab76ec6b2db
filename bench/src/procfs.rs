//! What the bench reads from `/proc`: fields of `status` and `meminfo`, a process's CPU time,
//! and the CPU time of the bench's whole PostgreSQL server.

use anyhow::{Context, Result};

/// A `/proc`-style `name: value` line's value.
pub(crate) fn proc_field(text: &str, name: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == name).then(|| v.trim().to_string())
    })
}

/// A `/proc`-style `Name:   1234 kB` line's number.
pub(crate) fn proc_kib(text: &str, name: &str) -> Option<u64> {
    proc_field(text, name)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `/proc/<pid>/stat` fields 14 and 15 (utime, stime), counted after the `)` that ends the name.
fn cpu_ticks(stat: &str) -> Option<u64> {
    let fields = stat_fields(stat);
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

/// utime + stime of process `pid`, in seconds.
pub(crate) fn cpu_seconds_of(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    cpu_ticks(&stat)
        .map(|t| t as f64 / clock_ticks())
        .context("unreadable /proc/<pid>/stat")
}

/// CPU seconds of the whole PostgreSQL server whose postmaster is `postmaster`: its own utime +
/// stime, its reaped children's (cutime + cstime: backends that have exited), and those of its
/// live children (backends, checkpointer, WAL writer, autovacuum). Load-independent where
/// rates are not, on a machine shared with other work.
pub(crate) fn server_cpu_seconds(postmaster: u32) -> Result<f64> {
    let mut ticks = 0u64;
    for entry in std::fs::read_dir("/proc")? {
        let name = entry?.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        // A process may exit between the listing and the read: it is counted in cutime then.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let fields = stat_fields(&stat);
        let field = |i: usize| {
            fields
                .get(i)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0)
        };
        if pid == postmaster {
            ticks += field(11) + field(12) + field(13) + field(14);
        } else if field(1) == u64::from(postmaster) {
            ticks += field(11) + field(12);
        }
    }
    Ok(ticks as f64 / clock_ticks())
}

/// The fields of a `/proc/<pid>/stat` line after the `)` that ends the name (the state first).
fn stat_fields(stat: &str) -> Vec<&str> {
    stat.rfind(')')
        .map_or_else(Vec::new, |i| stat[i + 1..].split_whitespace().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks_skip_the_process_name() {
        let stat = "123 (tall yd) S 1 123 123 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0";
        assert_eq!(cpu_ticks(stat), Some(300));
    }
}
