//! Who sent each record spilled at the memory cap, so that the folder routes it as its sender:
//! under the sender's connection id, so that an overflow found while folding it is reported in
//! that connection's `!flush` answer, and with the sender's correction numbers, so that a set
//! the flush refuses is answered `error` on the line that sent it, as when the record's events
//! go to memory directly.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// A spilled record's sender: its connection id, and how many corrections that connection had
/// sent before the record (its first correction is number `corrections + 1` there).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Sender {
    pub conn: u64,
    pub corrections: u64,
}

/// The senders of the spilled records not yet folded: 16 bytes a record.
#[derive(Debug, Default)]
pub(crate) struct Owners(Mutex<Inner>);

#[derive(Debug, Default)]
struct Inner {
    /// The number of the record `by[0]` is about.
    first: u64,
    /// The sender of each record from `first` on (connection 0: not known). Spilled records
    /// are numbered one after the other from the first not yet folded (once one spills, every
    /// later one does), so an index does.
    by: VecDeque<Sender>,
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

    /// Record `seq` was spilled by `sender`.
    pub(crate) fn spilled(&self, seq: u64, sender: Sender) {
        let mut n = self.inner();
        if seq < n.folded {
            return;
        }
        if n.by.is_empty() {
            n.first = seq;
        }
        while seq < n.first {
            n.by.push_front(Sender::default());
            n.first -= 1;
        }
        let i = (seq - n.first) as usize;
        if n.by.len() <= i {
            n.by.resize(i + 1, Sender::default());
        }
        n.by[i] = sender;
    }

    /// Connection `conn` closed; `last` is the last record it spilled (0: none).
    pub(crate) fn closed(&self, conn: u64, last: u64) {
        let mut n = self.inner();
        if last >= n.folded && last > 0 {
            n.closed.insert(conn, last);
        }
    }

    /// The folder takes record `seq`: its sender, if known and still connected.
    pub(crate) fn take(&self, seq: u64) -> Option<Sender> {
        let mut n = self.inner();
        let owner = seq
            .checked_sub(n.first)
            .and_then(|i| n.by.get(i as usize).copied())
            .filter(|s| s.conn != 0 && !n.closed.contains_key(&s.conn));
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
        let by = |conn, corrections| Sender { conn, corrections };
        o.spilled(5, by(10, 2));
        o.spilled(7, by(11, 0));
        // Known after a later record.
        o.spilled(4, by(12, 7));
        o.closed(11, 7);
        assert_eq!(o.take(4), Some(by(12, 7)));
        assert_eq!(o.take(5), Some(by(10, 2)));
        assert_eq!(o.take(6), None, "never reported");
        assert_eq!(o.take(7), None, "closed: no one will ask");
        // Known after the folder passed it: not kept.
        o.spilled(6, by(13, 0));
        assert!(o.inner().by.is_empty());
        assert!(o.inner().closed.is_empty());
        // A new spill far ahead.
        o.spilled(100, by(14, 1));
        assert_eq!(o.take(100), Some(by(14, 1)));
        assert!(o.inner().by.is_empty());
    }
}
