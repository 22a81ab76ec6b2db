//! Moving logical shards between databases, when a database is added or the map changes.
//!
//! A move runs before this daemon's first flush (at its start with `[database] move_shards =
//! true`, or from `tallyd move-shards` while no daemon runs on this data_dir). Other tallyd
//! instances may still run on these databases by the old map, and they write a moving shard to
//! its source. So the move's transaction on the source *fences* it first (`fence`): it waits
//! for the flushes in progress there, holds off new ones until it ends, and raises the
//! database's shard map version, which every flush checks in its own transaction
//! (`tallyd.check_shard_map`, migrations/V8). Once the move commits, a tallyd with the old map
//! can no longer write to a database that lost shards (its flushes fail there and it stops),
//! and the rows the move reads are all the rows there are. A database that only gains shards is
//! not fenced: by induction, one that was never fenced since a tallyd read its map owns at least
//! the shards that map gives it. For each (source, target) pair, in two-phase commit:
//! 1. on the source: fence, check that it still records the shards, read their rows (slots and
//!    rollups), summed per key;
//! 2. on the target: add them to `tallyd.rollups`, check the sums match, record ownership,
//!    `PREPARE TRANSACTION`;
//! 3. on the source, in the transaction of step 1: delete those rows and the ownership,
//!    `PREPARE TRANSACTION`;
//! 4. `COMMIT PREPARED` on the source, then on the target.
//!
//! Before anything moves, the plan must be complete: every logical shard recorded in one of the
//! configured databases, with the configured number of logical shards; otherwise the move is
//! refused and nothing changes.
//!
//! Two-phase transaction ids are global to a PostgreSQL server, and several of tallyd's databases
//! may live on one server, so each side has its own id: `tallyd-move-<move>-<from>-<to>-<first
//! shard>-<copy|delete>`, `<move>` random per group. A crash leaves prepared transactions that
//! [`resume`] settles at the next attempt, from what each side shows:
//! - the source's delete is prepared: the target's copy was prepared before it, so both commit
//!   (the delete first); if the copy is neither prepared nor committed, the delete rolls back;
//! - the target's copy is prepared and the source's delete committed (the source no longer owns
//!   the shards): the copy commits; the source still owns them: the copy rolls back and the
//!   move starts over;
//! - a shard recorded in two databases (left by older versions, which gave both sides one id):
//!   see `dedupe`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::SystemTime;

use tokio_postgres::types::Type;
use tokio_postgres::Client;
use tracing::{info, warn};

use super::{check_map, ranges, Db, StoreError};
use crate::hll::Sketch;
use crate::kind::{sql, Kept};
use crate::routing::Layout;
use rows::{copy_batch_claims, delete_shards, read_shards};

mod rows;

/// One logical shard going from database `from` to database `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    pub shard: i32,
    pub from: usize,
    pub to: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    #[error(
        "logical shard {shard} is recorded in databases {a} and {b}, which hold different totals \
         for its keys ({total_a} and {total_b} events): that is not what an interrupted move \
         leaves, so tallyd does not guess which one is right"
    )]
    TwoOwners {
        shard: i32,
        a: usize,
        b: usize,
        total_a: i64,
        total_b: i64,
    },
    #[error(
        "database {database} has max_prepared_transactions = 0, and moving shards commits in two \
         phases: set it to at least 2 there (postgresql.conf, restart) and move again"
    )]
    NoPreparedTransactions { database: usize },
    #[error(
        "an interrupted shard move ({gid}, in database {database}) needs database {missing}, \
         which is no longer configured: configure it again to let tallyd settle the move"
    )]
    Unsettled {
        gid: String,
        database: usize,
        missing: usize,
    },
    #[error("moving shards: the sketch of {row} cannot be read: {cause}; nothing was changed")]
    Sketch { row: String, cause: String },
    #[error("moving shards: the rows of {row} do not merge: {cause}; nothing was changed")]
    Merge { row: String, cause: String },
    #[error(
        "moving shards {from} -> {to}: the target's totals for the moved keys are {found}, \
         expected {expected}; nothing was changed"
    )]
    Mismatch {
        from: usize,
        to: usize,
        /// Sums of 64-bit counts, which may go beyond 64 bits: as their decimal text.
        found: String,
        expected: String,
    },
    #[error(
        "logical shards {shards} (of {logical}) are recorded in none of the {databases} \
         configured databases: a database that holds them is missing from [database] shards \
         (keep every database, in order, and append new ones); nothing was moved"
    )]
    Unrecorded {
        shards: String,
        logical: usize,
        databases: usize,
    },
    #[error(
        "database {database} records {recorded} logical shards, the config has \
         database.logical_shards = {configured}: moves keep the number of logical shards; \
         nothing was moved"
    )]
    LogicalShards {
        database: usize,
        recorded: usize,
        configured: usize,
    },
    #[error(
        "database {database} no longer records logical shards {shards}, which this move was to \
         take from it (another tallyd moved them meanwhile?); this group was not moved: start \
         again to plan the move anew"
    )]
    Changed { database: usize, shards: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<super::DbError> for MoveError {
    fn from(e: super::DbError) -> Self {
        MoveError::Store(e.into())
    }
}

impl From<tokio_postgres::Error> for MoveError {
    fn from(e: tokio_postgres::Error) -> Self {
        MoveError::Store(e.into())
    }
}

/// What [`settle`] did, and the map versions the databases have now.
#[derive(Debug)]
pub struct Settled {
    pub moves: Vec<Move>,
    /// Per database, its shard map version once the records agree with the map (see
    /// [`check_map`]).
    pub versions: Vec<i64>,
}

/// Settles any interrupted move, moves every shard the databases record elsewhere than the map
/// says, then checks the records. `instance_id` is the mover's own (its lease is not another
/// instance to warn about).
pub async fn settle(dbs: &[Db], layout: &Layout, instance_id: &str) -> Result<Settled, MoveError> {
    let mut clients = Vec::with_capacity(dbs.len());
    for db in dbs {
        clients.push(db.connect().await?);
    }
    resume(&clients).await?;
    let moves = plan(&clients, layout).await?;
    if !moves.is_empty() {
        check_prepared(&clients).await?;
        warn_live(&clients, &moves, instance_id).await?;
    }
    let mut groups: BTreeMap<(usize, usize), Vec<i32>> = BTreeMap::new();
    for m in &moves {
        groups.entry((m.from, m.to)).or_default().push(m.shard);
    }
    for ((from, to), shards) in groups {
        let gid = prepare_group(&clients, layout, from, to, &shards).await?;
        commit_group(&clients, from, to, &gid).await?;
    }
    let versions = check_map(dbs, layout).await?;
    Ok(Settled { moves, versions })
}

/// Names the other tallyd instances that hold a live lease in a database that loses shards: the
/// move fences them there, and they stop at their next flush to it (to be started again with
/// the new map).
async fn warn_live(clients: &[Client], moves: &[Move], instance_id: &str) -> Result<(), MoveError> {
    let sources: std::collections::BTreeSet<usize> = moves.iter().map(|m| m.from).collect();
    for database in sources {
        let live = clients[database]
            .query_typed(
                "SELECT instance_id, host, pid, data_dir FROM tallyd.instances \
                 WHERE expires_at > clock_timestamp() AND instance_id <> $1 ORDER BY instance_id",
                &[(&instance_id, Type::TEXT)],
            )
            .await?;
        for row in live {
            let (id, host, pid, data_dir): (String, String, i32, String) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            warn!(database, instance_id = %id, %host, pid, %data_dir,
                "another tallyd runs on a database whose shards move: the move fences it there, \
                 and it stops at its next flush to it; start it again with the new map");
        }
    }
    Ok(())
}

/// Inside the caller's transaction on `client` (a database losing shards), before it reads
/// anything it moves: waits for the flushes in progress in that database (they hold
/// `tallyd.shard_map_version` in ACCESS SHARE mode from their first statement to their commit),
/// holds off new ones until the transaction ends (a prepared transaction keeps the lock), and
/// raises the map version, so that every flush of a tallyd that read the map before fails
/// there once this commits.
async fn fence(client: &Client) -> Result<(), MoveError> {
    client
        .batch_execute(
            "LOCK TABLE tallyd.shard_map_version IN ACCESS EXCLUSIVE MODE; \
             UPDATE tallyd.shard_map_version SET version = version + 1",
        )
        .await?;
    Ok(())
}

/// Which database records each shard, and the shards recorded twice, by pair of databases.
async fn owners(
    clients: &[Client],
) -> Result<(HashMap<i32, usize>, BTreeMap<(usize, usize), Vec<i32>>), MoveError> {
    let mut owner: HashMap<i32, usize> = HashMap::new();
    let mut twice: BTreeMap<(usize, usize), Vec<i32>> = BTreeMap::new();
    for (index, client) in clients.iter().enumerate() {
        for row in client
            .query_typed("SELECT shard FROM tallyd.shards", &[])
            .await?
        {
            let shard: i32 = row.get(0);
            match owner.get(&shard) {
                Some(&other) => twice.entry((other, index)).or_default().push(shard),
                None => {
                    owner.insert(shard, index);
                }
            }
        }
    }
    Ok((owner, twice))
}

/// Settles shards recorded in two databases. Older versions left that when a move's copy had
/// committed and its delete had not (their two sides shared one transaction id, which fails on
/// databases of one server). Then both databases hold the same totals for the shards' keys:
/// the move is finished by deleting them from the database the map does not name (from the
/// second one if it names neither; the move then takes them on). Anything else is an error.
async fn dedupe(clients: &[Client], layout: &Layout) -> Result<(), MoveError> {
    let (_, twice) = owners(clients).await?;
    for ((a, b), shards) in twice {
        let set: HashSet<i32> = shards.iter().copied().collect();
        let (in_a, in_b) = (
            read_shards(&clients[a], layout, &set).await?,
            read_shards(&clients[b], layout, &set).await?,
        );
        let same = in_a.len() == in_b.len()
            && in_a
                .iter()
                .all(|(k, p)| in_b.get(k).is_some_and(|q| q.count == p.count));
        if !same {
            return Err(MoveError::TwoOwners {
                shard: shards[0],
                a,
                b,
                total_a: in_a.values().map(|p| p.count).sum(),
                total_b: in_b.values().map(|p| p.count).sum(),
            });
        }
        for (drop, kept) in [(a, b), (b, a)] {
            let mine: Vec<i32> = shards
                .iter()
                .copied()
                .filter(|&s| {
                    let mapped = layout.map.get(s as usize).map(|&m| m as usize);
                    if drop == b {
                        mapped != Some(b)
                    } else {
                        mapped == Some(b)
                    }
                })
                .collect();
            if mine.is_empty() {
                continue;
            }
            let mine_set: HashSet<i32> = mine.iter().copied().collect();
            clients[drop].batch_execute("BEGIN").await?;
            fence(&clients[drop]).await?;
            let parts = read_shards(&clients[drop], layout, &mine_set).await?;
            let counters: Vec<&str> = parts.keys().map(|(c, ..)| c.as_str()).collect();
            let keys: Vec<&str> = parts.keys().map(|(_, k, ..)| k.as_str()).collect();
            info!(
                database = drop,
                kept,
                shards = mine.len(),
                keys = keys.len(),
                "finishing a shard move an older version left half done"
            );
            delete_shards(&clients[drop], &counters, &keys, &mine).await?;
            clients[drop].batch_execute("COMMIT").await?;
        }
    }
    Ok(())
}

/// The shards recorded in one database and mapped to another, once shards recorded twice are
/// settled (`dedupe`). Refused, before anything changes, unless every logical shard of `layout`
/// is recorded in one of the databases (or none is recorded anywhere yet: nothing to move).
pub async fn plan(clients: &[Client], layout: &Layout) -> Result<Vec<Move>, MoveError> {
    complete(clients, layout).await?;
    dedupe(clients, layout).await?;
    let (owner, _) = owners(clients).await?;
    let mut moves: Vec<Move> = owner
        .into_iter()
        .filter_map(|(shard, from)| {
            let to = *layout.map.get(shard as usize)? as usize;
            (to != from).then_some(Move { shard, from, to })
        })
        .collect();
    moves.sort_by_key(|m| m.shard);
    Ok(moves)
}

/// Whether the databases' records can be brought to `layout` by moves alone: the number of
/// logical shards is the configured one, and every shard is recorded somewhere (a start with a
/// database left out of the config must not move shards among the others and then fail).
async fn complete(clients: &[Client], layout: &Layout) -> Result<(), MoveError> {
    let configured = layout.map.len();
    let mut recorded: HashSet<i32> = HashSet::new();
    for (database, client) in clients.iter().enumerate() {
        for row in client
            .query_typed("SELECT shard, logical_shards FROM tallyd.shards", &[])
            .await?
        {
            let logical = row.get::<_, i32>(1) as usize;
            if logical != configured {
                return Err(MoveError::LogicalShards {
                    database,
                    recorded: logical,
                    configured,
                });
            }
            recorded.insert(row.get(0));
        }
    }
    let missing: Vec<i32> = (0..configured as i32)
        .filter(|s| !recorded.contains(s))
        .collect();
    if recorded.is_empty() || missing.is_empty() {
        return Ok(());
    }
    Err(MoveError::Unrecorded {
        shards: ranges(&missing),
        logical: configured,
        databases: clients.len(),
    })
}

/// Refuses before changing anything when a database cannot prepare transactions.
async fn check_prepared(clients: &[Client]) -> Result<(), MoveError> {
    for (database, client) in clients.iter().enumerate() {
        let max: String = client
            .query_typed_one("SHOW max_prepared_transactions", &[])
            .await?
            .get(0);
        if max.trim() == "0" {
            return Err(MoveError::NoPreparedTransactions { database });
        }
    }
    Ok(())
}

/// Which side of a move a prepared transaction is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// On the target: the copy and the new ownership.
    Copy,
    /// On the source: the delete and the dropped ownership.
    Delete,
}

/// A parsed move transaction id; `id` is `None` for the ids of older versions
/// (`tallyd-move-<from>-<to>-<first>`, one id for both sides).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Gid {
    id: Option<u64>,
    from: usize,
    to: usize,
    first: i32,
}

impl Gid {
    fn side(&self, role: Role) -> String {
        let Some(id) = self.id else {
            return format!("tallyd-move-{}-{}-{}", self.from, self.to, self.first);
        };
        let role = match role {
            Role::Copy => "copy",
            Role::Delete => "delete",
        };
        format!(
            "tallyd-move-{id:016x}-{}-{}-{}-{role}",
            self.from, self.to, self.first
        )
    }
}

/// One key's rows (of one window), merged by its kind ([`Kept::merge`]).
struct Part {
    count: i64,
    first: SystemTime,
    last: SystemTime,
    /// The rows' `kind` column (NULL for a sum), written back as it was.
    kind: Option<String>,
    /// A max, min or last value or a unique counter's sketch: the rows' values merged, as of
    /// `last` (the latest `last_seen` of the rows merged so far).
    value: Option<Kept>,
}

/// The two prepared transactions of one group: `copy` on the target, `delete` on the source.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub copy: String,
    pub delete: String,
}

/// Steps 1 to 3 for the shards going from `from` to `to`: both sides prepared, nothing
/// committed. Returns the two-phase transaction ids.
pub async fn prepare_group(
    clients: &[Client],
    layout: &Layout,
    from: usize,
    to: usize,
    shards: &[i32],
) -> Result<Prepared, MoveError> {
    let (source, target) = (&clients[from], &clients[to]);
    let moving: HashSet<i32> = shards.iter().copied().collect();
    // 1. The source, fenced before it is read: from here on nothing else writes these shards
    // there, so the rows read are all there are until the delete below.
    source.batch_execute("BEGIN").await?;
    fence(source).await?;
    let still: i64 = source
        .query_one(
            "SELECT count(*) FROM tallyd.shards WHERE shard = ANY($1)",
            &[&shards],
        )
        .await?
        .get(0);
    if still != shards.len() as i64 {
        source.batch_execute("ROLLBACK").await?;
        return Err(MoveError::Changed {
            database: from,
            shards: ranges(shards),
        });
    }
    let parts = read_shards(source, layout, &moving).await?;
    let counters: Vec<&str> = parts.keys().map(|(c, ..)| c.as_str()).collect();
    let keys: Vec<&str> = parts.keys().map(|(_, k, ..)| k.as_str()).collect();
    let spans: Vec<&str> = parts.keys().map(|(_, _, s, _)| s.as_str()).collect();
    let wins: Vec<i64> = parts.keys().map(|(.., w)| *w).collect();
    let counts: Vec<i64> = parts.values().map(|p| p.count).collect();
    let firsts: Vec<SystemTime> = parts.values().map(|p| p.first).collect();
    let lasts: Vec<SystemTime> = parts.values().map(|p| p.last).collect();
    let kinds: Vec<Option<&str>> = parts.values().map(|p| p.kind.as_deref()).collect();
    let values: Vec<Option<i64>> = parts
        .values()
        .map(|p| p.value.as_ref().and_then(Kept::number))
        .collect();
    let sketches: Vec<Option<Vec<u8>>> = parts
        .values()
        .map(|p| {
            p.value
                .as_ref()
                .and_then(Kept::sketch)
                .map(Sketch::to_bytes)
        })
        .collect();
    // Every moved row's count: keys near the 64-bit edge (a window and its all-time row each
    // near the maximum) add up beyond it, so the check counts in 128 bits (numeric in SQL).
    let expected: i128 = counts.iter().map(|&n| i128::from(n)).sum();
    let logical = layout.map.len() as i32;
    let gid = Gid {
        id: Some(rand::random()),
        from,
        to,
        first: shards[0],
    };
    let gids = Prepared {
        copy: gid.side(Role::Copy),
        delete: gid.side(Role::Delete),
    };

    // 2. The copy, on the target. Not fenced: it only gains shards, and no tallyd writes these
    // to it before the move commits (one with the old map writes them to the source).
    target.batch_execute("BEGIN").await?;
    // Sketches are unioned by the extension's hll_union where the target has a row already;
    // only a move that carries sketches names it.
    let sketch_merge = if sketches.iter().any(Option::is_some) {
        format!(", sketch = {}", sql::sketch_column("r"))
    } else {
        String::new()
    };
    target
        .execute(
            &format!(
                "INSERT INTO tallyd.rollups AS r (counter, key, span, win, count, first_seen, last_seen, \
                     kind, value, sketch) \
                 SELECT c, k, sp, {}, n, f, l, kd, v, sk FROM unnest($1::text[], $2::text[], $3::text[], \
                     $4::bigint[], $5::bigint[], $6::timestamptz[], $7::timestamptz[], $8::text[], \
                     $9::bigint[], $10::bytea[]) AS u (c, k, sp, w, n, f, l, kd, v, sk) \
                 ON CONFLICT (counter, key, span, win) DO UPDATE SET count = r.count + EXCLUDED.count, \
                     first_seen = LEAST(r.first_seen, EXCLUDED.first_seen), \
                     last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen), \
                     value = {}{sketch_merge}",
                super::win_from_ms("w"),
                sql::value_column("r"),
            ),
            &[
                &counters, &keys, &spans, &wins, &counts, &firsts, &lasts, &kinds, &values,
                &sketches,
            ],
        )
        .await?;
    let found: String = target
        .query_one(
            "SELECT coalesce(sum(t.count), 0)::text FROM ( \
                 SELECT counter, key, count FROM tallyd.rollups \
                 UNION ALL SELECT counter, key, count FROM tallyd.slots) t \
             JOIN (SELECT DISTINCT * FROM unnest($1::text[], $2::text[]) AS u (counter, key)) u \
             USING (counter, key)",
            &[&counters, &keys],
        )
        .await?
        .get(0);
    // A sum of bigints is an integer: it always parses.
    let found: i128 = found.parse().unwrap_or(i128::MIN);
    if found != expected {
        target.batch_execute("ROLLBACK").await?;
        source.batch_execute("ROLLBACK").await?;
        return Err(MoveError::Mismatch {
            from,
            to,
            found: found.to_string(),
            expected: expected.to_string(),
        });
    }
    target
        .execute(
            "INSERT INTO tallyd.shards (shard, logical_shards) SELECT unnest($1::int[]), $2",
            &[&shards, &logical],
        )
        .await?;
    copy_batch_claims(source, target).await?;
    target
        .batch_execute(&format!("PREPARE TRANSACTION '{}'", gids.copy))
        .await?;

    // 3. The delete, on the source (its transaction open since step 1).
    delete_shards(source, &counters, &keys, shards).await?;
    source
        .batch_execute(&format!("PREPARE TRANSACTION '{}'", gids.delete))
        .await?;
    info!(
        from,
        to,
        shards = shards.len(),
        keys = keys.len(),
        events = %expected,
        "logical shards copied and prepared"
    );
    Ok(gids)
}

/// Step 4: the source first, so that [`resume`] can tell how far a crash let it get.
pub async fn commit_group(
    clients: &[Client],
    from: usize,
    to: usize,
    gids: &Prepared,
) -> Result<(), MoveError> {
    finish(&clients[from], &gids.delete, true).await?;
    finish(&clients[to], &gids.copy, true).await?;
    info!(from, to, gid = %gids.copy, "logical shards moved");
    Ok(())
}

async fn finish(client: &Client, gid: &str, commit: bool) -> Result<(), MoveError> {
    let verb = if commit { "COMMIT" } else { "ROLLBACK" };
    client
        .batch_execute(&format!("{verb} PREPARED '{gid}'"))
        .await?;
    Ok(())
}

/// Whether `gid` is prepared in the database `client` is connected to (ids are global to a
/// server, so a database's own are told apart by name).
async fn is_prepared(client: &Client, gid: &str) -> Result<bool, MoveError> {
    Ok(client
        .query_typed_opt(
            "SELECT 1 FROM pg_prepared_xacts WHERE gid = $1 AND database = current_database()",
            &[(&gid, Type::TEXT)],
        )
        .await?
        .is_some())
}

async fn owns(client: &Client, shard: i32) -> Result<bool, MoveError> {
    Ok(client
        .query_typed_opt(
            "SELECT 1 FROM tallyd.shards WHERE shard = $1",
            &[(&shard, Type::INT4)],
        )
        .await?
        .is_some())
}

/// Settles moves a crash interrupted (see the module docs). Every state has one answer.
pub async fn resume(clients: &[Client]) -> Result<(), MoveError> {
    for (index, client) in clients.iter().enumerate() {
        let prepared = client
            .query_typed(
                "SELECT gid FROM pg_prepared_xacts \
                 WHERE gid LIKE 'tallyd-move-%' AND database = current_database()",
                &[],
            )
            .await?;
        for row in prepared {
            let name: String = row.get(0);
            let Some((gid, role)) = parse_gid(&name, index) else {
                continue;
            };
            let other = if role == Role::Copy { gid.from } else { gid.to };
            let Some(peer) = clients.get(other) else {
                return Err(MoveError::Unsettled {
                    gid: name,
                    database: index,
                    missing: other,
                });
            };
            // Still prepared (not settled while visiting the other side)?
            if !is_prepared(client, &name).await? {
                continue;
            }
            match role {
                Role::Delete => {
                    let copy = gid.side(Role::Copy);
                    let copy_prepared = is_prepared(peer, &copy).await?;
                    // The copy is prepared or committed (the target owns the shards): go on.
                    let commit = copy_prepared || owns(peer, gid.first).await?;
                    info!(gid = %name, database = index, commit, "settling an interrupted shard move");
                    finish(client, &name, commit).await?;
                    if copy_prepared {
                        finish(peer, &copy, true).await?;
                    }
                }
                Role::Copy => {
                    let delete = gid.side(Role::Delete);
                    let commit = if is_prepared(peer, &delete).await? {
                        finish(peer, &delete, true).await?;
                        true
                    } else {
                        !owns(peer, gid.first).await?
                    };
                    info!(gid = %name, database = index, commit, "settling an interrupted shard move");
                    finish(client, &name, commit).await?;
                }
            }
        }
    }
    Ok(())
}

/// Parses a move's transaction id found in database `index` (which tells the side of an id of
/// an older version).
fn parse_gid(gid: &str, index: usize) -> Option<(Gid, Role)> {
    let parts: Vec<&str> = gid.strip_prefix("tallyd-move-")?.split('-').collect();
    let (id, rest, role) = match parts.as_slice() {
        [id, from, to, first, role] => {
            let role = match *role {
                "copy" => Role::Copy,
                "delete" => Role::Delete,
                _ => return None,
            };
            (
                Some(u64::from_str_radix(id, 16).ok()?),
                [from, to, first],
                role,
            )
        }
        [from, to, first] => {
            let source: usize = from.parse().ok()?;
            let role = if source == index {
                Role::Delete
            } else {
                Role::Copy
            };
            (None, [from, to, first], role)
        }
        _ => return None,
    };
    let gid = Gid {
        id,
        from: rest[0].parse().ok()?,
        to: rest[1].parse().ok()?,
        first: rest[2].parse().ok()?,
    };
    Some((gid, role))
}

#[cfg(test)]
mod tests {
    use super::{parse_gid, Gid, Role};

    #[test]
    fn gids_round_trip() {
        let gid = Gid {
            id: Some(0xfeed),
            from: 0,
            to: 2,
            first: 160,
        };
        for role in [Role::Copy, Role::Delete] {
            assert_eq!(parse_gid(&gid.side(role), 7), Some((gid.clone(), role)));
        }
        assert_ne!(gid.side(Role::Copy), gid.side(Role::Delete));
        assert_eq!(parse_gid("other", 0), None);
        assert_eq!(parse_gid("tallyd-move-1-2-3-4-other", 0), None);
    }

    #[test]
    fn gids_of_older_versions_are_read_by_side() {
        let old = "tallyd-move-0-1-160";
        let gid = Gid {
            id: None,
            from: 0,
            to: 1,
            first: 160,
        };
        assert_eq!(parse_gid(old, 0), Some((gid.clone(), Role::Delete)));
        assert_eq!(parse_gid(old, 1), Some((gid.clone(), Role::Copy)));
        assert_eq!(gid.side(Role::Copy), old);
    }
}
