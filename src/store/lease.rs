//! The instance lease: which one tallyd may write as an `instance_id`. A row in
//! `tallyd.instances` of every database the daemon writes, claimed before replay and before any
//! flush, renewed by a heartbeat, checked inside every flush transaction, expired at a clean stop.
//!
//! A row rather than an advisory lock: it needs no session state (so it works through PgBouncer
//! in transaction pooling mode), and a refusal can name the holder. The holder is identified by
//! a token kept in its data_dir (`instance_owner`, beside `instance_id`), so the same data_dir
//! restarting after kill -9 takes its lease back at once, while another data_dir with the same
//! instance id is refused until the lease expires unrenewed.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::MissedTickBehavior;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, warn};

use super::{Db, DbError, Ending};
use crate::health::Health;
use crate::io_error::IoError;

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error(
        "instance_id {instance_id} is held by another running tallyd (host {host}, pid {pid}, \
         data_dir {data_dir}) in database {database}; its lease expires in {expires_in:.1} s \
         unless it is renewed. Each tallyd needs its own instance_id (a copied config?): set a \
         distinct [daemon] instance_id, or leave it empty to generate one per data_dir. If that \
         tallyd is gone for good, start again once its lease has expired"
    )]
    Held {
        instance_id: String,
        database: usize,
        host: String,
        pid: i32,
        data_dir: String,
        expires_in: f64,
    },
    #[error(
        "instance_id {instance_id}: another tallyd (host {host}, pid {pid}, data_dir {data_dir}) \
         took over this daemon's lease in database {database}, after this one failed to renew \
         it for daemon.instance_lease_ms; stopping without writing (unflushed events stay in \
         the journal). Each tallyd needs its own instance_id"
    )]
    Lost {
        instance_id: String,
        database: usize,
        host: String,
        pid: i32,
        data_dir: String,
    },
    #[error(transparent)]
    Io(#[from] IoError),
    #[error(
        "database {database} has no tallyd.instances: its schema is older than this tallyd; run \
         `tallyd migrate` (or set [database] migrate = true)"
    )]
    Unmigrated { database: usize },
    #[error("database {database}: cannot claim the instance lease: {cause}")]
    Postgres { database: usize, cause: DbError },
}

/// Why one claim did not succeed.
enum Claim {
    Db(DbError),
    Held(LeaseError),
}

impl From<tokio_postgres::Error> for Claim {
    fn from(e: tokio_postgres::Error) -> Claim {
        Claim::Db(e.into())
    }
}

/// This daemon's claim on its instance id.
#[derive(Debug)]
pub struct Lease {
    pub instance_id: String,
    /// Identifies the data_dir: kept in `data_dir/instance_owner`.
    pub owner: String,
    host: String,
    pid: i32,
    data_dir: String,
    duration_ms: i64,
}

const CLAIM: &str = "\
INSERT INTO tallyd.instances AS i (instance_id, owner, host, pid, data_dir, heartbeat_at, expires_at)
VALUES ($1, $2, $3, $4, $5, clock_timestamp(), clock_timestamp() + $6::bigint * interval '1 millisecond')
ON CONFLICT (instance_id) DO UPDATE SET owner = EXCLUDED.owner, host = EXCLUDED.host,
    pid = EXCLUDED.pid, data_dir = EXCLUDED.data_dir, heartbeat_at = EXCLUDED.heartbeat_at,
    expires_at = EXCLUDED.expires_at
WHERE i.owner = EXCLUDED.owner OR i.expires_at < clock_timestamp()
RETURNING 1";

const HOLDER: &str = "\
SELECT owner, host, pid, data_dir, extract(epoch FROM expires_at - clock_timestamp())::float8
FROM tallyd.instances WHERE instance_id = $1";

const RENEW: &str = "\
UPDATE tallyd.instances SET heartbeat_at = clock_timestamp(),
    expires_at = clock_timestamp() + $3::bigint * interval '1 millisecond'
WHERE instance_id = $1 AND owner = $2";

impl Lease {
    /// The lease this data_dir would hold on `instance_id`, creating its owner token if needed.
    pub fn new(
        instance_id: &str,
        data_dir: &Path,
        duration: Duration,
    ) -> Result<Lease, LeaseError> {
        let path = data_dir.join("instance_owner");
        let io = |what, cause| LeaseError::Io(IoError::on(what, &path)(cause));
        let owner = match std::fs::read_to_string(&path) {
            Ok(token) if !token.trim().is_empty() => token.trim().to_string(),
            Ok(_) => new_token(&path).map_err(|e| io("cannot write", e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                new_token(&path).map_err(|e| io("cannot write", e))?
            }
            Err(e) => return Err(io("cannot read", e)),
        };
        let data_dir = std::path::absolute(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
        Ok(Lease {
            instance_id: instance_id.to_string(),
            owner,
            host: hostname(),
            pid: std::process::id() as i32,
            data_dir: data_dir.display().to_string(),
            duration_ms: duration.as_millis() as i64,
        })
    }

    /// Claims the instance id in every database, or says who holds it. Also adopts the ledger
    /// rows of this instance id written before leases existed (owner '').
    pub async fn claim(&self, dbs: &[Db]) -> Result<(), LeaseError> {
        for (database, db) in dbs.iter().enumerate() {
            let pg = |cause: DbError| {
                if cause.code() == Some(&SqlState::UNDEFINED_TABLE) {
                    LeaseError::Unmigrated { database }
                } else {
                    LeaseError::Postgres { database, cause }
                }
            };
            let mut client = db.connect().await.map_err(pg)?;
            loop {
                match self.claim_one(&mut client, database).await {
                    Err(Claim::Db(e)) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                        // The previous holder is inside a flush transaction, which locks the
                        // lease row: a takeover waits for it to end, or that flush could still
                        // commit after the takeover.
                        warn!(instance_id = %self.instance_id, database,
                            "waiting for a transaction of the lease's previous holder to end");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(Claim::Db(e)) => return Err(pg(e)),
                    Err(Claim::Held(e)) => return Err(e),
                    Ok(()) => break,
                }
            }
        }
        Ok(())
    }

    /// One try at the claim in one database, waiting at most 2 s for the lease row's lock.
    async fn claim_one(&self, client: &mut Client, database: usize) -> Result<(), Claim> {
        let tx = client.transaction().await?;
        tx.batch_execute("SET LOCAL lock_timeout = '2s'").await?;
        if let Some(row) = tx.query_opt(HOLDER, &[&self.instance_id]).await? {
            if row.get::<_, String>(0) != self.owner {
                let (host, pid, dir): (String, i32, String) = (row.get(1), row.get(2), row.get(3));
                warn!(instance_id = %self.instance_id, database, %host, pid, data_dir = %dir,
                    "another data_dir held this instance id before; its lease has expired");
            }
        }
        let params: [&(dyn ToSql + Sync); 6] = [
            &self.instance_id,
            &self.owner,
            &self.host,
            &self.pid,
            &self.data_dir,
            &self.duration_ms,
        ];
        if tx.query_opt(CLAIM, &params).await?.is_none() {
            drop(tx);
            // Outside a transaction: unnamed, for transaction poolers.
            let row = client
                .query_typed_one(HOLDER, &[(&self.instance_id, Type::TEXT)])
                .await?;
            return Err(Claim::Held(LeaseError::Held {
                instance_id: self.instance_id.clone(),
                database,
                host: row.get(1),
                pid: row.get(2),
                data_dir: row.get(3),
                expires_in: row.get::<_, f64>(4).max(0.0),
            }));
        }
        tx.execute(
            "UPDATE tallyd.flushes SET owner = $2 WHERE instance_id = $1 AND owner = ''",
            &[&self.instance_id, &self.owner],
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Extends the lease in one database; false when another data_dir holds it now.
    async fn renew(&self, client: &Client) -> Result<bool, DbError> {
        let n = client
            .execute_typed(
                RENEW,
                &[
                    (&self.instance_id, Type::TEXT),
                    (&self.owner, Type::TEXT),
                    (&self.duration_ms, Type::INT8),
                ],
            )
            .await?;
        Ok(n == 1)
    }

    /// Who holds the lease in `client`'s database now, as the error this daemon stops with.
    async fn lost(&self, client: &Client, database: usize) -> LeaseError {
        let row = client
            .query_typed_opt(HOLDER, &[(&self.instance_id, Type::TEXT)])
            .await;
        let (host, pid, data_dir) = match row {
            Ok(Some(r)) => (r.get(1), r.get(2), r.get(3)),
            _ => ("?".to_string(), 0, "?".to_string()),
        };
        LeaseError::Lost {
            instance_id: self.instance_id.clone(),
            database,
            host,
            pid,
            data_dir,
        }
    }

    /// Renews the lease in every database every third of its duration until `stop`, so that two
    /// missed renewals in a row still leave it held. When another data_dir has taken it over,
    /// cancels `on_lost` and returns why; a database that cannot be reached is retried (its
    /// flushes fail meanwhile anyway). Each renewal tells `health` whether the database answers,
    /// so that readiness sees an outage (and its end) even while nothing is flushed.
    pub async fn heartbeat(
        self: Arc<Self>,
        dbs: Vec<Db>,
        stop: CancellationToken,
        on_lost: Vec<CancellationToken>,
        health: Arc<Health>,
    ) -> Option<LeaseError> {
        let period = Duration::from_millis((self.duration_ms as u64 / 3).max(1));
        let mut ticker = tokio::time::interval(period);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // Each with why its connection ended, for the log (the server's own words).
        let mut clients: Vec<Option<(Client, Ending)>> = dbs.iter().map(|_| None).collect();
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.cancelled() => return None,
            }
            for (database, db) in dbs.iter().enumerate() {
                match self.renew_in(db, database, &mut clients[database]).await {
                    Ok(true) => {
                        health.reachable(database);
                        crate::events::DatabaseReached { database, up: true }.emit();
                    }
                    Ok(false) => {
                        let (client, _) = clients[database].as_ref().expect("renewed on it");
                        let err = self.lost(client, database).await;
                        error!(cause = %err, "instance lease lost");
                        for token in &on_lost {
                            token.cancel();
                        }
                        return Some(err);
                    }
                    Err(err) => {
                        health.unreachable(database, &err);
                        crate::events::LeaseRenewFailed {
                            database,
                            unreachable: err.is_connect() || err.is_closed(),
                            cause: &err,
                        }
                        .emit();
                    }
                }
            }
        }
    }

    /// Renews in `database` on its heartbeat connection `slot`, connecting when there is none.
    /// A connection the server ended while idle (its `idle_session_timeout`, a restart) is
    /// replaced first; one it ends just as the renewal uses it (the server's close not seen yet:
    /// `is_closed` still false) is replaced and the renewal tried once more, so that neither
    /// counts as a failed renewal (`tests/stalls.rs::
    /// a_connection_the_server_closed_is_logged_with_the_servers_reason`, once in a CI run).
    async fn renew_in(
        &self,
        db: &Db,
        database: usize,
        slot: &mut Option<(Client, Ending)>,
    ) -> Result<bool, DbError> {
        let mut again = true;
        loop {
            if let Some((_, ending)) = slot.take_if(|(client, _)| client.is_closed()) {
                let cause = ending.reason().await;
                let cause: &dyn std::fmt::Display = match &cause {
                    Some(reason) => reason,
                    None => &"closed",
                };
                debug!(database, %cause, "the database closed the lease heartbeat's idle connection; reconnecting");
            }
            let reused = slot.is_some();
            if slot.is_none() {
                *slot = Some(db.connect_watched().await?);
            }
            let (client, _) = slot.as_ref().expect("connected above");
            match self.renew(client).await {
                Err(err) => {
                    let err = match slot.take() {
                        Some((_, ending)) => ending.explain(err).await,
                        None => err,
                    };
                    // Closed, or the server's reason for closing it delivered as this
                    // renewal's answer (SQLSTATE class 57P: an operator intervention such as
                    // `idle_session_timeout`), depending on which the driver read first.
                    let ended =
                        err.is_closed() || err.code().is_some_and(|c| c.code().starts_with("57P"));
                    if reused && again && ended {
                        again = false;
                        debug!(database, cause = %err, "the lease heartbeat's connection closed as it was used; renewing on a new one");
                        continue;
                    }
                    return Err(err);
                }
                renewed => return renewed,
            }
        }
    }

    /// Lets the lease expire now (a clean stop), so another data_dir may take the id at once.
    /// The row stays, naming the last holder.
    pub async fn release(&self, dbs: &[Db]) {
        for (database, db) in dbs.iter().enumerate() {
            let result = match db.connect().await {
                Ok(client) => client
                    .execute_typed(
                        "UPDATE tallyd.instances SET expires_at = clock_timestamp() \
                         WHERE instance_id = $1 AND owner = $2",
                        &[(&self.instance_id, Type::TEXT), (&self.owner, Type::TEXT)],
                    )
                    .await
                    .map(drop)
                    .map_err(DbError::from),
                Err(err) => Err(err),
            };
            if let Err(err) = result {
                warn!(database, cause = %err, "cannot release the instance lease; it expires by itself");
            }
        }
    }
}

fn new_token(path: &Path) -> std::io::Result<String> {
    let token = format!("{:032x}", rand::random::<u128>());
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    crate::instance::write_atomically(path, token.as_bytes())?;
    Ok(token)
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into our buffer.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}
