//! Opening connections: one [`Db`] per database, parsed once from its connection string
//! (conninfo.rs), connected with libpq's `sslmode` fallbacks (tls.rs), and failures that name
//! the database (without its password) and say why.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::config::Host;
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;
use tokio_postgres_rustls::MakeRustlsConnect;
use tracing::debug;

use super::conninfo::{self, Conninfo, ConninfoError};
use super::tls::{self, CertProblem, SslMode};
use super::{DbError, StoreError};

/// Where the database is: a parsed connection config, connected to as often as needed.
#[derive(Clone)]
pub struct Db {
    info: Conninfo,
    tls: Option<MakeRustlsConnect>,
    /// `SET LOCAL ...` for the start of each flush transaction (see `with_timeouts`).
    transaction_settings: Option<Arc<str>>,
}

impl fmt::Debug for Db {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Db({}, sslmode={})",
            self.info.redacted, self.info.sslmode
        )
    }
}

#[derive(Debug, thiserror::Error)]
#[error("cannot connect to database {database} (sslmode={sslmode}): {}", explain(.cause, .targets, *.sslmode, .password))]
pub struct ConnectError {
    database: String,
    /// Each `host:port` or socket file tried.
    targets: String,
    sslmode: SslMode,
    password: PasswordSource,
    /// Not a `source()`: the message above already says everything it holds, once.
    cause: tokio_postgres::Error,
}

impl ConnectError {
    pub(crate) fn into_source(self) -> tokio_postgres::Error {
        self.cause
    }
}

/// Where the password came from, so that a refusal can say so without showing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PasswordSource {
    None,
    Given,
}

impl Db {
    /// Accepts a `postgres://` URL or a libpq `key=value` string, with libpq's `PG*` environment
    /// variables as defaults. `application_name` defaults to `tallyd`.
    pub fn new(conninfo: &str, connect_timeout: Duration) -> Result<Db, StoreError> {
        Db::with_env(conninfo, connect_timeout, &|name| std::env::var(name).ok())
    }

    /// [`Db::new`] with the environment given (tests).
    pub fn with_env(
        conninfo: &str,
        connect_timeout: Duration,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Db, StoreError> {
        let mut info = conninfo::parse(conninfo, env)?;
        if info.config.get_connect_timeout().is_none() {
            info.config.connect_timeout(connect_timeout);
        }
        let default = info.fallback_application_name.clone();
        if !info.application_name_set {
            info.config
                .application_name(default.as_deref().unwrap_or("tallyd"));
        }
        // libpq reads no certificate for a Unix socket: it never uses TLS there.
        let mode = if unix_only(&info.config) {
            SslMode::Disable
        } else {
            info.sslmode
        };
        let tls =
            tls::connector(mode, &info.files, info.sni).map_err(|source| ConninfoError::Tls {
                redacted: info.redacted.clone(),
                cause: source,
            })?;
        Ok(Db {
            info,
            tls,
            transaction_settings: None,
        })
    }

    /// Sets `application_name` unless the connection string or `PGAPPNAME` chose one.
    pub fn default_application_name(mut self, name: &str) -> Db {
        if !self.info.application_name_set && self.info.fallback_application_name.is_none() {
            self.info.config.application_name(name);
        }
        self
    }

    /// The same database, with `lock_timeout` and `statement_timeout` (`None` leaves the
    /// server's setting) for the transactions that ask for [`Db::transaction_settings`].
    /// `SET LOCAL` in each transaction rather than startup options (`-c name=value`): PgBouncer
    /// refuses an `options` startup parameter, or ignores it when told to, and a session-level
    /// `SET` would stay on a pooled server connection for other clients.
    pub fn with_timeouts(
        mut self,
        lock_timeout: Option<Duration>,
        statement_timeout: Option<Duration>,
    ) -> Db {
        let sql: Vec<String> = [
            ("lock_timeout", lock_timeout),
            ("statement_timeout", statement_timeout),
        ]
        .iter()
        .filter_map(|(name, t)| Some((name, t.filter(|t| !t.is_zero())?)))
        .map(|(name, t)| format!("SET LOCAL {name} = {}", t.as_millis()))
        .collect();
        self.transaction_settings = (!sql.is_empty()).then(|| sql.join("; ").into());
        self
    }

    /// What to run first in a transaction that wants this database's timeouts.
    pub fn transaction_settings(&self) -> Option<&str> {
        self.transaction_settings.as_deref()
    }

    /// The database as messages name it: hosts, ports, database and user, never a password.
    pub fn name(&self) -> &str {
        &self.info.redacted
    }

    /// A fresh connection; its driver task ends when the client is dropped. `allow` tries
    /// without TLS first and `prefer` with TLS first, each trying the other way once when the
    /// server refuses the first (pg_hba.conf's `hostssl` / `hostnossl`), as libpq does; `prefer`
    /// also goes on without TLS when the TLS handshake fails (libpq's fallback too: a root
    /// certificate file the server's certificate does not verify against, a protocol mismatch).
    pub async fn connect(&self) -> Result<Client, DbError> {
        Ok(self.connect_watched().await?.0)
    }

    /// [`Db::connect`], with the [`Ending`] of the connection: why it closed, once it has.
    pub async fn connect_watched(&self) -> Result<(Client, Ending), DbError> {
        use tokio_postgres::config::SslMode as Wire;
        let mode = self.info.sslmode;
        let unix_only = unix_only(&self.info.config);
        let first = match mode {
            // libpq never uses TLS on a Unix socket, whatever sslmode says.
            _ if unix_only => Wire::Disable,
            SslMode::Disable | SslMode::Allow => Wire::Disable,
            SslMode::Prefer => Wire::Prefer,
            _ => Wire::Require,
        };
        let result = match self.connect_with(first).await {
            Err(e) if refused(&e) && mode == SslMode::Allow && !unix_only => {
                self.connect_with(Wire::Require).await
            }
            Err(e) if refused(&e) && mode == SslMode::Prefer && !unix_only => {
                self.connect_with(Wire::Disable).await
            }
            Err(e) if handshake_failed(&e) && mode == SslMode::Prefer && !unix_only => {
                debug!(cause = %e, "TLS handshake failed; sslmode=prefer tries without TLS");
                match self.connect_with(Wire::Disable).await {
                    // pg_hba.conf wants TLS (hostssl): why TLS failed is what to fix.
                    Err(plain) if refused(&plain) => Err(e),
                    other => other,
                }
            }
            other => other,
        };
        result.map_err(|source| {
            DbError::from(ConnectError {
                database: self.info.redacted.clone(),
                targets: super::error::targets(&self.info.config),
                sslmode: mode,
                password: if self.info.config.get_password().is_some() {
                    PasswordSource::Given
                } else {
                    PasswordSource::None
                },
                cause: source,
            })
        })
    }

    async fn connect_with(
        &self,
        wire: tokio_postgres::config::SslMode,
    ) -> Result<(Client, Ending), tokio_postgres::Error> {
        let mut config = self.info.config.clone();
        config.ssl_mode(wire);
        Ok(match (&self.tls, wire) {
            (Some(tls), w) if w != tokio_postgres::config::SslMode::Disable => {
                let (client, connection) = config.connect(tls.clone()).await?;
                (client, spawn(connection))
            }
            _ => {
                let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
                (client, spawn(connection))
            }
        })
    }
}

/// Why a connection ended, as the task that drives it saw it: the message the server sent
/// before closing the session (a FATAL such as "terminating connection due to
/// idle-in-transaction timeout"), or the socket's error. The client of a closed connection says
/// only "connection closed".
pub struct Ending(tokio::task::JoinHandle<Option<tokio_postgres::Error>>);

/// How long [`Ending`] waits for the driving task: it is already ending when the client sees
/// the connection closed, so this only bounds a surprise.
const ENDING_WAIT: Duration = Duration::from_secs(1);

impl Ending {
    /// `err` with the reason the connection ended, when `err` says only that it had closed.
    pub async fn explain(self, err: DbError) -> DbError {
        if !err.is_closed() {
            return err;
        }
        match self.wait().await {
            Some(reason) => err.ended_by(reason),
            None => err,
        }
    }

    /// Why the connection ended (its client has seen it closed); `None`: it ended cleanly.
    pub async fn reason(self) -> Option<DbError> {
        self.wait().await.map(DbError::from)
    }

    async fn wait(self) -> Option<tokio_postgres::Error> {
        tokio::time::timeout(ENDING_WAIT, self.0).await.ok()?.ok()?
    }
}

/// Drives `connection` in a task of its own until it ends; the task returns its error.
fn spawn<F>(connection: F) -> Ending
where
    F: Future<Output = Result<(), tokio_postgres::Error>> + Send + 'static,
{
    Ending(tokio::spawn(async move {
        let ended = connection.await.err();
        if let Some(err) = &ended {
            debug!(cause = %DbError::from_ref(err), "database connection ended");
        }
        ended
    }))
}

fn unix_only(config: &tokio_postgres::Config) -> bool {
    config.get_hostaddrs().is_empty()
        && config
            .get_hosts()
            .iter()
            .all(|h| !matches!(h, Host::Tcp(_)))
}

/// pg_hba.conf had no line for this connection (e.g. `hostssl` only, and we came in plain).
fn refused(err: &tokio_postgres::Error) -> bool {
    err.code() == Some(&SqlState::INVALID_AUTHORIZATION_SPECIFICATION)
}

/// The TLS handshake itself failed (not a server without TLS, which `prefer` takes as it is).
fn handshake_failed(err: &tokio_postgres::Error) -> bool {
    let text = err.to_string();
    // tokio-postgres's only sign of its `Kind::Tls`.
    text.starts_with("error performing TLS handshake")
        && !text.contains("server does not support TLS")
}

/// The cause of a failed connection in words (as [`DbError`] says it), with the likely fix.
fn explain(
    err: &tokio_postgres::Error,
    targets: &str,
    mode: SslMode,
    password: &PasswordSource,
) -> String {
    let mut s = super::error::describe_connect(err, targets);
    let hint = match err.as_db_error() {
        Some(db) => db_hint(db, mode, password),
        None => other_hint(err, &s),
    };
    if let Some(h) = hint {
        s.push_str(&format!("; {h}"));
    }
    s
}

fn db_hint(
    db: &tokio_postgres::error::DbError,
    mode: SslMode,
    password: &PasswordSource,
) -> Option<&'static str> {
    let code = db.code();
    if *code == SqlState::INVALID_AUTHORIZATION_SPECIFICATION
        && (db.message().contains("no encryption") || db.message().contains("SSL off"))
        && mode < SslMode::Require
    {
        return Some("the server accepts only TLS connections here (hostssl): use sslmode=require or stronger");
    }
    if *code == SqlState::INVALID_PASSWORD {
        return Some(match password {
            PasswordSource::None => {
                "no password was given: set it in the URL, PGPASSWORD or a password file (passfile)"
            }
            PasswordSource::Given => {
                "the password from the URL, PGPASSWORD or the password file is wrong"
            }
        });
    }
    None
}

fn other_hint(err: &tokio_postgres::Error, text: &str) -> Option<&'static str> {
    let mut cause = std::error::Error::source(err);
    while let Some(c) = cause {
        if let Some(h) = tls_hint(c) {
            return Some(h);
        }
        cause = c.source();
    }
    if text.contains("password missing") {
        return Some(
            "the server asks for a password and none was given: set it in the URL, PGPASSWORD \
             or a password file (passfile, PGPASSFILE, ~/.pgpass)",
        );
    }
    if text.contains("server does not support TLS") {
        return Some("the server has ssl = off; turn it on, or use sslmode=prefer or disable");
    }
    None
}

/// What a certificate the handshake rejected means for the user.
fn tls_hint(err: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    use rustls::CertificateError as C;
    let rustls = err.downcast_ref::<rustls::Error>().or_else(|| {
        err.downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    })?;
    let rustls::Error::InvalidCertificate(cert) = rustls else {
        return None;
    };
    if let C::Other(other) = cert {
        return match other.0.downcast_ref::<CertProblem>()? {
            CertProblem::UnsupportedVersion(_) => Some(
                "the server's certificate is X.509 version 1 or 2 (as CREATE EXTENSION citus \
                 makes), and tallyd verifies only version 3 certificates (verify-ca, verify-full, \
                 or a root certificate file in any mode): give the server a version 3 \
                 certificate signed by a CA in sslrootcert, or use sslmode=require without a \
                 root certificate file (encrypted, server not authenticated)",
            ),
            CertProblem::HandshakeSignature => Some(
                "the server does not hold the private key of the certificate it sent: \
                 something between tallyd and the server may be intercepting the connection",
            ),
        };
    }
    Some(match cert {
        C::UnknownIssuer | C::BadSignature => {
            "the server's certificate is not signed by a CA in sslrootcert"
        }
        C::NotValidForName | C::NotValidForNameContext { .. } => {
            "the server's certificate does not name this host (verify-full checks the name; \
             verify-ca does not)"
        }
        C::Expired | C::ExpiredContext { .. } => "the server's certificate has expired",
        _ => return None,
    })
}
