//! Moving logical shards between databases, when a database is added or the map changes.
//!
//! A move runs before any flush (at the daemon's start with `[database] move_shards = true`, or
//! from `tallyd move-shards` while no daemon runs), so nothing writes the moving shards while
//! they move. For each (source, target) pair, in two-phase commit:
//! 1. read the source's rows of the moving shards (slots and rollups), summed per key;
//! 2. on the target: add them to `tallyd.rollups`, check the sums match, record ownership,
//!    `PREPARE TRANSACTION`;
//! 3. on the source: delete those rows and the ownership, `PREPARE TRANSACTION`;
//! 4. `COMMIT PREPARED` on the source, then on the target.
//!
//! A crash leaves prepared transactions that [`resume`] settles at the next attempt: if the
//! source no longer owns the shards its delete committed, so the target's copy commits too;
//! otherwise the target's prepared copy is rolled back and the move starts over.

use std::collections::{BTreeMap, HashMap};
use std::time::SystemTime;

use tokio_postgres::types::Type;
use tokio_postgres::Client;
use tracing::info;

use super::{check_map, Db, StoreError};
use crate::bucket::{self, Layout};

/// One logical shard going from database `from` to database `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    pub shard: i32,
    pub from: usize,
    pub to: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    #[error("logical shard {shard} is recorded in databases {a} and {b}; fix by hand")]
    TwoOwners { shard: i32, a: usize, b: usize },
    #[error(
        "moving shards {from} -> {to}: the target's totals for the moved keys are {found}, \
         expected {expected}; nothing was changed"
    )]
    Mismatch {
        from: usize,
        to: usize,
        found: i64,
        expected: i64,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<tokio_postgres::Error> for MoveError {
    fn from(e: tokio_postgres::Error) -> Self {
        MoveError::Store(StoreError::Postgres(e))
    }
}

/// Settles any interrupted move, moves every shard the databases record elsewhere than the map
/// says, then checks the records. Returns the moves made.
pub async fn settle(dbs: &[Db], layout: &Layout) -> Result<Vec<Move>, MoveError> {
    let mut clients = Vec::with_capacity(dbs.len());
    for db in dbs {
        clients.push(db.connect().await.map_err(StoreError::from)?);
    }
    resume(&clients).await?;
    let moves = plan(&clients, layout).await?;
    let mut groups: BTreeMap<(usize, usize), Vec<i32>> = BTreeMap::new();
    for m in &moves {
        groups.entry((m.from, m.to)).or_default().push(m.shard);
    }
    for ((from, to), shards) in groups {
        let gid = prepare_group(&clients, layout, from, to, &shards).await?;
        commit_group(&clients, from, to, &gid).await?;
    }
    check_map(dbs, layout).await?;
    Ok(moves)
}

/// The shards recorded in one database and mapped to another.
pub async fn plan(clients: &[Client], layout: &Layout) -> Result<Vec<Move>, MoveError> {
    let mut owner: HashMap<i32, usize> = HashMap::new();
    for (index, client) in clients.iter().enumerate() {
        for row in client
            .query_typed("SELECT shard FROM tallyd.shards", &[])
            .await?
        {
            let shard: i32 = row.get(0);
            if let Some(&other) = owner.get(&shard) {
                return Err(MoveError::TwoOwners {
                    shard,
                    a: other,
                    b: index,
                });
            }
            owner.insert(shard, index);
        }
    }
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

fn gid(from: usize, to: usize, first_shard: i32) -> String {
    format!("tallyd-move-{from}-{to}-{first_shard}")
}

/// One key's rows, summed.
struct Part {
    count: i64,
    first: SystemTime,
    last: SystemTime,
}

/// Steps 1 to 3 for the shards going from `from` to `to`: both sides prepared, nothing
/// committed. Returns the two-phase transaction id.
pub async fn prepare_group(
    clients: &[Client],
    layout: &Layout,
    from: usize,
    to: usize,
    shards: &[i32],
) -> Result<String, MoveError> {
    let (source, target) = (&clients[from], &clients[to]);
    let moving: std::collections::HashSet<i32> = shards.iter().copied().collect();
    let mut parts: HashMap<(String, String), Part> = HashMap::new();
    let rows = source
        .query_typed(
            "SELECT counter, key, count, first_seen, last_seen FROM tallyd.slots \
             UNION ALL SELECT counter, key, count, first_seen, last_seen FROM tallyd.rollups",
            &[],
        )
        .await?;
    for row in rows {
        let (counter, key): (String, String) = (row.get(0), row.get(1));
        let hash = bucket::key_hash(bucket::counter_seed(&counter), key.as_bytes());
        if !moving.contains(&(bucket::logical_shard(hash, layout.map.len()) as i32)) {
            continue;
        }
        let (count, first, last): (i64, SystemTime, SystemTime) =
            (row.get(2), row.get(3), row.get(4));
        let part = parts.entry((counter, key)).or_insert(Part {
            count: 0,
            first,
            last,
        });
        part.count += count;
        part.first = part.first.min(first);
        part.last = part.last.max(last);
    }
    let counters: Vec<&str> = parts.keys().map(|(c, _)| c.as_str()).collect();
    let keys: Vec<&str> = parts.keys().map(|(_, k)| k.as_str()).collect();
    let counts: Vec<i64> = parts.values().map(|p| p.count).collect();
    let firsts: Vec<SystemTime> = parts.values().map(|p| p.first).collect();
    let lasts: Vec<SystemTime> = parts.values().map(|p| p.last).collect();
    let expected: i64 = counts.iter().sum();
    let logical = layout.map.len() as i32;
    let gid = gid(from, to, shards[0]);

    // 2. The copy, on the target.
    target.batch_execute("BEGIN").await?;
    target
        .execute(
            "INSERT INTO tallyd.rollups AS r (counter, key, count, first_seen, last_seen) \
             SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::timestamptz[], $5::timestamptz[]) \
             ON CONFLICT (counter, key) DO UPDATE SET count = r.count + EXCLUDED.count, \
                 first_seen = LEAST(r.first_seen, EXCLUDED.first_seen), \
                 last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen)",
            &[&counters, &keys, &counts, &firsts, &lasts],
        )
        .await?;
    let found: i64 = target
        .query_one(
            "SELECT coalesce(sum(t.count), 0)::bigint FROM tallyd.totals t \
             JOIN unnest($1::text[], $2::text[]) AS u (counter, key) USING (counter, key)",
            &[&counters, &keys],
        )
        .await?
        .get(0);
    if found != expected {
        target.batch_execute("ROLLBACK").await?;
        return Err(MoveError::Mismatch {
            from,
            to,
            found,
            expected,
        });
    }
    target
        .execute(
            "INSERT INTO tallyd.shards (shard, logical_shards) SELECT unnest($1::int[]), $2",
            &[&shards, &logical],
        )
        .await?;
    target
        .batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
        .await?;

    // 3. The delete, on the source.
    source.batch_execute("BEGIN").await?;
    for table in ["tallyd.slots", "tallyd.rollups"] {
        source
            .execute(
                &format!(
                    "DELETE FROM {table} t USING unnest($1::text[], $2::text[]) AS u (counter, key) \
                     WHERE t.counter = u.counter AND t.key = u.key"
                ),
                &[&counters, &keys],
            )
            .await?;
    }
    source
        .execute(
            "DELETE FROM tallyd.shards WHERE shard = ANY($1)",
            &[&shards],
        )
        .await?;
    source
        .batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
        .await?;
    info!(
        from,
        to,
        shards = shards.len(),
        keys = keys.len(),
        events = expected,
        "logical shards copied and prepared"
    );
    Ok(gid)
}

/// Step 4: the source first, so that [`resume`] can tell how far a crash let it get.
pub async fn commit_group(
    clients: &[Client],
    from: usize,
    to: usize,
    gid: &str,
) -> Result<(), MoveError> {
    clients[from]
        .batch_execute(&format!("COMMIT PREPARED '{gid}'"))
        .await?;
    clients[to]
        .batch_execute(&format!("COMMIT PREPARED '{gid}'"))
        .await?;
    info!(from, to, %gid, "logical shards moved");
    Ok(())
}

/// Settles moves a crash interrupted (see the module docs).
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
            let gid: String = row.get(0);
            let Some((from, to, first)) = parse_gid(&gid) else {
                continue;
            };
            let source = clients.get(from);
            let commit = if index == from {
                // The source prepared its delete: the target had prepared its copy before.
                true
            } else if let Some(source) = source {
                let still_owned = source
                    .query_typed_opt(
                        "SELECT 1 FROM tallyd.shards WHERE shard = $1",
                        &[(&first, Type::INT4)],
                    )
                    .await?
                    .is_some();
                let source_prepared = source
                    .query_typed_opt(
                        "SELECT 1 FROM pg_prepared_xacts WHERE gid = $1",
                        &[(&gid, Type::TEXT)],
                    )
                    .await?
                    .is_some();
                !still_owned || source_prepared
            } else {
                false
            };
            let verb = if commit { "COMMIT" } else { "ROLLBACK" };
            info!(%gid, database = index, to, verb, "settling an interrupted shard move");
            client
                .batch_execute(&format!("{verb} PREPARED '{gid}'"))
                .await?;
        }
    }
    Ok(())
}

fn parse_gid(gid: &str) -> Option<(usize, usize, i32)> {
    let mut parts = gid.strip_prefix("tallyd-move-")?.split('-');
    Some((
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn gids_round_trip() {
        assert_eq!(super::parse_gid(&super::gid(0, 2, 160)), Some((0, 2, 160)));
        assert_eq!(super::parse_gid("other"), None);
    }
}
