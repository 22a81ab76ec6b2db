//! A move's rows: what it reads from the source's shards (slots and rollups summed per key and
//! window, by the kind algebra), what it deletes there, and the batch claims it copies along.

use std::collections::{HashMap, HashSet};
use std::time::SystemTime;

use tokio_postgres::Client;

use super::{MoveError, Part};
use crate::hll::Sketch;
use crate::kind::{Kept, Kind, Theirs};
use crate::routing::{self, Layout};

/// The source's batch claims (`tallyd.batches`) go with its shards to the target, in the copy's
/// transaction: a batch counted before the move, resent after it, finds its claim where its
/// moved keys now live and counts nothing there (docs/reliability.md, "Batches"). A claim the
/// target has already (another copy's) stays: each database's part counted once either way.
pub(super) async fn copy_batch_claims(source: &Client, target: &Client) -> Result<(), MoveError> {
    let rows = source
        .query(
            "SELECT id, instance_id, payload, claimed_at FROM tallyd.batches",
            &[],
        )
        .await?;
    let ids: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    let instances: Vec<String> = rows.iter().map(|r| r.get(1)).collect();
    let payloads: Vec<i64> = rows.iter().map(|r| r.get(2)).collect();
    let at: Vec<SystemTime> = rows.iter().map(|r| r.get(3)).collect();
    target
        .execute(
            "INSERT INTO tallyd.batches (id, instance_id, payload, claimed_at) \
             SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::timestamptz[]) \
             ON CONFLICT (id) DO NOTHING",
            &[&ids, &instances, &payloads, &at],
        )
        .await?;
    Ok(())
}

/// The rows (slots and rollups) of `client`'s database whose keys fall in `shards`, summed
/// per key and window.
pub(super) async fn read_shards(
    client: &Client,
    layout: &Layout,
    shards: &HashSet<i32>,
) -> Result<HashMap<(String, String, String, i64), Part>, MoveError> {
    let mut parts: HashMap<(String, String, String, i64), Part> = HashMap::new();
    let win = crate::store::WIN_AS_MS;
    let rows = client
        .query_typed(
            &format!(
                "SELECT counter, key, count, first_seen, last_seen, span, {win}, kind, value, sketch \
                 FROM tallyd.slots \
                 UNION ALL SELECT counter, key, count, first_seen, last_seen, span, {win}, kind, \
                 value, sketch FROM tallyd.rollups"
            ),
            &[],
        )
        .await?;
    for row in rows {
        let (counter, key): (String, String) = (row.get(0), row.get(1));
        let (span, win): (String, i64) = (row.get(5), row.get(6));
        let hash = routing::key_hash(routing::counter_seed(&counter), key.as_bytes());
        if !shards.contains(&(routing::logical_shard(hash, layout.map.len()) as i32)) {
            continue;
        }
        let (count, first, last): (i64, SystemTime, SystemTime) =
            (row.get(2), row.get(3), row.get(4));
        let (kind, value, sketch): (Option<String>, Option<i64>, Option<Vec<u8>>) =
            (row.get(7), row.get(8), row.get(9));
        let what = || format!("counter {counter} key {key}");
        let sketch = sketch
            .map(|bytes| Sketch::from_bytes(&bytes))
            .transpose()
            .map_err(|e| MoveError::Sketch {
                row: what(),
                cause: e.to_string(),
            })?;
        let merge = |cause: String| MoveError::Merge { row: what(), cause };
        let of_kind = Kind::of_column(kind.as_deref())
            .ok_or_else(|| merge(format!("its kind {kind:?} is none tallyd writes")))?;
        let theirs = Kept::of_row(of_kind, value, sketch);
        let part = parts
            .entry((counter.clone(), key.clone(), span, win))
            .or_insert(Part {
                count: 0,
                first,
                last,
                kind: kind.clone(),
                value: None,
            });
        match (&mut part.value, theirs) {
            (_, None) => {}
            (mine @ None, theirs) => *mine = theirs,
            (Some(mine), Some(theirs)) => mine
                .merge(part.last, Theirs::Kept(&theirs), last)
                .map_err(|e| merge(e.to_string()))?,
        }
        part.count += count;
        part.first = part.first.min(first);
        part.last = part.last.max(last);
    }
    Ok(parts)
}

/// Deletes the given keys' rows and the shards' ownership, inside the caller's transaction.
pub(super) async fn delete_shards(
    client: &Client,
    counters: &[&str],
    keys: &[&str],
    shards: &[i32],
) -> Result<(), MoveError> {
    for table in ["tallyd.slots", "tallyd.rollups"] {
        client
            .execute(
                &format!(
                    "DELETE FROM {table} t USING unnest($1::text[], $2::text[]) AS u (counter, key) \
                     WHERE t.counter = u.counter AND t.key = u.key"
                ),
                &[&counters, &keys],
            )
            .await?;
    }
    client
        .execute(
            "DELETE FROM tallyd.shards WHERE shard = ANY($1)",
            &[&shards],
        )
        .await?;
    Ok(())
}
