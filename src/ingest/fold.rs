//! The folder: routes records that were spilled at the memory cap (journaled only, see
//! [`Journal::record`]) to the buckets, reading them back from the journal's segments in
//! order of their numbers, one record at a time as flushes make room. The start's replay routes
//! old records the same way ([`route`]).
//!
//! Exactly once: a record is routed under the journal's gate and marked routed before the gate
//! is let go, and no drain point passes a record that is not routed, so a flush's coverage
//! never claims a spilled record before its events are in the flight, nor after (see
//! docs/reliability.md, "Spilling at the memory cap").

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Ingest, Router};
use crate::events;
use crate::journal::{self, Journal, JournalError};
use crate::throttle::Throttle;

/// Routes the lines of record `seq` to the buckets under the journal's gate, then marks it
/// routed (see [`Journal::fold`]).
pub(crate) async fn route(
    ingest: &Ingest,
    journal: &Journal,
    router: &mut Router,
    seq: u64,
    lines: &[u8],
) {
    journal
        .fold(seq, async {
            for line in lines.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                router.line(ingest, Ok(line));
            }
            // Not `send`: the gate is held already, and these lines are journaled already.
            router.reserve(ingest);
            router.send_batches(ingest).await;
        })
        .await;
}

/// Folds spilled records until `stop`, or once none waits after `finish` (the daemon's stop,
/// with the listeners closed): waits for a spill, then routes every spilled record as memory
/// has room, until none waits. What is still spilled at the stop stays in the journal for the
/// next start's replay.
pub async fn run(
    ingest: &Ingest,
    journal: &Journal,
    finish: CancellationToken,
    stop: CancellationToken,
) {
    let mut router = Router::for_journal(ingest);
    // Counted as accepted when they were spilled.
    router.counts_accepted = false;
    let errors = Throttle::new(10_000);
    let mut seen = Seen::default();
    loop {
        tokio::select! {
            _ = journal.spilled() => {}
            _ = finish.cancelled(), if journal.unrouted().is_none() => break,
            _ = stop.cancelled() => break,
        }
        match round(ingest, journal, &mut router, &mut seen, &stop).await {
            Ok(0) => {
                // A record numbered before the sync but handed to the writer after it: the next
                // round finds it.
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                    _ = stop.cancelled() => break,
                }
            }
            Ok(_) => {}
            Err(err) => {
                if let Some(suppressed) = errors.allow() {
                    warn!(cause = %err, suppressed, "cannot read spilled records back from the journal; retrying");
                }
                tokio::select! {
                    _ = tokio::time::sleep(journal::RETRY_EVERY) => {}
                    _ = stop.cancelled() => break,
                }
            }
        }
        report(journal);
    }
    router.close(ingest).await;
    if let Some(first) = journal.unrouted() {
        let records = journal.last_numbered() + 1 - first;
        warn!(
            records,
            unrouted_from = first,
            "spilled journal records not yet routed at the stop: the next start replays them"
        );
    }
}

fn report(journal: &Journal) {
    events::Unfolded {
        records: journal.unfolded(),
    }
    .emit();
}

/// Where the folder is in the journal: its place in each segment (see [`journal::read_chunk`]),
/// so that a round reads only what was appended since the last, and the records read past a
/// gap in the numbers, kept until the gap is filled (a later segment may hold the missing
/// number: the writer appends in the order records reach it, so one numbered just before a
/// rollover can land in the next segment).
#[derive(Debug, Default)]
struct Seen {
    places: HashMap<PathBuf, journal::Place>,
    ahead: BTreeMap<u64, Vec<u8>>,
}

/// Routes the spilled records that are on disk now, in order, each once memory has room.
/// Returns how many it routed.
async fn round(
    ingest: &Ingest,
    journal: &Journal,
    router: &mut Router,
    seen: &mut Seen,
    stop: &CancellationToken,
) -> Result<u64, FoldError> {
    let Some(mut next) = journal.unrouted() else {
        return Ok(0);
    };
    // Everything numbered before the sync is in the segments once it answers (a record numbered
    // before it may still reach the writer after it: the contiguous run of numbers stops there
    // and a later round goes on). While journal writes fail (a full disk), the sync answers an
    // error, but what is on disk is still folded: its commits are what lets covered segments go
    // and frees the disk (records whose write failed are a gap, folded once a retry has written
    // them). Every record numbered from the first unrouted one on is spilled (once one spills,
    // every later one does) until the folder has routed the last of them: from then on the
    // records appended are not the folder's, so it asks the journal before routing each.
    if let Err(cause) = journal.sync().await {
        debug!(%cause, "journal writes failing; folding the spilled records already written");
    }
    let mut routed = 0;
    seen.ahead.retain(|&seq, _| seq >= next);
    let paths = journal::segments(journal.dir())?;
    seen.places.retain(|p, _| paths.contains(p));
    let newest = paths.len().saturating_sub(1);
    for (i, path) in paths.into_iter().enumerate() {
        let closed = i < newest;
        loop {
            let place = seen.places.get(&path).copied().unwrap_or_default();
            if place.done {
                break;
            }
            let read = path.clone();
            let (records, after) =
                tokio::task::spawn_blocking(move || journal::read_chunk(&read, place, closed))
                    .await??;
            seen.places.insert(path.clone(), after);
            for (seq, lines) in records.into_iter().filter(|(seq, _)| *seq >= next) {
                seen.ahead.entry(seq).or_insert(lines);
            }
            loop {
                // Only the first unrouted record is the folder's to route next. Once it has
                // routed the last spilled one, the records numbered after it went to memory at
                // once, and the chunks it reads next hold them too: routed again, their events
                // would count twice (and a set's earlier events after it). A later spill starts
                // unrouted records again further on.
                match journal.unrouted() {
                    None => return Ok(routed),
                    Some(first) if first != next => {
                        next = first;
                        seen.ahead.retain(|&seq, _| seq >= next);
                    }
                    Some(_) => {}
                }
                let Some(lines) = seen.ahead.remove(&next) else {
                    break;
                };
                tokio::select! {
                    _ = ingest.shared.wait_for_room() => {}
                    _ = stop.cancelled() => {
                        seen.ahead.insert(next, lines);
                        return Ok(routed);
                    }
                }
                let accepted = router.accepted;
                // As its sender: under its connection id, so an overflow is reported to the
                // sender (its `!flush` waits for this record's commit, then asks its buckets),
                // and with its correction numbers, so a refused set is answered on its line.
                let own = router.sender();
                router.set_sender(ingest.owners.take(next).unwrap_or(own));
                route(ingest, journal, router, next, &lines).await;
                router.set_sender(own);
                events::RecordFolded {
                    events: router.accepted - accepted,
                }
                .emit();
                routed += 1;
                next += 1;
                report(journal);
            }
            if after == place || after.done {
                break;
            }
        }
    }
    Ok(routed)
}

#[derive(Debug, thiserror::Error)]
enum FoldError {
    #[error(transparent)]
    Read(#[from] JournalError),
    #[error("reading a segment stopped: {0}")]
    Join(#[from] tokio::task::JoinError),
}
