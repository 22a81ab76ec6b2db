//! Parsing one line (without its `\n`) into a [`Line`]: the declared counters, the limits,
//! the field grammar, deltas and timestamps, and why a line is rejected.

use std::collections::HashMap;

use super::keys::{parse_key, text_key, Key, KeyType};
use super::reject::Reject;
use crate::kind::Kind;

/// Up to this many counters, comparing names one by one beats hashing the name.
const LINEAR_LOOKUP_MAX: usize = 8;

/// The parser's index of the counters, looked up by name on every line: per counter id, what a
/// line needs (name, key type, kind) and whether it may still be named. The daemon builds it
/// from its counter table (`ingest::Schema`); it is kept small, apart from the table, so that a
/// lookup reads a few bytes per counter.
#[derive(Clone, Debug)]
pub struct Counters {
    entries: Vec<Entry>,
    pub(super) by_name: Option<HashMap<Box<[u8]>, u16>>,
}

/// One counter id of [`Counters`].
#[derive(Clone, Debug)]
struct Entry {
    name: Box<str>,
    key_type: KeyType,
    /// What the field after the key means.
    kind: Kind,
    /// False for a counter a reload removed: it keeps its id (pending events name it) but is
    /// no longer looked up.
    live: bool,
}

impl Counters {
    /// Sum counters; each counter's id is its position in `decl`.
    ///
    /// Names are expected to be unique (config validation's job); if one repeats, lookups find
    /// its first declaration.
    ///
    /// # Panics
    /// If more than 65536 counters are declared, since ids are `u16`.
    pub fn new<'a>(decl: impl IntoIterator<Item = (&'a str, KeyType)>) -> Counters {
        Counters::declare(
            decl.into_iter()
                .map(|(name, key_type)| (name, key_type, Kind::Sum, true)),
        )
    }

    /// Counters of any kind; the entries whose `live` is false keep their id and are not found
    /// by [`Counters::lookup`] (counters a reload removed).
    pub fn declare<'a>(decl: impl IntoIterator<Item = (&'a str, KeyType, Kind, bool)>) -> Counters {
        let entries = decl
            .into_iter()
            .map(|(name, key_type, kind, live)| Entry {
                name: Box::from(name),
                key_type,
                kind,
                live,
            })
            .collect();
        Counters::build(entries)
    }

    /// Like [`Counters::new`], but the entries whose `live` is false keep their id and are not
    /// found by [`Counters::lookup`] (counters a reload removed).
    pub fn with_retired<'a>(decl: impl IntoIterator<Item = (&'a str, KeyType, bool)>) -> Counters {
        Counters::declare(
            decl.into_iter()
                .map(|(name, key_type, live)| (name, key_type, Kind::Sum, live)),
        )
    }

    /// These counters with the retired ones found again: for lines that were accepted while
    /// they were declared (spilled journal records, routed after a reload removed one).
    pub fn reviving(&self) -> Counters {
        let mut entries = self.entries.clone();
        entries.iter_mut().for_each(|e| e.live = true);
        Counters::build(entries)
    }

    fn build(entries: Vec<Entry>) -> Counters {
        assert!(
            entries.len() <= usize::from(u16::MAX) + 1,
            "at most 65536 counters can be declared, got {}",
            entries.len()
        );
        let by_name = (entries.len() > LINEAR_LOOKUP_MAX).then(|| {
            let mut map = HashMap::with_capacity(entries.len());
            for (id, e) in entries.iter().enumerate().filter(|(_, e)| e.live) {
                // Keep the first declaration so both lookup strategies agree on duplicates.
                map.entry(Box::from(e.name.as_bytes())).or_insert(id as u16);
            }
            map
        });
        Counters { entries, by_name }
    }

    pub fn lookup(&self, name: &[u8]) -> Option<(u16, KeyType)> {
        let id = match &self.by_name {
            None => self
                .entries
                .iter()
                .position(|e| e.live && e.name.as_bytes() == name)? as u16,
            Some(map) => *map.get(name)?,
        };
        Some((id, self.entries[usize::from(id)].key_type))
    }

    /// Whether lines may name counter `id` (a reload has not removed it).
    pub fn is_live(&self, id: u16) -> bool {
        self.entries[usize::from(id)].live
    }

    /// # Panics
    /// If `id` is not a declared counter's id.
    pub fn key_type(&self, id: u16) -> KeyType {
        self.entries[usize::from(id)].key_type
    }

    /// # Panics
    /// If `id` is not a declared counter's id.
    pub fn kind(&self, id: u16) -> Kind {
        self.entries[usize::from(id)].kind
    }

    /// # Panics
    /// If `id` is not a declared counter's id.
    pub fn name(&self, id: u16) -> &str {
        &self.entries[usize::from(id)].name
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Longest accepted line, counting every byte before the `\n` (a `\r` included).
    pub max_line_bytes: usize,
    /// Longest accepted key as sent, before canonicalisation.
    pub max_key_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_line_bytes: 4096,
            max_key_bytes: 256,
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Line<'a> {
    Event(Event<'a>),
    Control(Control),
    /// `!set` or `!forget`, or why its arguments are refused (the connection answers either).
    Correction(Result<Correction<'a>, Reject>),
    /// `!batch <id>`, `!commit` or `!abort` (docs/protocol.md, "Batches").
    Batch(BatchControl),
    Empty,
}

/// A batch's control lines. The id is owned: `!batch` is one line per batch, not per event.
#[derive(Debug, PartialEq, Eq)]
pub enum BatchControl {
    /// `!batch <id>`, or why the id is refused.
    Open(Result<String, BatchRefusal>),
    Commit,
    Abort,
}

/// Why a batch's control line is refused: answered `error <reason> <message>`, and the line
/// changes nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchRefusal {
    MissingBatchId,
    BatchIdTooLong,
    BadBatchId,
    /// `!batch`, `!flush`, `!sync`, `!set` or `!forget` while a batch is open.
    BatchOpen,
    /// `!commit` or `!abort` without an open batch.
    NoBatch,
    /// The batch's lines exceeded `batch.max_bytes`.
    BatchTooLarge,
    /// The journal is disabled.
    BatchNeedsJournal,
}

impl BatchRefusal {
    pub fn as_str(self) -> &'static str {
        match self {
            BatchRefusal::MissingBatchId => "missing_batch_id",
            BatchRefusal::BatchIdTooLong => "batch_id_too_long",
            BatchRefusal::BadBatchId => "bad_batch_id",
            BatchRefusal::BatchOpen => "batch_open",
            BatchRefusal::NoBatch => "no_batch",
            BatchRefusal::BatchTooLarge => "batch_too_large",
            BatchRefusal::BatchNeedsJournal => "batch_needs_journal",
        }
    }

    /// The message after the reason.
    pub fn message(self) -> &'static str {
        match self {
            BatchRefusal::MissingBatchId => "!batch needs an id",
            BatchRefusal::BatchIdTooLong => "a batch id is at most listen.max_key_bytes bytes",
            BatchRefusal::BadBatchId => {
                "a batch id is UTF-8 text without control characters or whitespace"
            }
            BatchRefusal::BatchOpen => "a batch is open: !commit or !abort it first",
            BatchRefusal::NoBatch => "no batch is open",
            BatchRefusal::BatchTooLarge => {
                "the batch's lines exceeded batch.max_bytes; nothing of it counted"
            }
            BatchRefusal::BatchNeedsJournal => {
                "batches need the journal ([journal] enabled = true) to count exactly once"
            }
        }
    }
}

/// A correction (docs/protocol.md, "Corrections"): applied in order with the events of its
/// connection, through the key's bucket, and answered once committed.
#[derive(Debug, PartialEq, Eq)]
pub enum Correction<'a> {
    /// `!set <counter> <key> <value> [@<unix_ms>]`: the key's total (a windowed counter's: the
    /// total of the window holding the time) becomes `value`.
    Set {
        counter: u16,
        key: Key<'a>,
        value: i64,
        at_ms: Option<i64>,
    },
    /// `!forget <counter> <key>`: every row of the key is deleted.
    Forget { counter: u16, key: Key<'a> },
    /// `!forget * <key>`: the key in every counter whose key type accepts it; as sent.
    ForgetEverywhere { key: &'a [u8] },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Flush,
    Ping,
    Sync,
    /// From now on, answer each rejected line of this connection with its reason.
    Errors,
    /// A correction was routed: answered `ok` once committed, as `!flush` is.
    Corrected,
    /// A correction was refused: answered `error <reason>` at once.
    Refused(super::Reject),
    /// A correction inside an open batch: answered `error batch_open ...` at once.
    InBatch,
}

#[derive(Debug, PartialEq, Eq)]
pub struct Event<'a> {
    pub counter: u16,
    pub key: Key<'a>,
    /// A sum counter's delta; a max, min or last counter's value; 1 for a unique counter.
    pub delta: i64,
    /// A unique counter's value, as sent (valid text); `None` for the other kinds.
    pub value: Option<&'a str>,
    /// Event time in milliseconds since the Unix epoch, if the line carried one.
    pub at_ms: Option<i64>,
}

/// 9999-12-31T23:59:59.999Z: later times are far more likely to be unit mistakes (µs, ns)
/// than real event times.
pub(crate) const MAX_TIMESTAMP_MS: u64 = 253_402_300_799_999;

#[inline]
fn is_sep(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

/// Yields the non-empty runs of non-separator bytes.
struct Fields<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Fields<'a> {
    type Item = &'a [u8];

    #[inline]
    fn next(&mut self) -> Option<&'a [u8]> {
        let start = self.rest.iter().position(|&b| !is_sep(b))?;
        let rest = &self.rest[start..];
        let end = rest.iter().position(|&b| is_sep(b)).unwrap_or(rest.len());
        let (field, tail) = rest.split_at(end);
        self.rest = tail;
        Some(field)
    }
}

#[inline]
fn is_timestamp_field(field: &[u8]) -> bool {
    field.first() == Some(&b'@')
}

pub fn parse_line<'a>(
    line: &'a [u8],
    counters: &Counters,
    limits: &Limits,
) -> Result<Line<'a>, Reject> {
    if line.len() > limits.max_line_bytes {
        return Err(Reject::TooLong);
    }
    let line = match line {
        [rest @ .., b'\r'] => rest,
        _ => line,
    };
    let mut fields = Fields { rest: line };
    let Some(name) = fields.next() else {
        return Ok(Line::Empty);
    };
    if name.first() == Some(&b'!') {
        if let Some(batch) = parse_batch(name, &mut fields, limits) {
            return Ok(Line::Batch(batch));
        }
        if let Some(correction) = parse_correction(name, &mut fields, counters, limits) {
            return Ok(Line::Correction(correction));
        }
        return parse_control(name, fields.next().is_none());
    }
    let Some(key) = fields.next() else {
        return Err(Reject::MissingKey);
    };
    let third = fields.next();
    let fourth = fields.next();
    if fields.next().is_some() {
        return Err(Reject::TooManyFields);
    }
    let Some((counter, key_type)) = counters.lookup(name) else {
        // Structure before names, as for sums: a value is never needed to tell the shape.
        return Err(match (third, fourth) {
            (Some(d), Some(t)) if is_timestamp_field(d) || !is_timestamp_field(t) => {
                Reject::TooManyFields
            }
            _ => Reject::UnknownCounter,
        });
    };
    let kind = counters.kind(counter);
    // The third field: a sum's optional delta, every other kind's required value.
    let (amount, at) = match (third, fourth) {
        (None, _) => (None, None),
        (Some(t), None) if kind == Kind::Sum && is_timestamp_field(t) => (None, Some(t)),
        (Some(t), None) if kind.numeric() && is_timestamp_field(t) => (None, Some(t)),
        (Some(d), None) => (Some(d), None),
        (Some(d), Some(t))
            if is_timestamp_field(t) && (kind == Kind::Unique || !is_timestamp_field(d)) =>
        {
            (Some(d), Some(t))
        }
        (Some(_), Some(_)) => return Err(Reject::TooManyFields),
    };
    if key.len() > limits.max_key_bytes {
        return Err(Reject::KeyTooLong);
    }
    let key = parse_key(key, key_type)?;
    let (delta, value) = match (kind, amount) {
        (Kind::Sum, None) => (1, None),
        (Kind::Sum, Some(d)) => (parse_i64(d).ok_or(Reject::BadDelta)?, None),
        (_, None) => return Err(Reject::MissingValue),
        (Kind::Unique, Some(v)) => (1, Some(parse_value(v, limits)?)),
        (_, Some(v)) => (parse_i64(v).ok_or(Reject::BadValue)?, None),
    };
    let at_ms = match at {
        None => None,
        Some(t) => Some(parse_timestamp(&t[1..]).ok_or(Reject::BadTimestamp)?),
    };
    Ok(Line::Event(Event {
        counter,
        key,
        delta,
        value,
        at_ms,
    }))
}

/// A unique counter's value: at most `max_key_bytes`, and valid as a text key is (UTF-8 without
/// control characters or Unicode whitespace), so that it is the `text` `hll_hash_text` hashes.
pub(crate) fn parse_value<'a>(value: &'a [u8], limits: &Limits) -> Result<&'a str, Reject> {
    if value.len() > limits.max_key_bytes {
        return Err(Reject::ValueTooLong);
    }
    text_key(value).map_err(|_| Reject::BadValue)
}

/// `!set` and `!forget` with their arguments; `None` for any other control word.
fn parse_correction<'a>(
    word: &[u8],
    fields: &mut Fields<'a>,
    counters: &Counters,
    limits: &Limits,
) -> Option<Result<Correction<'a>, Reject>> {
    let set = match word {
        b"!set" => true,
        b"!forget" => false,
        _ => return None,
    };
    let parsed = (|| {
        let (name, key) = match (fields.next(), fields.next()) {
            (Some(name), Some(key)) => (name, key),
            _ => return Err(Reject::MissingKey),
        };
        let value = fields.next();
        let at = fields.next();
        if fields.next().is_some() || (!set && value.is_some()) {
            return Err(Reject::TooManyFields);
        }
        if key.len() > limits.max_key_bytes {
            return Err(Reject::KeyTooLong);
        }
        if !set && name == b"*" {
            return Ok(Correction::ForgetEverywhere { key });
        }
        let (counter, key_type) = counters.lookup(name).ok_or(Reject::UnknownCounter)?;
        let key = parse_key(key, key_type)?;
        if !set {
            return Ok(Correction::Forget { counter, key });
        }
        let value = parse_i64(value.ok_or(Reject::MissingValue)?).ok_or(Reject::BadValue)?;
        let at_ms = match at {
            None => None,
            Some(t) if is_timestamp_field(t) => {
                Some(parse_timestamp(&t[1..]).ok_or(Reject::BadTimestamp)?)
            }
            Some(_) => return Err(Reject::TooManyFields),
        };
        Ok(Correction::Set {
            counter,
            key,
            value,
            at_ms,
        })
    })();
    Some(parsed)
}

/// `!batch <id>`, `!commit`, `!abort`; `None` for any other control word. An id is valid as a
/// `text` key is, and at most `max_key_bytes` long.
fn parse_batch(word: &[u8], fields: &mut Fields<'_>, limits: &Limits) -> Option<BatchControl> {
    let alone = |fields: &mut Fields<'_>| fields.next().is_none();
    match word {
        b"!commit" if alone(fields) => Some(BatchControl::Commit),
        b"!abort" if alone(fields) => Some(BatchControl::Abort),
        b"!batch" => Some(BatchControl::Open((|| {
            let id = fields.next().ok_or(BatchRefusal::MissingBatchId)?;
            if !alone(fields) {
                return Err(BatchRefusal::BadBatchId);
            }
            if id.len() > limits.max_key_bytes {
                return Err(BatchRefusal::BatchIdTooLong);
            }
            let id = super::keys::text_key(id).map_err(|_| BatchRefusal::BadBatchId)?;
            Ok(id.to_string())
        })())),
        _ => None,
    }
}

fn parse_control(word: &[u8], alone: bool) -> Result<Line<'static>, Reject> {
    if !alone {
        return Err(Reject::UnknownCommand);
    }
    let control = match word {
        b"!flush" => Control::Flush,
        b"!ping" => Control::Ping,
        b"!sync" => Control::Sync,
        b"!errors" => Control::Errors,
        _ => return Err(Reject::UnknownCommand),
    };
    Ok(Line::Control(control))
}

/// Non-empty decimal digits to `u64`; `None` on any other byte or on overflow.
#[inline]
fn parse_digits(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    let mut acc: u64 = 0;
    // 19 digits stay below u64::MAX, so the common case needs no overflow checks.
    if digits.len() <= 19 {
        for &b in digits {
            let d = b.wrapping_sub(b'0');
            if d > 9 {
                return None;
            }
            acc = acc * 10 + u64::from(d);
        }
    } else {
        for &b in digits {
            let d = b.wrapping_sub(b'0');
            if d > 9 {
                return None;
            }
            acc = acc.checked_mul(10)?.checked_add(u64::from(d))?;
        }
    }
    Some(acc)
}

/// Optional `+`/`-` then decimal digits, within `i64`.
#[inline]
pub(crate) fn parse_i64(s: &[u8]) -> Option<i64> {
    let (negative, digits) = match s {
        [b'-', rest @ ..] => (true, rest),
        [b'+', rest @ ..] => (false, rest),
        _ => (false, s),
    };
    let magnitude = parse_digits(digits)?;
    if negative {
        // i64::MIN's magnitude does not fit in i64, hence the detour through wrapping_neg.
        if magnitude > i64::MIN.unsigned_abs() {
            return None;
        }
        Some((magnitude as i64).wrapping_neg())
    } else {
        i64::try_from(magnitude).ok()
    }
}

fn parse_timestamp(digits: &[u8]) -> Option<i64> {
    let ms = parse_digits(digits)?;
    if ms > MAX_TIMESTAMP_MS {
        return None;
    }
    Some(ms as i64)
}
