//! The journal, against the real `tallyd run` binary and a real PostgreSQL: its disk full in each
//! fsync mode, a batch whose routed record cannot be written, and a damaged segment
//! (`disk_full`), its cap `journal.max_bytes` through a
//! database outage and a kill at the cap (`max_bytes`), and its replay across a change of the
//! flush layout or the shard map (`layout_change`). Every acknowledged event counted exactly
//! once. The journal's replay after kill -9 under every workload: tests/faults; records
//! spilled at the memory cap: tests/outage.

#[path = "../common/mod.rs"]
mod common;
mod disk_full;
mod layout_change;
mod max_bytes;
