//! File descriptors: the soft `RLIMIT_NOFILE` raised to the hard limit at start, and the share
//! of it stream connections may hold, so that the database connections, the journal and the
//! HTTP endpoint always find one. Without the share, idle clients could take every descriptor:
//! a flush could then not reconnect to its database until some of them left.

use std::io;

use tracing::{info, warn};

use crate::config::{Config, MetricsConfig};

/// Descriptors the journal may hold at once: its segment, the directory it syncs, a segment
/// it opens while the previous one closes.
const JOURNAL: usize = 3;

/// Descriptors for what comes and goes: a reload's database connection, a flush connection
/// still closing while its replacement opens, a refused connection before it is closed.
const MARGIN: usize = 16;

/// The process's descriptor limits (`getrlimit(RLIMIT_NOFILE)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub soft: u64,
    pub hard: u64,
}

impl Limits {
    pub fn current() -> io::Result<Limits> {
        let mut now = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct we own.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut now) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Limits {
            soft: now.rlim_cur,
            hard: now.rlim_max,
        })
    }
}

/// Raises the soft descriptor limit to the hard one, once at start (a process inherits a soft
/// limit of 1,024 from most shells and service managers, whatever the hard limit allows), and
/// logs both. A failure is logged and tallyd goes on with the limit it has.
pub fn raise_limit() {
    let before = match Limits::current() {
        Ok(limits) => limits,
        Err(err) => {
            warn!(cause = %err, "cannot read the file descriptor limit (RLIMIT_NOFILE)");
            return;
        }
    };
    if before.soft >= before.hard {
        info!(
            soft = before.soft,
            hard = before.hard,
            "file descriptor limit (RLIMIT_NOFILE)"
        );
        return;
    }
    let raised = libc::rlimit {
        rlim_cur: before.hard as libc::rlim_t,
        rlim_max: before.hard as libc::rlim_t,
    };
    // SAFETY: setrlimit reads the struct we own.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        let err = io::Error::last_os_error();
        warn!(soft = before.soft, hard = before.hard, cause = %err,
            "cannot raise the soft file descriptor limit (RLIMIT_NOFILE) to the hard limit");
        return;
    }
    info!(
        soft = before.hard,
        hard = before.hard,
        was = before.soft,
        "file descriptor limit (RLIMIT_NOFILE): soft limit raised to the hard limit"
    );
}

/// Descriptors kept for everything but stream connections, as `config` needs them, beyond the
/// `open` ones already open when serving starts (the sockets, the data_dir lock, the log, the
/// runtime's own).
pub fn reserve(config: &Config, open: usize) -> usize {
    let databases = config.database.databases().len();
    // Its flush connections, its rollup's, the lease heartbeat's.
    let per_database = config.flush.connections + usize::from(config.rollup.enabled) + 1;
    let journal = if config.journal.enabled { JOURNAL } else { 0 };
    let http = match config.metrics.listen() {
        Some(_) => MetricsConfig::HTTP_CONNECTIONS,
        None => 0,
    };
    open + databases * per_database + journal + http + MARGIN
}

/// How many stream connections may hold a descriptor at once: the soft limit minus `reserve`.
pub fn budget(soft: u64, reserve: usize) -> usize {
    usize::try_from(soft)
        .unwrap_or(usize::MAX)
        .saturating_sub(reserve)
}

/// The stream connections' share of the descriptors, for `config`, as the process stands now
/// (call it when serving starts); `None` when the limit or the open descriptors cannot be read.
/// Logs it, and says so when it is below `listen.max_connections`.
pub fn connection_budget(config: &Config) -> Option<usize> {
    let soft = match Limits::current() {
        Ok(limits) => limits.soft,
        Err(err) => {
            warn!(cause = %err, "cannot read the file descriptor limit: stream connections are limited by listen.max_connections alone");
            return None;
        }
    };
    let open = match open_descriptors() {
        Ok(open) => open,
        Err(err) => {
            warn!(cause = %err, "cannot count the open file descriptors (/proc/self/fd): stream connections are limited by listen.max_connections alone");
            return None;
        }
    };
    let reserve = reserve(config, open);
    let budget = budget(soft, reserve);
    let max_connections = config.listen.max_connections;
    if budget < max_connections {
        warn!(
            budget,
            soft_limit = soft,
            reserve,
            max_connections,
            "the file descriptor limit allows fewer stream connections than listen.max_connections: \
             beyond the budget, new connections are refused; raise the limit (LimitNOFILE) or lower listen.max_connections"
        );
    } else {
        info!(
            budget,
            soft_limit = soft,
            reserve,
            "file descriptors kept for the database connections, the journal and the HTTP endpoint"
        );
    }
    Some(budget)
}

/// The descriptors this process has open (not counting the one that lists them).
fn open_descriptors() -> io::Result<usize> {
    Ok(std::fs::read_dir("/proc/self/fd")?
        .count()
        .saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_counts_every_database_connection_the_journal_and_the_http_slots() {
        let mut config = Config::default();
        config.database.shards = vec!["postgres:///a".into(), "postgres:///b".into()];
        config.flush.connections = 4;
        config.rollup.enabled = true;
        config.journal.enabled = true;
        config.metrics.set_listen(Some("127.0.0.1:9187".into()));
        // 2 databases × (4 flush + 1 rollup + 1 lease) + 3 journal + 32 HTTP + 16 margin.
        assert_eq!(reserve(&config, 10), 10 + 12 + 3 + 32 + 16);
        config.rollup.enabled = false;
        config.journal.enabled = false;
        config.metrics.set_listen(None);
        assert_eq!(reserve(&config, 10), 10 + 10 + 16);
    }

    #[test]
    fn the_budget_is_what_the_soft_limit_leaves() {
        assert_eq!(budget(256, 100), 156);
        assert_eq!(
            budget(64, 100),
            0,
            "a reserve above the limit leaves nothing"
        );
        assert_eq!(budget(u64::MAX, 100), usize::MAX - 100);
    }

    #[test]
    fn the_limits_can_be_read() {
        let limits = Limits::current().unwrap();
        assert!(limits.soft <= limits.hard);
        assert!(
            open_descriptors().unwrap() >= 3,
            "at least stdin, stdout, stderr"
        );
    }
}
