//! Who sent each record spilled at the memory cap, so that the folder routes it under its
//! sender's connection id: an overflow found while folding it is then reported in that
//! connection's `!flush` answer, as when its events go to memory directly.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// The senders of the spilled records not yet folded: 8 bytes a record.
#[derive(Debug, Default)]
pub(crate) struct Owners(Mutex<Inner>);

#[derive(Debug, Default)]
struct Inner {
    /// The number of the record `by[0]` is about.
    first: u64,
    /// The connection of each record from `first` on (0: not known). Spilled records are
    /// numbered one after the other from the first not yet folded (once one spills, every
    /// later one does), so an index does.
    by: VecDeque<u64>,
    /// The next record the folder takes: a sender known only later is not kept.
    folded: u64,
    /// Connections that closed with spilled records not yet folded, with the last of those: no
    /// one will ask for their overflows.
    closed: HashMap<u64, u64>,
}

impl Owners {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Record `seq` was spilled by connection `conn`.
    pub(crate) fn spilled(&self, seq: u64, conn: u64) {
        let mut n = self.inner();
        if seq < n.folded {
            return;
        }
        if n.by.is_empty() {
            n.first = seq;
        }
        while seq < n.first {
            n.by.push_front(0);
            n.first -= 1;
        }
        let i = (seq - n.first) as usize;
        if n.by.len() <= i {
            n.by.resize(i + 1, 0);
        }
        n.by[i] = conn;
    }

    /// Connection `conn` closed; `last` is the last record it spilled (0: none).
    pub(crate) fn closed(&self, conn: u64, last: u64) {
        let mut n = self.inner();
        if last >= n.folded && last > 0 {
            n.closed.insert(conn, last);
        }
    }

    /// The folder takes record `seq`: its sender, if known and still connected.
    pub(crate) fn take(&self, seq: u64) -> Option<u64> {
        let mut n = self.inner();
        let owner = seq
            .checked_sub(n.first)
            .and_then(|i| n.by.get(i as usize).copied())
            .filter(|&c| c != 0 && !n.closed.contains_key(&c));
        n.folded = n.folded.max(seq + 1);
        while n.first < n.folded && n.by.pop_front().is_some() {
            n.first += 1;
        }
        n.closed.retain(|_, last| *last > seq);
        owner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn senders_are_found_in_order_and_forgotten_once_folded() {
        let o = Owners::default();
        o.spilled(5, 10);
        o.spilled(7, 11);
        // Known after a later record.
        o.spilled(4, 12);
        o.closed(11, 7);
        assert_eq!(o.take(4), Some(12));
        assert_eq!(o.take(5), Some(10));
        assert_eq!(o.take(6), None, "never reported");
        assert_eq!(o.take(7), None, "closed: no one will ask");
        // Known after the folder passed it: not kept.
        o.spilled(6, 13);
        assert!(o.inner().by.is_empty());
        assert!(o.inner().closed.is_empty());
        // A new spill far ahead.
        o.spilled(100, 14);
        assert_eq!(o.take(100), Some(14));
        assert!(o.inner().by.is_empty());
    }
}
