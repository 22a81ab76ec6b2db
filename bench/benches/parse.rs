//! Criterion micro-benchmark of line parsing: a stream connection's path from read buffer to
//! event (`LineBuffer` framing, then `parse_line`), over a realistic mix of counters, key types,
//! deltas and timestamps. Throughput is in lines (each one an event).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use tallyd::protocol::{parse_line, Counters, KeyType, Limits, Line, LineBuffer};

/// Lines per measured buffer: about a second of a busy client's traffic in a few hundred KiB.
const LINES: usize = 10_000;
/// What one `read` hands the framer (the listener's read size).
const READ_SIZE: usize = 64 * 1024;

fn counters() -> Counters {
    Counters::new([
        ("page_views", KeyType::Text),
        ("downloads", KeyType::Text),
        ("item_sold", KeyType::Bigint),
        ("user_events", KeyType::Uuid),
        ("ip_seen", KeyType::Inet),
    ])
}

/// One line of the mix: mostly plain text keys, some with a delta or a timestamp, and keys that
/// need canonicalising (upper-case UUIDs, IPv6) so the inline-key path is measured too.
fn line(rng: &mut StdRng, out: &mut Vec<u8>) {
    let n: u32 = rng.gen_range(0..1_000);
    let at = 1_700_000_000_000u64 + u64::from(n);
    let text = match rng.gen_range(0..10) {
        0..=3 => format!("page_views /products/{n}\n"),
        4 => format!("downloads report-{n}.pdf {}\n", n % 7 + 1),
        5 => format!("downloads report-{n}.pdf 1 @{at}\n"),
        6 => format!("item_sold {} -1\n", 100_000 + n),
        7 => format!("user_events 6ba7b810-9dad-11d1-80b4-00c04fd4{n:04}\n"),
        8 => format!("user_events 6BA7B810-9DAD-11D1-80B4-00C04FD4{n:04} @{at}\n"),
        _ => format!("ip_seen 2001:db8::{n:x} 1 @{at}\n"),
    };
    out.extend_from_slice(text.as_bytes());
}

fn stream() -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(12);
    let mut buf = Vec::with_capacity(LINES * 48);
    for _ in 0..LINES {
        line(&mut rng, &mut buf);
    }
    buf
}

/// Frames and parses `bytes` as the listener does, read by read; returns the events seen.
fn frame_and_parse(framer: &mut LineBuffer, bytes: &[u8], counters: &Counters) -> u64 {
    let limits = Limits::default();
    let mut events = 0;
    for chunk in bytes.chunks(READ_SIZE) {
        framer.read_buf().extend_from_slice(chunk);
        framer.drain_lines(|line| {
            if let Ok(Line::Event(ev)) = line.and_then(|l| parse_line(l, counters, &limits)) {
                black_box(&ev);
                events += 1;
            }
        });
    }
    framer.finish(|_| {});
    events
}

fn parse(c: &mut Criterion) {
    let bytes = stream();
    let counters = counters();
    let mut framer = LineBuffer::new(Limits::default().max_line_bytes, READ_SIZE);
    // Every line of the mix is valid: a parse regression that rejects lines shows here first.
    assert_eq!(
        frame_and_parse(&mut framer, &bytes, &counters),
        LINES as u64
    );
    let mut group = c.benchmark_group("parse");
    group.throughput(Throughput::Elements(LINES as u64));
    // One framer for every iteration, as one connection keeps its buffer.
    group.bench_function("mixed_lines", |b| {
        b.iter(|| frame_and_parse(&mut framer, black_box(&bytes), &counters))
    });
    group.finish();
}

criterion_group!(benches, parse);
criterion_main!(benches);
