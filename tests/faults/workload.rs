//! What a workload is to the matrix (the [`Workload`] trait, the [`Round`] it sends), and the
//! databases it is checked against ([`Store`]).

use std::collections::BTreeMap;
use std::path::Path;

use futures_util::future::BoxFuture;
use rand::rngs::StdRng;
use tallyd::config::CounterConfig;
use tallyd::routing::Layout;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row};

/// One feature's traffic and its exact model: what the databases must hold after every line it
/// sent was acknowledged. Shared by every connection that sends its rounds (so its model sits
/// behind a lock), and by the fault that checks it.
pub trait Workload: Send + Sync {
    /// Its name: the prefix of its counters' names, and what a failure names.
    fn name(&self) -> &'static str;

    /// The counters it declares, its own (named after it): the only ones its lines, checks and
    /// keys touch. A `!forget *` of its keys must not reach another workload's keys either.
    fn counters(&self) -> Vec<CounterConfig>;

    /// SQL run on every database before the daemon first starts (an application's table).
    fn setup_sql(&self) -> String {
        String::new()
    }

    /// One round of connection `at.conn`, recorded in the model as sent: the fault sends it
    /// and waits for its acknowledgement before the next round of that connection, and
    /// strikes only after an acknowledgement, so every recorded line must be in the database
    /// once, exactly.
    fn round(&self, at: Ctx, rng: &mut StdRng) -> Round;

    /// Compares the databases with the model: `Err` says what differs. Every key of its
    /// counters, no other key, each on the database its shard maps to.
    fn verify<'a>(&'a self, store: &'a Store) -> BoxFuture<'a, Result<(), String>>;
}

/// Where a round stands: which connection of the workload sends it, its number on that
/// connection (from 0, counted across restarts), and how large it is.
#[derive(Clone, Copy, Debug)]
pub struct Ctx {
    pub conn: usize,
    pub round: usize,
    pub size: Size,
    /// Whether the round may hold lines that commit by themselves (corrections: their `ok`
    /// comes once they and every earlier line of the connection are committed). A fault that
    /// must find the round in the journal alone asks for none.
    pub commits: bool,
}

/// How many lines a round sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    /// Tens of lines on a few hot keys: many rounds, much contention.
    Small,
    /// Thousands of lines on thousands of keys: a flight a kill interrupts while it is
    /// written, reads that pass the memory cap.
    Large,
}

/// What one round sends and what the daemon answers to it.
#[derive(Debug, Default)]
pub struct Round {
    /// Its lines, each ended by `\n`.
    pub lines: Vec<u8>,
    /// How many of them are events accepted (what the next `!flush` counts).
    pub events: u64,
    /// How many of them are rejected (what the next `!flush` counts).
    pub rejected: u64,
    /// The answers to its lines, in order, before the acknowledgement's own (`ok\n` for each
    /// correction).
    pub replies: Vec<String>,
}

impl Round {
    /// A round of `lines` (with `\n` added), all of them accepted events.
    pub fn of_events(lines: Vec<String>) -> Round {
        let events = lines.len() as u64;
        Round {
            lines: crate::common::buf_of(lines),
            events,
            ..Round::default()
        }
    }
}

/// The databases a fault's daemon writes, and which one holds each key.
pub struct Store {
    clients: Vec<Client>,
    layout: Layout,
    /// Whether shards have moved: a move adds the moved rows of every counter to the target's
    /// `tallyd.rollups`, those of a `rollup_into` counter too (store/moves/mod.rs).
    pub moved: bool,
}

impl Store {
    /// Sessions on `conninfos` (the databases reached directly, not through a pooler), with
    /// the key layout of the config at `config`.
    pub async fn open(conninfos: &[String], config: &Path, moved: bool) -> Store {
        let config = tallyd::config::Config::load(config).expect("the fault's config");
        let mut clients = Vec::new();
        for conninfo in conninfos {
            clients.push(crate::common::sql(conninfo).await);
        }
        Store {
            clients,
            layout: config.layout(),
            moved,
        }
    }

    /// A session on the first database (where the extension builds reference sketches).
    pub fn first(&self) -> &Client {
        &self.clients[0]
    }

    pub fn all(&self) -> &[Client] {
        &self.clients
    }

    /// The index of the database `counter`'s `key` lives in.
    pub fn home(&self, counter: &str, key: &str) -> usize {
        self.layout.database(tallyd::routing::key_hash(
            tallyd::routing::counter_seed(counter),
            key.as_bytes(),
        ))
    }

    /// `query`'s rows from every database, each with its database's index.
    pub async fn rows(&self, query: &str, params: &[&(dyn ToSql + Sync)]) -> Vec<(usize, Row)> {
        let mut out = Vec::new();
        for (i, client) in self.clients.iter().enumerate() {
            let rows = client
                .query(query, params)
                .await
                .unwrap_or_else(|e| panic!("{query}: {}", crate::common::db_error(&e)));
            out.extend(rows.into_iter().map(|r| (i, r)));
        }
        out
    }
}

/// Checks that `found` (per row: the database it was read from, its key and what it holds) is
/// exactly `want`, each row on the database its key's shard maps to (`key_of` names the
/// counter's key in a row's key): the comparison every workload ends with.
pub fn compare<K, V>(
    store: &Store,
    counter: &str,
    want: &BTreeMap<K, V>,
    found: Vec<(usize, K, V)>,
    key_of: impl Fn(&K) -> &str,
) -> Result<(), String>
where
    K: Ord + std::fmt::Debug,
    V: PartialEq + std::fmt::Debug,
{
    let mut seen = BTreeMap::new();
    for (database, key, value) in found {
        let home = store.home(counter, key_of(&key));
        if database != home {
            return Err(format!(
                "{counter} {key:?} is on database {database}, its shard's is {home}"
            ));
        }
        if let Some((other, _)) = seen.insert(key, (database, value)) {
            return Err(format!(
                "{counter}: a key on databases {other} and {database}"
            ));
        }
    }
    let extra: Vec<&K> = seen.keys().filter(|k| !want.contains_key(*k)).collect();
    if !extra.is_empty() {
        return Err(format!(
            "{counter}: {} keys never sent (or forgotten) are there: {:?}",
            extra.len(),
            &extra[..extra.len().min(5)]
        ));
    }
    for (key, value) in want {
        match seen.get(key) {
            None => return Err(format!("{counter} {key:?} is missing (want {value:?})")),
            Some((_, found)) if found != value => {
                return Err(format!("{counter} {key:?}: {found:?}, want {value:?}"))
            }
            Some(_) => {}
        }
    }
    Ok(())
}
