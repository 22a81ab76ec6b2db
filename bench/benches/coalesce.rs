//! Criterion micro-benchmark of coalescing: a bucket's `Pending::record` over batches of events,
//! then the `drain` a flush takes, for three key distributions (one hot key, a thousand keys,
//! every key new). Throughput is in events.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use tallyd::bucket::{Batch, Drained, Pending};
use tallyd::routing::{counter_seed, key_hash};

/// Events recorded between two drains.
const EVENTS: usize = 100_000;
/// Events per batch: what one read buffer carries to one bucket.
const BATCH: usize = 1_000;
const AT_MS: i64 = 1_700_000_000_000;

/// `EVENTS` events in batches of `BATCH`, keys drawn by `key`, hashed as the listener does.
fn batches(mut key: impl FnMut(usize) -> String) -> Vec<Batch> {
    let seed = counter_seed("page_views");
    let mut out = Vec::new();
    for start in (0..EVENTS).step_by(BATCH) {
        let mut batch = Batch::default();
        for i in start..start + BATCH {
            let key = key(i);
            batch.push(key_hash(seed, key.as_bytes()), 0, &key, 1, AT_MS + i as i64);
        }
        out.push(batch);
    }
    out
}

/// Records every batch into a fresh `Pending` (from 16 connections in turn) and drains it.
fn coalesce(batches: &[Batch]) -> Drained {
    let mut pending = Pending::default();
    for (conn, batch) in batches.iter().enumerate() {
        black_box(pending.record(conn as u64 % 16, batch));
    }
    pending.drain()
}

fn coalescing(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(9);
    let cases = [
        ("hot_key", batches(|_| "hot".to_string()), 1),
        (
            "1k_keys",
            batches(|_| format!("/products/{}", rng.gen_range(0..1_000))),
            1_000,
        ),
        ("all_new", batches(|i| format!("/products/{i}")), EVENTS),
    ];
    let mut group = c.benchmark_group("coalesce");
    group.throughput(Throughput::Elements(EVENTS as u64));
    for (name, batches, keys) in &cases {
        let drained = coalesce(batches);
        assert_eq!(
            (drained.events, drained.entries.len()),
            (EVENTS as u64, *keys),
            "{name}"
        );
        // The drained table is dropped outside the timing: the flush worker owns it then.
        group.bench_function(*name, |b| {
            b.iter_with_large_drop(|| coalesce(black_box(batches)))
        });
    }
    group.finish();
}

criterion_group!(benches, coalescing);
criterion_main!(benches);
