//! HyperLogLog sketches in postgresql-hll's own storage format: the `hll` type of the `hll`
//! extension (Debian's `postgresql-15-hll`, 2.17; the format is the same up to 2.20). A
//! [`Sketch`] built here from a set of values is, byte for byte, the sketch
//! `hll_add_agg(hll_hash_text(value))` builds in SQL from the same values with the same
//! parameters, so the two union cleanly and `hll_cardinality` reads either. A leaf: nothing of
//! the crate. Everything below was read from the extension's `src/hll.c` and checked against the
//! extension itself (tests/hll.rs).
//!
//! # The hash
//! [`hash_text`] is `hll_hash_text(v)` (and `hll_hash_bytea`): MurmurHash3 x64 128 of the bytes,
//! seed 0, the first 64 bits as a signed integer. [`hash_bigint`] is `hll_hash_bigint(v)`: the
//! same over the integer's 8 bytes in memory, which on every server PostgreSQL runs on in
//! practice (x86-64, arm64) are little-endian. Text is hashed as its bytes in the database's
//! encoding, so [`hash_text`] of UTF-8 matches in a UTF-8 database only.
//!
//! # Adding a hash
//! The low `log2m` bits of the hash pick the register; the register takes the position, from 1,
//! of the lowest 1 bit of the remaining `64 - log2m` bits (0 when they are all zero), capped at
//! `2^regwidth - 1`, if it is higher than what the register holds.
//!
//! # Representations
//! As the extension keeps them in memory:
//! - **empty**: no value yet.
//! - **explicit**: the distinct hashes themselves, ascending as signed integers (the extension
//!   compares them so, for its Java sibling's sake). Exact: the cardinality is their number.
//!   It holds at most the explicit threshold: `expthresh` when it is set, and with `-1` (auto)
//!   as many 8-byte hashes as fit in the full representation's bytes,
//!   `((regwidth * 2^log2m + 7) / 8) / 8`: 160 for the defaults. Threshold 0 skips it.
//! - **full**: every register, one byte each in memory. Past the threshold, every hash the
//!   explicit set held is added to fresh registers, and the set is dropped.
//!
//! Sparse is not a state but a way to write full registers: [`Sketch::to_bytes`] writes the
//! registers that are not 0 as (index, value) pairs when `sparseon` is set and they take fewer
//! bits than all the registers, `filled * (log2m + regwidth) < 2^log2m * regwidth` (639 filled
//! registers for the defaults), and all of them otherwise, exactly as the extension decides it
//! each time it writes a sketch (unless a session called `hll_set_max_sparse`). A sketch read
//! from its sparse bytes is full in memory. Each state depends only on the set of hashes added,
//! never on their order, which is what makes tallyd's sketch the extension's.
//!
//! # Storage format (schema version 1)
//! - byte 0: the schema version (1) in the high 4 bits, the type in the low 4 (0 undefined,
//!   1 empty, 2 explicit, 3 sparse, 4 full);
//! - byte 1: `regwidth - 1` in the high 3 bits, `log2m` in the low 5;
//! - byte 2: `sparseon` in bit 6; `expthresh` in the low 6 bits: 63 for -1 (auto), 0 for 0,
//!   else `log2(expthresh) + 1`;
//! - the body: nothing (empty); each hash as 8 bytes big-endian (explicit); per register that is
//!   not 0, in index order, `index << regwidth | value` in `log2m + regwidth` bits (sparse); every
//!   register's value in `regwidth` bits (full). Bits are packed most significant first, across
//!   byte boundaries, and the last byte is padded with zeros.
//!
//! So `\x118b7f` is the empty default sketch (`hll_empty()`), and `\x128b7f` followed by 8 bytes
//! per value is an explicit one.
//!
//! # Memory
//! A pending sketch costs its struct (56 bytes, up to four distinct values inline) and what it
//! holds on the heap: 8 bytes per distinct value while explicit past four (the set grows by
//! doubling, up to the threshold), one byte per register once full. For the default parameters (log2m 11, regwidth 5, auto threshold 160),
//! measured by `tests::bytes_per_sketch_at_1_100_and_100000_values` (the allocator's own
//! overhead not counted):
//!
//! | distinct values | representation | bytes |
//! | ---: | --- | ---: |
//! | 1 | explicit | 56 |
//! | 100 | explicit | 1,080 |
//! | 100,000 | full | 2,104 |
//!
//! Its storage bytes are fewer: 3 + 8 per value explicit, at most 1,283 full.
//!
//! # Parameters
//! `log2m` 4 to 17, `regwidth` 1 to 7, `expthresh` -1, 0 or a power of two up to 8,192: what the
//! extension's functions accept (`check_modifiers`: log2m at most 17, regwidth at most 7, an
//! explicit threshold that fits its 128 KiB buffer), and log2m at least 4, below which its
//! `hll_cardinality` refuses a full sketch ("number of registers too small"). Its README's
//! "log2m 4 to 31, regwidth 1 to 8" is the storage format's range, wider than what it builds.
//!
//! With regwidth 6 or 7 the extension's estimate breaks: it computes `1ULL << L` with
//! `L = 2^regwidth - 2 + log2m` of 64 or more, an undefined shift in C that x86-64 and arm64
//! take modulo 64, so its large-range cut-off is tiny, and once every register is set
//! `hll_cardinality` returns NaN (2.17 gives NaN for 100,000 values at `hll_add_agg(h, 12, 6)`).
//! [`Sketch::cardinality`] computes the same NaN, as it must to be the extension's; regwidth 5,
//! the default, is good to about 2^41 / 30 distinct values.

use std::fmt;

use smallvec::{smallvec, SmallVec};

/// The storage schema version, the high 4 bits of the first byte.
const SCHEMA_VERSION: u8 = 1;

/// The storage types, the low 4 bits of the first byte (0, undefined, is never written, and
/// refused when read).
const TYPE_EMPTY: u8 = 1;
const TYPE_EXPLICIT: u8 = 2;
const TYPE_SPARSE: u8 = 3;
const TYPE_FULL: u8 = 4;

/// Version and type, the parameters, `sparseon` and `expthresh`.
const HEADER_BYTES: usize = 3;

/// `expthresh = -1` (auto) as the header stores it.
const EXPTHRESH_AUTO_CODE: u8 = 63;

/// The bounds of the parameters, as the extension's functions accept them (module docs).
pub const LOG2M_MIN: u32 = 4;
pub const LOG2M_MAX: u32 = 17;
/// The widest register the storage format and the extension take. Config stops lower
/// (`REGWIDTH_MAX` in src/config/counters.rs): the extension's cardinality is NaN beyond 5.
pub const REGWIDTH_FORMAT_MAX: u32 = 7;
pub const EXPTHRESH_MAX: i64 = 8192;

/// What a sketch or its bytes may be refused for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HllError {
    #[error("log2m {0} is out of range: postgresql-hll builds sketches of log2m 4 to 17")]
    Log2m(u32),
    #[error("regwidth {0} is out of range: postgresql-hll builds sketches of regwidth 1 to 7")]
    Regwidth(u32),
    #[error("expthresh {0} is not -1 (auto), 0 or a power of two up to 8192")]
    Expthresh(i64),
    #[error("sketches of different parameters cannot be unioned: {0} and {1}")]
    Mismatch(Params, Params),
    #[error("an hll of {0} bytes: fewer than its 3 header bytes")]
    Short(usize),
    #[error("hll schema version {0} is unknown: only version 1 is")]
    Version(u8),
    #[error("hll type {0}: not a sketch (1 empty, 2 explicit, 3 sparse, 4 full; 0 is undefined)")]
    Type(u8),
    #[error("{kind} hll of {len} bytes: expected {expected}")]
    Length {
        kind: &'static str,
        len: usize,
        expected: usize,
    },
    #[error("explicit hll of {0} bytes: its values are not whole 8-byte values")]
    ExplicitLength(usize),
    #[error("sparse hll of {0} bytes: a whole byte of padding after its registers")]
    SparsePadding(usize),
    #[error("explicit hll values are not ascending without duplicates")]
    Unsorted,
}

/// `hll_hash_text(v)` (and `hll_hash_bytea`): MurmurHash3 x64 128 of `bytes` with seed 0, its
/// first 64 bits.
pub fn hash_text(bytes: &[u8]) -> i64 {
    murmur3_x64_128_first(bytes, 0) as i64
}

/// `hll_hash_bigint(v)`: the hash of the integer's 8 bytes, little-endian.
pub fn hash_bigint(value: i64) -> i64 {
    murmur3_x64_128_first(&value.to_le_bytes(), 0) as i64
}

/// MurmurHash3_x64_128 (Austin Appleby's, as the extension carries it in
/// src/MurmurHash3.cpp), the first of its two 64-bit halves. Blocks are read little-endian, as
/// the extension reads them on a little-endian machine.
fn murmur3_x64_128_first(data: &[u8], seed: u32) -> u64 {
    const C1: u64 = 0x87c3_7b91_1142_53d5;
    const C2: u64 = 0x4cf5_ad43_2745_937f;
    let mix1 = |k: u64| k.wrapping_mul(C1).rotate_left(31).wrapping_mul(C2);
    let mix2 = |k: u64| k.wrapping_mul(C2).rotate_left(33).wrapping_mul(C1);
    let le = |bytes: &[u8]| {
        bytes
            .iter()
            .rev()
            .fold(0u64, |k, &b| (k << 8) | u64::from(b))
    };

    let mut h1 = u64::from(seed);
    let mut h2 = u64::from(seed);
    let mut blocks = data.chunks_exact(16);
    for block in &mut blocks {
        h1 ^= mix1(le(&block[..8]));
        h1 = h1
            .rotate_left(27)
            .wrapping_add(h2)
            .wrapping_mul(5)
            .wrapping_add(0x52dc_e729);
        h2 ^= mix2(le(&block[8..]));
        h2 = h2
            .rotate_left(31)
            .wrapping_add(h1)
            .wrapping_mul(5)
            .wrapping_add(0x3849_5ab5);
    }
    let tail = blocks.remainder();
    if tail.len() > 8 {
        h2 ^= mix2(le(&tail[8..]));
    }
    if !tail.is_empty() {
        h1 ^= mix1(le(&tail[..tail.len().min(8)]));
    }

    h1 ^= data.len() as u64;
    h2 ^= data.len() as u64;
    h1 = h1.wrapping_add(h2);
    h2 = h2.wrapping_add(h1);
    fmix64(h1).wrapping_add(fmix64(h2))
}

/// MurmurHash3's finalisation: every bit of `k` avalanches.
fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// A sketch's parameters: its precision (`log2m`, `regwidth`), its explicit threshold and
/// whether it may be written sparse. Sketches union only with sketches of equal parameters,
/// `expthresh` as given (-1 is not its effective value), as the extension requires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Params {
    log2m: u8,
    regwidth: u8,
    /// As the header stores it: 63 for -1 (auto), 0 for 0, else `log2(expthresh) + 1`.
    expthresh_code: u8,
    sparseon: bool,
}

impl Default for Params {
    /// The extension's defaults (`hll_empty()`, `hll_add_agg(h)`): log2m 11, regwidth 5,
    /// expthresh -1 (auto), sparse on.
    fn default() -> Params {
        Params {
            log2m: 11,
            regwidth: 5,
            expthresh_code: EXPTHRESH_AUTO_CODE,
            sparseon: true,
        }
    }
}

impl Params {
    /// Parameters as `hll_empty(log2m, regwidth, expthresh, sparseon)` takes them, refused
    /// where the extension would refuse them (module docs, "Parameters").
    pub fn new(
        log2m: u32,
        regwidth: u32,
        expthresh: i64,
        sparseon: bool,
    ) -> Result<Params, HllError> {
        if !(LOG2M_MIN..=LOG2M_MAX).contains(&log2m) {
            return Err(HllError::Log2m(log2m));
        }
        if !(1..=REGWIDTH_FORMAT_MAX).contains(&regwidth) {
            return Err(HllError::Regwidth(regwidth));
        }
        let expthresh_code = match expthresh {
            -1 => EXPTHRESH_AUTO_CODE,
            0 => 0,
            t if t > 0 && t <= EXPTHRESH_MAX && t.count_ones() == 1 => t.trailing_zeros() as u8 + 1,
            t => return Err(HllError::Expthresh(t)),
        };
        Ok(Params {
            log2m: log2m as u8,
            regwidth: regwidth as u8,
            expthresh_code,
            sparseon,
        })
    }

    pub fn log2m(self) -> u32 {
        u32::from(self.log2m)
    }

    pub fn regwidth(self) -> u32 {
        u32::from(self.regwidth)
    }

    /// As given: -1 for auto.
    pub fn expthresh(self) -> i64 {
        match self.expthresh_code {
            EXPTHRESH_AUTO_CODE => -1,
            0 => 0,
            code => 1 << (code - 1),
        }
    }

    pub fn sparseon(self) -> bool {
        self.sparseon
    }

    /// The most distinct values the explicit representation holds: `expthresh`, or with -1 as
    /// many 8-byte values as fit in the full representation's bytes (`expthresh_value`).
    pub fn explicit_threshold(self) -> usize {
        match self.expthresh() {
            -1 => self.full_bytes() / 8,
            t => t as usize,
        }
    }

    /// 2^log2m.
    fn registers(self) -> usize {
        1 << self.log2m
    }

    /// The highest value a register holds: 2^regwidth - 1.
    fn max_register(self) -> u8 {
        ((1u32 << self.regwidth) - 1) as u8
    }

    /// The bytes of every register packed in `regwidth` bits: the full body's length.
    fn full_bytes(self) -> usize {
        (self.registers() * usize::from(self.regwidth)).div_ceil(8)
    }

    /// The header's three bytes for a sketch of `kind`.
    fn header(self, kind: u8) -> [u8; HEADER_BYTES] {
        [
            (SCHEMA_VERSION << 4) | kind,
            ((self.regwidth - 1) << 5) | self.log2m,
            (u8::from(self.sparseon) << 6) | self.expthresh_code,
        ]
    }

    /// The parameters of a header's bytes 1 and 2, refused as [`Params::new`] refuses them.
    fn from_header(params: u8, flags: u8) -> Result<Params, HllError> {
        let expthresh = match flags & 0x3f {
            EXPTHRESH_AUTO_CODE => -1,
            0 => 0,
            code => 1i64 << (code - 1),
        };
        Params::new(
            u32::from(params & 0x1f),
            u32::from(params >> 5) + 1,
            expthresh,
            flags & 0x40 != 0,
        )
    }
}

impl fmt::Display for Params {
    /// As `hll_print` names them: `log2m=11, regwidth=5, expthresh=-1, sparseon=1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "log2m={}, regwidth={}, expthresh={}, sparseon={}",
            self.log2m,
            self.regwidth,
            self.expthresh(),
            u8::from(self.sparseon)
        )
    }
}

/// A HyperLogLog sketch as postgresql-hll keeps it (module docs, "Representations").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sketch {
    params: Params,
    repr: Repr,
}

/// An explicit sketch's hashes: up to four inline, so that a pending key with a few values
/// costs one allocation (its boxed sketch), not two.
type Hashes = SmallVec<[i64; 4]>;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Repr {
    Empty,
    /// Distinct hashes, ascending as signed integers.
    Explicit(Hashes),
    /// One byte per register.
    Full(Box<[u8]>),
}

impl Sketch {
    /// An empty sketch: `hll_empty(...)` of `params`.
    pub fn new(params: Params) -> Sketch {
        Sketch {
            params,
            repr: Repr::Empty,
        }
    }

    pub fn params(&self) -> Params {
        self.params
    }

    /// Adds a hash ([`hash_text`], [`hash_bigint`]) as `hll_add` and `hll_add_agg` do. No
    /// allocation once full; while explicit, a binary search and a shift of the larger hashes.
    pub fn add_hash(&mut self, hash: i64) {
        let params = self.params;
        match &mut self.repr {
            Repr::Full(registers) => update(registers, params, hash),
            Repr::Explicit(hashes) => match hashes.binary_search(&hash) {
                Ok(_) => {}
                Err(at) => {
                    let threshold = params.explicit_threshold();
                    if hashes.len() >= threshold {
                        let mut registers = full_of(params, hashes);
                        update(&mut registers, params, hash);
                        self.repr = Repr::Full(registers);
                    } else {
                        if hashes.len() == hashes.capacity() {
                            // Double, but never past the threshold: a set that stops below it
                            // holds at most twice its values, and one at it exactly them.
                            hashes.reserve_exact(hashes.len().clamp(1, threshold - hashes.len()));
                        }
                        hashes.insert(at, hash);
                    }
                }
            },
            Repr::Empty => {
                self.repr = if params.explicit_threshold() == 0 {
                    let mut registers = full_of(params, &[]);
                    update(&mut registers, params, hash);
                    Repr::Full(registers)
                } else {
                    // Capacity 1: most pending keys hold one value.
                    Repr::Explicit(smallvec![hash])
                };
            }
        }
    }

    /// Adds every value of `other` to this sketch, as `hll_union(self, other)` and
    /// `hll_union_agg` do: the result is the sketch of both sketches' values. Refused, changing
    /// nothing, when the parameters differ.
    pub fn union(&mut self, other: &Sketch) -> Result<(), HllError> {
        if self.params != other.params {
            return Err(HllError::Mismatch(self.params, other.params));
        }
        let params = self.params;
        match (&mut self.repr, &other.repr) {
            (_, Repr::Empty) => {}
            (Repr::Empty, theirs) => self.repr = theirs.clone(),
            (Repr::Full(ours), Repr::Full(theirs)) => {
                for (r, &t) in ours.iter_mut().zip(theirs.iter()) {
                    *r = (*r).max(t);
                }
            }
            (Repr::Full(ours), Repr::Explicit(theirs)) => {
                for &hash in theirs {
                    update(ours, params, hash);
                }
            }
            (Repr::Explicit(ours), Repr::Full(theirs)) => {
                let mut registers = theirs.clone();
                for &hash in ours.iter() {
                    update(&mut registers, params, hash);
                }
                self.repr = Repr::Full(registers);
            }
            (Repr::Explicit(ours), Repr::Explicit(theirs)) => {
                let merged = merge(ours, theirs);
                // As `explicit_union`: a new value into a set at its threshold makes it full.
                if merged.len() > ours.len() {
                    self.repr = if merged.len() > params.explicit_threshold() {
                        Repr::Full(full_of(params, &merged))
                    } else {
                        Repr::Explicit(merged)
                    };
                }
            }
        }
        Ok(())
    }

    /// The estimated number of distinct values, exactly as `hll_cardinality` computes it: the
    /// count itself while explicit; once full, HyperLogLog's estimate with its small-range
    /// (linear counting) and large-range corrections.
    pub fn cardinality(&self) -> f64 {
        match &self.repr {
            Repr::Empty => 0.0,
            Repr::Explicit(hashes) => hashes.len() as f64,
            Repr::Full(registers) => estimate(self.params, registers),
        }
    }

    /// The sketch in the extension's storage format: what `hll_send` sends and `hll_recv`
    /// takes, and what `'\x…'::hll` spells.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_to(&mut out);
        out
    }

    /// [`Sketch::to_bytes`], appended to `out`.
    pub fn write_to(&self, out: &mut Vec<u8>) {
        let params = self.params;
        match &self.repr {
            Repr::Empty => out.extend_from_slice(&params.header(TYPE_EMPTY)),
            Repr::Explicit(hashes) => {
                out.reserve(HEADER_BYTES + 8 * hashes.len());
                out.extend_from_slice(&params.header(TYPE_EXPLICIT));
                for hash in hashes {
                    out.extend_from_slice(&hash.to_be_bytes());
                }
            }
            Repr::Full(registers) => {
                let regwidth = params.regwidth();
                let pair_bits = params.log2m() + regwidth;
                let filled = registers.iter().filter(|&&r| r != 0).count();
                // The extension's test (`multiset_pack`), in bits.
                let sparse = params.sparseon
                    && filled * (pair_bits as usize) < registers.len() * regwidth as usize;
                let mut bits = BitWriter::new(out);
                if sparse {
                    bits.out.extend_from_slice(&params.header(TYPE_SPARSE));
                    for (index, &r) in registers.iter().enumerate() {
                        if r != 0 {
                            bits.push(((index as u32) << regwidth) | u32::from(r), pair_bits);
                        }
                    }
                } else {
                    bits.out.reserve(HEADER_BYTES + params.full_bytes());
                    bits.out.extend_from_slice(&params.header(TYPE_FULL));
                    for &r in registers.iter() {
                        bits.push(u32::from(r), regwidth);
                    }
                }
                bits.finish();
            }
        }
    }

    /// A sketch from its storage bytes (`hll_send`'s, or a `bytea` of them), checked as the
    /// extension checks them when it reads one, and refused if its parameters are outside what
    /// [`Params::new`] accepts. An undefined sketch (type 0, which the extension reads as
    /// "unknown" and unions to undefined) is refused too.
    pub fn from_bytes(bytes: &[u8]) -> Result<Sketch, HllError> {
        let &[first, params, flags, ..] = bytes else {
            return Err(HllError::Short(bytes.len()));
        };
        if first >> 4 != SCHEMA_VERSION {
            return Err(HllError::Version(first >> 4));
        }
        let kind = first & 0x0f;
        if !(TYPE_EMPTY..=TYPE_FULL).contains(&kind) {
            return Err(HllError::Type(kind));
        }
        let params = Params::from_header(params, flags)?;
        let body = &bytes[HEADER_BYTES..];
        let repr = match kind {
            TYPE_EMPTY if body.is_empty() => Repr::Empty,
            TYPE_EMPTY => {
                return Err(HllError::Length {
                    kind: "empty",
                    len: bytes.len(),
                    expected: HEADER_BYTES,
                })
            }
            TYPE_EXPLICIT => {
                if body.len() % 8 != 0 {
                    return Err(HllError::ExplicitLength(bytes.len()));
                }
                let hashes: Hashes = body
                    .chunks_exact(8)
                    .map(|b| i64::from_be_bytes(b.try_into().expect("8 bytes")))
                    .collect();
                if hashes.windows(2).any(|w| w[0] >= w[1]) {
                    return Err(HllError::Unsorted);
                }
                Repr::Explicit(hashes)
            }
            TYPE_SPARSE => {
                let pair_bits = (params.log2m() + params.regwidth()) as usize;
                let pairs = body.len() * 8 / pair_bits;
                if body.len() * 8 - pairs * pair_bits >= 8 {
                    return Err(HllError::SparsePadding(bytes.len()));
                }
                let mut registers = full_of(params, &[]);
                let mut bits = BitReader::new(body);
                for _ in 0..pairs {
                    let pair = bits.take(pair_bits as u32);
                    registers[(pair >> params.regwidth) as usize] =
                        (pair & u32::from(params.max_register())) as u8;
                }
                Repr::Full(registers)
            }
            _ => {
                if body.len() != params.full_bytes() {
                    return Err(HllError::Length {
                        kind: "full",
                        len: bytes.len(),
                        expected: HEADER_BYTES + params.full_bytes(),
                    });
                }
                let mut bits = BitReader::new(body);
                let registers = (0..params.registers())
                    .map(|_| bits.take(params.regwidth()) as u8)
                    .collect();
                Repr::Full(registers)
            }
        };
        Ok(Sketch { params, repr })
    }

    /// The heap bytes the sketch holds (the explicit set's capacity or the registers), beside
    /// its `size_of::<Sketch>()`: what a pending sketch costs.
    pub fn heap_bytes(&self) -> usize {
        match &self.repr {
            Repr::Empty => 0,
            Repr::Explicit(hashes) if hashes.spilled() => hashes.capacity() * size_of::<i64>(),
            Repr::Explicit(_) => 0,
            Repr::Full(registers) => registers.len(),
        }
    }
}

/// `compressed_add`: the register the low `log2m` bits pick takes the position of the lowest
/// 1 bit of the rest (from 1; 0 if none), capped at the register's maximum, if higher.
#[inline]
fn update(registers: &mut [u8], params: Params, hash: i64) {
    let hash = hash as u64;
    let index = (hash & ((1 << params.log2m) - 1)) as usize;
    let rest = hash >> params.log2m;
    let position = if rest == 0 {
        0
    } else {
        rest.trailing_zeros() as u8 + 1
    };
    let register = &mut registers[index];
    *register = (*register).max(position.min(params.max_register()));
}

/// Fresh registers with `hashes` added.
fn full_of(params: Params, hashes: &[i64]) -> Box<[u8]> {
    let mut registers = vec![0u8; params.registers()].into_boxed_slice();
    for &hash in hashes {
        update(&mut registers, params, hash);
    }
    registers
}

/// The ascending union of two ascending sets.
fn merge(a: &[i64], b: &[i64]) -> Hashes {
    let mut out = Hashes::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (x, y) = (a[i], b[j]);
        out.push(x.min(y));
        i += usize::from(x <= y);
        j += usize::from(y <= x);
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

/// `multiset_card` of full registers, operation for operation (the same floating-point
/// results): the raw HyperLogLog estimate; linear counting below 5/2 of the register count
/// when a register is 0; past 2^L / 30 (L = 2^regwidth - 2 + log2m, the hash bits the registers
/// can tell apart), the large-range correction.
fn estimate(params: Params, registers: &[u8]) -> f64 {
    let n = registers.len() as f64;
    let max_register = (1u64 << params.regwidth) - 1;
    // The extension computes `1ULL << L` with L up to 134 (regwidth 7): in C an undefined shift,
    // on x86-64 and arm64 one by L mod 64, as `wrapping_shl` does. Only regwidth 5 and below
    // stay under 64.
    let two_to_l = 1u64.wrapping_shl((max_register - 1 + params.log2m as u64) as u32);
    let large_cutoff = two_to_l as f64 / 30.0;

    let mut sum = 0.0;
    let mut zeros = 0u32;
    for &r in registers {
        // `1L << r`: a register past 62 (only from hand-made bytes) shifts as the C does.
        sum += 1.0 / 1i64.wrapping_shl(u32::from(r)) as f64;
        zeros += u32::from(r == 0);
    }
    let alpha_m_squared = match registers.len() {
        16 => 0.673 * n * n,
        32 => 0.697 * n * n,
        64 => 0.709 * n * n,
        _ => (0.7213 / (1.0 + 1.079 / n)) * n * n,
    };
    let estimator = alpha_m_squared / sum;
    if zeros != 0 && estimator < 5.0 * n / 2.0 {
        n * (n / f64::from(zeros)).ln()
    } else if estimator <= large_cutoff {
        estimator
    } else {
        -(two_to_l as i64 as f64) * (1.0 - estimator / two_to_l as f64).ln()
    }
}

/// Values of up to 32 bits into bytes, most significant bit first, as `bitstream_pack` packs
/// them.
struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    /// The bits not yet written, in the low `pending` bits.
    acc: u64,
    pending: u32,
}

impl<'a> BitWriter<'a> {
    fn new(out: &'a mut Vec<u8>) -> BitWriter<'a> {
        BitWriter {
            out,
            acc: 0,
            pending: 0,
        }
    }

    /// Appends the low `bits` bits of `value` (the others must be 0).
    fn push(&mut self, value: u32, bits: u32) {
        self.acc = (self.acc << bits) | u64::from(value);
        self.pending += bits;
        while self.pending >= 8 {
            self.pending -= 8;
            self.out.push((self.acc >> self.pending) as u8);
        }
    }

    /// Writes the last bits, padded with zeros to a whole byte.
    fn finish(self) {
        if self.pending > 0 {
            self.out.push((self.acc << (8 - self.pending)) as u8);
        }
    }
}

/// Values of up to 32 bits out of bytes, most significant bit first (`bitstream_unpack`).
struct BitReader<'a> {
    bytes: std::slice::Iter<'a, u8>,
    acc: u64,
    available: u32,
}

impl<'a> BitReader<'a> {
    fn new(bytes: &'a [u8]) -> BitReader<'a> {
        BitReader {
            bytes: bytes.iter(),
            acc: 0,
            available: 0,
        }
    }

    /// The next `bits` bits; the caller has counted that the bytes hold them.
    fn take(&mut self, bits: u32) -> u32 {
        while self.available < bits {
            let byte = self.bytes.next().copied().unwrap_or(0);
            self.acc = (self.acc << 8) | u64::from(byte);
            self.available += 8;
        }
        self.available -= bits;
        ((self.acc >> self.available) & ((1 << bits) - 1)) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The resident memory of full log2m-14 sketches (regwidth 5, expthresh auto), one per
    /// pending key, filled as a daemon fills them: values arriving for every key in turn, so
    /// each key's explicit list grows (doubling) and is then replaced by its registers. Run by
    /// hand (`cargo test --lib full_sketch_memory -- --ignored --nocapture`): config.toml's
    /// figure per pending key comes from it.
    #[test]
    #[ignore = "a measurement: run by hand"]
    fn full_sketch_memory_per_pending_key() {
        fn rss_kib() -> f64 {
            let status = std::fs::read_to_string("/proc/self/status").unwrap();
            let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
            line.split_whitespace().nth(1).unwrap().parse().unwrap()
        }
        const KEYS: usize = 4_000;
        let params = Params::new(14, 5, -1, true).unwrap();
        let before = rss_kib();
        let mut keys: Vec<Box<Sketch>> = (0..KEYS).map(|_| Box::new(Sketch::new(params))).collect();
        for v in 0..3_000i64 {
            for (k, sketch) in keys.iter_mut().enumerate() {
                sketch.add_hash(hash_bigint(k as i64 * 1_000_000 + v));
            }
        }
        assert!(keys.iter().all(|s| matches!(s.repr, Repr::Full(_))));
        let per_key = (rss_kib() - before) * 1024.0 / KEYS as f64;
        println!(
            "{KEYS} full log2m-14 sketches: {per_key:.0} bytes of RSS per key ({} bytes of registers)",
            params.registers()
        );
        std::hint::black_box(&keys);
    }

    fn params(log2m: u32, regwidth: u32, expthresh: i64, sparseon: bool) -> Params {
        Params::new(log2m, regwidth, expthresh, sparseon).unwrap()
    }

    fn of(params: Params, hashes: impl IntoIterator<Item = i64>) -> Sketch {
        let mut sketch = Sketch::new(params);
        for hash in hashes {
            sketch.add_hash(hash);
        }
        sketch
    }

    /// A hash that picks register `index` and gives it `value` (the lowest 1 bit of the rest at
    /// position `value`), for `log2m`.
    fn hash_for(log2m: u32, index: u64, value: u32) -> i64 {
        (((1u64 << (value - 1)) << log2m) | index) as i64
    }

    #[test]
    fn hashes_are_the_extensions() {
        // From `SELECT hll_hash_text(...)`, `hll_hash_bigint(...)` of postgresql-hll 2.17;
        // tests/hll.rs checks many more against the running extension.
        assert_eq!(hash_text(b""), 0);
        assert_eq!(hash_text(b"a"), -8839064797231613815);
        assert_eq!(hash_text(b"hello"), -3758069500696749310);
        assert_eq!(hash_text(b"0123456789abcdef"), 5467490433528156583);
        assert_eq!(hash_text(b"0123456789abcdefg"), -8200385122730116642);
        assert_eq!(hash_text(b"visitor-42"), -525327378863125364);
        assert_eq!(hash_text("Grüße, 世界 🎉".as_bytes()), -2415149686938207828);
        assert_eq!(hash_bigint(0), 2945182322382062539);
        assert_eq!(hash_bigint(1), 19144387141682250);
        assert_eq!(hash_bigint(-1), -6853156495446839949);
        assert_eq!(hash_bigint(i64::MAX), 7815693464130447828);
        // `hll_hash_text('x', 7)`: the seed, which tallyd never uses, enters as the C does.
        assert_eq!(murmur3_x64_128_first(b"x", 7) as i64, -2381512454701978174);
    }

    #[test]
    fn the_header_spells_the_parameters() {
        // `hll_empty()`, `hll_empty(17, 7)`, `hll_empty(11, 5, 8192, 1)`.
        assert_eq!(
            Sketch::new(Params::default()).to_bytes(),
            [0x11, 0x8b, 0x7f]
        );
        assert_eq!(
            Sketch::new(params(17, 7, -1, true)).to_bytes(),
            [0x11, 0xd1, 0x7f]
        );
        assert_eq!(
            Sketch::new(params(11, 5, 8192, true)).to_bytes(),
            [0x11, 0x8b, 0x4e]
        );
        assert_eq!(
            Sketch::new(params(10, 4, 0, false)).to_bytes(),
            [0x11, 0x6a, 0x00]
        );
        assert_eq!(params(11, 5, 8192, true).expthresh(), 8192);
        assert_eq!(params(11, 5, 1, true).expthresh(), 1);
    }

    #[test]
    fn parameters_outside_the_extensions_are_refused() {
        assert_eq!(Params::new(3, 5, -1, true), Err(HllError::Log2m(3)));
        assert_eq!(Params::new(18, 5, -1, true), Err(HllError::Log2m(18)));
        assert_eq!(Params::new(11, 0, -1, true), Err(HllError::Regwidth(0)));
        assert_eq!(Params::new(11, 8, -1, true), Err(HllError::Regwidth(8)));
        assert_eq!(Params::new(11, 5, 3, true), Err(HllError::Expthresh(3)));
        assert_eq!(Params::new(11, 5, -2, true), Err(HllError::Expthresh(-2)));
        assert_eq!(
            Params::new(11, 5, 16384, true),
            Err(HllError::Expthresh(16384))
        );
        assert!(Params::new(4, 1, 0, false).is_ok());
        assert!(Params::new(17, 7, 8192, true).is_ok());
    }

    #[test]
    fn the_auto_threshold_is_what_fits_in_the_full_bytes() {
        assert_eq!(Params::default().explicit_threshold(), 160);
        assert_eq!(params(14, 5, -1, true).explicit_threshold(), 1280);
        assert_eq!(params(10, 4, -1, true).explicit_threshold(), 64);
        assert_eq!(params(4, 1, -1, true).explicit_threshold(), 0);
        assert_eq!(params(17, 7, -1, true).explicit_threshold(), 14336);
        assert_eq!(params(11, 5, 32, true).explicit_threshold(), 32);
    }

    #[test]
    fn explicit_values_are_ascending_signed_big_endian() {
        let sketch = of(Params::default(), [5, -1, 3, 5, i64::MIN]);
        let mut expected = vec![0x12, 0x8b, 0x7f];
        for v in [i64::MIN, -1, 3, 5] {
            expected.extend_from_slice(&v.to_be_bytes());
        }
        assert_eq!(sketch.to_bytes(), expected);
        assert_eq!(sketch.cardinality(), 4.0);
    }

    #[test]
    #[allow(clippy::unusual_byte_groupings)] // the groups are the packed fields
    fn the_register_is_the_low_bits_and_the_value_the_lowest_one_bit_of_the_rest() {
        let p = params(4, 3, 0, false);
        let mut sketch = Sketch::new(p);
        // Register 5 gets 3: rest = 0b100.
        sketch.add_hash(0b100_0101);
        // Register 15: the rest is all zeros, so it stays 0.
        sketch.add_hash(0b1111);
        // Register 0: the lowest 1 bit of the rest is its 60th, capped at 7.
        sketch.add_hash(i64::MIN);
        // Register 1: a lower value than one it holds changes nothing.
        sketch.add_hash(0b1000_0001);
        sketch.add_hash(0b0001_0001);
        let Repr::Full(registers) = &sketch.repr else {
            panic!("threshold 0 is full at once")
        };
        assert_eq!(registers[..6], [7, 4, 0, 0, 0, 3]);
        assert_eq!(registers[15], 0);
        // Full (sparse off): 16 registers of 3 bits, packed from the high bit.
        assert_eq!(
            sketch.to_bytes(),
            [
                0x14,
                0x44,
                0x00,
                0b111_100_00,
                0b0_000_000_0,
                0b11_000_000,
                0,
                0,
                0
            ]
        );
    }

    #[test]
    #[allow(clippy::unusual_byte_groupings)] // the groups are the packed fields
    fn sparse_pairs_are_index_and_value_in_log2m_plus_regwidth_bits() {
        let p = params(4, 3, 0, true);
        // Registers 1 = 2 and 14 = 5: pairs of 7 bits, 0001_010 and 1110_101.
        let sketch = of(p, [hash_for(4, 1, 2), hash_for(4, 14, 5)]);
        assert_eq!(
            sketch.to_bytes(),
            [0x13, 0x44, 0x40, 0b0001_010_1, 0b110_101_00]
        );
        assert_eq!(Sketch::from_bytes(&sketch.to_bytes()), Ok(sketch));
    }

    #[test]
    fn full_registers_are_written_sparse_only_while_smaller() {
        let p = params(4, 3, 0, true);
        // 16 registers of 3 bits = 48 bits; pairs are 7 bits: 6 filled (42 bits) stay sparse,
        // 7 (49) are written full.
        let sketch = of(p, (0..6).map(|i| hash_for(4, i, 1)));
        assert_eq!(sketch.to_bytes()[0], 0x13);
        let sketch = of(p, (0..7).map(|i| hash_for(4, i, 1)));
        assert_eq!(sketch.to_bytes()[0], 0x14);
        // Sparse off: full from the first value.
        let sketch = of(params(4, 3, 0, false), [hash_for(4, 0, 1)]);
        assert_eq!(sketch.to_bytes()[0], 0x14);
    }

    #[test]
    fn the_explicit_set_turns_full_past_its_threshold() {
        let p = params(11, 5, 4, true);
        let mut sketch = of(p, [1, 2, 3, 4]);
        sketch.add_hash(4);
        assert_eq!(sketch.repr, Repr::Explicit(smallvec![1, 2, 3, 4]));
        sketch.add_hash(5);
        assert_eq!(sketch.repr, Repr::Full(full_of(p, &[1, 2, 3, 4, 5])));
    }

    #[test]
    fn order_does_not_matter() {
        let hashes: Vec<i64> = (0..1000).map(|i| hash_bigint(i % 700)).collect();
        for n in [0, 1, 160, 161, 400, 1000] {
            let forward = of(Params::default(), hashes[..n].iter().copied());
            let backward = of(Params::default(), hashes[..n].iter().rev().copied());
            assert_eq!(forward.to_bytes(), backward.to_bytes(), "{n} hashes");
        }
    }

    #[test]
    fn union_is_the_sketch_of_all_values() {
        let hashes: Vec<i64> = (0..3000).map(hash_bigint).collect();
        let cuts = [
            (0, 0),
            (0, 5),
            (3, 50),
            (100, 100),
            (150, 20),
            (2, 2000),
            (1000, 1500),
        ];
        for (a, b) in cuts {
            let (left, right) = (&hashes[..a], &hashes[a..a + b]);
            // Overlapping too: right also takes the first half of left.
            let right: Vec<i64> = right.iter().chain(&left[..a / 2]).copied().collect();
            let all = of(Params::default(), left.iter().chain(&right).copied());
            for (x, y) in [(left, &right[..]), (&right[..], left)] {
                let mut union = of(Params::default(), x.iter().copied());
                union
                    .union(&of(Params::default(), y.iter().copied()))
                    .unwrap();
                assert_eq!(
                    union.to_bytes(),
                    all.to_bytes(),
                    "{} ∪ {}",
                    x.len(),
                    y.len()
                );
            }
        }
    }

    #[test]
    fn union_of_different_parameters_is_refused() {
        let mut a = of(Params::default(), [1]);
        let b = of(params(11, 5, 128, true), [2]);
        let err = a.union(&b).unwrap_err();
        assert_eq!(
            err.to_string(),
            "sketches of different parameters cannot be unioned: \
             log2m=11, regwidth=5, expthresh=-1, sparseon=1 and \
             log2m=11, regwidth=5, expthresh=128, sparseon=1"
        );
        assert_eq!(a, of(Params::default(), [1]));
    }

    #[test]
    fn bytes_round_trip() {
        for p in [
            Params::default(),
            params(14, 5, -1, true),
            params(10, 4, -1, false),
        ] {
            for n in [0, 1, 64, 65, 200, 5000] {
                let sketch = of(p, (0..n).map(hash_bigint));
                let bytes = sketch.to_bytes();
                let back = Sketch::from_bytes(&bytes).unwrap();
                assert_eq!(back.to_bytes(), bytes, "{p}, {n} values");
                assert_eq!(back.cardinality().to_bits(), sketch.cardinality().to_bits());
            }
        }
    }

    #[test]
    fn malformed_bytes_are_refused() {
        let explicit = of(Params::default(), [1, 2]).to_bytes();
        assert_eq!(Sketch::from_bytes(&[0x11, 0x8b]), Err(HllError::Short(2)));
        assert_eq!(
            Sketch::from_bytes(&[0x21, 0x8b, 0x7f]),
            Err(HllError::Version(2))
        );
        assert_eq!(
            Sketch::from_bytes(&[0x10, 0x8b, 0x7f]),
            Err(HllError::Type(0))
        );
        assert_eq!(
            Sketch::from_bytes(&[0x15, 0x8b, 0x7f]),
            Err(HllError::Type(5))
        );
        assert_eq!(
            Sketch::from_bytes(&[0x11, 0xeb, 0x7f]),
            Err(HllError::Regwidth(8))
        );
        assert_eq!(
            Sketch::from_bytes(&[0x11, 0x92, 0x7f]),
            Err(HllError::Log2m(18))
        );
        assert!(matches!(
            Sketch::from_bytes(&[0x11, 0x8b, 0x7f, 0]),
            Err(HllError::Length { kind: "empty", .. })
        ));
        assert_eq!(
            Sketch::from_bytes(&explicit[..explicit.len() - 1]),
            Err(HllError::ExplicitLength(18))
        );
        let mut swapped = explicit[..3].to_vec();
        swapped.extend_from_slice(&explicit[11..]);
        swapped.extend_from_slice(&explicit[3..11]);
        assert_eq!(Sketch::from_bytes(&swapped), Err(HllError::Unsorted));
        let full = of(params(4, 3, 0, false), [1]).to_bytes();
        assert_eq!(
            Sketch::from_bytes(&full[..full.len() - 1]),
            Err(HllError::Length {
                kind: "full",
                len: 8,
                expected: 9
            })
        );
        // A sparse body of 7-bit pairs: 2 bytes hold two (2 bits of padding), 3 bytes hold three
        // (3 bits), 1 byte one (1 bit); 9 bits of padding can only be hand-made.
        assert!(Sketch::from_bytes(&[0x13, 0x44, 0x40, 0x02, 0x00]).is_ok());
        let p = params(17, 7, 0, true);
        let mut long = p.header(TYPE_SPARSE).to_vec();
        long.extend_from_slice(&[0; 4]); // 32 bits: one 24-bit pair and 8 bits of padding
        assert_eq!(Sketch::from_bytes(&long), Err(HllError::SparsePadding(7)));
    }

    #[test]
    fn cardinality_corrections() {
        let p = Params::default();
        // Few registers set: linear counting, 2048 * ln(2048 / zeros).
        let few = of(p, (0..161).map(|i| hash_for(11, i, 1)));
        assert_eq!(few.cardinality(), 2048.0 * (2048.0f64 / 1887.0).ln());
        // Every register at 1: no zeros, the raw estimate alpha * m^2 / (m / 2).
        let all = of(p, (0..2048).map(|i| hash_for(11, i, 1)));
        let m = 2048.0f64;
        assert_eq!(
            all.cardinality(),
            (0.7213 / (1.0 + 1.079 / m)) * m * m / (m / 2.0)
        );
        // Every register at 26: past 2^41 / 30 (L = 2^5 - 2 + 11), the large-range form.
        let high = of(p, (0..2048).map(|i| hash_for(11, i, 26)));
        let two_to_l = (1u64 << 41) as f64;
        let raw = (0.7213 / (1.0 + 1.079 / m)) * m * m / (m / 2f64.powi(26));
        assert_eq!(high.cardinality(), -two_to_l * (1.0 - raw / two_to_l).ln());
    }

    #[test]
    fn bytes_per_sketch_at_1_100_and_100000_values() {
        // The module docs' "Memory" table.
        let cost = |n: i64| {
            let sketch = of(Params::default(), (0..n).map(hash_bigint));
            size_of::<Sketch>() + sketch.heap_bytes()
        };
        assert_eq!(size_of::<Sketch>(), 56);
        assert_eq!(cost(1), 56);
        assert_eq!(cost(4), 56, "up to four values inline");
        assert_eq!(cost(100), 1080);
        assert_eq!(cost(100_000), 2104);
        // At the threshold the set holds exactly its values.
        assert_eq!(cost(160), 56 + 160 * 8);
    }
}
