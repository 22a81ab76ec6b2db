//! Load: pre-built buffers of protocol lines, one per client (one hot key, uniform or Zipf keys,
//! distinct keys; for a unique counter, a value on each line).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::env::{COUNTER, HOT, UNIQUE_COUNTER};

/// The exponent of the Zipf-distributed keys (`tallyd-hc-zipf`).
const ZIPF_S: f64 = 1.0;

#[derive(Clone, Copy, Debug)]
pub(crate) enum KeyDist {
    Uniform,
    Zipf,
}

/// What the clients send, and what `tallyd.totals` must hold afterwards.
pub(crate) struct Load {
    pub(crate) buffers: Vec<Vec<u8>>,
    pub(crate) events: u64,
    pub(crate) keys: u64,
}

/// Events client `i` of `clients` sends, so that they add up to `events`.
pub(crate) fn share(events: u64, clients: usize, i: usize) -> u64 {
    let clients = clients as u64;
    events / clients + u64::from((i as u64) < events % clients)
}

pub(crate) fn hot_load(events: u64, clients: usize) -> Load {
    let line = format!("{COUNTER} {HOT}\n");
    Load {
        buffers: (0..clients)
            .map(|i| line.repeat(share(events, clients, i) as usize).into_bytes())
            .collect(),
        events,
        keys: u64::from(events > 0),
    }
}

/// `events` events over `keys` keys drawn from `dist`.
pub(crate) fn spread_load(events: u64, keys: u64, clients: usize, dist: KeyDist) -> Load {
    let zipf = matches!(dist, KeyDist::Zipf).then(|| Zipf::new(keys as usize, ZIPF_S));
    let mut rng = StdRng::from_entropy();
    let mut seen = vec![false; keys as usize];
    let buffers = (0..clients)
        .map(|i| {
            let n = share(events, clients, i);
            let mut buf = Vec::with_capacity(n as usize * 16);
            for _ in 0..n {
                let k = match &zipf {
                    Some(z) => z.sample(&mut rng),
                    None => rng.gen_range(0..keys),
                };
                seen[k as usize] = true;
                push_key_line(&mut buf, k);
            }
            buf
        })
        .collect();
    Load {
        buffers,
        events,
        keys: seen.iter().filter(|s| **s).count() as u64,
    }
}

/// A load of a unique counter (`visitors <key> v<n>` lines), and how many distinct values its
/// keys hold: what their sketches' cardinalities must come near.
pub(crate) struct UniqueLoad {
    pub(crate) load: Load,
    /// Distinct (key, value) pairs: the sum of every key's true cardinality.
    pub(crate) distinct: u64,
    /// The most distinct values one key holds.
    pub(crate) max_per_key: u64,
}

/// `events` events on the hot key, each value drawn uniformly from `v0` to `v<values - 1>`.
pub(crate) fn unique_hot_load(events: u64, values: u64, clients: usize) -> UniqueLoad {
    let mut rng = StdRng::from_entropy();
    let mut seen = vec![false; values as usize];
    let buffers = (0..clients)
        .map(|i| {
            let n = share(events, clients, i);
            let mut buf = Vec::with_capacity(n as usize * 24);
            for _ in 0..n {
                let v = rng.gen_range(0..values);
                seen[v as usize] = true;
                push_unique_line(&mut buf, HOT.as_bytes(), v);
            }
            buf
        })
        .collect();
    let distinct = seen.iter().filter(|s| **s).count() as u64;
    UniqueLoad {
        load: Load {
            buffers,
            events,
            keys: u64::from(events > 0),
        },
        distinct,
        max_per_key: distinct,
    }
}

/// `events` events over `keys` keys `k<n>` drawn uniformly (the `tallyd-hc-uniform` load), each
/// with one of its key's `per_key` values (key n's are `v<n * per_key>` to `v<n * per_key +
/// per_key - 1>`), drawn uniformly too.
pub(crate) fn unique_spread_load(
    events: u64,
    keys: u64,
    per_key: u64,
    clients: usize,
) -> UniqueLoad {
    let mut rng = StdRng::from_entropy();
    let mut seen = vec![false; (keys * per_key) as usize];
    let mut key = Vec::with_capacity(24);
    let buffers = (0..clients)
        .map(|i| {
            let n = share(events, clients, i);
            let mut buf = Vec::with_capacity(n as usize * 24);
            for _ in 0..n {
                let k = rng.gen_range(0..keys);
                let v = k * per_key + rng.gen_range(0..per_key);
                seen[v as usize] = true;
                key.clear();
                key.push(b'k');
                push_decimal(&mut key, k);
                push_unique_line(&mut buf, &key, v);
            }
            buf
        })
        .collect();
    let per_key_seen: Vec<u64> = seen
        .chunks(per_key.max(1) as usize)
        .map(|values| values.iter().filter(|s| **s).count() as u64)
        .collect();
    UniqueLoad {
        load: Load {
            buffers,
            events,
            keys: per_key_seen.iter().filter(|n| **n > 0).count() as u64,
        },
        distinct: per_key_seen.iter().sum(),
        max_per_key: per_key_seen.iter().copied().max().unwrap_or(0),
    }
}

/// `visitors <key> v<value>\n`.
fn push_unique_line(buf: &mut Vec<u8>, key: &[u8], value: u64) {
    buf.extend_from_slice(UNIQUE_COUNTER.as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(key);
    buf.extend_from_slice(b" v");
    push_decimal(buf, value);
    buf.push(b'\n');
}

/// Every key in `0..keys` once.
pub(crate) fn distinct_load(keys: u64, clients: usize) -> Load {
    let mut next = 0u64;
    let buffers = (0..clients)
        .map(|i| {
            let n = share(keys, clients, i);
            let mut buf = Vec::with_capacity(n as usize * 16);
            for k in next..next + n {
                push_key_line(&mut buf, k);
            }
            next += n;
            buf
        })
        .collect();
    Load {
        buffers,
        events: keys,
        keys,
    }
}

/// Every key in `0..keys` once at each of `times` (event times, Unix ms, sent as `@<ms>`): with
/// each time in its own window, `keys * times.len()` distinct (key, window) pairs.
pub(crate) fn distinct_timed_load(keys: u64, times: &[u64], clients: usize) -> Load {
    let pairs = keys * times.len() as u64;
    let mut next = 0u64;
    let buffers = (0..clients)
        .map(|i| {
            let n = share(pairs, clients, i);
            let mut buf = Vec::with_capacity(n as usize * 32);
            for p in next..next + n {
                push_key(&mut buf, p % keys);
                buf.extend_from_slice(b" @");
                push_decimal(&mut buf, times[(p / keys) as usize]);
                buf.push(b'\n');
            }
            next += n;
            buf
        })
        .collect();
    Load {
        buffers,
        events: pairs,
        keys,
    }
}

/// `bench k<n>\n`, without a formatter per line.
fn push_key_line(buf: &mut Vec<u8>, k: u64) {
    push_key(buf, k);
    buf.push(b'\n');
}

/// `bench k<n>`.
fn push_key(buf: &mut Vec<u8>, k: u64) {
    buf.extend_from_slice(COUNTER.as_bytes());
    buf.extend_from_slice(b" k");
    push_decimal(buf, k);
}

/// `n` in decimal, without a formatter.
pub(crate) fn push_decimal(buf: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf.extend_from_slice(&digits[i..]);
}

/// Zipf over ranks `0..n` (rank r has weight 1 / (r + 1)^s): a precomputed CDF, binary search.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Zipf {
        let mut sum = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|r| {
                sum += 1.0 / (r as f64).powf(s);
                sum
            })
            .collect();
        for c in &mut cdf {
            *c /= sum;
        }
        Zipf { cdf }
    }

    fn sample(&self, rng: &mut impl Rng) -> u64 {
        let u: f64 = rng.gen();
        let i = self.cdf.partition_point(|&c| c < u);
        i.min(self.cdf.len() - 1) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_add_up() {
        let load = hot_load(10, 3);
        let lines: usize = load
            .buffers
            .iter()
            .map(|b| b.split(|&c| c == b'\n').count() - 1)
            .sum();
        assert_eq!((lines, load.events, load.keys), (10, 10, 1));
        let load = distinct_load(1001, 4);
        let text: Vec<u8> = load.buffers.concat();
        assert!(text.starts_with(b"bench k0\nbench k1\n"));
        assert!(text.ends_with(b"bench k1000\n"));
        let load = spread_load(5000, 50, 2, KeyDist::Uniform);
        assert_eq!(
            load.buffers
                .concat()
                .iter()
                .filter(|&&c| c == b'\n')
                .count(),
            5000
        );
        assert!(load.keys <= 50 && load.keys > 40);
        let load = distinct_timed_load(3, &[1000, 2000], 2);
        assert_eq!((load.events, load.keys), (6, 3));
        assert_eq!(
            load.buffers.concat(),
            b"bench k0 @1000\nbench k1 @1000\nbench k2 @1000\n\
              bench k0 @2000\nbench k1 @2000\nbench k2 @2000\n"
        );
        assert_eq!(
            load.buffers[0],
            b"bench k0 @1000\nbench k1 @1000\nbench k2 @1000\n"
        );
    }

    #[test]
    fn unique_loads_know_their_distinct_values() {
        let load = unique_hot_load(1000, 10, 3);
        let text = load.load.buffers.concat();
        let lines: Vec<&[u8]> = text
            .split(|&c| c == b'\n')
            .filter(|l| !l.is_empty())
            .collect();
        assert_eq!(lines.len(), 1000);
        assert!(lines.iter().all(|l| l.starts_with(b"visitors hot v")));
        let mut values: Vec<&[u8]> = lines.iter().map(|l| &l[14..]).collect();
        values.sort();
        values.dedup();
        assert_eq!(values.len() as u64, load.distinct);
        assert_eq!(
            (load.load.events, load.load.keys, load.max_per_key),
            (1000, 1, load.distinct)
        );
        assert!(load.distinct <= 10 && load.distinct >= 9);

        let load = unique_spread_load(5000, 50, 3, 2);
        assert_eq!(load.load.events, 5000);
        assert!(load.load.keys <= 50 && load.load.keys > 40);
        assert_eq!(load.max_per_key, 3);
        let text = String::from_utf8(load.load.buffers.concat()).unwrap();
        let mut pairs: Vec<(u64, u64)> = text
            .lines()
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                assert_eq!(f[0], "visitors");
                (f[1][1..].parse().unwrap(), f[2][1..].parse().unwrap())
            })
            .collect();
        assert_eq!(pairs.len(), 5000);
        assert!(pairs.iter().all(|&(k, v)| v / 3 == k));
        pairs.sort();
        pairs.dedup();
        assert_eq!(pairs.len() as u64, load.distinct);
    }

    #[test]
    fn zipf_follows_its_weights() {
        let zipf = Zipf::new(1000, 1.0);
        let mut rng = StdRng::seed_from_u64(7);
        let n = 200_000;
        let top = (0..n).filter(|_| zipf.sample(&mut rng) == 0).count() as f64 / n as f64;
        let harmonic: f64 = (1..=1000).map(|r| 1.0 / r as f64).sum();
        assert!((top - 1.0 / harmonic).abs() < 0.01, "rank 0 share {top}");
        assert!((0..1000).all(|_| zipf.sample(&mut rng) < 1000));
    }
}
