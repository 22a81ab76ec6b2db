//! Routing: where an event goes. The stable hash of a (counter, key), the bucket and logical
//! shard it picks, and the [`Layout`] that maps logical shards to databases and buckets to flush
//! workers. The listener, the journal (its segment headers), shard moves and `tallyd get` all
//! route by these functions, so a key lands in the same place everywhere.

/// Stable hash of (counter, key): xxh3-64 of the key seeded with xxh3-64 of the counter name.
/// It decides the bucket (and, with several databases, the logical shard), so it must never change.
pub fn key_hash(counter_seed: u64, key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key, counter_seed)
}

/// The seed of a counter's key hashes: xxh3-64 of its name.
pub fn counter_seed(name: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(name.as_bytes())
}

/// Maps a hash onto `0..n` without the bias or the division of `%` (Lemire's multiply-shift).
pub fn reduce(hash: u64, n: usize) -> usize {
    ((hash as u128 * n as u128) >> 64) as usize
}

/// The logical shard of a key: the same stable hash, other bits than the bucket uses.
pub fn logical_shard(hash: u64, logical_shards: usize) -> usize {
    reduce(hash.rotate_left(32), logical_shards)
}

/// Where a key goes: its logical shard picks a database (`map`), and each database has its own
/// `buckets` bucket actors and `workers` flush workers. Bucket and worker numbers are global:
/// database `d` owns buckets `d * buckets ..` and workers `d * workers ..`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub buckets: usize,
    pub workers: usize,
    /// Database index of each logical shard.
    pub map: Vec<u16>,
}

impl Layout {
    /// One database: every logical shard maps to it.
    pub fn single(buckets: usize, workers: usize) -> Layout {
        Layout {
            buckets,
            workers,
            map: vec![0],
        }
    }

    pub fn databases(&self) -> usize {
        self.map.iter().copied().max().map_or(1, |d| d as usize + 1)
    }

    pub fn database(&self, hash: u64) -> usize {
        self.map[logical_shard(hash, self.map.len())] as usize
    }

    pub fn bucket(&self, hash: u64) -> usize {
        self.database(hash) * self.buckets + reduce(hash, self.buckets)
    }

    pub fn worker_of(&self, bucket: usize) -> usize {
        (bucket / self.buckets) * self.workers + (bucket % self.buckets) % self.workers
    }

    pub fn total_buckets(&self) -> usize {
        self.databases() * self.buckets
    }

    pub fn total_workers(&self) -> usize {
        self.databases() * self.workers
    }

    /// The logical shards database `db` owns.
    pub fn owned(&self, db: usize) -> Vec<i32> {
        (0..self.map.len())
            .filter(|&s| self.map[s] as usize == db)
            .map(|s| s as i32)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_stays_in_range_and_spreads() {
        let mut seen = [0u32; 12];
        for i in 0..12_000u64 {
            seen[reduce(key_hash(3, &i.to_le_bytes()), 12)] += 1;
        }
        assert!(seen.iter().all(|&n| (800..1200).contains(&n)), "{seen:?}");
    }
}
