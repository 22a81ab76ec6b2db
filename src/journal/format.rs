//! The journal on disk, byte for byte: a segment's header (its magic and the layout its records
//! were routed by, with a CRC), a record's header (mark, length, sequence number, CRC), and the
//! lines inside a record. A record holds the canonical lines of one read's accepted lines, in
//! the order they were taken: an event `<counter> <key> <delta or value> @<unix_ms>`
//! ([`push_line`]; a unique counter's value as its text, [`push_value_line`]) and a correction
//! `!set <counter> <key> <value> @<unix_ms>` or `!forget <counter> <key>` ([`push_set_line`],
//! [`push_forget_line`]). Replay routes a line by its counter and key ([`parse_line`]) and
//! parses it again with the protocol parser.
//!
//! Record layout: `mark: 4 bytes | len: u32 | seq: u64 | crc32: u32 | len bytes of lines`,
//! little endian; the CRC covers `len`, `seq` and the lines, and the mark lets a reader find the
//! next record after a damaged one. A segment starts with a header (with its own CRC) that
//! records how keys were spread over writers when it was written.

use crate::routing::Layout;

pub(super) const MAGIC: &[u8; 8] = b"TALLYJ3\n";
/// The format before record marks and the header CRC: still read, never written.
pub(super) const MAGIC_V2: &[u8; 8] = b"TALLYJ2\n";
/// A segment rewritten under another layout ([`super::translate`]), laid out as [`MAGIC`]'s: it
/// supersedes every record of the other segments numbered below its own first record.
pub(super) const MAGIC_TRANSLATED: &[u8; 8] = b"TALLYJT\n";
/// Magic, buckets and workers per database, and the length of the shard map that follows (then
/// the map and a CRC-32 of everything before it).
pub(super) const HEADER_LEN: usize = 20;
/// Starts every record. 0xFF never occurs in the UTF-8 lines of a record, so a reader that lost
/// its place finds the next record by this mark (and confirms it by the CRC).
pub(super) const RECORD_MARK: [u8; 4] = [0xFF, 0xA5, b'T', b'R'];
pub(super) const RECORD_HEADER: usize = 20;

pub(super) fn record_header(seq: u64, lines: &[u8]) -> [u8; RECORD_HEADER] {
    let mut h = [0u8; RECORD_HEADER];
    h[0..4].copy_from_slice(&RECORD_MARK);
    h[4..8].copy_from_slice(&(lines.len() as u32).to_le_bytes());
    h[8..16].copy_from_slice(&seq.to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&h[4..16]);
    crc.update(lines);
    h[16..20].copy_from_slice(&crc.finalize().to_le_bytes());
    h
}

pub(super) fn encode_header(layout: &Layout) -> Vec<u8> {
    header(MAGIC, layout)
}

/// The header of a translated segment.
pub(super) fn encode_translated_header(layout: &Layout) -> Vec<u8> {
    header(MAGIC_TRANSLATED, layout)
}

fn header(magic: &[u8; 8], layout: &Layout) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN + 2 * layout.map.len() + 4);
    h.extend_from_slice(magic);
    h.extend_from_slice(&(layout.buckets as u32).to_le_bytes());
    h.extend_from_slice(&(layout.workers as u32).to_le_bytes());
    h.extend_from_slice(&(layout.map.len() as u32).to_le_bytes());
    for &d in &layout.map {
        h.extend_from_slice(&d.to_le_bytes());
    }
    let crc = crc32fast::hash(&h);
    h.extend_from_slice(&crc.to_le_bytes());
    h
}

/// Appends the canonical line of one accepted event to a record.
pub fn push_line(buf: &mut Vec<u8>, counter: &str, key: &str, delta: i64, at_ms: i64) {
    let mut num = itoa::Buffer::new();
    buf.extend_from_slice(counter.as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(key.as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(num.format(delta).as_bytes());
    buf.extend_from_slice(b" @");
    buf.extend_from_slice(num.format(at_ms).as_bytes());
    buf.push(b'\n');
}

/// Appends a unique counter's event as a line: `<counter> <key> <value> @<unix_ms>\n`.
pub fn push_value_line(buf: &mut Vec<u8>, counter: &str, key: &str, value: &str, at_ms: i64) {
    let mut num = itoa::Buffer::new();
    buf.extend_from_slice(counter.as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(key.as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(value.as_bytes());
    buf.extend_from_slice(b" @");
    buf.extend_from_slice(num.format(at_ms).as_bytes());
    buf.push(b'\n');
}

/// Appends a `!set` correction as a line: `!set <counter> <key> <value> @<unix_ms>\n` (with its
/// time, so that a replay sets the same window).
pub fn push_set_line(buf: &mut Vec<u8>, counter: &str, key: &str, value: i64, at_ms: i64) {
    buf.extend_from_slice(b"!set ");
    push_line(buf, counter, key, value, at_ms);
}

/// Appends a `!forget` correction as a line: `!forget <counter> <key>\n`.
pub fn push_forget_line(buf: &mut Vec<u8>, counter: &str, key: &str) {
    buf.extend_from_slice(b"!forget ");
    buf.extend_from_slice(counter.as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(key.as_bytes());
    buf.push(b'\n');
}

/// The non-empty lines of a record, as [`push_line`] wrote them (without their `\n`).
pub fn lines(record: &[u8]) -> impl Iterator<Item = &[u8]> {
    record.split(|&b| b == b'\n').filter(|l| !l.is_empty())
}

/// The counter and key of a line written by [`push_line`], [`push_value_line`] or a correction
/// (`!set <counter> <key> ...`, `!forget <counter> <key>`): all replay needs to route it; the
/// whole line is parsed again by the protocol parser when replayed. None without a key.
pub fn parse_line(line: &[u8]) -> Option<(&[u8], &[u8])> {
    let mut fields = line.splitn(4, |&b| b == b' ');
    let first = fields.next()?;
    match first.first() {
        Some(b'!') => Some((fields.next()?, fields.next()?)),
        _ => Some((first, fields.next()?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_read_back_as_written() {
        let mut record = Vec::new();
        push_line(&mut record, "page_views", "/a/b", -3, 1_700_000_000_000);
        push_line(&mut record, "c", "k", 1, 5);
        assert_eq!(record, b"page_views /a/b -3 @1700000000000\nc k 1 @5\n");
        let read: Vec<_> = lines(&record).map(parse_line).collect();
        assert_eq!(
            read,
            vec![
                Some((&b"page_views"[..], &b"/a/b"[..])),
                Some((&b"c"[..], &b"k"[..]))
            ]
        );
        assert_eq!(parse_line(b"lonely"), None);
        assert_eq!(parse_line(b"!set c k 5 @9"), Some((&b"c"[..], &b"k"[..])));
        assert_eq!(parse_line(b"!forget c k"), Some((&b"c"[..], &b"k"[..])));
        let mut corrections = Vec::new();
        push_set_line(&mut corrections, "c", "k", -5, 9);
        push_forget_line(&mut corrections, "c", "k");
        assert_eq!(corrections, b"!set c k -5 @9\n!forget c k\n");
        let read: Vec<_> = lines(&corrections).map(parse_line).collect();
        assert_eq!(read, vec![Some((&b"c"[..], &b"k"[..])); 2]);
    }
}
