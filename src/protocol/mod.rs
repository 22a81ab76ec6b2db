//! Line protocol v1: framing bytes into lines and parsing a line into an event, without allocating per line.
//!
//! A line is `<counter> <key> [<delta>] [@<unix_ms>]`, fields separated by runs of spaces or
//! tabs, or a control line (`!flush`, `!ping`, `!sync`). [`LineBuffer`] frames a byte stream
//! into lines, [`datagram_lines`] splits one datagram, and [`parse_line`] turns a line into a
//! [`Line`]. Nothing here allocates per line: text keys borrow from the input, and keys that
//! need rewriting into canonical form live in a fixed stack buffer ([`InlineKey`]).
//!
//! Decisions the grammar leaves open:
//! - Structure is checked before content: a line with the wrong shape is `MissingKey` or
//!   `TooManyFields` even if its counter is also unknown. After that, fields are checked left
//!   to right (counter, key, delta, timestamp) and the first failure is reported.
//! - The field after the delta must start with `@`; a fourth field without it, or any field
//!   after the timestamp, is `TooManyFields`.
//! - `max_line_bytes` counts every byte before the `\n`, including a `\r` of a `\r\n` ending,
//!   so the framer and the parser agree on which lines are too long.
//! - `max_key_bytes` applies to the key as sent, before canonicalisation.
//! - Text keys also reject Unicode whitespace (e.g. U+00A0, U+3000), not only ASCII
//!   separators and control characters.
//!
//! Files by job: [`keys`] (key types and canonical keys), [`parse`] (one line into a
//! [`Line`]), [`framing`] (bytes into lines), [`reject`] (why a line was rejected, shared by all three); their
//! tests in `tests.rs`.

mod framing;
mod keys;
mod parse;
mod reject;
#[cfg(test)]
mod tests;

/// A counter's kind decides what the field after the key means ([`crate::kind`] owns it).
pub use crate::kind::Kind;
pub use framing::{datagram_lines, LineBuffer};
pub use keys::{InlineKey, Key, KeyType};
pub use parse::{
    parse_line, BatchControl, BatchRefusal, Control, Correction, Counters, Event, Limits, Line,
};
pub use reject::Reject;
// For the statsd parser, which produces the same events.
pub(crate) use keys::parse_key;
pub(crate) use parse::{parse_i64, parse_value, MAX_TIMESTAMP_MS};
