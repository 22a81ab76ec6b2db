//! What an earlier run left in the journal, read at start before anything is written: its
//! segments, how far the ledger says each writer committed them, lines written under another
//! layout (rewritten under this one), and the journal this run opens after them.

use std::path::PathBuf;
use std::sync::Arc;

use super::DaemonError;
use tracing::info;

use crate::config::Config;
use crate::journal::replay::Coverage;
use crate::journal::{self, Journal, OldSegment};
use crate::routing::Layout;
use crate::store::lease::Lease;
use crate::store::{coverage, Db};

/// What an earlier run left in the journal (after a crash, or a stop that could not flush), and
/// how far the ledger says this instance's writers have committed it.
pub(super) struct Backlog {
    pub(super) dir: PathBuf,
    pub(super) segments: Vec<OldSegment>,
    pub(super) covered: Coverage,
    /// Uncommitted lines written under a layout other than this run's: the journal is
    /// rewritten under this one before the replay (see [`Backlog::translate`]).
    pub(super) foreign: Option<journal::replay::Foreign>,
}

impl Backlog {
    pub(super) async fn read(
        config: &Config,
        dbs: &[Db],
        lease: &Lease,
    ) -> Result<Backlog, DaemonError> {
        let dir = config.daemon.data_dir.join("journal");
        let segments = journal::read_segments(&dir, &config.layout())?.segments;
        let mut covered = coverage::covered(dbs, lease).await?;
        covered.uniques = config
            .counters
            .iter()
            .filter(|c| c.kind == crate::kind::Kind::Unique)
            .map(|c| c.name.clone())
            .collect();
        if !config.journal.enabled && !segments.is_empty() {
            return Err(DaemonError::Unreplayed { dir });
        }
        // Replay is exactly once only under the layout that wrote the journal: another one's
        // lines are rewritten under this one (after the checks, once nothing can refuse the
        // start), which needs the ledger rows of every database the old layout wrote to.
        let current = config.layout();
        let foreign = journal::replay::foreign(&segments, &covered, &current)?;
        if let Some(f) = &foreign {
            if f.databases > dbs.len() {
                return Err(DaemonError::JournalDatabases {
                    dir,
                    lines: f.lines,
                    journal: f.databases,
                    configured: dbs.len(),
                });
            }
        }
        let declared = |name: &str| config.counters.iter().any(|c| c.name == name);
        let undeclared = journal::replay::undeclared(&segments, &covered, declared)?;
        if !undeclared.is_empty() {
            let counters = undeclared
                .iter()
                .map(|(name, lines)| format!("{name}: {lines} events"))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(DaemonError::UndeclaredCounters { dir, counters });
        }
        Ok(Backlog {
            dir,
            segments,
            covered,
            foreign,
        })
    }

    /// When another layout wrote lines no flush covers, rewrites the uncovered lines of every
    /// old segment (each chosen under the layout that wrote it) as one segment of `current`,
    /// numbered above everything the ledger or the segments hold, which supersedes the old
    /// segments (`journal::translate`). Its replay is then an ordinary one: exactly once under
    /// the layout that wrote it, whatever crash interrupts it.
    pub(super) fn translate(self, current: &Layout) -> Result<Backlog, DaemonError> {
        let Some(foreign) = &self.foreign else {
            return Ok(self);
        };
        let chosen = journal::replay::select(&self.segments, &self.covered, current)?;
        let first = journal::replay::first_seq(&self.segments, &self.covered);
        // Held whole while written (a rare start: after a layout change with a backlog).
        let lines = journal::replay::replayed(&self.segments, &self.covered, chosen.records)
            .map(|r| r.map(|(_, lines)| lines))
            .collect::<Result<Vec<_>, _>>()?;
        let translated = journal::translate(&self.dir, current, first, lines)?;
        info!(
            lines = chosen.kept,
            foreign = foreign.lines,
            changes = %foreign.changes(current),
            segment = %translated.path.display(),
            "the journal holds uncommitted events written under another layout: rewritten under this one, to be replayed"
        );
        let mut segments = self.segments;
        for old in &mut segments {
            // Superseded: kept only to be retired after the replay.
            old.records.clear();
        }
        segments.push(translated);
        Ok(Backlog {
            segments,
            foreign: None,
            ..self
        })
    }
}

pub(super) fn open_journal(
    config: &Config,
    backlog: &Backlog,
) -> Result<Option<Arc<Journal>>, DaemonError> {
    if !config.journal.enabled {
        return Ok(None);
    }
    let first_seq = journal::replay::first_seq(&backlog.segments, &backlog.covered);
    let journal = Journal::open(&config.journal, &backlog.dir, first_seq, &config.layout())?;
    Ok(Some(Arc::new(journal)))
}
