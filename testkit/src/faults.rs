//! Faults a test injects into the database under a running tallyd: its sessions terminated
//! ([`terminate`] once, a [`Terminator`] every few tens of milliseconds until stopped), and
//! `tallyd.rollup` run in a loop on a session of its own ([`RollupLoop`]).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;
use tokio_postgres::Client;

use crate::{db, sql};

/// Whose sessions [`terminate`] ends; never the caller's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sessions {
    /// tallyd's (`application_name` `tallyd-...`): its flush workers, rollups, lease and
    /// replay.
    Tallyd,
    /// Every client backend: through PgBouncer these are its server connections, which carry
    /// no application name of tallyd's.
    All,
}

/// Terminates `which` sessions on `client`'s server; returns how many it ended.
pub async fn terminate(client: &Client, which: Sessions) -> i64 {
    terminated(client, which)
        .await
        .unwrap_or_else(|e| panic!("terminating {which:?} sessions: {e}"))
}

/// Terminates sessions again and again until [`Terminator::stop`]: the backends-terminated
/// fault.
pub struct Terminator {
    stop: Arc<AtomicBool>,
    task: JoinHandle<i64>,
}

impl Terminator {
    /// Terminates `which` sessions on the server of `conninfo`, pausing a random time in
    /// `pause_ms` (a seeded generator) between two rounds. Its own session is opened again
    /// when the server ends it (a restart of the database): a round that fails is skipped.
    pub fn start(conninfo: &str, which: Sessions, pause_ms: Range<u64>) -> Terminator {
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let stop = stop.clone();
            let db = db(conninfo);
            tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(pause_ms.start ^ pause_ms.end);
                let mut session: Option<Client> = None;
                let mut ended = 0;
                while !stop.load(Ordering::Relaxed) {
                    if session.as_ref().is_none_or(Client::is_closed) {
                        session = db.connect().await.ok();
                    }
                    if let Some(client) = &session {
                        ended += terminated(client, which).await.unwrap_or(0);
                    }
                    let pause = rng.gen_range(pause_ms.clone());
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                }
                ended
            })
        };
        Terminator { stop, task }
    }

    /// Stops it; returns how many sessions it ended.
    pub async fn stop(self) -> i64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("terminator task")
    }
}

/// [`terminate`], with a failed query (the server restarting) an error rather than a panic.
async fn terminated(client: &Client, which: Sessions) -> Result<i64, tokio_postgres::Error> {
    let whose = match which {
        Sessions::Tallyd => "AND application_name LIKE 'tallyd-%'",
        Sessions::All => "",
    };
    let row = client
        .query_one(
            &format!(
                "SELECT count(pg_terminate_backend(pid))::bigint FROM pg_stat_activity \
                 WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() {whose}"
            ),
            &[],
        )
        .await?;
    Ok(row.get(0))
}

/// `tallyd.rollup(batch_rows)` called in a loop on a session of its own until
/// [`RollupLoop::stop`]: a rollup running beside everything else.
pub struct RollupLoop {
    stop: Arc<AtomicBool>,
    task: JoinHandle<i64>,
}

impl RollupLoop {
    pub async fn start(conninfo: &str, batch_rows: i32) -> RollupLoop {
        let client = sql(conninfo).await;
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut folded = 0;
                while !stop.load(Ordering::Relaxed) {
                    folded += client
                        .query_one("SELECT tallyd.rollup($1)", &[&batch_rows])
                        .await
                        .unwrap_or_else(|e| {
                            panic!("tallyd.rollup({batch_rows}): {}", crate::db_error(&e))
                        })
                        .get::<_, i64>(0);
                }
                folded
            })
        };
        RollupLoop { stop, task }
    }

    /// Stops it; returns the slot rows it folded.
    pub async fn stop(self) -> i64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("rollup loop task")
    }
}
