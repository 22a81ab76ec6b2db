//! One way to print a database error: everything the server or the operating system said, once.
//!
//! `tokio_postgres::Error` displays only its kind (`db error`, `error connecting to server`) and
//! hides the server's message, SQLSTATE, detail and hint, or the OS error, behind `source()`.
//! [`DbError`] prints all of it in its message and returns no source, so a log line
//! (`cause = %err`) and the CLI's error chain (`{err:#}`) both show the cause exactly once.

use std::error::Error as _;
use std::fmt;

use tokio_postgres::error::SqlState;

/// A tokio-postgres error, with the address tried when it happened while connecting.
#[derive(Debug)]
pub struct DbError {
    err: tokio_postgres::Error,
    /// Where a failed connection went: `host:port` or a socket path.
    target: Option<String>,
    /// The whole message, when a failed connection was already described (store/connect.rs).
    message: Option<String>,
    /// Why the connection had ended, when `err` says only that it was closed: what the server
    /// said before closing the session, or the socket's error (store/connect.rs, `Ending`).
    ended: Option<tokio_postgres::Error>,
}

impl From<super::ConnectError> for DbError {
    fn from(err: super::ConnectError) -> DbError {
        let message = err.to_string();
        DbError {
            err: err.into_source(),
            target: None,
            message: Some(message),
            ended: None,
        }
    }
}

impl DbError {
    /// `err`, which happened while connecting to `target`.
    pub fn connecting(err: tokio_postgres::Error, target: String) -> DbError {
        DbError {
            err,
            target: Some(target),
            message: None,
            ended: None,
        }
    }

    /// This error (the connection was closed) with why the connection had ended.
    pub(super) fn ended_by(self, reason: tokio_postgres::Error) -> DbError {
        DbError {
            ended: Some(reason),
            ..self
        }
    }

    /// The error is a failed connection, whose message already names the database.
    pub fn is_connect(&self) -> bool {
        self.message.is_some()
    }

    /// The connection had closed (the server ended the session, or the socket failed).
    pub fn is_closed(&self) -> bool {
        self.err.is_closed()
    }

    /// The server's SQLSTATE, when the server reported the error (or, for a closed connection,
    /// the message it ended the session with).
    pub fn code(&self) -> Option<&SqlState> {
        self.err
            .code()
            .or_else(|| self.ended.as_ref().and_then(|e| e.code()))
    }

    /// The statement was cancelled by `statement_timeout` (or by an operator's cancel request).
    pub fn is_statement_timeout(&self) -> bool {
        self.code() == Some(&SqlState::QUERY_CANCELED)
    }

    /// `tallyd.check_shard_map` refused a flush: another tallyd moved logical shards of this
    /// database since this one read its map (SQLSTATE TD001, migrations/V8).
    pub fn is_shard_map_changed(&self) -> bool {
        self.code().is_some_and(|c| c.code() == "TD001")
    }

    /// A statement named the hll extension's type or functions, which the database does not
    /// have (SQLSTATE 42704 or 42883): the extension was dropped (`DROP EXTENSION hll`).
    pub fn is_missing_hll(&self) -> bool {
        let Some(db) = self.err.as_db_error() else {
            return false;
        };
        matches!(db.code().code(), "42704" | "42883") && db.message().contains("hll")
    }

    /// `tallyd.correct` refused a correction whose set would move a row beside its window
    /// beyond the 64-bit range (SQLSTATE TD003, migrations/V15): its position in the call's
    /// arrays, from 1.
    pub fn refused_correction(&self) -> Option<usize> {
        let db = self.err.as_db_error()?;
        (db.code().code() == "TD003").then(|| db.detail()?.parse().ok())?
    }
}

impl From<tokio_postgres::Error> for DbError {
    fn from(err: tokio_postgres::Error) -> DbError {
        DbError {
            err,
            target: None,
            message: None,
            ended: None,
        }
    }
}

impl fmt::Display for DbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.message, &self.ended) {
            (Some(message), _) => f.write_str(message),
            (None, Some(reason)) => {
                write!(f, "{}: ", self.err)?;
                describe(reason, self.target.as_deref(), f)
            }
            (None, None) => describe(&self.err, self.target.as_deref(), f),
        }
    }
}

impl DbError {
    /// Describes `err` without owning it.
    pub(super) fn from_ref(err: &tokio_postgres::Error) -> impl fmt::Display + '_ {
        struct Ref<'a>(&'a tokio_postgres::Error);
        impl fmt::Display for Ref<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                describe(self.0, None, f)
            }
        }
        Ref(err)
    }
}

/// No source: the message already carries every cause.
impl std::error::Error for DbError {}

/// For a server error: `message (SQLSTATE xxxxx); detail: ...; hint: ...`. Otherwise the
/// driver's words, the address tried, and each underlying cause (the OS error with its errno).
fn describe(
    err: &tokio_postgres::Error,
    target: Option<&str>,
    f: &mut fmt::Formatter<'_>,
) -> fmt::Result {
    if let Some(db) = err.as_db_error() {
        write!(f, "{} (SQLSTATE {})", db.message(), db.code().code())?;
        if let Some(detail) = db.detail() {
            write!(f, "; detail: {detail}")?;
        }
        if let Some(hint) = db.hint() {
            write!(f, "; hint: {hint}")?;
        }
        return Ok(());
    }
    write!(f, "{err}")?;
    if let Some(target) = target {
        write!(f, " at {target}")?;
    }
    let mut cause = err.source();
    while let Some(c) = cause {
        write!(f, ": {c}")?;
        cause = c.source();
    }
    Ok(())
}

/// A failed connection to `target`, described as [`DbError`] describes it (store/connect.rs adds
/// which database and the likely fix).
pub(crate) fn describe_connect(err: &tokio_postgres::Error, target: &str) -> String {
    struct Connect<'a>(&'a tokio_postgres::Error, &'a str);
    impl fmt::Display for Connect<'_> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            describe(self.0, Some(self.1), f)
        }
    }
    Connect(err, target).to_string()
}

/// A failed migration: refinery's words, with the database error behind them described as
/// above (refinery alone prints it as `db error`).
pub fn migration(err: &refinery::Error) -> String {
    match err.kind() {
        refinery::error::Kind::Connection(what, cause) => {
            match cause.downcast_ref::<tokio_postgres::Error>() {
                Some(pg) => format!("{what}: {}", DbError::from_ref(pg)),
                None => format!("{what}: {cause}"),
            }
        }
        _ => err.to_string(),
    }
}

/// Where `config` connects, for error messages: each `host:port` or socket file, in order.
pub fn targets(config: &tokio_postgres::Config) -> String {
    use tokio_postgres::config::Host;
    let ports = config.get_ports();
    let port = |i: usize| match ports {
        [] => 5432,
        [one] => *one,
        many => many.get(i).copied().unwrap_or(5432),
    };
    let all: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| match host {
            Host::Tcp(name) => format!("{name}:{}", port(i)),
            Host::Unix(dir) => format!("{}/.s.PGSQL.{}", dir.display(), port(i)),
        })
        .collect();
    match all.len() {
        0 => "(no host given)".into(),
        _ => all.join(", "),
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use super::*;

    #[test]
    fn a_bad_connection_string_says_why_once() {
        let err = tokio_postgres::Config::from_str("host=/tmp port=notanumber").unwrap_err();
        let text = DbError::from(err).to_string();
        assert!(text.starts_with("invalid connection string: "), "{text}");
        assert_eq!(
            text.matches("invalid connection string").count(),
            1,
            "{text}"
        );
        assert!(text.contains("port"), "{text}");
    }

    #[test]
    fn targets_name_every_host_with_its_port() {
        let config =
            tokio_postgres::Config::from_str("host=/run/pg,db.example port=5433,6000").unwrap();
        assert_eq!(targets(&config), "/run/pg/.s.PGSQL.5433, db.example:6000");
    }
}
